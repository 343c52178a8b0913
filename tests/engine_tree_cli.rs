//! An EAGLE engine's default tree on the tiny Llama: `spec-build --eagle_choices` validates
//! the tree against the engine's limits and writes it beside the plan, and spec-run drafts it
//! when given no tree (the same steps and drafts as passing it, plain decoding's output).
//! Trees that do not fit, or a tree for an engine that does not draft, are refused with one
//! exact line and no engine written.

mod common;

use common::{
    build_eagle_ok, one_line_error, s, spec_build, spec_run, spec_run_ids, stderr, stdout,
    tiny_checkpoint, tiny_eagle, tiny_request,
};
use kestrel_core::plan::EAGLE_CHOICES_FILE;
use std::path::{Path, PathBuf};

const TREE: &str = "[[0],[1],[0,0]]";

/// spec-run on "a b c hello" for 16 tokens with `extra` flags: the output ids and the first
/// output's (steps, draft tokens).
fn run(engine: &Path, json: &Path, extra: &[&str]) -> (Vec<Vec<u32>>, (u64, u64)) {
    let ids = spec_run_ids(&tiny_request(engine, extra), json);
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let stats = &doc["outputs"][0]["stats"];
    let steps = stats["steps"].as_u64().unwrap();
    let drafts = stats["draft_tokens"].as_u64().unwrap();
    (ids, (steps, drafts))
}

/// The tiny Llama with the tiny EAGLE head, built in `w` with the default tree `choices`.
fn eagle_engine(w: &Path, choices: &str) -> PathBuf {
    let ckpt = tiny_checkpoint(w, &["--eagle_model_dir", s(&tiny_eagle())]);
    let engine = w.join("engine");
    build_eagle_ok(&ckpt, &engine, &["--eagle_choices", choices]);
    engine
}

#[test]
fn the_engine_default_tree_is_drafted_when_no_tree_is_given() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    // Unsorted and spaced: the engine keeps the validated paths in node order.
    let engine = eagle_engine(w, "[[0, 0], [1], [0]]");
    assert_eq!(
        std::fs::read_to_string(engine.join(EAGLE_CHOICES_FILE)).unwrap(),
        TREE
    );

    let json = w.join("out.json");
    let (plain, _) = run(&engine, &json, &["--no_speculation"]);
    let (default, default_stats) = run(&engine, &json, &[]);
    let (given, given_stats) = run(&engine, &json, &["--eagle_choices", TREE]);
    let (mc_sim, mc_sim_stats) = run(&engine, &json, &["--eagle_choices", "mc_sim_7b_63"]);
    assert_eq!(plain[0].len(), 16, "{plain:?}");
    for out in [&default, &given, &mc_sim] {
        assert_eq!(out, &plain);
    }
    assert_eq!(default_stats, given_stats);
    // Every step drafts the whole tree: 3 nodes against mc_sim_7b_63's 63.
    assert_eq!(default_stats.1, 3 * default_stats.0, "{default_stats:?}");
    assert_ne!(default_stats, mc_sim_stats);
}

#[test]
fn a_default_tree_that_cannot_run_is_refused_at_build_time() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let eagle_ckpt = tiny_checkpoint(&w.join("e"), &["--eagle_model_dir", s(&tiny_eagle())]);
    let plain_ckpt = tiny_checkpoint(&w.join("p"), &[]);
    let engine = w.join("engine");
    let cases: [(&Path, &[&str], String); 3] = [
        (
            &eagle_ckpt,
            &["--speculative_decoding_mode", "eagle", "--eagle_choices", "[[0],[0,0],[0,0,0],[0,0,0,0],[0,0,0,0,0]]"],
            "--eagle_choices: eagle_choices path [0, 0, 0, 0, 0] has depth 5, deeper than num_eagle_layers = 4: the engine drafts at most 4 levels".to_string(),
        ),
        (
            &eagle_ckpt,
            &["--speculative_decoding_mode", "eagle", "--eagle_choices", "nosuch"],
            "--eagle_choices: unknown eagle_choices preset \"nosuch\": known presets are mc_sim_7b_63, eagle_mc_sim_7b_63, chain_4, small_8".to_string(),
        ),
        (
            &plain_ckpt,
            &["--eagle_choices", "[[0]]"],
            "--eagle_choices needs --speculative_decoding_mode eagle (this build is none): only EAGLE engines draft trees".to_string(),
        ),
    ];
    for (ckpt, flags, want) in cases {
        let mut args = vec!["--checkpoint_dir", s(ckpt), "--output_dir", s(&engine)];
        args.extend_from_slice(flags);
        let out = spec_build(&args);
        assert_eq!(one_line_error("spec-build", &out), want, "{flags:?}");
        assert!(!engine.exists(), "{flags:?} left an engine behind");
    }
}

#[test]
fn the_profile_reports_the_share_of_draft_tokens_accepted() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let engine = eagle_engine(w, TREE);
    let json = w.join("out.json");
    let profile = |extra: &[&str]| {
        let mut args = tiny_request(&engine, extra);
        args.extend(["--run_profiling", "--output_json", s(&json)]);
        let out = spec_run(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let line = stdout(&out)
            .lines()
            .find(|l| l.starts_with("[profile] generated "))
            .expect("a profile line")
            .to_string();
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let stats = &doc["outputs"][0]["stats"];
        let count = |k: &str| stats[k].as_u64().unwrap();
        (line, count("draft_tokens"), count("accepted_draft_tokens"))
    };
    let (line, drafted, accepted) = profile(&[]);
    assert!(drafted > 0);
    let share = format!(
        "tokens per step ({accepted} of {drafted} draft tokens accepted, {:.0}%);",
        100.0 * accepted as f64 / drafted as f64
    );
    assert!(line.contains(&share), "{line} lacks {share}");
    let (line, drafted, _) = profile(&["--no_speculation"]);
    assert_eq!(drafted, 0);
    assert!(line.contains("tokens per step; draft "), "{line}");
}

#[test]
fn several_prompts_on_a_cpu_get_a_note_on_the_batch_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let engine = eagle_engine(w, TREE);
    let prompts = w.join("prompts.json");
    std::fs::write(&prompts, r#"["a b c", "hello a"]"#).unwrap();
    let one = w.join("one.json");
    std::fs::write(&one, r#"["a b c"]"#).unwrap();
    let note_for = |file: &Path, extra: &[&str]| {
        let mut args = vec!["--engine_dir", s(&engine), "--input_file", s(file)];
        args.extend(["--max_output_len", "4"]);
        args.extend_from_slice(extra);
        let out = spec_run(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        stderr(&out).contains(
            "--speculative_disable_by_batch_size 1 speculates only while one sequence decodes",
        )
    };
    assert!(note_for(&prompts, &[]));
    assert!(!note_for(
        &prompts,
        &["--speculative_disable_by_batch_size", "1"]
    ));
    assert!(!note_for(&prompts, &["--no_speculation"]));
    assert!(!note_for(&one, &[]));
}

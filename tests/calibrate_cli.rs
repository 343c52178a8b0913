//! `spec-train calibrate` end to end on the tiny EAGLE engine: the tree it writes is one
//! `spec-run --eagle_choices` takes, with output identical to plain greedy decoding, and so
//! is the one re-derived from its statistics for step costs; bad flags are refused with one
//! clear line and exit status 1, leaving no file behind.

mod common;

use common::{exec, one_line_error, s, spec_run_ids, stderr, tiny_engine_with, TRAIN};
use std::path::{Path, PathBuf};

/// The tiny Llama (vocab 16, hidden 8, 1 layer) converted with (`eagle`) or without its tiny
/// EAGLE head and built into `<dir>/engine` (max_draft_len 63, num_eagle_layers 4).
fn tiny_engine(dir: &Path, eagle: bool) -> PathBuf {
    tiny_engine_with(
        dir,
        eagle,
        &["--max_input_len", "16", "--max_seq_len", "64"],
    )
}

fn prompts_file(dir: &Path) -> PathBuf {
    let file = dir.join("prompts.json");
    std::fs::write(
        &file,
        r#"["a b c", "hello world", "d e a b", "c", "world a e"]"#,
    )
    .unwrap();
    file
}

fn calibrate(engine: &Path, prompts: &Path, output: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "calibrate",
        "--engine_dir",
        s(engine),
        "--prompts",
        s(prompts),
        "--no_chat",
        "--max_output_len",
        "24",
        "--output",
        s(output),
    ];
    args.extend_from_slice(extra);
    exec(TRAIN, &args)
}

/// `calibrate --from_stats stats`: a tree re-derived from earlier statistics, no prompts.
fn rederive(engine: &Path, stats: &Path, output: &Path, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "calibrate",
        "--engine_dir",
        s(engine),
        "--from_stats",
        s(stats),
        "--output",
        s(output),
    ];
    args.extend_from_slice(extra);
    exec(TRAIN, &args)
}

#[test]
fn calibrated_tree_runs_in_spec_run_with_plain_greedy_output() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path(), true);
    let prompts = prompts_file(tmp.path());
    let trees = tmp.path().join("trees");
    let tree = trees.join("tiny.json");
    let out = calibrate(&engine, &prompts, &tree, &["--num_nodes", "12"]);
    assert!(out.status.success(), "calibrate failed: {}", stderr(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains(&format!("wrote {}", tree.display())),
        "{stdout}"
    );
    assert!(stdout.contains("mc_sim_7b_63"), "{stdout}");

    // The tree: an eagle_choices list of rank paths within the budget and the engine.
    let choices: Vec<Vec<usize>> =
        serde_json::from_str(&std::fs::read_to_string(&tree).unwrap()).unwrap();
    assert!(!choices.is_empty() && choices.len() <= 12, "{choices:?}");
    assert!(choices
        .iter()
        .all(|p| !p.is_empty() && p.len() <= 4 && p.iter().all(|&r| r < 10)));

    // The statistics beside it.
    let stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trees.join("tiny.stats.json")).unwrap())
            .unwrap();
    assert_eq!(stats["format"], "kestrel-eagle-calibration");
    assert!(stats["positions"].as_u64().unwrap() > 0);
    let p = stats["p"].as_array().unwrap();
    assert_eq!(
        p.len(),
        4,
        "depths measured = the engine's num_eagle_layers"
    );
    assert!(p.iter().all(|row| row.as_array().unwrap().len() == 10));
    assert_eq!(
        stats["tree"]["nodes"].as_u64().unwrap() as usize,
        choices.len()
    );
    let e = stats["tree"]["expected_length"].as_f64().unwrap();
    assert!(e >= 1.0, "{e}");
    // No preset of at most 12 nodes is expected to do better than the derived tree.
    for preset in stats["presets"].as_array().unwrap() {
        if let Some(pe) = preset["expected_length"].as_f64() {
            if preset["nodes"].as_u64().unwrap() <= 12 {
                assert!(pe <= e + 1e-9, "{preset} beats the derived tree ({e})");
            }
        }
    }
    // Nothing else was left in the output folder.
    let mut names: Vec<String> = std::fs::read_dir(&trees)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["tiny.json", "tiny.stats.json"]);

    // spec-run takes the file, and its greedy output is plain greedy decoding's.
    let run = |extra: &[&str], json: &Path| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--input_text",
            "a b c",
            "--input_text",
            "hello world",
            "--input_text",
            "e d",
            "--max_output_len",
            "24",
        ];
        args.extend_from_slice(extra);
        spec_run_ids::<serde_json::Value>(&args, json)
    };
    let eagle = run(
        &["--eagle_choices", s(&tree)],
        &tmp.path().join("eagle.json"),
    );
    let plain = run(&["--no_speculation"], &tmp.path().join("plain.json"));
    assert_eq!(eagle.len(), 3);
    assert_eq!(eagle, plain);

    // Re-derived from those statistics (no prompts, nothing measured) for step costs where a
    // second draft level costs 5 plain steps: a one-level tree, with its expected speedup.
    let fast = trees.join("fast.json");
    let out = rederive(
        &engine,
        &trees.join("tiny.stats.json"),
        &fast,
        &["--step_costs", "0.3,5,0.01"],
    );
    assert!(
        out.status.success(),
        "calibrate --from_stats: {}",
        stderr(&out)
    );
    let flat: Vec<Vec<usize>> =
        serde_json::from_str(&std::fs::read_to_string(&fast).unwrap()).unwrap();
    assert!(
        !flat.is_empty() && flat.iter().all(|p| p.len() == 1),
        "{flat:?}"
    );
    let fast_stats: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(trees.join("fast.stats.json")).unwrap())
            .unwrap();
    assert_eq!(fast_stats["p"], stats["p"]);
    assert_eq!(fast_stats["step_costs"]["level"], 5.0);
    let speedup = fast_stats["tree"]["expected_speedup"].as_f64().unwrap();
    let e = fast_stats["tree"]["expected_length"].as_f64().unwrap();
    assert!((speedup - e / (1.3 + 0.01 * flat.len() as f64)).abs() < 1e-9);
    let eagle = run(
        &["--eagle_choices", s(&fast)],
        &tmp.path().join("fast_run.json"),
    );
    assert_eq!(eagle, plain);
}

#[test]
fn calibrate_refuses_bad_flags_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path(), true);
    let prompts = prompts_file(tmp.path());
    let tree = tmp.path().join("tree.json");
    let error = |output: &Path, extra: &[&str]| {
        let msg = one_line_error("spec-train", &calibrate(&engine, &prompts, output, extra));
        assert!(!output.exists(), "a refused run wrote {}", output.display());
        msg
    };
    assert_eq!(
        error(&tree, &["--num_nodes", "0"]),
        "--num_nodes 0: the tree needs at least one node (--num_nodes 1 or more)"
    );
    assert_eq!(
        error(&tree, &["--num_nodes", "64"]),
        "--num_nodes 64 exceeds the engine's max_draft_len = 63: a tree has at most 63 draft nodes (pass --num_nodes 63 or less, or rebuild the engine with a larger spec-build --max_draft_len)"
    );
    assert_eq!(
        error(&tree, &["--max_depth", "5"]),
        "--max_depth 5 exceeds the engine's num_eagle_layers = 4: the engine drafts at most 4 levels (pass --max_depth 4 or less, or convert the checkpoint with a larger --num_eagle_layers)"
    );
    assert_eq!(
        error(&tree, &["--top_k", "11"]),
        "--top_k 11 exceeds max_top_k = 10: eagle_choices ranks must be below 10 (spec-run drafts from the head's top 10)"
    );
    assert_eq!(
        error(&tree, &["--stats_output", s(&tree)]),
        format!(
            "--stats_output {} is the --output file: give the statistics another name",
            tree.display()
        )
    );
    let txt = tmp.path().join("tree.txt");
    assert_eq!(
        error(&txt, &[]),
        format!(
            "--output {}: must end in .json (spec-run --eagle_choices reads other names as preset names)",
            txt.display()
        )
    );

    assert_eq!(
        error(&tree, &["--step_costs", "0.3,0.3"]),
        "--step_costs 0.3,0.3: expected FIXED,LEVEL,NODE, three non-negative numbers in plain decode steps (e.g. 0.33,0.32,0.02)"
    );
    let not_stats = tmp.path().join("not_stats.json");
    std::fs::write(&not_stats, "[[0]]").unwrap();
    let out = rederive(&engine, &not_stats, &tree, &[]);
    let msg = one_line_error("spec-train", &out);
    assert!(
        msg.starts_with(&format!(
            "{}: not a calibration statistics file",
            not_stats.display()
        )),
        "{msg}"
    );
    assert!(!tree.exists());

    let plain_dir = tmp.path().join("plain");
    let plain = tiny_engine(&plain_dir, false);
    let msg = one_line_error("spec-train", &calibrate(&plain, &prompts, &tree, &[]));
    assert_eq!(
        msg,
        format!(
            "{} has no EAGLE head: calibrate an engine built with spec-build --speculative_decoding_mode eagle",
            plain.display()
        )
    );
    assert!(!tree.exists());
}

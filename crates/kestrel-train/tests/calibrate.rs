//! Tree calibration on tiny EAGLE engines (CPU, seconds): the measured ranks are the ones
//! spec-run's drafter meets, an agreeing head calibrates to a confident tree, a random head
//! to a worse one.

#[path = "../../kestrel-runtime/tests/support/mod.rs"]
mod support;

use candle_core::Device;
use kestrel_runtime::{
    generate, Acceptance, DecodeMode, EagleOptions, EagleTreeKind, Engine, GenerationParams, NoSink,
};
use kestrel_spec::{EagleTree, SamplingParams};
use kestrel_train::calibrate::{
    default_stats_path, derive, engine_tree_limits, expected_length, load_report, measure,
    measure_ranks, save, BudgetFlags, CalibrationReport, CalibrationSource, RankTable, TreeBudget,
};
use kestrel_train::distill::{distill, DistillOptions};
use kestrel_train::step_cost::StepCosts;
use std::collections::HashSet;
use support::{agreeing_pair, build, prompts, random_head, seeded_uniform, EngineSpec};

const ANSWER: usize = 40;

fn greedy_opts() -> DistillOptions {
    DistillOptions {
        num_prompts: usize::MAX,
        max_prompt_len: usize::MAX,
        max_new_tokens: ANSWER,
        chat: false,
        sampling: SamplingParams::greedy(),
    }
}

/// An engine with `head` on the agreeing pair's base model.
fn engine(dir: &std::path::Path, agreeing: bool) -> Engine {
    let (cfg, base, good) = agreeing_pair(11);
    let head = if agreeing { good } else { random_head(&cfg, 6) };
    let engine_dir = build(dir, &cfg, &base, Some(&head), &EngineSpec::default());
    Engine::load(&engine_dir, &Device::Cpu).unwrap()
}

/// A random head that also reads base layers 0 and 1 of a 3-layer base, through a random
/// `fuse`.
fn fused_engine(dir: &std::path::Path) -> Engine {
    let cfg = support::tiny_config(3);
    let h = cfg.hidden_size;
    let base = kestrel_model::llama::random_tensors(&cfg, 5).unwrap();
    let mut head = random_head(&cfg, 6);
    head.insert("fuse.weight".into(), seeded_uniform(7, (h, 3 * h), 0.2));
    let spec = EngineSpec {
        feature_layers: vec![0, 1],
        ..EngineSpec::default()
    };
    let engine_dir = build(dir, &cfg, &base, Some(&head), &spec);
    Engine::load(&engine_dir, &Device::Cpu).unwrap()
}

fn answers(engine: &Engine) -> Vec<(Vec<u32>, usize)> {
    distill(engine, &prompts(), &greedy_opts(), &mut |_, _| {}).unwrap()
}

/// A calibration's table, derived tree and report (the longest tree for `num_nodes`), and
/// its budget.
struct Calibrated {
    table: RankTable,
    choices: Vec<Vec<usize>>,
    report: CalibrationReport,
    budget: TreeBudget,
}

fn calibrate(engine: &Engine, num_nodes: usize) -> Calibrated {
    let seqs = answers(engine);
    let limits = engine_tree_limits(&engine.plan.limits);
    let flags = BudgetFlags {
        num_nodes: Some(num_nodes),
        ..BudgetFlags::default()
    };
    let budget = TreeBudget::resolve(&flags, &limits).unwrap();
    let head = engine.eagle.as_ref().unwrap();
    let table = measure(
        &engine.model,
        head,
        &seqs,
        budget.top_k,
        budget.max_depth,
        4,
        &mut |_, _| {},
    )
    .unwrap();
    let (choices, report) = derive(
        &table,
        &budget,
        &limits,
        CalibrationSource::default(),
        "t",
        None,
    )
    .unwrap();
    assert!(EagleTree::new(&choices, &limits).is_ok());
    assert_eq!(report.tree.nodes, choices.len());
    Calibrated {
        table,
        choices,
        report,
        budget,
    }
}

#[test]
fn an_agreeing_head_calibrates_to_a_confident_tree_and_beats_a_random_head() {
    let dir = tempfile::tempdir().unwrap();
    let good = engine(&dir.path().join("good"), true);
    let Calibrated {
        table,
        choices,
        report,
        ..
    } = calibrate(&good, 16);
    let e_good = report.tree.expected_length.unwrap();
    let p = table.probs();
    // Every answer position is measured at depth 1; fewer at deeper depths near the end.
    let seqs = answers(&good);
    let answer_positions: u64 = seqs
        .iter()
        .map(|(t, n)| (t.len() - n).saturating_sub(1) as u64)
        .sum();
    assert_eq!(table.positions(), answer_positions);
    // Answers of one token (an immediate end id) have no position to measure.
    let measurable = seqs.iter().filter(|(t, n)| t.len() >= n + 2).count();
    assert_eq!(table.sequences, measurable);
    assert!(measurable >= 2);
    eprintln!("agreeing: p = {p:.3?}, E = {e_good:.3}, tree {choices:?}");
    assert!(table.samples.windows(2).all(|w| w[0] > w[1]));
    assert!(
        p[0][0] > 0.8,
        "p[1][0] = {:.3} with an agreeing head",
        p[0][0]
    );
    assert!(p[0][0] > p[0][1]);
    // The first node chosen is the best guess; the tree is at most 16 nodes.
    let report_first = kestrel_train::calibrate::greedy_tree(&p, 16, 10);
    assert_eq!(report_first[0].path, vec![0]);
    assert!(choices.len() <= 16 && choices.contains(&vec![0]));
    assert!(
        e_good > 2.0,
        "expected length {e_good:.3} with an agreeing head"
    );

    let bad = engine(&dir.path().join("bad"), false);
    let Calibrated { table, report, .. } = calibrate(&bad, 16);
    let e_bad = report.tree.expected_length.unwrap();
    let q = table.probs();
    eprintln!("random: p = {q:.3?}, E = {e_bad:.3}");
    assert!(
        q[0][0] < p[0][0],
        "random {:.3} vs agreeing {:.3}",
        q[0][0],
        p[0][0]
    );
    assert!(
        e_bad < e_good,
        "random head {e_bad:.3} vs agreeing head {e_good:.3}"
    );
}

#[test]
fn saved_statistics_give_back_their_table_and_trees_for_step_costs() {
    let dir = tempfile::tempdir().unwrap();
    let good = engine(&dir.path().join("good"), true);
    let cal = calibrate(&good, 16);
    let (table, budget) = (&cal.table, &cal.budget);
    let limits = engine_tree_limits(&good.plan.limits);
    let out = dir.path().join("tree.json");
    let stats = default_stats_path(&out);
    save(&out, &stats, &cal.choices, &cal.report).unwrap();
    let loaded = load_report(&stats).unwrap();
    assert_eq!(loaded, cal.report);
    assert_eq!(&RankTable::from_report(&loaded).unwrap(), table);

    // Levels dearer than any second-level node is likely: a one-level tree, scored.
    let costs = StepCosts::parse("--step_costs", "0.3,5,0.01").unwrap();
    let (flat, r) = derive(
        table,
        budget,
        &limits,
        CalibrationSource::default(),
        "f",
        Some(&costs),
    )
    .unwrap();
    assert!(
        !flat.is_empty() && flat.iter().all(|path| path.len() == 1),
        "{flat:?}"
    );
    assert_eq!(r.step_costs, Some(costs));
    let e = r.tree.expected_length.unwrap();
    let speedup = r.tree.expected_speedup.unwrap();
    assert!((speedup - e / (1.3 + 0.01 * flat.len() as f64)).abs() < 1e-12);
    // No other tree of the same statistics scores better under these costs.
    for preset in &r.presets {
        if let Some(s) = preset.expected_speedup {
            assert!(s <= speedup, "{} scores {s:.3} > {speedup:.3}", preset.name);
        }
    }

    // Not a statistics file: a clear error naming it.
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "[[0]]").unwrap();
    let err = load_report(&bad).unwrap_err().to_string();
    assert!(
        err.starts_with(&format!(
            "{}: not a calibration statistics file",
            bad.display()
        )),
        "{err}"
    );
}

/// The accepted length at one root under greedy token matching: the longest prefix of the
/// true tokens' ranks that is a path of the tree.
fn accepted(ranks: &[Option<usize>], tree: &HashSet<Vec<usize>>) -> usize {
    let mut path = Vec::new();
    for r in ranks {
        match r {
            Some(r) if tree.contains(&[path.as_slice(), &[*r]].concat()) => path.push(*r),
            _ => break,
        }
    }
    path.len()
}

#[test]
fn measured_ranks_predict_spec_runs_steps_exactly() {
    // Teacher forcing must see exactly what spec-run's drafter sees along a right path:
    // then the ranks alone replay EAGLE decoding step for step, for any static tree.
    let dir = tempfile::tempdir().unwrap();
    let engines = [
        ("agreeing", engine(&dir.path().join("agreeing"), true)),
        ("random", engine(&dir.path().join("random"), false)),
        ("fused", fused_engine(&dir.path().join("fused"))),
    ];
    for (name, engine) in engines {
        let seqs = answers(&engine);
        let head = engine.eagle.as_ref().unwrap();
        let ranks = measure_ranks(&engine.model, head, &seqs, 10, 4, 3, &mut |_, _| {}).unwrap();
        let limits = engine_tree_limits(&engine.plan.limits);
        for preset in ["small_8", "mc_sim_7b_63", "chain_4"] {
            let tree = EagleTree::from_preset(preset, &limits).unwrap();
            let paths: HashSet<Vec<usize>> = tree.choices().iter().cloned().collect();
            let mode = DecodeMode::Eagle(EagleOptions {
                tree: EagleTreeKind::Static(tree.clone()),
                acceptance: Acceptance::TokenMatch,
                draft_vocab: None,
                lookup: None,
                disable_by_batch_size: None,
            });
            let params = GenerationParams {
                max_output_len: ANSWER,
                sampling: SamplingParams::greedy(),
                end_ids: engine.config.eos_token_ids(),
            };
            for ((tokens, prompt_len), roots) in seqs.iter().zip(&ranks) {
                // One prompt per call: the prompt's prefill is then the same computation as
                // calibration's.
                let prompt = vec![tokens[..*prompt_len].to_vec()];
                let (out, _) = generate(&engine, &mode, &prompt, &params, &mut NoSink).unwrap();
                assert_eq!(&out[0].output_ids[..], &tokens[*prompt_len..]);
                let mut steps = 0;
                let mut root = *prompt_len;
                while root + 1 < tokens.len() {
                    steps += 1;
                    root += accepted(&roots[root - prompt_len], &paths) + 1;
                }
                assert_eq!(
                    out[0].stats.steps, steps,
                    "{preset}, {name} head: spec-run's steps differ from the replay"
                );
            }
        }
    }
}

#[test]
fn expected_length_of_a_chain_is_the_running_product() {
    let p = vec![vec![0.5, 0.1], vec![0.4, 0.1], vec![0.5, 0.0]];
    let chain = vec![vec![0], vec![0, 0], vec![0, 0, 0]];
    let e = expected_length(&p, &chain).unwrap();
    assert!((e - (1.0 + 0.5 + 0.2 + 0.1)).abs() < 1e-12);
    assert_eq!(expected_length(&p, &[vec![0, 0, 0, 0]]), None);
}

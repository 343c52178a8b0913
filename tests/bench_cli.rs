//! spec-bench end to end on CPU: the batch sweep over a tiny engine (one JSON entry per mode
//! and batch size, greedy output equal across batch sizes and modes), random weights of a
//! real shape (plain and verify:T), and bad input refused in one line with exit status 1.

mod common;

use common::{exec, one_line_error, s, stderr, stdout, tiny_engine_with};
use serde_json::Value;
use std::path::{Path, PathBuf};

const BENCH: &str = env!("CARGO_BIN_EXE_spec-bench");

/// The tiny Llama (vocab 16, 1 layer), optionally with its tiny EAGLE head, as an engine.
fn tiny_engine(dir: &Path, eagle: bool) -> PathBuf {
    tiny_engine_with(
        dir,
        eagle,
        &[
            "--max_input_len",
            "16",
            "--max_seq_len",
            "64",
            "--max_batch_size",
            "4",
        ],
    )
}

fn prompts(dir: &Path) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    std::fs::write(
        &path,
        "{\"turns\": [\"a b c\"]}\n{\"turns\": [\"hello world\"]}\n{\"turns\": [\"e d\"]}\n",
    )
    .unwrap();
    path
}

/// A temporary folder holding the tiny EAGLE engine and the prompts, with where a report
/// goes: `(folder, engine, prompts, report)`.
fn eagle_bench() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path(), true);
    let prompts = prompts(tmp.path());
    let json = tmp.path().join("bench.json");
    (tmp, engine, prompts, json)
}

/// Runs spec-bench, which must succeed; returns its JSON report.
fn bench_ok(args: &[&str], json: &Path) -> Value {
    let mut all = args.to_vec();
    // A small copy keeps the bandwidth measurement quick; a few MiB still measure something.
    all.extend(["--copy_bytes", "8388608", "--output_json", s(json)]);
    let out = exec(BENCH, &all);
    assert!(out.status.success(), "spec-bench {all:?}: {}", stderr(&out));
    assert!(stdout(&out).starts_with("spec-bench: "), "{}", stdout(&out));
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

fn results(report: &Value) -> &Vec<Value> {
    report["results"].as_array().unwrap()
}

/// Figures every result carries, whatever the mode.
fn check_common(report: &Value) {
    assert!(report["copy_bandwidth_bytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(report["weight_bytes"].as_u64().unwrap() > 0);
    assert!(report["kv_bytes_per_token"].as_u64().unwrap() > 0);
    assert!(!report["device_name"].as_str().unwrap().is_empty());
    assert!(
        report["memory_after_load_bytes"].as_u64().is_some(),
        "{report}"
    );
    for r in results(report) {
        assert!(r["step_latency_ms"].as_f64().unwrap() > 0.0, "{r}");
        let roof = r["roofline_fraction"].as_f64().unwrap();
        assert!(roof > 0.0 && roof.is_finite(), "{r}");
        assert!(r["bytes_per_step"].as_f64().unwrap() > 0.0, "{r}");
        let peak = r["peak_memory_bytes"].as_u64().unwrap() as f64;
        let needed = (report["weight_bytes"].as_u64().unwrap()
            + r["kv_in_use_bytes"].as_u64().unwrap()) as f64;
        let over = r["memory_overhead_fraction"].as_f64().unwrap();
        assert!((over - (peak / needed - 1.0)).abs() < 1e-9, "{r}");
        assert!(
            r["kv_allocated_bytes"].as_u64().unwrap() >= r["kv_in_use_bytes"].as_u64().unwrap()
        );
    }
}

#[test]
fn batch_sweep_writes_one_entry_per_mode_and_batch_size() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path(), true);
    let json = tmp.path().join("bench.json");
    let report = bench_ok(
        &[
            "--engine_dir",
            s(&engine),
            "--prompts",
            s(&prompts(tmp.path())),
            "--num_prompts",
            "3",
            "--max_output_len",
            "12",
            "--batch_sizes",
            "1,2",
            "--modes",
            "plain,eagle1:[[0],[0,0],[1]],eagle2:2,prompt_lookup:3:2,verify:4,eagle1:[[0],[0,0],[1]]+prompt_lookup:3:2,eagle2:2+prompt_lookup:2",
        ],
        &json,
    );
    check_common(&report);
    let rs = results(&report);
    let keys: Vec<(String, u64)> = rs
        .iter()
        .map(|r| {
            (
                r["mode"].as_str().unwrap().to_string(),
                r["batch_size"].as_u64().unwrap(),
            )
        })
        .collect();
    let mut want = Vec::new();
    for b in [1, 2] {
        for m in [
            "plain",
            "eagle1:[[0],[0,0],[1]]",
            "eagle2:2",
            "prompt_lookup:3:2",
            "verify:4",
            "eagle1:[[0],[0,0],[1]]+prompt_lookup:3:2",
            "eagle2:2+prompt_lookup:2",
        ] {
            want.push((m.to_string(), b));
        }
    }
    assert_eq!(keys, want);
    // Programmatic dependent launch exists on CUDA only.
    assert_eq!(report["dependent_launch"], false);
    let digest_of = |mode: &str, batch: u64| {
        rs.iter()
            .find(|r| r["mode"] == mode && r["batch_size"] == batch)
            .map(|r| r["output_digest"].clone())
            .unwrap()
    };
    for r in rs {
        let mode = r["mode"].as_str().unwrap();
        let batch = r["batch_size"].as_u64().unwrap();
        if mode.starts_with("verify") {
            let v = &r["verify"];
            assert_eq!(v["tree_tokens"], 4);
            assert!(v["ratio"].as_f64().unwrap() > 0.0);
            assert!(r["mean_accepted_len"].is_null());
            assert!(r["output_digest"].is_null());
            continue;
        }
        // Same outputs, same digest: 16 hex digits, equal to plain decoding's at this batch
        // size, and different across batch sizes (4 requests at batch 2, 3 at batch 1).
        let digest = r["output_digest"].as_str().unwrap();
        assert!(
            digest.len() == 16 && digest.bytes().all(|b| b.is_ascii_hexdigit()),
            "{r}"
        );
        assert_eq!(r["output_digest"], digest_of("plain", batch), "{r}");
        assert_ne!(digest_of("plain", 1), digest_of("plain", 2));
        // 3 prompts cycled up to a multiple of the batch size.
        assert_eq!(r["requests"], if batch == 1 { 3 } else { 4 });
        // Each mode ran once untimed first (--warmup_tokens, 8 by default).
        assert!(r["warmup_s"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["tokens_per_s"].as_f64().unwrap() > 0.0);
        assert!(r["time_to_first_token_ms"].as_f64().unwrap() > 0.0);
        let tau = r["mean_accepted_len"].as_f64().unwrap();
        if mode == "plain" {
            assert_eq!(tau, 1.0);
            assert!(r["same_output_as_plain"].is_null());
            // A step commits one token of every live sequence (the first came from the
            // prefill): alone, one step a token; two at a time, at least half as many.
            let decoded = r["generated_tokens"].as_u64().unwrap() - r["requests"].as_u64().unwrap();
            let steps = r["steps"].as_u64().unwrap();
            if batch == 1 {
                assert_eq!(steps, decoded, "{r}");
            } else {
                assert!(steps >= decoded / 2 && steps < decoded, "{r}");
            }
        } else {
            assert!(tau >= 1.0, "{r}");
            // Greedy speculation reproduces plain decoding exactly.
            assert_eq!(r["same_output_as_plain"], true, "{r}");
            assert!(r["speedup_vs_plain"].as_f64().unwrap() > 0.0);
        }
        // The CPU kernels are batch-invariant, so batch 2 decodes what batch 1 did.
        if batch == 1 {
            assert!(r["same_output_as_first_batch_size"].is_null());
        } else {
            assert_eq!(r["same_output_as_first_batch_size"], true, "{r}");
        }
    }
}

#[test]
fn the_draft_vocabulary_is_recorded_and_keeps_output() {
    let (_tmp, engine, prompts, json) = eagle_bench();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--prompts",
            s(&prompts),
            "--max_output_len",
            "8",
            "--batch_sizes",
            "1",
            "--modes",
            "plain,eagle1:[[0],[1]]",
        ];
        args.extend_from_slice(extra);
        let report = bench_ok(&args, &json);
        assert_eq!(results(&report)[1]["same_output_as_plain"], true);
        if extra.contains(&"--warmup_tokens") {
            assert!(results(&report).iter().all(|r| r["warmup_s"] == 0.0));
        }
        report["eagle_draft_vocab"].clone()
    };
    assert!(run(&["--warmup_tokens", "0"]).is_null());
    assert_eq!(run(&["--eagle_draft_vocab", "4"]), "the first 4 token ids");
    let counts: Vec<u64> = (0..16).collect();
    kestrel_core::draft_vocab::DraftVocabRanking::from_counts(&counts)
        .save(&engine.join(kestrel_core::draft_vocab::DRAFT_VOCAB_FILE))
        .unwrap();
    assert_eq!(
        run(&["--eagle_draft_vocab", "4"]),
        "the 4 most frequent tokens of the engine's draft_vocab.json"
    );
}

/// The target's own engine at 4 bits drafts for it: plain output, and the report names the
/// draft.
#[test]
fn a_self_draft_at_4_bits_is_recorded_and_keeps_output() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine_with(
        tmp.path(),
        false,
        &[
            "--max_input_len",
            "16",
            "--max_seq_len",
            "64",
            "--speculative_decoding_mode",
            "draft_tokens_external",
            "--max_draft_len",
            "3",
        ],
    );
    let prompts = prompts(tmp.path());
    let json = tmp.path().join("bench.json");
    let report = bench_ok(
        &[
            "--engine_dir",
            s(&engine),
            "--draft_engine_dir",
            s(&engine),
            "--draft_quantization",
            "q4",
            "--prompts",
            s(&prompts),
            "--max_output_len",
            "8",
            "--batch_sizes",
            "1",
            "--modes",
            "plain,draft_target:3",
        ],
        &json,
    );
    assert_eq!(results(&report)[1]["same_output_as_plain"], true);
    assert_eq!(
        report["draft_source"],
        format!("{} (4-bit draft)", engine.display())
    );
}

/// `--in_flight` is recorded, and static batches give every mode the tokens in-flight ones do.
#[test]
fn in_flight_or_static_batches_give_the_same_output() {
    let (_tmp, engine, prompts, json) = eagle_bench();
    let run = |on: &str| {
        let report = bench_ok(
            &[
                "--engine_dir",
                s(&engine),
                "--prompts",
                s(&prompts),
                "--num_prompts",
                "3",
                "--max_output_len",
                "12",
                "--batch_sizes",
                "2",
                "--modes",
                "plain,eagle1:[[0],[0,0],[1]],prompt_lookup:3:2",
                "--in_flight",
                on,
            ],
            &json,
        );
        assert_eq!(report["in_flight"], on == "on");
        results(&report)
            .iter()
            .map(|r| r["output_digest"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    assert_eq!(run("on"), run("off"));
}

/// `--draft_on_device` is recorded, and either way a run gives the same tokens and
/// acceptance: greedy and sampled (token matching and typical acceptance), with a draft
/// vocabulary. (The tiny head rarely agrees with its target; the runtime's EAGLE tests check
/// the drafts themselves with an agreeing one.)
#[test]
fn drafted_tokens_on_the_device_or_the_host_give_the_same_output() {
    let (_tmp, engine, prompts, json) = eagle_bench();
    let run = |on: &str, extra: &[&str]| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--prompts",
            s(&prompts),
            "--max_output_len",
            "16",
            "--batch_sizes",
            "1,3",
            "--modes",
            "eagle1:[[0],[1],[0,0],[0,1],[1,0],[0,0,0]]",
            "--eagle_draft_vocab",
            "8",
            "--draft_on_device",
            on,
        ];
        args.extend(extra);
        let report = bench_ok(&args, &json);
        assert_eq!(report["draft_on_device"], on == "on");
        results(&report)
            .iter()
            .map(|r| {
                (
                    r["output_digest"].as_str().unwrap().to_string(),
                    r["mean_accepted_len"].as_f64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    let sampled = ["--temperature", "1.2", "--random_seed", "4"];
    let typical = [
        "--temperature",
        "1.2",
        "--random_seed",
        "4",
        "--eagle_posterior_threshold",
        "0.2",
    ];
    for extra in [&[][..], &sampled, &typical] {
        let on = run("on", extra);
        assert_eq!(on.len(), 2, "{extra:?}");
        assert_eq!(run("off", extra), on, "{extra:?}");
    }
}

#[test]
fn sampled_runs_are_recorded_and_repeat_with_their_seed() {
    let (_tmp, engine, prompts, json) = eagle_bench();
    let run = |seed: &str| {
        let report = bench_ok(
            &[
                "--engine_dir",
                s(&engine),
                "--prompts",
                s(&prompts),
                "--max_output_len",
                "12",
                "--batch_sizes",
                "1",
                "--modes",
                "plain,eagle1:[[0],[1]]",
                "--temperature",
                "1.5",
                "--top_k",
                "12",
                "--random_seed",
                seed,
            ],
            &json,
        );
        let sampling = &report["sampling"];
        assert!((sampling["temperature"].as_f64().unwrap() - 1.5).abs() < 1e-6);
        assert_eq!(sampling["top_k"], 12);
        assert_eq!(sampling["seed"].as_u64().unwrap().to_string(), seed);
        // Sampling on the device and launching plain steps ahead apply to GPUs only.
        assert_eq!(report["device_sampling"], false);
        assert_eq!(report["launch_ahead"], false);
        let rs = results(&report);
        // Sampled speculation keeps the target's distribution, not plain decoding's draws:
        // no equality with plain is claimed.
        assert!(rs[1]["same_output_as_plain"].is_null(), "{}", rs[1]);
        assert!(rs[1]["mean_accepted_len"].as_f64().unwrap() >= 1.0);
        rs.iter()
            .map(|r| r["output_digest"].as_str().unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let first = run("5");
    assert_eq!(run("5"), first, "the same seed draws the same tokens");
    assert_ne!(run("6"), first, "another seed draws others");
    // EAGLE's acceptance rule is spec-run's flag, and the report says which ran.
    for (flags, named) in [
        (["--eagle_sampling", "exact"], Some("exact")),
        (["--eagle_posterior_threshold", "0.09"], None),
    ] {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--prompts",
            s(&prompts),
            "--max_output_len",
            "12",
            "--batch_sizes",
            "1",
            "--modes",
            "eagle1:[[0],[1],[0,0]],eagle2:2",
            "--temperature",
            "0.9",
        ];
        args.extend(flags);
        let report = bench_ok(&args, &json);
        assert_eq!(report["eagle_sampling"].as_str(), named);
        assert_eq!(
            report["eagle_posterior_threshold"].is_null(),
            named.is_some()
        );
        for r in results(&report) {
            assert!(r["mean_accepted_len"].as_f64().unwrap() >= 1.0, "{r}");
        }
    }
    let out = exec(
        BENCH,
        &[
            "--engine_dir",
            s(&engine),
            "--prompts",
            s(&prompts),
            "--modes",
            "eagle1",
            "--eagle_sampling",
            "maybe",
        ],
    );
    assert_eq!(
        one_line_error("spec-bench", &out),
        "unknown --eagle_sampling 'maybe': expected token_match, typical or exact"
    );
}

#[test]
fn random_weights_of_a_real_shape_run_plain_and_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("random.json");
    let report = bench_ok(
        &[
            "--random_weights",
            "smollm2-135m",
            "--dtype",
            "float32",
            "--prompt_len",
            "8",
            "--max_output_len",
            "2",
            "--num_prompts",
            "1",
            "--batch_sizes",
            "1",
            "--modes",
            "plain,verify:4",
        ],
        &json,
    );
    check_common(&report);
    assert_eq!(report["shape"], "smollm2-135m");
    assert_eq!(report["dtype"], "float32");
    assert_eq!(report["num_parameters"], 134_515_008);
    assert_eq!(report["weight_bytes"], 134_515_008u64 * 4);
    // 30 layers × K and V × 3 KV heads × head_dim 64 × 4 bytes.
    assert_eq!(report["kv_bytes_per_token"], 30 * 2 * 3 * 64 * 4);
    let rs = results(&report);
    assert_eq!(rs.len(), 2);
    assert_eq!(rs[0]["mode"], "plain");
    // No end ids: every request runs to --max_output_len.
    assert_eq!(rs[0]["generated_tokens"], 2);
    assert_eq!(rs[0]["mean_accepted_len"], 1.0);
    assert_eq!(rs[1]["mode"], "verify:4");
    assert_eq!(rs[1]["verify"]["tree_tokens"], 4);
}

/// Random weights draft for themselves through their own 4-bit copy (how a large shape's
/// self-draft is timed without its weights): plain decoding's output; without that flag
/// draft_target is refused.
#[test]
fn random_weights_draft_for_themselves_at_4_bits() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("self_draft.json");
    let report = bench_ok(
        &[
            "--random_weights",
            "tiny",
            "--prompt_len",
            "6",
            "--max_output_len",
            "12",
            "--num_prompts",
            "2",
            "--batch_sizes",
            "1,2",
            "--draft_quantization",
            "q4",
            "--modes",
            "plain,draft_target:3",
        ],
        &json,
    );
    check_common(&report);
    assert_eq!(report["draft_source"], "random:tiny (4-bit draft)");
    let rs = results(&report);
    assert_eq!(rs.len(), 4);
    for r in &rs[..] {
        if r["mode"] == "draft_target:3" {
            assert_eq!(r["same_output_as_plain"], true, "{r}");
            // The copy agrees with its model most of the time (3.3 tokens a step here).
            assert!(r["mean_accepted_len"].as_f64().unwrap() > 2.0, "{r}");
        }
    }
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--modes", "plain,draft_target:3"]),
        "--modes draft_target:3: random weights have no draft head or draft model; with --random_weights run plain and verify:T, and draft_target:K with --draft_quantization q4 or --draft_skip_layers (the model's own derived copy drafts)"
    );
}

#[test]
fn random_weights_sweep_batch_sizes_in_bfloat16() {
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("tiny.json");
    let report = bench_ok(
        &[
            "--random_weights",
            "tiny",
            "--prompt_len",
            "6",
            "--max_output_len",
            "5",
            "--num_prompts",
            "2",
            "--batch_sizes",
            "1,2",
        ],
        &json,
    );
    check_common(&report);
    assert_eq!(report["dtype"], "bfloat16");
    let modes: Vec<(&str, u64)> = results(&report)
        .iter()
        .map(|r| {
            (
                r["mode"].as_str().unwrap(),
                r["batch_size"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        modes,
        [
            ("plain", 1),
            ("verify:64", 1),
            ("plain", 2),
            ("verify:64", 2)
        ]
    );
    assert_eq!(results(&report)[2]["same_output_as_first_batch_size"], true);
}

fn bench_error(args: &[&str]) -> String {
    one_line_error("spec-bench", &exec(BENCH, args))
}

#[test]
fn bench_refuses_bad_input_in_one_line() {
    assert_eq!(
        bench_error(&["--random_weights", "llama9"]),
        "--random_weights 'llama9': unknown shape: expected one of llama2-7b, llama3-8b, smollm2-135m, tiny"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--batch_sizes", "1,x"]),
        "--batch_sizes '1,x': 'x' is not a positive integer (expected a comma-separated list such as 1,4,16)"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--batch_size", "0"]),
        "--batch_sizes '0': '0' is not a positive integer (expected a comma-separated list such as 1,4,16)"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--modes", "plain,eagle2:4"]),
        "--modes eagle2:4: random weights have no draft head or draft model; with --random_weights run plain and verify:T, and draft_target:K with --draft_quantization q4 or --draft_skip_layers (the model's own derived copy drafts)"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--modes", "verify:0"]),
        "--modes verify:0: verify needs a positive integer after ':'"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--modes", "verify:[[0,0]]"]),
        "--modes verify:[[0,0]]: eagle_choices path [0, 0] has no parent [0]: every prefix of a path must be in the tree"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--modes", "verify:no/tree.json"]),
        "--modes verify:no/tree.json: no such file (give JSON paths, a preset name or an existing JSON file)"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--dtype", "int8"]),
        "--dtype: unknown dtype 'int8': expected one of float32, float16, bfloat16"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--dependent_launch", "maybe"]),
        "--dependent_launch maybe: expected on or off"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--device_sampling", "maybe"]),
        "--device_sampling maybe: expected on or off"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--draft_on_device", "yes"]),
        "--draft_on_device yes: expected on or off"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--in_flight", "sometimes"]),
        "--in_flight sometimes: expected on or off"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--launch_ahead", "later"]),
        "--launch_ahead later: expected on or off"
    );
    assert_eq!(
        bench_error(&[
            "--engine_dir",
            "/nonexistent",
            "--modes",
            "prompt_lookup:4:3:corpus"
        ]),
        "--modes prompt_lookup:4:3:corpus needs --prompt_lookup_corpus"
    );
    assert_eq!(
        bench_error(&[
            "--engine_dir",
            "/nonexistent",
            "--modes",
            "eagle1:small_8+prompt_lookup:4:3:corpus"
        ]),
        "--modes eagle1:small_8+prompt_lookup:4:3:corpus needs --prompt_lookup_corpus"
    );
    assert_eq!(
        bench_error(&[
            "--engine_dir",
            "/nonexistent",
            "--modes",
            "prompt_lookup:4:3:all"
        ]),
        "--modes prompt_lookup:4:3:all: prompt_lookup takes K, K:N or K:N:corpus"
    );
    assert_eq!(
        bench_error(&["--random_weights", "tiny", "--top_p", "0"]),
        "top_p must be in (0, 1] (1 = disabled), got 0"
    );
    assert_eq!(
        bench_error(&[
            "--random_weights",
            "tiny",
            "--modes",
            "draft_target:2:exact"
        ]),
        "--modes draft_target:2:exact: draft_target takes K or K:logits"
    );
    assert_eq!(
        bench_error(&[]),
        "give --engine_dir DIR or --random_weights SHAPE"
    );
    assert_eq!(
        bench_error(&["--engine_dir", "x", "--random_weights", "tiny"]),
        "give either --engine_dir or --random_weights, not both"
    );
    assert_eq!(
        bench_error(&["--engine_dir", "x", "--dtype", "float32"]),
        "--dtype applies to --random_weights only: an engine's dtype is fixed when spec-build builds it"
    );
}

#[test]
fn bench_refuses_batch_sizes_beyond_the_engine_and_eagle_modes_without_a_head() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path(), false);
    let p = prompts(tmp.path());
    let base = ["--engine_dir", s(&engine), "--prompts", s(&p)];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend_from_slice(extra);
        bench_error(&a)
    };
    assert_eq!(
        with(&["--batch_sizes", "1,16"]),
        format!(
            "--batch_sizes 16: {} was built with max_batch_size 4; rebuild it with spec-build --max_batch_size 16 or leave that batch size out",
            engine.display()
        )
    );
    assert_eq!(
        with(&["--batch_sizes", "1", "--modes", "plain,eagle1"]),
        format!(
            "--modes eagle1: {} has no EAGLE head: build it with spec-build --speculative_decoding_mode eagle",
            engine.display()
        )
    );
    assert_eq!(
        with(&["--modes", "draft_target:2"]),
        "--modes draft_target:2 needs --draft_engine_dir"
    );
}

//! `spec-train draft` end to end on a tiny random 4-layer target: it makes the
//! self-distillation data, writes a 2-layer draft that convert-checkpoint and spec-build
//! take, and draft-target decoding with that draft gives exactly plain greedy's tokens; the
//! same data, gathered by `spec-train ngram-corpus`, backs prompt lookup with the same tokens.
//! Bad layer flags are refused with one exact line and exit status 1.

mod common;

use common::{one_line_error, pipeline, s, spec_run_ids, spec_train, stderr};
use kestrel_core::ModelConfig;
use kestrel_formats::candle_core::{self, Tensor};
use kestrel_model::llama::random_tensors;
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const VOCAB: usize = 64;

/// A whitespace word-level tokenizer with one word per id (`w0` … `w63`).
fn tokenizer_json() -> String {
    let vocab: Vec<String> = (0..VOCAB).map(|i| format!("\"w{i}\": {i}")).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {{"type": "WhitespaceSplit"}},
            "post_processor": null, "decoder": null,
            "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "w0"}}}}"#,
        vocab.join(", ")
    )
}

/// An HF folder of a random 4-layer Llama (no end token) with the tokenizer. Untied: a random
/// tied model's greedy token is nearly always the current one, which any draft predicts.
fn target_hf(dir: &Path) -> PathBuf {
    let cfg_json = format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": {VOCAB}, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
            "max_position_embeddings": 256, "bos_token_id": 1}}"#
    );
    let cfg: ModelConfig = serde_json::from_str(&cfg_json).unwrap();
    let src = dir.join("target-hf");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), cfg_json).unwrap();
    let tensors: HashMap<String, Tensor> = random_tensors(&cfg, 21).unwrap().into_iter().collect();
    candle_core::safetensors::save(&tensors, src.join("model.safetensors")).unwrap();
    std::fs::write(src.join("tokenizer.json"), tokenizer_json()).unwrap();
    src
}

const LIMITS: [&str; 8] = [
    "--max_batch_size",
    "4",
    "--max_input_len",
    "32",
    "--max_seq_len",
    "96",
    "--tokens_per_block",
    "8",
];

/// The target engine, built to verify external draft tokens (up to 4 per step).
fn target_engine(work: &Path) -> PathBuf {
    let src = target_hf(work);
    let mut build = LIMITS.to_vec();
    build.extend([
        "--speculative_decoding_mode",
        "draft_tokens_external",
        "--max_draft_len",
        "4",
    ]);
    pipeline(&src, &work.join("target"), &[], &build)
}

/// 16 prompts of 4 to 8 words, written as a JSON list of strings.
fn prompts_file(dir: &Path) -> PathBuf {
    let prompts: Vec<String> = (0..16)
        .map(|i| {
            (0..4 + i % 5)
                .map(|j| format!("w{}", (7 * i + 13 * j + 3) % VOCAB))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let path = dir.join("prompts.json");
    std::fs::write(&path, serde_json::to_string(&prompts).unwrap()).unwrap();
    path
}

#[test]
fn a_distilled_draft_runs_draft_target_decoding_losslessly() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let engine = target_engine(w);
    let prompts = prompts_file(w);
    let (data, draft) = (w.join("data"), w.join("draft-hf"));
    let out = spec_train(&[
        "draft",
        "--engine_dir",
        s(&engine),
        "--data_dir",
        s(&data),
        "--output_dir",
        s(&draft),
        "--prompts",
        s(&prompts),
        "--no_chat",
        "--num_prompts",
        "16",
        "--max_new_tokens",
        "24",
        "--num_layers",
        "2",
        "--epochs",
        "4",
        "--batch_size",
        "4",
        "--lr",
        "3e-3",
        "--warmup_steps",
        "2",
        "--val_fraction",
        "0.25",
        "--dtype",
        "float32",
        "--keep_best",
    ]);
    assert!(out.status.success(), "spec-train draft: {}", stderr(&out));
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "train_log.json",
    ] {
        assert!(draft.join(f).is_file(), "{f} missing from the draft folder");
    }
    // The data went where `spec-train eagle` keeps it, so either trainer can reuse it.
    assert!(data.join("meta.json").is_file());
    let log: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(draft.join("train_log.json")).unwrap())
            .unwrap();
    let epochs = log["epochs"].as_array().unwrap();
    assert_eq!(epochs.len(), 5);
    let kl = |e: &serde_json::Value| e["val"]["kl"].as_f64().unwrap();
    assert!(kl(&epochs[4]) < kl(&epochs[0]), "held-out KL: {epochs:?}");
    // --keep_best: the folder holds the epoch of the highest held-out agreement (the
    // earliest of a tie).
    let agreement = |e: &serde_json::Value| e["val"]["top1"].as_f64().unwrap();
    let best = (1..5).fold(0, |b, e| {
        if agreement(&epochs[e]) > agreement(&epochs[b]) {
            e
        } else {
            b
        }
    });
    assert_eq!(log["kept_epoch"], best, "{epochs:?}");
    assert!(log["command"].as_str().unwrap().contains("--num_layers 2"));

    // convert-checkpoint → spec-build → draft-target with the draft: plain greedy's tokens.
    let draft_engine = pipeline(&draft, &w.join("draft"), &[], &LIMITS);
    let run = |extra: &[&str], json: &Path| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--input_file",
            s(&prompts),
            "--max_output_len",
            "40",
        ];
        args.extend_from_slice(extra);
        spec_run_ids::<Vec<u32>>(&args, json)
    };
    let plain = run(&[], &w.join("plain.json"));
    assert!(plain.iter().all(|ids| ids.len() == 40));
    for cfg in ["[3,[cpu],[cpu],False]", "[4,[cpu],[cpu],True]"] {
        let json = w.join("draft-target.json");
        let spec = run(
            &[
                "--draft_engine_dir",
                s(&draft_engine),
                "--draft_target_model_config",
                cfg,
            ],
            &json,
        );
        assert_eq!(spec, plain, "draft-target {cfg} differs from plain greedy");
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let accepted: u64 = doc["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r["stats"]["accepted_draft_tokens"].as_u64().unwrap())
            .sum();
        assert!(
            accepted > 0,
            "{cfg}: the distilled draft had no token accepted"
        );
    }

    // The target's own engine as its draft, its down projections (the only ones of 64
    // inputs in this shape) read at 4 bits: still plain greedy's tokens.
    let json = w.join("self-draft.json");
    let spec = run(
        &[
            "--draft_engine_dir",
            s(&engine),
            "--draft_target_model_config",
            "[4,[cpu],[cpu],False]",
            "--draft_quantization",
            "q4",
        ],
        &json,
    );
    assert_eq!(
        spec, plain,
        "the 4-bit self-draft differs from plain greedy"
    );

    // The same self-distillation data as a prompt lookup corpus: its 16 sequences.
    let corpus = w.join("corpus.safetensors");
    let out = spec_train(&[
        "ngram-corpus",
        "--data_dir",
        s(&data),
        "--output",
        s(&corpus),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("wrote 16 sequences"),
        "{}",
        stderr(&out)
    );
    let lookup = run(
        &[
            "--prompt_lookup_config",
            "[3,2]",
            "--prompt_lookup_corpus",
            s(&corpus),
        ],
        &w.join("lookup.json"),
    );
    assert_eq!(lookup, plain, "prompt lookup with the data as corpus");
}

#[test]
fn bad_layer_flags_are_refused_with_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let engine = target_engine(w);
    let out_dir = w.join("draft-hf");
    let err = |extra: &[&str]| {
        let mut args = vec![
            "draft",
            "--engine_dir",
            s(&engine),
            "--data_dir",
            "/nonexistent/data",
            "--output_dir",
            s(&out_dir),
        ];
        args.extend_from_slice(extra);
        let msg = one_line_error("spec-train", &spec_train(&args));
        assert!(
            !out_dir.exists(),
            "a refused run left {}",
            out_dir.display()
        );
        msg
    };
    assert_eq!(
        err(&["--num_layers", "0"]),
        "--num_layers must be at least 1"
    );
    assert_eq!(
        err(&["--num_layers", "5"]),
        "--num_layers 5 exceeds the target's 4 decoder layers: a draft has at most as many layers as its target"
    );
    assert_eq!(
        err(&["--num_layers", "2", "--init_layers", "0,4"]),
        "--init_layers: layer 4 is out of range: the target's decoder layers are 0..=3"
    );
    assert_eq!(
        err(&["--num_layers", "3", "--init_layers", "0,3"]),
        "--init_layers lists 2 layers but --num_layers is 3: give one target layer per draft layer"
    );
    assert_eq!(
        err(&["--kd_temperature", "0"]),
        "--kd_temperature 0 must be positive"
    );
    assert_eq!(
        err(&["--resume"]),
        format!(
            "--resume: {} holds no draft (config.json, model.safetensors): drop --resume to start one",
            out_dir.display()
        )
    );
    assert_eq!(
        err(&[]),
        "--prompts FILE or --synthetic_prompts N is needed to generate data (ShareGPT JSON, GSM8K JSONL, ...)"
    );
}

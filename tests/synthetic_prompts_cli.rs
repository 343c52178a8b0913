//! `spec-train eagle --stage data --synthetic_prompts N`: SmolLM2-135M-Instruct writes its
//! own user prompts (Magpie) and answers them; the kept prompts are the data's prompts,
//! through the chat template, and a seed reproduces them. Misuse is one exact error line.

mod common;

use candle_core::Device;
use common::{one_line_error, s, smollm2_engine, spec_train, stderr};
use kestrel_runtime::{ChatMessage, Engine, TextCodec};
use kestrel_train::FeatureDataset;
use std::path::Path;

/// Runs the data stage with `count` synthetic prompts and `seed`; returns the kept prompts.
fn synthesize(engine: &Path, data: &Path, count: &str, seed: &str) -> Vec<String> {
    let out = spec_train(&[
        "eagle",
        "--engine_dir",
        s(engine),
        "--stage",
        "data",
        "--data_dir",
        s(data),
        "--synthetic_prompts",
        count,
        "--synthetic_prompt_len",
        "64",
        "--max_new_tokens",
        "6",
        "--seed",
        seed,
    ]);
    assert!(out.status.success(), "spec-train: {}", stderr(&out));
    let text = std::fs::read_to_string(data.join("synthetic_prompts.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn smollm2_writes_prompts_that_become_the_data_and_a_seed_repeats_them() {
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = smollm2_engine(
        tmp.path(),
        &[
            "--max_batch_size",
            "4",
            "--max_input_len",
            "128",
            "--max_seq_len",
            "160",
        ],
    );
    let prompts = synthesize(&engine_dir, &tmp.path().join("a"), "6", "3");
    assert!(
        !prompts.is_empty() && prompts.len() <= 6,
        "{} prompts kept of 6",
        prompts.len()
    );
    for p in &prompts {
        assert!(!p.trim().is_empty() && p.trim() == p, "{p:?}");
        assert!(
            !p.contains("<|im_end|>") && !p.contains("<|im_start|>"),
            "{p:?}"
        );
    }

    // Every kept prompt is one of the data's sequences: the chat-templated user turn, then
    // its answer.
    let data = FeatureDataset::load(&tmp.path().join("a")).unwrap();
    assert_eq!(data.len(), prompts.len());
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tmp.path().join("a/meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["source"]["synthetic_prompts"], prompts.len());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let codec = TextCodec::load(&engine_dir, &engine.config).unwrap();
    let template = codec.chat_template.as_ref().unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let rendered = template.render(&[ChatMessage::user(p)], true).unwrap();
        let ids = codec.encode(&rendered).unwrap();
        let seq = &data.tokens[data.offsets[i]..data.offsets[i + 1]];
        assert_eq!(data.prompt_lens[i], ids.len(), "prompt {i}");
        assert_eq!(&seq[..ids.len()], &ids[..], "prompt {i}: {p:?}");
    }

    assert_eq!(
        synthesize(&engine_dir, &tmp.path().join("b"), "6", "3"),
        prompts,
        "the same seed sampled other prompts"
    );
    assert_ne!(
        synthesize(&engine_dir, &tmp.path().join("c"), "6", "4"),
        prompts,
        "another seed sampled the same prompts"
    );
}

#[test]
fn synthetic_prompts_need_a_chat_template() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = common::tiny_engine_with(tmp.path(), false, &[]);
    let data = tmp.path().join("data");
    let err = |extra: &[&str]| {
        let mut args = vec![
            "eagle",
            "--engine_dir",
            s(&engine),
            "--stage",
            "data",
            "--data_dir",
            s(&data),
            "--synthetic_prompts",
            "2",
        ];
        args.extend_from_slice(extra);
        let msg = one_line_error("spec-train", &spec_train(&args));
        assert!(!data.exists(), "a refused run left {}", data.display());
        msg
    };
    assert_eq!(
        err(&[]),
        "synthetic prompts need the engine's chat template, and it has no chat_template.jinja"
    );
    assert_eq!(
        err(&["--no_chat"]),
        "--synthetic_prompts continues the chat template's user turn: drop --no_chat"
    );
}

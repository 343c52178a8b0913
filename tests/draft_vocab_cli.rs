//! A draft vocabulary ranking end to end on the tiny Llama: `spec-train draft-vocab` ranks
//! the self-distillation answers into a head folder, convert-checkpoint and spec-build carry
//! the file along, and spec-run drafting from its first tokens gives plain decoding's output.
//! A ranking made for another vocabulary is refused with one exact line.

mod common;

use common::{
    build_eagle_ok, convert, convert_ok, one_line_error, s, spec_run_ids, spec_train, stderr,
    tiny_checkpoint, tiny_eagle, tiny_llama, tiny_request,
};
use kestrel_core::draft_vocab::{DraftVocabRanking, DRAFT_VOCAB_FILE};
use std::path::{Path, PathBuf};

const VOCAB: usize = 16;

/// A copy of the tiny EAGLE head in `<dir>/head`.
fn head_copy(dir: &Path) -> PathBuf {
    let head = dir.join("head");
    std::fs::create_dir_all(&head).unwrap();
    for f in ["config.json", "pytorch_model.bin"] {
        std::fs::copy(tiny_eagle().join(f), head.join(f)).unwrap();
    }
    head
}

/// spec-run's output ids for "a b c hello" with `extra` flags.
fn run_ids(engine: &Path, json: &Path, extra: &[&str]) -> Vec<Vec<u32>> {
    spec_run_ids(&tiny_request(engine, extra), json)
}

#[test]
fn a_ranking_travels_from_the_data_to_the_engine_and_keeps_output() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    // Self-distillation data from the plain tiny engine.
    let plain = common::tiny_engine_with(&w.join("plain"), false, &[]);
    let prompts = w.join("prompts.json");
    std::fs::write(&prompts, r#"["a b c", "hello world", "d e a", "b b c d"]"#).unwrap();
    let data = w.join("data");
    let out = spec_train(&[
        "eagle",
        "--engine_dir",
        s(&plain),
        "--stage",
        "data",
        "--data_dir",
        s(&data),
        "--prompts",
        s(&prompts),
        "--no_chat",
        "--max_new_tokens",
        "12",
    ]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));

    let head = head_copy(w);
    let out = spec_train(&[
        "draft-vocab",
        "--data_dir",
        s(&data),
        "--output_dir",
        s(&head),
    ]);
    assert!(
        out.status.success(),
        "spec-train draft-vocab: {}",
        stderr(&out)
    );
    let ranking = DraftVocabRanking::load(&head.join(DRAFT_VOCAB_FILE), VOCAB).unwrap();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("meta.json")).unwrap()).unwrap();
    assert_eq!(
        ranking.counted_tokens,
        meta["answer_tokens"].as_u64().unwrap()
    );
    assert!(ranking.counts.windows(2).all(|c| c[0] >= c[1]));

    let ckpt = tiny_checkpoint(&w.join("e"), &["--eagle_model_dir", s(&head)]);
    let engine = w.join("e/engine");
    build_eagle_ok(&ckpt, &engine, &[]);
    let original = std::fs::read(head.join(DRAFT_VOCAB_FILE)).unwrap();
    for dir in [&ckpt, &engine] {
        assert_eq!(
            std::fs::read(dir.join(DRAFT_VOCAB_FILE)).unwrap(),
            original,
            "{} does not carry the head's ranking",
            dir.display()
        );
    }
    let json = w.join("out.json");
    let plain_ids = run_ids(&engine, &json, &["--no_speculation"]);
    let drafted = run_ids(
        &engine,
        &json,
        &[
            "--eagle_choices",
            "[[0],[1],[0,0]]",
            "--eagle_draft_vocab",
            "4",
        ],
    );
    assert_eq!(plain_ids.len(), 1);
    assert_eq!(plain_ids[0].len(), 16, "{plain_ids:?}");
    assert_eq!(drafted, plain_ids);
}

#[test]
fn a_ranking_for_another_vocabulary_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let head = head_copy(tmp.path());
    DraftVocabRanking::from_counts(&[1; VOCAB + 1])
        .save(&head.join(DRAFT_VOCAB_FILE))
        .unwrap();
    let (src, ckpt) = (tiny_llama(), tmp.path().join("ckpt"));
    let args = [
        "--model_dir",
        s(&src),
        "--eagle_model_dir",
        s(&head),
        "--output_dir",
        s(&ckpt),
    ];
    assert_eq!(
        one_line_error("convert-checkpoint", &convert(&args)),
        format!(
            "--eagle_model_dir {}: {}: ranks 17 ids with 17 counts, but the model's vocabulary has 16 tokens: it was made for another model",
            head.display(),
            head.join(DRAFT_VOCAB_FILE).display()
        )
    );
    assert!(!ckpt.exists());
    // Without the ranking, the same head converts.
    std::fs::remove_file(head.join(DRAFT_VOCAB_FILE)).unwrap();
    convert_ok(&args);
    assert!(!ckpt.join(DRAFT_VOCAB_FILE).exists());
}

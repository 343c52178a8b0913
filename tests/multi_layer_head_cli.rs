//! Heads beyond EAGLE-1's one layer over the final feature, end to end on a tiny 3-layer
//! Llama. A head that reads several base layers: `spec-train eagle --feature_layers` keeps
//! those layers' states in the cache, a head trained on a subset of them
//! (`--head_feature_layers`) is written with its `feature_layers` and `fuse`. A head of
//! stacked decoder layers: `--head_layers` grows a trained head. convert-checkpoint and
//! spec-build take both, and spec-run's EAGLE output equals plain decoding's. A layer the
//! cache does not hold, or a head asked to lose layers, is refused with one exact line.
//! `--keep_best` (and `--early_stop`) write a resumed head back unchanged when every epoch
//! makes it worse.

mod common;

use common::{
    build_ok, convert_ok, fixture, one_line_error, s, spec_run_ids, spec_train, stderr,
    TINY_TOKENIZER_JSON,
};
use std::path::{Path, PathBuf};

/// The 3-layer tiny Llama converted (with `extra` flags) and built (with `build_args`) under
/// `dir`.
fn engine(dir: &Path, extra: &[&str], build_args: &[&str]) -> PathBuf {
    let src = fixture("tiny/mqa");
    let ckpt = dir.join("ckpt");
    let mut args = vec!["--model_dir", s(&src), "--output_dir", s(&ckpt)];
    args.extend_from_slice(extra);
    convert_ok(&args);
    std::fs::write(ckpt.join("tokenizer.json"), TINY_TOKENIZER_JSON).unwrap();
    let engine = dir.join("engine");
    let mut args = vec![
        "--checkpoint_dir",
        s(&ckpt),
        "--output_dir",
        s(&engine),
        "--max_input_len",
        "64",
        "--max_seq_len",
        "128",
    ];
    args.extend_from_slice(build_args);
    build_ok(&args);
    engine
}

/// The plain tiny engine, four prompts and where their feature cache goes, under `w`.
fn plain_engine_and_prompts(w: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let plain = engine(&w.join("plain"), &[], &[]);
    let prompts = w.join("prompts.json");
    std::fs::write(&prompts, r#"["a b c", "hello world", "d e a", "b b c d"]"#).unwrap();
    (plain, prompts, w.join("data"))
}

/// `spec-train eagle` over the plain engine: answers to `prompts` (12 tokens each) cached in
/// `data`, one epoch on all of them into `output`, then `extra`.
fn train_eagle(
    plain: &Path,
    prompts: &Path,
    data: &Path,
    output: &Path,
    extra: &[&str],
) -> std::process::Output {
    let mut args = vec![
        "eagle",
        "--engine_dir",
        s(plain),
        "--data_dir",
        s(data),
        "--output_dir",
        s(output),
        "--prompts",
        s(prompts),
        "--no_chat",
        "--max_new_tokens",
        "12",
        "--epochs",
        "1",
        "--val_fraction",
        "0",
    ];
    args.extend_from_slice(extra);
    spec_train(&args)
}

#[test]
fn a_head_reading_base_layers_trains_converts_and_keeps_output() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let (plain, prompts, data) = plain_engine_and_prompts(w);
    let head = w.join("head");
    let train = |extra: &[&str]| {
        let mut args = vec!["--feature_layers", "0,1"];
        args.extend_from_slice(extra);
        train_eagle(&plain, &prompts, &data, &head, &args)
    };
    let out = train(&["--head_feature_layers", "1"]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(data.join("meta.json")).unwrap()).unwrap();
    assert_eq!(meta["feature_layers"], serde_json::json!([0, 1]));
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(head.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["feature_layers"], serde_json::json!([1]));

    let refused = train(&["--stage", "train", "--head_feature_layers", "2"]);
    assert_eq!(
        one_line_error("spec-train", &refused),
        format!(
            "{}: the feature cache holds base layers [0, 1], not layer 2: regenerate it with --feature_layers",
            data.display()
        )
    );

    assert_eagle_equals_plain(w, &head);
}

/// `head` converted with the tiny Llama into an EAGLE engine: spec-run's output with a static
/// and a dynamic tree equals plain decoding's.
fn assert_eagle_equals_plain(w: &Path, head: &Path) {
    let eagle = engine(
        &w.join("eagle"),
        &["--eagle_model_dir", s(head)],
        &["--speculative_decoding_mode", "eagle"],
    );
    let json = w.join("out.json");
    let run = |extra: &[&str]| -> Vec<Vec<u32>> {
        let mut args = vec![
            "--engine_dir",
            s(&eagle),
            "--input_text",
            "a b c hello",
            "--max_output_len",
            "16",
        ];
        args.extend_from_slice(extra);
        spec_run_ids(&args, &json)
    };
    let plain_ids = run(&["--no_speculation"]);
    assert_eq!(plain_ids[0].len(), 16, "{plain_ids:?}");
    assert_eq!(
        run(&["--eagle_choices", "[[0],[1],[0,0],[0,1]]"]),
        plain_ids
    );
    assert_eq!(
        run(&[
            "--eagle_use_dynamic_tree",
            "--eagle_dynamic_tree_max_top_k",
            "2"
        ]),
        plain_ids
    );
}

#[test]
fn a_head_grown_to_two_layers_trains_converts_and_keeps_output() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let (plain, prompts, data) = plain_engine_and_prompts(w);
    let (one, two) = (w.join("one"), w.join("two"));
    let train = |output: &Path, extra: &[&str]| train_eagle(&plain, &prompts, &data, output, extra);
    let out = train(&one, &[]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    let out = train(&two, &["--resume", s(&one), "--head_layers", "2"]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    assert!(
        stderr(&out).contains("grown from 1 to 2 layers"),
        "{}",
        stderr(&out)
    );
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["num_hidden_layers"], 2);

    let refused = train(
        &w.join("none"),
        &[
            "--stage",
            "train",
            "--resume",
            s(&two),
            "--head_layers",
            "1",
        ],
    );
    assert_eq!(
        one_line_error("spec-train", &refused),
        format!(
            "{}: the head has 2 layers, --head_layers 1 would drop some",
            two.display()
        )
    );
    assert!(!w.join("none").exists());
    let refused = train(&w.join("none"), &["--stage", "train", "--head_layers", "4"]);
    assert_eq!(
        one_line_error("spec-train", &refused),
        "--head_layers 4: a head has 1 to 3 layers (the base's)"
    );
    assert_eagle_equals_plain(w, &two);
}

#[test]
fn keep_best_writes_the_resumed_head_back_when_training_only_hurts_and_stops_early() {
    let tmp = tempfile::tempdir().unwrap();
    let w = tmp.path();
    let (plain, prompts, data) = plain_engine_and_prompts(w);
    let one = w.join("one");
    let out = train_eagle(&plain, &prompts, &data, &one, &[]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    let resume = |from: &Path, output: &Path, extra: &[&str]| {
        let mut args = vec![
            "eagle",
            "--stage",
            "train",
            "--engine_dir",
            s(&plain),
            "--data_dir",
            s(&data),
            "--output_dir",
            s(output),
            "--resume",
            s(from),
            "--warmup_steps",
            "0",
        ];
        args.extend_from_slice(extra);
        spec_train(&args)
    };
    // A head that predicts something, then a step size that wrecks it: every epoch ends
    // worse than it started.
    let good = w.join("good");
    let out = resume(
        &one,
        &good,
        &["--epochs", "30", "--lr", "1e-2", "--val_fraction", "0"],
    );
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    let wreck = |output: &Path, val_fraction: &str, extra: &[&str]| {
        let mut args = vec![
            "--val_fraction",
            val_fraction,
            "--lr",
            "1",
            "--grad_clip",
            "0",
            "--epochs",
            "3",
        ];
        args.extend_from_slice(extra);
        resume(&good, output, &args)
    };
    let kept = w.join("kept");
    let out = wreck(&kept, "0.5", &["--keep_best", "--early_stop", "2"]);
    assert!(out.status.success(), "spec-train eagle: {}", stderr(&out));
    let err = stderr(&out);
    assert!(
        err.contains("spec-train: stopping early: 2 epoch(s) without a better held-out chain score than epoch 0's\nspec-train: kept epoch 0's weights: held-out chain score")
            && err.contains("the best of epochs 0-2\n")
            && !err.contains("epoch 3/3"),
        "{err}"
    );
    let tensors = |dir: &Path| std::fs::read(dir.join("model.safetensors")).unwrap();
    assert!(
        tensors(&kept) == tensors(&good),
        "the kept head is not the resumed one"
    );
    let log: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(kept.join("train_log.json")).unwrap())
            .unwrap();
    assert_eq!(log["kept_epoch"], 0);

    for (val_fraction, extra, why) in [
        (
            "0",
            &["--keep_best"][..],
            "--keep_best compares epochs on held-out sequences, but --val_fraction 0 holds out none of the 4 sequences",
        ),
        (
            "0.5",
            &["--early_stop", "1"][..],
            "--early_stop 1 needs --keep_best: a run cut short should write its best epoch, not its last",
        ),
    ] {
        let refused = wreck(&w.join("none"), val_fraction, extra);
        assert_eq!(one_line_error("spec-train", &refused), why);
        assert!(!w.join("none").exists());
    }
    // A recipe that cannot train is refused before the data stage answers any prompt.
    let fresh = w.join("fresh-data");
    let refused = train_eagle(
        &plain,
        &prompts,
        &fresh,
        &w.join("none"),
        &["--early_stop", "1"],
    );
    assert_eq!(
        one_line_error("spec-train", &refused),
        "--early_stop 1 needs --keep_best: a run cut short should write its best epoch, not its last"
    );
    assert!(!fresh.exists());
}

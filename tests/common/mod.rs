//! Helpers shared by the root package's integration tests: the binaries, fixture and model
//! paths, and running the convert → build → run pipeline.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub const CONVERT: &str = env!("CARGO_BIN_EXE_convert-checkpoint");
pub const BUILD: &str = env!("CARGO_BIN_EXE_spec-build");
pub const RUN: &str = env!("CARGO_BIN_EXE_spec-run");
pub const TRAIN: &str = env!("CARGO_BIN_EXE_spec-train");

/// The repository root (the root package's manifest directory).
pub fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// `tests/fixtures/<rel>`.
pub fn fixture(rel: &str) -> PathBuf {
    repo().join("tests/fixtures").join(rel)
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("test paths are UTF-8")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Runs `bin` with `args`, capturing its output.
pub fn exec(bin: &str, args: &[&str]) -> Output {
    Command::new(bin)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"))
}

pub fn convert(args: &[&str]) -> Output {
    exec(CONVERT, args)
}

pub fn spec_build(args: &[&str]) -> Output {
    exec(BUILD, args)
}

pub fn spec_run(args: &[&str]) -> Output {
    exec(RUN, args)
}

pub fn spec_train(args: &[&str]) -> Output {
    exec(TRAIN, args)
}

/// Runs convert-checkpoint, which must succeed with its one-line summary.
pub fn convert_ok(args: &[&str]) {
    let out = convert(args);
    assert!(
        out.status.success(),
        "convert-checkpoint {args:?} failed: {}",
        stderr(&out)
    );
    let stdout = stdout(&out);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.starts_with("convert-checkpoint: wrote "), "{stdout}");
}

/// Runs spec-build, which must succeed with its one-line summary.
pub fn build_ok(args: &[&str]) {
    let out = spec_build(args);
    assert!(
        out.status.success(),
        "spec-build {args:?} failed: {}",
        stderr(&out)
    );
    let stdout = stdout(&out);
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.starts_with("Built engine "), "{stdout}");
}

/// Builds the EAGLE engine `engine` from `ckpt` (plus `extra`), which must succeed.
pub fn build_eagle_ok(ckpt: &Path, engine: &Path, extra: &[&str]) {
    let mut args = vec![
        "--checkpoint_dir",
        s(ckpt),
        "--output_dir",
        s(engine),
        "--speculative_decoding_mode",
        "eagle",
    ];
    args.extend_from_slice(extra);
    build_ok(&args);
}

/// Converts `--model_dir src` (plus `convert_args`) into `<work>/ckpt` and builds
/// `<work>/engine` from it (plus `build_args`); returns the engine directory.
pub fn pipeline(src: &Path, work: &Path, convert_args: &[&str], build_args: &[&str]) -> PathBuf {
    let mut args = vec!["--model_dir", s(src)];
    args.extend_from_slice(convert_args);
    pipeline_args(work, &args, build_args)
}

/// The SmolLM2 GGUF in float32 through [`pipeline`]'s steps, into `<work>/engine`.
pub fn smollm2_engine(work: &Path, build_args: &[&str]) -> PathBuf {
    let gguf = smollm2_gguf();
    pipeline_args(
        work,
        &["--gguf", s(&gguf), "--dtype", "float32"],
        build_args,
    )
}

fn pipeline_args(work: &Path, convert_args: &[&str], build_args: &[&str]) -> PathBuf {
    let ckpt = work.join("ckpt");
    let engine = work.join("engine");
    let mut args = vec!["--output_dir", s(&ckpt)];
    args.extend_from_slice(convert_args);
    convert_ok(&args);
    let mut args = vec!["--checkpoint_dir", s(&ckpt), "--output_dir", s(&engine)];
    args.extend_from_slice(build_args);
    build_ok(&args);
    engine
}

/// The failure of a tool run by its own error path: exit status 1, no panic, and stderr is
/// exactly one line `<tool>: error: <message>`. Returns the message.
pub fn one_line_error(tool: &str, out: &Output) -> String {
    let err = stderr(out);
    assert!(!err.contains("panicked"), "{tool} panicked: {err}");
    assert_eq!(
        out.status.code(),
        Some(1),
        "{tool} exit status; stderr: {err}"
    );
    assert_eq!(
        err.lines().count(),
        1,
        "{tool} wrote more than one line: {err}"
    );
    assert!(err.ends_with('\n'), "{err:?}");
    let prefix = format!("{tool}: error: ");
    err.strip_prefix(&prefix)
        .unwrap_or_else(|| panic!("stderr does not start with {prefix:?}: {err}"))
        .trim_end_matches('\n')
        .to_string()
}

/// The SmolLM2-135M-Instruct Q4_1 GGUF: `$KESTREL_SMOLLM2_GGUF`, or
/// `<repo>/models/SmolLM2-135M-Instruct.Q4_1.gguf`. Fails with how to get it when absent.
pub fn smollm2_gguf() -> PathBuf {
    let p = match std::env::var_os("KESTREL_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    assert!(
        p.is_file(),
        "this test needs the SmolLM2-135M-Instruct Q4_1 GGUF but {} does not exist: run \
         tools/fetch-smollm2.sh (it puts the file at <repo>/models/), or set \
         KESTREL_SMOLLM2_GGUF to the file",
        p.display()
    );
    p
}

/// A whitespace word-level tokenizer whose ids fit the tiny models' vocabulary of 16.
pub const TINY_TOKENIZER_JSON: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": {"type": "WhitespaceSplit"},
  "post_processor": null,
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "d": 4, "e": 5, "hello": 6, "world": 7},
    "unk_token": "<unk>"
  }
}"#;

/// The tiny Llama (vocab 16, hidden 8, 1 layer) in pytorch_model.bin form.
pub fn tiny_llama() -> PathBuf {
    repo().join("crates/kestrel-formats/tests/data/tiny_llama_bin")
}

/// The tiny Llama's EAGLE head in pytorch_model.bin form.
pub fn tiny_eagle() -> PathBuf {
    repo().join("crates/kestrel-formats/tests/data/tiny_eagle_bin")
}

/// Converts the tiny Llama (with `extra` convert flags) into `<dir>/ckpt`, adding a tokenizer.
pub fn tiny_checkpoint(dir: &Path, extra: &[&str]) -> PathBuf {
    let src = tiny_llama();
    let ckpt = dir.join("ckpt");
    let mut args = vec!["--model_dir", s(&src), "--output_dir", s(&ckpt)];
    args.extend_from_slice(extra);
    convert_ok(&args);
    std::fs::write(ckpt.join("tokenizer.json"), TINY_TOKENIZER_JSON).unwrap();
    ckpt
}

/// The tiny Llama, converted with its tiny EAGLE head and built with
/// `--speculative_decoding_mode eagle` when `eagle`, into `<dir>/engine` with `build_args`.
pub fn tiny_engine_with(dir: &Path, eagle: bool, build_args: &[&str]) -> PathBuf {
    let head = tiny_eagle();
    let convert_args: &[&str] = if eagle {
        &["--eagle_model_dir", s(&head)]
    } else {
        &[]
    };
    let ckpt = tiny_checkpoint(dir, convert_args);
    let engine = dir.join("engine");
    let mut args = vec!["--checkpoint_dir", s(&ckpt), "--output_dir", s(&engine)];
    args.extend_from_slice(build_args);
    if eagle {
        args.extend(["--speculative_decoding_mode", "eagle"]);
    }
    build_ok(&args);
    engine
}

/// spec-run's arguments for the tiny engines' usual request: "a b c hello", 16 tokens, then
/// `extra`.
pub fn tiny_request<'a>(engine: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--engine_dir",
        s(engine),
        "--input_text",
        "a b c hello",
        "--max_output_len",
        "16",
    ];
    args.extend_from_slice(extra);
    args
}

/// Runs spec-run with `args` plus `--output_json json`, which must succeed; returns the
/// report's `output_ids`.
pub fn spec_run_ids<T: serde::de::DeserializeOwned>(args: &[&str], json: &Path) -> Vec<T> {
    let mut all = args.to_vec();
    all.extend(["--output_json", s(json)]);
    let out = spec_run(&all);
    assert!(out.status.success(), "spec-run {args:?}: {}", stderr(&out));
    output_ids(json)
}

/// The `output_ids` of every output in a `--output_json` report.
pub fn output_ids<T: serde::de::DeserializeOwned>(json: &Path) -> Vec<T> {
    let doc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    doc["outputs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| serde_json::from_value(o["output_ids"].clone()).unwrap())
        .collect()
}

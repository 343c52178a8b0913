//! Bad input to spec-build and spec-run: each is refused with exit status 1 and exactly one
//! line `<tool>: error: <message>` naming the file, tensor or flag, never with a panic.

mod common;

use common::{
    build_ok, fixture, one_line_error, s, spec_build, spec_run, spec_run_ids, spec_train, stderr,
    stdout, tiny_checkpoint, tiny_engine_with,
};
use kestrel_formats::candle_core::{self, DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// A plain engine for the tiny Llama with a tokenizer and no chat template, max_input_len 4.
fn tiny_engine(dir: &Path) -> PathBuf {
    let engine = tiny_engine_with(dir, false, &["--max_input_len", "4", "--max_seq_len", "64"]);
    assert!(engine.join("tokenizer.json").is_file());
    assert!(!engine.join("chat_template.jinja").exists());
    engine
}

/// An EAGLE engine: the tiny Llama with its tiny EAGLE head.
fn tiny_eagle_engine(dir: &Path) -> PathBuf {
    tiny_engine_with(dir, true, &["--max_input_len", "16", "--max_seq_len", "64"])
}

fn build_error(ckpt: &Path, out: &Path, extra: &[&str]) -> String {
    let mut args = vec!["--checkpoint_dir", s(ckpt), "--output_dir", s(out)];
    args.extend_from_slice(extra);
    let msg = one_line_error("spec-build", &spec_build(&args));
    assert!(!out.exists(), "a failed build left {}", out.display());
    msg
}

fn run_error(engine: &Path, extra: &[&str]) -> String {
    let mut args = vec!["--engine_dir", s(engine)];
    args.extend_from_slice(extra);
    one_line_error("spec-run", &spec_run(&args))
}

// ---------------------------------------------------------------- spec-build: flags and inputs

#[test]
fn build_refuses_a_directory_that_is_not_a_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let out = tmp.path().join("engine");
    assert_eq!(
        build_error(&empty, &out, &[]),
        format!(
            "{}: not a Kestrel checkpoint (no config.json): create one with convert-checkpoint",
            empty.display()
        )
    );
    let missing = tmp.path().join("nowhere");
    assert_eq!(
        build_error(&missing, &out, &[]),
        format!("{}: checkpoint directory does not exist", missing.display())
    );
    // A Hugging Face folder has a config.json, but not Kestrel's section.
    let hf = fixture("tiny/mha");
    assert_eq!(
        build_error(&hf, &out, &[]),
        format!(
            "{}: has no \"kestrel\" section: this is a Hugging Face config, not a converted checkpoint; run convert-checkpoint first",
            hf.join("config.json").display()
        )
    );
}

#[test]
fn build_refuses_bad_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    let input_len = |input: &str| {
        format!("--max_input_len {input} must be smaller than --max_seq_len 128 (the sequence holds the input and at least one output token)")
    };
    let cases: Vec<(&[&str], String)> = vec![
        (
            &["--max_beam_width", "2"],
            "--max_beam_width 2 is not supported: Kestrel decodes with beam width 1 (speculative decoding has no beam search)".into(),
        ),
        (
            &["--max_input_len", "128", "--max_seq_len", "128"],
            input_len("128"),
        ),
        (
            &["--max_input_len", "200", "--max_seq_len", "128"],
            input_len("200"),
        ),
        (
            &["--speculative_decoding_mode", "eagle"],
            format!(
                "--speculative_decoding_mode eagle needs an EAGLE head, but {} has none: convert with --eagle_model_dir",
                ckpt.display()
            ),
        ),
        (
            &["--speculative_decoding_mode", "medusa"],
            "unknown --speculative_decoding_mode 'medusa': expected none, eagle or draft_tokens_external".into(),
        ),
        (
            &["--target_device", "cuda:sm_75"],
            "--target_device cuda:sm_75 is below compute capability 8.0: Kestrel's CUDA kernels need Ampere (sm_80) or newer".into(),
        ),
        (
            &["--target_device", "tpu"],
            "unknown --target_device 'tpu': expected cpu or cuda:sm_XY (for example cuda:sm_90)".into(),
        ),
        (
            &["--attention_kernel", "flash"],
            "unknown --attention_kernel 'flash': expected scalar or tensor_cores".into(),
        ),
        (
            &["--attention_kernel", "tensor_cores"],
            "--attention_kernel tensor_cores needs a CUDA target: add --target_device cuda:sm_XY".into(),
        ),
        (
            &["--attention_kernel", "tensor_cores", "--target_device", "cuda:sm_90"],
            "--attention_kernel tensor_cores needs float16 or bfloat16 weights, but the checkpoint is float32: reconvert with --dtype bfloat16".into(),
        ),
    ];
    for (args, want) in cases {
        assert_eq!(
            build_error(&ckpt, &tmp.path().join("e"), args),
            want,
            "{args:?}"
        );
    }
}

/// The tensor-core attention takes heads of 64 and 128 only (the tiny model's are 4).
#[test]
fn build_refuses_tensor_core_attention_for_other_heads() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &["--dtype", "bfloat16"]);
    let args = [
        "--attention_kernel",
        "tensor_cores",
        "--target_device",
        "cuda:sm_90",
    ];
    assert_eq!(
        build_error(&ckpt, &tmp.path().join("e"), &args),
        "--attention_kernel tensor_cores takes heads of 64 or 128 values; this model's have 4: use --attention_kernel scalar"
    );
}

// ---------------------------------------------------------------- spec-build: broken weights

fn load_rank0(ckpt: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(ckpt.join("rank0.safetensors"), &Device::Cpu).unwrap()
}

fn save_rank0(ckpt: &Path, tensors: &HashMap<String, Tensor>) {
    candle_core::safetensors::save(tensors, ckpt.join("rank0.safetensors")).unwrap();
}

#[test]
fn build_refuses_a_truncated_rank_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    let rank0 = ckpt.join("rank0.safetensors");
    let bytes = std::fs::read(&rank0).unwrap();
    std::fs::write(&rank0, &bytes[..bytes.len() - 100]).unwrap();
    let msg = build_error(&ckpt, &tmp.path().join("e"), &[]);
    let head = format!("{}: not a valid safetensors file (", rank0.display());
    assert!(msg.starts_with(&head), "{msg}");
    assert!(msg.ends_with("): reconvert the checkpoint"), "{msg}");
}

#[test]
fn build_refuses_a_tensor_of_the_wrong_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    let mut tensors = load_rank0(&ckpt);
    tensors.insert(
        "model.norm.weight".into(),
        Tensor::ones(4, DType::F32, &Device::Cpu).unwrap(),
    );
    save_rank0(&ckpt, &tensors);
    assert_eq!(
        build_error(&ckpt, &tmp.path().join("e"), &[]),
        format!(
            "{}: tensor model.norm.weight has shape [4], expected [8]",
            ckpt.join("rank0.safetensors").display()
        )
    );
}

#[test]
fn build_refuses_a_missing_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    let mut tensors = load_rank0(&ckpt);
    let name = "model.layers.0.mlp.up_proj.weight";
    assert!(tensors.remove(name).is_some());
    save_rank0(&ckpt, &tensors);
    assert_eq!(
        build_error(&ckpt, &tmp.path().join("e"), &[]),
        format!(
            "{}: tensor {name} is missing",
            ckpt.join("rank0.safetensors").display()
        )
    );
}

// ---------------------------------------------------------------- spec-run: engines

#[test]
fn run_refuses_a_directory_that_is_not_an_engine() {
    let tmp = tempfile::tempdir().unwrap();
    // A checkpoint is the likeliest mistake.
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    assert_eq!(
        run_error(&ckpt, &["--input_text", "a"]),
        format!(
            "{}: not an engine directory (no plan.bin): build one with spec-build",
            ckpt.display()
        )
    );
    let missing = tmp.path().join("nowhere");
    assert_eq!(
        run_error(&missing, &["--input_text", "a"]),
        format!("{}: engine directory does not exist", missing.display())
    );
}

#[test]
fn run_refuses_a_corrupted_plan() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let plan = engine.join("plan.bin");
    let mut bytes = std::fs::read(&plan).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x01;
    std::fs::write(&plan, &bytes).unwrap();
    assert_eq!(
        run_error(&engine, &["--input_text", "a"]),
        format!(
            "{}: checksum mismatch: the engine plan is corrupted; rebuild the engine",
            plan.display()
        )
    );
    // Not a plan at all.
    std::fs::write(&plan, b"{\"not\": \"a plan\"}").unwrap();
    assert_eq!(
        run_error(&engine, &["--input_text", "a"]),
        format!(
            "{}: not a Kestrel engine plan (bad magic): build the engine with spec-build",
            plan.display()
        )
    );
}

#[test]
fn run_refuses_a_plan_of_another_version() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let plan = engine.join("plan.bin");
    let mut bytes = std::fs::read(&plan).unwrap();
    let ours = kestrel_core::plan::PLAN_FORMAT_VERSION;
    assert_eq!(bytes[8..12], ours.to_le_bytes());
    let other = ours + 1;
    bytes[8..12].copy_from_slice(&other.to_le_bytes());
    std::fs::write(&plan, &bytes).unwrap();
    assert_eq!(
        run_error(&engine, &["--input_text", "a"]),
        format!(
            "{}: engine plan format version {other}, but this spec-run reads version {ours}: rebuild the engine with this release's spec-build",
            plan.display()
        )
    );
}

// ---------------------------------------------------------------- spec-run: requests

#[test]
fn run_works_on_the_tiny_engine() {
    // The control for the request errors below: the same engine and tokenizer do run.
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let out = spec_run(&[
        "--engine_dir",
        s(&engine),
        "--input_text",
        "hello world",
        "--max_output_len",
        "3",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let console = stdout(&out);
    assert!(
        console.starts_with("Input [Text 0]: \"hello world\"\nOutput [Text 0 Beam 0]: "),
        "{console}"
    );
}

#[test]
fn run_notes_when_max_seq_len_ended_answers_before_max_output_len() {
    // The tiny engine's max_seq_len is 64: a prompt of P tokens has room for 64 - P new ones.
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let prompts = tmp.path().join("prompts.json");
    std::fs::write(&prompts, r#"["hello world", "a b c", "hello"]"#).unwrap();
    let json = tmp.path().join("out.json");
    let run = |max_output_len: &str| {
        let out = spec_run(&[
            "--engine_dir",
            s(&engine),
            "--input_file",
            s(&prompts),
            "--max_output_len",
            max_output_len,
            "--output_json",
            s(&json),
        ]);
        assert!(out.status.success(), "{}", stderr(&out));
        let doc: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        let lens: Vec<(usize, usize, String)> = doc["outputs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| {
                (
                    o["input_ids"].as_array().unwrap().len(),
                    o["output_ids"].as_array().unwrap().len(),
                    o["finish_reason"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        (stderr(&out), lens)
    };
    let (err, lens) = run("70");
    let (p0, _, _) = lens[0];
    assert!(
        err.contains(&format!(
            "note: input 0 (and 2 other inputs) stopped at the engine's max_seq_len 64 before --max_output_len 70: its {p0} prompt tokens left room for {} new tokens (rebuild with a larger --max_seq_len for more)\n",
            64 - p0
        )),
        "{err}"
    );
    for (prompt, output, finish) in &lens {
        // The tiny Llama's greedy answers to these prompts never reach its end id (255).
        assert_eq!(
            (prompt + output, finish.as_str()),
            (64, "length"),
            "{lens:?}"
        );
    }
    // Room for every answer: no note.
    let shortest = lens.iter().map(|l| 64 - l.0).min().unwrap().to_string();
    let (err, _) = run(&shortest);
    assert!(!err.contains("note: input"), "{err}");
}

#[test]
fn run_prompt_lookup_on_an_eagle_engine_gives_plain_greedy_output() {
    // The control for the prompt lookup errors below: an engine that verifies drafts runs it.
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_eagle_engine(tmp.path());
    let run = |extra: &[&str], name: &str| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--input_text",
            "a b c a b c a b",
            "--input_text",
            "hello world hello",
            "--max_output_len",
            "24",
        ];
        args.extend_from_slice(extra);
        spec_run_ids::<Vec<u32>>(&args, &tmp.path().join(name))
    };
    let plain = run(&["--no_speculation"], "plain.json");
    assert_eq!(plain.iter().map(Vec::len).collect::<Vec<_>>(), vec![24, 24]);
    assert_eq!(
        run(&["--prompt_lookup_config", "[4,2]"], "lookup.json"),
        plain
    );
    // The plain answers as an n-gram corpus (spec-train ngram-corpus), then backing the lookup.
    let corpus = tmp.path().join("corpus.safetensors");
    let out = spec_train(&[
        "ngram-corpus",
        "--from_outputs",
        s(&tmp.path().join("plain.json")),
        "--output",
        s(&corpus),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let with_corpus = run(
        &[
            "--prompt_lookup_config",
            "[4,2]",
            "--prompt_lookup_corpus",
            s(&corpus),
        ],
        "corpus.json",
    );
    assert_eq!(with_corpus, plain);
    // The lookup grafted onto EAGLE's trees, static and dynamic.
    for tree in [
        &["--eagle_choices", "small_8"][..],
        &[
            "--eagle_use_dynamic_tree",
            "--eagle_dynamic_tree_max_top_k",
            "3",
        ],
    ] {
        let mut args = vec![
            "--prompt_lookup_config",
            "[4,2]",
            "--prompt_lookup_corpus",
            s(&corpus),
            "--eagle_prompt_lookup",
        ];
        args.extend_from_slice(tree);
        assert_eq!(run(&args, "grafted.json"), plain, "{tree:?}");
    }
    assert_eq!(
        run_error(
            &engine,
            &[
                "--input_text",
                "a",
                "--prompt_lookup_config",
                "[4,2]",
                "--eagle_prompt_lookup",
                "--no_speculation"
            ]
        ),
        "--eagle_prompt_lookup cannot be combined with --no_speculation"
    );
    assert_eq!(
        run_error(
            &engine,
            &["--input_text", "a", "--prompt_lookup_corpus", s(&corpus)]
        ),
        "--prompt_lookup_corpus needs --prompt_lookup_config \"[num_tokens,max_ngram]\""
    );
    assert_eq!(
        one_line_error(
            "spec-train",
            &spec_train(&["ngram-corpus", "--output", s(&corpus)])
        ),
        "no answers to read: give --from_outputs REPORT.json (repeatable) or --data_dir DIR"
    );
}

#[test]
fn run_reuses_cached_prompt_blocks_across_batches() {
    // The control for the KV cache flag errors below: one prompt per batch, blocks of two
    // tokens; the second prompt starts with the first one's two full blocks.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tiny_checkpoint(tmp.path(), &[]);
    let engine = tmp.path().join("engine");
    build_ok(&[
        "--checkpoint_dir",
        s(&ckpt),
        "--output_dir",
        s(&engine),
        "--max_batch_size",
        "1",
        "--max_input_len",
        "16",
        "--max_seq_len",
        "64",
        "--tokens_per_block",
        "2",
    ]);
    let file = tmp.path().join("prompts.json");
    std::fs::write(&file, r#"["a b c d e", "a b c d c"]"#).unwrap();
    let run = |extra: &[&str]| {
        let mut args = vec![
            "--engine_dir",
            s(&engine),
            "--input_file",
            s(&file),
            "--max_output_len",
            "3",
            "--run_profiling",
        ];
        args.extend_from_slice(extra);
        let out = spec_run(&args);
        assert!(out.status.success(), "{}", stderr(&out));
        let console = stdout(&out);
        let outputs: Vec<String> = console
            .lines()
            .filter(|l| l.starts_with("Output ["))
            .map(String::from)
            .collect();
        let pool = console
            .lines()
            .find(|l| l.starts_with("[profile] KV cache "))
            .unwrap_or_else(|| panic!("no KV cache profile line: {console}"))
            .to_string();
        (outputs, pool)
    };
    let (plain, pool) = run(&[]);
    assert_eq!(plain.len(), 2);
    // ceil((64 + 1) / 2) = 33 blocks for a batch of one.
    assert_eq!(
        pool,
        "[profile] KV cache target: 33 blocks of 2 tokens; prompt tokens: 10 prefilled, 0 reused from cached blocks"
    );
    let (reused, pool) = run(&["--kv_cache_enable_block_reuse"]);
    assert_eq!(reused, plain);
    assert_eq!(
        pool,
        "[profile] KV cache target: 33 blocks of 2 tokens; prompt tokens: 6 prefilled, 4 reused from cached blocks"
    );
    // All free memory is more than the default pool: the default size stays.
    let (sized, pool) = run(&["--kv_cache_free_gpu_memory_fraction", "1"]);
    assert_eq!(sized, plain);
    assert!(
        pool.starts_with("[profile] KV cache target: 33 blocks of 2 tokens;"),
        "{pool}"
    );
}

#[test]
fn run_refuses_a_bad_kv_cache_memory_fraction() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let fraction = |f: &str| {
        run_error(
            &engine,
            &[
                "--input_text",
                "a",
                "--kv_cache_free_gpu_memory_fraction",
                f,
            ],
        )
    };
    let range = |f: &str| {
        format!("--kv_cache_free_gpu_memory_fraction {f} must be in (0, 1]: it is the share of free device memory the KV cache may take")
    };
    assert_eq!(fraction("0"), range("0"));
    assert_eq!(fraction("1.5"), range("1.5"));
    assert_eq!(fraction("-0.5"), range("-0.5"));
    assert_eq!(
        fraction("abc"),
        "--kv_cache_free_gpu_memory_fraction 'abc' is not a number: give a fraction in (0, 1], for example 0.9"
    );
    // A valid fraction too small for one sequence of max_input_len 4 + max_output_len 64.
    let msg = fraction("1e-15");
    assert!(
        msg.starts_with("--kv_cache_free_gpu_memory_fraction 0.000000000000001: the target KV cache gets 0 blocks of "),
        "{msg}"
    );
    assert!(
        msg.ends_with(
            ": raise --kv_cache_free_gpu_memory_fraction, lower --max_output_len or free memory"
        ),
        "{msg}"
    );
}

#[test]
fn run_refuses_bad_requests() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    #[allow(unused_mut)]
    let mut cases: Vec<(&[&str], String)> = vec![
        (
            &["--input_text", "a b", "--input_text", "a b c d e"],
            "input 1 has 5 tokens, more than the engine's max_input_len 4: shorten it or rebuild with a larger --max_input_len".into(),
        ),
        (
            &["--input_text", "a", "--num_beams", "2"],
            "--num_beams 2 is not supported: speculative decoding decodes with one beam".into(),
        ),
        (
            &[],
            "no input: give --input_text TEXT (repeatable) or --input_file FILE".into(),
        ),
        (
            &["--input_text", "a", "--chat"],
            format!(
                "--chat needs a chat template, but {} has no chat_template.jinja",
                engine.display()
            ),
        ),
        (
            &["--input_text", "a", "--eagle_choices", "[[0]]"],
            format!(
                "--eagle_* flags need an EAGLE engine, but {} was built with --speculative_decoding_mode none",
                engine.display()
            ),
        ),
        (
            &["--input_text", "a", "--prompt_lookup_config", "[4]"],
            "--prompt_lookup_config \"[4]\": expected [prompt_lookup_num_tokens,max_matching_ngram_size] or [num_tokens,ngram_size,[target devices]]".into(),
        ),
        (
            &["--input_text", "a", "--prompt_lookup_config", "[4,3]"],
            format!(
                "{}: the engine was built with --speculative_decoding_mode none, but prompt lookup decoding verifies drafts: rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len 4",
                engine.display()
            ),
        ),
        (
            &["--input_text", "a", "--prompt_lookup_config", "[4,3]", "--no_speculation"],
            "--prompt_lookup_config cannot be combined with --eagle_* flags or --no_speculation (--eagle_prompt_lookup grafts its drafts onto EAGLE's tree)".into(),
        ),
        (
            &["--input_text", "a", "--eagle_prompt_lookup"],
            "--eagle_prompt_lookup needs --prompt_lookup_config \"[num_tokens,max_ngram]\"".into(),
        ),
        (
            &["--input_text", "a", "--prompt_lookup_config", "[4,3]", "--eagle_prompt_lookup"],
            format!(
                "--eagle_prompt_lookup grafts onto EAGLE trees, but {} was built with --speculative_decoding_mode none",
                engine.display()
            ),
        ),
        (
            &["--input_text", "a", "--prompt_lookup_config", "[4,3,[cpu,cpu]]"],
            "--prompt_lookup_config lists 2 target device(s) but the engine has tp_size 1: list one device per tensor-parallel rank".into(),
        ),
    ];
    #[cfg(not(feature = "cuda"))]
    cases.extend([
        (
            &["--input_text", "a", "--device", "cuda:0"][..],
            "--device cuda:0: this binary was built without CUDA support; rebuild with --features cuda".to_string(),
        ),
        (
            &["--input_text", "a", "--device", "gpu"],
            "unknown --device 'gpu': expected cpu or cuda:N".into(),
        ),
    ]);
    for (args, want) in cases {
        assert_eq!(run_error(&engine, args), want, "{args:?}");
    }
}

#[test]
fn run_refuses_a_malformed_input_file() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let file = tmp.path().join("prompts.jsonl");
    std::fs::write(&file, "\"a b\"\n{\"prompt\": \"a\"\n").unwrap();
    let msg = run_error(&engine, &["--input_file", s(&file)]);
    let head = format!("--input_file {}: line 2 is not JSON: ", file.display());
    assert!(msg.starts_with(&head), "{msg}");

    std::fs::write(&file, "{\"question\": \"a\"}\n").unwrap();
    assert_eq!(
        run_error(&engine, &["--input_file", s(&file)]),
        format!(
            "--input_file {}: line 1: expected a string or an object with \"prompt\", \"text\" or \"turns\"",
            file.display()
        )
    );

    std::fs::write(&file, "\n\n").unwrap();
    assert_eq!(
        run_error(&engine, &["--input_file", s(&file)]),
        format!("--input_file {}: holds no prompts", file.display())
    );

    let missing = tmp.path().join("missing.jsonl");
    let msg = run_error(&engine, &["--input_file", s(&missing)]);
    let head = format!("--input_file {}: cannot read it: ", missing.display());
    assert!(msg.starts_with(&head), "{msg}");
}

// ---------------------------------------------------------------- spec-run: EAGLE flags

#[test]
fn run_refuses_static_choices_with_a_dynamic_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_eagle_engine(tmp.path());
    assert_eq!(
        run_error(
            &engine,
            &[
                "--input_text",
                "a",
                "--eagle_choices",
                "[[0], [1]]",
                "--eagle_use_dynamic_tree",
                "--eagle_dynamic_tree_max_top_k",
                "2"
            ]
        ),
        "--eagle_choices cannot be combined with --eagle_use_dynamic_tree: EAGLE-2 builds its tree while decoding"
    );
}

#[test]
fn run_refuses_dynamic_tree_caps_without_a_dynamic_tree_and_past_the_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_eagle_engine(tmp.path());
    for flag in [
        "--eagle_dynamic_tree_max_draft_len",
        "--eagle_dynamic_tree_num_layers",
        "--eagle_dynamic_tree_min_prob",
    ] {
        assert_eq!(
            run_error(&engine, &["--input_text", "a", flag, "2"]),
            format!("{flag} needs --eagle_use_dynamic_tree")
        );
    }
    assert_eq!(
        dynamic_run_error(&engine, &["--eagle_dynamic_tree_num_layers", "9"]),
        format!(
            "--eagle_dynamic_tree_num_layers 9 exceeds 4, the limit {} was built with; more needs convert-checkpoint --num_eagle_layers 9",
            engine.display()
        )
    );
}

#[test]
fn run_refuses_a_dynamic_tree_gate_outside_zero_to_one() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_eagle_engine(tmp.path());
    for gate in ["1.5", "-0.25"] {
        assert_eq!(
            dynamic_run_error(&engine, &[&format!("--eagle_dynamic_tree_min_prob={gate}")]),
            format!("eagle_dynamic_tree_min_prob must be a probability in [0, 1], got {gate}")
        );
    }
}

/// spec-run's one-line error for EAGLE-2 (top-k 2) on input "a" with `extra` flags.
fn dynamic_run_error(engine: &Path, extra: &[&str]) -> String {
    let mut args = vec![
        "--input_text",
        "a",
        "--eagle_use_dynamic_tree",
        "--eagle_dynamic_tree_max_top_k",
        "2",
    ];
    args.extend_from_slice(extra);
    run_error(engine, &args)
}

#[test]
fn run_takes_a_speculation_batch_limit_for_speculative_runs_only() {
    let tmp = tempfile::tempdir().unwrap();
    let eagle = tiny_eagle_engine(&tmp.path().join("eagle"));
    let plain = tiny_engine(&tmp.path().join("plain"));
    let limit = |engine: &Path, n: &str, extra: &[&str]| {
        let mut args = vec![
            "--input_text",
            "a",
            "--speculative_disable_by_batch_size",
            n,
        ];
        args.extend_from_slice(extra);
        run_error(engine, &args)
    };
    assert_eq!(
        limit(&eagle, "0", &[]),
        "--speculative_disable_by_batch_size 0 would never speculate: pass --no_speculation instead"
    );
    let not_speculating =
        "--speculative_disable_by_batch_size applies to speculative decoding, which this run does not use";
    assert_eq!(limit(&eagle, "2", &["--no_speculation"]), not_speculating);
    assert_eq!(limit(&plain, "2", &[]), not_speculating);
    // A batch of one is within a limit of one: the run speculates, with plain's output.
    let json = tmp.path().join("out.json");
    let request = |extra: &[&'static str]| {
        let mut args = vec![
            "--engine_dir",
            s(&eagle),
            "--input_text",
            "a b",
            "--max_output_len",
            "8",
        ];
        args.extend_from_slice(extra);
        spec_run_ids::<Vec<u32>>(&args, &json)
    };
    assert_eq!(
        request(&["--speculative_disable_by_batch_size", "1"]),
        request(&["--no_speculation"])
    );
}

#[test]
fn run_names_the_offending_eagle_choices_path() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_eagle_engine(tmp.path());
    let choices = |c: &str| run_error(&engine, &["--input_text", "a", "--eagle_choices", c]);
    assert_eq!(
        choices("[[0], [0, 0], [1, 0]]"),
        "eagle_choices path [1, 0] has no parent [1]: every prefix of a path must be in the tree"
    );
    assert_eq!(
        choices("[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]"),
        "eagle_choices path [0, 0, 0, 0, 0] has depth 5, deeper than num_eagle_layers = 4: the engine drafts at most 4 levels"
    );
    // The same check applies to a choices file.
    let file = tmp.path().join("choices.json");
    std::fs::write(&file, "[[0], [0], [1]]").unwrap();
    assert_eq!(
        choices(s(&file)),
        "eagle_choices path [0] appears more than once"
    );
}

/// `--draft_skip_layers`: a list it cannot read (a usage error, exit status 2, as clap's
/// others), a layer the draft does not have, and no draft engine to skip layers of, each
/// refused by name.
#[test]
fn run_refuses_bad_layers_to_skip() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    let args = |skip: &'static str| {
        vec![
            "--engine_dir",
            s(&engine),
            "--input_text",
            "hi",
            "--draft_engine_dir",
            s(&engine),
            "--draft_target_model_config",
            "[2,[cpu],[cpu],False]",
            "--draft_skip_layers",
            skip,
        ]
    };
    for (skip, why) in [
        ("3-1", "the range \"3-1\" is empty"),
        ("0,x", "\"x\" is not a layer index or a range like 10-19"),
    ] {
        let out = spec_run(&args(skip));
        assert_eq!(out.status.code(), Some(2));
        let first = stderr(&out).lines().next().unwrap_or_default().to_string();
        assert_eq!(
            first,
            format!("error: invalid value '{skip}' for '--draft_skip_layers <DRAFT_SKIP_LAYERS>': bad layer list \"{skip}\": {why}")
        );
    }
    assert_eq!(
        one_line_error("spec-run", &spec_run(&args("7"))),
        format!(
            "the draft derived from {}: invalid input: layer 7 to skip is not a decoder layer of this 1-layer model (0 to 0)",
            engine.display()
        )
    );
    assert_eq!(
        run_error(&engine, &["--input_text", "hi", "--draft_skip_layers", "1"]),
        "--draft_skip_layers needs --draft_engine_dir (the target's own engine for a self-draft)"
    );
}

#[test]
fn run_refuses_a_quantized_draft_without_a_draft_engine() {
    let tmp = tempfile::tempdir().unwrap();
    let engine = tiny_engine(tmp.path());
    assert_eq!(
        run_error(
            &engine,
            &["--input_text", "hi", "--draft_quantization", "q4"]
        ),
        "--draft_quantization needs --draft_engine_dir (the target's own engine for a self-draft)"
    );
}

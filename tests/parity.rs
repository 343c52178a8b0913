//! Exactness against Hugging Face transformers through the real pipeline: every checkpoint
//! goes through the convert-checkpoint and spec-build binaries, and the engine they write must
//! reproduce the reference outputs in `tests/fixtures` (written by tools/make_tiny_fixtures.py
//! and tools/smollm2_reference.py).

mod common;

use common::{fixture, pipeline, s, smollm2_engine, spec_run, stderr, stdout};
use kestrel_model::{OutputRows, SeqInput};
use kestrel_runtime::device::Device;
use kestrel_runtime::{
    generate, ChatMessage, DecodeMode, Engine, FinishReason, GenerationParams, NoSink,
    PromptLookup, SequenceOutput, TextCodec,
};
use kestrel_spec::SamplingParams;
use serde::Deserialize;
use std::path::Path;

/// Greedy tokens generated per prompt in the fixtures.
const NEW_TOKENS: usize = 32;
/// Largest |Δlogit| allowed against transformers' float32 logits.
const LOGIT_TOLERANCE: f32 = 1e-4;

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> T {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn greedy_params(end_ids: Vec<u32>) -> GenerationParams {
    GenerationParams {
        max_output_len: NEW_TOKENS,
        sampling: SamplingParams::greedy(),
        end_ids,
    }
}

fn run_plain(engine: &Engine, prompts: &[Vec<u32>], end_ids: Vec<u32>) -> Vec<SequenceOutput> {
    assert!(
        prompts.len() <= engine.plan.limits.max_batch_size,
        "the prompts must fit one batch"
    );
    let (outputs, _) = generate(
        engine,
        &DecodeMode::Plain,
        prompts,
        &greedy_params(end_ids),
        &mut NoSink,
    )
    .unwrap();
    assert_eq!(outputs.len(), prompts.len());
    outputs
}

/// Last-position logits of one forward over `prompt` in a fresh KV cache.
fn last_logits(engine: &Engine, prompt: &[u32]) -> Vec<f32> {
    let model = &engine.model;
    let mut cache = model
        .new_cache(engine.kv_blocks(), engine.plan.limits.tokens_per_block)
        .unwrap();
    let seq = cache.add_sequence();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let batch = [SeqInput {
        seq,
        tokens: prompt,
        positions: &positions,
        mask: None,
        output_rows: OutputRows::Last,
    }];
    let hidden = model.forward(&batch, &mut cache).unwrap();
    let mut rows = model.logits(&hidden).unwrap().to_vec2::<f32>().unwrap();
    assert_eq!(rows.len(), 1);
    rows.pop().unwrap()
}

/// tests/fixtures/tiny/<name>/expected.json (the fields used here).
#[derive(Deserialize)]
struct TinyExpected {
    name: String,
    prompts: Vec<Vec<u32>>,
    last_logits: Vec<Vec<f32>>,
    greedy: Vec<Vec<u32>>,
}

/// Converts tests/fixtures/tiny/<name> at `tp_size`, builds it, and checks last-position
/// logits and 32 greedy tokens per prompt (one batched call) against transformers.
fn tiny_parity(name: &str, tp_size: usize) {
    let src = fixture(&format!("tiny/{name}"));
    let expected: TinyExpected = read_json(&src.join("expected.json"));
    assert_eq!(expected.name, name);
    assert_eq!(expected.prompts.len(), 4);
    let tmp = tempfile::tempdir().unwrap();
    let tp = tp_size.to_string();
    let engine_dir = pipeline(
        &src,
        tmp.path(),
        &["--dtype", "float32", "--tp_size", &tp],
        // llama3_rope has max_position_embeddings 128.
        &["--max_input_len", "64", "--max_seq_len", "128"],
    );
    for rank in 0..tp_size {
        assert!(engine_dir.join(format!("rank{rank}.safetensors")).is_file());
    }
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    assert_eq!(engine.plan.mapping.tp_size, tp_size);

    for (i, (prompt, want)) in expected
        .prompts
        .iter()
        .zip(&expected.last_logits)
        .enumerate()
    {
        let got = last_logits(&engine, prompt);
        assert_eq!(
            got.len(),
            want.len(),
            "{name} tp{tp_size} prompt {i}: vocab"
        );
        let (worst, delta) = got
            .iter()
            .zip(want)
            .map(|(a, b)| (a - b).abs())
            .enumerate()
            .fold((0, 0f32), |m, (j, d)| if d > m.1 { (j, d) } else { m });
        assert!(
            delta <= LOGIT_TOLERANCE,
            "{name} tp{tp_size} prompt {i}: max |Δlogit| {delta:e} at token {worst} \
             (kestrel {}, transformers {}) exceeds {LOGIT_TOLERANCE:e}",
            got[worst],
            want[worst]
        );
    }

    let outputs = run_plain(&engine, &expected.prompts, vec![]);
    for (i, (out, want)) in outputs.iter().zip(&expected.greedy).enumerate() {
        assert_eq!(
            &out.output_ids, want,
            "{name} tp{tp_size} prompt {i}: greedy ids differ from transformers"
        );
        assert_eq!(out.finish_reason, FinishReason::Length);
    }
}

#[test]
fn tiny_mha_matches_transformers() {
    tiny_parity("mha", 1);
}

#[test]
fn tiny_mha_tp2_matches_transformers() {
    tiny_parity("mha", 2);
}

#[test]
fn tiny_gqa_tied_matches_transformers() {
    tiny_parity("gqa", 1);
}

#[test]
fn tiny_gqa_tied_tp2_matches_transformers() {
    tiny_parity("gqa", 2);
}

#[test]
fn tiny_mqa_matches_transformers() {
    tiny_parity("mqa", 1);
}

#[test]
fn tiny_mqa_tp2_replicated_kv_matches_transformers() {
    tiny_parity("mqa", 2);
}

#[test]
fn tiny_llama3_rope_matches_transformers() {
    tiny_parity("llama3_rope", 1);
}

#[test]
fn tiny_sharded_safetensors_matches_transformers() {
    tiny_parity("sharded", 1);
}

#[test]
fn tiny_pytorch_bin_matches_transformers() {
    tiny_parity("bin", 1);
}

/// tests/fixtures/smollm2/expected.json (the fields used here).
#[derive(Deserialize)]
struct SmolExpected {
    tokenizer: SmolTokenizer,
    prompts: Vec<SmolPrompt>,
}

#[derive(Deserialize)]
struct SmolTokenizer {
    eos_token_id: u32,
    chat_template: String,
}

#[derive(Deserialize)]
struct SmolPrompt {
    text: String,
    raw_ids: Vec<u32>,
    templated_text: String,
    templated_ids: Vec<u32>,
    raw: SmolGreedy,
    templated: SmolGreedy,
}

#[derive(Deserialize)]
struct SmolGreedy {
    greedy: Vec<u32>,
    greedy_text: String,
}

/// SmolLM2-135M-Instruct (Q4_1 GGUF, dequantised to float32): tokenizer, chat template and
/// greedy ids through the runtime API, then spec-run end to end with --chat.
#[test]
fn smollm2_matches_transformers() {
    let expected: SmolExpected = read_json(&fixture("smollm2/expected.json"));
    assert_eq!(expected.prompts.len(), 4);
    let tmp = tempfile::tempdir().unwrap();
    // Small limits keep the KV pool (and so the run's memory) small.
    let engine_dir = smollm2_engine(
        tmp.path(),
        &["--max_input_len", "128", "--max_seq_len", "256"],
    );
    assert_eq!(
        std::fs::read_to_string(engine_dir.join("chat_template.jinja")).unwrap(),
        expected.tokenizer.chat_template,
        "the engine's chat template is not the GGUF's"
    );

    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let eos = expected.tokenizer.eos_token_id;
    assert_eq!(engine.config.eos_token_ids(), vec![eos]);
    let codec = TextCodec::load(&engine_dir, &engine.config).unwrap();
    let template = codec
        .chat_template
        .as_ref()
        .expect("the engine carries SmolLM2's chat template");

    // Raw and chat-templated prompt of each text, interleaved, in one batch of 8.
    let mut prompts = Vec::new();
    let mut wanted = Vec::new();
    for (i, p) in expected.prompts.iter().enumerate() {
        assert_eq!(
            codec.encode(&p.text).unwrap(),
            p.raw_ids,
            "prompt {i}: raw ids"
        );
        let rendered = template
            .render(&[ChatMessage::user(&p.text)], true)
            .unwrap();
        assert_eq!(rendered, p.templated_text, "prompt {i}: chat template");
        assert_eq!(
            codec.encode(&rendered).unwrap(),
            p.templated_ids,
            "prompt {i}: templated ids"
        );
        prompts.push(p.raw_ids.clone());
        wanted.push((format!("prompt {i} raw"), &p.raw.greedy));
        prompts.push(p.templated_ids.clone());
        wanted.push((format!("prompt {i} templated"), &p.templated.greedy));
    }
    let outputs = run_plain(&engine, &prompts, vec![]);
    for (out, (what, want)) in outputs.iter().zip(&wanted) {
        assert_eq!(
            &out.output_ids, *want,
            "{what}: greedy ids differ from transformers"
        );
    }
    drop(engine);

    // spec-run stops at eos by default. With --chat over all four prompts (none meets eos in
    // 32 tokens), and raw over the two whose raw greedy output holds eos (one at its first
    // token), so that both finish reasons go through the binary.
    spec_run_matches(
        &engine_dir,
        tmp.path(),
        &codec,
        eos,
        &expected.prompts,
        true,
    );
    let with_eos: Vec<&SmolPrompt> = expected
        .prompts
        .iter()
        .filter(|p| p.raw.greedy.contains(&eos))
        .collect();
    assert_eq!(with_eos.len(), 2);
    spec_run_matches(&engine_dir, tmp.path(), &codec, eos, &with_eos, false);
}

/// Runs the spec-run binary on the prompts' texts (32 new tokens, greedy, stopping at eos)
/// and checks its --output_json records and console lines against the fixture: output_ids are
/// the greedy ids up to the first eos (included), output_text is their decoding.
fn spec_run_matches<P: std::borrow::Borrow<SmolPrompt>>(
    engine_dir: &Path,
    tmp: &Path,
    codec: &TextCodec,
    eos: u32,
    prompts: &[P],
    chat: bool,
) {
    let variant = if chat { "chat" } else { "raw" };
    let input = tmp.join(format!("prompts-{variant}.json"));
    let texts: Vec<&str> = prompts.iter().map(|p| p.borrow().text.as_str()).collect();
    std::fs::write(&input, serde_json::to_string(&texts).unwrap()).unwrap();
    let json_path = tmp.join(format!("out-{variant}.json"));
    let max_output_len = NEW_TOKENS.to_string();
    let mut args = vec![
        "--engine_dir",
        s(engine_dir),
        "--input_file",
        s(&input),
        "--max_output_len",
        &max_output_len,
        "--output_json",
        s(&json_path),
    ];
    if chat {
        args.push("--chat");
    }
    let out = spec_run(&args);
    assert!(out.status.success(), "spec-run failed: {}", stderr(&out));
    let doc: serde_json::Value = read_json(&json_path);
    let records = doc["outputs"].as_array().expect("outputs is a list");
    assert_eq!(records.len(), prompts.len());
    let console = stdout(&out);
    for (i, (p, rec)) in prompts.iter().zip(records).enumerate() {
        let p = p.borrow();
        let (prompt_ids, reference) = if chat {
            (&p.templated_ids, &p.templated)
        } else {
            (&p.raw_ids, &p.raw)
        };
        let what = format!("spec-run {variant} prompt {i} ({:?})", p.text);
        let greedy = &reference.greedy;
        let stop = greedy.iter().position(|&t| t == eos);
        let want = &greedy[..stop.map_or(greedy.len(), |k| k + 1)];
        let ids: Vec<u32> = serde_json::from_value(rec["output_ids"].clone()).unwrap();
        assert_eq!(ids, want, "{what}: output_ids");
        let input_ids: Vec<u32> = serde_json::from_value(rec["input_ids"].clone()).unwrap();
        assert_eq!(&input_ids, prompt_ids, "{what}: input_ids");
        assert_eq!(rec["input_text"], p.text.as_str(), "{what}");
        let text = codec.decode(want).unwrap();
        assert_eq!(rec["output_text"], text.as_str(), "{what}: output_text");
        // transformers decoded all 32 ids keeping special tokens; spec-run skips them.
        let shown = reference.greedy_text.replace("<|im_end|>", "");
        assert!(
            shown.starts_with(&text),
            "{what}: {text:?} is not a prefix of transformers' {:?}",
            reference.greedy_text
        );
        let reason = if stop.is_some() { "stop" } else { "length" };
        assert_eq!(rec["finish_reason"], reason, "{what}");
        assert!(
            console.contains(&format!("Output [Text {i} Beam 0]: {text:?}\n")),
            "{what}: {console}"
        );
    }
}

/// Prompt lookup on SmolLM2 backed by the shipped n-gram corpus of its own answers
/// (heads/smollm2-ngram): the corpus loads with SmolLM2's vocabulary, drafts are accepted,
/// and the tokens are still transformers' greedy ones for the chat-templated prompts.
#[test]
fn smollm2_prompt_lookup_with_the_shipped_corpus_keeps_transformers_greedy() {
    use kestrel_runtime::ngram_corpus::load_ngram_corpus;
    let expected: SmolExpected = read_json(&fixture("smollm2/expected.json"));
    let tmp = tempfile::tempdir().unwrap();
    let engine_dir = smollm2_engine(
        tmp.path(),
        &[
            "--max_input_len",
            "128",
            "--max_seq_len",
            "256",
            "--speculative_decoding_mode",
            "draft_tokens_external",
            "--max_draft_len",
            "4",
        ],
    );
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let corpus_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("heads/smollm2-ngram/corpus.safetensors");
    let corpus = load_ngram_corpus(&corpus_path, engine.config.vocab_size).unwrap();
    assert!(corpus.tokens() > 1_000_000, "{} tokens", corpus.tokens());
    let prompts: Vec<Vec<u32>> = expected
        .prompts
        .iter()
        .map(|p| p.templated_ids.clone())
        .collect();
    let mode = DecodeMode::PromptLookup {
        lookup: PromptLookup {
            config: kestrel_spec::PromptLookupConfig::new(4, 3).unwrap(),
            corpus: Some(std::sync::Arc::new(corpus)),
        },
        disable_by_batch_size: None,
    };
    let (outputs, _) = generate(
        &engine,
        &mode,
        &prompts,
        &greedy_params(vec![]),
        &mut NoSink,
    )
    .unwrap();
    for (i, (out, p)) in outputs.iter().zip(&expected.prompts).enumerate() {
        assert_eq!(
            out.output_ids, p.templated.greedy,
            "prompt {i}: prompt lookup's ids differ from transformers' greedy ids"
        );
    }
    let accepted: usize = outputs.iter().map(|o| o.stats.accepted_draft_tokens).sum();
    let steps: usize = outputs.iter().map(|o| o.stats.steps).sum();
    assert!(
        accepted * 2 > steps,
        "{accepted} drafts accepted in {steps} steps"
    );
}

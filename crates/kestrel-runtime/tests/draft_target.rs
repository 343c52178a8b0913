//! Draft-target decoding on tiny random engines built in a temporary directory:
//! greedy output equals plain greedy output token for token (identical and weak drafts,
//! several draft lengths, long generations, end ids), sampled output follows the target's
//! distribution (chi-square against exact marginals), and incompatible engines are refused
//! with exact messages.

mod support;

use candle_core::{Device, Tensor};
use kestrel_build::{build_engine, AttentionKernel, BuildOptions, GemmPlugin, TargetDevice};
use kestrel_core::checkpoint::{
    checkpoint_config_json, CheckpointMeta, CHECKPOINT_FORMAT, CHECKPOINT_VERSION,
};
use kestrel_core::{DType, Mapping, ModelConfig, SpeculativeMode};
use kestrel_model::llama::random_tensors;
use kestrel_runtime::{
    generate, DecodeMode, DraftTargetOptions, Engine, FinishReason, GenerationParams, NoSink,
    PromptLookup, SequenceOutput, TokenSink,
};
use kestrel_spec::{PromptLookupConfig, SamplingParams};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

const VOCAB: usize = 64;

fn model_cfg(vocab: usize, hidden: usize, layers: usize, heads: usize, kv: usize) -> ModelConfig {
    serde_json::from_str(&format!(
        r#"{{"vocab_size": {vocab}, "hidden_size": {hidden}, "intermediate_size": {},
            "num_hidden_layers": {layers}, "num_attention_heads": {heads},
            "num_key_value_heads": {kv}, "rms_norm_eps": 1e-5, "tie_word_embeddings": false}}"#,
        hidden * 2
    ))
    .unwrap()
}

fn target_cfg(vocab: usize) -> ModelConfig {
    model_cfg(vocab, 32, 2, 4, 2)
}

/// A smaller, differently shaped draft model.
fn weak_cfg(vocab: usize) -> ModelConfig {
    model_cfg(vocab, 16, 1, 2, 1)
}

struct Spec {
    mode: SpeculativeMode,
    max_draft_len: Option<usize>,
    max_batch_size: usize,
    max_seq_len: usize,
    tokenizer: Option<&'static str>,
}

const PLAIN: Spec = Spec {
    mode: SpeculativeMode::None,
    max_draft_len: None,
    max_batch_size: 4,
    max_seq_len: 256,
    tokenizer: None,
};

fn target_spec(max_draft_len: usize) -> Spec {
    Spec {
        mode: SpeculativeMode::DraftTokensExternal,
        max_draft_len: Some(max_draft_len),
        ..PLAIN
    }
}

/// Writes a checkpoint (config.json + rank0.safetensors of random weights) and builds it.
fn build(root: &Path, name: &str, cfg: &ModelConfig, seed: u64, spec: &Spec) -> PathBuf {
    let ckpt = root.join(format!("{name}-ckpt"));
    std::fs::create_dir_all(&ckpt).unwrap();
    let meta = CheckpointMeta {
        format: CHECKPOINT_FORMAT.into(),
        version: CHECKPOINT_VERSION,
        dtype: DType::F32,
        mapping: Mapping::new(1),
        source_files: vec![],
        eagle: None,
    };
    std::fs::write(ckpt.join("config.json"), checkpoint_config_json(cfg, &meta)).unwrap();
    let tensors: HashMap<String, Tensor> = random_tensors(cfg, seed).unwrap().into_iter().collect();
    candle_core::safetensors::save(&tensors, ckpt.join("rank0.safetensors")).unwrap();
    if let Some(tok) = spec.tokenizer {
        std::fs::write(ckpt.join("tokenizer.json"), tok).unwrap();
    }
    let out = root.join(name);
    build_engine(&BuildOptions {
        checkpoint_dir: ckpt,
        output_dir: out.clone(),
        max_batch_size: spec.max_batch_size,
        max_input_len: 64,
        max_seq_len: spec.max_seq_len,
        max_beam_width: 1,
        speculative_mode: spec.mode,
        max_draft_len: spec.max_draft_len,
        tokens_per_block: 8,
        use_paged_context_fmha: true,
        gemm_plugin: GemmPlugin::Auto,
        attention_kernel: AttentionKernel::Scalar,
        target_device: TargetDevice::Cpu,
        eagle_choices: None,
    })
    .unwrap();
    out
}

fn load(dir: &Path) -> Engine {
    Engine::load(dir, &Device::Cpu).unwrap()
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![1, 2, 3],
        vec![5, 17, 42, 8, 8, 30, 61, 2, 9, 11, 40],
        vec![7, 3, 9, 30, 2, 4, 8, 50],
    ]
}

fn greedy(max_output_len: usize, end_ids: Vec<u32>) -> GenerationParams {
    GenerationParams {
        max_output_len,
        sampling: SamplingParams::greedy(),
        end_ids,
    }
}

fn dt(draft: &Engine, draft_len: usize, use_logits: bool) -> DecodeMode<'_> {
    DecodeMode::DraftTarget {
        draft,
        options: DraftTargetOptions {
            draft_len,
            use_logits,
            disable_by_batch_size: None,
        },
    }
}

fn run(
    target: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
) -> Vec<SequenceOutput> {
    generate(target, mode, prompts, params, &mut NoSink)
        .unwrap()
        .0
}

fn ids(outs: &[SequenceOutput]) -> Vec<Vec<u32>> {
    outs.iter().map(|o| o.output_ids.clone()).collect()
}

fn check_stats(outs: &[SequenceOutput], what: &str) {
    for (i, o) in outs.iter().enumerate() {
        let s = &o.stats;
        assert!(
            s.accepted_draft_tokens <= s.draft_tokens,
            "{what} seq {i}: {s:?}"
        );
        let committed: usize = s
            .accepted_len_histogram
            .iter()
            .enumerate()
            .map(|(k, n)| (k + 1) * n)
            .sum();
        assert_eq!(committed + 1, o.output_ids.len(), "{what} seq {i}: {s:?}");
        assert_eq!(s.steps, s.accepted_len_histogram.iter().sum::<usize>());
    }
}

/// Decodes `prompts` with `mode`, asserts the output is plain decoding's (`plain`) and the
/// stats add up; returns the drafts accepted and drafted over all sequences.
fn assert_lossless(
    target: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    plain: &[SequenceOutput],
    what: &str,
) -> (usize, usize) {
    let outs = run(target, mode, prompts, params);
    assert_eq!(ids(&outs), ids(plain), "{what}");
    check_stats(&outs, what);
    outs.iter().fold((0, 0), |(a, d), o| {
        (a + o.stats.accepted_draft_tokens, d + o.stats.draft_tokens)
    })
}

#[derive(Default)]
struct Collect(HashMap<usize, Vec<u32>>);

impl TokenSink for Collect {
    fn on_tokens(&mut self, seq_index: usize, tokens: &[u32]) {
        self.0
            .entry(seq_index)
            .or_default()
            .extend_from_slice(tokens);
    }
}

/// (a), (b), (g): identical and weak drafts, draft_len 1, 3, 5, use_logits either way, a
/// batch of three prompts of different lengths: exactly plain greedy's tokens.
#[test]
fn greedy_equals_plain_greedy() {
    let root = tempfile::tempdir().unwrap();
    let target = load(&build(
        root.path(),
        "target",
        &target_cfg(VOCAB),
        1,
        &target_spec(5),
    ));
    let same = load(&build(root.path(), "same", &target_cfg(VOCAB), 1, &PLAIN));
    let weak = load(&build(root.path(), "weak", &weak_cfg(VOCAB), 99, &PLAIN));
    let params = greedy(40, vec![]);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);
    assert!(plain.iter().all(|o| o.output_ids.len() == 40));
    for draft_len in [1, 3, 5] {
        for (name, draft) in [("identical", &same), ("weak", &weak)] {
            for use_logits in [false, true] {
                let what = format!("{name} draft, draft_len {draft_len}, use_logits {use_logits}");
                let mut sink = Collect::default();
                let (outs, timings) = generate(
                    &target,
                    &dt(draft, draft_len, use_logits),
                    &prompts(),
                    &params,
                    &mut sink,
                )
                .unwrap();
                assert_eq!(ids(&outs), ids(&plain), "{what}");
                for (i, o) in outs.iter().enumerate() {
                    assert_eq!(sink.0[&i], o.output_ids, "{what}: streamed tokens");
                    assert_eq!(o.finish_reason, FinishReason::Length);
                    assert!(o.stats.time_to_first_token_s > 0.0);
                }
                check_stats(&outs, &what);
                assert!(timings.draft_s > 0.0 && timings.verify_s > 0.0 && timings.prefill_s > 0.0);
                assert_eq!(timings.generated_tokens, 120);
                if name == "identical" {
                    for o in &outs {
                        // Every draft is accepted: only the length limit cuts a step short.
                        assert_eq!(
                            o.stats.accepted_draft_tokens, o.stats.draft_tokens,
                            "{what}"
                        );
                        assert!(o.stats.tokens_per_step > 1.5, "{what}: {:?}", o.stats);
                        if draft_len == 5 {
                            assert!(o.stats.tokens_per_step > 5.0, "{what}: {:?}", o.stats);
                        }
                    }
                }
            }
        }
    }
}

/// (d): a long generation with a weak draft (many rejections and rollbacks) and one with
/// end ids that fire inside an accepted run of drafts.
#[test]
fn long_generation_and_end_ids_match_plain() {
    let root = tempfile::tempdir().unwrap();
    let target = load(&build(
        root.path(),
        "target",
        &target_cfg(VOCAB),
        3,
        &target_spec(4),
    ));
    let weak = load(&build(root.path(), "weak", &weak_cfg(VOCAB), 5, &PLAIN));
    let same = load(&build(root.path(), "same", &target_cfg(VOCAB), 3, &PLAIN));
    let long = greedy(150, vec![]);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &long);
    let spec = run(&target, &dt(&weak, 4, false), &prompts(), &long);
    assert_eq!(ids(&spec), ids(&plain));
    assert!(spec.iter().all(|o| o.output_ids.len() == 150));
    check_stats(&spec, "long weak");
    let rejected: usize = spec
        .iter()
        .map(|o| o.stats.draft_tokens - o.stats.accepted_draft_tokens)
        .sum();
    assert!(rejected > 0, "the weak draft should be rejected sometimes");

    // An end id taken from the middle of each plain output.
    let end_ids: Vec<u32> = plain.iter().map(|o| o.output_ids[20]).collect();
    let params = greedy(60, end_ids);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);
    for draft in [&same, &weak] {
        let spec = run(&target, &dt(draft, 4, true), &prompts(), &params);
        assert_eq!(ids(&spec), ids(&plain));
        for (s, p) in spec.iter().zip(&plain) {
            assert_eq!(s.finish_reason, p.finish_reason);
            assert_eq!(s.finish_reason, FinishReason::Stop);
        }
        check_stats(&spec, "end ids");
    }

    // max_output_len 1 and 2: the first token comes from the prompt; no draft is needed.
    for n in [1, 2] {
        let params = greedy(n, vec![]);
        let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);
        let spec = run(&target, &dt(&same, 4, false), &prompts(), &params);
        assert_eq!(ids(&spec), ids(&plain));
    }
}

/// Wilson–Hilferty approximation of the chi-square quantile at standard-normal quantile `z`.
fn chi2_quantile(df: usize, z: f64) -> f64 {
    let d = df as f64;
    let a = 2.0 / (9.0 * d);
    d * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Chi-square goodness of fit with cells of expected count < 5 pooled; panics beyond the
/// p = 1e-4 critical value.
fn assert_fits(counts: &[usize], expected: &[f64], what: &str) {
    let n: usize = counts.iter().sum();
    let mut stat = 0.0;
    let mut cells = 0usize;
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(expected) {
        let e = p * n as f64;
        if e < 5.0 {
            pooled_obs += c as f64;
            pooled_exp += e;
            assert!(p > 0.0 || c == 0, "{what}: impossible token drawn");
            continue;
        }
        stat += (c as f64 - e).powi(2) / e;
        cells += 1;
    }
    if pooled_exp > 0.0 {
        stat += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        cells += 1;
    }
    let crit = chi2_quantile(cells.saturating_sub(1).max(1), 3.719);
    assert!(
        stat < crit,
        "{what}: chi-square {stat:.1} ≥ {crit:.1} ({cells} cells)\ncounts {counts:?}\nexpected {:?}",
        expected.iter().map(|p| p * n as f64).collect::<Vec<_>>()
    );
}

fn argmax_f64(p: &[f64]) -> u32 {
    (0..p.len()).fold(0, |b, i| if p[i] > p[b] { i } else { b }) as u32
}

/// (c): sampled draft-target decoding keeps the target's distribution: the marginals of the
/// first three generated tokens (the first from the prompt, the second and third from the
/// first speculative step with draft_len 2: accepted drafts, residual corrections or bonus
/// tokens) fit the exact marginals computed from the target's logits.
#[test]
fn sampled_tokens_follow_the_target_distribution() {
    const V: usize = 16;
    const N: usize = 5000;
    let root = tempfile::tempdir().unwrap();
    let big = Spec {
        max_batch_size: 100,
        max_seq_len: 128,
        ..target_spec(2)
    };
    let target = load(&build(root.path(), "target", &target_cfg(V), 11, &big));
    let draft_spec = Spec {
        max_batch_size: 100,
        max_seq_len: 128,
        ..PLAIN
    };
    let draft = load(&build(root.path(), "draft", &weak_cfg(V), 12, &draft_spec));
    let prompt = vec![3u32, 1, 4, 1, 5];
    let sampling = SamplingParams {
        temperature: 0.9,
        top_k: 12,
        top_p: 0.97,
        seed: 2024,
    };

    // Exact marginals of tokens 1, 2 and 3.
    let p1 = support::next_probs(&target, &prompt, &sampling);
    let mut p2 = vec![0.0; V];
    let mut p3 = vec![0.0; V];
    for (a, &pa) in p1.iter().enumerate().filter(|(_, &p)| p > 0.0) {
        let mut seq = prompt.clone();
        seq.push(a as u32);
        let pb = support::next_probs(&target, &seq, &sampling);
        for (b, &pab) in pb.iter().enumerate().filter(|(_, &p)| p > 0.0) {
            p2[b] += pa * pab;
            seq.push(b as u32);
            for (c, &pc) in support::next_probs(&target, &seq, &sampling)
                .iter()
                .enumerate()
            {
                p3[c] += pa * pab * pc;
            }
            seq.pop();
        }
    }
    // The draft disagrees with the target often enough for rejections to matter.
    let likely = [prompt.clone(), vec![argmax_f64(&p1)]].concat();
    let (p, q) = (
        support::next_probs(&target, &likely, &sampling),
        support::next_probs(&draft, &likely, &sampling),
    );
    let tv: f64 = p.iter().zip(&q).map(|(a, b)| (a - b).abs()).sum::<f64>() / 2.0;
    assert!(tv > 0.1, "draft too close to the target (TV {tv})");

    let prompts = vec![prompt.clone(); N];
    let params = GenerationParams {
        max_output_len: 4,
        sampling,
        end_ids: vec![],
    };
    for use_logits in [true, false] {
        let outs = run(&target, &dt(&draft, 2, use_logits), &prompts, &params);
        check_stats(&outs, "sampled");
        let mut counts = vec![vec![0usize; V]; 3];
        for o in &outs {
            for (pos, &t) in o.output_ids.iter().take(3).enumerate() {
                counts[pos][t as usize] += 1;
            }
        }
        let accepted: usize = outs.iter().map(|o| o.stats.accepted_draft_tokens).sum();
        let drafted: usize = outs.iter().map(|o| o.stats.draft_tokens).sum();
        assert!(
            accepted > 0 && accepted < drafted,
            "use_logits {use_logits}: accepted {accepted} of {drafted}"
        );
        for (pos, exact) in [&p1, &p2, &p3].into_iter().enumerate() {
            assert_fits(
                &counts[pos],
                exact,
                &format!("use_logits {use_logits}, token {}", pos + 1),
            );
        }
    }
    // The same seed gives the same tokens.
    let a = run(&target, &dt(&draft, 2, true), &prompts[..8], &params);
    let b = run(&target, &dt(&draft, 2, true), &prompts[..8], &params);
    assert_eq!(ids(&a), ids(&b));
}

fn err(target: &Engine, mode: &DecodeMode) -> String {
    generate(target, mode, &prompts(), &greedy(4, vec![]), &mut NoSink)
        .unwrap_err()
        .to_string()
}

fn tokenizer_json(vocab: &[(&str, u32)]) -> String {
    let entries: Vec<String> = vocab.iter().map(|(t, i)| format!("\"{t}\": {i}")).collect();
    format!(
        r#"{{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {{"type": "Whitespace"}}, "post_processor": null,
            "decoder": null, "model": {{"type": "WordLevel", "vocab": {{{}}}, "unk_token": "a"}}}}"#,
        entries.join(", ")
    )
}

/// (e), (f) and the other construction checks, with their exact messages.
#[test]
fn incompatible_engines_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let target_dir = build(r, "target", &target_cfg(VOCAB), 1, &target_spec(3));
    let target = load(&target_dir);
    let draft = load(&build(r, "draft", &weak_cfg(VOCAB), 2, &PLAIN));

    // (e) vocab sizes differ.
    let other_dir = build(r, "other", &weak_cfg(48), 2, &PLAIN);
    let other = load(&other_dir);
    assert_eq!(
        err(&target, &dt(&other, 2, false)),
        format!(
            "the draft engine {} has vocab_size 48 but the target engine {} has vocab_size 64: draft-target decoding needs both models to share one vocabulary",
            other_dir.display(),
            target_dir.display()
        )
    );

    // (f) draft_len beyond the target's max_draft_len, and 0.
    assert_eq!(
        err(&target, &dt(&draft, 4, false)),
        "--draft_target_model_config: draft_len 4 exceeds the target engine's max_draft_len 3: lower draft_len or rebuild the target with --speculative_decoding_mode draft_tokens_external --max_draft_len 4"
    );
    assert_eq!(
        err(&target, &dt(&draft, 0, true)),
        "--draft_target_model_config: draft_len must be at least 1"
    );

    // A target built without draft_tokens_external.
    let plain_dir = build(r, "plain-target", &target_cfg(VOCAB), 1, &PLAIN);
    let plain_target = load(&plain_dir);
    assert_eq!(
        err(&plain_target, &dt(&draft, 2, false)),
        format!(
            "{}: the target engine was built with --speculative_decoding_mode none, but draft-target decoding needs a target that verifies drafts: rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len K (or for EAGLE)",
            plain_dir.display()
        )
    );

    // A draft engine that is not plain.
    let spec_draft_dir = build(r, "spec-draft", &weak_cfg(VOCAB), 2, &target_spec(2));
    let spec_draft = load(&spec_draft_dir);
    assert_eq!(
        err(&target, &dt(&spec_draft, 2, false)),
        format!(
            "{}: the draft engine was built with --speculative_decoding_mode draft_tokens_external: build the draft as a plain engine (--speculative_decoding_mode none)",
            spec_draft_dir.display()
        )
    );

    // A draft built for smaller batches or shorter sequences than the target.
    let small_dir = build(
        r,
        "small-draft",
        &weak_cfg(VOCAB),
        2,
        &Spec {
            max_batch_size: 2,
            ..PLAIN
        },
    );
    assert_eq!(
        err(&target, &dt(&load(&small_dir), 2, false)),
        format!(
            "{}: the draft engine was built with --max_batch_size 2, smaller than the target engine's 4: rebuild the draft with --max_batch_size 4",
            small_dir.display()
        )
    );
    let short_dir = build(
        r,
        "short-draft",
        &weak_cfg(VOCAB),
        2,
        &Spec {
            max_seq_len: 128,
            ..PLAIN
        },
    );
    assert_eq!(
        err(&target, &dt(&load(&short_dir), 2, false)),
        format!(
            "{}: the draft engine was built with --max_seq_len 128, smaller than the target engine's 256: rebuild the draft with --max_seq_len 256",
            short_dir.display()
        )
    );
}

/// (e) for tokenizers: when both engines carry tokenizer.json, their vocabularies must agree
/// (formatting differences do not matter).
#[test]
fn tokenizer_vocabularies_must_agree() {
    let root = tempfile::tempdir().unwrap();
    let r = root.path();
    let tok = tokenizer_json(&[("a", 0), ("b", 1), ("c", 2)]);
    let same_vocab = tokenizer_json(&[("c", 2), ("a", 0), ("b", 1)]);
    let swapped = tokenizer_json(&[("a", 1), ("b", 0), ("c", 2)]);
    let leak = |s: String| -> &'static str { Box::leak(s.into_boxed_str()) };
    let with_tok = |t: &'static str| Spec {
        tokenizer: Some(t),
        ..PLAIN
    };
    let target_dir = build(
        r,
        "target",
        &target_cfg(VOCAB),
        1,
        &Spec {
            tokenizer: Some(leak(tok)),
            ..target_spec(2)
        },
    );
    let target = load(&target_dir);
    let ok = load(&build(
        r,
        "ok",
        &weak_cfg(VOCAB),
        2,
        &with_tok(leak(same_vocab)),
    ));
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &greedy(8, vec![]));
    let spec = run(&target, &dt(&ok, 2, false), &prompts(), &greedy(8, vec![]));
    assert_eq!(ids(&spec), ids(&plain));

    let bad_dir = build(r, "bad", &weak_cfg(VOCAB), 2, &with_tok(leak(swapped)));
    assert_eq!(
        err(&target, &dt(&load(&bad_dir), 2, false)),
        format!(
            "{} and {} have different vocabularies (token \"a\" is id 1 in the draft and id 0 in the target): draft-target decoding needs both models to share one tokenizer",
            bad_dir.join("tokenizer.json").display(),
            target_dir.join("tokenizer.json").display()
        )
    );
}

fn lookup(num_tokens: usize, max_ngram: usize) -> DecodeMode<'static> {
    lookup_mode(PromptLookup {
        config: PromptLookupConfig::new(num_tokens, max_ngram).unwrap(),
        corpus: None,
    })
}

/// Prompt lookup decoding with `lookup`, always speculating.
fn lookup_mode(lookup: PromptLookup) -> DecodeMode<'static> {
    DecodeMode::PromptLookup {
        lookup,
        disable_by_batch_size: None,
    }
}

/// The target of the prompt lookup tests, built to verify up to `max_draft_len` drafts.
fn lookup_target(root: &Path, max_draft_len: usize) -> Engine {
    load(&build(
        root,
        "target",
        &target_cfg(VOCAB),
        1,
        &target_spec(max_draft_len),
    ))
}

/// Prompts that repeat themselves, so that lookups find drafts from the first step.
fn repetitive_prompts() -> Vec<Vec<u32>> {
    vec![
        vec![4, 9, 16, 25, 36, 4, 9, 16, 25, 36, 4, 9],
        vec![5, 17, 42, 8, 8, 30, 61, 2, 9, 11, 40],
        vec![7, 3, 7, 3, 7, 3, 7],
    ]
}

/// Prompt lookup through the draft-target loop: plain greedy's tokens exactly, batched and
/// alone, for several draft and n-gram sizes, with drafts that are accepted and drafts that
/// are not.
#[test]
fn prompt_lookup_greedy_equals_plain_greedy() {
    let root = tempfile::tempdir().unwrap();
    let target = lookup_target(root.path(), 8);
    let params = greedy(40, vec![]);
    let prompts = repetitive_prompts();
    let plain = run(&target, &DecodeMode::Plain, &prompts, &params);
    for (k, n) in [(1, 1), (4, 3), (8, 2)] {
        let what = format!("prompt lookup [{k},{n}]");
        let outs = run(&target, &lookup(k, n), &prompts, &params);
        assert_eq!(ids(&outs), ids(&plain), "{what}");
        check_stats(&outs, &what);
        let drafted: usize = outs.iter().map(|o| o.stats.draft_tokens).sum();
        let accepted: usize = outs.iter().map(|o| o.stats.accepted_draft_tokens).sum();
        assert!(
            accepted > 0 && accepted < drafted,
            "{what}: accepted {accepted} of {drafted}"
        );
        for (i, p) in prompts.iter().enumerate() {
            let alone = run(&target, &lookup(k, n), std::slice::from_ref(p), &params);
            assert_eq!(
                alone[0].output_ids, plain[i].output_ids,
                "{what}, prompt {i} alone"
            );
        }
    }
}

/// Sampled prompt lookup takes the target's own token at every position from the sequence's
/// stream, one uniform a committed token, as plain sampling does: the same seed gives plain
/// sampling's tokens.
#[test]
fn prompt_lookup_sampled_equals_plain_sampled() {
    let root = tempfile::tempdir().unwrap();
    let target = lookup_target(root.path(), 4);
    let params = GenerationParams {
        max_output_len: 40,
        sampling: SamplingParams {
            temperature: 0.7,
            top_k: 20,
            top_p: 0.95,
            seed: 7,
        },
        end_ids: vec![],
    };
    let prompts = repetitive_prompts();
    let plain = run(&target, &DecodeMode::Plain, &prompts, &params);
    let outs = run(&target, &lookup(4, 3), &prompts, &params);
    assert_eq!(ids(&outs), ids(&plain));
    let accepted: usize = outs.iter().map(|o| o.stats.accepted_draft_tokens).sum();
    assert!(accepted > 0, "no draft was accepted");
}

#[test]
fn prompt_lookup_needs_an_engine_that_verifies_drafts() {
    let root = tempfile::tempdir().unwrap();
    let plain_dir = build(root.path(), "plain", &target_cfg(VOCAB), 1, &PLAIN);
    let plain = load(&plain_dir);
    assert_eq!(
        err(&plain, &lookup(4, 3)),
        format!(
            "{}: the engine was built with --speculative_decoding_mode none, but prompt lookup decoding verifies drafts: rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len 4",
            plain_dir.display()
        )
    );
    let target = lookup_target(root.path(), 3);
    assert_eq!(
        err(&target, &lookup(4, 3)),
        "--prompt_lookup_config: prompt_lookup_num_tokens 4 exceeds the engine's max_draft_len 3: lower it or rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len 4"
    );
}

/// Backed by an n-gram model of the plain answers themselves (written and loaded through the
/// corpus file), prompt lookup drafts far more of them, and the output is still plain
/// greedy's.
#[test]
fn prompt_lookup_with_a_corpus_drafts_from_it_and_keeps_plain_output() {
    use kestrel_runtime::ngram_corpus::{load_ngram_corpus, write_ngram_corpus};
    let root = tempfile::tempdir().unwrap();
    let target = lookup_target(root.path(), 4);
    let params = greedy(40, vec![]);
    let prompts = prompts();
    let plain = run(&target, &DecodeMode::Plain, &prompts, &params);
    let answers: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&plain)
        .map(|(p, o)| [p.clone(), o.output_ids.clone()].concat())
        .collect();
    let path = root.path().join("corpus.safetensors");
    write_ngram_corpus(&path, &answers).unwrap();
    let corpus = std::sync::Arc::new(load_ngram_corpus(&path, VOCAB).unwrap());
    let config = PromptLookupConfig::new(4, 3).unwrap();
    let with = run(
        &target,
        &lookup_mode(PromptLookup {
            config,
            corpus: Some(corpus),
        }),
        &prompts,
        &params,
    );
    let without = run(&target, &lookup(4, 3), &prompts, &params);
    assert_eq!(ids(&with), ids(&plain));
    assert_eq!(ids(&without), ids(&plain));
    check_stats(&with, "with a corpus");
    let accepted = |outs: &[SequenceOutput]| -> usize {
        outs.iter().map(|o| o.stats.accepted_draft_tokens).sum()
    };
    assert!(
        accepted(&with) > accepted(&without) + 20,
        "with the corpus {} accepted, without {}",
        accepted(&with),
        accepted(&without)
    );
}

/// A shape whose projections are all 4-bit quantizable (rows of 64 and 128).
fn quantizable_cfg(vocab: usize) -> ModelConfig {
    model_cfg(vocab, 64, 2, 4, 2)
}

/// A 2-layer target of [`quantizable_cfg`], built in `root`.
fn quantizable_target(root: &Path) -> Engine {
    load(&build(
        root,
        "target",
        &quantizable_cfg(VOCAB),
        3,
        &target_spec(4),
    ))
}

/// The target's own weights at 4 bits (its LM head at 8) as its draft
/// (`Engine::self_draft`): the output is
/// plain greedy decoding's, the draft is really another model (its logits differ from the
/// target's), and it agrees with the target far more often than chance.
#[test]
fn a_4_bit_copy_of_the_target_drafts_for_it() {
    let root = tempfile::tempdir().unwrap();
    let target = quantizable_target(root.path());
    let (draft, bytes) = target.self_draft(true, &[]).unwrap();
    // Per layer: q/k/v, o and gate/up of 64 inputs, down of 128: 64·(128 + 64 + 256) + 64·128
    // weights at half a byte; the LM head's VOCAB·64 at a byte; two f16 per 32 weights.
    let weights = 64 * (128 + 64 + 256) + 64 * 128;
    let head = VOCAB * 64;
    assert_eq!(
        bytes,
        2 * (weights / 2 + 4 * weights / 32) + head + 4 * head / 32
    );

    let prompt = [5u32, 17, 9, 40];
    let unwarped = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let probs = |e: &Engine| support::next_probs(e, &prompt, &unwarped);
    let (full, quantized) = (probs(&target), probs(&draft));
    assert_ne!(full, quantized, "the draft computes with other weights");

    let params = greedy(40, vec![]);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);
    for draft_len in [1, 4] {
        for use_logits in [false, true] {
            let what = format!("4-bit draft, draft_len {draft_len}, use_logits {use_logits}");
            let mode = dt(&draft, draft_len, use_logits);
            let (accepted, drafted) =
                assert_lossless(&target, &mode, &prompts(), &params, &plain, &what);
            assert!(
                accepted * 2 > drafted,
                "{what}: {accepted} of {drafted} drafts accepted"
            );
        }
    }
}

/// The target's quantized copy drafts over the target's own KV cache: no pool and no prompt
/// pass of its own, and the output is still plain greedy decoding's. The same copy marked as
/// an unrelated engine keeps a cache of its own (the general draft-target path), as before.
#[test]
fn a_4_bit_copy_of_the_target_drafts_over_the_targets_cache() {
    let root = tempfile::tempdir().unwrap();
    let target = quantizable_target(root.path());
    let (shared, _) = target.self_draft(true, &[]).unwrap();
    assert_eq!(shared.derived_from.as_deref(), Some(target.dir.as_path()));
    let (mut own, _) = target.self_draft(true, &[]).unwrap();
    own.derived_from = None;

    let params = greedy(40, vec![]);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);
    let prompt_tokens: usize = prompts().iter().map(Vec::len).sum();
    for draft_len in [1, 3] {
        let both = [
            (&shared, "shared cache", vec![("target", prompt_tokens)]),
            (
                &own,
                "own cache",
                vec![("target", prompt_tokens), ("draft", prompt_tokens)],
            ),
        ];
        for (draft, how, want) in both {
            let mode = dt(draft, draft_len, false);
            let (outs, timings) =
                generate(&target, &mode, &prompts(), &params, &mut NoSink).unwrap();
            let what = format!("{how}, draft_len {draft_len}");
            assert_eq!(ids(&outs), ids(&plain), "{what}");
            check_stats(&outs, &what);
            let pools: Vec<(&str, usize)> = timings
                .kv_pools
                .iter()
                .map(|p| (p.name, p.prefilled_prompt_tokens))
                .collect();
            assert_eq!(pools, want, "{what}");
        }
    }
}

/// The target's own engine as its draft, derived with no weight of its own
/// (`Engine::self_draft`): as itself (nothing skipped, nothing quantized) over the target's
/// cache it drafts exactly the target's tokens, so every draft is accepted; skipping a layer
/// (alone, and at 4 bits) it is another model (its probabilities differ), and the output is
/// still plain greedy decoding's, token matching and speculative sampling alike.
#[test]
fn the_target_skipping_layers_drafts_for_it_over_its_cache() {
    let root = tempfile::tempdir().unwrap();
    let target = quantizable_target(root.path());
    let params = greedy(40, vec![]);
    let plain = run(&target, &DecodeMode::Plain, &prompts(), &params);

    let (itself, bytes) = target.self_draft(false, &[]).unwrap();
    assert_eq!(bytes, 0);
    let outs = run(&target, &dt(&itself, 3, false), &prompts(), &params);
    assert_eq!(ids(&outs), ids(&plain), "the target drafting as itself");
    check_stats(&outs, "the target drafting as itself");
    for o in &outs {
        assert_eq!(
            o.stats.accepted_draft_tokens, o.stats.draft_tokens,
            "{:?}",
            o.stats
        );
        assert!(o.stats.tokens_per_step > 3.0, "{:?}", o.stats);
    }

    let prompt = [5u32, 17, 9, 40];
    let unwarped = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let full = support::next_probs(&target, &prompt, &unwarped);
    for quantize in [false, true] {
        let (draft, _) = target.self_draft(quantize, &[1]).unwrap();
        assert_eq!(draft.model.layer_ids(), &[0]);
        let what = format!("skipping layer 1, quantized {quantize}");
        assert_ne!(
            support::next_probs(&draft, &prompt, &unwarped),
            full,
            "{what}"
        );
        for (draft_len, use_logits) in [(1, false), (3, false), (3, true)] {
            let what = format!("{what}, draft_len {draft_len}, use_logits {use_logits}");
            let mode = dt(&draft, draft_len, use_logits);
            assert_lossless(&target, &mode, &prompts(), &params, &plain, &what);
        }
    }
}

/// An EAGLE engine verifies a self-draft's chain as a tree of one branch, so one engine serves
/// every mode: the target drafting as itself has every draft accepted, a copy skipping a
/// layer keeps plain greedy decoding's output, and the head is not used.
#[test]
fn an_eagle_engine_verifies_a_self_draft() {
    let dir = tempfile::tempdir().unwrap();
    let engine = support::random_head_engine(dir.path());
    assert_eq!(engine.plan.speculative_mode, SpeculativeMode::Eagle);
    let params = greedy(40, vec![]);
    let plain = run(&engine, &DecodeMode::Plain, &support::prompts(), &params);
    for skip in [vec![], vec![1]] {
        let (draft, _) = engine.self_draft(false, &skip).unwrap();
        let what = format!("skipping {skip:?}");
        let mode = dt(&draft, 3, false);
        let (accepted, drafted) =
            assert_lossless(&engine, &mode, &support::prompts(), &params, &plain, &what);
        if skip.is_empty() {
            assert_eq!(accepted, drafted, "{what}");
        } else {
            assert!(accepted < drafted, "{what}: {accepted} of {drafted}");
        }
    }
}

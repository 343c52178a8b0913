//! Decode and prefill speed of a SmolLM2-135M-shaped model (random f32 weights) on CPU.
//!
//! `cargo bench -p kestrel-model --bench decode`; set `KESTREL_BENCH_DTYPE=bf16|f16` for half
//! precision. Decode: one token (forward + logits) at batch 1 over a 100-token context, rolled
//! back after each step so the context stays fixed. Prefill: a 128-token prompt into an empty
//! sequence (forward + logits of the last row). Verify: 3 or 8 chained tokens after the same
//! context with every row's logits, the cost of a tree verification step. q4_draft: the 4-bit
//! self-draft's step over the same context, one row or two, back to back and (as the runtime
//! meets it) right after a target step.

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use kestrel_core::{DType, ModelConfig};
use kestrel_model::{Llama, OutputRows, PagedKvCache, SeqId, SeqInput};
use std::hint::black_box;

fn smollm2_cfg() -> ModelConfig {
    serde_json::from_str(
        r#"{"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": true,
            "max_position_embeddings": 8192}"#,
    )
    .expect("valid config")
}

/// `model`'s logits for `tokens` at `positions` after the first 100 tokens of `seq` (every
/// row's or the last's), the cache rolled back to those 100 afterwards.
fn step_after_context(
    model: &Llama,
    cache: &mut PagedKvCache,
    seq: SeqId,
    tokens: &[u32],
    positions: &[u32],
    output_rows: OutputRows,
) -> candle_core::Tensor {
    let h = model
        .forward(
            &[SeqInput {
                seq,
                tokens,
                positions,
                mask: None,
                output_rows,
            }],
            cache,
        )
        .expect("step");
    let logits = model.logits(&h).expect("logits");
    cache.truncate(seq, 100).expect("rollback");
    logits
}

/// Token 42 at position 100 after the context, the last row's logits (a decode or draft step).
fn one_token_step(model: &Llama, cache: &mut PagedKvCache, seq: SeqId) -> candle_core::Tensor {
    step_after_context(model, cache, seq, &[42], &[100], OutputRows::Last)
}

fn bench(c: &mut Criterion) {
    let dtype: DType = std::env::var("KESTREL_BENCH_DTYPE")
        .ok()
        .map(|s| s.parse().expect("KESTREL_BENCH_DTYPE"))
        .unwrap_or(DType::F32);
    let cfg = smollm2_cfg();
    let model = Llama::random(&cfg, 1, dtype, &Device::Cpu).expect("model");
    let mut cache = model.new_cache(64, 16).expect("cache");

    let ctx: Vec<u32> = (0..100u32).map(|i| (i * 7919) % 49152).collect();
    let ctx_pos: Vec<u32> = (0..100).collect();
    let seq = cache.add_sequence();
    model
        .forward(
            &[SeqInput {
                seq,
                tokens: &ctx,
                positions: &ctx_pos,
                mask: None,
                output_rows: OutputRows::Last,
            }],
            &mut cache,
        )
        .expect("context");

    let mut group = c.benchmark_group(format!("smollm2-135m-{dtype}"));
    group.sample_size(20);
    group.throughput(Throughput::Elements(1));
    group.bench_function("decode_b1_ctx100", |b| {
        b.iter(|| black_box(one_token_step(&model, &mut cache, seq)))
    });

    // A tree verification's cost over the decode step above: T chained tokens, every row's
    // logits (as acceptance needs them), rolled back the same way.
    for t in [3usize, 8] {
        let tokens: Vec<u32> = (0..t as u32).map(|i| 42 + i).collect();
        let positions: Vec<u32> = (100..100 + t as u32).collect();
        group.bench_function(format!("verify_{t}_ctx100"), |b| {
            b.iter(|| {
                black_box(step_after_context(
                    &model,
                    &mut cache,
                    seq,
                    &tokens,
                    &positions,
                    OutputRows::All,
                ))
            })
        });
    }

    // The 4-bit self-draft's steps (`Llama::with_quantized_draft_weights`, as
    // `--draft_quantization q4` drafts): one row as a draft step, two as the catch-up after a
    // full acceptance (last draft and bonus token), over the same context in the same cache.
    let (draft, _) = model
        .with_quantized_draft_weights()
        .expect("quantized copy");
    for t in [1usize, 2] {
        let tokens: Vec<u32> = (0..t as u32).map(|i| 42 + i).collect();
        let positions: Vec<u32> = (100..100 + t as u32).collect();
        group.bench_function(format!("q4_draft_{t}_ctx100"), |b| {
            b.iter(|| {
                black_box(step_after_context(
                    &draft,
                    &mut cache,
                    seq,
                    &tokens,
                    &positions,
                    OutputRows::Last,
                ))
            })
        });
    }

    // The draft step as the runtime meets it: after a target step (a verification), which
    // streams the full weights past the copy's ~100 MB. Back to back, the draft steps above
    // find much of those bytes in a large L3 (480 MiB on the 2-core Xeon of session 45: 4.8
    // ms there against 6.6 ms here, and the runtime's draft tokens cost 5.6-6.8 ms). Only the
    // draft step is timed.
    group.bench_function("q4_draft_1_after_target_step", |b| {
        b.iter_custom(|iters| {
            let mut timed = std::time::Duration::ZERO;
            for _ in 0..iters {
                black_box(one_token_step(&model, &mut cache, seq));
                let start = std::time::Instant::now();
                black_box(one_token_step(&draft, &mut cache, seq));
                timed += start.elapsed();
            }
            timed
        })
    });

    let prompt: Vec<u32> = (0..128u32).map(|i| (i * 104729) % 49152).collect();
    let prompt_pos: Vec<u32> = (0..128).collect();
    group.throughput(Throughput::Elements(prompt.len() as u64));
    // Through `forward_prompt`, the call every decoding mode prefills a prompt with.
    group.bench_function("prefill_128", |b| {
        b.iter(|| {
            let s = cache.add_sequence();
            let h = model
                .forward_prompt(
                    &[SeqInput {
                        seq: s,
                        tokens: &prompt,
                        positions: &prompt_pos,
                        mask: None,
                        output_rows: OutputRows::Last,
                    }],
                    &mut cache,
                )
                .expect("prefill");
            let logits = model.logits(&h).expect("logits");
            cache.free_sequence(s).expect("free");
            black_box(logits)
        })
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! A CPU step's results do not depend on how many threads run it: its parallel loops (the
//! matvec's weight-row tasks, attention's (row, head) tasks, shared by a step's team of
//! spinning helpers) only decide which thread computes an output, never how.

mod common;

use candle_core::Device;
use common::forward_rows;
use kestrel_core::{DType, ModelConfig};
use kestrel_model::Llama;

/// Wide enough that every loop splits into many tasks, and attention over the context goes
/// parallel (its threshold is 2^18 multiply-adds a call).
fn cfg() -> ModelConfig {
    serde_json::from_str(
        r#"{"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "rms_norm_eps": 1e-5, "tie_word_embeddings": true}"#,
    )
    .unwrap()
}

/// The bits of a 150-token prompt's last row, a decode step's row and an 8-row tree step's
/// rows (a mask where each node sees the first and itself), run in a pool of `threads`.
fn step_bits(m: &Llama, threads: usize) -> Vec<Vec<u32>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    pool.install(|| {
        let mut cache = m.new_cache(16, 16).unwrap();
        let seq = cache.add_sequence();
        let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 5) % 2048).collect();
        let mut bits = Vec::new();
        let mut run = |cache: &mut _, tokens: &[u32], start: usize, mask: Option<&[bool]>| {
            let out = forward_rows(m, cache, seq, tokens, start, mask);
            let logits = m.logits(&out).unwrap();
            for row in logits.to_vec2::<f32>().unwrap() {
                bits.push(row.iter().map(|v| v.to_bits()).collect::<Vec<u32>>());
            }
        };
        run(&mut cache, &prompt, 0, None);
        run(&mut cache, &[7], 150, None);
        let tree: Vec<u32> = (0..8u32).map(|i| (i * 101 + 9) % 2048).collect();
        let mask: Vec<bool> = (0..64).map(|k| k % 8 == 0 || k / 8 == k % 8).collect();
        run(&mut cache, &tree, 151, Some(&mask));
        bits
    })
}

#[test]
fn cpu_steps_give_the_same_bits_on_one_two_and_three_threads() {
    for dtype in [DType::F32, DType::BF16] {
        let m = Llama::random(&cfg(), 5, dtype, &Device::Cpu).unwrap();
        let one = step_bits(&m, 1);
        assert_eq!(one.len(), 150 + 1 + 8);
        for threads in [2, 3] {
            let got = step_bits(&m, threads);
            let differing = one.iter().zip(&got).filter(|(a, b)| a != b).count();
            assert_eq!(
                differing, 0,
                "{dtype:?}: {differing} rows changed on {threads} threads"
            );
        }
    }
}

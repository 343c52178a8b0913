//! Fixtures shared by the trainers' tests: a tiny random Llama and greedy continuations of
//! random prompts on it (what self-distillation produces at temperature 0).

use candle_core::{Device, Tensor, D};
use kestrel_core::ModelConfig;
use kestrel_model::llama::random_tensors;
use kestrel_model::{Llama, OutputRows, SeqInput};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// A tiny Llama config (vocabulary 64, hidden 32) of `num_layers` layers; `extra` is
/// spliced into the JSON object (`, "bos_token_id": 1`).
pub fn tiny_config(num_layers: usize, rope_theta: f64, tied: bool, extra: &str) -> ModelConfig {
    serde_json::from_str(&format!(
        r#"{{"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": {num_layers}, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rope_theta": {rope_theta:?}, "rms_norm_eps": 1e-5, "tie_word_embeddings": {tied}{extra}}}"#
    ))
    .unwrap()
}

/// A random model and its full HF-named tensors.
pub struct Tiny {
    pub model: Llama,
    pub tensors: BTreeMap<String, Tensor>,
}

impl Tiny {
    /// The f32 CPU model of `cfg` with the random tensors of `seed`.
    pub fn new(cfg: &ModelConfig, seed: u64) -> Tiny {
        let tensors = random_tensors(cfg, seed).unwrap();
        Tiny {
            model: Llama::from_tensors(
                cfg,
                tensors.clone(),
                kestrel_core::DType::F32,
                &Device::Cpu,
            )
            .unwrap(),
            tensors,
        }
    }
}

/// `n` random prompts of `prompt_len` tokens (from `seed`), each followed by the model's
/// `answer_len` greedy tokens: (tokens, prompt length).
pub fn greedy_sequences(
    model: &Llama,
    n: usize,
    prompt_len: usize,
    answer_len: usize,
    seed: u64,
) -> Vec<(Vec<u32>, usize)> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let vocab = model.config().vocab_size as u32;
    (0..n)
        .map(|_| {
            let mut toks: Vec<u32> = (0..prompt_len)
                .map(|_| rng.random_range(0..vocab))
                .collect();
            let mut cache = model.new_cache(16, 8).unwrap();
            let seq = cache.add_sequence();
            let mut new = toks.clone();
            let mut pos = 0u32;
            for _ in 0..answer_len {
                let positions: Vec<u32> = (pos..pos + new.len() as u32).collect();
                let input = SeqInput {
                    seq,
                    tokens: &new,
                    positions: &positions,
                    mask: None,
                    output_rows: OutputRows::Last,
                };
                let h = model.forward(&[input], &mut cache).unwrap();
                pos += new.len() as u32;
                let logits = model.logits(&h).unwrap();
                let next = logits.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap()[0];
                toks.push(next);
                new = vec![next];
            }
            (toks, prompt_len)
        })
        .collect()
}

/// The largest absolute difference between `a` and `b`.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

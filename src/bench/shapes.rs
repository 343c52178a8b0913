//! `--random_weights SHAPE`: the configurations of real checkpoints, so a model of that shape
//! can be built in memory with random weights and timed without its files.

use anyhow::{bail, Result};
use kestrel_core::ModelConfig;

/// Shape names `--random_weights` takes.
pub const SHAPES: &[&str] = &["llama2-7b", "llama3-8b", "smollm2-135m", "tiny"];

/// The HF config of `name` (the fields a forward pass reads; no special token ids, so random
/// models never stop early and every request runs to `--max_output_len`).
pub fn shape_config(name: &str) -> Result<ModelConfig> {
    // (hidden, layers, heads, kv heads, intermediate, vocab, rope_theta, rms eps, tied, max pos)
    let (h, l, nh, nkv, i, v, theta, eps, tied, max_pos) = match name {
        // meta-llama/Llama-2-7b-hf.
        "llama2-7b" => (4096, 32, 32, 32, 11008, 32000, 10_000.0, 1e-5, false, 4096),
        // meta-llama/Meta-Llama-3-8B: plain RoPE. Llama-3.1 adds "llama3" rope scaling, which
        // changes nothing below its original 8192-token context, so it is left out.
        "llama3-8b" => (
            4096, 32, 32, 8, 14336, 128_256, 500_000.0, 1e-5, false, 8192,
        ),
        // HuggingFaceTB/SmolLM2-135M(-Instruct).
        "smollm2-135m" => (576, 30, 9, 3, 1536, 49152, 100_000.0, 1e-5, true, 8192),
        // A toy shape for tests: milliseconds per step on any machine.
        "tiny" => (64, 2, 4, 2, 128, 256, 10_000.0, 1e-5, false, 2048),
        other => bail!(
            "--random_weights '{other}': unknown shape: expected one of {}",
            SHAPES.join(", ")
        ),
    };
    Ok(ModelConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size: v,
        hidden_size: h,
        intermediate_size: i,
        num_hidden_layers: l,
        num_attention_heads: nh,
        num_key_value_heads: Some(nkv),
        head_dim: None,
        rope_theta: theta,
        rope_scaling: None,
        rope_parameters: None,
        rms_norm_eps: eps,
        tie_word_embeddings: tied,
        max_position_embeddings: max_pos,
        hidden_act: "silu".into(),
        attention_bias: false,
        mlp_bias: false,
        bos_token_id: None,
        eos_token_id: None,
        pad_token_id: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parameter counts of the published checkpoints.
    #[test]
    fn shapes_have_the_published_parameter_counts() {
        let n = |s: &str| shape_config(s).unwrap().num_parameters();
        assert_eq!(n("llama2-7b"), 6_738_415_616);
        assert_eq!(n("llama3-8b"), 8_030_261_248);
        assert_eq!(n("smollm2-135m"), 134_515_008);
        for s in SHAPES {
            shape_config(s).unwrap().validate().unwrap();
        }
    }
}

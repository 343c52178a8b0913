//! The tensor names and per-rank shapes of a Llama checkpoint: the single source of truth
//! that convert-checkpoint writes, spec-build checks and the model loader expects.

use crate::config::{EagleHeadConfig, ModelConfig};
use crate::mapping::Mapping;

/// A tensor every rank file must hold, with its shape on one rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<usize>,
}

fn spec(name: String, shape: Vec<usize>) -> TensorSpec {
    TensorSpec { name, shape }
}

/// Per-rank shapes of one decoder layer's tensors under `prefix` (e.g. "model.layers.3.").
fn decoder_layer(
    cfg: &ModelConfig,
    mapping: Mapping,
    prefix: &str,
    with_input_norm: bool,
) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let hd = cfg.head_dim();
    let (q_heads, kv_heads) = mapping.heads_per_rank(cfg);
    let inter = cfg.intermediate_size / mapping.tp_size;
    let mut out = vec![
        spec(
            format!("{prefix}self_attn.q_proj.weight"),
            vec![q_heads * hd, h],
        ),
        spec(
            format!("{prefix}self_attn.k_proj.weight"),
            vec![kv_heads * hd, h],
        ),
        spec(
            format!("{prefix}self_attn.v_proj.weight"),
            vec![kv_heads * hd, h],
        ),
        spec(
            format!("{prefix}self_attn.o_proj.weight"),
            vec![h, q_heads * hd],
        ),
        spec(format!("{prefix}mlp.gate_proj.weight"), vec![inter, h]),
        spec(format!("{prefix}mlp.up_proj.weight"), vec![inter, h]),
        spec(format!("{prefix}mlp.down_proj.weight"), vec![h, inter]),
        spec(format!("{prefix}post_attention_layernorm.weight"), vec![h]),
    ];
    if with_input_norm {
        out.push(spec(format!("{prefix}input_layernorm.weight"), vec![h]));
    }
    out
}

/// Every tensor of the base model on one rank.
pub fn llama_tensors(cfg: &ModelConfig, mapping: Mapping) -> Vec<TensorSpec> {
    let h = cfg.hidden_size;
    let mut out = vec![spec(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
    )];
    for layer in 0..cfg.num_hidden_layers {
        out.extend(decoder_layer(
            cfg,
            mapping,
            &format!("model.layers.{layer}."),
            true,
        ));
    }
    out.push(spec("model.norm.weight".into(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(spec("lm_head.weight".into(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Every tensor of an EAGLE-1 head (its `num_hidden_layers` layers, the first without an input
/// norm; with `fuse` when it reads `feature_layers`) on one rank, under `prefix` ("" in published heads,
/// [`crate::checkpoint::EAGLE_PREFIX`] inside Kestrel checkpoints). The optional
/// `embed_tokens.weight` is not listed: a head may bring its own or use the base model's.
pub fn eagle_head_tensors(
    head: &EagleHeadConfig,
    mapping: Mapping,
    prefix: &str,
) -> Vec<TensorSpec> {
    let h = head.llama.hidden_size;
    let mut out = vec![spec(format!("{prefix}fc.weight"), vec![h, 2 * h])];
    if head.bias {
        out.push(spec(format!("{prefix}fc.bias"), vec![h]));
    }
    if !head.feature_layers.is_empty() {
        // Small ([hidden, (1 + layers) · hidden]) and applied before the head's layer: whole
        // on every rank, like fc.
        out.push(spec(
            format!("{prefix}fuse.weight"),
            vec![h, head.feature_width()],
        ));
    }
    for layer in 0..head.llama.num_hidden_layers {
        out.extend(decoder_layer(
            &head.llama,
            mapping,
            &format!("{prefix}layers.{layer}."),
            layer > 0,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smollm2_shapes_on_three_ranks() {
        let cfg: ModelConfig = serde_json::from_str(
            r#"{"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
                "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
                "tie_word_embeddings": true}"#,
        )
        .unwrap();
        let t = llama_tensors(&cfg, Mapping::new(3));
        // embed + 9 per layer + final norm, no lm_head (tied).
        assert_eq!(t.len(), 1 + 30 * 9 + 1);
        let k = t
            .iter()
            .find(|s| s.name == "model.layers.0.self_attn.k_proj.weight")
            .unwrap();
        assert_eq!(k.shape, vec![64, 576]);
        let down = t
            .iter()
            .find(|s| s.name == "model.layers.29.mlp.down_proj.weight")
            .unwrap();
        assert_eq!(down.shape, vec![576, 512]);
    }
}

use crate::error::FormatError;
use candle_core::{DType as CDType, Tensor};
use kestrel_core::ModelConfig;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A checkpoint read into memory, whatever its source format.
#[derive(Debug)]
pub struct LoadedCheckpoint {
    pub config: ModelConfig,
    /// Weights under HF names (`model.layers.0.self_attn.q_proj.weight`, ...), on the CPU, in
    /// the source's dtype (f32 for GGUF, whose tensors are dequantised). `lm_head.weight` is
    /// present exactly when the embeddings are untied.
    pub tensors: BTreeMap<String, Tensor>,
    pub tokenizer: Option<tokenizers::Tokenizer>,
    pub chat_template: Option<String>,
    /// The files the checkpoint was read from, sorted.
    pub source_files: Vec<PathBuf>,
}

/// The shapes of one decoder layer's tensors under `prefix` (e.g. `model.layers.3.`).
pub(crate) fn layer_shapes(
    cfg: &ModelConfig,
    prefix: &str,
    with_input_norm: bool,
    out: &mut BTreeMap<String, Vec<usize>>,
) {
    let h = cfg.hidden_size;
    let q = cfg.num_attention_heads * cfg.head_dim();
    let kv = cfg.num_kv_heads() * cfg.head_dim();
    let inter = cfg.intermediate_size;
    let mut put = |name: &str, shape: Vec<usize>| {
        out.insert(format!("{prefix}{name}"), shape);
    };
    put("self_attn.q_proj.weight", vec![q, h]);
    put("self_attn.k_proj.weight", vec![kv, h]);
    put("self_attn.v_proj.weight", vec![kv, h]);
    put("self_attn.o_proj.weight", vec![h, q]);
    if cfg.attention_bias {
        put("self_attn.q_proj.bias", vec![q]);
        put("self_attn.k_proj.bias", vec![kv]);
        put("self_attn.v_proj.bias", vec![kv]);
        put("self_attn.o_proj.bias", vec![h]);
    }
    put("mlp.gate_proj.weight", vec![inter, h]);
    put("mlp.up_proj.weight", vec![inter, h]);
    put("mlp.down_proj.weight", vec![h, inter]);
    if cfg.mlp_bias {
        put("mlp.gate_proj.bias", vec![inter]);
        put("mlp.up_proj.bias", vec![inter]);
        put("mlp.down_proj.bias", vec![h]);
    }
    if with_input_norm {
        put("input_layernorm.weight", vec![h]);
    }
    put("post_attention_layernorm.weight", vec![h]);
}

/// Every tensor a `LlamaForCausalLM` checkpoint with this configuration holds, with its shape
/// (`lm_head.weight` only when the embeddings are untied).
pub fn expected_shapes(cfg: &ModelConfig) -> BTreeMap<String, Vec<usize>> {
    let mut out = BTreeMap::new();
    out.insert(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, cfg.hidden_size],
    );
    for i in 0..cfg.num_hidden_layers {
        layer_shapes(cfg, &format!("model.layers.{i}."), true, &mut out);
    }
    out.insert("model.norm.weight".to_string(), vec![cfg.hidden_size]);
    if !cfg.tie_word_embeddings {
        out.insert(
            "lm_head.weight".to_string(),
            vec![cfg.vocab_size, cfg.hidden_size],
        );
    }
    out
}

/// True for buffers some exporters save that are not weights (RoPE's `inv_freq`).
pub(crate) fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with("rotary_emb.inv_freq")
}

fn shape_text(dims: &[usize]) -> String {
    let parts: Vec<String> = dims.iter().map(|d| d.to_string()).collect();
    format!("[{}]", parts.join(", "))
}

/// Checks that `tensors` holds exactly the `required` tensors (plus any of `optional`), each
/// with its expected shape and a floating-point dtype. `path` names the checkpoint in errors.
pub fn check_tensors(
    path: &Path,
    required: &BTreeMap<String, Vec<usize>>,
    optional: &BTreeMap<String, Vec<usize>>,
    tensors: &BTreeMap<String, Tensor>,
) -> Result<(), FormatError> {
    for (name, tensor) in tensors {
        let Some(want) = required.get(name).or_else(|| optional.get(name)) else {
            return Err(FormatError::tensor(
                path,
                name,
                "unexpected tensor: it is not part of a Llama checkpoint with this configuration; check that config.json belongs to these weights",
            ));
        };
        let got = tensor.dims();
        if got != want.as_slice() {
            return Err(FormatError::tensor(
                path,
                name,
                format!(
                    "shape {} does not match {} expected from the configuration; check that config.json belongs to these weights",
                    shape_text(got),
                    shape_text(want)
                ),
            ));
        }
        if !matches!(tensor.dtype(), CDType::F32 | CDType::F16 | CDType::BF16) {
            return Err(FormatError::tensor(
                path,
                name,
                format!(
                    "dtype {:?} is not a floating-point type (float32, float16, bfloat16)",
                    tensor.dtype()
                ),
            ));
        }
    }
    if let Some(name) = required.keys().find(|n| !tensors.contains_key(*n)) {
        return Err(FormatError::tensor(
            path,
            name,
            "missing: the checkpoint is incomplete; download all of its weight files again",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn cfg() -> ModelConfig {
        serde_json::from_str(
            r#"{"vocab_size": 8, "hidden_size": 4, "intermediate_size": 6,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "tie_word_embeddings": true}"#,
        )
        .unwrap()
    }

    #[test]
    fn gqa_shapes_and_tied_head() {
        let shapes = expected_shapes(&cfg());
        assert_eq!(shapes["model.layers.0.self_attn.k_proj.weight"], vec![2, 4]);
        assert_eq!(shapes["model.layers.0.self_attn.o_proj.weight"], vec![4, 4]);
        assert_eq!(shapes["model.layers.0.mlp.down_proj.weight"], vec![4, 6]);
        assert!(!shapes.contains_key("lm_head.weight"));
        assert_eq!(shapes.len(), 1 + 9 + 1);
    }

    #[test]
    fn wrong_shape_names_tensor() {
        let shapes = expected_shapes(&cfg());
        let mut tensors: BTreeMap<String, Tensor> = shapes
            .iter()
            .map(|(n, s)| {
                (
                    n.clone(),
                    Tensor::zeros(s.as_slice(), CDType::F32, &Device::Cpu).unwrap(),
                )
            })
            .collect();
        let p = Path::new("m");
        assert!(check_tensors(p, &shapes, &BTreeMap::new(), &tensors).is_ok());
        tensors.insert(
            "model.norm.weight".into(),
            Tensor::zeros(5, CDType::F32, &Device::Cpu).unwrap(),
        );
        assert_eq!(
            check_tensors(p, &shapes, &BTreeMap::new(), &tensors)
                .unwrap_err()
                .to_string(),
            "m: tensor 'model.norm.weight': shape [5] does not match [4] expected from the configuration; check that config.json belongs to these weights"
        );
        tensors.remove("model.norm.weight");
        assert_eq!(
            check_tensors(p, &shapes, &BTreeMap::new(), &tensors)
                .unwrap_err()
                .to_string(),
            "m: tensor 'model.norm.weight': missing: the checkpoint is incomplete; download all of its weight files again"
        );
    }
}

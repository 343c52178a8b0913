use crate::checkpoint::{check_tensors, is_ignored_buffer, layer_shapes};
use crate::error::FormatError;
use crate::hf::{read_weight_files, require_dir};
use candle_core::Tensor;
use kestrel_core::EagleHeadConfig;
use std::collections::BTreeMap;
use std::path::Path;

/// The tensors of an EAGLE head: `(required, optional)` names with their shapes.
///
/// Required: `fc.weight` (`[hidden, 2*hidden]`), `fc.bias` when the config's `bias` is true, and
/// each of the `num_hidden_layers` layers' attention, MLP and `post_attention_layernorm`, with
/// `input_layernorm` from layer 1 on. Optional: `fc.bias` when `bias` is false (some exports
/// keep a bias of zeros), `embed_tokens.weight` (a head with its own embedding) and
/// `layers.0.input_layernorm.weight` (which EAGLE's layer 0 does not use).
pub fn eagle_expected_shapes(
    cfg: &EagleHeadConfig,
) -> (BTreeMap<String, Vec<usize>>, BTreeMap<String, Vec<usize>>) {
    let llama = &cfg.llama;
    let h = llama.hidden_size;
    let mut required = BTreeMap::new();
    let mut optional = BTreeMap::new();
    required.insert("fc.weight".to_string(), vec![h, 2 * h]);
    if cfg.bias {
        required.insert("fc.bias".to_string(), vec![h]);
    } else {
        optional.insert("fc.bias".to_string(), vec![h]);
    }
    if !cfg.feature_layers.is_empty() {
        required.insert("fuse.weight".to_string(), vec![h, cfg.feature_width()]);
    }
    for l in 0..llama.num_hidden_layers {
        layer_shapes(llama, &format!("layers.{l}."), l > 0, &mut required);
    }
    optional.insert("embed_tokens.weight".to_string(), vec![llama.vocab_size, h]);
    optional.insert("layers.0.input_layernorm.weight".to_string(), vec![h]);
    (required, optional)
}

/// Reads an EAGLE-1/2 head directory: `config.json` plus `model.safetensors` or
/// `pytorch_model.bin`. Tensor names are returned as in the file (`fc.weight`,
/// `layers.0.self_attn.q_proj.weight`, ...), each checked against the head's configuration.
pub fn load_eagle_head(
    dir: &Path,
) -> Result<(EagleHeadConfig, BTreeMap<String, Tensor>), FormatError> {
    require_dir(
        dir,
        "an EAGLE head folder with config.json and pytorch_model.bin or model.safetensors",
    )?;
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(FormatError::file(
            dir,
            "no config.json: not an EAGLE head folder (expected config.json and pytorch_model.bin or model.safetensors)",
        ));
    }
    let cfg = EagleHeadConfig::from_json_file(&config_path)?;
    let weights = ["model.safetensors", "pytorch_model.bin"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
        .ok_or_else(|| {
            FormatError::file(
                dir,
                "no EAGLE head weights: expected model.safetensors or pytorch_model.bin",
            )
        })?;
    let mut tensors = read_weight_files(std::slice::from_ref(&weights))?;
    tensors.retain(|name, _| !is_ignored_buffer(name));
    let (required, optional) = eagle_expected_shapes(&cfg);
    check_tensors(&weights, &required, &optional, &tensors)?;
    Ok((cfg, tensors))
}

/// The files [`load_eagle_head`] reads from `dir` (for recording their digests).
pub fn eagle_head_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = vec![dir.join("config.json")];
    if let Some(w) = ["model.safetensors", "pytorch_model.bin"]
        .iter()
        .map(|f| dir.join(f))
        .find(|p| p.is_file())
    {
        files.push(w);
    }
    files
}

use crate::checkpoint::{check_tensors, expected_shapes, LoadedCheckpoint};
use crate::error::{one_line, FormatError};
use crate::gguf_tokenizer::build_tokenizer;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use candle_core::{Device, Tensor};
use kestrel_core::config::TokenIds;
use kestrel_core::ModelConfig;
use std::collections::{BTreeMap, HashMap};
use std::io::BufReader;
use std::path::Path;

/// GGUF tensor types this reader dequantises.
const SUPPORTED_TYPES: &[GgmlDType] = &[
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q8_0,
];

pub(crate) struct Metadata<'a> {
    pub path: &'a Path,
    pub map: &'a HashMap<String, Value>,
}

impl Metadata<'_> {
    fn missing(&self, key: &str) -> FormatError {
        FormatError::file(
            self.path,
            format!(
                "GGUF metadata key '{key}' is missing: the file is incomplete or not a llama model"
            ),
        )
    }

    fn wrong(&self, key: &str, want: &str) -> FormatError {
        FormatError::file(
            self.path,
            format!("GGUF metadata key '{key}' is not {want}: the file is corrupt"),
        )
    }

    pub fn opt_uint(&self, key: &str) -> Result<Option<u64>, FormatError> {
        let v = match self.map.get(key) {
            None => return Ok(None),
            Some(v) => v,
        };
        let n = match v {
            Value::U8(x) => Some(*x as u64),
            Value::U16(x) => Some(*x as u64),
            Value::U32(x) => Some(*x as u64),
            Value::U64(x) => Some(*x),
            Value::I8(x) => u64::try_from(*x).ok(),
            Value::I16(x) => u64::try_from(*x).ok(),
            Value::I32(x) => u64::try_from(*x).ok(),
            Value::I64(x) => u64::try_from(*x).ok(),
            _ => None,
        };
        n.map(Some)
            .ok_or_else(|| self.wrong(key, "a non-negative integer"))
    }

    pub fn uint(&self, key: &str) -> Result<usize, FormatError> {
        let n = self.opt_uint(key)?.ok_or_else(|| self.missing(key))?;
        usize::try_from(n).map_err(|_| self.wrong(key, "a size that fits in memory"))
    }

    pub fn opt_u32(&self, key: &str) -> Result<Option<u32>, FormatError> {
        match self.opt_uint(key)? {
            None => Ok(None),
            Some(n) => u32::try_from(n)
                .map(Some)
                .map_err(|_| self.wrong(key, "a token id")),
        }
    }

    pub fn opt_float(&self, key: &str) -> Result<Option<f64>, FormatError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::F32(x)) => Ok(Some(*x as f64)),
            Some(Value::F64(x)) => Ok(Some(*x)),
            Some(_) => Err(self.wrong(key, "a float")),
        }
    }

    pub fn opt_str(&self, key: &str) -> Result<Option<&str>, FormatError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(_) => Err(self.wrong(key, "a string")),
        }
    }

    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>, FormatError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(self.wrong(key, "a boolean")),
        }
    }

    pub fn opt_strings(&self, key: &str) -> Result<Option<Vec<&str>>, FormatError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.as_str()),
                    _ => Err(self.wrong(key, "an array of strings")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(self.wrong(key, "an array of strings")),
        }
    }

    pub fn opt_ints(&self, key: &str) -> Result<Option<Vec<i64>>, FormatError> {
        match self.map.get(key) {
            None => Ok(None),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| match v {
                    Value::I32(x) => Ok(*x as i64),
                    Value::U32(x) => Ok(*x as i64),
                    Value::I8(x) => Ok(*x as i64),
                    Value::U8(x) => Ok(*x as i64),
                    Value::I16(x) => Ok(*x as i64),
                    Value::U16(x) => Ok(*x as i64),
                    Value::I64(x) => Ok(*x),
                    _ => Err(self.wrong(key, "an array of integers")),
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Some),
            Some(_) => Err(self.wrong(key, "an array of integers")),
        }
    }
}

/// The HF name of a GGUF tensor of the llama architecture, or `None` when it has none.
pub fn hf_name(gguf: &str) -> Option<String> {
    match gguf {
        "token_embd.weight" => return Some("model.embed_tokens.weight".into()),
        "output_norm.weight" => return Some("model.norm.weight".into()),
        "output.weight" => return Some("lm_head.weight".into()),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (part, kind) = rest.rsplit_once('.')?;
    if kind != "weight" && kind != "bias" {
        return None;
    }
    let hf = match part {
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{kind}"))
}

/// Undoes llama.cpp's Q/K row permutation.
///
/// `convert_hf_to_gguf.py` stores `w.reshape(n_head, 2, rows/n_head/2, *rest).swapaxes(1, 2)`
/// so that ggml's RoPE rotates adjacent pairs; HF's RoPE rotates halves. The inverse views the
/// stored rows as `(n_head, rows/n_head/2, 2)` and swaps the last two axes back.
pub fn unpermute_rows(t: &Tensor, n_head: usize) -> candle_core::Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if n_head == 0 || rows == 0 || rows % (2 * n_head) != 0 {
        candle_core::bail!("{rows} rows cannot be split into {n_head} heads of pairs")
    }
    let rest: usize = dims[1..].iter().product();
    t.reshape((n_head, rows / n_head / 2, 2, rest))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

fn config_from_metadata(
    md: &Metadata,
    content: &Content,
    vocab_size: usize,
) -> Result<ModelConfig, FormatError> {
    let path = md.path;
    let hidden_size = md.uint("llama.embedding_length")?;
    let num_attention_heads = md.uint("llama.attention.head_count")?;
    let num_key_value_heads = match md.opt_uint("llama.attention.head_count_kv")? {
        Some(n) => Some(n as usize),
        None => Some(num_attention_heads),
    };
    let head_dim = match md.opt_uint("llama.attention.key_length")? {
        Some(k) if num_attention_heads > 0 && k as usize != hidden_size / num_attention_heads => {
            Some(k as usize)
        }
        _ => None,
    };
    if let Some(kind) = md.opt_str("llama.rope.scaling.type")? {
        if kind != "none" {
            return Err(FormatError::file(
                path,
                format!("RoPE scaling '{kind}' (llama.rope.scaling.type) is not supported from GGUF: convert the HF checkpoint instead"),
            ));
        }
    }
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let eos = md.opt_u32("tokenizer.ggml.eos_token_id")?;
    let config = ModelConfig {
        architectures: vec!["LlamaForCausalLM".into()],
        model_type: "llama".into(),
        vocab_size,
        hidden_size,
        intermediate_size: md.uint("llama.feed_forward_length")?,
        num_hidden_layers: md.uint("llama.block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rope_theta: md.opt_float("llama.rope.freq_base")?.unwrap_or(10000.0),
        rope_scaling: None,
        rope_parameters: None,
        rms_norm_eps: md
            .opt_float("llama.attention.layer_norm_rms_epsilon")?
            .unwrap_or(1e-6),
        tie_word_embeddings: !has("output.weight"),
        max_position_embeddings: md.opt_uint("llama.context_length")?.unwrap_or(2048) as usize,
        hidden_act: "silu".into(),
        attention_bias: has("blk.0.attn_q.bias"),
        mlp_bias: has("blk.0.ffn_up.bias"),
        bos_token_id: md.opt_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_id: eos.map(TokenIds::One),
        pad_token_id: md.opt_u32("tokenizer.ggml.padding_token_id")?,
    };
    config.validate().map_err(|e| {
        FormatError::file(
            path,
            format!("GGUF metadata describes an invalid model: {e}"),
        )
    })?;
    Ok(config)
}

/// Reads a llama.cpp GGUF file of the `llama` architecture (see the crate docs).
pub fn load_gguf(file: &Path) -> Result<LoadedCheckpoint, FormatError> {
    if !file.is_file() {
        let what = if file.exists() {
            "not a file"
        } else {
            "file does not exist"
        };
        return Err(FormatError::file(
            file,
            format!("{what}: expected a GGUF model file"),
        ));
    }
    let handle = std::fs::File::open(file)
        .map_err(|e| FormatError::file(file, format!("cannot open: {e}")))?;
    let mut reader = BufReader::new(handle);
    let content = Content::read(&mut reader).map_err(|e| {
        FormatError::file(
            file,
            format!(
                "not a valid GGUF file ({}): it may be truncated; download it again",
                one_line(e)
            ),
        )
    })?;
    let md = Metadata {
        path: file,
        map: &content.metadata,
    };
    let arch = md
        .opt_str("general.architecture")?
        .ok_or_else(|| md.missing("general.architecture"))?;
    if arch != "llama" {
        return Err(FormatError::file(
            file,
            format!("GGUF architecture '{arch}' (general.architecture) is not supported: Kestrel reads 'llama' GGUF files only"),
        ));
    }

    let tokens = md.opt_strings("tokenizer.ggml.tokens")?;
    let vocab_size = match (&tokens, md.opt_uint("llama.vocab_size")?) {
        (Some(t), _) => t.len(),
        (None, Some(n)) => n as usize,
        (None, None) => {
            return Err(md.missing("tokenizer.ggml.tokens"));
        }
    };
    let config = config_from_metadata(&md, &content, vocab_size)?;

    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors = BTreeMap::new();
    for gguf_name in names {
        if gguf_name == "rope_freqs.weight" {
            return Err(FormatError::tensor(
                file,
                gguf_name,
                "Llama-3.1 RoPE frequency scaling is not supported from GGUF: convert the HF checkpoint instead",
            ));
        }
        let Some(name) = hf_name(gguf_name) else {
            return Err(FormatError::tensor(
                file,
                gguf_name,
                "unexpected tensor: not part of a llama model",
            ));
        };
        let info = &content.tensor_infos[gguf_name];
        if !SUPPORTED_TYPES.contains(&info.ggml_dtype) {
            return Err(FormatError::tensor(
                file,
                gguf_name,
                format!(
                    "GGUF type {:?} is not supported: Kestrel dequantises F32, F16, BF16, Q4_0, Q4_1 and Q8_0; requantise the model with one of these",
                    info.ggml_dtype
                ),
            ));
        }
        let qtensor = info
            .read(&mut reader, content.tensor_data_offset, &Device::Cpu)
            .map_err(|e| {
                FormatError::tensor(
                    file,
                    gguf_name,
                    format!(
                        "cannot read ({}): the file is truncated or corrupt; download it again",
                        one_line(e)
                    ),
                )
            })?;
        let mut tensor = qtensor.dequantize(&Device::Cpu).map_err(|e| {
            FormatError::tensor(
                file,
                gguf_name,
                format!("cannot dequantise: {}", one_line(e)),
            )
        })?;
        let heads = if name.contains(".self_attn.q_proj.") {
            Some(config.num_attention_heads)
        } else if name.contains(".self_attn.k_proj.") {
            Some(config.num_kv_heads())
        } else {
            None
        };
        if let Some(n_head) = heads {
            tensor = unpermute_rows(&tensor, n_head).map_err(|e| {
                FormatError::tensor(
                    file,
                    gguf_name,
                    format!(
                        "cannot undo llama.cpp's Q/K permutation ({}): the shape does not match the metadata",
                        one_line(e)
                    ),
                )
            })?;
        }
        tensors.insert(name, tensor);
    }
    check_tensors(file, &expected_shapes(&config), &BTreeMap::new(), &tensors)?;

    let tokenizer = build_tokenizer(&md)?;
    let chat_template = md.opt_str("tokenizer.chat_template")?.map(str::to_string);
    Ok(LoadedCheckpoint {
        config,
        tensors,
        tokenizer,
        chat_template,
        source_files: vec![file.to_path_buf()],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.12.attn_output.weight").as_deref(),
            Some("model.layers.12.self_attn.o_proj.weight")
        );
        assert_eq!(
            hf_name("blk.0.ffn_norm.weight").as_deref(),
            Some("model.layers.0.post_attention_layernorm.weight")
        );
        assert_eq!(hf_name("output.weight").as_deref(), Some("lm_head.weight"));
        assert_eq!(hf_name("blk.x.attn_q.weight"), None);
        assert_eq!(hf_name("blk.0.attn_qkv.weight"), None);
    }

    /// llama.cpp's permute, written as in convert_hf_to_gguf.py, for the round trip.
    fn permute(t: &Tensor, n_head: usize) -> Tensor {
        let dims = t.dims().to_vec();
        let rest: usize = dims[1..].iter().product();
        t.reshape((n_head, 2, dims[0] / n_head / 2, rest))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
            .reshape(dims)
            .unwrap()
    }

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // 2 heads of dim 4, 3 input features: rows 0..8.
        let hf = Tensor::arange(0f32, 24., &Device::Cpu)
            .unwrap()
            .reshape((8, 3))
            .unwrap();
        let stored = permute(&hf, 2);
        // Head 0's rows in HF order are 0,1 | 2,3 (halves); llama.cpp interleaves them: 0,2,1,3.
        let first_col: Vec<f32> = stored
            .narrow(1, 0, 1)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert_eq!(first_col, vec![0., 6., 3., 9., 12., 18., 15., 21.]);
        let back = unpermute_rows(&stored, 2).unwrap();
        assert_eq!(
            back.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            hf.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }
}

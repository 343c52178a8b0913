mod common;

use common::*;
use kestrel_formats::{load_eagle_head, load_gguf, load_hf_dir, FormatError};
use std::collections::BTreeMap;
use std::path::Path;

fn err_text<T: std::fmt::Debug>(r: Result<T, FormatError>) -> String {
    r.unwrap_err().to_string()
}

#[test]
fn single_safetensors_loads_and_drops_tied_head() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    let mut written = tiny_hf_dir(&dir, true);
    // A tied checkpoint that also saved its head: the head is dropped.
    written.insert("lm_head.weight".into(), ramp(&[V, H], 5.0));
    write_safetensors(&dir.join("model.safetensors"), &written);
    std::fs::write(dir.join("chat_template.jinja"), "{{ x }}").unwrap();
    let ckpt = load_hf_dir(&dir).unwrap();
    assert_eq!(ckpt.config.hidden_size, H);
    assert_eq!(ckpt.tensors.len(), 11);
    assert!(!ckpt.tensors.contains_key("lm_head.weight"));
    assert_eq!(
        values(&ckpt.tensors["model.layers.0.self_attn.k_proj.weight"]),
        values(&written["model.layers.0.self_attn.k_proj.weight"])
    );
    assert!(ckpt.tokenizer.is_none());
    assert_eq!(ckpt.chat_template.as_deref(), Some("{{ x }}"));
    let names: Vec<_> = ckpt
        .source_files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["chat_template.jinja", "config.json", "model.safetensors"]
    );
}

#[test]
fn sharded_safetensors_with_index_load_like_one_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    std::fs::write(dir.join("config.json"), config_json(false)).unwrap();
    let all = tiny_tensors(false);
    let (a, b): (BTreeMap<_, _>, BTreeMap<_, _>) = all
        .clone()
        .into_iter()
        .partition(|(n, _)| n.contains("layers"));
    write_safetensors(&dir.join("model-00001-of-00002.safetensors"), &a);
    write_safetensors(&dir.join("model-00002-of-00002.safetensors"), &b);
    let weight_map: serde_json::Map<String, serde_json::Value> = a
        .keys()
        .map(|n| (n.clone(), "model-00001-of-00002.safetensors".into()))
        .chain(
            b.keys()
                .map(|n| (n.clone(), "model-00002-of-00002.safetensors".into())),
        )
        .collect();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    )
    .unwrap();
    let ckpt = load_hf_dir(dir).unwrap();
    assert_eq!(ckpt.tensors.len(), all.len());
    for (n, t) in &all {
        assert_eq!(values(&ckpt.tensors[n]), values(t), "{n}");
    }
    assert_eq!(ckpt.chat_template.as_deref(), Some("D"));

    std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    let msg = err_text(load_hf_dir(dir));
    assert!(
        msg.ends_with(&format!("model.safetensors.index.json: shard 'model-00002-of-00002.safetensors' listed in the index is missing: download it into {}", dir.display())),
        "{msg}"
    );
}

#[test]
fn pytorch_bin_loads_through_the_safe_unpickler() {
    let dir = data_dir().join("tiny_llama_bin");
    let ckpt = load_hf_dir(&dir).unwrap();
    let reference = candle_core::safetensors::load(
        data_dir().join("tiny_llama_bin.reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(ckpt.tensors.len(), 12);
    for (n, t) in &reference {
        assert_eq!(values(&ckpt.tensors[n]), values(t), "{n}");
    }
}

#[test]
fn missing_dir_and_missing_config_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nope");
    assert_eq!(
        err_text(load_hf_dir(&dir)),
        format!(
            "{}: directory does not exist: expected a Hugging Face model folder with config.json and the weights",
            dir.display()
        )
    );
    std::fs::create_dir(&dir).unwrap();
    assert_eq!(
        err_text(load_hf_dir(&dir)),
        format!("{}: no config.json: not a Hugging Face model folder (expected config.json and *.safetensors or pytorch_model.bin)", dir.display())
    );
    std::fs::write(dir.join("config.json"), config_json(true)).unwrap();
    assert_eq!(
        err_text(load_hf_dir(&dir)),
        format!("{}: no weights found: expected model.safetensors, sharded *.safetensors with model.safetensors.index.json, or pytorch_model.bin", dir.display())
    );
}

#[test]
fn truncated_safetensors_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_hf_dir(tmp.path(), true);
    let file = tmp.path().join("model.safetensors");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() - 100]).unwrap();
    let msg = err_text(load_hf_dir(tmp.path()));
    assert!(
        msg.starts_with(&format!(
            "{}: not a valid safetensors file (",
            file.display()
        )),
        "{msg}"
    );
    assert!(
        msg.ends_with("it may be truncated; download it again"),
        "{msg}"
    );
    assert!(!msg.contains('\n'));
}

#[test]
fn missing_and_misshapen_tensors_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let mut tensors = tiny_hf_dir(dir, true);
    tensors.remove("model.layers.0.mlp.up_proj.weight");
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    assert_eq!(
        err_text(load_hf_dir(dir)),
        format!("{}: tensor 'model.layers.0.mlp.up_proj.weight': missing: the checkpoint is incomplete; download all of its weight files again", dir.display())
    );
    tensors.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        ramp(&[I, H + 1], 0.0),
    );
    write_safetensors(&dir.join("model.safetensors"), &tensors);
    assert_eq!(
        err_text(load_hf_dir(dir)),
        format!("{}: tensor 'model.layers.0.mlp.up_proj.weight': shape [12, 9] does not match [12, 8] expected from the configuration; check that config.json belongs to these weights", dir.display())
    );
}

#[test]
fn unknown_architecture_in_config_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    tiny_hf_dir(tmp.path(), true);
    let cfg = config_json(true).replace("LlamaForCausalLM", "MistralForCausalLM");
    std::fs::write(tmp.path().join("config.json"), cfg).unwrap();
    let msg = err_text(load_hf_dir(tmp.path()));
    assert_eq!(
        msg,
        format!("{}: unsupported architecture [\"MistralForCausalLM\"] (\"architectures\" in config.json): Kestrel supports LlamaForCausalLM", tmp.path().join("config.json").display())
    );
}

#[test]
fn tiny_gguf_is_renamed_and_unpermuted() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("tiny.gguf");
    let hf = tiny_gguf(&file, "llama", false);
    let ckpt = load_gguf(&file).unwrap();
    assert!(ckpt.config.tie_word_embeddings);
    assert_eq!(ckpt.config.num_kv_heads(), KV);
    assert_eq!(ckpt.config.rope_theta, 100000.0);
    assert_eq!(ckpt.config.max_position_embeddings, 64);
    assert_eq!(ckpt.config.vocab_size, TOKENS.len());
    assert_eq!(ckpt.config.bos_token_id, Some(1));
    assert_eq!(ckpt.tensors.len(), hf.len());
    for (n, t) in &hf {
        assert_eq!(values(&ckpt.tensors[n]), values(t), "{n}");
    }
    let tok = ckpt.tokenizer.unwrap();
    let enc = tok.encode("<|im_start|>ab 12", false).unwrap();
    assert_eq!(enc.get_ids(), &[1, 7, 8, 9, 10]);
    assert_eq!(tok.decode(&[7, 15], false).unwrap(), "ab a");
    assert_eq!(ckpt.chat_template.as_deref(), Some("{{ messages }}"));
}

#[test]
fn gguf_errors_name_the_problem() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("missing.gguf");
    assert_eq!(
        err_text(load_gguf(&missing)),
        format!(
            "{}: file does not exist: expected a GGUF model file",
            missing.display()
        )
    );

    let qwen = tmp.path().join("qwen.gguf");
    tiny_gguf(&qwen, "qwen2", false);
    assert_eq!(
        err_text(load_gguf(&qwen)),
        format!("{}: GGUF architecture 'qwen2' (general.architecture) is not supported: Kestrel reads 'llama' GGUF files only", qwen.display())
    );

    let q4k = tmp.path().join("q4k.gguf");
    tiny_gguf(&q4k, "llama", true);
    assert_eq!(
        err_text(load_gguf(&q4k)),
        format!("{}: tensor 'blk.0.ffn_gate.weight': GGUF type Q4K is not supported: Kestrel dequantises F32, F16, BF16, Q4_0, Q4_1 and Q8_0; requantise the model with one of these", q4k.display())
    );

    // Cut inside the tensor data, then inside the header.
    let good = tmp.path().join("good.gguf");
    tiny_gguf(&good, "llama", false);
    let bytes = std::fs::read(&good).unwrap();
    let cut = tmp.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() - 64]).unwrap();
    let msg = err_text(load_gguf(&cut));
    assert!(
        msg.starts_with(&format!("{}: tensor '", cut.display())),
        "{msg}"
    );
    assert!(
        msg.ends_with("the file is truncated or corrupt; download it again"),
        "{msg}"
    );
    std::fs::write(&cut, &bytes[..200]).unwrap();
    let msg = err_text(load_gguf(&cut));
    assert!(
        msg.starts_with(&format!("{}: not a valid GGUF file (", cut.display())),
        "{msg}"
    );
    assert!(!msg.contains('\n'), "{msg}");
}

fn eagle_dir(dir: &Path, bias: bool, with_bias_tensor: bool) {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = config_json(false).replace('}', &format!(", \"bias\": {bias}}}"));
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let mut t = BTreeMap::new();
    t.insert("fc.weight".to_string(), ramp(&[H, 2 * H], 0.0));
    if with_bias_tensor {
        t.insert("fc.bias".to_string(), ramp(&[H], 1.0));
    }
    for (n, v) in tiny_tensors(true) {
        if let Some(rest) = n.strip_prefix("model.layers.0.") {
            if rest != "input_layernorm.weight" {
                t.insert(format!("layers.0.{rest}"), v);
            }
        }
    }
    write_safetensors(&dir.join("model.safetensors"), &t);
}

#[test]
fn eagle_head_bias_follows_config() {
    let tmp = tempfile::tempdir().unwrap();
    let with_bias = tmp.path().join("a");
    eagle_dir(&with_bias, true, true);
    let (cfg, t) = load_eagle_head(&with_bias).unwrap();
    assert!(cfg.bias);
    assert_eq!(t.len(), 10);

    let without = tmp.path().join("b");
    eagle_dir(&without, false, false);
    let (cfg, t) = load_eagle_head(&without).unwrap();
    assert!(!cfg.bias);
    assert!(!t.contains_key("fc.bias"));

    let bias_missing = tmp.path().join("c");
    eagle_dir(&bias_missing, true, false);
    assert_eq!(
        err_text(load_eagle_head(&bias_missing)),
        format!("{}: tensor 'fc.bias': missing: the checkpoint is incomplete; download all of its weight files again", bias_missing.join("model.safetensors").display())
    );
}

#[test]
fn eagle_head_from_pytorch_bin_with_own_embedding() {
    let dir = data_dir().join("tiny_eagle_bin");
    let (cfg, tensors) = load_eagle_head(&dir).unwrap();
    assert!(cfg.bias);
    let reference = candle_core::safetensors::load(
        data_dir().join("tiny_eagle_bin.reference.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    assert_eq!(tensors.len(), reference.len());
    assert!(tensors.contains_key("embed_tokens.weight"));
    for (n, t) in &reference {
        assert_eq!(values(&tensors[n]), values(t), "{n}");
    }
}

#[test]
fn eagle_head_wrong_fc_shape_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    eagle_dir(dir, true, true);
    let st = dir.join("model.safetensors");
    let mut t: BTreeMap<String, candle_core::Tensor> =
        candle_core::safetensors::load(&st, &candle_core::Device::Cpu)
            .unwrap()
            .into_iter()
            .collect();
    t.insert("fc.weight".into(), ramp(&[H, H], 0.0));
    write_safetensors(&st, &t);
    assert_eq!(
        err_text(load_eagle_head(dir)),
        format!("{}: tensor 'fc.weight': shape [8, 8] does not match [8, 16] expected from the configuration; check that config.json belongs to these weights", st.display())
    );
}

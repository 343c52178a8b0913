//! convert-checkpoint end to end, on tiny checkpoints written here and on the real SmolLM2 GGUF.

mod common;

use common::{convert as run, convert_ok, s, smollm2_gguf, stderr};
use kestrel_formats::candle_core::{self, DType, Device, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

/// hidden 16, 4 query heads and 2 KV heads of dim 4, intermediate 24, vocab 32, 2 layers.
fn config_json(heads: usize, kv: usize, tie: bool) -> String {
    format!(
        r#"{{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32,
            "hidden_size": {}, "intermediate_size": 24, "num_hidden_layers": 2,
            "num_attention_heads": {heads}, "num_key_value_heads": {kv},
            "tie_word_embeddings": {tie}, "bos_token_id": 1, "eos_token_id": 2}}"#,
        heads * 4
    )
}

fn ramp(shape: &[usize], seed: usize) -> Tensor {
    let n: usize = shape.iter().product();
    let data: Vec<f32> = (0..n).map(|i| (seed * 1000 + i) as f32 * 0.001).collect();
    Tensor::from_vec(data, shape, &Device::Cpu).unwrap()
}

fn tiny_tensors(heads: usize, kv: usize, tie: bool) -> BTreeMap<String, Tensor> {
    let h = heads * 4;
    let mut shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![32, h]),
        ("model.norm.weight".into(), vec![h]),
    ];
    for l in 0..2 {
        let p = format!("model.layers.{l}.");
        shapes.extend([
            (format!("{p}self_attn.q_proj.weight"), vec![heads * 4, h]),
            (format!("{p}self_attn.k_proj.weight"), vec![kv * 4, h]),
            (format!("{p}self_attn.v_proj.weight"), vec![kv * 4, h]),
            (format!("{p}self_attn.o_proj.weight"), vec![h, heads * 4]),
            (format!("{p}mlp.gate_proj.weight"), vec![24, h]),
            (format!("{p}mlp.up_proj.weight"), vec![24, h]),
            (format!("{p}mlp.down_proj.weight"), vec![h, 24]),
            (format!("{p}input_layernorm.weight"), vec![h]),
            (format!("{p}post_attention_layernorm.weight"), vec![h]),
        ]);
    }
    if !tie {
        shapes.push(("lm_head.weight".into(), vec![32, h]));
    }
    shapes
        .into_iter()
        .enumerate()
        .map(|(i, (n, s))| (n, ramp(&s, i)))
        .collect()
}

fn write_st(path: &Path, tensors: &BTreeMap<String, Tensor>) {
    let map: HashMap<String, Tensor> = tensors.clone().into_iter().collect();
    candle_core::safetensors::save(&map, path).unwrap();
}

fn tiny_model(dir: &Path, heads: usize, kv: usize, tie: bool) -> BTreeMap<String, Tensor> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config_json(heads, kv, tie)).unwrap();
    let t = tiny_tensors(heads, kv, tie);
    write_st(&dir.join("model.safetensors"), &t);
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    t
}

/// An EAGLE head for the tiny model (hidden 16), fc bias included.
fn tiny_eagle(dir: &Path, heads: usize, kv: usize) -> BTreeMap<String, Tensor> {
    std::fs::create_dir_all(dir).unwrap();
    let cfg = config_json(heads, kv, true)
        .replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 1");
    std::fs::write(dir.join("config.json"), cfg).unwrap();
    let h = heads * 4;
    let mut t = BTreeMap::new();
    t.insert("fc.weight".to_string(), ramp(&[h, 2 * h], 90));
    t.insert("fc.bias".to_string(), ramp(&[h], 91));
    for (n, v) in tiny_tensors(heads, kv, true) {
        if let Some(rest) = n.strip_prefix("model.layers.0.") {
            if rest != "input_layernorm.weight" {
                t.insert(format!("layers.0.{rest}"), v);
            }
        }
    }
    write_st(&dir.join("model.safetensors"), &t);
    t
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

fn vals(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn tp1_writes_the_checkpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    let original = tiny_model(&src, 4, 2, false);
    let out = tmp.path().join("ckpt");
    convert_ok(&["--model_dir", s(&src), "--output_dir", s(&out)]);

    let rank0 = load(&out.join("rank0.safetensors"));
    assert_eq!(rank0.len(), original.len());
    for (n, t) in &original {
        assert_eq!(rank0[n].dtype(), DType::F32);
        assert_eq!(vals(&rank0[n]), vals(t), "{n}");
    }
    let files: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(
        files,
        ["chat_template.jinja", "config.json", "rank0.safetensors"]
    );

    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["hidden_size"], 16);
    let k = &cfg["kestrel"];
    assert_eq!(k["format"], "kestrel-checkpoint");
    assert_eq!(k["version"], 1);
    assert_eq!(k["dtype"], "float32");
    assert_eq!(k["mapping"]["tp_size"], 1);
    assert_eq!(k["eagle"], serde_json::Value::Null);
    let sources: Vec<&str> = k["source_files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["file"].as_str().unwrap())
        .collect();
    assert_eq!(
        sources,
        ["chat_template.jinja", "config.json", "model.safetensors"]
    );
    assert_eq!(k["source_files"][2]["sha256"].as_str().unwrap().len(), 64);

    let (mc, meta) = kestrel_convert::read_checkpoint_config(&out).unwrap();
    assert_eq!(mc.num_kv_heads(), 2);
    assert_eq!(meta.dtype, kestrel_core::DType::F32);
}

#[test]
fn tp2_shards_concatenate_back_and_cast() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    let original = tiny_model(&src, 4, 2, false);
    let out = tmp.path().join("ckpt");
    convert_ok(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--tp_size",
        "2",
        "--dtype",
        "float16",
        "--workers",
        "2",
    ]);
    let r0 = load(&out.join("rank0.safetensors"));
    let r1 = load(&out.join("rank1.safetensors"));
    assert!(!out.join("rank2.safetensors").exists());
    for (n, t) in &original {
        let (a, b) = (&r0[n], &r1[n]);
        assert_eq!(a.dtype(), DType::F16, "{n}");
        let whole = if n.contains("q_proj")
            || n.contains("k_proj")
            || n.contains("v_proj")
            || n.contains("gate_proj")
            || n.contains("up_proj")
        {
            assert_eq!(a.dim(0).unwrap() * 2, t.dim(0).unwrap(), "{n}");
            Tensor::cat(&[a, b], 0).unwrap()
        } else if n.contains("o_proj") || n.contains("down_proj") {
            assert_eq!(a.dim(1).unwrap() * 2, t.dim(1).unwrap(), "{n}");
            Tensor::cat(&[a, b], 1).unwrap()
        } else {
            assert_eq!(vals(a), vals(b), "{n} replicated");
            a.clone()
        };
        let want = vals(&t.to_dtype(DType::F16).unwrap());
        assert_eq!(vals(&whole), want, "{n}");
    }
}

#[test]
fn kv_heads_are_replicated_when_fewer_than_ranks() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    // 4 query heads, 1 KV head, 4 ranks: every rank holds the one KV head whole.
    let original = tiny_model(&src, 4, 1, true);
    let out = tmp.path().join("ckpt");
    convert_ok(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--tp_size",
        "4",
    ]);
    let k = "model.layers.1.self_attn.k_proj.weight";
    for rank in 0..4 {
        let r = load(&out.join(format!("rank{rank}.safetensors")));
        assert_eq!(vals(&r[k]), vals(&original[k]), "rank {rank}");
        assert_eq!(r["model.layers.1.self_attn.q_proj.weight"].dims(), &[4, 16]);
        assert!(!r.contains_key("lm_head.weight"), "tied: no lm_head");
    }
}

#[test]
fn eagle_head_is_stored_once_under_its_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    let base = tiny_model(&src, 4, 2, true);
    let eagle_src = tmp.path().join("eagle");
    let head = tiny_eagle(&eagle_src, 4, 2);
    let out = tmp.path().join("ckpt");
    convert_ok(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--eagle_model_dir",
        s(&eagle_src),
        "--max_draft_len",
        "32",
        "--tp_size",
        "2",
    ]);
    let r0 = load(&out.join("rank0.safetensors"));
    let r1 = load(&out.join("rank1.safetensors"));
    assert_eq!(r0.len(), base.len() + head.len());
    assert_eq!(vals(&r0["eagle.fc.weight"]), vals(&head["fc.weight"]));
    assert!(!r0.contains_key("eagle.embed_tokens.weight"));
    let q = Tensor::cat(
        &[
            &r0["eagle.layers.0.self_attn.q_proj.weight"],
            &r1["eagle.layers.0.self_attn.q_proj.weight"],
        ],
        0,
    )
    .unwrap();
    assert_eq!(vals(&q), vals(&head["layers.0.self_attn.q_proj.weight"]));
    let (_, meta) = kestrel_convert::read_checkpoint_config(&out).unwrap();
    let eagle = meta.eagle.unwrap();
    assert_eq!(
        (
            eagle.max_draft_len,
            eagle.num_eagle_layers,
            eagle.max_non_leaves_per_layer
        ),
        (32, 4, 10)
    );
    assert!(eagle.head_config.bias);
    assert!(meta
        .source_files
        .iter()
        .any(|f| f.file == "eagle/model.safetensors"));

    let bad = run(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&tmp.path().join("x")),
        "--eagle_model_dir",
        s(&eagle_src),
        "--max_draft_len",
        "257",
    ]);
    assert_eq!(bad.status.code(), Some(1));
    assert_eq!(
        stderr(&bad),
        "convert-checkpoint: error: --max_draft_len 257 is out of range: it must be between 1 and 256\n"
    );
}

#[test]
fn non_dividing_tp_is_refused_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    tiny_model(&src, 4, 2, false);
    let out = tmp.path().join("ckpt");
    let o = run(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--tp_size",
        "3",
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        "convert-checkpoint: error: num_attention_heads (4) is not divisible by --tp_size 3: choose a tp_size that divides it\n"
    );
    assert!(!out.exists());
    // No temporary sibling is left either.
    let left: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from("hf")]);
}

#[test]
fn failure_after_loading_keeps_an_earlier_output() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    tiny_model(&src, 4, 2, false);
    let out = tmp.path().join("ckpt");
    convert_ok(&["--model_dir", s(&src), "--output_dir", s(&out)]);
    let before = std::fs::read(out.join("rank0.safetensors")).unwrap();
    // Truncate the source: the second run fails and the first output stays as it was.
    let st = src.join("model.safetensors");
    let bytes = std::fs::read(&st).unwrap();
    std::fs::write(&st, &bytes[..bytes.len() / 2]).unwrap();
    let o = run(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--tp_size",
        "2",
    ]);
    assert_eq!(o.status.code(), Some(1));
    let err = stderr(&o);
    assert!(
        err.starts_with(&format!(
            "convert-checkpoint: error: {}: not a valid safetensors file",
            st.display()
        )),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1);
    assert_eq!(
        std::fs::read(out.join("rank0.safetensors")).unwrap(),
        before
    );
    assert!(!out.join("rank1.safetensors").exists());
}

#[test]
fn usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    tiny_model(&src, 4, 2, false);
    let out = tmp.path().join("ckpt");
    let both = run(&[
        "--model_dir",
        s(&src),
        "--gguf",
        "x.gguf",
        "--output_dir",
        s(&out),
    ]);
    assert_eq!(both.status.code(), Some(2));
    assert!(
        stderr(&both).contains("cannot be used with"),
        "{}",
        stderr(&both)
    );
    let neither = run(&["--output_dir", s(&out)]);
    assert_eq!(neither.status.code(), Some(2));
    let dtype = run(&[
        "--model_dir",
        s(&src),
        "--output_dir",
        s(&out),
        "--dtype",
        "int8",
    ]);
    assert_eq!(dtype.status.code(), Some(2));
    assert!(
        stderr(&dtype).contains("unknown dtype 'int8'"),
        "{}",
        stderr(&dtype)
    );
    assert!(!out.exists());

    let missing = tmp.path().join("nowhere");
    let o = run(&["--model_dir", s(&missing), "--output_dir", s(&out)]);
    assert_eq!(o.status.code(), Some(1));
    assert_eq!(
        stderr(&o),
        format!("convert-checkpoint: error: {}: directory does not exist: expected a Hugging Face model folder with config.json and the weights\n", missing.display())
    );
    assert!(!out.exists());

    // An existing folder that is not a checkpoint is never replaced.
    let o = run(&["--model_dir", s(&src), "--output_dir", s(&src)]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("exists and is not a Kestrel checkpoint"),
        "{}",
        stderr(&o)
    );
    assert!(src.join("model.safetensors").exists());
}

#[test]
fn same_input_gives_identical_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("hf");
    tiny_model(&src, 4, 2, false);
    let eagle_src = tmp.path().join("eagle");
    tiny_eagle(&eagle_src, 4, 2);
    let outs: Vec<PathBuf> = (0..2).map(|i| tmp.path().join(format!("out{i}"))).collect();
    for (i, out) in outs.iter().enumerate() {
        let workers = if i == 0 { "1" } else { "2" };
        convert_ok(&[
            "--model_dir",
            s(&src),
            "--output_dir",
            s(out),
            "--tp_size",
            "2",
            "--dtype",
            "bfloat16",
            "--workers",
            workers,
            "--eagle_model_dir",
            s(&eagle_src),
        ]);
    }
    for name in [
        "config.json",
        "rank0.safetensors",
        "rank1.safetensors",
        "chat_template.jinja",
    ] {
        let a = std::fs::read(outs[0].join(name)).unwrap();
        let b = std::fs::read(outs[1].join(name)).unwrap();
        assert!(a == b, "{name} differs between runs");
    }
}

#[test]
fn converts_the_real_smollm2_gguf() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("smollm2");
    convert_ok(&["--gguf", s(&gguf), "--output_dir", s(&out)]);
    let r0 = load(&out.join("rank0.safetensors"));
    assert_eq!(r0.len(), 2 + 30 * 9);
    assert!(!r0.contains_key("lm_head.weight"));
    assert_eq!(r0["model.embed_tokens.weight"].dims(), &[49152, 576]);
    assert_eq!(
        r0["model.layers.29.self_attn.k_proj.weight"].dims(),
        &[192, 576]
    );
    assert_eq!(
        r0["model.layers.0.mlp.down_proj.weight"].dims(),
        &[576, 1536]
    );
    assert_eq!(r0["model.norm.weight"].dims(), &[576]);
    assert!(out.join("tokenizer.json").is_file());
    assert!(std::fs::read_to_string(out.join("chat_template.jinja"))
        .unwrap()
        .contains("<|im_start|>"));
    let (cfg, meta) = kestrel_convert::read_checkpoint_config(&out).unwrap();
    assert_eq!((cfg.num_attention_heads, cfg.num_kv_heads()), (9, 3));
    assert_eq!(meta.source_files[0].file, "SmolLM2-135M-Instruct.Q4_1.gguf");
    let tok = kestrel_formats::load_tokenizer(&out.join("tokenizer.json")).unwrap();
    let ids = tok
        .encode("<|im_start|>user\nHi there<|im_end|>\n", false)
        .unwrap();
    assert_eq!(ids.get_ids(), &[1, 4093, 198, 26843, 665, 2, 198]);
}

//! Loading: per-rank files → unsharded model; missing or misshaped tensors are named.

mod common;

use candle_core::{Device, Tensor};
use common::*;
use kestrel_core::{DType, Mapping, ModelConfig};
use kestrel_model::llama::random_tensors;
use kestrel_model::{unshard, Llama, ModelError, OutputRows, SeqInput};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

fn last_hidden(m: &Llama) -> Vec<f32> {
    let mut cache = m.new_cache(8, 4).unwrap();
    let s = cache.add_sequence();
    let t = [3u32, 9, 27, 40, 5];
    let pos = [0u32, 1, 2, 3, 4];
    let out = m
        .forward(
            &[SeqInput {
                seq: s,
                tokens: &t,
                positions: &pos,
                mask: None,
                output_rows: OutputRows::Last,
            }],
            &mut cache,
        )
        .unwrap();
    to_vec(&out)
}

fn write_ranks(
    dir: &std::path::Path,
    cfg: &ModelConfig,
    tp: usize,
    tensors: &BTreeMap<String, Tensor>,
) -> Vec<PathBuf> {
    let m = Mapping::new(tp);
    (0..tp)
        .map(|r| {
            let shards: HashMap<String, Tensor> = tensors
                .iter()
                .map(|(k, t)| (k.clone(), unshard::shard(cfg, &m, k, t, r).unwrap()))
                .collect();
            let path = dir.join(format!("rank{r}.safetensors"));
            candle_core::safetensors::save(&shards, &path).unwrap();
            path
        })
        .collect()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kestrel-model-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn sharded_files_load_to_the_same_model() {
    for (name, cfg, tp) in [
        ("gqa", tiny_cfg(4, 2, false, false), 2),
        ("mqa-replicated-kv", tiny_cfg(4, 1, true, true), 4),
    ] {
        let tensors = random_tensors(&cfg, 5).unwrap();
        let want = last_hidden(
            &Llama::from_tensors(&cfg, tensors.clone(), DType::F32, &Device::Cpu).unwrap(),
        );
        let dir = tmpdir(name);
        let files = write_ranks(&dir, &cfg, tp, &tensors);
        let loaded = Llama::load(&cfg, Mapping::new(tp), &files, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(max_abs_diff(&last_hidden(&loaded), &want), 0.0, "{name}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn missing_and_misshaped_tensors_are_named() {
    let cfg = tiny_cfg(4, 2, false, false);
    let tensors = random_tensors(&cfg, 5).unwrap();

    let mut missing = tensors.clone();
    missing.remove("lm_head.weight");
    let err = Llama::from_tensors(&cfg, missing, DType::F32, &Device::Cpu).unwrap_err();
    assert!(
        matches!(&err, ModelError::MissingTensor { name, .. } if name == "lm_head.weight"),
        "{err}"
    );

    let mut bad = tensors.clone();
    bad.insert(
        "model.layers.1.mlp.down_proj.weight".into(),
        Tensor::zeros((3, 3), candle_core::DType::F32, &Device::Cpu).unwrap(),
    );
    let err = Llama::from_tensors(&cfg, bad, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.1.mlp.down_proj.weight") && err.contains("[3, 3]"),
        "{err}"
    );

    // In files: the error names the tensor and the file.
    let dir = tmpdir("missing");
    let mut partial = tensors.clone();
    partial.remove("model.layers.0.self_attn.k_proj.weight");
    let files = write_ranks(&dir, &cfg, 2, &partial);
    let err = Llama::load(&cfg, Mapping::new(2), &files, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("model.layers.0.self_attn.k_proj.weight") && err.contains("rank0.safetensors"),
        "{err}"
    );
    // Files sharded for tp 2 do not load as tp 1.
    let err = Llama::load(&cfg, Mapping::new(1), &files[..1], DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank0.safetensors"), "{err}");
    let err = Llama::load(
        &cfg,
        Mapping::new(2),
        &[dir.join("nope.safetensors"), dir.join("nope1.safetensors")],
        DType::F32,
        &Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("nope.safetensors"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

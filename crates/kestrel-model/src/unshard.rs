//! Reassembling tensor-parallel shards on one device.
//!
//! Each rank file holds its slice of every tensor per [`Mapping::shard_range`]: column-parallel
//! weights split along dim 0, row-parallel ones along dim 1, the rest replicated. Unsharding
//! concatenates the slices along the split dimension in range order, taking each range once
//! (KV heads replicated on several ranks appear once).

use crate::error::{ModelError, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{Device, Tensor};
use kestrel_core::{Mapping, ModelConfig, ShardDim};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn split_dim(name: &str) -> Option<usize> {
    match Mapping::shard_dim(name) {
        ShardDim::Replicated => None,
        ShardDim::Rows => Some(0),
        ShardDim::Cols => Some(1),
    }
}

/// The shape rank `rank` holds of tensor `name` whose full shape is `full`.
pub fn shard_shape(
    cfg: &ModelConfig,
    mapping: &Mapping,
    name: &str,
    full: &[usize],
    rank: usize,
) -> Vec<usize> {
    let mut shape = full.to_vec();
    if let Some(d) = split_dim(name) {
        if d < full.len() {
            if let Some(r) = mapping.shard_range(cfg, name, full[d], rank) {
                shape[d] = r.len();
            }
        }
    }
    shape
}

/// Rank `rank`'s slice of the full tensor `name` (what convert-checkpoint writes).
pub fn shard(
    cfg: &ModelConfig,
    mapping: &Mapping,
    name: &str,
    full: &Tensor,
    rank: usize,
) -> Result<Tensor> {
    match split_dim(name) {
        Some(d) if d < full.rank() => match mapping.shard_range(cfg, name, full.dim(d)?, rank) {
            Some(r) => Ok(full.narrow(d, r.start, r.len())?.contiguous()?),
            None => Ok(full.clone()),
        },
        _ => Ok(full.clone()),
    }
}

/// Reassembles tensor `name` of full shape `full` from its per-rank slices `shards[rank]`;
/// `origins[rank]` names where each came from for error messages.
pub fn unshard(
    cfg: &ModelConfig,
    mapping: &Mapping,
    name: &str,
    full: &[usize],
    shards: &[Tensor],
    origins: &[String],
) -> Result<Tensor> {
    if shards.len() != mapping.tp_size || origins.len() != shards.len() {
        return Err(ModelError::InvalidInput(format!(
            "tensor '{name}': {} shards for tp_size {}",
            shards.len(),
            mapping.tp_size
        )));
    }
    for (rank, t) in shards.iter().enumerate() {
        let want = shard_shape(cfg, mapping, name, full, rank);
        if t.dims() != want.as_slice() {
            return Err(ModelError::ShapeMismatch {
                name: name.to_string(),
                origin: origins[rank].clone(),
                expected: want,
                got: t.dims().to_vec(),
            });
        }
    }
    let Some(d) = split_dim(name).filter(|&d| d < full.len() && mapping.tp_size > 1) else {
        return Ok(shards[0].clone());
    };
    let mut pieces: BTreeMap<usize, (usize, &Tensor)> = BTreeMap::new();
    for (rank, t) in shards.iter().enumerate() {
        if let Some(r) = mapping.shard_range(cfg, name, full[d], rank) {
            pieces.entry(r.start).or_insert((r.end, t));
        }
    }
    let mut next = 0;
    for (&start, &(end, _)) in &pieces {
        if start != next {
            break;
        }
        next = end;
    }
    if next != full[d] {
        return Err(ModelError::InvalidInput(format!(
            "tensor '{name}': the shards of tp_size {} do not cover its {} {}",
            mapping.tp_size,
            full[d],
            if d == 0 { "rows" } else { "columns" }
        )));
    }
    let parts: Vec<&Tensor> = pieces.values().map(|(_, t)| *t).collect();
    Ok(Tensor::cat(&parts, d)?)
}

/// Opens the rank files and reassembles every expected tensor (in its stored dtype, on CPU).
fn map_file(path: &Path) -> Result<MmapedSafetensors> {
    // SAFETY: the file is mapped read-only; Kestrel never writes a checkpoint it is reading.
    unsafe { MmapedSafetensors::new(path) }.map_err(|e| ModelError::File {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

/// The tensors of the safetensors file `path` whose names start with `prefix`, keyed
/// without it, on the CPU. Only they are read: an engine's rank file holds the EAGLE head
/// beside the whole base model, which reading the file whole would load a second time.
pub fn load_prefixed(path: &Path, prefix: &str) -> Result<BTreeMap<String, Tensor>> {
    let st = map_file(path)?;
    let mut out = BTreeMap::new();
    for (name, _) in st.tensors() {
        let Some(short) = name.strip_prefix(prefix) else {
            continue;
        };
        let t = st.load(&name, &Device::Cpu).map_err(|e| ModelError::File {
            path: path.display().to_string(),
            message: format!("tensor '{name}': {e}"),
        })?;
        out.insert(short.to_string(), t);
    }
    Ok(out)
}

/// Per-rank checkpoint files, mapped, from which full tensors are reassembled one at a time.
pub(crate) struct ShardedFiles {
    cfg: ModelConfig,
    mapping: Mapping,
    files: Vec<MmapedSafetensors>,
    origins: Vec<String>,
}

impl ShardedFiles {
    /// Maps `rank_files` (one per rank of `mapping`) after checking the mapping fits `cfg`.
    pub(crate) fn open(
        cfg: &ModelConfig,
        mapping: Mapping,
        rank_files: &[PathBuf],
    ) -> Result<Self> {
        if rank_files.len() != mapping.tp_size {
            return Err(ModelError::InvalidInput(format!(
                "{} rank files given for tp_size {}",
                rank_files.len(),
                mapping.tp_size
            )));
        }
        mapping.validate(cfg).map_err(ModelError::Config)?;
        Ok(ShardedFiles {
            cfg: cfg.clone(),
            mapping,
            files: rank_files
                .iter()
                .map(|p| map_file(p))
                .collect::<Result<Vec<_>>>()?,
            origins: rank_files.iter().map(|p| p.display().to_string()).collect(),
        })
    }

    /// The full tensor `name` of shape `full`, reassembled from every rank's slice (on the
    /// CPU, in the files' dtype).
    pub(crate) fn load(&self, name: &str, full: &[usize]) -> Result<Tensor> {
        let mut shards = Vec::with_capacity(self.files.len());
        for (rank, st) in self.files.iter().enumerate() {
            let origin = &self.origins[rank];
            let view = st.get(name).map_err(|_| ModelError::MissingTensor {
                name: name.to_string(),
                origin: origin.clone(),
            })?;
            let want = shard_shape(&self.cfg, &self.mapping, name, full, rank);
            if view.shape() != want.as_slice() {
                return Err(ModelError::ShapeMismatch {
                    name: name.to_string(),
                    origin: origin.clone(),
                    expected: want,
                    got: view.shape().to_vec(),
                });
            }
            let t = st.load(name, &Device::Cpu).map_err(|e| ModelError::File {
                path: origin.clone(),
                message: format!("tensor '{name}': {e}"),
            })?;
            shards.push(t);
        }
        unshard(&self.cfg, &self.mapping, name, full, &shards, &self.origins)
    }

    /// The files, comma-separated, for messages.
    pub(crate) fn origin(&self) -> String {
        self.origins.join(", ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::llama::{expected_tensors, random_tensors};

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        serde_json::from_str(&format!(
            r#"{{"vocab_size": 24, "hidden_size": {}, "intermediate_size": 16,
                "num_hidden_layers": 1, "num_attention_heads": {heads}, "num_key_value_heads": {kv}}}"#,
            heads * 4
        ))
        .unwrap()
    }

    #[test]
    fn shard_then_unshard_is_identity() {
        // MHA, GQA with kv >= tp, GQA/MQA with kv < tp (replicated KV heads).
        for (heads, kv, tp) in [(4, 4, 2), (8, 4, 2), (8, 2, 4), (8, 1, 4), (4, 2, 1)] {
            let c = cfg(heads, kv);
            let m = Mapping::new(tp);
            m.validate(&c).unwrap();
            let tensors = random_tensors(&c, 7).unwrap();
            for (name, full) in expected_tensors(&c) {
                let t = &tensors[&name];
                let shards: Vec<Tensor> = (0..tp)
                    .map(|r| shard(&c, &m, &name, t, r).unwrap())
                    .collect();
                let origins: Vec<String> = (0..tp).map(|r| format!("rank{r}")).collect();
                let back = unshard(&c, &m, &name, &full, &shards, &origins).unwrap();
                assert_eq!(back.dims(), t.dims(), "{name}");
                let diff: f32 = (back - t)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar()
                    .unwrap();
                assert_eq!(diff, 0.0, "{name} heads {heads} kv {kv} tp {tp}");
            }
        }
    }

    #[test]
    fn misshaped_shard_names_tensor_and_file() {
        let c = cfg(4, 4);
        let m = Mapping::new(2);
        let name = "model.layers.0.self_attn.q_proj.weight";
        let good = Tensor::zeros((8, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
        let bad = Tensor::zeros((9, 16), candle_core::DType::F32, &Device::Cpu).unwrap();
        let err = unshard(
            &c,
            &m,
            name,
            &[16, 16],
            &[good, bad],
            &["r0.st".into(), "r1.st".into()],
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains(name) && err.contains("r1.st"), "{err}");
    }
}

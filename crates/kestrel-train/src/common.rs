//! Pieces shared by the EAGLE-head and draft-model trainers: reading a frozen model's full
//! tensors back from an engine's rank files, the train/validation split, length-grouped
//! batches, the learning-rate schedule and gradient clipping.

use crate::dataset::FeatureDataset;
use crate::error::{file_err, invalid, Result};
use candle_core::backprop::GradStore;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};
use kestrel_core::{Mapping, ModelConfig};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::path::PathBuf;

/// The training log written next to a trained draft.
pub const TRAIN_LOG_FILE: &str = "train_log.json";

/// The full (unsharded) shape of the HF tensor `name` of `cfg`, if it is one.
pub(crate) fn full_shape(cfg: &ModelConfig, name: &str) -> Option<Vec<usize>> {
    kestrel_model::llama::expected_tensors(cfg)
        .into_iter()
        .find(|(n, _)| n == name)
        .map(|(_, s)| s)
}

/// An engine's (or checkpoint's) per-rank safetensors files, memory-mapped, from which full
/// HF-named tensors are reassembled one at a time: a trainer reads only the tensors it needs.
pub struct RankFiles {
    cfg: ModelConfig,
    mapping: Mapping,
    paths: Vec<PathBuf>,
    files: Vec<MmapedSafetensors>,
}

impl RankFiles {
    pub fn open(cfg: &ModelConfig, mapping: Mapping, rank_files: &[PathBuf]) -> Result<Self> {
        if rank_files.len() != mapping.tp_size {
            return Err(invalid(format!(
                "{} rank files for tp_size {}",
                rank_files.len(),
                mapping.tp_size
            )));
        }
        let mut files = Vec::with_capacity(rank_files.len());
        for path in rank_files {
            // SAFETY: mapped read-only; nothing writes an engine while it is being read.
            let st = unsafe { MmapedSafetensors::new(path) }.map_err(|e| file_err(path, e))?;
            files.push(st);
        }
        Ok(RankFiles {
            cfg: cfg.clone(),
            mapping,
            paths: rank_files.to_vec(),
            files,
        })
    }

    /// The full tensor `name` (HF name), f32 on the CPU.
    pub fn get(&self, name: &str) -> Result<Tensor> {
        let cfg = &self.cfg;
        let full = full_shape(cfg, name)
            .ok_or_else(|| invalid(format!("'{name}' is not a tensor of this model")))?;
        let origins: Vec<String> = self.paths.iter().map(|p| p.display().to_string()).collect();
        let mut shards = Vec::with_capacity(self.files.len());
        for (st, path) in self.files.iter().zip(&self.paths) {
            shards.push(
                st.load(name, &Device::Cpu)
                    .map_err(|e| file_err(path, format!("tensor '{name}': {e}")))?,
            );
        }
        let t =
            kestrel_model::unshard::unshard(cfg, &self.mapping, name, &full, &shards, &origins)?;
        Ok(t.to_dtype(DType::F32)?)
    }
}

/// Splits sequence indices into (train, validation), deterministically from `seed`.
pub fn split(n: usize, val_fraction: f64, seed: u64) -> (Vec<usize>, Vec<usize>) {
    let mut idx: Vec<usize> = (0..n).collect();
    idx.shuffle(&mut ChaCha8Rng::seed_from_u64(seed ^ 0x5eed));
    let mut n_val = (n as f64 * val_fraction.clamp(0.0, 1.0)).round() as usize;
    if val_fraction > 0.0 && n >= 2 {
        n_val = n_val.clamp(1, n - 1);
    }
    let val = idx.split_off(n - n_val);
    (idx, val)
}

/// Batches of an epoch: shuffled, then grouped by length in windows of 16 batches so that
/// little padding is trained on.
pub fn epoch_batches(
    data: &FeatureDataset,
    train: &[usize],
    batch_size: usize,
    rng: &mut ChaCha8Rng,
) -> Vec<Vec<usize>> {
    let mut idx = train.to_vec();
    idx.shuffle(rng);
    let mut batches = Vec::new();
    for group in idx.chunks(batch_size * 16) {
        let mut g = group.to_vec();
        g.sort_by_key(|&s| data.seq_len(s));
        batches.extend(g.chunks(batch_size).map(<[usize]>::to_vec));
    }
    batches.shuffle(rng);
    batches
}

/// The learning rate of step `step` (0-based) of `total`: linear warmup over `warmup_steps`
/// to `lr`, then cosine decay to `lr · min_lr_ratio` at the last step.
pub fn cosine_lr(
    lr: f64,
    warmup_steps: usize,
    min_lr_ratio: f64,
    step: usize,
    total: usize,
) -> f64 {
    if step < warmup_steps {
        return lr * (step + 1) as f64 / warmup_steps as f64;
    }
    let span = total.saturating_sub(warmup_steps).max(1);
    let progress = ((step - warmup_steps) as f64 / span as f64).min(1.0);
    let cos = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
    lr * (min_lr_ratio + (1.0 - min_lr_ratio) * cos)
}

/// The global norm of the gradients of `vars`; when it exceeds `grad_clip` (> 0) they are
/// scaled down to that norm. A non-finite norm is an error naming step `step`.
pub fn clip_gradients(
    vars: &[Var],
    grads: &mut GradStore,
    grad_clip: f64,
    step: usize,
) -> Result<f64> {
    let mut sq = 0f64;
    for v in vars {
        if let Some(g) = grads.get(v.as_tensor()) {
            sq += g.sqr()?.sum_all()?.to_scalar::<f32>()? as f64;
        }
    }
    let norm = sq.sqrt();
    if !norm.is_finite() {
        return Err(invalid(format!(
            "step {step}: the gradient is not finite (norm {norm}): lower --lr"
        )));
    }
    if grad_clip > 0.0 && norm > grad_clip {
        let s = grad_clip / norm;
        for v in vars {
            if let Some(g) = grads.remove(v.as_tensor()) {
                grads.insert(v.as_tensor(), (g * s)?);
            }
        }
    }
    Ok(norm)
}

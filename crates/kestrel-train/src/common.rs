//! Pieces shared by the EAGLE-head and draft-model trainers: reading a frozen model's full
//! tensors back from an engine's rank files, the train/validation split, length-grouped
//! batches, the learning-rate schedule and gradient clipping, and writing and reading a
//! model folder.

use crate::dataset::FeatureDataset;
use crate::error::{file_err, invalid, Result};
use candle_core::backprop::GradStore;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor, Var};
use kestrel_core::{AtomicDir, Mapping, ModelConfig};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

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

/// The part of a training recipe both trainers share: the AdamW optimizer, its learning-rate
/// schedule ([`cosine_lr`]), the batching and the seed. Each trainer's configuration
/// flattens it in, so a saved configuration keeps its keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Recipe {
    /// Total epochs (a resumed run continues up to this many).
    pub epochs: usize,
    /// Peak learning rate (after warmup), AdamW.
    pub lr: f64,
    /// Linear warmup steps, then cosine decay to `lr · min_lr_ratio` at the last step.
    pub warmup_steps: usize,
    pub min_lr_ratio: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 disables.
    pub grad_clip: f64,
    /// Sequences per step.
    pub batch_size: usize,
    /// Rows per chunk of vocabulary-sized logits (memory bound).
    pub logits_chunk: usize,
    pub seed: u64,
    /// Save, and end with, the weights of the epoch with the best held-out score (each
    /// trainer names its score; the starting weights count as epoch 0 and ties keep the
    /// earlier) rather than the last epoch's: a fine-tune that drifts gives back the weights
    /// it started from.
    #[serde(default)]
    pub keep_best: bool,
    /// With `keep_best`: stop once this many epochs in a row have not beaten the best.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub early_stop: Option<usize>,
}

impl Recipe {
    /// AdamW (β 0.9 / 0.95, no weight decay) at peak rate `lr` after `warmup_steps`, decaying
    /// to a tenth, clipped at `grad_clip`; 4 epochs of 8 sequences, logits in chunks of 256
    /// rows, seed 0: what both trainers start from, with their own rate, warmup and clip.
    pub fn new(lr: f64, warmup_steps: usize, grad_clip: f64) -> Self {
        Recipe {
            epochs: 4,
            lr,
            warmup_steps,
            min_lr_ratio: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            weight_decay: 0.0,
            grad_clip,
            batch_size: 8,
            logits_chunk: 256,
            seed: 0,
            keep_best: false,
            early_stop: None,
        }
    }

    /// The checks every trainer's settings share: batches and logits chunks of at least one,
    /// windows (`max_len`, whose meaning each trainer gives) of at least two tokens, a
    /// positive finite learning rate and a floor ratio in [0, 1].
    pub fn validate(&self, max_len: usize) -> Result<()> {
        if self.batch_size == 0 || max_len < 2 || self.logits_chunk == 0 {
            return Err(invalid(
                "--batch_size and --logits_chunk must be at least 1 and --max_len at least 2",
            ));
        }
        if !(self.lr > 0.0 && self.lr.is_finite()) {
            return Err(invalid(format!("--lr {} must be positive", self.lr)));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(invalid("--min_lr_ratio must lie in [0, 1]"));
        }
        match self.early_stop {
            Some(0) => Err(invalid("--early_stop must be at least 1 epoch")),
            Some(n) if !self.keep_best => Err(invalid(format!(
                "--early_stop {n} needs --keep_best: a run cut short should write its best epoch, not its last"
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses `keep_best` without held-out sequences, the only judge of an epoch.
    pub fn check_held_out(&self, val: &[usize]) -> Result<()> {
        if self.keep_best && val.is_empty() {
            return Err(invalid(
                "keeping the best epoch needs held-out sequences to compare epochs on",
            ));
        }
        Ok(())
    }

    /// The learning rate of step `step` (0-based) of `total`.
    pub fn lr_at(&self, step: usize, total: usize) -> f64 {
        cosine_lr(self.lr, self.warmup_steps, self.min_lr_ratio, step, total)
    }
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

/// A config's JSON text with `torch_dtype` set to `dtype`'s HF name, as published model
/// folders carry it.
pub(crate) fn config_json_with_dtype(cfg: &impl Serialize, dtype: DType) -> String {
    let mut v = serde_json::to_value(cfg).expect("config serialises");
    let name = match dtype {
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        _ => "float32",
    };
    v["torch_dtype"] = serde_json::Value::String(name.into());
    serde_json::to_string_pretty(&v).expect("JSON prints")
}

/// Refuses a save dtype other than float16, bfloat16 or float32.
pub(crate) fn check_save_dtype(dtype: DType) -> Result<()> {
    if !matches!(dtype, DType::F16 | DType::BF16 | DType::F32) {
        return Err(invalid(format!(
            "save dtype {dtype:?}: use float16, bfloat16 or float32"
        )));
    }
    Ok(())
}

/// The `expected` tensors out of `tensors`, checked against their shapes (`what` names them
/// in errors: "draft", "head"), each passed through `convert`.
pub(crate) fn expected_for_save(
    expected: Vec<(String, Vec<usize>)>,
    tensors: &BTreeMap<String, Tensor>,
    what: &str,
    convert: impl Fn(&Tensor) -> Result<Tensor>,
) -> Result<HashMap<String, Tensor>> {
    let mut map = HashMap::new();
    for (name, shape) in expected {
        let t = tensors
            .get(&name)
            .ok_or_else(|| invalid(format!("{what} tensor '{name}' is missing")))?;
        if t.dims() != shape.as_slice() {
            return Err(invalid(format!(
                "{what} tensor '{name}' has shape {:?}, expected {shape:?}",
                t.dims()
            )));
        }
        map.insert(name, convert(t)?);
    }
    Ok(map)
}

/// A model folder's files, written by [`write_model_dir`].
pub(crate) struct ModelDirFiles<'a> {
    pub weights_file: &'a str,
    pub config_file: &'a str,
    pub config_json: String,
    /// Copied into the folder under their file names.
    pub copy_files: &'a [PathBuf],
    /// Further text files: (name, text).
    pub extra: &'a [(&'a str, String)],
}

/// Writes `weights` (safetensors) and `files` into `dir`, replacing it atomically.
pub(crate) fn write_model_dir(
    dir: &Path,
    weights: &HashMap<String, Tensor>,
    files: ModelDirFiles,
) -> Result<()> {
    let out = AtomicDir::new(dir).map_err(|e| file_err(dir, e))?;
    let path = out.path().join(files.weights_file);
    candle_core::safetensors::save(weights, &path).map_err(|e| file_err(&path, e))?;
    let config = out.path().join(files.config_file);
    std::fs::write(&config, files.config_json).map_err(|e| file_err(&config, e))?;
    for src in files.copy_files {
        let name = src
            .file_name()
            .ok_or_else(|| file_err(src, "not a file to copy"))?;
        std::fs::copy(src, out.path().join(name)).map_err(|e| file_err(src, e))?;
    }
    for (name, text) in files.extra {
        let p = out.path().join(name);
        std::fs::write(&p, text).map_err(|e| file_err(&p, e))?;
    }
    out.commit().map_err(|e| file_err(dir, e))?;
    Ok(())
}

/// The `expected` tensors of the safetensors file `path`, f32 on the CPU, checked against
/// their shapes.
pub(crate) fn load_expected(
    path: &Path,
    expected: Vec<(String, Vec<usize>)>,
) -> Result<BTreeMap<String, Tensor>> {
    let mut all =
        candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| file_err(path, e))?;
    let mut out = BTreeMap::new();
    for (name, shape) in expected {
        let t = all
            .remove(&name)
            .ok_or_else(|| file_err(path, format!("tensor '{name}' is missing")))?;
        if t.dims() != shape.as_slice() {
            return Err(file_err(
                path,
                format!(
                    "tensor '{name}' has shape {:?}, expected {shape:?}",
                    t.dims()
                ),
            ));
        }
        out.insert(name, t.to_dtype(DType::F32)?);
    }
    Ok(out)
}

/// The trained variables of `varmap`, locked (candle keeps them behind a mutex).
pub(crate) fn locked_vars(
    varmap: &candle_nn::VarMap,
) -> Result<std::sync::MutexGuard<'_, HashMap<String, Var>>> {
    varmap
        .data()
        .lock()
        .map_err(|_| invalid("variable map lock poisoned"))
}

/// Sets every variable of `varmap` to its tensor in `tensors` (a snapshot of them, on any
/// device), in place.
pub(crate) fn restore_vars(
    varmap: &candle_nn::VarMap,
    tensors: &BTreeMap<String, Tensor>,
) -> Result<()> {
    for (name, var) in locked_vars(varmap)?.iter() {
        let t = tensors
            .get(name)
            .ok_or_else(|| invalid(format!("the saved weights lack tensor '{name}'")))?;
        var.set(&t.to_device(var.device())?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::draft::DraftTrainConfig;
    use crate::eagle::TrainConfig;

    /// A bad setting applied to each trainer's defaults, and the message it must give.
    type Case = (
        &'static str,
        fn(&mut TrainConfig),
        fn(&mut DraftTrainConfig),
    );

    /// Both trainers refuse the same bad schedules with the same messages.
    #[test]
    fn both_trainers_refuse_a_bad_schedule_with_its_message() {
        let shape = "--batch_size and --logits_chunk must be at least 1 and --max_len at least 2";
        let cases: [Case; 7] = [
            (
                shape,
                |c| c.recipe.batch_size = 0,
                |c| c.recipe.batch_size = 0,
            ),
            (shape, |c| c.max_len = 1, |c| c.max_len = 1),
            (
                shape,
                |c| c.recipe.logits_chunk = 0,
                |c| c.recipe.logits_chunk = 0,
            ),
            (
                "--lr -0.5 must be positive",
                |c| c.recipe.lr = -0.5,
                |c| c.recipe.lr = -0.5,
            ),
            (
                "--min_lr_ratio must lie in [0, 1]",
                |c| c.recipe.min_lr_ratio = 1.5,
                |c| c.recipe.min_lr_ratio = 1.5,
            ),
            (
                "--early_stop 2 needs --keep_best: a run cut short should write its best epoch, not its last",
                |c| c.recipe.early_stop = Some(2),
                |c| c.recipe.early_stop = Some(2),
            ),
            (
                "--early_stop must be at least 1 epoch",
                |c| (c.recipe.keep_best, c.recipe.early_stop) = (true, Some(0)),
                |c| (c.recipe.keep_best, c.recipe.early_stop) = (true, Some(0)),
            ),
        ];
        for (want, eagle, draft) in cases {
            let mut e = TrainConfig::default();
            eagle(&mut e);
            assert_eq!(e.validate().unwrap_err().to_string(), want);
            let mut d = DraftTrainConfig::default();
            draft(&mut d);
            assert_eq!(d.validate().unwrap_err().to_string(), want);
        }
        assert!(TrainConfig::default().validate().is_ok());
        assert!(DraftTrainConfig::default().validate().is_ok());
    }

    /// The shared recipe is flattened into each configuration: the shipped head's training
    /// log (written before the recipe was its own struct) reads back, and the recipe's keys
    /// are written out at the top level with the values read.
    #[test]
    fn saved_configurations_keep_their_flat_keys() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../heads/smollm2-eagle/train_log.json"
        );
        let log: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let saved = log["config"].clone();
        let cfg: TrainConfig = serde_json::from_value(saved.clone()).unwrap();
        assert_eq!(cfg.recipe.lr, 3e-4);
        assert_eq!(cfg.recipe.batch_size, 32);
        assert_eq!(cfg.max_len, 768);
        let written = serde_json::to_value(&cfg).unwrap();
        let recipe = serde_json::to_value(&cfg.recipe).unwrap();
        for key in recipe.as_object().unwrap().keys() {
            match saved.get(key) {
                Some(value) => assert_eq!(&written[key], value, "{key}"),
                // Added after that log was written: read as its default.
                None => assert_eq!((key.as_str(), &written[key]), ("keep_best", &false.into())),
            }
        }
        assert!(written.get("recipe").is_none());
        let draft = serde_json::to_value(DraftTrainConfig::default()).unwrap();
        assert_eq!(draft["lr"], 1e-3);
        assert!(draft.get("recipe").is_none());
    }
}

//! Draft-model distillation: a small Llama that shares the target's tokenizer and shapes
//! (the target's config with fewer decoder layers) learns the target's next-token
//! distributions, for draft-target decoding.
//!
//! * **Student.** Decoder layer `i` starts as a copy of target layer `init_layers[i]`
//!   ([`default_init_layers`]: evenly spaced, first and last included); the embedding, the
//!   final norm and the LM head are the target's. The embedding (and an untied LM head) stay
//!   frozen unless `train_embeddings`: they hold most of a small model's parameters, and
//!   sharing the target's keeps the draft's token space the target's. A tied head stays tied.
//! * **Targets.** The target's distribution at a position is `softmax(lm_head(f))` of its
//!   final-normed hidden state `f`, which the self-distillation data
//!   ([`crate::dataset::FeatureDataset`], written by `spec-train eagle --stage data`) already
//!   holds for every position. So the frozen target costs one LM-head product per loss row
//!   and no forward at all, and nothing vocabulary-wide is stored.
//! * **Loss**, per answer position (a position whose next token is part of the answer):
//!   `T² · KL(p_T ‖ q_T)` (forward KL at temperature `T`, scaled by `T²` so that gradient
//!   magnitudes do not depend on `T`) plus `ce_weight ·` the cross-entropy of the student on
//!   the target's greedy token. Both gradients with respect to the student's logits are
//!   closed-form (`T · (q_T − p_T)` and `q − onehot`), so the logits stay out of candle's
//!   autograd graph as in the EAGLE trainer: they are computed in row chunks, turned into a
//!   gradient on the student's final hidden states (and on the LM head when it trains), and
//!   only `Σ h · g` is back-propagated through the decoder.
//! * **Output.** An HF model folder (`config.json`, `model.safetensors` under HF names, the
//!   engine's tokenizer files, `train_log.json`), rewritten atomically after every epoch, that
//!   `convert-checkpoint --model_dir` reads.

use crate::common::{
    check_save_dtype, clip_gradients, config_json_with_dtype, expected_for_save, load_expected,
    locked_vars, restore_vars, write_model_dir, ModelDirFiles, RankFiles, Recipe, TRAIN_LOG_FILE,
};
use crate::dataset::FeatureDataset;
use crate::error::{file_err, invalid, Result, TrainError};
use crate::train_loop::{
    log_initial, run_epochs, BestEpoch, EpochEnd, EpochMeans, EpochTrainer, Schedule,
};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use kestrel_core::ModelConfig;
use kestrel_model::llama::{expected_tensors, random_tensors};
use kestrel_model::Llama;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Files of a draft model folder (Hugging Face layout).
pub const DRAFT_CONFIG_FILE: &str = "config.json";
pub const DRAFT_WEIGHTS_FILE: &str = "model.safetensors";

/// The embedding's HF name.
const EMBED: &str = "model.embed_tokens.weight";
/// An untied LM head's HF name.
const LM_HEAD: &str = "lm_head.weight";

/// Target layers that the student's `num_layers` layers start from: layer 0 (it reads the
/// raw embeddings, as the student's first layer will), the last layer (it writes the
/// residual stream the final norm and the LM head expect), and the others at multiples of
/// `target_layers / (num_layers − 1)` in between, so the copies cover the whole depth. For
/// 30 layers and 4: 0, 10, 20, 29. One layer: layer 0. Empty for `num_layers` 0.
pub fn default_init_layers(target_layers: usize, num_layers: usize) -> Vec<usize> {
    match num_layers {
        0 => Vec::new(),
        1 => vec![0],
        n => (0..n)
            .map(|i| (i * target_layers / (n - 1)).min(target_layers.saturating_sub(1)))
            .collect(),
    }
}

/// Checks `--num_layers` and `--init_layers` against the target's depth and returns the
/// target layer each student layer starts from (`init`, or [`default_init_layers`]).
pub fn resolve_init_layers(
    target_layers: usize,
    num_layers: usize,
    init: Option<&[usize]>,
) -> Result<Vec<usize>> {
    if num_layers == 0 {
        return Err(invalid("--num_layers must be at least 1"));
    }
    if num_layers > target_layers {
        return Err(invalid(format!(
            "--num_layers {num_layers} exceeds the target's {target_layers} decoder layers: a draft has at most as many layers as its target"
        )));
    }
    let Some(list) = init else {
        return Ok(default_init_layers(target_layers, num_layers));
    };
    if list.len() != num_layers {
        return Err(invalid(format!(
            "--init_layers lists {} layers but --num_layers is {num_layers}: give one target layer per draft layer",
            list.len()
        )));
    }
    if let Some(&bad) = list.iter().find(|&&l| l >= target_layers) {
        return Err(invalid(format!(
            "--init_layers: layer {bad} is out of range: the target's decoder layers are 0..={}",
            target_layers - 1
        )));
    }
    Ok(list.to_vec())
}

/// The draft's configuration: the target's with `num_layers` decoder layers (same
/// vocabulary, special tokens, shapes and RoPE).
pub fn draft_config(target: &ModelConfig, num_layers: usize) -> ModelConfig {
    let mut cfg = target.clone();
    cfg.architectures = vec!["LlamaForCausalLM".into()];
    cfg.num_hidden_layers = num_layers;
    cfg.rope_parameters = None;
    cfg
}

/// Where the target's full, HF-named tensors come from.
pub trait TargetTensors {
    /// The tensor `name`, f32 on the CPU.
    fn tensor(&self, name: &str) -> Result<Tensor>;
}

impl TargetTensors for BTreeMap<String, Tensor> {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        let t = self
            .get(name)
            .ok_or_else(|| invalid(format!("target tensor '{name}' is missing")))?;
        Ok(t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)
    }
}

impl TargetTensors for RankFiles {
    fn tensor(&self, name: &str) -> Result<Tensor> {
        self.get(name)
    }
}

/// Where the student's first weights come from.
#[derive(Debug, Clone)]
pub enum DraftInit {
    /// Student layer `i` is a copy of target layer `layers[i]`.
    TargetLayers(Vec<usize>),
    /// Seeded random layers (PyTorch-like bounds, norms near 1); embedding, final norm and
    /// LM head are still the target's. The untrained baseline.
    Random { seed: u64 },
    /// Every student tensor under its HF name (resuming from a written draft).
    Tensors(BTreeMap<String, Tensor>),
}

/// The student's initial tensors (HF names, f32, CPU) for a draft of `num_layers` layers.
pub fn initial_student(
    target_cfg: &ModelConfig,
    target: &dyn TargetTensors,
    num_layers: usize,
    init: DraftInit,
) -> Result<BTreeMap<String, Tensor>> {
    let cfg = draft_config(target_cfg, num_layers);
    let expected = expected_tensors(&cfg);
    let mut out = BTreeMap::new();
    match init {
        DraftInit::Tensors(mut given) => {
            for (name, shape) in &expected {
                let t = given
                    .remove(name)
                    .ok_or_else(|| invalid(format!("draft tensor '{name}' is missing")))?;
                if t.dims() != shape.as_slice() {
                    return Err(invalid(format!(
                        "draft tensor '{name}' has shape {:?}, expected {shape:?}",
                        t.dims()
                    )));
                }
                out.insert(name.clone(), t.to_dtype(DType::F32)?);
            }
        }
        DraftInit::TargetLayers(layers) => {
            let layers = resolve_init_layers(
                target_cfg.num_hidden_layers,
                num_layers,
                Some(layers.as_slice()),
            )?;
            for (name, _) in &expected {
                let source = match layer_of(name) {
                    Some((i, rest)) => format!("model.layers.{}.{rest}", layers[i]),
                    None => name.clone(),
                };
                out.insert(name.clone(), target.tensor(&source)?);
            }
        }
        DraftInit::Random { seed } => {
            resolve_init_layers(target_cfg.num_hidden_layers, num_layers, None)?;
            let random = random_tensors(&cfg, seed)?;
            for (name, _) in &expected {
                let t = match layer_of(name) {
                    Some(_) => random[name].clone(),
                    None => target.tensor(name)?,
                };
                out.insert(name.clone(), t);
            }
        }
    }
    Ok(out)
}

/// `model.layers.{i}.{rest}` → `(i, rest)`.
fn layer_of(name: &str) -> Option<(usize, &str)> {
    let rest = name.strip_prefix("model.layers.")?;
    let (i, rest) = rest.split_once('.')?;
    Some((i.parse().ok()?, rest))
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DraftTrainConfig {
    #[serde(flatten)]
    pub recipe: Recipe,
    /// Longest window trained on: a sequence's first `max_len` tokens (the draft always
    /// sees its context from position 0 at inference, so the window keeps the start).
    pub max_len: usize,
    /// Temperature `T` of the KL term.
    pub kd_temperature: f64,
    /// Weight of the cross-entropy on the target's greedy tokens.
    pub ce_weight: f64,
    /// Train the embedding (and an untied LM head) too.
    pub train_embeddings: bool,
}

impl Default for DraftTrainConfig {
    fn default() -> Self {
        DraftTrainConfig {
            recipe: Recipe::new(1e-3, 10, 1.0),
            max_len: 512,
            kd_temperature: 1.0,
            ce_weight: 0.0,
            train_embeddings: false,
        }
    }
}

impl DraftTrainConfig {
    pub fn validate(&self) -> Result<()> {
        self.recipe.validate(self.max_len)?;
        if !(self.kd_temperature > 0.0 && self.kd_temperature.is_finite()) {
            return Err(invalid(format!(
                "--kd_temperature {} must be positive",
                self.kd_temperature
            )));
        }
        if !(self.ce_weight >= 0.0 && self.ce_weight.is_finite()) {
            return Err(invalid(format!(
                "--ce_weight {} must be non-negative",
                self.ce_weight
            )));
        }
        Ok(())
    }
}

/// One training or evaluation batch, on the training device.
pub struct DraftBatch {
    /// `[B, T]` u32: each sequence's window from position 0, right-padded.
    pub tokens: Tensor,
    /// Rows of the flattened `[B·T]` hidden states that carry loss.
    pub loss_rows: Tensor,
    /// `[N, H]` f32: the target's final-normed hidden states at those positions.
    pub targets: Tensor,
    pub n_rows: usize,
}

/// The window of sequence `s` (its first `len` tokens) and its loss positions
/// `first..end`: positions whose next token belongs to the answer.
fn window(data: &FeatureDataset, s: usize, max_len: usize) -> Option<(usize, usize, usize)> {
    let n = data.seq_len(s);
    if n < 2 {
        return None;
    }
    let len = n.min(max_len);
    let first = data.prompt_lens[s].max(1) - 1;
    let end = (n - 1).min(len);
    (first < end).then_some((len, first, end))
}

/// Builds the batch of sequences `seqs`; `None` when none of them has a loss position.
pub fn make_draft_batch(
    data: &FeatureDataset,
    seqs: &[usize],
    max_len: usize,
    device: &Device,
) -> Result<Option<DraftBatch>> {
    let wins: Vec<(usize, (usize, usize, usize))> = seqs
        .iter()
        .filter_map(|&s| window(data, s, max_len).map(|w| (s, w)))
        .collect();
    if wins.is_empty() {
        return Ok(None);
    }
    let t = wins.iter().map(|(_, (len, _, _))| *len).max().unwrap_or(1);
    let b = wins.len();
    let mut tokens = vec![0u32; b * t];
    let mut loss_rows = Vec::new();
    let mut target_rows = Vec::new();
    for (row, &(s, (len, first, end))) in wins.iter().enumerate() {
        tokens[row * t..row * t + len].copy_from_slice(&data.seq_tokens(s)[..len]);
        let off = data.offsets[s];
        for i in first..end {
            loss_rows.push((row * t + i) as u32);
            target_rows.push((off + i) as u32);
        }
    }
    let n_rows = loss_rows.len();
    // The final feature only: a cache made for a multi-layer EAGLE head carries more.
    let targets = data
        .features
        .index_select(&Tensor::from_vec(target_rows, n_rows, &Device::Cpu)?, 0)?
        .narrow(1, 0, data.hidden_size)?
        .contiguous()?;
    Ok(Some(DraftBatch {
        tokens: Tensor::from_vec(tokens, (b, t), device)?,
        loss_rows: Tensor::from_vec(loss_rows, n_rows, device)?,
        targets: targets.to_device(device)?,
        n_rows,
    }))
}

/// Loss rows of `seqs` (answer positions inside the windows).
pub fn loss_rows(data: &FeatureDataset, seqs: &[usize], max_len: usize) -> usize {
    seqs.iter()
        .filter_map(|&s| window(data, s, max_len).map(|(_, f, e)| e - f))
        .sum()
}

/// Sums over the loss rows of one or more batches.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct KdSums {
    pub rows: usize,
    /// Σ over rows of KL(p_T ‖ q_T).
    pub kl: f64,
    /// Σ over rows of −log q(target's greedy token), at temperature 1.
    pub ce: f64,
    /// Rows where the student's greedy token is the target's.
    pub top1: usize,
}

impl KdSums {
    pub fn add(&mut self, o: &KdSums) {
        self.rows += o.rows;
        self.kl += o.kl;
        self.ce += o.ce;
        self.top1 += o.top1;
    }
    pub fn mean(&self, cfg: &DraftTrainConfig) -> KdMeans {
        let n = self.rows.max(1) as f64;
        let t2 = cfg.kd_temperature * cfg.kd_temperature;
        KdMeans {
            loss: (t2 * self.kl + cfg.ce_weight * self.ce) / n,
            kl: self.kl / n,
            ce: self.ce / n,
            top1: self.top1 as f64 / n,
            rows: self.rows,
        }
    }
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct KdMeans {
    pub loss: f64,
    pub kl: f64,
    pub ce: f64,
    /// Greedy next-token agreement with the target (teacher-forced).
    pub top1: f64,
    pub rows: usize,
}

/// Gradients of a step's loss: on the student's final hidden states of the loss rows and,
/// when the LM head trains, on its weight.
struct KdGrads {
    hidden: Tensor,
    lm_head: Option<Tensor>,
}

/// Losses of student hidden states `h` against the target's `targets` (both `[N, H]`,
/// detached) through the LM head `w: [V, H]`; with `grad_rows` (the step's loss rows), also
/// the gradients of the mean loss.
fn kd_losses(
    h: &Tensor,
    targets: &Tensor,
    w: &Tensor,
    cfg: &DraftTrainConfig,
    grad_rows: Option<usize>,
    lm_head_grad: bool,
) -> Result<(KdSums, Option<KdGrads>)> {
    let (n, _) = h.dims2()?;
    let vocab = w.dim(0)?;
    let temp = cfg.kd_temperature;
    let mut sums = KdSums {
        rows: n,
        ..Default::default()
    };
    let w_t = w.t()?;
    let ids = Tensor::arange(0u32, vocab as u32, h.device())?.unsqueeze(0)?;
    let mut g_h = Vec::new();
    let mut g_w: Option<Tensor> = None;
    let mut start = 0;
    while start < n {
        let len = cfg.recipe.logits_chunk.min(n - start);
        let hs = h.narrow(0, start, len)?;
        let zs = hs.matmul(&w_t)?;
        let zt = targets.narrow(0, start, len)?.matmul(&w_t)?;
        let log_q1 = candle_nn::ops::log_softmax(&zs, D::Minus1)?;
        let (log_qt, log_pt) = if temp == 1.0 {
            (log_q1.clone(), candle_nn::ops::log_softmax(&zt, D::Minus1)?)
        } else {
            (
                candle_nn::ops::log_softmax(&(&zs / temp)?, D::Minus1)?,
                candle_nn::ops::log_softmax(&(&zt / temp)?, D::Minus1)?,
            )
        };
        let pt = log_pt.exp()?;
        sums.kl += (&pt * (&log_pt - &log_qt)?)?
            .sum_all()?
            .to_scalar::<f32>()? as f64;
        let greedy = zt.argmax(D::Minus1)?;
        sums.top1 += zs
            .argmax(D::Minus1)?
            .eq(&greedy)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
        let greedy = greedy.unsqueeze(1)?;
        sums.ce -= log_q1.gather(&greedy, 1)?.sum_all()?.to_scalar::<f32>()? as f64;
        if let Some(rows) = grad_rows {
            let rows = rows.max(1) as f64;
            // d(T² · KL(p_T ‖ q_T)) / dz = T · (q_T − p_T).
            let mut dz = ((log_qt.exp()? - &pt)? * (temp / rows))?;
            if cfg.ce_weight > 0.0 {
                let onehot = greedy.broadcast_eq(&ids)?.to_dtype(DType::F32)?;
                dz = (dz + ((log_q1.exp()? - onehot)? * (cfg.ce_weight / rows))?)?;
            }
            g_h.push(dz.matmul(w)?);
            if lm_head_grad {
                let gw = dz.t()?.matmul(&hs)?;
                g_w = Some(match g_w {
                    Some(acc) => (acc + gw)?,
                    None => gw,
                });
            }
        }
        start += len;
    }
    let grads = match grad_rows {
        Some(_) => Some(KdGrads {
            hidden: Tensor::cat(&g_h, 0)?,
            lm_head: g_w,
        }),
        None => None,
    };
    Ok((sums, grads))
}

/// A draft being trained: its variables, the model built over them and the optimiser.
pub struct DraftTrainer {
    model_cfg: ModelConfig,
    varmap: VarMap,
    frozen: BTreeMap<String, Tensor>,
    model: Llama,
    /// The LM head weight `[V, H]` (the embedding when tied): a variable's tensor when it
    /// trains, else a constant.
    lm_head: Tensor,
    lm_head_trains: bool,
    opt: AdamW,
    device: Device,
    pub cfg: DraftTrainConfig,
    pub step: usize,
}

impl DraftTrainer {
    /// A trainer for a draft of config `model_cfg` starting from `initial` (every HF tensor
    /// of the config, see [`initial_student`]), on `device`.
    pub fn new(
        model_cfg: ModelConfig,
        initial: BTreeMap<String, Tensor>,
        cfg: DraftTrainConfig,
        device: &Device,
    ) -> Result<Self> {
        cfg.validate()?;
        model_cfg
            .validate()
            .map_err(|e| invalid(format!("draft config: {e}")))?;
        let head_name = if model_cfg.tie_word_embeddings {
            EMBED
        } else {
            LM_HEAD
        };
        let varmap = VarMap::new();
        let mut frozen = BTreeMap::new();
        {
            let mut vars = locked_vars(&varmap)?;
            for (name, shape) in expected_tensors(&model_cfg) {
                let t = initial
                    .get(&name)
                    .ok_or_else(|| invalid(format!("initial draft tensor '{name}' is missing")))?;
                if t.dims() != shape.as_slice() {
                    return Err(invalid(format!(
                        "initial draft tensor '{name}' has shape {:?}, expected {shape:?}",
                        t.dims()
                    )));
                }
                let t = t.to_dtype(DType::F32)?.to_device(device)?.contiguous()?;
                let embedding = name == EMBED || name == LM_HEAD;
                if embedding && !cfg.train_embeddings {
                    frozen.insert(name, t);
                } else {
                    vars.insert(name, Var::from_tensor(&t)?);
                }
            }
        }
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, device);
        let model = Llama::from_var_builder(&model_cfg, vb, &frozen)?;
        let lm_head = match frozen.get(head_name) {
            Some(t) => t.clone(),
            None => locked_vars(&varmap)?
                .get(head_name)
                .map(|v| v.as_tensor().clone())
                .ok_or_else(|| invalid(format!("'{head_name}' is neither frozen nor trained")))?,
        };
        let lm_head_trains = !frozen.contains_key(head_name);
        let opt = AdamW::new(
            varmap.all_vars(),
            ParamsAdamW {
                lr: cfg.recipe.lr,
                beta1: cfg.recipe.beta1,
                beta2: cfg.recipe.beta2,
                eps: 1e-8,
                weight_decay: cfg.recipe.weight_decay,
            },
        )?;
        Ok(DraftTrainer {
            model_cfg,
            varmap,
            frozen,
            model,
            lm_head,
            lm_head_trains,
            opt,
            device: device.clone(),
            cfg,
            step: 0,
        })
    }

    pub fn model_config(&self) -> &ModelConfig {
        &self.model_cfg
    }
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Trained parameters (the frozen embedding excluded).
    pub fn num_trainable(&self) -> usize {
        self.varmap
            .all_vars()
            .iter()
            .map(|v| v.as_tensor().elem_count())
            .sum()
    }

    /// Final hidden states of the batch's loss rows, `[N, H]` (tracked for backprop).
    fn predict(&self, batch: &DraftBatch) -> Result<Tensor> {
        let h = self.model.forward_train(&batch.tokens)?;
        let (b, t, d) = h.dims3()?;
        Ok(h.reshape((b * t, d))?.index_select(&batch.loss_rows, 0)?)
    }

    /// One optimiser step on `batch` at learning rate `lr`; returns the batch's losses
    /// (before the update) and the gradient norm (before clipping).
    pub fn train_step(&mut self, batch: &DraftBatch, lr: f64) -> Result<(KdSums, f64)> {
        let h = self.predict(batch)?;
        let (sums, grads) = kd_losses(
            &h.detach(),
            &batch.targets,
            &self.lm_head.detach(),
            &self.cfg,
            Some(batch.n_rows),
            self.lm_head_trains,
        )?;
        let g = grads.ok_or_else(|| invalid("no gradient computed"))?;
        let mut surrogate = (h * g.hidden)?.sum_all()?;
        if let Some(gw) = g.lm_head {
            surrogate = (surrogate + (&self.lm_head * gw)?.sum_all()?)?;
        }
        let mut grads = surrogate.backward()?;
        let vars = self.varmap.all_vars();
        let norm = clip_gradients(&vars, &mut grads, self.cfg.recipe.grad_clip, self.step)?;
        self.opt.set_learning_rate(lr);
        self.opt.step(&grads)?;
        self.step += 1;
        Ok((sums, norm))
    }

    /// Losses and greedy agreement over `seqs`, without updates.
    pub fn evaluate(&self, data: &FeatureDataset, seqs: &[usize]) -> Result<KdSums> {
        let mut total = KdSums::default();
        for group in seqs.chunks(self.cfg.recipe.batch_size) {
            let Some(batch) = make_draft_batch(data, group, self.cfg.max_len, &self.device)? else {
                continue;
            };
            let h = self.predict(&batch)?.detach();
            let w = self.lm_head.detach();
            let (sums, _) = kd_losses(&h, &batch.targets, &w, &self.cfg, None, false)?;
            total.add(&sums);
        }
        Ok(total)
    }

    /// Every tensor of the draft under its HF name (f32, CPU): a snapshot, since the
    /// optimiser updates the variables in place.
    pub fn tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        let vars = locked_vars(&self.varmap)?;
        for (name, v) in vars.iter() {
            let t = v.as_tensor().copy()?.detach().to_device(&Device::Cpu)?;
            out.insert(name.clone(), t);
        }
        for (name, t) in &self.frozen {
            out.insert(name.clone(), t.to_device(&Device::Cpu)?);
        }
        Ok(out)
    }

    /// Sets every trained variable to its tensor in `tensors` (a [`Self::tensors`] snapshot).
    fn restore(&mut self, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
        restore_vars(&self.varmap, tensors)
    }
}

/// The HF `config.json` of a draft: its config plus `torch_dtype`.
pub fn draft_config_json(cfg: &ModelConfig, dtype: DType) -> String {
    config_json_with_dtype(cfg, dtype)
}

/// Writes a draft as an HF model folder: `config.json`, `model.safetensors` (HF names, in
/// `dtype`; no `lm_head.weight` when tied), copies of `copy_files` (the engine's tokenizer
/// and chat template) and the `extra` text files, replacing `dir` atomically.
pub fn save_draft(
    dir: &Path,
    cfg: &ModelConfig,
    tensors: &BTreeMap<String, Tensor>,
    dtype: DType,
    copy_files: &[PathBuf],
    extra: &[(&str, String)],
) -> Result<()> {
    check_save_dtype(dtype)?;
    let map = expected_for_save(expected_tensors(cfg), tensors, "draft", |t| {
        Ok(t.to_device(&Device::Cpu)?.to_dtype(dtype)?.contiguous()?)
    })?;
    write_model_dir(
        dir,
        &map,
        ModelDirFiles {
            weights_file: DRAFT_WEIGHTS_FILE,
            config_file: DRAFT_CONFIG_FILE,
            config_json: draft_config_json(cfg, dtype),
            copy_files,
            extra,
        },
    )
}

/// Reads a draft folder written by [`save_draft`]: its config, f32 tensors (checked against
/// the config) and training log when present.
pub fn load_draft(
    dir: &Path,
) -> Result<(ModelConfig, BTreeMap<String, Tensor>, Option<DraftTrainLog>)> {
    let cfg = ModelConfig::from_json_file(&dir.join(DRAFT_CONFIG_FILE))?;
    let out = load_expected(&dir.join(DRAFT_WEIGHTS_FILE), expected_tensors(&cfg))?;
    let log_path = dir.join(TRAIN_LOG_FILE);
    let log = if log_path.is_file() {
        let text = std::fs::read_to_string(&log_path).map_err(|e| file_err(&log_path, e))?;
        Some(
            serde_json::from_str(&text).map_err(|source| TrainError::Json {
                path: log_path.display().to_string(),
                source,
            })?,
        )
    } else {
        None
    };
    Ok((cfg, out, log))
}

/// Checks that `data`'s features are what `model` (the target) computes, on the data's
/// shortest sequence: a feature cache made by another model would train the draft towards
/// that model's distributions. Returns the largest difference relative to the largest
/// feature.
pub fn check_features(model: &Llama, data: &FeatureDataset) -> Result<f64> {
    let Some(s) = (0..data.len()).min_by_key(|&s| data.seq_len(s)) else {
        return Err(invalid("the feature cache holds no sequences"));
    };
    let fresh = FeatureDataset::extract(
        model,
        vec![(data.seq_tokens(s).to_vec(), data.prompt_lens[s])],
        &data.feature_layers,
        usize::MAX,
        &mut |_, _| {},
    )?;
    let cached = data.features.narrow(0, data.offsets[s], data.seq_len(s))?;
    let scale = fresh.features.abs()?.max_all()?.to_scalar::<f32>()? as f64;
    let diff = (&fresh.features - &cached)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()? as f64;
    Ok(diff / scale.max(1e-12))
}

/// One line of the training log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DraftEpochLog {
    /// 0 = before training.
    pub epoch: usize,
    /// Optimiser steps taken so far.
    pub steps: usize,
    pub lr: f64,
    /// Running means over the epoch's training batches.
    pub train: Option<KdMeans>,
    /// Held-out sequences.
    pub val: Option<KdMeans>,
    pub grad_norm: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct DraftTrainLog {
    /// The command line that produced the draft (to reproduce one too big to ship).
    pub command: Option<String>,
    pub config: DraftTrainConfig,
    pub init: String,
    pub num_layers: usize,
    pub trainable_parameters: usize,
    pub train_sequences: usize,
    pub val_sequences: usize,
    pub train_loss_rows: usize,
    pub epochs: Vec<DraftEpochLog>,
    /// Training-batch means every tenth of an epoch: (step, loss, top1).
    pub steps: Vec<(usize, f64, f64)>,
    /// With `keep_best`: the epoch whose weights were saved (0 = the starting draft).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_epoch: Option<usize>,
}

/// Where and how [`train_draft`] saves after every epoch.
pub struct DraftSaveOptions<'p> {
    pub output_dir: &'p Path,
    pub dtype: DType,
    /// Copied into the output folder (the engine's tokenizer.json, chat_template.jinja).
    pub copy_files: Vec<PathBuf>,
}

/// Trains up to `trainer.cfg.recipe.epochs` epochs over `train`, evaluating on `val` before
/// training and after every epoch, saving the draft (and `train_log.json`) after every
/// epoch. With `resume` (the log of the run whose weights the trainer starts from), the
/// finished epochs are skipped and the schedule continues at their step count; AdamW's
/// moments start again from zero (they are not saved: they would triple the checkpoint).
/// Each epoch's batch order depends only on the seed and the epoch, so a resumed run sees
/// the batches an uninterrupted run would have. `log` receives one line per event.
#[allow(clippy::too_many_arguments)]
pub fn train_draft(
    trainer: &mut DraftTrainer,
    data: &FeatureDataset,
    train: &[usize],
    val: &[usize],
    init_name: &str,
    command: Option<String>,
    resume: Option<DraftTrainLog>,
    save: Option<&DraftSaveOptions>,
    log: &mut dyn FnMut(&str),
) -> Result<DraftTrainLog> {
    let cfg = trainer.cfg.clone();
    if train.is_empty() {
        return Err(invalid("no training sequences"));
    }
    cfg.recipe.check_held_out(val)?;
    let t0 = Instant::now();
    // The epoch whose weights the trainer starts from: a resumed folder holds its kept epoch
    // (or its last, when it kept none).
    let start_epoch = resume.as_ref().map_or(0, |p| {
        p.kept_epoch
            .or(p.epochs.last().map(|e| e.epoch))
            .unwrap_or(0)
    });
    let mut v0 = None;
    let mut tlog = match resume {
        Some(mut prior) => {
            let done = prior.epochs.last().map_or(0, |e| e.epoch);
            trainer.step = prior.epochs.last().map_or(0, |e| e.steps);
            let from = if start_epoch == done {
                String::new()
            } else {
                format!(" from epoch {start_epoch}'s weights, the ones it kept")
            };
            log(&format!(
                "resuming after epoch {done} (step {}){from}: {} epochs to go",
                trainer.step,
                cfg.recipe.epochs.saturating_sub(done)
            ));
            prior.command = command.or(prior.command);
            prior.config = cfg.clone();
            prior
        }
        None => {
            v0 = val_means(trainer, data, val)?;
            log_initial(init_name, v0.as_ref(), log);
            DraftTrainLog {
                command,
                config: cfg.clone(),
                init: init_name.into(),
                num_layers: trainer.model_cfg.num_hidden_layers,
                trainable_parameters: trainer.num_trainable(),
                train_sequences: train.len(),
                val_sequences: val.len(),
                train_loss_rows: loss_rows(data, train, cfg.max_len),
                epochs: vec![DraftEpochLog {
                    epoch: 0,
                    steps: 0,
                    lr: 0.0,
                    train: None,
                    val: v0,
                    grad_norm: 0.0,
                    seconds: t0.elapsed().as_secs_f64(),
                }],
                steps: Vec::new(),
                kept_epoch: None,
            }
        }
    };
    // With keep_best the starting weights are the first best: a resumed draft scored as it
    // was saved (in its dtype), not as its log had it.
    let start = match v0 {
        Some(v) => Some(v),
        None if cfg.recipe.keep_best => val_means(trainer, data, val)?,
        None => None,
    };
    let best = match start {
        Some(v) if cfg.recipe.keep_best => Some(BestEpoch::start(
            AGREEMENT,
            start_epoch,
            v.top1,
            trainer.tensors()?,
        )),
        _ => None,
    };
    // The folder holds the weights `best` starts from, or from now on the last epoch's.
    tlog.kept_epoch = best.as_ref().map(|b| b.epoch);
    let first_epoch = tlog.epochs.last().map_or(0, |e| e.epoch) + 1;
    let schedule = Schedule {
        epochs: cfg.recipe.epochs,
        batch_size: cfg.recipe.batch_size,
        seed: cfg.recipe.seed,
        reseed_each_epoch: true,
    };
    let mut run = DraftRun {
        trainer,
        data,
        val,
        save,
        tlog,
        best,
    };
    run_epochs(&mut run, data, train, &schedule, first_epoch, t0, log)?;
    if let Some(best) = run.best {
        run.trainer.restore(&best.tensors)?;
        log(&best.kept());
    }
    Ok(run.tlog)
}

/// What `keep_best` ranks a draft's epochs by: greedy agreement with the target.
const AGREEMENT: &str = "held-out agreement";

/// The held-out means of `trainer` over `val`; `None` without held-out sequences.
fn val_means(
    trainer: &DraftTrainer,
    data: &FeatureDataset,
    val: &[usize],
) -> Result<Option<KdMeans>> {
    if val.is_empty() {
        return Ok(None);
    }
    Ok(Some(trainer.evaluate(data, val)?.mean(&trainer.cfg)))
}

impl EpochMeans for KdMeans {
    const TOP1: &'static str = "agreement";
    fn loss(&self) -> f64 {
        self.loss
    }
    fn top1(&self) -> f64 {
        self.top1
    }
    fn rows(&self) -> usize {
        self.rows
    }
    fn describe(&self) -> String {
        format!(
            "loss {:.4} (kl {:.4}, ce {:.3}) agreement {:.3}",
            self.loss, self.kl, self.ce, self.top1
        )
    }
}

/// [`train_draft`]'s state as the shared epoch loop drives it.
struct DraftRun<'r, 'p> {
    trainer: &'r mut DraftTrainer,
    data: &'r FeatureDataset,
    val: &'r [usize],
    save: Option<&'r DraftSaveOptions<'p>>,
    tlog: DraftTrainLog,
    best: Option<BestEpoch>,
}

impl EpochTrainer for DraftRun<'_, '_> {
    type Batch = DraftBatch;
    type Sums = KdSums;
    type Means = KdMeans;

    fn steps(&self) -> usize {
        self.trainer.step
    }
    fn lr_at(&self, step: usize, total: usize) -> f64 {
        self.trainer.cfg.recipe.lr_at(step, total)
    }
    fn make_batch(&self, seqs: &[usize], _rng: &mut ChaCha8Rng) -> Result<Option<DraftBatch>> {
        make_draft_batch(
            self.data,
            seqs,
            self.trainer.cfg.max_len,
            &self.trainer.device,
        )
    }
    fn train_step(&mut self, batch: &DraftBatch, lr: f64) -> Result<(KdSums, f64)> {
        self.trainer.train_step(batch, lr)
    }
    fn zero_sums(&self) -> KdSums {
        KdSums::default()
    }
    fn add(total: &mut KdSums, sums: &KdSums) {
        total.add(sums);
    }
    fn means(&self, sums: &KdSums) -> KdMeans {
        sums.mean(&self.trainer.cfg)
    }
    fn validate(&self) -> Result<Option<KdMeans>> {
        val_means(self.trainer, self.data, self.val)
    }
    fn step_log(&mut self) -> &mut Vec<(usize, f64, f64)> {
        &mut self.tlog.steps
    }
    fn stop_early(&self) -> Option<String> {
        self.best.as_ref()?.stop(self.trainer.cfg.recipe.early_stop)
    }
    fn end_epoch(&mut self, end: EpochEnd<KdMeans>) -> Result<Option<String>> {
        if let (Some(best), Some(val)) = (self.best.as_mut(), &end.val) {
            best.offer(end.epoch, val.top1, || self.trainer.tensors())?;
            self.tlog.kept_epoch = Some(best.epoch);
        }
        self.tlog.epochs.push(DraftEpochLog {
            epoch: end.epoch,
            steps: end.steps,
            lr: end.lr,
            train: Some(end.train),
            val: end.val,
            grad_norm: end.grad_norm,
            seconds: end.seconds,
        });
        let Some(save) = self.save else {
            return Ok(None);
        };
        let text = serde_json::to_string_pretty(&self.tlog).expect("log serialises");
        let last;
        let tensors = match &self.best {
            Some(best) => &best.tensors,
            None => {
                last = self.trainer.tensors()?;
                &last
            }
        };
        save_draft(
            save.output_dir,
            &self.trainer.model_cfg,
            tensors,
            save.dtype,
            &save.copy_files,
            &[(TRAIN_LOG_FILE, text)],
        )?;
        Ok(Some(match &self.best {
            Some(best) => best.saved(save.output_dir),
            None => save.output_dir.display().to_string(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mean loss written out with candle ops, so that autograd gives the reference
    /// gradients: the student's logits through `ws`, the target's through `wt` (a constant:
    /// the target side is never trained).
    fn explicit_loss(
        h: &Tensor,
        ws: &Tensor,
        t: &Tensor,
        wt: &Tensor,
        c: &DraftTrainConfig,
    ) -> Tensor {
        let n = h.dim(0).unwrap() as f64;
        let temp = c.kd_temperature;
        let zs = h.matmul(&ws.t().unwrap()).unwrap();
        let zt = t.matmul(&wt.t().unwrap()).unwrap();
        let log_q = candle_nn::ops::log_softmax(&(&zs / temp).unwrap(), D::Minus1).unwrap();
        let log_p = candle_nn::ops::log_softmax(&(&zt / temp).unwrap(), D::Minus1).unwrap();
        let kl = (log_p.exp().unwrap() * (&log_p - &log_q).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let greedy = zt.argmax(D::Minus1).unwrap().unsqueeze(1).unwrap();
        let ce = candle_nn::ops::log_softmax(&zs, D::Minus1)
            .unwrap()
            .gather(&greedy, 1)
            .unwrap()
            .sum_all()
            .unwrap()
            .neg()
            .unwrap();
        ((kl * (temp * temp / n)).unwrap() + (ce * (c.ce_weight / n)).unwrap()).unwrap()
    }

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let s = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() / s.to_scalar::<f32>().unwrap()
    }

    #[test]
    fn closed_form_gradients_match_autograd() {
        let dev = Device::Cpu;
        let (n, hdim, vocab) = (7, 6, 11);
        let h0 = Tensor::randn(0f32, 1.0, (n, hdim), &dev).unwrap();
        let t = Tensor::randn(0f32, 1.0, (n, hdim), &dev).unwrap();
        let w0 = Tensor::randn(0f32, 1.0, (vocab, hdim), &dev).unwrap();
        for (temp, ce_weight, chunk) in [(1.0, 0.0, 256), (2.0, 0.3, 3), (0.5, 1.0, 1)] {
            let defaults = DraftTrainConfig::default();
            let c = DraftTrainConfig {
                kd_temperature: temp,
                ce_weight,
                recipe: Recipe {
                    logits_chunk: chunk,
                    ..defaults.recipe.clone()
                },
                ..defaults
            };
            let what = format!("T {temp}, ce_weight {ce_weight}, chunk {chunk}");
            let (sums, grads) = kd_losses(&h0, &t, &w0, &c, Some(n), true).unwrap();
            let grads = grads.unwrap();
            let h = Var::from_tensor(&h0).unwrap();
            let ws = Var::from_tensor(&w0).unwrap();
            let loss = explicit_loss(h.as_tensor(), ws.as_tensor(), &t, &w0, &c);
            let want = loss.to_scalar::<f32>().unwrap() as f64;
            let got = sums.mean(&c).loss;
            assert!(
                (got - want).abs() < 1e-4 * want.max(1.0),
                "{what}: {got} vs {want}"
            );
            let g = loss.backward().unwrap();
            let gh = g.get(h.as_tensor()).unwrap();
            let gw = g.get(ws.as_tensor()).unwrap();
            assert!(max_rel(&grads.hidden, gh) < 1e-4, "{what}: hidden");
            assert!(
                max_rel(grads.lm_head.as_ref().unwrap(), gw) < 1e-4,
                "{what}: lm_head"
            );
        }
    }
}

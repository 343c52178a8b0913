//! EAGLE-1 head training by self-distillation.
//!
//! Pairs (EAGLE's layout): head position `i` of a sequence takes token `t[i+1]` and the base
//! feature `f[i]` (plus uniform noise) and predicts `f[i+1]`; the loss covers the positions
//! whose target feature belongs to the answer (`i + 1 >= prompt_len`), so the head learns what
//! it drafts at inference. Loss = `feature_weight` · SmoothL1(pred, target) (mean over
//! elements) + `ce_weight` · CE(softmax(lm_head(target)), log_softmax(lm_head(pred))) with the
//! frozen base LM head. EAGLE-1/2 weight them 1 and 0.1 (the default); EAGLE-3 drops the
//! feature term (`feature_weight = 0`), so the head's output only has to give the base's
//! next-token distribution and deeper draft levels read it as a free-form state.
//!
//! Gradients of both terms with respect to the predicted features are closed-form
//! (`feature_weight · clamp(pred - target, -1, 1) / (N·H)` and
//! `ce_weight · (softmax(lm_head(pred)) - p) · W / N`),
//! so the vocabulary-sized logits stay out of candle's autograd graph: they are computed in
//! row chunks and dropped, and only `Σ pred · g` is back-propagated through the head.
//!
//! **Training-time test** (`ttt_steps = K > 1`; HASS, arXiv 2408.15766, and EAGLE-3's
//! unrolled training). At inference a depth-d draft node is fed its parent's *predicted*
//! feature, and it attends to K/V computed from real features only for the committed
//! context; pass 1 alone never trains that. So the head runs K passes per batch
//! ([`EagleHead::forward_train_step`]); pass `k` stands for the depth-`(k-1)` node at head
//! position `i`, i.e. the chain drafted from the root pair at `i - k + 1` (the layout of
//! `calibrate.rs`):
//! - its input at `i` is (`t[i+1]`, pass `k-1`'s prediction at `i - 1`), the prediction
//!   detached (HASS detaches it too; it keeps every pass's gradient closed-form and the
//!   graph one pass deep in the features);
//! - query `i` attends to pass-1 K/V of positions `<= i - k + 1` (shifted causal mask) and
//!   to pass `m`'s K/V at `i - (k - m)` for `m = 2..=k`, one key per pass. Those keys are
//!   diagonals, scored row by row, so a pass costs one `T × T` attention plus `O(T)`;
//!   gradients do flow into the pass-1 K/V the deeper passes attend to;
//! - its target is `f[i+1]`, like pass 1, with the same SmoothL1 + CE loss, on the loss rows
//!   whose root is in the answer (`i >= first loss position + k - 1`: the whole drafted chain
//!   is answer tokens, as in calibration); the loss is `Σ_k ttt_decay^(k-1) · loss_k`, each
//!   a mean over its own rows (HASS weights every pass 1).
//!
//! The unit test `unrolled_passes_are_the_inference_draft_chain` checks pass k against the
//! inference head drafting along the true tokens with its paged cache. `ttt_steps = 1` runs
//! exactly the former single pass. Cost on CPU: K passes cost about K times one.
//! The held-out evaluation measures passes `1..=max(eval_steps, ttt_steps)`: pass k's top-1
//! is the head's top-1 at draft depth k along the true continuation.

use crate::common::{
    check_save_dtype, clip_gradients, config_json_with_dtype, expected_for_save, load_expected,
    locked_vars, restore_vars, write_model_dir, ModelDirFiles, RankFiles, Recipe,
};
use crate::dataset::FeatureDataset;
use crate::error::{invalid, Result};
use crate::train_loop::{
    log_initial, run_epochs, BestEpoch, EpochEnd, EpochMeans, EpochTrainer, Schedule,
};
use candle_core::{DType, Device, Tensor, Var, D};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use kestrel_core::{EagleHeadConfig, Mapping, ModelConfig};
use kestrel_model::{EagleHead, Llama, TrainUnroll};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

/// Files of a published EAGLE head directory.
pub const HEAD_CONFIG_FILE: &str = "config.json";
pub const HEAD_WEIGHTS_FILE: &str = "model.safetensors";
pub use crate::common::{epoch_batches, split, TRAIN_LOG_FILE};

/// The frozen base model as the trainer needs it: the decoder (for the embedding), the LM
/// head weight and its top decoder layers' weights (for the head's initialisation).
pub struct FrozenBase<'a> {
    pub model: &'a Llama,
    /// `[vocab, hidden]` f32.
    pub lm_head: Tensor,
    /// The base's last decoder layers, in order (the last one last), each under its tensors'
    /// names within a layer (`self_attn.q_proj.weight`, …, `input_layernorm.weight`), f32:
    /// what head layer `i` of an `n`-layer copied head starts as is `top_layers[len - n + i]`.
    pub top_layers: Vec<BTreeMap<String, Tensor>>,
}

const LAYER_TENSORS: &[&str] = &[
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_attention_layernorm.weight",
    "input_layernorm.weight",
];

impl<'a> FrozenBase<'a> {
    /// From HF-named full tensors (e.g. `kestrel_model::llama::random_tensors`), keeping the
    /// base's last `top_layers` decoder layers (the most layers a head will copy).
    pub fn from_tensors(
        model: &'a Llama,
        tensors: &BTreeMap<String, Tensor>,
        top_layers: usize,
    ) -> Result<Self> {
        let cfg = model.config();
        let get = |name: &str| {
            tensors
                .get(name)
                .ok_or_else(|| invalid(format!("base tensor '{name}' is missing")))
                .and_then(|t| Ok(t.to_dtype(DType::F32)?.to_device(model.device())?))
        };
        Self::assemble(model, cfg, top_layers, get)
    }

    /// From an engine's (or checkpoint's) per-rank safetensors files; `top_layers` as in
    /// [`FrozenBase::from_tensors`].
    pub fn from_rank_files(
        model: &'a Llama,
        mapping: Mapping,
        rank_files: &[PathBuf],
        top_layers: usize,
    ) -> Result<Self> {
        let cfg = model.config();
        let files = RankFiles::open(cfg, mapping, rank_files)?;
        Self::assemble(model, cfg, top_layers, |name| {
            Ok(files.get(name)?.to_device(model.device())?)
        })
    }

    fn assemble(
        model: &'a Llama,
        cfg: &ModelConfig,
        top_layers: usize,
        get: impl Fn(&str) -> Result<Tensor>,
    ) -> Result<Self> {
        let n = cfg.num_hidden_layers;
        if top_layers == 0 || top_layers > n {
            return Err(invalid(format!(
                "a head of {top_layers} layers cannot start from the base's top layers: the base has {n}"
            )));
        }
        let lm_head = if cfg.tie_word_embeddings {
            get("model.embed_tokens.weight")?
        } else {
            get("lm_head.weight")?
        };
        let top_layers = (n - top_layers..n)
            .map(|l| {
                LAYER_TENSORS
                    .iter()
                    .map(|t| Ok((t.to_string(), get(&format!("model.layers.{l}.{t}"))?)))
                    .collect::<Result<BTreeMap<_, _>>>()
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(FrozenBase {
            model,
            lm_head: lm_head.contiguous()?,
            top_layers,
        })
    }
}

/// The head's configuration for `base`: a Llama of `layers` layers (EAGLE's is one) of the
/// base's shapes, with `rope_theta` (and scaling) of the base written out explicitly.
pub fn head_config(base: &ModelConfig, bias: bool, layers: usize) -> EagleHeadConfig {
    let mut llama = base.clone();
    llama.architectures = vec!["LlamaForCausalLM".into()];
    llama.num_hidden_layers = layers;
    llama.tie_word_embeddings = false;
    llama.rope_parameters = None;
    EagleHeadConfig {
        llama,
        bias,
        feature_layers: Vec::new(),
    }
}

/// Where the head's first weights come from.
#[derive(Debug, Clone)]
pub enum HeadInit {
    /// The base's last decoder layers, one per head layer ([`FrozenBase::top_layers`]);
    /// `fc = [0 | I]` (feature passthrough), zero bias. `out_scale` multiplies the layers'
    /// residual-branch outputs (`o_proj`, `down_proj`): a base layer writes into a residual
    /// stream far larger than the normed feature the head starts from, so 1.0 makes the first
    /// predictions overshoot; 0.0 starts the head as the identity (`pred = feature`).
    CopyTopLayers { out_scale: f64 },
    /// Random (PyTorch-like uniform linear init, unit norms).
    Random { seed: u64 },
    /// Given tensors under the head's names (resuming from a checkpoint).
    Tensors(BTreeMap<String, Tensor>),
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainConfig {
    #[serde(flatten)]
    pub recipe: Recipe,
    /// Longest window trained on; longer sequences keep their last `max_len` positions.
    pub max_len: usize,
    /// Amplitude `a` of the uniform `U(-a, a)` noise added to the input features.
    pub noise: f32,
    /// Weight of the distribution (CE) term.
    pub ce_weight: f64,
    /// Weight of the feature-regression (SmoothL1) term; 0 is EAGLE-3's token-only loss.
    #[serde(default = "one_f64")]
    pub feature_weight: f64,
    /// Passes of the training-time-test unroll (module docs): 1 trains on real features
    /// only, `K` also trains draft depths `2..=K` on the head's own predictions.
    #[serde(default = "one")]
    pub ttt_steps: usize,
    /// Pass `k`'s loss is weighted `ttt_decay^(k - 1)` (HASS: 1, EAGLE-3: 0.8).
    #[serde(default = "one_f64")]
    pub ttt_decay: f64,
    /// Passes measured on the held-out set (at least `ttt_steps`): its top-1 at pass `k` is
    /// the head's top-1 at draft depth `k` along the true continuation.
    #[serde(default = "one")]
    pub eval_steps: usize,
}

fn one() -> usize {
    1
}

fn one_f64() -> f64 {
    1.0
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            recipe: Recipe::new(5e-4, 20, 0.5),
            max_len: 512,
            noise: 0.1,
            ce_weight: LossWeights::EAGLE1.ce,
            feature_weight: LossWeights::EAGLE1.feature,
            ttt_steps: 1,
            ttt_decay: 1.0,
            eval_steps: 3,
        }
    }
}

impl TrainConfig {
    pub fn validate(&self) -> Result<()> {
        self.recipe.validate(self.max_len)?;
        if !(self.noise >= 0.0 && self.noise.is_finite()) {
            return Err(invalid("--noise must be non-negative"));
        }
        if self.ttt_steps == 0 {
            return Err(invalid("--ttt_steps must be at least 1 (1 = no unrolling)"));
        }
        let w = self.loss_weights();
        if !(w.feature >= 0.0 && w.feature.is_finite() && w.ce >= 0.0 && w.ce.is_finite()) {
            return Err(invalid(
                "--feature_weight and --ce_weight must be non-negative",
            ));
        }
        if w.feature == 0.0 && w.ce == 0.0 {
            return Err(invalid(
                "--feature_weight and --ce_weight are both 0: the head would learn nothing",
            ));
        }
        if !(self.ttt_decay >= 0.0 && self.ttt_decay.is_finite()) {
            return Err(invalid("--ttt_decay must be non-negative"));
        }
        Ok(())
    }

    /// The weights of the loss's two terms.
    pub fn loss_weights(&self) -> LossWeights {
        LossWeights {
            feature: self.feature_weight,
            ce: self.ce_weight,
        }
    }

    /// Passes of the held-out evaluation.
    pub fn eval_passes(&self) -> usize {
        self.eval_steps.max(self.ttt_steps)
    }
}

/// One training or evaluation batch.
pub struct Batch {
    /// `[B, T]` u32: `t[i+1]`.
    pub tokens: Tensor,
    /// `[B, T, W]` f32: `f[i]` (+ noise), the dataset's `W = feature_width()` columns (the
    /// final feature, then any tapped layer states).
    pub features: Tensor,
    /// Rows of the flattened `[B·T]` predictions that carry loss.
    pub loss_rows: Tensor,
    /// `[N, H]`: the final feature `f[i+1]` of those rows.
    pub targets: Tensor,
    pub n_rows: usize,
    /// Per loss row, its distance from its sequence's first loss position (host): pass `k`
    /// of the unroll trains on the rows where this is at least `k - 1`.
    pub chain_room: Vec<u32>,
}

impl Batch {
    /// The batch on `device` (batches are assembled on the host, next to the feature cache).
    pub fn to_device(&self, device: &Device) -> Result<Batch> {
        Ok(Batch {
            tokens: self.tokens.to_device(device)?,
            features: self.features.to_device(device)?,
            loss_rows: self.loss_rows.to_device(device)?,
            targets: self.targets.to_device(device)?,
            n_rows: self.n_rows,
            chain_room: self.chain_room.clone(),
        })
    }

    /// The loss rows of pass `k` (1-based) as (rows of the flattened `[B·T]` predictions,
    /// their targets), `None` when there are none; pass 1 keeps them all.
    fn pass_rows(&self, k: usize) -> Result<Option<(Tensor, Tensor)>> {
        if k == 1 {
            return Ok(Some((self.loss_rows.clone(), self.targets.clone())));
        }
        let keep: Vec<u32> = (0..self.n_rows as u32)
            .filter(|&r| self.chain_room[r as usize] as usize + 1 >= k)
            .collect();
        if keep.is_empty() {
            return Ok(None);
        }
        let keep = Tensor::from_vec(keep.clone(), keep.len(), self.targets.device())?;
        Ok(Some((
            self.loss_rows.index_select(&keep, 0)?,
            self.targets.index_select(&keep, 0)?,
        )))
    }
}

/// The window of head positions of sequence `s` trained on, and the first loss position.
fn window(data: &FeatureDataset, s: usize, max_len: usize) -> Option<(usize, usize, usize)> {
    let n = data.seq_len(s).checked_sub(1)?; // head positions 0..n
    let first_loss = data.prompt_lens[s].max(1) - 1;
    if n == 0 || first_loss >= n {
        return None;
    }
    let start = n.saturating_sub(max_len);
    Some((start, n, first_loss.max(start)))
}

/// Builds the batch of sequences `seqs`; `None` when none of them has a loss position.
pub fn make_batch(
    data: &FeatureDataset,
    seqs: &[usize],
    max_len: usize,
    noise: f32,
    rng: &mut ChaCha8Rng,
) -> Result<Option<Batch>> {
    let wins: Vec<(usize, (usize, usize, usize))> = seqs
        .iter()
        .filter_map(|&s| window(data, s, max_len).map(|w| (s, w)))
        .collect();
    if wins.is_empty() {
        return Ok(None);
    }
    let h = data.hidden_size;
    let w = data.feature_width();
    let t = wins.iter().map(|(_, (a, b, _))| b - a).max().unwrap_or(1);
    let b = wins.len();
    let mut tokens = vec![0u32; b * t];
    let mut feats = Vec::with_capacity(b);
    let mut loss_rows = Vec::new();
    let mut target_rows = Vec::new();
    let mut chain_room = Vec::new();
    for (row, &(s, (start, end, first_loss))) in wins.iter().enumerate() {
        let off = data.offsets[s];
        let toks = data.seq_tokens(s);
        let len = end - start;
        tokens[row * t..row * t + len].copy_from_slice(&toks[start + 1..end + 1]);
        let f = data.features.narrow(0, off + start, len)?;
        let f = if len < t {
            Tensor::cat(
                &[&f, &Tensor::zeros((t - len, w), DType::F32, &Device::Cpu)?],
                0,
            )?
        } else {
            f
        };
        feats.push(f);
        for i in first_loss..end {
            loss_rows.push((row * t + i - start) as u32);
            target_rows.push((off + i + 1) as u32);
            chain_room.push((i - first_loss) as u32);
        }
    }
    let mut features = Tensor::stack(&feats, 0)?;
    if noise > 0.0 {
        let data_noise: Vec<f32> = (0..b * t * w)
            .map(|_| rng.random_range(-noise..noise))
            .collect();
        features = (features + Tensor::from_vec(data_noise, (b, t, w), &Device::Cpu)?)?;
    }
    let n_rows = loss_rows.len();
    let targets = data
        .features
        .index_select(&Tensor::from_vec(target_rows, n_rows, &Device::Cpu)?, 0)?
        .narrow(1, 0, h)?
        .contiguous()?;
    Ok(Some(Batch {
        tokens: Tensor::from_vec(tokens, (b, t), &Device::Cpu)?,
        features,
        loss_rows: Tensor::from_vec(loss_rows, n_rows, &Device::Cpu)?,
        targets,
        n_rows,
        chain_room,
    }))
}

/// Sums over the loss rows of one or more batches.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LossSums {
    pub rows: usize,
    /// Σ over rows of the row's mean SmoothL1.
    pub smooth_l1: f64,
    /// Σ over rows of the cross-entropy.
    pub ce: f64,
    /// Rows where argmax(lm_head(pred)) == argmax(lm_head(target)).
    pub top1: usize,
}

impl LossSums {
    pub fn add(&mut self, o: &LossSums) {
        self.rows += o.rows;
        self.smooth_l1 += o.smooth_l1;
        self.ce += o.ce;
        self.top1 += o.top1;
    }
    pub fn mean(&self, w: LossWeights) -> LossMeans {
        let n = self.rows.max(1) as f64;
        LossMeans {
            loss: (w.feature * self.smooth_l1 + w.ce * self.ce) / n,
            smooth_l1: self.smooth_l1 / n,
            ce: self.ce / n,
            top1: self.top1 as f64 / n,
            rows: self.rows,
        }
    }
}

/// Weights of the loss's feature (SmoothL1) and distribution (CE) terms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossWeights {
    pub feature: f64,
    pub ce: f64,
}

impl LossWeights {
    /// EAGLE-1's weights, [`TrainConfig`]'s default.
    pub const EAGLE1: LossWeights = LossWeights {
        feature: 1.0,
        ce: 0.1,
    };
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct LossMeans {
    pub loss: f64,
    pub smooth_l1: f64,
    pub ce: f64,
    /// Top-1 acceptance proxy.
    pub top1: f64,
    pub rows: usize,
}

/// Losses of predicted features against targets, with (when `grad_scale` is given) the
/// gradient of `w.feature · smooth_l1_mean + w.ce · ce_mean` with respect to `pred` for a step of
/// `grad_scale` loss rows.
fn losses(
    pred: &Tensor,
    target: &Tensor,
    lm_head: &Tensor,
    w: LossWeights,
    chunk: usize,
    grad_rows: Option<usize>,
) -> Result<(LossSums, Option<Tensor>)> {
    let (n, h) = pred.dims2()?;
    let diff = (pred - target)?;
    let a = diff.abs()?;
    let m = a.clamp(0f64, 1f64)?;
    let sl1 = ((m.sqr()? * 0.5)? + (&a - &m)?)?;
    let smooth_l1 = sl1.sum_all()?.to_scalar::<f32>()? as f64 / h as f64;
    let mut sums = LossSums {
        rows: n,
        smooth_l1,
        ..Default::default()
    };
    let mut grads = Vec::new();
    let w_t = lm_head.t()?;
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let p_rows = pred.narrow(0, start, len)?;
        let t_rows = target.narrow(0, start, len)?;
        let lp = p_rows.matmul(&w_t)?;
        let lt = t_rows.matmul(&w_t)?;
        let p = candle_nn::ops::softmax_last_dim(&lt)?;
        let logq = candle_nn::ops::log_softmax(&lp, D::Minus1)?;
        sums.ce -= (&p * &logq)?.sum_all()?.to_scalar::<f32>()? as f64;
        sums.top1 += lp
            .argmax(D::Minus1)?
            .eq(&lt.argmax(D::Minus1)?)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
        if let Some(rows) = grad_rows {
            let g = ((logq.exp()? - &p)? * (w.ce / rows.max(1) as f64))?;
            grads.push(g.matmul(lm_head)?);
        }
        start += len;
    }
    let grad = match grad_rows {
        Some(rows) => {
            let g_ce = Tensor::cat(&grads, 0)?;
            let g_v = (diff.clamp(-1f64, 1f64)? * (w.feature / (rows.max(1) * h) as f64))?;
            Some((g_v + g_ce)?)
        }
        None => None,
    };
    Ok((sums, grad))
}

/// The features pass `k + 1` of the unroll is fed from pass `k`'s predictions `[B, T, H]`:
/// position `i` gets the prediction at `i - 1` (position 0, which has no parent, zeros).
fn parent_outputs(pred: &Tensor) -> Result<Tensor> {
    let (b, t, h) = pred.dims3()?;
    let zeros = Tensor::zeros((b, 1, h), pred.dtype(), pred.device())?;
    if t == 1 {
        return Ok(zeros);
    }
    Ok(Tensor::cat(&[&zeros, &pred.narrow(1, 0, t - 1)?], 1)?)
}

/// Seeded random head weights: linear weights and biases uniform in `±1/sqrt(fan_in)`
/// (PyTorch's default), norm weights 1.
fn random_head(expected: &[(String, Vec<usize>)], seed: u64) -> Result<BTreeMap<String, Tensor>> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut out = BTreeMap::new();
    let fc_in = expected
        .iter()
        .find(|(n, _)| n == "fc.weight")
        .map(|(_, s)| s[1])
        .unwrap_or(1);
    for (name, shape) in expected {
        let n: usize = shape.iter().product();
        let t = if name.ends_with("layernorm.weight") {
            Tensor::ones(n, DType::F32, &Device::Cpu)?
        } else {
            let fan_in = if shape.len() == 2 { shape[1] } else { fc_in };
            let bound = 1.0 / (fan_in.max(1) as f32).sqrt();
            let v: Vec<f32> = (0..n).map(|_| rng.random_range(-bound..bound)).collect();
            Tensor::from_vec(v, n, &Device::Cpu)?
        };
        out.insert(name.clone(), t.reshape(shape.as_slice())?);
    }
    Ok(out)
}

/// `fuse = [I | 0 …]`: the fused feature is the base's final feature, the tapped layers
/// weighted zero until training finds a use for them.
fn final_feature_fuse(head_cfg: &EagleHeadConfig) -> Result<Tensor> {
    let h = head_cfg.llama.hidden_size;
    let eye = Tensor::eye(h, DType::F32, &Device::Cpu)?;
    let rest = Tensor::zeros((h, head_cfg.feature_width() - h), DType::F32, &Device::Cpu)?;
    Ok(Tensor::cat(&[&eye, &rest], 1)?)
}

/// Head layer `l` of `head_cfg` as a copy of the base layer it starts from
/// ([`FrozenBase::top_layers`]), its residual-branch outputs scaled by `out_scale`, under the
/// head's names (`layers.{l}.…`).
fn copied_layer(
    base: &FrozenBase,
    head_cfg: &EagleHeadConfig,
    l: usize,
    out_scale: f64,
) -> Result<Vec<(String, Tensor)>> {
    let n = head_cfg.llama.num_hidden_layers;
    let have = base.top_layers.len();
    let source = (have + l).checked_sub(n).ok_or_else(|| {
        invalid(format!(
            "a {n}-layer head starts from the base's top {n} layers, but only {have} were loaded"
        ))
    })?;
    base.top_layers[source]
        .iter()
        .map(|(name, t)| {
            let t = if name.ends_with("o_proj.weight") || name.ends_with("down_proj.weight") {
                (t * out_scale)?
            } else {
                t.clone()
            };
            Ok((format!("layers.{l}.{name}"), t))
        })
        .collect()
}

/// Grows a head's weights `tensors` (of `head_cfg`'s shapes, but with only `from` layers) to
/// `head_cfg`'s `num_hidden_layers`: each new layer is the base layer a copied head of that
/// depth would start from, with `o_proj` and `down_proj` zero, so the grown head computes
/// exactly what it did and training starts where the shallower head stopped.
pub fn deepen_head(
    tensors: &mut BTreeMap<String, Tensor>,
    from: usize,
    head_cfg: &EagleHeadConfig,
    base: &FrozenBase,
) -> Result<()> {
    let to = head_cfg.llama.num_hidden_layers;
    if from == 0 || from > to {
        return Err(invalid(format!(
            "a head of {from} layers cannot grow to {to}"
        )));
    }
    for l in from..to {
        tensors.extend(copied_layer(base, head_cfg, l, 0.0)?);
    }
    Ok(())
}

/// A head being trained: its variables, the head built over them and the optimiser.
pub struct EagleTrainer<'b, 'a> {
    base: &'b FrozenBase<'a>,
    head_cfg: EagleHeadConfig,
    varmap: VarMap,
    head: EagleHead,
    opt: AdamW,
    pub cfg: TrainConfig,
    pub step: usize,
}

impl<'b, 'a> EagleTrainer<'b, 'a> {
    pub fn new(
        base: &'b FrozenBase<'a>,
        head_cfg: EagleHeadConfig,
        init: HeadInit,
        cfg: TrainConfig,
    ) -> Result<Self> {
        cfg.validate()?;
        head_cfg
            .check_compatible(base.model.config())
            .map_err(invalid)?;
        let varmap = VarMap::new();
        let device = base.model.device().clone();
        let expected = EagleHead::expected_tensors(&head_cfg);
        let mut initial: Option<BTreeMap<String, Tensor>> = match init {
            HeadInit::CopyTopLayers { out_scale } => {
                let h = head_cfg.llama.hidden_size;
                let mut m = BTreeMap::new();
                let eye = Tensor::eye(h, DType::F32, &Device::Cpu)?;
                let zeros = Tensor::zeros((h, h), DType::F32, &Device::Cpu)?;
                m.insert("fc.weight".to_string(), Tensor::cat(&[&zeros, &eye], 1)?);
                if head_cfg.bias {
                    m.insert(
                        "fc.bias".to_string(),
                        Tensor::zeros(h, DType::F32, &Device::Cpu)?,
                    );
                }
                for l in 0..head_cfg.llama.num_hidden_layers {
                    m.extend(copied_layer(base, &head_cfg, l, out_scale)?);
                }
                Some(m)
            }
            HeadInit::Random { seed } => Some(random_head(&expected, seed)?),
            HeadInit::Tensors(m) => Some(m),
        };
        if let Some(m) = initial.as_mut() {
            if !head_cfg.feature_layers.is_empty() && !m.contains_key("fuse.weight") {
                // A head without `fuse` (copied, or an EAGLE-1 head resumed) starts reading
                // the final feature alone, so it begins exactly where it was.
                m.insert("fuse.weight".to_string(), final_feature_fuse(&head_cfg)?);
            }
        }
        if let Some(initial) = initial {
            let mut data = locked_vars(&varmap)?;
            for (name, shape) in &expected {
                let t = initial
                    .get(name)
                    .ok_or_else(|| invalid(format!("initial head weights lack tensor '{name}'")))?;
                if t.dims() != shape.as_slice() {
                    return Err(invalid(format!(
                        "initial head tensor '{name}' has shape {:?}, expected {shape:?}",
                        t.dims()
                    )));
                }
                let t = t.to_dtype(DType::F32)?.to_device(&device)?.contiguous()?;
                data.insert(name.clone(), Var::from_tensor(&t)?);
            }
        }
        let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
        let head = EagleHead::from_var_builder(&head_cfg, vb, base.model)?;
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
        Ok(EagleTrainer {
            base,
            head_cfg,
            varmap,
            head,
            opt,
            cfg,
            step: 0,
        })
    }

    pub fn head_config(&self) -> &EagleHeadConfig {
        &self.head_cfg
    }

    /// Predicted features `[B, T, H]` of passes `1..=passes` of the unroll (tracked for
    /// backprop). A single pass is the plain training forward; from pass 2 on, position `i`
    /// is fed the previous pass's prediction at `i - 1` (its parent node's output), detached:
    /// the gradient stays closed-form per pass, and HASS detaches the fed-back features too.
    pub fn unrolled_predictions(&self, batch: &Batch, passes: usize) -> Result<Vec<Tensor>> {
        debug_assert!(batch.tokens.device().same_device(self.base.model.device()));
        let fed = self.head.fuse_features(&batch.features)?;
        if passes == 1 {
            return Ok(vec![self.head.forward_train(&batch.tokens, &fed)?]);
        }
        let mut unroll = TrainUnroll::default();
        let mut preds: Vec<Tensor> = Vec::with_capacity(passes);
        for _ in 0..passes {
            let features = match preds.last() {
                None => fed.clone(),
                Some(p) => parent_outputs(&p.detach())?,
            };
            preds.push(
                self.head
                    .forward_train_step(&batch.tokens, &features, &mut unroll)?,
            );
        }
        Ok(preds)
    }

    /// Per pass of the unroll that has loss rows: the predictions of those rows `[N_k, H]`
    /// (tracked) and their targets.
    fn predict(&self, batch: &Batch, passes: usize) -> Result<Vec<(Tensor, Tensor)>> {
        let mut out = Vec::with_capacity(passes);
        for (k, pred) in self.unrolled_predictions(batch, passes)?.iter().enumerate() {
            let Some((rows, targets)) = batch.pass_rows(k + 1)? else {
                break;
            };
            let (b, t, h) = pred.dims3()?;
            out.push((pred.reshape((b * t, h))?.index_select(&rows, 0)?, targets));
        }
        Ok(out)
    }

    /// Losses of every pass of `batch` (`[k - 1]` = pass k; passes without loss rows are
    /// left out).
    fn pass_losses(
        &self,
        preds: &[(Tensor, Tensor)],
        with_grad: bool,
    ) -> Result<Vec<(LossSums, Option<Tensor>)>> {
        preds
            .iter()
            .map(|(pred, target)| {
                losses(
                    &pred.detach(),
                    target,
                    &self.base.lm_head,
                    self.cfg.loss_weights(),
                    self.cfg.recipe.logits_chunk,
                    with_grad.then(|| pred.dim(0)).transpose()?,
                )
            })
            .collect()
    }

    /// One optimiser step on `batch` at learning rate `lr`; returns the batch's losses
    /// (before the update; pass 1 of the unroll) and the gradient norm (before clipping).
    pub fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<(LossSums, f64)> {
        let (sums, norm) = self.train_step_unrolled(batch, lr)?;
        Ok((sums[0], norm))
    }

    /// [`EagleTrainer::train_step`] with the losses of every pass (`[k - 1]` = pass k).
    /// The loss is `Σ_k ttt_decay^(k - 1) · loss_k`, each pass's loss the mean over its own
    /// rows.
    pub fn train_step_unrolled(&mut self, batch: &Batch, lr: f64) -> Result<(Vec<LossSums>, f64)> {
        let batch = &batch.to_device(self.base.model.device())?;
        let preds = self.predict(batch, self.cfg.ttt_steps)?;
        let mut all = Vec::with_capacity(preds.len());
        let mut surrogate: Option<Tensor> = None;
        for (k, ((pred, _), (sums, grad))) in preds
            .iter()
            .zip(self.pass_losses(&preds, true)?)
            .enumerate()
        {
            let grad = grad.ok_or_else(|| invalid("no gradient computed"))?;
            // Pass 1's weight is 1: its gradient is left untouched, bit for bit.
            let grad = match k {
                0 => grad,
                _ => (grad * self.cfg.ttt_decay.powi(k as i32))?,
            };
            let term = (pred * grad)?.sum_all()?;
            surrogate = Some(match surrogate {
                None => term,
                Some(s) => (s + term)?,
            });
            all.push(sums);
        }
        let surrogate = surrogate.ok_or_else(|| invalid("the batch has no loss rows"))?;
        let mut grads = surrogate.backward()?;
        let vars = self.varmap.all_vars();
        let norm = clip_gradients(&vars, &mut grads, self.cfg.recipe.grad_clip, self.step)?;
        self.opt.set_learning_rate(lr);
        self.opt.step(&grads)?;
        self.step += 1;
        Ok((all, norm))
    }

    /// Losses over `seqs` without noise or updates (pass 1: real features).
    pub fn evaluate(&self, data: &FeatureDataset, seqs: &[usize]) -> Result<LossSums> {
        Ok(self.evaluate_unrolled(data, seqs, 1)?[0])
    }

    /// Losses of passes `1..=passes` over `seqs` without noise or updates; pass k's top-1 is
    /// the head's top-1 at draft depth k along the true continuation.
    pub fn evaluate_unrolled(
        &self,
        data: &FeatureDataset,
        seqs: &[usize],
        passes: usize,
    ) -> Result<Vec<LossSums>> {
        let mut total = vec![LossSums::default(); passes];
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        for group in seqs.chunks(self.cfg.recipe.batch_size) {
            let Some(batch) = make_batch(data, group, self.cfg.max_len, 0.0, &mut rng)? else {
                continue;
            };
            let batch = batch.to_device(self.base.model.device())?;
            let preds = self.predict(&batch, passes)?;
            for (t, (sums, _)) in total.iter_mut().zip(self.pass_losses(&preds, false)?) {
                t.add(&sums);
            }
        }
        Ok(total)
    }

    /// The head's current weights under their checkpoint names (f32).
    pub fn tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let data = locked_vars(&self.varmap)?;
        Ok(data
            .iter()
            .map(|(k, v)| (k.clone(), v.as_tensor().detach()))
            .collect())
    }

    /// A copy of the head's weights that training does not change.
    fn snapshot(&self) -> Result<BTreeMap<String, Tensor>> {
        self.tensors()?
            .into_iter()
            .map(|(name, t)| Ok((name, t.copy()?)))
            .collect()
    }

    /// Sets every weight to `tensors`' (a [`Self::snapshot`] of this head).
    fn restore(&mut self, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
        restore_vars(&self.varmap, tensors)
    }

    /// Writes the head in the published EAGLE layout (`config.json` + `model.safetensors`
    /// in `dtype`, no `embed_tokens`), plus `extra` files, replacing `dir` atomically.
    pub fn save(&self, dir: &Path, dtype: DType, extra: &[(&str, String)]) -> Result<()> {
        save_head(&self.head_cfg, &self.tensors()?, dir, dtype, extra)
    }
}

/// The published `config.json` of a head: the head config plus `torch_dtype`.
pub fn head_config_json(head_cfg: &EagleHeadConfig, dtype: DType) -> String {
    config_json_with_dtype(head_cfg, dtype)
}

/// Writes `tensors` as an EAGLE head directory (see [`EagleTrainer::save`]).
pub fn save_head(
    head_cfg: &EagleHeadConfig,
    tensors: &BTreeMap<String, Tensor>,
    dir: &Path,
    dtype: DType,
    extra: &[(&str, String)],
) -> Result<()> {
    check_save_dtype(dtype)?;
    let expected = EagleHead::expected_tensors(head_cfg);
    let map = expected_for_save(expected, tensors, "head", |t| {
        Ok(t.to_dtype(dtype)?.to_device(&Device::Cpu)?.contiguous()?)
    })?;
    write_model_dir(
        dir,
        &map,
        ModelDirFiles {
            weights_file: HEAD_WEIGHTS_FILE,
            config_file: HEAD_CONFIG_FILE,
            config_json: head_config_json(head_cfg, dtype),
            copy_files: &[],
            extra,
        },
    )
}

/// Reads a head directory written by [`save_head`] (or any EAGLE-1 head in safetensors):
/// its config and f32 tensors, checked against the config.
pub fn load_head(dir: &Path) -> Result<(EagleHeadConfig, BTreeMap<String, Tensor>)> {
    let cfg = EagleHeadConfig::from_json_file(&dir.join(HEAD_CONFIG_FILE))?;
    let out = load_expected(
        &dir.join(HEAD_WEIGHTS_FILE),
        EagleHead::expected_tensors(&cfg),
    )?;
    Ok((cfg, out))
}

/// One line of the training log.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct EpochLog {
    /// 0 = before training.
    pub epoch: usize,
    pub steps: usize,
    pub lr: f64,
    /// Running means over the epoch's training batches (with feature noise).
    pub train: Option<LossMeans>,
    /// Held-out sequences, no noise.
    pub val: Option<LossMeans>,
    /// Training means of unroll passes 2..=ttt_steps (`[0]` = pass 2, draft depth 2).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub train_deeper: Vec<LossMeans>,
    /// Held-out means of passes 2..=eval_steps: the head's accuracy at draft depth 2, 3, …
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub val_deeper: Vec<LossMeans>,
    pub grad_norm: f64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainLog {
    pub config: TrainConfig,
    pub init: String,
    pub train_sequences: usize,
    pub val_sequences: usize,
    pub train_loss_rows: usize,
    pub epochs: Vec<EpochLog>,
    /// Training-batch losses every `step_log_every` steps: (step, loss, top1).
    pub steps: Vec<(usize, f64, f64)>,
    /// With `keep_best`: the epoch whose weights were saved (0 = the starting head).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_epoch: Option<usize>,
}

/// Where and how [`train`] saves.
pub struct SaveOptions<'p> {
    pub output_dir: &'p Path,
    pub dtype: DType,
    /// Also written into the output directory (e.g. a README).
    pub extra: Vec<(&'static str, String)>,
}

/// Trains for `trainer.cfg.recipe.epochs` epochs over `train`, evaluating on `val` before training
/// and after every epoch, saving the head (and `train_log.json`) after every epoch: the
/// last epoch's, or with `keep_best` the best so far, which the trainer also ends with.
/// `log` receives one human-readable line per event.
pub fn train(
    trainer: &mut EagleTrainer,
    data: &FeatureDataset,
    train: &[usize],
    val: &[usize],
    init_name: &str,
    save: Option<&SaveOptions>,
    log: &mut dyn FnMut(&str),
) -> Result<TrainLog> {
    let cfg = trainer.cfg.clone();
    if train.is_empty() {
        return Err(invalid("no training sequences"));
    }
    cfg.recipe.check_held_out(val)?;
    let train_rows: usize = train
        .iter()
        .filter_map(|&s| window(data, s, cfg.max_len).map(|(_, e, f)| e - f))
        .sum();
    let mut tlog = TrainLog {
        config: cfg.clone(),
        init: init_name.into(),
        train_sequences: train.len(),
        val_sequences: val.len(),
        train_loss_rows: train_rows,
        epochs: Vec::new(),
        steps: Vec::new(),
        kept_epoch: None,
    };
    let t0 = Instant::now();
    let v0 = val_means(trainer, data, val)?;
    log_initial(init_name, v0.as_ref(), log);
    let best = match &v0 {
        Some(v) if cfg.recipe.keep_best => Some(BestEpoch::start(
            CHAIN_SCORE,
            0,
            v.chain_score(),
            trainer.snapshot()?,
        )),
        _ => None,
    };
    let (v0, v0_deeper) = PassMeans::split(v0);
    tlog.epochs.push(EpochLog {
        epoch: 0,
        steps: 0,
        lr: 0.0,
        train: None,
        val: v0,
        train_deeper: Vec::new(),
        val_deeper: v0_deeper,
        grad_norm: 0.0,
        seconds: t0.elapsed().as_secs_f64(),
    });
    let schedule = Schedule {
        epochs: cfg.recipe.epochs,
        batch_size: cfg.recipe.batch_size,
        seed: cfg.recipe.seed,
        reseed_each_epoch: false,
    };
    let mut run = EagleRun {
        trainer,
        data,
        val,
        save,
        tlog,
        best,
    };
    run_epochs(&mut run, data, train, &schedule, 1, t0, log)?;
    if let Some(best) = run.best {
        run.trainer.restore(&best.tensors)?;
        log(&best.kept());
    }
    Ok(run.tlog)
}

/// What `keep_best` ranks a head's epochs by ([`PassMeans::chain_score`]).
const CHAIN_SCORE: &str = "held-out chain score";

/// Means of pass 1 and of the deeper passes of the unroll (`deeper[0]` = pass 2).
struct PassMeans {
    first: LossMeans,
    deeper: Vec<LossMeans>,
}

impl PassMeans {
    fn new(sums: &[LossSums], w: LossWeights) -> Self {
        let mut means = split_means(sums, w);
        let first = means.remove(0);
        PassMeans {
            first,
            deeper: means,
        }
    }

    /// Held-out means as the epoch log holds them: pass 1's, and the deeper passes'.
    fn split(means: Option<PassMeans>) -> (Option<LossMeans>, Vec<LossMeans>) {
        match means {
            Some(m) => (Some(m.first), m.deeper),
            None => (None, Vec::new()),
        }
    }

    /// The tokens a greedy chain of the evaluated depths would accept on average if each
    /// depth's top-1 held independently: `p1 + p1·p2 + p1·p2·p3 + …`, the held-out proxy of
    /// the mean accepted length (less the bonus token) that `keep_best` maximises.
    fn chain_score(&self) -> f64 {
        let mut reach = 1.0;
        std::iter::once(&self.first)
            .chain(&self.deeper)
            .map(|m| {
                reach *= m.top1;
                reach
            })
            .sum()
    }
}

impl EpochMeans for PassMeans {
    const TOP1: &'static str = "top-1";
    fn loss(&self) -> f64 {
        self.first.loss
    }
    fn top1(&self) -> f64 {
        self.first.top1
    }
    fn rows(&self) -> usize {
        self.first.rows
    }
    fn describe(&self) -> String {
        let m = &self.first;
        format!(
            "loss {:.4} (smooth_l1 {:.4}, ce {:.3}) top-1 {:.3}{}",
            m.loss,
            m.smooth_l1,
            m.ce,
            m.top1,
            deeper_top1(&self.deeper)
        )
    }
}

/// Held-out means of every evaluated pass; `None` without held-out sequences.
fn val_means(
    trainer: &EagleTrainer,
    data: &FeatureDataset,
    val: &[usize],
) -> Result<Option<PassMeans>> {
    if val.is_empty() {
        return Ok(None);
    }
    let cfg = &trainer.cfg;
    Ok(Some(PassMeans::new(
        &trainer.evaluate_unrolled(data, val, cfg.eval_passes())?,
        cfg.loss_weights(),
    )))
}

/// [`train`]'s state as the shared epoch loop drives it.
struct EagleRun<'r, 'b, 'a, 'p> {
    trainer: &'r mut EagleTrainer<'b, 'a>,
    data: &'r FeatureDataset,
    val: &'r [usize],
    save: Option<&'r SaveOptions<'p>>,
    tlog: TrainLog,
    best: Option<BestEpoch>,
}

impl EpochTrainer for EagleRun<'_, '_, '_, '_> {
    type Batch = Batch;
    /// Sums of every unroll pass (`[k - 1]` = pass k).
    type Sums = Vec<LossSums>;
    type Means = PassMeans;

    fn steps(&self) -> usize {
        self.trainer.step
    }
    fn lr_at(&self, step: usize, total: usize) -> f64 {
        self.trainer.cfg.recipe.lr_at(step, total)
    }
    fn make_batch(&self, seqs: &[usize], rng: &mut ChaCha8Rng) -> Result<Option<Batch>> {
        let cfg = &self.trainer.cfg;
        make_batch(self.data, seqs, cfg.max_len, cfg.noise, rng)
    }
    fn train_step(&mut self, batch: &Batch, lr: f64) -> Result<(Vec<LossSums>, f64)> {
        self.trainer.train_step_unrolled(batch, lr)
    }
    fn zero_sums(&self) -> Vec<LossSums> {
        vec![LossSums::default(); self.trainer.cfg.ttt_steps]
    }
    fn add(total: &mut Vec<LossSums>, sums: &Vec<LossSums>) {
        for (t, s) in total.iter_mut().zip(sums) {
            t.add(s);
        }
    }
    fn means(&self, sums: &Vec<LossSums>) -> PassMeans {
        PassMeans::new(sums, self.trainer.cfg.loss_weights())
    }
    fn validate(&self) -> Result<Option<PassMeans>> {
        val_means(self.trainer, self.data, self.val)
    }
    fn step_log(&mut self) -> &mut Vec<(usize, f64, f64)> {
        &mut self.tlog.steps
    }
    fn stop_early(&self) -> Option<String> {
        self.best.as_ref()?.stop(self.trainer.cfg.recipe.early_stop)
    }
    fn end_epoch(&mut self, end: EpochEnd<PassMeans>) -> Result<Option<String>> {
        if let (Some(best), Some(val)) = (self.best.as_mut(), &end.val) {
            best.offer(end.epoch, val.chain_score(), || self.trainer.snapshot())?;
            self.tlog.kept_epoch = Some(best.epoch);
        }
        let (val, val_deeper) = PassMeans::split(end.val);
        self.tlog.epochs.push(EpochLog {
            epoch: end.epoch,
            steps: end.steps,
            lr: end.lr,
            train: Some(end.train.first),
            val,
            train_deeper: end.train.deeper,
            val_deeper,
            grad_norm: end.grad_norm,
            seconds: end.seconds,
        });
        let Some(save) = self.save else {
            return Ok(None);
        };
        let mut extra: Vec<(&str, String)> =
            save.extra.iter().map(|(n, t)| (*n, t.clone())).collect();
        extra.push((
            TRAIN_LOG_FILE,
            serde_json::to_string_pretty(&self.tlog).expect("log serialises"),
        ));
        let dir = save.output_dir;
        Ok(Some(match &self.best {
            Some(best) => {
                save_head(
                    &self.trainer.head_cfg,
                    &best.tensors,
                    dir,
                    save.dtype,
                    &extra,
                )?;
                best.saved(dir)
            }
            None => {
                self.trainer.save(dir, save.dtype, &extra)?;
                dir.display().to_string()
            }
        }))
    }
}

fn split_means(sums: &[LossSums], w: LossWeights) -> Vec<LossMeans> {
    sums.iter().map(|s| s.mean(w)).collect()
}

/// `", depth 2/3/…: a/b/…"` for the top-1 of passes 2.., empty without them.
fn deeper_top1(deeper: &[LossMeans]) -> String {
    if deeper.is_empty() {
        return String::new();
    }
    let depths: Vec<String> = (2..deeper.len() + 2).map(|d| d.to_string()).collect();
    let top1: Vec<String> = deeper.iter().map(|m| format!("{:.3}", m.top1)).collect();
    format!(" (depth {}: {})", depths.join("/"), top1.join("/"))
}

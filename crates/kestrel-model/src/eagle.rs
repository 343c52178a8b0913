//! The EAGLE-1 draft head: `fc(cat(embed(token), feature))` → its decoder layers (the first
//! without an input norm, as in EAGLE's code; published heads have one, Kestrel's trainer may
//! stack more) → predicted feature (no final norm); logits through the base model's LM head.
//!
//! A head with `feature_layers` (EAGLE-3's multi-layer features) reads more of the base for
//! committed tokens: `fuse(cat(final feature, tapped layer states))` is the feature it is fed
//! there ([`EagleHead::fuse_features`]); draft nodes deeper in a tree are fed their parent's
//! prediction as before. Without `feature_layers` there is no `fuse` and the base's final
//! feature goes in unchanged.

use crate::cache::{PagedKvCache, SeqId};
use crate::candle_dtype;
use crate::cuda_kernels::CudaKernels;
use crate::error::{invalid, ModelError, Result};
use crate::layer::{
    causal_train_inputs, forward_train_layers, train_mask, AttnCtx, DecoderLayer, Linear,
};
use crate::llama::{
    check_cache, check_supported, decoder_layer_shapes, layer_dims, Llama, OutputRows,
};
use crate::rope::Rope;
use crate::step::{plan_step, Step, StepSeq};
use crate::step_graph::{GraphActivity, StepGraphs};
use crate::step_ids::StepIds;
use crate::weights::{MapSource, VarSource, WeightSource};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::VarBuilder;
use kestrel_core::EagleHeadConfig;
use kestrel_kernels::gather_rows;
use std::collections::BTreeMap;
use std::path::Path;

/// One sequence's part of a head step: tokens with the base features they are paired with.
#[derive(Debug, Clone)]
pub struct EagleSeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// `[tokens.len(), hidden]` base-model features.
    pub features: Tensor,
    pub positions: &'a [u32],
    /// `n×n` row-major, `true` = may attend; `None` = causal.
    pub mask: Option<&'a [bool]>,
    pub output_rows: OutputRows,
}

#[derive(Debug, Clone)]
pub struct EagleHead {
    cfg: EagleHeadConfig,
    /// `[hidden, feature_width]`, present with `feature_layers`.
    fuse: Option<Linear>,
    fc: Linear,
    /// `layers.0` (no input norm), `layers.1`, …: `num_hidden_layers` of them.
    layers: Vec<DecoderLayer>,
    embed: Tensor,
    own_embed: bool,
    rope: Rope,
    dtype: DType,
    device: Device,
    cpu_kernels: bool,
    cuda_kernels: CudaKernels,
    graphs: StepGraphs,
}

impl EagleHead {
    /// Names and shapes of the head's tensors (`embed_tokens.weight` is optional).
    pub fn expected_tensors(head_cfg: &EagleHeadConfig) -> Vec<(String, Vec<usize>)> {
        let c = &head_cfg.llama;
        let h = c.hidden_size;
        let mut out = vec![("fc.weight".to_string(), vec![h, 2 * h])];
        if !head_cfg.feature_layers.is_empty() {
            out.push(("fuse.weight".to_string(), vec![h, head_cfg.feature_width()]));
        }
        if head_cfg.bias {
            out.push(("fc.bias".to_string(), vec![h]));
        }
        for l in 0..c.num_hidden_layers {
            // EAGLE's layer 0 has no input norm.
            out.extend(decoder_layer_shapes(c, &format!("layers.{l}"), l > 0));
        }
        out
    }

    /// Loads a head from one safetensors file.
    pub fn load(
        head_cfg: &EagleHeadConfig,
        file: &Path,
        base: &Llama,
        dtype: kestrel_core::DType,
        device: &Device,
    ) -> Result<Self> {
        let tensors =
            candle_core::safetensors::load(file, &Device::Cpu).map_err(|e| ModelError::File {
                path: file.display().to_string(),
                message: e.to_string(),
            })?;
        let tensors: BTreeMap<String, Tensor> = tensors.into_iter().collect();
        let origin = file.display().to_string();
        let src = MapSource {
            map: &tensors,
            origin: &origin,
            dtype: candle_dtype(dtype),
            device,
        };
        Self::build(head_cfg, &src, base)
    }

    /// Builds a head from in-memory tensors named as in EAGLE checkpoints (`fc.weight`, …).
    pub fn from_tensors(
        head_cfg: &EagleHeadConfig,
        tensors: BTreeMap<String, Tensor>,
        base: &Llama,
        dtype: kestrel_core::DType,
        device: &Device,
    ) -> Result<Self> {
        let src = MapSource {
            map: &tensors,
            origin: "in-memory EAGLE head tensors",
            dtype: candle_dtype(dtype),
            device,
        };
        Self::build(head_cfg, &src, base)
    }

    /// A trainable head whose weights are the `VarBuilder`'s variables (created with the usual
    /// initialisation when the builder is backed by an empty `VarMap`). Projections are kept
    /// unfused so that optimiser updates of the `Var`s are seen by every forward.
    pub fn from_var_builder(
        head_cfg: &EagleHeadConfig,
        vb: VarBuilder,
        base: &Llama,
    ) -> Result<Self> {
        Self::build(head_cfg, &VarSource { vb: &vb }, base)
    }

    fn build(head_cfg: &EagleHeadConfig, src: &dyn WeightSource, base: &Llama) -> Result<Self> {
        let c = &head_cfg.llama;
        check_supported(c)?;
        head_cfg
            .check_compatible(base.config())
            .map_err(ModelError::Config)?;
        let h = c.hidden_size;
        let fc = Linear::load(src, "fc", h, 2 * h, head_cfg.bias)?;
        let fuse = (!head_cfg.feature_layers.is_empty())
            .then(|| Linear::load(src, "fuse", h, head_cfg.feature_width(), false))
            .transpose()?;
        let layers = (0..c.num_hidden_layers)
            .map(|l| DecoderLayer::load(src, &format!("layers.{l}"), layer_dims(c), l > 0))
            .collect::<Result<Vec<_>>>()?;
        let (embed, own_embed) = match src.get_opt("embed_tokens.weight", &[c.vocab_size, h])? {
            Some(e) => (e, true),
            None => (
                base.embedding()
                    .to_device(src.device())?
                    .to_dtype(src.dtype())?,
                false,
            ),
        };
        let mut head = EagleHead {
            cfg: head_cfg.clone(),
            fuse,
            fc,
            layers,
            embed,
            own_embed,
            rope: Rope::new(c.head_dim(), c.rope_theta, c.rope_scaling.as_ref()),
            dtype: src.dtype(),
            device: src.device().clone(),
            cpu_kernels: true,
            cuda_kernels: CudaKernels::default(),
            graphs: StepGraphs::default(),
        };
        // The projections take the default kernel choice too.
        head.set_cuda_kernels(head.cuda_kernels);
        Ok(head)
    }

    pub fn config(&self) -> &EagleHeadConfig {
        &self.cfg
    }
    /// Whether the head brought its own `embed_tokens` (else it uses the base's).
    pub fn has_own_embedding(&self) -> bool {
        self.own_embed
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// See [`Llama::set_cpu_kernels`].
    pub fn set_cpu_kernels(&mut self, enabled: bool) {
        self.cpu_kernels = enabled;
    }

    /// See [`Llama::set_cuda_kernels`].
    pub fn set_cuda_kernels(&mut self, kernels: CudaKernels) {
        self.cuda_kernels = kernels;
        self.layers
            .iter_mut()
            .flat_map(|layer| layer.linears_mut())
            .for_each(|l| l.gemv = kernels.gemv);
        self.fc.gemv = kernels.gemv;
        if let Some(f) = &mut self.fuse {
            f.gemv = kernels.gemv;
        }
    }

    /// The feature the head is fed for committed tokens, from the base's features
    /// `[.., feature_width]` (rows of [`Llama::forward_tapped`] over `feature_layers`):
    /// `fuse(base_features)` with `feature_layers`, else the base's final feature itself.
    /// Differentiable, so training calls it too.
    pub fn fuse_features(&self, base_features: &Tensor) -> Result<Tensor> {
        let width = self.cfg.feature_width();
        if base_features.dim(D::Minus1)? != width {
            return Err(invalid(format!(
                "base features have shape {:?}, expected {width} per token",
                base_features.dims()
            )));
        }
        match &self.fuse {
            None => Ok(base_features.clone()),
            Some(fuse) => {
                let x = base_features.to_dtype(self.dtype)?;
                match x.rank() {
                    2 => fuse.forward_with(&x, self.cpu_kernels),
                    _ => fuse.forward(&x),
                }
            }
        }
    }

    /// See [`Llama::set_cuda_graphs`].
    pub fn set_cuda_graphs(&mut self, enabled: bool) {
        self.graphs.set_enabled(enabled && self.device.is_cuda());
    }

    /// See [`Llama::cuda_graph_failure`].
    pub fn cuda_graph_failure(&self) -> Option<String> {
        self.graphs.failure()
    }

    /// See [`Llama::cuda_graph_count`].
    pub fn cuda_graph_count(&self) -> usize {
        self.graphs.count()
    }

    /// See [`Llama::cuda_graph_activity`].
    pub fn cuda_graph_activity(&self) -> GraphActivity {
        self.graphs.activity()
    }

    /// See [`Llama::cuda_graph_arena_bytes`].
    pub fn cuda_graph_arena_bytes(&self) -> usize {
        self.graphs.arena_bytes()
    }

    /// Decoder layers of the head (the layers of its KV cache).
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// A KV cache shaped for this head: one layer per decoder layer.
    pub fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<PagedKvCache> {
        let c = &self.cfg.llama;
        let mut cache = PagedKvCache::new(
            self.layers.len(),
            c.num_kv_heads(),
            c.head_dim(),
            num_blocks,
            block_size,
            self.dtype,
            &self.device,
        )?;
        cache.set_move_kernel(self.cuda_kernels.kv_append);
        Ok(cache)
    }

    /// Predicted features `[rows, hidden]` (not normed) of the requested rows of all
    /// sequences, concatenated; logits are `base.logits(&out)`.
    pub fn forward(
        &self,
        base: &Llama,
        batch: &[EagleSeqInput],
        cache: &mut PagedKvCache,
    ) -> Result<Tensor> {
        self.forward_with(base, batch, None, cache)
    }

    /// [`EagleHead::forward`] over token ids already on the head's device: `ids`, u32
    /// `[Σ n]`, the inputs' tokens in batch order (drafted nodes, which then never cross to the
    /// host between draft levels). The inputs carry no host tokens (`tokens` empty): their
    /// counts come from `positions`. The ids are not checked against the vocabulary, so they
    /// must come from the model's own rows.
    pub fn forward_device_ids(
        &self,
        base: &Llama,
        batch: &[EagleSeqInput],
        ids: &Tensor,
        cache: &mut PagedKvCache,
    ) -> Result<Tensor> {
        self.forward_with(base, batch, Some(ids), cache)
    }

    fn forward_with(
        &self,
        base: &Llama,
        batch: &[EagleSeqInput],
        device_ids: Option<&Tensor>,
        cache: &mut PagedKvCache,
    ) -> Result<Tensor> {
        if self.device.is_cpu() && self.cpu_kernels {
            let rows = batch.iter().map(|s| s.tokens.len()).sum();
            return crate::team::run(rows, || self.forward_impl(base, batch, device_ids, cache));
        }
        self.forward_impl(base, batch, device_ids, cache)
    }

    fn forward_impl(
        &self,
        base: &Llama,
        batch: &[EagleSeqInput],
        device_ids: Option<&Tensor>,
        cache: &mut PagedKvCache,
    ) -> Result<Tensor> {
        let c = &self.cfg.llama;
        check_cache(
            cache,
            self.layers.len(),
            c.num_kv_heads(),
            c.head_dim(),
            self.dtype,
            "EAGLE head",
        )?;
        if base.config().hidden_size != c.hidden_size {
            return Err(invalid("EAGLE head and base model differ in hidden_size"));
        }
        let inputs = batch.iter().map(|s| (s.seq, s.tokens, s.positions.len()));
        let step_ids = StepIds::of(inputs, device_ids)?;
        let mut feats = Vec::with_capacity(batch.len());
        for s in batch {
            let n = s.positions.len();
            if s.features.dims() != [n, c.hidden_size] {
                return Err(invalid(format!(
                    "sequence {:?}: features have shape {:?}, expected [{n}, {}]",
                    s.seq,
                    s.features.dims(),
                    c.hidden_size
                )));
            }
            feats.push(s.features.to_dtype(self.dtype)?);
        }
        let steps: Vec<StepSeq> = batch
            .iter()
            .map(|s| StepSeq {
                seq: s.seq,
                n: s.positions.len(),
                positions: s.positions,
                mask: s.mask,
                output_rows: &s.output_rows,
            })
            .collect();
        let portable = !(self.cpu_kernels && self.device.is_cpu());
        let cuda = self.device.is_cuda().then_some(&self.cuda_kernels);
        let mut plan = plan_step(&steps, cache, &self.device, portable, cuda, false)?;
        step_ids.check(c.vocab_size)?;
        let feats = if feats.len() == 1 {
            feats.pop().expect("one")
        } else {
            Tensor::cat(&feats, 0)?
        };
        let commit = std::mem::take(&mut plan.commit);
        let kv: &PagedKvCache = cache;
        let out = if plan.graphable() && self.graphs.active() {
            let inputs = plan.graph_inputs(step_ids.host(), &self.rope)?;
            let cache_id = kv.pools(0).0.id();
            let run = |ids: &Tensor, step: &Step, feats: Option<&Tensor>| {
                let feats = feats.ok_or_else(|| invalid("graphed head step without features"))?;
                self.run_layers(ids, feats, step, kv)
            };
            self.graphs.run(
                cache_id,
                &inputs,
                step_ids.device(),
                Some(&feats),
                self.dtype,
                &self.device,
                run,
            )?
        } else {
            let step = plan.upload(&self.rope, kv, self.dtype, &self.device)?;
            self.run_layers(&step_ids.on(&self.device)?, &feats, &step, kv)?
        };
        for (seq, len) in commit {
            cache.set_len(seq, len)?;
        }
        Ok(out)
    }

    /// The device work of a head step: `fc` over embeddings and features, the layers, the
    /// requested rows.
    fn run_layers(
        &self,
        ids: &Tensor,
        feats: &Tensor,
        step: &Step,
        kv: &PagedKvCache,
    ) -> Result<Tensor> {
        let emb = gather_rows(&self.embed, ids)?;
        let x = self
            .fc
            .forward_with(&Tensor::cat(&[&emb, feats], D::Minus1)?, self.cpu_kernels)?;
        let mut x = x;
        for (l, layer) in self.layers.iter().enumerate() {
            let ctx = AttnCtx::Paged {
                cos: &step.cos,
                sin: &step.sin,
                seqs: &step.seqs,
                batched: step.batched.as_ref(),
                kernel: step.kernel.as_ref(),
                cuda: self.device.is_cuda().then_some(&self.cuda_kernels),
                cache: kv,
                layer: l,
                cpu_kernels: self.cpu_kernels,
                matvec: true,
            };
            x = layer.forward(&x, &ctx)?;
        }
        if let Some(rows) = &step.out_rows {
            x = gather_rows(&x, rows)?;
        }
        Ok(x)
    }

    /// Training forward without a cache: `tokens: [B, T]` (u32), `features: [B, T, H]` →
    /// predicted features `[B, T, H]`, causal attention, positions `0..T`, built from
    /// differentiable candle ops.
    pub fn forward_train(&self, tokens: &Tensor, features: &Tensor) -> Result<Tensor> {
        forward_train_layers(
            &self.layers,
            &self.rope,
            self.train_input(tokens, features)?,
        )
    }

    /// Pass `k = unroll.passes() + 1` of a training-time-test unroll (HASS, EAGLE-3): the
    /// training forward of [`EagleHead::forward_train`] (pass 1 gives exactly its output),
    /// except that from pass 2 on, query position `i` attends the way a depth-`k - 1` draft
    /// node at head position `i` does at inference: to pass-1 K/V of positions
    /// `<= i - k + 1` (the committed pairs in the head's cache) and to the K/V of passes
    /// `2..=k` at positions `i - k + 2..=i`, one each (the node's chain ancestors and itself).
    /// For that, `features[:, i]` of pass `k >= 2` must be pass `k - 1`'s output at `i - 1`,
    /// the parent node's output; positions `i < k - 1` have no such chain and their outputs
    /// are meaningless. The pass's K/V (each layer's) are appended to `unroll`.
    pub fn forward_train_step(
        &self,
        tokens: &Tensor,
        features: &Tensor,
        unroll: &mut TrainUnroll,
    ) -> Result<Tensor> {
        let mut x = self.train_input(tokens, features)?;
        let t = x.dim(1)?;
        if let Some((k, _)) = unroll.kv.first().and_then(|pass| pass.first()) {
            if k.dims()[..2] != x.dims()[..2] {
                return Err(invalid(format!(
                    "unrolled pass over [{}, {t}] after passes over {:?}",
                    x.dim(0)?,
                    &k.dims()[..2]
                )));
            }
        }
        let (cos, sin, causal) = causal_train_inputs(&self.rope, t, self.dtype, &self.device)?;
        let mask = match unroll.passes() {
            0 => causal,
            done => train_mask(t, done, &self.device)?,
        };
        let mut pass_kv = Vec::with_capacity(self.layers.len());
        for (l, layer) in self.layers.iter().enumerate() {
            let prev: Vec<(Tensor, Tensor)> = unroll.kv.iter().map(|p| p[l].clone()).collect();
            let (y, kv) = layer.forward_unrolled(&x, &cos, &sin, &mask, &prev)?;
            pass_kv.push(kv);
            x = y;
        }
        unroll.kv.push(pass_kv);
        Ok(x)
    }

    /// `fc(cat(embed(tokens), features))` of a training batch, `[B, T, H]`.
    fn train_input(&self, tokens: &Tensor, features: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        let h = self.cfg.llama.hidden_size;
        if features.dims() != [b, t, h] {
            return Err(invalid(format!(
                "features have shape {:?}, expected [{b}, {t}, {h}]",
                features.dims()
            )));
        }
        let emb = self
            .embed
            .embedding(&tokens.flatten_all()?)?
            .reshape((b, t, h))?;
        let x = Tensor::cat(&[&emb, &features.to_dtype(self.dtype)?], D::Minus1)?;
        self.fc.forward(&x)
    }
}

/// The K/V of the passes of a training-time-test unroll so far
/// ([`EagleHead::forward_train_step`]); start each batch with a fresh one.
#[derive(Debug, Clone, Default)]
pub struct TrainUnroll {
    /// Per pass, per layer, roped K and V `[B, T, n_kv, head_dim]` (tracked for backprop).
    kv: Vec<Vec<(Tensor, Tensor)>>,
}

impl TrainUnroll {
    /// Passes run so far.
    pub fn passes(&self) -> usize {
        self.kv.len()
    }
}

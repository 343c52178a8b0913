//! The Llama decoder: embedding → decoder layers over the paged KV cache → final RMSNorm on
//! the requested rows; `logits` applies the LM head.

use crate::cache::{PagedKvCache, SeqId};
use crate::candle_dtype;
use crate::cuda_kernels::CudaKernels;
use crate::error::{invalid, ModelError, Result};
use crate::layer::{forward_train_layers, AttnCtx, DecoderLayer, LayerDims, Linear, RmsNorm};
use crate::matvec_quant::{Bits, QuantCopy};
use crate::rope::Rope;
use crate::step::{plan_step, Step, StepSeq};
use crate::step_graph::{GraphActivity, StepGraphs};
use crate::step_ids::StepIds;
use crate::unshard;
use crate::weights::{MapSource, PackedSource, TrainSource, VarSource, WeightSource};
use candle_core::{DType, Device, Tensor};
use candle_nn::{Init, VarBuilder};
use kestrel_core::{Mapping, ModelConfig};
use kestrel_kernels::gather_rows;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Which rows of a sequence's new tokens a forward returns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OutputRows {
    All,
    Last,
    Rows(Vec<usize>),
}

impl OutputRows {
    pub(crate) fn resolve(&self, n: usize) -> Result<Vec<usize>> {
        match self {
            OutputRows::All => Ok((0..n).collect()),
            OutputRows::Last => Ok(vec![n - 1]),
            OutputRows::Rows(rows) => {
                if let Some(&bad) = rows.iter().find(|&&r| r >= n) {
                    return Err(invalid(format!(
                        "output row {bad} is out of range for {n} new tokens"
                    )));
                }
                Ok(rows.clone())
            }
        }
    }
}

/// One sequence's part of a forward step.
#[derive(Debug, Clone)]
pub struct SeqInput<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    /// RoPE positions of the tokens (explicit: never inferred from the cache length).
    pub positions: &'a [u32],
    /// `n×n` row-major over this call's new tokens, `true` = may attend; `None` = causal.
    /// Every new token always sees all of the sequence's previously cached slots.
    pub mask: Option<&'a [bool]>,
    pub output_rows: OutputRows,
}

/// Feature taps: strictly increasing decoder layers of a `layers`-layer model (at most 128,
/// the width of a graph layout's tap mask) that the model runs (`run`).
fn check_taps(taps: &[usize], layers: usize, run: &[usize]) -> Result<()> {
    if let Some(w) = taps.windows(2).find(|w| w[0] >= w[1]) {
        return Err(invalid(format!(
            "feature taps must be strictly increasing, found {} then {}",
            w[0], w[1]
        )));
    }
    if let Some(&l) = taps.iter().find(|&&l| l >= layers.min(128)) {
        return Err(invalid(format!(
            "feature tap {l} is not a decoder layer of this {layers}-layer model"
        )));
    }
    if let Some(&l) = taps.iter().find(|l| !run.contains(l)) {
        return Err(invalid(format!(
            "feature tap {l} is a layer this copy of the model skips"
        )));
    }
    Ok(())
}

pub(crate) fn check_cache(
    cache: &PagedKvCache,
    layers: usize,
    n_kv: usize,
    head_dim: usize,
    dtype: DType,
    who: &str,
) -> Result<()> {
    if cache.num_layers() != layers
        || cache.n_kv_heads() != n_kv
        || cache.head_dim() != head_dim
        || cache.dtype() != dtype
    {
        return Err(invalid(format!(
            "KV cache ({} layers, {} KV heads, head_dim {}, {:?}) does not fit the {who} \
             ({layers} layers, {n_kv} KV heads, head_dim {head_dim}, {dtype:?})",
            cache.num_layers(),
            cache.n_kv_heads(),
            cache.head_dim(),
            cache.dtype()
        )));
    }
    Ok(())
}

/// A Llama-family decoder.
#[derive(Debug, Clone)]
pub struct Llama {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<DecoderLayer>,
    /// Each entry of `layers`' index in the full model: the KV-cache layer it reads and
    /// writes, and the feature tap it answers to (`0..n` but in a copy that skips layers).
    layer_ids: Vec<usize>,
    norm: RmsNorm,
    lm_head: Linear,
    rope: Rope,
    dtype: DType,
    device: Device,
    cpu_kernels: bool,
    cuda_kernels: CudaKernels,
    graphs: StepGraphs,
}

pub(crate) fn check_supported(cfg: &ModelConfig) -> Result<()> {
    cfg.validate().map_err(ModelError::Config)?;
    if cfg.attention_bias || cfg.mlp_bias {
        return Err(ModelError::Config(
            "attention_bias / mlp_bias are not supported (Llama checkpoints have none)".into(),
        ));
    }
    Ok(())
}

pub(crate) fn layer_dims(cfg: &ModelConfig) -> LayerDims {
    LayerDims {
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        n_heads: cfg.num_attention_heads,
        n_kv: cfg.num_kv_heads(),
        head_dim: cfg.head_dim(),
        eps: cfg.rms_norm_eps,
    }
}

/// HF names and full shapes of every tensor a Llama checkpoint holds.
pub fn expected_tensors(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let mut out = vec![(
        "model.embed_tokens.weight".to_string(),
        vec![cfg.vocab_size, h],
    )];
    for l in 0..cfg.num_hidden_layers {
        out.extend(decoder_layer_shapes(
            cfg,
            &format!("model.layers.{l}"),
            true,
        ));
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![cfg.vocab_size, h]));
    }
    out
}

/// Names and shapes of one decoder layer's tensors under `prefix` (`…layers.N`), the input
/// norm first when it has one, in the order the random weights are drawn.
pub(crate) fn decoder_layer_shapes(
    cfg: &ModelConfig,
    prefix: &str,
    input_norm: bool,
) -> Vec<(String, Vec<usize>)> {
    let h = cfg.hidden_size;
    let i = cfg.intermediate_size;
    let q = cfg.num_attention_heads * cfg.head_dim();
    let kv = cfg.num_kv_heads() * cfg.head_dim();
    let p = prefix;
    let norm = input_norm.then(|| (format!("{p}.input_layernorm.weight"), vec![h]));
    norm.into_iter()
        .chain([
            (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
            (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
            (format!("{p}.self_attn.o_proj.weight"), vec![h, q]),
            (format!("{p}.post_attention_layernorm.weight"), vec![h]),
            (format!("{p}.mlp.gate_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![i, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, i]),
        ])
        .collect()
}

impl Llama {
    /// Loads per-rank safetensors files (HF names, sliced per `mapping`), reassembling the
    /// full tensors on one device.
    pub fn load(
        cfg: &ModelConfig,
        mapping: Mapping,
        rank_files: &[PathBuf],
        dtype: kestrel_core::DType,
        device: &Device,
    ) -> Result<Self> {
        check_supported(cfg)?;
        let files = unshard::ShardedFiles::open(cfg, mapping, rank_files)?;
        let origin = format!("checkpoint files {}", files.origin());
        let expected = expected_tensors(cfg);
        let dtype = candle_dtype(dtype);
        if device.is_cpu() {
            // Each tensor straight into the packed buffer: the weights exist once in memory.
            let weights =
                crate::arena::load_packed(dtype, &expected, |name, full| files.load(name, full))?;
            let src = PackedSource {
                weights: &weights,
                origin: &origin,
                device,
            };
            return Self::build_from(cfg, &src);
        }
        let tensors = expected
            .iter()
            .map(|(name, full)| Ok((name.clone(), files.load(name, full)?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        Self::build(cfg, &tensors, &origin, dtype, device)
    }

    /// Builds a model from HF-named full tensors held in memory.
    pub fn from_tensors(
        cfg: &ModelConfig,
        tensors: BTreeMap<String, Tensor>,
        dtype: kestrel_core::DType,
        device: &Device,
    ) -> Result<Self> {
        check_supported(cfg)?;
        Self::build(
            cfg,
            &tensors,
            "in-memory tensors",
            candle_dtype(dtype),
            device,
        )
    }

    /// A model with deterministic random weights (benchmarks and tests): linear weights
    /// uniform with PyTorch's `1/sqrt(fan_in)` bound, embeddings of unit scale, norm weights
    /// around 1.
    pub fn random(
        cfg: &ModelConfig,
        seed: u64,
        dtype: kestrel_core::DType,
        device: &Device,
    ) -> Result<Self> {
        check_supported(cfg)?;
        // Generated straight in the model's dtype: a 7B model in f32 would need 27 GB of host
        // memory on its way to a bf16 GPU copy.
        let dtype = candle_dtype(dtype);
        let tensors = random_tensors_as(cfg, seed, dtype)?;
        Self::build(cfg, &tensors, "random tensors", dtype, device)
    }

    fn build(
        cfg: &ModelConfig,
        tensors: &BTreeMap<String, Tensor>,
        origin: &str,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let src = MapSource {
            map: tensors,
            origin,
            dtype,
            device,
        };
        Self::build_from(cfg, &src)
    }

    /// A trainable model (see [`crate::eagle::EagleHead::from_var_builder`] for the head):
    /// every tensor is a variable of `vb` (taken from its `VarMap` when present there, else
    /// created with the usual initialisation), except those in `frozen` (HF names, full
    /// shapes), which are constants that receive no gradient. A tied LM head is the embedding
    /// itself, so a trainable tied embedding gets the gradients of both of its uses.
    /// Projections stay unfused and the weights unpacked, so that optimiser updates of the
    /// variables are what every forward sees; train with [`Llama::forward_train`].
    pub fn from_var_builder(
        cfg: &ModelConfig,
        vb: VarBuilder,
        frozen: &BTreeMap<String, Tensor>,
    ) -> Result<Self> {
        check_supported(cfg)?;
        let vars = VarSource { vb: &vb };
        let src = TrainSource {
            frozen: MapSource {
                map: frozen,
                origin: "frozen tensors",
                dtype: vb.dtype(),
                device: vb.device(),
            },
            vars,
        };
        Self::build_from(cfg, &src)
    }

    fn build_from(cfg: &ModelConfig, src: &dyn WeightSource) -> Result<Self> {
        let (dtype, device) = (src.dtype(), src.device().clone());
        let h = cfg.hidden_size;
        let embed = src.get(
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            Init::Const(0.0),
        )?;
        let dims = layer_dims(cfg);
        let layers = (0..cfg.num_hidden_layers)
            .map(|l| DecoderLayer::load(src, &format!("model.layers.{l}"), dims, true))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(src, "model.norm", h, cfg.rms_norm_eps)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::no_bias(embed.clone())
        } else {
            Linear::load(src, "lm_head", cfg.vocab_size, h, false)?
        };
        let mut model = Llama {
            cfg: cfg.clone(),
            embed,
            layer_ids: (0..layers.len()).collect(),
            layers,
            norm,
            lm_head,
            rope: Rope::new(cfg.head_dim(), cfg.rope_theta, cfg.rope_scaling.as_ref()),
            dtype,
            device,
            cpu_kernels: true,
            cuda_kernels: CudaKernels::default(),
            graphs: StepGraphs::default(),
        };
        // Packing copies the weights into one buffer: trainable variables must stay where
        // the optimiser updates them.
        if src.fuse() && !src.packed() {
            model.pack_weights()?;
        }
        // The projections take the default kernel choice too.
        model.set_cuda_kernels(model.cuda_kernels);
        Ok(model)
    }

    /// On CPU, moves all weights into one huge-page-backed buffer (see `arena`).
    fn pack_weights(&mut self) -> Result<()> {
        if !self.device.is_cpu() {
            return Ok(());
        }
        let tied = self.cfg.tie_word_embeddings;
        let mut all: Vec<&mut Tensor> = vec![&mut self.embed];
        for layer in &mut self.layers {
            all.extend(layer.tensors_mut());
        }
        all.push(&mut self.norm.w);
        if !tied {
            self.lm_head.tensors_mut(&mut all);
        }
        crate::arena::pack(&mut all)?;
        if tied {
            self.lm_head.w = self.embed.clone();
        }
        Ok(())
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Whether CPU forwards may use the hand-written kernels (matrix-vector products for few
    /// rows, paged attention). On by default; off runs the portable candle ops that CUDA uses.
    pub fn set_cpu_kernels(&mut self, enabled: bool) {
        self.cpu_kernels = enabled;
    }

    /// Which of Kestrel's CUDA kernels run on a CUDA device (all by default; an engine's
    /// plan sets its own choice). Ignored off CUDA.
    pub fn set_cuda_kernels(&mut self, kernels: CudaKernels) {
        self.cuda_kernels = kernels;
        for layer in &mut self.layers {
            layer
                .linears_mut()
                .into_iter()
                .for_each(|l| l.gemv = kernels.gemv);
        }
        self.lm_head.gemv = kernels.gemv;
    }
    pub fn cuda_kernels(&self) -> CudaKernels {
        self.cuda_kernels
    }

    /// A copy of this model whose decoder layers' projections read 4-bit copies of their
    /// weights and whose LM head reads an 8-bit copy (`matvec_quant.rs`: 0.31 and 0.56 of
    /// the bytes bf16 weights take), everything else shared with `self` (the runtime drafts
    /// with it: `Engine::self_draft`). Why 8 bits for the head: SmolLM2's comes from an
    /// 8-bit tensor, and at 4 bits the copy's greedy tokens agreed with the model's less
    /// often (3.2 against 3.6 tokens a draft-target step at 3 drafts). On the CPU or on CUDA
    /// (each with its own kernel, on the same quantized numbers); a matrix whose rows the
    /// kernel does not take stays as it is. Returns the copy and the bytes its quantized
    /// weights take.
    pub fn with_quantized_draft_weights(&self) -> Result<(Llama, usize)> {
        let mut copy = self.clone();
        copy.graphs = StepGraphs::default();
        let mut bytes = 0;
        let projections = copy.layers.iter_mut().flat_map(|l| l.linears_mut());
        let layers = projections.map(|lin| (lin, Bits::Four));
        for (lin, bits) in layers.chain([(&mut copy.lm_head, Bits::Eight)]) {
            if let Some(quant) = QuantCopy::of(&lin.w, bits)? {
                bytes += quant.bytes();
                lin.quant = Some(std::sync::Arc::new(quant));
            }
        }
        Ok((copy, bytes))
    }

    /// A copy of this model that skips the decoder layers in `skip` (the residual stream
    /// passes them unchanged) and runs every other layer over that layer's own place in the
    /// KV cache, sharing all weights with `self`: a draft for the model itself with no
    /// weights of its own (self-speculative decoding's layer skipping, as in Draft & Verify
    /// and SWIFT). Over the model's own cache it reads the model's K/V of the committed
    /// tokens at the layers it runs. `skip` names layers of the model, each once, and leaves
    /// at least one to run.
    pub fn skipping_layers(&self, skip: &[usize]) -> Result<Llama> {
        let n = self.cfg.num_hidden_layers;
        if let Some(&l) = skip.iter().find(|&&l| l >= n) {
            return Err(invalid(format!(
                "layer {l} to skip is not a decoder layer of this {n}-layer model (0 to {})",
                n - 1
            )));
        }
        let mut sorted = skip.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("layer {} is named twice to skip", w[0])));
        }
        let mut copy = self.clone();
        copy.graphs = StepGraphs::default();
        let kept: Vec<(usize, DecoderLayer)> = self
            .layer_ids
            .iter()
            .copied()
            .zip(self.layers.iter().cloned())
            .filter(|(l, _)| !skip.contains(l))
            .collect();
        if kept.is_empty() {
            return Err(invalid(format!(
                "skipping layers {skip:?} leaves none of the model's {n} layers to run"
            )));
        }
        (copy.layer_ids, copy.layers) = kept.into_iter().unzip();
        Ok(copy)
    }

    /// The decoder layers this model runs, by their index in the full model (all of them
    /// but in a [`Llama::skipping_layers`] copy).
    pub fn layer_ids(&self) -> &[usize] {
        &self.layer_ids
    }

    /// Whether decode and tree steps on CUDA replay captured CUDA graphs (off by default).
    /// Only steps whose attention and K/V writes take Kestrel's kernels are captured, and
    /// only while the weights stay where they are: never turn this on for a model being
    /// trained. Ignored off CUDA.
    pub fn set_cuda_graphs(&mut self, enabled: bool) {
        self.graphs.set_enabled(enabled && self.device.is_cuda());
    }

    /// Why CUDA graphs were turned off after a failed capture, if they were.
    pub fn cuda_graph_failure(&self) -> Option<String> {
        self.graphs.failure()
    }

    /// How many step graphs are captured now (one per step layout in use).
    pub fn cuda_graph_count(&self) -> usize {
        self.graphs.count()
    }

    /// What the step graphs have done since the model was loaded.
    pub fn cuda_graph_activity(&self) -> GraphActivity {
        self.graphs.activity()
    }

    /// Device bytes the step graphs keep their activations in (their shared arena).
    pub fn cuda_graph_arena_bytes(&self) -> usize {
        self.graphs.arena_bytes()
    }

    /// What moving each captured step's allocations into the arena did.
    pub fn cuda_graph_relocations(&self) -> Vec<kestrel_kernels::RelocationStats> {
        self.graphs.relocations()
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// The token embedding `[vocab, hidden]`.
    pub fn embedding(&self) -> &Tensor {
        &self.embed
    }

    /// A KV cache shaped for this model.
    pub fn new_cache(&self, num_blocks: usize, block_size: usize) -> Result<PagedKvCache> {
        let mut cache = PagedKvCache::new(
            self.cfg.num_hidden_layers,
            self.cfg.num_kv_heads(),
            self.cfg.head_dim(),
            num_blocks,
            block_size,
            self.dtype,
            &self.device,
        )?;
        // Compaction goes with the other writes of K/V rows: Kestrel's kernels or candle's.
        cache.set_move_kernel(self.cuda_kernels.kv_append);
        Ok(cache)
    }

    /// Runs one step over the batch; returns the final-normed hidden states of the
    /// requested rows of all sequences, concatenated: `[total_rows, hidden]`.
    ///
    /// Projections of steps up to [`crate::matvec::MAX_ROWS`] rows take the batch-invariant
    /// matrix-vector kernel on CPU, so a row's result does not depend on the step's other
    /// rows: decode and tree-verification steps must use this.
    pub fn forward(&self, batch: &[SeqInput], cache: &mut PagedKvCache) -> Result<Tensor> {
        self.forward_with(batch, None, cache, true, &[])
    }

    /// [`Llama::forward`] for prompts: on CPU, f32 projections take candle's GEMM, which
    /// prefills long prompts faster (f16/bf16 ones take the matrix-vector kernel: candle's
    /// half-precision CPU GEMM is ~100× slower). Every decoding mode must run a prompt
    /// through this same call, so that the cached K/V and the first token agree across modes.
    pub fn forward_prompt(&self, batch: &[SeqInput], cache: &mut PagedKvCache) -> Result<Tensor> {
        self.forward_with(batch, None, cache, false, &[])
    }

    /// [`Llama::forward`] (`prompt = false`) or [`Llama::forward_prompt`] whose rows also
    /// carry the residual state after each decoder layer in `taps` (strictly increasing),
    /// RMS-normalised without a weight: `[rows, (1 + taps.len()) · hidden]` =
    /// `cat(final-normed hidden, state(taps[0]), …)`, the base features an EAGLE head with
    /// `feature_layers` reads. The first `hidden` columns are exactly what the untapped
    /// call returns; [`Llama::final_hidden`] gives them back for [`Llama::logits`].
    pub fn forward_tapped(
        &self,
        batch: &[SeqInput],
        cache: &mut PagedKvCache,
        taps: &[usize],
        prompt: bool,
    ) -> Result<Tensor> {
        check_taps(taps, self.cfg.num_hidden_layers, &self.layer_ids)?;
        self.forward_with(batch, None, cache, !prompt, taps)
    }

    /// [`Llama::forward_tapped`] of a decode or verification step (not a prompt) whose token
    /// ids are already on the model's device: `ids`, u32 `[Σ n]`, the inputs' tokens in batch
    /// order (a drafted tree's, which then never cross to the host before verification). The
    /// inputs carry no host tokens (`tokens` empty): their counts come from `positions`. The
    /// ids are not checked against the vocabulary, so they must come from the model's own
    /// rows (a top-k over its logits).
    pub fn forward_tapped_device_ids(
        &self,
        batch: &[SeqInput],
        ids: &Tensor,
        cache: &mut PagedKvCache,
        taps: &[usize],
    ) -> Result<Tensor> {
        check_taps(taps, self.cfg.num_hidden_layers, &self.layer_ids)?;
        self.forward_with(batch, Some(ids), cache, true, taps)
    }

    fn forward_with(
        &self,
        batch: &[SeqInput],
        device_ids: Option<&Tensor>,
        cache: &mut PagedKvCache,
        matvec: bool,
        taps: &[usize],
    ) -> Result<Tensor> {
        if self.device.is_cpu() && self.cpu_kernels {
            // Positions, not host tokens: a step fed device ids carries none.
            let rows = batch.iter().map(|s| s.positions.len()).sum();
            return crate::team::run(rows, || {
                self.forward_impl(batch, device_ids, cache, matvec, taps)
            });
        }
        self.forward_impl(batch, device_ids, cache, matvec, taps)
    }

    fn forward_impl(
        &self,
        batch: &[SeqInput],
        device_ids: Option<&Tensor>,
        cache: &mut PagedKvCache,
        matvec: bool,
        taps: &[usize],
    ) -> Result<Tensor> {
        check_cache(
            cache,
            self.cfg.num_hidden_layers,
            self.cfg.num_kv_heads(),
            self.cfg.head_dim(),
            self.dtype,
            "model",
        )?;
        let inputs = batch.iter().map(|s| (s.seq, s.tokens, s.positions.len()));
        let step_ids = StepIds::of(inputs, device_ids)?;
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
        let mut plan = plan_step(&steps, cache, &self.device, portable, cuda, !matvec)?;
        step_ids.check(self.cfg.vocab_size)?;
        let commit = std::mem::take(&mut plan.commit);
        let kv: &PagedKvCache = cache;
        let out = if matvec && plan.graphable() && self.graphs.active() {
            let mut inputs = plan.graph_inputs(step_ids.host(), &self.rope)?;
            inputs.layout.taps = taps.iter().fold(0u128, |m, &l| m | (1 << l));
            let cache_id = kv.pools(0).0.id();
            self.graphs.run(
                cache_id,
                &inputs,
                step_ids.device(),
                None,
                self.dtype,
                &self.device,
                |ids, step, _| self.run_layers(ids, step, kv, matvec, taps),
            )?
        } else {
            let step = plan.upload(&self.rope, kv, self.dtype, &self.device)?;
            self.run_layers(&step_ids.on(&self.device)?, &step, kv, matvec, taps)?
        };
        for (seq, len) in commit {
            cache.set_len(seq, len)?;
        }
        Ok(out)
    }

    /// The final-normed hidden states (the first `hidden` columns) of rows returned by
    /// [`Llama::forward_tapped`]: what [`Llama::logits`] takes. Untapped rows pass through.
    pub fn final_hidden(&self, rows: &Tensor) -> Result<Tensor> {
        let h = self.cfg.hidden_size;
        if rows.dim(1)? == h {
            return Ok(rows.clone());
        }
        Ok(rows.narrow(1, 0, h)?.contiguous()?)
    }

    /// The device work of a step: embedding, the layers, the requested rows, the final norm
    /// (and the tapped layer states after it, see [`Llama::forward_tapped`]).
    fn run_layers(
        &self,
        ids: &Tensor,
        step: &Step,
        kv: &PagedKvCache,
        matvec: bool,
        taps: &[usize],
    ) -> Result<Tensor> {
        let cuda = self.device.is_cuda().then_some(&self.cuda_kernels);
        let mut x = gather_rows(&self.embed, ids)?;
        let ctx = |l: usize| AttnCtx::Paged {
            cos: &step.cos,
            sin: &step.sin,
            seqs: &step.seqs,
            batched: step.batched.as_ref(),
            kernel: step.kernel.as_ref(),
            cuda,
            cache: kv,
            layer: l,
            cpu_kernels: self.cpu_kernels,
            matvec,
        };
        let select = |t: Tensor| -> Result<Tensor> {
            Ok(match &step.out_rows {
                Some(rows) => gather_rows(&t, rows)?,
                None => t,
            })
        };
        let mut tapped = Vec::with_capacity(taps.len());
        let mut tap = |l: usize, state: &dyn Fn() -> Result<Tensor>| -> Result<()> {
            if taps.contains(&l) {
                // Residual states grow with depth; normed without the final norm's weight,
                // every tap is on the final feature's scale.
                tapped.push(self.norm.forward_unweighted(&select(state()?)?)?);
            }
            Ok(())
        };
        let normed = if cuda.is_some_and(|k| k.add_rmsnorm) {
            // Each layer's last residual add is fused into the next layer's input norm.
            let mut pending: Option<Tensor> = None;
            for (&l, layer) in self.layer_ids.iter().zip(&self.layers) {
                let (r, delta) = layer.forward_deferred(&x, pending.as_ref(), &ctx(l))?;
                x = r;
                tap(l, &|| Ok((&x + &delta)?))?;
                pending = Some(delta);
            }
            match pending {
                // The last add fused into the final norm; the norm is per row, so selecting
                // the requested rows after it gives the same values.
                Some(p) => select(self.norm.forward_add(&x, &p)?.1)?,
                None => self.norm.forward(&select(x)?, false)?,
            }
        } else {
            for (&l, layer) in self.layer_ids.iter().zip(&self.layers) {
                x = layer.forward(&x, &ctx(l))?;
                tap(l, &|| Ok(x.clone()))?;
            }
            self.norm.forward(&select(x)?, false)?
        };
        if tapped.is_empty() {
            return Ok(normed);
        }
        tapped.insert(0, normed);
        Ok(Tensor::cat(&tapped, 1)?)
    }

    /// Training forward without a cache: `tokens: [B, T]` (u32, each row a sequence from
    /// position 0; right padding is harmless under the causal mask) → final-normed hidden
    /// states `[B, T, hidden]`, built from differentiable candle ops.
    pub fn forward_train(&self, tokens: &Tensor) -> Result<Tensor> {
        let (b, t) = tokens.dims2()?;
        if b == 0 || t == 0 {
            return Err(invalid(format!("empty training batch [{b}, {t}]")));
        }
        let h = self.cfg.hidden_size;
        let ids = tokens.flatten_all()?;
        let max = ids.max(0)?.to_scalar::<u32>()?;
        if max as usize >= self.cfg.vocab_size {
            return Err(invalid(format!(
                "token id {max} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let x = self.embed.embedding(&ids)?.reshape((b, t, h))?;
        let x = forward_train_layers(&self.layers, &self.rope, x)?;
        self.norm.forward(&x, true)
    }

    /// The LM head's rows of `ids` (a copy): a draft vocabulary whose products read
    /// `ids.len() / vocab` of the head's weight. Every id must be below the vocabulary size.
    pub fn lm_head_rows(&self, ids: &[u32]) -> Result<LmHeadRows> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
            return Err(invalid(format!(
                "LM head row {bad} is outside the vocabulary of {}",
                self.cfg.vocab_size
            )));
        }
        let index = Tensor::from_slice(ids, ids.len(), self.lm_head.w.device())?;
        let head = &self.lm_head;
        Ok(LmHeadRows(Linear {
            w: gather_rows(&head.w, &index)?,
            b: head
                .b
                .as_ref()
                .map(|b| gather_rows(b, &index))
                .transpose()?,
            gemv: head.gemv,
            quant: None,
        }))
    }

    /// `rows(hidden)` as f32 logits `[rows, ids.len()]`: column j is token `ids[j]` of
    /// [`Llama::lm_head_rows`].
    pub fn logits_of(&self, rows: &LmHeadRows, hidden: &Tensor) -> Result<Tensor> {
        self.logits_through(&rows.0, hidden)
    }

    /// LM head over hidden states `[rows, hidden]` → f32 logits `[rows, vocab]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.logits_through(&self.lm_head, hidden)
    }

    /// `head(hidden)` as f32 logits.
    fn logits_through(&self, head: &Linear, hidden: &Tensor) -> Result<Tensor> {
        Ok(head
            .forward_with(hidden, self.cpu_kernels)?
            .to_dtype(DType::F32)?)
    }
}

/// Some rows of a model's LM head ([`Llama::lm_head_rows`]).
#[derive(Debug, Clone)]
pub struct LmHeadRows(Linear);

/// SplitMix64 (deterministic, dependency-free random numbers for `Llama::random`). It is
/// counter-based: value `k` of the stream seeded with `seed` is `mix(seed + (k + 1)·γ)`, so
/// any stretch of the stream can be generated on its own, in parallel, with the same values a
/// sequential generator would give.
const SPLITMIX_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

fn splitmix_mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Value `k` of the stream, uniform in [-1, 1).
fn splitmix_unit(seed: u64, k: u64) -> f32 {
    let z = splitmix_mix(seed.wrapping_add(k.wrapping_add(1).wrapping_mul(SPLITMIX_GAMMA)));
    ((z >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

/// `center + scale·U[-1, 1)` for values `start..start + n` of the stream, converted to `T`
/// element by element so that a large model never exists in f32 on the host.
fn random_values<T: Send>(
    seed: u64,
    start: u64,
    n: usize,
    center: f32,
    scale: f32,
    conv: impl Fn(f32) -> T + Sync,
) -> Vec<T> {
    use rayon::prelude::*;
    (0..n)
        .into_par_iter()
        .map(|i| conv(center + scale * splitmix_unit(seed, start + i as u64)))
        .collect()
}

/// Random HF-named tensors for `cfg` on the CPU in `dtype`: the f32 values of
/// [`random_tensors`] rounded to `dtype` (round to nearest even, as `Tensor::to_dtype`).
pub fn random_tensors_as(
    cfg: &ModelConfig,
    seed: u64,
    dtype: DType,
) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    let mut start = 0u64;
    for (name, shape) in expected_tensors(cfg) {
        let (center, scale) = if shape.len() == 1 {
            (1.0, 0.2)
        } else if name.contains("embed_tokens") {
            (0.0, 1.0)
        } else {
            (0.0, 1.0 / (shape[1] as f32).sqrt())
        };
        let n: usize = shape.iter().product();
        let t = match dtype {
            DType::BF16 => Tensor::from_vec(
                random_values(seed, start, n, center, scale, half::bf16::from_f32),
                shape.as_slice(),
                &Device::Cpu,
            )?,
            DType::F16 => Tensor::from_vec(
                random_values(seed, start, n, center, scale, half::f16::from_f32),
                shape.as_slice(),
                &Device::Cpu,
            )?,
            _ => Tensor::from_vec(
                random_values(seed, start, n, center, scale, |x| x),
                shape.as_slice(),
                &Device::Cpu,
            )?
            .to_dtype(dtype)?,
        };
        start += n as u64;
        out.insert(name, t);
    }
    Ok(out)
}

/// Random HF-named tensors for `cfg` (f32, CPU).
pub fn random_tensors(cfg: &ModelConfig, seed: u64) -> Result<BTreeMap<String, Tensor>> {
    random_tensors_as(cfg, seed, DType::F32)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel, counter-based generator must give exactly the values of the sequential
    /// SplitMix64 stream it replaced, so random models stay what tests were written against.
    #[test]
    fn counter_based_splitmix_matches_the_sequential_stream() {
        let seed = 7u64;
        let mut state = seed;
        let sequential: Vec<f32> = (0..1000)
            .map(|_| {
                state = state.wrapping_add(SPLITMIX_GAMMA);
                ((splitmix_mix(state) >> 40) as f32 / (1u64 << 23) as f32) - 1.0
            })
            .collect();
        let parallel = random_values(seed, 0, 1000, 0.0, 1.0, |x| x);
        assert_eq!(parallel, sequential);
        assert_eq!(
            random_values(seed, 400, 600, 0.0, 1.0, |x| x),
            sequential[400..]
        );
    }

    #[test]
    fn tensors_in_a_dtype_are_the_f32_tensors_rounded() {
        let cfg: ModelConfig = serde_json::from_str(
            r#"{"vocab_size":16,"hidden_size":8,"intermediate_size":16,"num_hidden_layers":1,
                "num_attention_heads":2,"num_key_value_heads":1}"#,
        )
        .unwrap();
        let f32s = random_tensors(&cfg, 3).unwrap();
        let bf16s = random_tensors_as(&cfg, 3, DType::BF16).unwrap();
        for (name, t) in &f32s {
            let want = t.to_dtype(DType::BF16).unwrap().flatten_all().unwrap();
            let got = bf16s[name].flatten_all().unwrap();
            assert_eq!(
                got.to_vec1::<half::bf16>().unwrap(),
                want.to_vec1::<half::bf16>().unwrap(),
                "{name}"
            );
        }
    }
}

//! The building blocks shared by the Llama decoder and the EAGLE head: linear projections
//! (fused when loading for inference), RMSNorm, attention over the paged KV cache or over a
//! plain causal window (training), the SwiGLU MLP, and the decoder layer itself.

use crate::batched_attn::{BatchedStep, KernelAttn};
use crate::cache::PagedKvCache;
use crate::cpu_attn::{self, AttnShape};
use crate::cuda_kernels::CudaKernels;
use crate::error::Result;
use crate::matvec::{MatMulNt, MAX_ROWS};
use crate::matvec_quant::QuantCopy;
use crate::rope;
use crate::weights::{linear_init, WeightSource};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::Init;
use std::sync::Arc;

/// `y = x · wᵀ (+ b)`, with `w: [out, in]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    pub w: Tensor,
    pub b: Option<Tensor>,
    /// On CUDA, steps of a few rows take Kestrel's `gemv` kernel (the plan's choice).
    pub gemv: bool,
    /// A 4- or 8-bit copy of `w` that every product reads instead, on the CPU or on CUDA
    /// ([`crate::Llama::with_quantized_draft_weights`]); `w` stays, shared with the model it
    /// was copied from, and is not read.
    pub quant: Option<Arc<QuantCopy>>,
}

impl Linear {
    pub fn load(
        src: &dyn WeightSource,
        name: &str,
        out: usize,
        inp: usize,
        bias: bool,
    ) -> Result<Self> {
        let w = src.get(&format!("{name}.weight"), &[out, inp], linear_init(inp))?;
        let b = if bias {
            Some(src.get(&format!("{name}.bias"), &[out], linear_init(inp))?)
        } else {
            None
        };
        Ok(Linear {
            w,
            b,
            gemv: false,
            quant: None,
        })
    }

    /// A linear layer without bias over `w`.
    pub fn no_bias(w: Tensor) -> Self {
        Linear {
            w,
            b: None,
            gemv: false,
            quant: None,
        }
    }

    pub fn tensors_mut<'a>(&'a mut self, out: &mut Vec<&'a mut Tensor>) {
        out.push(&mut self.w);
        if let Some(b) = &mut self.b {
            out.push(b);
        }
    }

    /// `x: [.., in]` → `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, true)
    }

    /// `fast`: a step's rows, which may take a few-rows kernel (the CPU matrix-vector
    /// kernel; on CUDA, `gemv` when the plan picked it).
    pub fn forward_with(&self, x: &Tensor, fast: bool) -> Result<Tensor> {
        if let (Some(quant), 2) = (&self.quant, x.rank()) {
            return self.add_bias(quant.matmul(x)?);
        }
        let y = if x.rank() == 2 {
            let m = x.dim(0)?;
            let cpu_same = x.device().is_cpu() && x.dtype() == self.w.dtype();
            // Half-precision prompts too: candle's CPU GEMM in f16/bf16 prefilled SmolLM2 at
            // 2 tokens/s (the matrix-vector kernel: ~260), and its rows are as batch-invariant.
            let half = x.dtype() != DType::F32;
            if !fast && crate::amx::applies(x, &self.w) {
                // A bf16 prompt on a CPU with AMX (amx.rs: why prompts only).
                x.contiguous()?
                    .apply_op2_no_bwd(&self.w, &crate::amx::MatMulTiles)?
            } else if cpu_same && ((fast && m <= MAX_ROWS) || half) {
                x.contiguous()?.apply_op2_no_bwd(&self.w, &MatMulNt)?
            } else if fast && self.takes_gemv() && kestrel_kernels::gemv_applies(x, &self.w) {
                kestrel_kernels::gemv(x, &self.w)?
            } else {
                // Batch-invariant rows on CPU: a prompt's K/V must not depend on what else
                // is prefilled with it (prefix reuse prefills only the uncached part).
                crate::row_gemm::matmul_nt(x, &self.w)?
            }
        } else {
            x.broadcast_matmul(&self.w.t()?)?
        };
        self.add_bias(y)
    }

    /// Whether a step's rows take Kestrel's `gemv` kernels over `w` (and their fused
    /// variants): the plan picked them and no quantized copy stands in for `w`.
    fn takes_gemv(&self) -> bool {
        self.gemv && self.quant.is_none()
    }

    fn add_bias(&self, y: Tensor) -> Result<Tensor> {
        Ok(match &self.b {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `(x + res, self(norm(x + res)))` for the rows `[N, H]` of a CUDA step (no add when
    /// `res` is `None`): one launch when this projection takes the `gemv` kernel, else
    /// Kestrel's fused add + RMSNorm (or the norm alone) and then the projection.
    fn forward_add_norm(
        &self,
        x: &Tensor,
        res: Option<&Tensor>,
        norm: &RmsNorm,
        fast: bool,
    ) -> Result<(Tensor, Tensor)> {
        if fast && self.takes_gemv() && kestrel_kernels::gemv_add_rms_norm_applies(x, &self.w) {
            let eps = norm.eps as f32;
            let (sum, y) = kestrel_kernels::gemv_add_rms_norm(x, res, &norm.w, eps, &self.w)?;
            return Ok((sum, self.add_bias(y)?));
        }
        let (sum, h) = norm.forward_maybe_add(x, res)?;
        Ok((sum, self.forward_with(&h, fast)?))
    }
}

/// Several projections of one input: fused into one matmul for inference, kept apart for
/// training.
#[derive(Debug, Clone)]
pub(crate) enum Proj {
    Fused { lin: Linear, sizes: Vec<usize> },
    Split(Vec<Linear>),
}

impl Proj {
    /// The bias-free projections `parts` (name, output features) of `inp` inputs: fused when
    /// the source allows, their weights concatenated before they reach the device.
    fn load(src: &dyn WeightSource, parts: &[(String, usize)], inp: usize) -> Result<Self> {
        if src.fuse() && parts.len() > 1 {
            let weights: Vec<(String, Vec<usize>)> = parts
                .iter()
                .map(|(name, out)| (format!("{name}.weight"), vec![*out, inp]))
                .collect();
            return Ok(Proj::Fused {
                lin: Linear::no_bias(src.get_cat(&weights)?),
                sizes: parts.iter().map(|(_, out)| *out).collect(),
            });
        }
        Ok(Proj::Split(
            parts
                .iter()
                .map(|(name, out)| Linear::load(src, name, *out, inp, false))
                .collect::<Result<_>>()?,
        ))
    }

    fn tensors_mut<'a>(&'a mut self, out: &mut Vec<&'a mut Tensor>) {
        match self {
            Proj::Fused { lin, .. } => lin.tensors_mut(out),
            Proj::Split(parts) => parts.iter_mut().for_each(|l| l.tensors_mut(out)),
        }
    }

    fn linears_mut(&mut self) -> Vec<&mut Linear> {
        match self {
            Proj::Fused { lin, .. } => vec![lin],
            Proj::Split(parts) => parts.iter_mut().collect(),
        }
    }

    fn forward(&self, x: &Tensor, fast: bool) -> Result<Vec<Tensor>> {
        match self {
            Proj::Split(parts) => parts.iter().map(|l| l.forward_with(x, fast)).collect(),
            Proj::Fused { lin, sizes } => {
                let y = lin.forward_with(x, fast)?;
                let mut out = Vec::with_capacity(sizes.len());
                let mut start = 0;
                for &s in sizes {
                    out.push(y.narrow(D::Minus1, start, s)?);
                    start += s;
                }
                Ok(out)
            }
        }
    }
}

/// HF Llama RMSNorm: `w * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)`.
#[derive(Debug, Clone)]
pub(crate) struct RmsNorm {
    pub w: Tensor,
    ones: Tensor,
    eps: f64,
}

impl RmsNorm {
    pub fn load(src: &dyn WeightSource, name: &str, size: usize, eps: f64) -> Result<Self> {
        let w = src.get(&format!("{name}.weight"), &[size], Init::Const(1.0))?;
        let ones = Tensor::ones(size, DType::F32, w.device())?;
        Ok(RmsNorm { w, ones, eps })
    }

    /// `(x + res, self(x + res))` through Kestrel's fused CUDA kernel (`[N, H]` rows).
    pub fn forward_add(&self, x: &Tensor, res: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok(kestrel_kernels::add_rms_norm(
            x,
            res,
            &self.w,
            self.eps as f32,
        )?)
    }

    /// [`Self::forward_add`], or `(x, self(x))` without a residual.
    fn forward_maybe_add(&self, x: &Tensor, res: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
        match res {
            Some(r) => self.forward_add(x, r),
            None => Ok((x.clone(), self.forward(x, false)?)),
        }
    }

    /// `x` RMS-normalised in f32 without the weight, in `x`'s dtype (`[N, H]` rows).
    pub fn forward_unweighted(&self, x: &Tensor) -> Result<Tensor> {
        let normed = candle_nn::ops::rms_norm(
            &x.to_dtype(DType::F32)?.contiguous()?,
            &self.ones,
            self.eps as f32,
        )?;
        Ok(normed.to_dtype(x.dtype())?)
    }

    pub fn forward(&self, x: &Tensor, differentiable: bool) -> Result<Tensor> {
        let dtype = x.dtype();
        if differentiable {
            let xf = x.to_dtype(DType::F32)?;
            let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = xf.broadcast_mul(&(var + self.eps)?.sqrt()?.recip()?)?;
            return Ok(normed.to_dtype(dtype)?.broadcast_mul(&self.w)?);
        }
        let x = x.contiguous()?;
        if dtype == DType::F32 {
            return Ok(candle_nn::ops::rms_norm(&x, &self.w, self.eps as f32)?);
        }
        if x.device().is_cpu() {
            // The same bits as the ops below, in one pass.
            return crate::cpu_norm::rms_norm_half(&x, &self.w, self.eps as f32);
        }
        let normed =
            candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?, &self.ones, self.eps as f32)?;
        Ok(normed.to_dtype(dtype)?.broadcast_mul(&self.w)?)
    }
}

/// One sequence's part of a paged attention step.
pub(crate) struct PagedSeq {
    /// First row of this sequence in the step's concatenated tokens.
    pub offset: usize,
    /// Its number of new tokens.
    pub n: usize,
    /// Pool rows its new K/V go to.
    pub new_rows: Vec<u32>,
    /// Pool rows of all its slots, cached then new.
    pub all_rows: Vec<u32>,
    /// The same as a u32 tensor `[L]` (portable path only).
    pub all_rows_t: Option<Tensor>,
    /// Additive f32 mask `[n, L]`; `None` when every new token may see every slot.
    pub mask: Option<Vec<f32>>,
    /// The same as a tensor (portable path only).
    pub mask_t: Option<Tensor>,
}

/// How attention finds its keys and values.
pub(crate) enum AttnCtx<'a> {
    /// Inference: `x: [N, H]`, K/V written to and read from the paged cache.
    Paged {
        cos: &'a Tensor,
        sin: &'a Tensor,
        seqs: &'a [PagedSeq],
        /// The whole batch in one attention call (portable path, equal new-token counts).
        batched: Option<&'a BatchedStep>,
        /// The step through Kestrel's paged-attention kernel (CUDA, when the plan picks it).
        kernel: Option<&'a KernelAttn>,
        /// Kestrel's CUDA kernels in use; `None` off CUDA, which keeps the CPU and portable
        /// paths exactly as they were.
        cuda: Option<&'a CudaKernels>,
        cache: &'a PagedKvCache,
        layer: usize,
        /// Use the CPU kernels (matvec, paged attention) where they apply.
        cpu_kernels: bool,
        /// Whether projections may take the matrix-vector kernel (batch-invariant rows) or
        /// must take GEMM (a prompt's forward, the same call in every decoding mode).
        matvec: bool,
    },
    /// Training: `x: [B, T, H]`, causal self-attention without a cache, differentiable ops.
    Train {
        cos: &'a Tensor,
        sin: &'a Tensor,
        mask: &'a Tensor,
    },
}

/// The RoPE tables of positions `0..t` and the additive causal mask `[t, t]` of a training
/// forward ([`AttnCtx::Train`]): every window starts at position 0 and sees no cache.
pub(crate) fn causal_train_inputs(
    rope: &rope::Rope,
    t: usize,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor, Tensor)> {
    let positions: Vec<u32> = (0..t as u32).collect();
    let (cos, sin) = rope.cos_sin(&positions, dtype, device)?;
    Ok((cos, sin, train_mask(t, 0, device)?))
}

/// `layers` in turn over a training batch `x: [B, T, H]` (positions `0..T`, causal, no
/// cache), built from differentiable ops.
pub(crate) fn forward_train_layers(
    layers: &[DecoderLayer],
    rope: &rope::Rope,
    x: Tensor,
) -> Result<Tensor> {
    let (cos, sin, mask) = causal_train_inputs(rope, x.dim(1)?, x.dtype(), x.device())?;
    let ctx = AttnCtx::Train {
        cos: &cos,
        sin: &sin,
        mask: &mask,
    };
    layers
        .iter()
        .try_fold(x, |x, layer| layer.forward(&x, &ctx))
}

/// The additive mask `[t, t]` under which query `i` sees keys `j <= i - shift` (`shift = 0`:
/// causal). A row with no visible key is all `f32::MIN`, which only the unrolled attention
/// (which always adds keys of its own) may use.
pub(crate) fn train_mask(t: usize, shift: usize, device: &Device) -> Result<Tensor> {
    let mut mask = vec![0f32; t * t];
    for i in 0..t {
        for j in (i + 1).saturating_sub(shift)..t {
            mask[i * t + j] = f32::MIN;
        }
    }
    Ok(Tensor::from_vec(mask, (t, t), device)?)
}

/// `x: [b, t, ..]` moved `s` rows later along the time axis: row `i` holds `x[i - s]`, the
/// first `s` rows zeros.
fn shift_rows(x: &Tensor, s: usize) -> Result<Tensor> {
    let t = x.dim(1)?;
    if s == 0 {
        return Ok(x.clone());
    }
    let mut pad_shape = x.dims().to_vec();
    pad_shape[1] = s.min(t);
    let pad = Tensor::zeros(pad_shape, x.dtype(), x.device())?;
    if s >= t {
        return Ok(pad);
    }
    Ok(Tensor::cat(&[&pad, &x.narrow(1, 0, t - s)?], 1)?)
}

/// Attention of pass `k = 1 + chain.len() >= 2` of a training-time-test unroll (see
/// [`crate::eagle::TrainUnroll`]), differentiable. `q: [b, t, n_kv, group, d]`; `first`: K/V
/// `[b, t, n_kv, d]` of pass 1 (real features); `chain[m]`: K/V of pass `m + 2`, the last
/// being pass `k`'s own. Query `i` sees what an inference draft chain sees at depth `k - 1`:
/// pass-1 keys `j <= i - k + 1` (the committed context, `mask` = [`train_mask`] with shift
/// `k - 1`) and one key of each pass `m = 2..=k`, at position `i - (k - m)` (its chain
/// ancestors, then itself). Those are diagonals, so they are scored row by row (`O(t)` each)
/// instead of as `t × t` blocks that would be masked but for one entry per row. Returns
/// `[b, t, n_kv * group * d]`, like [`attend`].
fn attend_unrolled(
    q: &Tensor,
    first: &(Tensor, Tensor),
    chain: &[(Tensor, Tensor)],
    mask: &Tensor,
) -> Result<Tensor> {
    let (b, t, n_kv, g, d) = q.dims5()?;
    let dtype = q.dtype();
    let scale = 1.0 / (d as f64).sqrt();
    let qh = q
        .permute((0, 2, 3, 1, 4))?
        .contiguous()?
        .reshape((b, n_kv, g * t, d))?;
    let k1 = first.0.transpose(1, 2)?.contiguous()?;
    let v1 = first.1.transpose(1, 2)?.contiguous()?;
    let context = (qh.matmul(&k1.t()?)? * scale)?
        .to_dtype(DType::F32)?
        .reshape((b, n_kv, g, t, t))?
        .broadcast_add(mask)?;
    let mut scores = vec![context];
    let mut values = Vec::with_capacity(chain.len());
    for (m, (k, v)) in chain.iter().enumerate() {
        let lag = chain.len() - 1 - m;
        let k = shift_rows(k, lag)?.unsqueeze(3)?;
        // [b, t, n_kv, g, 1] → [b, n_kv, g, t, 1]
        let s = (q.broadcast_mul(&k)?.sum_keepdim(D::Minus1)? * scale)?
            .to_dtype(DType::F32)?
            .permute((0, 2, 3, 1, 4))?;
        scores.push(s);
        values.push(shift_rows(v, lag)?.transpose(1, 2)?.unsqueeze(2)?);
    }
    let probs =
        candle_nn::ops::softmax(&Tensor::cat(&scores, D::Minus1)?, D::Minus1)?.to_dtype(dtype)?;
    let mut out = probs
        .narrow(D::Minus1, 0, t)?
        .reshape((b, n_kv, g * t, t))?
        .matmul(&v1)?
        .reshape((b, n_kv, g, t, d))?;
    for (m, v) in values.iter().enumerate() {
        let p = probs.narrow(D::Minus1, t + m, 1)?;
        out = (out + p.broadcast_mul(v)?)?;
    }
    Ok(out
        .permute((0, 3, 1, 2, 4))?
        .reshape((b, t, n_kv * g * d))?)
}

impl AttnCtx<'_> {
    fn differentiable(&self) -> bool {
        matches!(self, AttnCtx::Train { .. })
    }
    /// The CUDA kernel choices of an inference step (never for training).
    fn cuda(&self) -> Option<&CudaKernels> {
        match self {
            AttnCtx::Paged { cuda, .. } => *cuda,
            AttnCtx::Train { .. } => None,
        }
    }
    fn matvec(&self) -> bool {
        matches!(
            self,
            AttnCtx::Paged {
                cpu_kernels: true,
                matvec: true,
                ..
            }
        )
    }
}

#[derive(Debug, Clone)]
struct Attention {
    qkv: Proj,
    o: Linear,
    n_heads: usize,
    n_kv: usize,
    head_dim: usize,
}

/// Softmax attention. `q: [b, n, n_kv, group, d]`, `k`, `v: [b, L, n_kv, d]`, `mask: [n, L]`
/// additive f32. Returns `[b, n, n_kv * group * d]`. Scores and softmax in f32 like HF.
pub(crate) fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    differentiable: bool,
) -> Result<Tensor> {
    let (b, n, n_kv, g, d) = q.dims5()?;
    let l = k.dim(1)?;
    let dtype = q.dtype();
    let qh = q
        .permute((0, 2, 3, 1, 4))?
        .contiguous()?
        .reshape((b, n_kv, g * n, d))?;
    let kh = k.transpose(1, 2)?.contiguous()?;
    let vh = v.transpose(1, 2)?.contiguous()?;
    let scores = (qh.matmul(&kh.t()?)? * (1.0 / (d as f64).sqrt()))?;
    let mut scores = scores.to_dtype(DType::F32)?.reshape((b, n_kv, g, n, l))?;
    if let Some(mask) = mask {
        scores = scores.broadcast_add(mask)?;
    }
    let probs = if differentiable {
        candle_nn::ops::softmax(&scores, D::Minus1)?
    } else {
        candle_nn::ops::softmax_last_dim(&scores.contiguous()?)?
    };
    let probs = probs.to_dtype(dtype)?.reshape((b, n_kv, g * n, l))?;
    let out = probs.matmul(&vh)?.reshape((b, n_kv, g, n, d))?;
    Ok(out
        .permute((0, 3, 1, 2, 4))?
        .reshape((b, n, n_kv * g * d))?)
}

impl Attention {
    /// Differentiable attention over a training window `x: [B, T, H]` with RoPE `cos`/`sin`:
    /// causal under `mask` when `prev` is empty, else pass `prev.len() + 1` of an unroll
    /// whose earlier passes left `prev` (see [`attend_unrolled`]; `mask` is then the shifted
    /// context mask). Returns the output and this pass's roped K and V `[B, T, n_kv, d]`.
    fn forward_unrolled(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        prev: &[(Tensor, Tensor)],
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let (nh, nkv, hd) = (self.n_heads, self.n_kv, self.head_dim);
        let qkv = self.qkv.forward(x, false)?;
        let (b, t, _) = x.dims3()?;
        let q = rope::apply(&qkv[0].reshape((b, t, nh, hd))?, cos, sin, true)?;
        let k = rope::apply(&qkv[1].reshape((b, t, nkv, hd))?, cos, sin, true)?;
        let v = qkv[2].reshape((b, t, nkv, hd))?;
        let q = q.reshape((b, t, nkv, nh / nkv, hd))?;
        let kv = (k, v);
        let out = match prev.split_first() {
            None => attend(&q, &kv.0, &kv.1, Some(mask), true)?,
            Some((first, rest)) => {
                let mut chain = rest.to_vec();
                chain.push(kv.clone());
                attend_unrolled(&q, first, &chain, mask)?
            }
        };
        Ok((self.o.forward_with(&out, false)?, kv))
    }

    /// The fused QKV projection when the step runs through Kestrel's kernels only (the plan
    /// picks them all): then one launch splits it, applies RoPE and appends K/V, and one
    /// attends ([`Self::attend_fused_qkv`]). `None` when some other path applies.
    fn fused_kernels_qkv<'s>(&'s self, ctx: &AttnCtx) -> Option<&'s Linear> {
        let AttnCtx::Paged {
            kernel: Some(ka),
            cuda: Some(cuda),
            ..
        } = ctx
        else {
            return None;
        };
        match &self.qkv {
            Proj::Fused { lin, .. } if ka.kv_append && cuda.qkv_rope => Some(lin),
            _ => None,
        }
    }

    /// The rest of the layer's attention from the fused projection's output `qkv`, on the
    /// path [`Self::fused_kernels_qkv`] chose.
    fn attend_fused_qkv(&self, qkv: &Tensor, ctx: &AttnCtx) -> Result<Tensor> {
        let AttnCtx::Paged {
            cos,
            sin,
            kernel: Some(ka),
            cache,
            layer,
            ..
        } = ctx
        else {
            unreachable!("fused_kernels_qkv chose the kernel path");
        };
        let (kp, vp) = cache.pools(*layer);
        let q = kestrel_kernels::qkv_rope_append(
            qkv,
            cos,
            sin,
            &ka.meta.new_slots,
            kp,
            vp,
            self.n_heads,
            self.n_kv,
        )?;
        let out = ka.attend(&q, kp, vp)?;
        self.o.forward_with(&out, ctx.matvec())
    }

    /// `(x + res, attention(norm(x + res)))` for a CUDA step, the add and norm fused into
    /// the QKV projection where the kernels allow it.
    fn forward_add_norm(
        &self,
        x: &Tensor,
        res: Option<&Tensor>,
        norm: &RmsNorm,
        ctx: &AttnCtx,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(lin) = self.fused_kernels_qkv(ctx) {
            let (sum, qkv) = lin.forward_add_norm(x, res, norm, ctx.matvec())?;
            return Ok((sum, self.attend_fused_qkv(&qkv, ctx)?));
        }
        let (sum, h) = norm.forward_maybe_add(x, res)?;
        Ok((sum, self.forward(&h, ctx)?))
    }

    fn forward(&self, x: &Tensor, ctx: &AttnCtx) -> Result<Tensor> {
        if let AttnCtx::Train { cos, sin, mask } = ctx {
            return Ok(self.forward_unrolled(x, cos, sin, mask, &[])?.0);
        }
        let (nh, nkv, hd) = (self.n_heads, self.n_kv, self.head_dim);
        let g = nh / nkv;
        let fast = ctx.matvec();
        if let Some(lin) = self.fused_kernels_qkv(ctx) {
            return self.attend_fused_qkv(&lin.forward_with(x, fast)?, ctx);
        }
        let qkv = self.qkv.forward(x, fast)?;
        let (q, k, v) = (&qkv[0], &qkv[1], &qkv[2]);
        let out = match ctx {
            AttnCtx::Paged {
                cos,
                sin,
                seqs,
                batched,
                kernel,
                cache,
                layer,
                cpu_kernels,
                ..
            } => {
                let cpu = *cpu_kernels && x.device().is_cpu();
                let n_tok = x.dim(0)?;
                let q =
                    rope::apply(&q.reshape((1, n_tok, nh, hd))?, cos, sin, false)?.squeeze(0)?;
                let k =
                    rope::apply(&k.reshape((1, n_tok, nkv, hd))?, cos, sin, false)?.squeeze(0)?;
                let v = v.reshape((n_tok, nkv, hd))?;
                if let Some(ka) = kernel {
                    let (kp, vp) = cache.pools(*layer);
                    if ka.kv_append {
                        kestrel_kernels::kv_append(kp, &k, &ka.meta.new_slots)?;
                        kestrel_kernels::kv_append(vp, &v, &ka.meta.new_slots)?;
                    } else {
                        for s in seqs.iter() {
                            cache.write(
                                *layer,
                                &s.new_rows,
                                &k.narrow(0, s.offset, s.n)?,
                                &v.narrow(0, s.offset, s.n)?,
                            )?;
                        }
                    }
                    // Same stream as the appends above: the kernel sees the new rows.
                    let out = ka.attend(&q, kp, vp)?;
                    return self.o.forward_with(&out, fast);
                }
                if let (Some(b), false) = (batched, cpu) {
                    let out = b.attend(cache, *layer, &q, &k, &v)?;
                    return self.o.forward_with(&out, fast);
                }
                let mut outs = Vec::with_capacity(seqs.len());
                for s in seqs.iter() {
                    cache.write(
                        *layer,
                        &s.new_rows,
                        &k.narrow(0, s.offset, s.n)?,
                        &v.narrow(0, s.offset, s.n)?,
                    )?;
                    let qs = q.narrow(0, s.offset, s.n)?;
                    if cpu {
                        let (kp, vp) = cache.pools(*layer);
                        let shape = AttnShape {
                            n: s.n,
                            n_heads: nh,
                            n_kv: nkv,
                            head_dim: hd,
                        };
                        let mask = s.mask.as_deref();
                        outs.push(cpu_attn::attend(&qs, kp, vp, &s.all_rows, mask, &shape)?);
                        continue;
                    }
                    let rows = match &s.all_rows_t {
                        Some(r) => r.clone(),
                        None => Tensor::new(s.all_rows.as_slice(), x.device())?,
                    };
                    let mask = match (&s.mask_t, &s.mask) {
                        (Some(m), _) => Some(m.clone()),
                        (None, Some(m)) => {
                            Some(Tensor::from_slice(m, (s.n, s.all_rows.len()), x.device())?)
                        }
                        (None, None) => None,
                    };
                    let (ks, vs) = cache.gather(*layer, &rows)?;
                    let qs = qs.reshape((1, s.n, nkv, g, hd))?;
                    let o = attend(
                        &qs,
                        &ks.unsqueeze(0)?,
                        &vs.unsqueeze(0)?,
                        mask.as_ref(),
                        false,
                    )?;
                    outs.push(o.squeeze(0)?);
                }
                if outs.len() == 1 {
                    outs.pop().expect("one output")
                } else {
                    Tensor::cat(&outs, 0)?
                }
            }
            AttnCtx::Train { .. } => unreachable!("training attention returned above"),
        };
        self.o.forward_with(&out, fast)
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    gate_up: Proj,
    down: Linear,
}

impl Mlp {
    /// `swiglu_kernel`: run `silu(gate) · up` as Kestrel's CUDA kernel on the fused output;
    /// `cpu_kernel`: as the CPU's one-pass kernel (`cpu_elementwise.rs`; inference only).
    fn forward(
        &self,
        x: &Tensor,
        fast: bool,
        swiglu_kernel: bool,
        cpu_kernel: bool,
    ) -> Result<Tensor> {
        if let Some(lin) = self.fused_gate_up(x, swiglu_kernel) {
            return self.down_swiglu(&lin.forward_with(x, fast)?, fast);
        }
        if let Some(lin) = self.fused_gate_up(x, cpu_kernel) {
            let h = crate::cpu_elementwise::swiglu_cpu(&lin.forward_with(x, fast)?)?;
            return self.down.forward_with(&h, fast);
        }
        let gu = self.gate_up.forward(x, fast)?;
        let h = (gu[0].silu()? * &gu[1])?;
        self.down.forward_with(&h, fast)
    }

    /// The fused gate_up projection when SwiGLU runs as one of Kestrel's kernels (CUDA or CPU)
    /// on its output.
    fn fused_gate_up(&self, x: &Tensor, swiglu_kernel: bool) -> Option<&Linear> {
        match &self.gate_up {
            Proj::Fused { lin, sizes }
                if swiglu_kernel && x.rank() == 2 && sizes.len() == 2 && sizes[0] == sizes[1] =>
            {
                Some(lin)
            }
            _ => None,
        }
    }

    /// The down projection of `swiglu(gu)`: one launch when it takes the `gemv` kernel.
    fn down_swiglu(&self, gu: &Tensor, fast: bool) -> Result<Tensor> {
        if fast && self.down.takes_gemv() && kestrel_kernels::gemv_swiglu_applies(gu, &self.down.w)
        {
            let y = kestrel_kernels::gemv_swiglu(gu, &self.down.w)?;
            return self.down.add_bias(y);
        }
        self.down.forward_with(&kestrel_kernels::swiglu(gu)?, fast)
    }

    /// `(x + res, mlp(norm(x + res)))` for a CUDA step, the add and norm fused into the
    /// gate_up projection where the kernels allow it.
    fn forward_add_norm(
        &self,
        x: &Tensor,
        res: &Tensor,
        norm: &RmsNorm,
        fast: bool,
        swiglu_kernel: bool,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(lin) = self.fused_gate_up(x, swiglu_kernel) {
            let (sum, gu) = lin.forward_add_norm(x, Some(res), norm, fast)?;
            return Ok((sum, self.down_swiglu(&gu, fast)?));
        }
        let (sum, h) = norm.forward_add(x, res)?;
        Ok((sum, self.forward(&h, fast, swiglu_kernel, false)?))
    }
}

/// Shapes of one decoder layer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LayerDims {
    pub hidden: usize,
    pub intermediate: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub eps: f64,
}

/// A Llama decoder layer; the EAGLE head's has no input norm.
#[derive(Debug, Clone)]
pub(crate) struct DecoderLayer {
    input_norm: Option<RmsNorm>,
    attn: Attention,
    post_norm: RmsNorm,
    mlp: Mlp,
}

impl DecoderLayer {
    /// Loads `{prefix}.self_attn.*`, `{prefix}.mlp.*` and the norms.
    pub fn load(
        src: &dyn WeightSource,
        prefix: &str,
        d: LayerDims,
        input_norm: bool,
    ) -> Result<Self> {
        let h = d.hidden;
        let (q_out, kv_out) = (d.n_heads * d.head_dim, d.n_kv * d.head_dim);
        let input_norm = if input_norm {
            Some(RmsNorm::load(
                src,
                &format!("{prefix}.input_layernorm"),
                h,
                d.eps,
            )?)
        } else {
            None
        };
        let a = format!("{prefix}.self_attn");
        let qkv = Proj::load(
            src,
            &[
                (format!("{a}.q_proj"), q_out),
                (format!("{a}.k_proj"), kv_out),
                (format!("{a}.v_proj"), kv_out),
            ],
            h,
        )?;
        let o = Linear::load(src, &format!("{a}.o_proj"), h, q_out, false)?;
        let post_norm =
            RmsNorm::load(src, &format!("{prefix}.post_attention_layernorm"), h, d.eps)?;
        let m = format!("{prefix}.mlp");
        let gate_up = Proj::load(
            src,
            &[
                (format!("{m}.gate_proj"), d.intermediate),
                (format!("{m}.up_proj"), d.intermediate),
            ],
            h,
        )?;
        let down = Linear::load(src, &format!("{m}.down_proj"), h, d.intermediate, false)?;
        Ok(DecoderLayer {
            input_norm,
            attn: Attention {
                qkv,
                o,
                n_heads: d.n_heads,
                n_kv: d.n_kv,
                head_dim: d.head_dim,
            },
            post_norm,
            mlp: Mlp { gate_up, down },
        })
    }

    /// Every weight tensor of the layer (for packing).
    pub fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut out = Vec::new();
        if let Some(n) = &mut self.input_norm {
            out.push(&mut n.w);
        }
        self.attn.qkv.tensors_mut(&mut out);
        self.attn.o.tensors_mut(&mut out);
        out.push(&mut self.post_norm.w);
        self.mlp.gate_up.tensors_mut(&mut out);
        self.mlp.down.tensors_mut(&mut out);
        out
    }

    /// Every projection of the layer (to set how few-row steps run them).
    pub fn linears_mut(&mut self) -> Vec<&mut Linear> {
        let mut out = self.attn.qkv.linears_mut();
        out.push(&mut self.attn.o);
        out.extend(self.mlp.gate_up.linears_mut());
        out.push(&mut self.mlp.down);
        out
    }

    pub fn forward(&self, x: &Tensor, ctx: &AttnCtx) -> Result<Tensor> {
        if ctx.cuda().is_some_and(|k| k.add_rmsnorm) && x.rank() == 2 {
            let (x, delta) = self.forward_deferred(x, None, ctx)?;
            return Ok((x + delta)?);
        }
        let swiglu = ctx.cuda().is_some_and(|k| k.swiglu);
        self.residual(x, ctx.differentiable(), ctx.matvec(), swiglu, |h| {
            self.attn.forward(h, ctx)
        })
    }

    /// One pass of a training-time-test unroll over `x: [B, T, H]` (see
    /// `Attention::forward_unrolled`); also returns the pass's K/V for the passes after it.
    pub fn forward_unrolled(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        prev: &[(Tensor, Tensor)],
    ) -> Result<(Tensor, (Tensor, Tensor))> {
        let mut kv = None;
        let y = self.residual(x, true, false, false, |h| {
            let (out, pass_kv) = self.attn.forward_unrolled(h, cos, sin, mask, prev)?;
            kv = Some(pass_kv);
            Ok(out)
        })?;
        Ok((y, kv.expect("the attention ran")))
    }

    /// The layer around its attention: `x + attn(norm(x))`, then the MLP block.
    fn residual(
        &self,
        x: &Tensor,
        diff: bool,
        matvec: bool,
        swiglu: bool,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let h = match &self.input_norm {
            Some(norm) => norm.forward(x, diff)?,
            None => x.clone(),
        };
        // Inference on the CPU takes one-pass kernels with candle's bits (adds only in
        // half precision, where candle's were slow).
        let cpu = !diff && x.device().is_cpu() && x.rank() == 2;
        let cpu_half = cpu && x.dtype() != DType::F32;
        let add = |a: &Tensor, b: &Tensor| -> Result<Tensor> {
            match cpu_half {
                true => crate::cpu_elementwise::add_half(a, b),
                false => Ok((a + b)?),
            }
        };
        let x = add(x, &attn(&h)?)?;
        let h = self.post_norm.forward(&x, diff)?;
        add(&x, &self.mlp.forward(&h, matvec, swiglu, cpu)?)
    }

    /// The layer with its residual adds fused into the RMSNorms that follow them (Kestrel's
    /// `add_rms_norm` CUDA kernel, inference on `[N, H]` only). The layer's input is
    /// `x + pending` (the previous layer's MLP output not yet added); returns the residual
    /// stream after attention and this layer's MLP output, whose sum is the layer's output,
    /// so the next layer can fuse that add into its input norm.
    pub fn forward_deferred(
        &self,
        x: &Tensor,
        pending: Option<&Tensor>,
        ctx: &AttnCtx,
    ) -> Result<(Tensor, Tensor)> {
        let (x, a) = match (pending, &self.input_norm) {
            (_, Some(norm)) => self.attn.forward_add_norm(x, pending, norm, ctx)?,
            (Some(p), None) => {
                let x = (x + p)?;
                let a = self.attn.forward(&x, ctx)?;
                (x, a)
            }
            (None, None) => (x.clone(), self.attn.forward(x, ctx)?),
        };
        let swiglu = ctx.cuda().is_some_and(|k| k.swiglu);
        self.mlp
            .forward_add_norm(&x, &a, &self.post_norm, ctx.matvec(), swiglu)
    }
}

//! Portable-path attention for a batch of sequences that each bring the same number of new
//! tokens (decode steps, equal-size tree verification): one K/V scatter, one gather and one
//! batched softmax attention per layer instead of a loop over the sequences, so the number
//! of kernel launches on a GPU stays flat as the batch grows.
//!
//! Each sequence's slots are padded to the longest sequence's with its own first slot and
//! masked out, so padding contributes exact zeros to the softmax. The CPU kernels keep their
//! per-sequence loop, which is what makes CPU results batch-invariant bit for bit.

use crate::cache::PagedKvCache;
use crate::error::Result;
use crate::layer::PagedSeq;
use candle_core::{Device, Tensor};

/// A step through Kestrel's paged-attention CUDA kernel: one metadata upload per step, one
/// attention launch (and two KV appends) per layer, whatever the batch's shape.
pub(crate) struct KernelAttn {
    pub meta: kestrel_kernels::PagedAttnMeta,
    /// Write the new K/V with the `kv_append` kernel (else `PagedKvCache::write`).
    pub kv_append: bool,
    /// Attend on the tensor-core kernels (the plan's choice for the model).
    pub tensor_cores: bool,
}

impl KernelAttn {
    /// The step's attention over the pools, through the model's kernel family.
    pub fn attend(
        &self,
        q: &Tensor,
        k_pool: &Tensor,
        v_pool: &Tensor,
    ) -> candle_core::Result<Tensor> {
        if self.tensor_cores {
            kestrel_kernels::paged_attention_tensor_cores(q, k_pool, v_pool, &self.meta)
        } else {
            kestrel_kernels::paged_attention(q, k_pool, v_pool, &self.meta)
        }
    }
}

/// How the batched step writes the new K/V rows.
enum KvWrite {
    /// `[b·n, n_kv, head_dim]` u32: each new token's pool row, broadcast for `scatter_set`.
    Scatter(Tensor),
    /// `[b·n]` u32 pool rows for Kestrel's `kv_append` CUDA kernel.
    Append(Tensor),
}

pub(crate) struct BatchedStep {
    b: usize,
    n: usize,
    lmax: usize,
    write: KvWrite,
    /// `[b·lmax]` u32: every sequence's slots (cached then new), padded.
    gather_rows: Tensor,
    /// `[b, 1, 1, n, lmax]` additive f32.
    mask: Tensor,
}

impl BatchedStep {
    /// `None` unless there are at least two sequences with the same number of new tokens.
    /// `kv_append`: write K/V with Kestrel's CUDA kernel instead of candle's `scatter_set`.
    pub fn new(
        seqs: &[PagedSeq],
        n_kv: usize,
        head_dim: usize,
        device: &Device,
        kv_append: bool,
    ) -> Result<Option<Self>> {
        let (b, n) = (seqs.len(), seqs.first().map_or(0, |s| s.n));
        if b < 2 || seqs.iter().any(|s| s.n != n) {
            return Ok(None);
        }
        let lmax = seqs.iter().map(|s| s.all_rows.len()).max().unwrap_or(0);
        let mut write = Vec::with_capacity(b * n);
        let mut gather = Vec::with_capacity(b * lmax);
        let mut mask = vec![0f32; b * n * lmax];
        for (i, s) in seqs.iter().enumerate() {
            write.extend_from_slice(&s.new_rows);
            let l = s.all_rows.len();
            gather.extend_from_slice(&s.all_rows);
            gather.extend(std::iter::repeat_n(s.all_rows[0], lmax - l));
            for r in 0..n {
                let row = &mut mask[(i * n + r) * lmax..(i * n + r + 1) * lmax];
                if let Some(m) = &s.mask {
                    row[..l].copy_from_slice(&m[r * l..(r + 1) * l]);
                }
                row[l..].fill(f32::MIN);
            }
        }
        let write = if kv_append {
            KvWrite::Append(Tensor::from_vec(write, b * n, device)?)
        } else {
            KvWrite::Scatter(
                Tensor::from_vec(write, (b * n, 1, 1), device)?
                    .broadcast_as((b * n, n_kv, head_dim))?
                    .contiguous()?,
            )
        };
        Ok(Some(BatchedStep {
            b,
            n,
            lmax,
            write,
            gather_rows: Tensor::from_vec(gather, b * lmax, device)?,
            mask: Tensor::from_vec(mask, (b, 1, 1, n, lmax), device)?,
        }))
    }

    /// Writes the step's `k`, `v` (`[b·n, n_kv, d]`, RoPE applied to `k`) into `layer`'s
    /// pools and attends `q` (`[b·n, n_heads, d]`) over each sequence's slots; returns
    /// `[b·n, n_heads·d]`.
    pub fn attend(
        &self,
        cache: &PagedKvCache,
        layer: usize,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let (_, n_kv, d) = k.dims3()?;
        let nh = q.dim(1)?;
        let (kp, vp) = cache.pools(layer);
        match &self.write {
            KvWrite::Scatter(idx) => {
                kp.scatter_set(idx, &k.contiguous()?, 0)?;
                vp.scatter_set(idx, &v.contiguous()?, 0)?;
            }
            KvWrite::Append(slots) => {
                kestrel_kernels::kv_append(kp, k, slots)?;
                kestrel_kernels::kv_append(vp, v, slots)?;
            }
        }
        let ks = kp
            .index_select(&self.gather_rows, 0)?
            .reshape((self.b, self.lmax, n_kv, d))?;
        let vs = vp
            .index_select(&self.gather_rows, 0)?
            .reshape((self.b, self.lmax, n_kv, d))?;
        let q = q.reshape((self.b, self.n, n_kv, nh / n_kv, d))?;
        let out = crate::layer::attend(&q, &ks, &vs, Some(&self.mask), false)?;
        Ok(out.reshape((self.b * self.n, nh * d))?)
    }
}

//! A CPU kernel for attention over the paged KV cache: for each new token and query head,
//! scores against the sequence's slots (read in place from the pools, no gather copy), f32
//! softmax with the additive mask, and the weighted sum of values. Same maths as the portable
//! candle path in `layer.rs`, which CUDA uses; f16/bf16 are widened and accumulated in f32.

use crate::error::Result;
use crate::matvec::WeightElem;
use candle_core::{DType, Device, Tensor, WithDType};
use half::{bf16, f16};

/// Below this many multiply-adds the work runs on the calling thread. Inside a step's team a
/// parallel loop costs a few µs, so a decode step's attention over ~100 slots already gains
/// from it (it was 2^18 under rayon alone, whose loops woke a sleeping worker).
const PAR_MIN_WORK: usize = 1 << 14;

pub(crate) struct AttnShape {
    pub n: usize,
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
}

/// `q: [n, n_heads, head_dim]`; `k_pool`, `v_pool: [slots, n_kv, head_dim]`; `rows[j]` the pool
/// row of the sequence's slot j; `mask: [n, rows.len()]` additive. Returns `[n, n_heads * head_dim]`.
pub(crate) fn attend(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &[u32],
    mask: Option<&[f32]>,
    s: &AttnShape,
) -> Result<Tensor> {
    let out = match q.dtype() {
        DType::F32 => Tensor::from_vec(
            run::<f32>(q, k_pool, v_pool, rows, mask, s)?,
            (s.n, s.n_heads * s.head_dim),
            &Device::Cpu,
        )?,
        DType::F16 => {
            let o = run::<f16>(q, k_pool, v_pool, rows, mask, s)?;
            Tensor::from_vec(
                o.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
                (s.n, s.n_heads * s.head_dim),
                &Device::Cpu,
            )?
        }
        DType::BF16 => {
            let o = run::<bf16>(q, k_pool, v_pool, rows, mask, s)?;
            Tensor::from_vec(
                o.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
                (s.n, s.n_heads * s.head_dim),
                &Device::Cpu,
            )?
        }
        other => {
            return Err(crate::error::invalid(format!(
                "cpu attention: unsupported dtype {other:?}"
            )))
        }
    };
    Ok(out)
}

fn with_slice<T: WithDType, R>(t: &Tensor, f: impl FnOnce(&[T]) -> Result<R>) -> Result<R> {
    crate::cpu_norm::cpu_slice(&t.contiguous()?, f)
}

fn run<T: WithDType + WeightElem>(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &[u32],
    mask: Option<&[f32]>,
    s: &AttnShape,
) -> Result<Vec<f32>> {
    let (n, nh, nkv, d) = (s.n, s.n_heads, s.n_kv, s.head_dim);
    let g = nh / nkv;
    let l = rows.len();
    let simd = simd_applies(d);
    with_slice::<T, _>(q, |q| {
        with_slice::<T, _>(k_pool, |k_pool| {
            with_slice::<T, _>(v_pool, |v_pool| {
                let group = Group {
                    k_pool,
                    v_pool,
                    rows,
                    nkv,
                    d,
                    g,
                    scale: 1.0 / (d as f32).sqrt(),
                };
                let mut out = vec![0f32; n * nh * d];
                // A task is one row's group of g query heads, which share a KV head: each
                // slot's K and V rows are read (and, in half precision, widened) once for the
                // group. Every head still sees its own operations in slot order.
                let task = |idx: usize, o: &mut [f32]| {
                    let (i, kvh) = (idx / nkv, idx % nkv);
                    let t = Task {
                        qg: &q[(i * nh + kvh * g) * d..(i * nh + (kvh + 1) * g) * d],
                        kvh,
                        mask_row: mask.map(|m| &m[i * l..(i + 1) * l]),
                    };
                    #[cfg(target_arch = "x86_64")]
                    if simd {
                        // SAFETY: `simd_applies` checked the features and d's multiple of 8.
                        unsafe { avx2::attend_group(&group, &t, o) };
                        return;
                    }
                    let _ = simd;
                    attend_group(&group, &t, o);
                };
                if n * nh * l * d >= PAR_MIN_WORK {
                    crate::team::for_each_chunk_mut(&mut out, g * d, task);
                } else {
                    out.chunks_mut(g * d)
                        .enumerate()
                        .for_each(|(i, o)| task(i, o));
                }
                Ok(out)
            })
        })
    })
}

/// What every task of one attention shares: the K and V pools, the sequence's pool rows, the
/// KV heads, the head size, the query heads a KV head serves and the score scale.
struct Group<'a, T> {
    k_pool: &'a [T],
    v_pool: &'a [T],
    rows: &'a [u32],
    nkv: usize,
    d: usize,
    g: usize,
    scale: f32,
}

/// One task: a row's `g` query heads `qg` (`[g, d]`), their KV head and the row's mask.
struct Task<'a, T> {
    qg: &'a [T],
    kvh: usize,
    mask_row: Option<&'a [f32]>,
}

impl<T> Group<'_, T> {
    /// Where slot j's row of KV head `kvh` starts in a pool.
    fn base(&self, j: usize, kvh: usize) -> usize {
        (self.rows[j] as usize * self.nkv + kvh) * self.d
    }
}

/// Whether a CPU attention takes [`avx2::attend_group`]: AVX2 with FMA (and F16C) and a head
/// size that is a multiple of 8. It depends on the machine and the model only, never on the
/// step, so a decode step and a verification step attend with the same arithmetic.
fn simd_applies(d: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        d.is_multiple_of(8)
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = d;
        false
    }
}

/// Softmax of each head's `l` scores in `scores` (`[g, l]`) in place, as weights.
fn softmax_rows(scores: &mut [f32], l: usize) {
    for s in scores.chunks_mut(l) {
        let max = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut z = 0f32;
        for sc in s.iter_mut() {
            *sc = (*sc - max).exp();
            z += *sc;
        }
        let inv = 1.0 / z;
        for sc in s.iter_mut() {
            *sc *= inv;
        }
    }
}

/// One task without SIMD, into `o` (`[g, d]`, zeroed).
fn attend_group<T: WeightElem>(grp: &Group<T>, task: &Task<T>, o: &mut [f32]) {
    let (kp, vp, qg, kvh, mask_row) = (grp.k_pool, grp.v_pool, task.qg, task.kvh, task.mask_row);
    let (d, g, l) = (grp.d, grp.g, grp.rows.len());
    let dot = crate::matvec::pick_dot();
    let mut qf = vec![0f32; g * d];
    T::widen(qg, &mut qf);
    let mut scratch = vec![0f32; d];
    // scores[hh · l + j]: head hh's score of slot j, then its softmax weight.
    let mut scores = vec![0f32; g * l];
    for j in 0..l {
        let base = grp.base(j, kvh);
        let krow = slot_row(&kp[base..base + d], &mut scratch);
        let m = mask_row.map_or(0.0, |m| m[j]);
        for (hh, qh) in qf.chunks(d).enumerate() {
            scores[hh * l + j] = dot(qh, krow) * grp.scale + m;
        }
    }
    softmax_rows(&mut scores, l);
    for j in 0..l {
        let base = grp.base(j, kvh);
        let vrow = slot_row(&vp[base..base + d], &mut scratch);
        for (hh, oh) in o.chunks_mut(d).enumerate() {
            let p = scores[hh * l + j];
            for (acc, v) in oh.iter_mut().zip(vrow) {
                *acc += p * v;
            }
        }
    }
}

/// A slot's K or V row in f32: read in place, or widened into `scratch`.
fn slot_row<'a, T: WeightElem>(row: &'a [T], scratch: &'a mut [f32]) -> &'a [f32] {
    match T::as_f32(row) {
        Some(r) => r,
        None => {
            T::widen(row, scratch);
            scratch
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{softmax_rows, Group, Task};
    use crate::matvec::{hsum_lanes, load8, WeightElem};
    use std::arch::x86_64::*;

    /// [`super::attend_group`] in 8-lane registers, K and V rows widened as they load. A
    /// score is one 8-lane accumulator over the head's chunks of 8 in order (`fma`), the
    /// matvec's fixed lane reduction, then `· scale + mask`; an output element adds its
    /// slots' `p · v` in slot order with `fma`. Heads are walked one at a time (their q
    /// and output chunks stay in registers; the group's K/V rows stay in L1 between heads).
    /// Why: a SmolLM2 attention task is ~100 slots × 3 heads × 64, where a dot product
    /// through a function pointer and a scalar-SSE weighted sum cost more than the work.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn attend_group<T: WeightElem>(
        grp: &Group<T>,
        task: &Task<T>,
        o: &mut [f32],
    ) {
        let (kp, vp, qg, kvh, mask_row) =
            (grp.k_pool, grp.v_pool, task.qg, task.kvh, task.mask_row);
        let (d, g, l) = (grp.d, grp.g, grp.rows.len());
        let chunks = d / 8;
        let mut scores = vec![0f32; g * l];
        for hh in 0..g {
            let qh = &qg[hh * d..(hh + 1) * d];
            for j in 0..l {
                let base = grp.base(j, kvh);
                assert!(kp.len() >= base + d);
                let mut acc = _mm256_setzero_ps();
                for c in 0..chunks {
                    // SAFETY: q's head row and the slot's K row hold d = 8·chunks elements.
                    let (qv, kv) = unsafe {
                        (
                            load8(qh.as_ptr().add(8 * c)),
                            load8(kp.as_ptr().add(base + 8 * c)),
                        )
                    };
                    acc = _mm256_fmadd_ps(qv, kv, acc);
                }
                let mut lanes = [0f32; 8];
                // SAFETY: `lanes` holds 8 f32.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
                let m = mask_row.map_or(0.0, |m| m[j]);
                scores[hh * l + j] = hsum_lanes(&lanes) * grp.scale + m;
            }
        }
        softmax_rows(&mut scores, l);
        for (hh, oh) in o.chunks_mut(d).enumerate() {
            for c0 in (0..chunks).step_by(8) {
                // Up to 8 chunks of the head's output in registers over all slots.
                let cn = 8.min(chunks - c0);
                let mut acc = [_mm256_setzero_ps(); 8];
                for j in 0..l {
                    let base = grp.base(j, kvh) + 8 * c0;
                    assert!(vp.len() >= base + 8 * cn);
                    let p = _mm256_set1_ps(scores[hh * l + j]);
                    for (c, a) in acc.iter_mut().enumerate().take(cn) {
                        // SAFETY: the slot's V row holds chunks c0..c0 + cn (asserted).
                        *a =
                            _mm256_fmadd_ps(p, unsafe { load8(vp.as_ptr().add(base + 8 * c)) }, *a);
                    }
                }
                for (c, a) in acc.iter().enumerate().take(cn) {
                    // SAFETY: o's head row holds chunks c0..c0 + cn.
                    unsafe { _mm256_storeu_ps(oh.as_mut_ptr().add(8 * (c0 + c)), *a) };
                }
            }
        }
    }
}

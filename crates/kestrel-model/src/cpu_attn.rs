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
    let scale = 1.0 / (d as f32).sqrt();
    let dot = crate::matvec::pick_dot();
    with_slice::<T, _>(q, |q| {
        with_slice::<T, _>(k_pool, |kp| {
            with_slice::<T, _>(v_pool, |vp| {
                let mut out = vec![0f32; n * nh * d];
                // A task is one row's group of g query heads, which share a KV head: each
                // slot's K and V rows are read (and, in half precision, widened) once for the
                // group. Every head still sees its own operations in slot order.
                let task = |idx: usize, o: &mut [f32]| {
                    let (i, kvh) = (idx / nkv, idx % nkv);
                    let mut qf = vec![0f32; g * d];
                    for (hh, qh) in qf.chunks_mut(d).enumerate() {
                        let h = kvh * g + hh;
                        T::widen(&q[(i * nh + h) * d..(i * nh + h + 1) * d], qh);
                    }
                    let mut scratch = vec![0f32; d];
                    // scores[hh · l + j]: head hh's score of slot j, then its softmax weight.
                    let mut scores = vec![0f32; g * l];
                    for (j, &r) in rows.iter().enumerate() {
                        let base = (r as usize * nkv + kvh) * d;
                        let krow = slot_row(&kp[base..base + d], &mut scratch);
                        let m = mask.map_or(0.0, |m| m[i * l + j]);
                        for (hh, qh) in qf.chunks(d).enumerate() {
                            scores[hh * l + j] = dot(qh, krow) * scale + m;
                        }
                    }
                    let mut inv = vec![0f32; g];
                    for (s, inv) in scores.chunks_mut(l).zip(&mut inv) {
                        let max = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let mut z = 0f32;
                        for sc in s.iter_mut() {
                            *sc = (*sc - max).exp();
                            z += *sc;
                        }
                        *inv = 1.0 / z;
                    }
                    for (j, &r) in rows.iter().enumerate() {
                        let base = (r as usize * nkv + kvh) * d;
                        let vrow = slot_row(&vp[base..base + d], &mut scratch);
                        for (hh, oh) in o.chunks_mut(d).enumerate() {
                            let p = scores[hh * l + j] * inv[hh];
                            for (acc, v) in oh.iter_mut().zip(vrow) {
                                *acc += p * v;
                            }
                        }
                    }
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

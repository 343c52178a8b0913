//! A CPU kernel for attention over the paged KV cache: for each new token and query head,
//! scores against the sequence's slots (read in place from the pools, no gather copy), f32
//! softmax with the additive mask, and the weighted sum of values. Same maths as the portable
//! candle path in `layer.rs`, which CUDA uses; f16/bf16 are widened and accumulated in f32.

use crate::error::Result;
use crate::matvec::WeightElem;
use candle_core::{DType, Device, Storage, Tensor, WithDType};
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
    let t = t.contiguous()?;
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        return Err(crate::error::invalid(
            "cpu attention called on a non-CPU tensor",
        ));
    };
    let all = cpu.as_slice::<T>()?;
    let start = layout.start_offset();
    f(&all[start..start + t.elem_count()])
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
                // A task is one row's group of g query heads, which share a KV head: half
                // precision K and V rows are widened once for the group, not once a head.
                let half = T::as_f32(&[]).is_none();
                let task = |idx: usize, o: &mut [f32]| {
                    let (i, kvh) = (idx / nkv, idx % nkv);
                    let widen_rows = |pool: &[T]| {
                        let mut w = vec![0f32; if half { l * d } else { 0 }];
                        for (j, &r) in rows.iter().enumerate().filter(|_| half) {
                            let base = (r as usize * nkv + kvh) * d;
                            T::widen(&pool[base..base + d], &mut w[j * d..(j + 1) * d]);
                        }
                        w
                    };
                    let (kw, vw) = (widen_rows(kp), widen_rows(vp));
                    let mut qf = vec![0f32; d];
                    let mut scores = Vec::with_capacity(l);
                    for (hh, o) in o.chunks_mut(d).enumerate() {
                        let h = kvh * g + hh;
                        T::widen(&q[(i * nh + h) * d..(i * nh + h + 1) * d], &mut qf);
                        scores.clear();
                        for (j, &r) in rows.iter().enumerate() {
                            let krow = slot_row(kp, &kw, (r as usize * nkv + kvh) * d, j, d);
                            let m = mask.map_or(0.0, |m| m[i * l + j]);
                            scores.push(dot(&qf, krow) * scale + m);
                        }
                        let max = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                        let mut z = 0f32;
                        for sc in scores.iter_mut() {
                            *sc = (*sc - max).exp();
                            z += *sc;
                        }
                        let inv = 1.0 / z;
                        for (j, &r) in rows.iter().enumerate() {
                            let p = scores[j] * inv;
                            let vrow = slot_row(vp, &vw, (r as usize * nkv + kvh) * d, j, d);
                            for (acc, v) in o.iter_mut().zip(vrow) {
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

/// Slot `j`'s row at `base` of a pool: read in place in f32, else from its widened copy.
fn slot_row<'a, T: WeightElem>(
    pool: &'a [T],
    widened: &'a [f32],
    base: usize,
    j: usize,
    d: usize,
) -> &'a [f32] {
    match T::as_f32(&pool[base..base + d]) {
        Some(row) => row,
        None => &widened[j * d..(j + 1) * d],
    }
}

//! A multi-threaded CPU kernel for `x · wᵀ` when `x` has only a few rows (decode, drafts):
//! each weight row is streamed from memory once and dotted with every row of `x`. Weight
//! rows are split over rayon's pool; the dot product is written so that the compiler
//! vectorises it, and an AVX2 copy is picked at run time where the CPU has it (no
//! `RUSTFLAGS` needed). f16/bf16 weights are widened to f32 row by row and accumulated in f32.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, WithDType};
use half::{bf16, f16, slice::HalfFloatSliceExt};
use rayon::prelude::*;

/// Largest number of rows of `x` the kernel is used for; longer prefill chunks go to candle's
/// GEMM.
///
/// Every output element is one `dot(x_i, w_j)` whatever the number of rows, so a row's result
/// does not depend on what else is in the step. That makes greedy speculative decoding
/// bit-identical to plain decoding: a tree verification step (up to a batch of
/// `max_draft_len + 1` rows per sequence) computes each node's logits exactly as a one-token
/// decode step would. The bound therefore covers any decode or verification step
/// (16 sequences × 64 tree tokens); only prompts longer than it take the faster GEMM, and
/// the prompt's forward is the same call in every decoding mode.
pub const MAX_ROWS: usize = 1024;

/// Weight rows per rayon task: enough for long sequential streams, few enough to balance.
fn rows_per_task(n: usize) -> usize {
    n.div_ceil(4 * rayon::current_num_threads()).clamp(16, 256)
}

const LANES: usize = 32;

#[inline(always)]
fn dot_body(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0f32; LANES];
    let mut ca = a.chunks_exact(LANES);
    let mut cb = b.chunks_exact(LANES);
    for (x, y) in (&mut ca).zip(&mut cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut tail = 0f32;
    for (x, y) in ca.remainder().iter().zip(cb.remainder()) {
        tail += x * y;
    }
    // Pairwise reduction of the lanes.
    let mut width = LANES / 2;
    while width > 0 {
        for l in 0..width {
            acc[l] += acc[l + width];
        }
        width /= 2;
    }
    acc[0] + tail
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

fn dot_generic(a: &[f32], b: &[f32]) -> f32 {
    dot_body(a, b)
}

type DotFn = fn(&[f32], &[f32]) -> f32;

/// The fastest dot product this CPU runs.
pub(crate) fn pick_dot() -> DotFn {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU supports the features `dot_avx2` is compiled for.
            return |a, b| unsafe { dot_avx2(a, b) };
        }
    }
    dot_generic
}

/// Weight element types the kernel reads.
pub trait WeightElem: WithDType {
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// True when the row is already f32 and can be used in place.
    fn as_f32(src: &[Self]) -> Option<&[f32]>;
}

impl WeightElem for f32 {
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn as_f32(src: &[f32]) -> Option<&[f32]> {
        Some(src)
    }
}
impl WeightElem for f16 {
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
}
impl WeightElem for bf16 {
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
}

/// `out[i][j] = Σ_t x[i][t] · w[j][t]` for `x: [m, k]` (f32) and `w: [n, k]`; returns `[m, n]`.
pub fn matmul_nt<W: WeightElem>(x: &[f32], w: &[W], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "x has {} elements, not {m}x{k}", x.len());
    assert_eq!(w.len(), n * k, "w has {} elements, not {n}x{k}", w.len());
    let dot = pick_dot();
    let per_task = rows_per_task(n);
    // Column-major result chunks ([n, m]), transposed at the end when m > 1.
    let mut out_t = vec![0f32; n * m];
    out_t
        .par_chunks_mut(per_task * m)
        .enumerate()
        .for_each(|(task, out)| {
            let j0 = task * per_task;
            let rows = out.len() / m;
            let mut buf = Vec::new();
            for r in 0..rows {
                let wrow = &w[(j0 + r) * k..(j0 + r + 1) * k];
                let wrow: &[f32] = match W::as_f32(wrow) {
                    Some(f) => f,
                    None => {
                        buf.resize(k, 0f32);
                        W::widen(wrow, &mut buf);
                        &buf
                    }
                };
                for i in 0..m {
                    out[r * m + i] = dot(&x[i * k..(i + 1) * k], wrow);
                }
            }
        });
    if m == 1 {
        return out_t;
    }
    let mut out = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            out[i * n + j] = out_t[j * m + i];
        }
    }
    out
}

/// The candle op: `x: [m, k]`, `w: [n, k]`, both contiguous and of one dtype (f32, f16 or
/// bf16), CPU only. Results are rounded to the input dtype once, after f32 accumulation.
pub(crate) struct MatMulNt;

fn slice<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(&s[a..b]),
        None => candle_core::bail!("matvec: operand must be contiguous"),
    }
}

impl CustomOp2 for MatMulNt {
    fn name(&self) -> &'static str {
        "kestrel-matvec"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l1.shape().dims2()?;
        let (n, k2) = l2.shape().dims2()?;
        if k != k2 {
            candle_core::bail!("matvec: x is {m}x{k} but w is {n}x{k2}");
        }
        let shape = Shape::from((m, n));
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(w)) => {
                CpuStorage::F32(matmul_nt(slice(x, l1)?, slice(w, l2)?, m, k, n))
            }
            (CpuStorage::F16(x), CpuStorage::F16(w)) => {
                let mut xf = vec![0f32; m * k];
                slice(x, l1)?.convert_to_f32_slice(&mut xf);
                let out = matmul_nt(&xf, slice(w, l2)?, m, k, n);
                CpuStorage::F16(out.iter().map(|&v| f16::from_f32(v)).collect())
            }
            (CpuStorage::BF16(x), CpuStorage::BF16(w)) => {
                let mut xf = vec![0f32; m * k];
                bf16::widen(slice(x, l1)?, &mut xf);
                let out = matmul_nt(&xf, slice(w, l2)?, m, k, n);
                CpuStorage::BF16(out.iter().map(|&v| bf16::from_f32(v)).collect())
            }
            _ => candle_core::bail!(
                "matvec: unsupported dtypes {:?} x {:?}",
                s1.dtype(),
                s2.dtype()
            ),
        };
        Ok((out, shape))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_for_odd_sizes() {
        for &(m, k, n) in &[(1, 1, 1), (1, 37, 5), (3, 100, 33), (8, 64, 17)] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 5.0)
                .collect();
            let w: Vec<f32> = (0..n * k)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 3.0)
                .collect();
            let got = matmul_nt(&x, &w, m, k, n);
            for i in 0..m {
                for j in 0..n {
                    let want: f32 = (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum();
                    assert!(
                        (got[i * n + j] - want).abs() < 1e-4,
                        "{m}x{k}x{n} at {i},{j}"
                    );
                }
            }
            let wh: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let got_h = matmul_nt(&x, &wh, m, k, n);
            for (a, b) in got.iter().zip(&got_h) {
                assert!((a - b).abs() < 0.05 * (1.0 + a.abs()));
            }
        }
    }
}

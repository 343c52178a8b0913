//! `x · wᵀ` through candle's CPU GEMM with every row's result independent of how many rows
//! `x` has, so that a prompt prefilled in one piece and a prompt whose first blocks came from
//! the prefix cache (only the rest prefilled, in a batch of other sizes) get bit-identical
//! K/V and logits.
//!
//! candle's CPU matmul is the `gemm` crate (0.19). Its blocked microkernel path accumulates
//! each output element over `k` in the same order whatever `m` is (its `kc` depends on `k`
//! and the cache sizes only; `m` only changes how rows are tiled and threaded), but it leaves
//! that path for small problems: `m == 1` takes a matrix-vector kernel, `m · n ≤ 256` a
//! "horizontal" kernel that reduces along `k` in SIMD lanes, and for `m, n ≤ 64` it picks
//! `kc = min(k, 512)` instead of its cache-derived `kc`. Each of those sums in another order,
//! so a row's bits depend on `m` (measured: with f32, a lone row differs from the same row
//! inside a 200-row product for every shape tried, from 32×64 to 2048×11264; with `m ≥ 2` and
//! `m · n > 256` no row ever differed). Padding `x` with zero rows up to [`min_rows`] keeps
//! every product on the blocked path; the padding rows are dropped after the product.

use crate::error::Result;
use candle_core::Tensor;

/// The fewest rows for which gemm 0.19 takes its blocked path for an `n × k` weight.
pub(crate) fn min_rows(n: usize, k: usize) -> usize {
    // Above 64 rows the blocked path is chosen whatever n is; with n ≤ 64 and k > 512 the
    // two kc choices differ, so such products always run with 65 rows or more.
    if n <= 64 && k > 512 {
        return 65;
    }
    (256 / n.max(1) + 1).max(2)
}

/// `x: [m, k]`, `w: [n, k]` → `[m, n]`; on CPU, rows are bit-identical for any `m`.
pub(crate) fn matmul_nt(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dim(0)?;
    let want = min_rows(n, k);
    if !x.device().is_cpu() || m >= want {
        return Ok(x.matmul(&w.t()?)?);
    }
    let pad = Tensor::zeros((want - m, k), x.dtype(), x.device())?;
    let padded = Tensor::cat(&[x, &pad], 0)?;
    Ok(padded.matmul(&w.t()?)?.narrow(0, 0, m)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn bits(t: &Tensor) -> Vec<Vec<u32>> {
        t.to_dtype(DType::F32)
            .unwrap()
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|r| r.iter().map(|v| v.to_bits()).collect())
            .collect()
    }

    /// Every slice of rows gives exactly the rows of the whole product, for shapes that hit
    /// each of gemm's small-problem kernels without the padding.
    #[test]
    fn rows_do_not_depend_on_the_row_count() {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (k, n) in [
                (32, 64),
                (32, 32),
                (16, 32),
                (64, 128),
                (48, 8),
                (600, 32),
                (96, 384),
            ] {
                let w = Tensor::randn(0f32, 1.0, (n, k), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let x = Tensor::randn(0f32, 1.0, (150, k), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                let full = bits(&matmul_nt(&x, &w).unwrap());
                for m in [1, 2, 3, 5, 8, 9, 17, 64, 65, 100] {
                    for start in [0, 7, 41] {
                        let part = x.narrow(0, start, m).unwrap();
                        let got = bits(&matmul_nt(&part, &w).unwrap());
                        assert_eq!(
                            got[..],
                            full[start..start + m],
                            "{dtype:?} k {k} n {n}: rows {start}..{} alone differ",
                            start + m
                        );
                    }
                }
            }
        }
    }
}

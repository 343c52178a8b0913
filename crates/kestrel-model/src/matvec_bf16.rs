//! bf16 rows against bf16 weights on CPUs with AVX512-BF16 (`vdpbf16ps`: Zen 4, Sapphire
//! Rapids and later): every step of a bf16 engine whose projections [`crate::matvec`] would
//! otherwise widen to f32.
//!
//! Why: widened, each extra row of a step costs one f32 FMA per 8 weights, and a step of a few
//! rows is bound by FMAs on 2 cores (the Zen 4 machine does ~20 G multiply-adds/s a core that
//! way); `vdpbf16ps` takes 32 products per instruction straight from the bf16 bytes, ~45 G/s
//! a core there. A bf16 engine's rows are bf16 already, so nothing is rounded on the way in.
//! The weights are read as the widened kernel reads them, 16 bytes of each of a tile's 4
//! rows at a time: one register holds chunk c (8 elements) of all 4 rows, and the input
//! row's chunk c sits in all four quarters. (64-byte loads of each row, 16 lanes an output,
//! streamed a one-row step 8-12% slower than the widened kernel: sessions 28-29.)
//! Measured on 2 Zen 4 cores against the widened kernel in one binary
//! (`KESTREL_CPU_DPBF16=0|1 KESTREL_BENCH_DTYPE=bf16 cargo bench --bench decode`, alternated
//! three times, session 29): decode unchanged (8.3-9.4 ms both), 3 verified rows 12.9-14.2 →
//! 12.4-13.0 ms, 8 rows 22.3-25.4 → 21.0-21.3, a 128-token prompt 307-312 → 277-284 ms;
//! `cargo bench --bench matvec` (a 230 MB matrix, two chains): 1 row as fast as the widened
//! kernel (~32 GiB/s in that run), 3 rows 25.4 against 21.1 GiB/s, 8 rows 15.8 against 12.7;
//! the decode bench's 8 rows another 7-10% shorter than with one chain (20.2-22.0 against
//! 22.7-23.7 ms), decode and 3 rows within noise.
//!
//! The arithmetic, the same for every row count, so a row's bits never depend on the step
//! (the property greedy speculation rests on): an output keeps two chains of 4 f32 lanes, the
//! even chunks of 8 elements in one and the odd ones in the other; for each chunk, lane q adds
//! `x[2q+1]·w[2q+1]` then `x[2q]·w[2q]` (each product exact in f32, each addition rounded:
//! what `vdpbf16ps` does, checked bit for bit against [`reference`] in the tests); then the
//! chains are added lane by lane, `(l0 + l2) + (l1 + l3)`, and the `k mod 8` tail added in
//! order. (Two chains: with one, a step of a few rows waited on each accumulator's
//! `vdpbf16ps` latency, 3 rows no faster than the widened kernel.)
//! `vdpbf16ps` treats denormal inputs and results as zero, so results differ from the widened
//! path's, as the portable path's already do from the AVX2 path's: each machine is
//! consistent with itself.

use crate::matvec::by_weight_tiles;
use half::bf16;

/// Elements of each weight row a `vdpbf16ps` takes: 4 lanes of two.
const CHUNK: usize = 8;
/// Weight rows a register holds (its four 128-bit quarters), and input rows sharing each
/// weight register (one accumulator each).
const TILE_N: usize = 4;
const TILE_M: usize = 8;

/// Whether this CPU takes [`matmul_nt`]. `KESTREL_CPU_DPBF16=0` keeps the widened path, to
/// measure the choice.
pub(crate) fn available() -> bool {
    static AVAILABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let allowed = std::env::var("KESTREL_CPU_DPBF16").as_deref() != Ok("0");
        #[cfg(target_arch = "x86_64")]
        {
            allowed && is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = allowed;
            false
        }
    })
}

/// `x [m, k] · w [n, k]ᵀ` → `[m, n]` in f32, by the arithmetic above. Check [`available`]
/// first (it panics otherwise).
pub(crate) fn matmul_nt(x: &[bf16], w: &[bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(available(), "matvec_bf16 needs AVX512-BF16");
    assert_eq!(x.len(), m * k, "x has {} elements, not {m}x{k}", x.len());
    assert_eq!(w.len(), n * k, "w has {} elements, not {n}x{k}", w.len());
    by_weight_tiles(m, n, TILE_N, |j, nj, out| {
        let wtile = &w[j * k..(j + nj) * k];
        for ib in (0..m).step_by(TILE_M) {
            let mi = TILE_M.min(m - ib);
            let mut res = [[0f32; TILE_N]; TILE_M];
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked the features `tile` is compiled for.
            unsafe {
                avx512::tile(
                    &x[ib * k..(ib + mi) * k],
                    wtile,
                    k,
                    (mi, nj),
                    ib == 0,
                    &mut res,
                )
            };
            out.put(ib, &res[..mi], nj);
        }
    })
}

/// The `k mod 8` tail of an output, added in order to its lanes' sum.
fn add_tail(sum: f32, x: &[bf16], w: &[bf16]) -> f32 {
    let mut s = sum;
    for t in x.len() / CHUNK * CHUNK..x.len() {
        s += x[t].to_f32() * w[t].to_f32();
    }
    s
}

/// One output by the arithmetic above, without SIMD (denormals aside): what the kernel is
/// tested against.
#[cfg(test)]
fn reference(x: &[bf16], w: &[bf16]) -> f32 {
    let mut chains = [[0f32; 4]; 2];
    for c in 0..x.len() / CHUNK {
        for (q, lane) in chains[c % 2].iter_mut().enumerate() {
            let (o, e) = (c * CHUNK + 2 * q + 1, c * CHUNK + 2 * q);
            *lane += x[o].to_f32() * w[o].to_f32();
            *lane += x[e].to_f32() * w[e].to_f32();
        }
    }
    let l: [f32; 4] = std::array::from_fn(|q| chains[0][q] + chains[1][q]);
    add_tail((l[0] + l[2]) + (l[1] + l[3]), x, w)
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{add_tail, CHUNK, TILE_M, TILE_N};
    use half::bf16;
    use std::arch::x86_64::*;

    /// `mi` rows of `x` against `nj` weight rows; `prefetch`: the first pass over these
    /// weight rows, which asks for the lines ahead of them (later passes find them in cache).
    #[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
    pub(super) unsafe fn tile(
        x: &[bf16],
        w: &[bf16],
        k: usize,
        (mi, nj): (usize, usize),
        prefetch: bool,
        out: &mut [[f32; TILE_N]; TILE_M],
    ) {
        assert!(mi <= TILE_M && nj <= TILE_N && x.len() >= mi * k && w.len() >= nj * k);
        macro_rules! rows {
            ($nj:literal) => {
                match mi {
                    1 => body::<1, $nj>(x, w, k, prefetch, out),
                    2 => body::<2, $nj>(x, w, k, prefetch, out),
                    3 => body::<3, $nj>(x, w, k, prefetch, out),
                    4 => body::<4, $nj>(x, w, k, prefetch, out),
                    5 => body::<5, $nj>(x, w, k, prefetch, out),
                    6 => body::<6, $nj>(x, w, k, prefetch, out),
                    7 => body::<7, $nj>(x, w, k, prefetch, out),
                    _ => body::<8, $nj>(x, w, k, prefetch, out),
                }
            };
        }
        match nj {
            4 => rows!(4),
            3 => rows!(3),
            2 => rows!(2),
            _ => rows!(1),
        }
    }

    /// Chunk `c` of weight rows `0..NJ` (row length `k`) in the quarters of one register,
    /// zeros in the quarters past `NJ`.
    #[inline(always)]
    unsafe fn weight_quarters<const NJ: usize>(w: *const bf16, k: usize, c: usize) -> __m512i {
        // SAFETY (all loads): the caller vouches for chunk c of rows 0..NJ.
        unsafe {
            let at = |j: usize| _mm_loadu_si128(w.add(j * k + c * CHUNK).cast());
            let mut v = _mm512_castsi128_si512(at(0));
            if NJ < 4 {
                v = _mm512_maskz_mov_epi32(0x000f, v);
            }
            if NJ > 1 {
                v = _mm512_inserti32x4::<1>(v, at(1));
            }
            if NJ > 2 {
                v = _mm512_inserti32x4::<2>(v, at(2));
            }
            if NJ > 3 {
                v = _mm512_inserti32x4::<3>(v, at(3));
            }
            v
        }
    }

    #[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
    unsafe fn body<const MI: usize, const NJ: usize>(
        x: &[bf16],
        w: &[bf16],
        k: usize,
        prefetch: bool,
        out: &mut [[f32; TILE_N]; TILE_M],
    ) {
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let per_chunk = NJ * CHUNK * std::mem::size_of::<bf16>();
        // Two chains an input row: even chunks into acc[i][0], odd ones into acc[i][1].
        let mut acc = [[_mm512_setzero_ps(); 2]; MI];
        let chunks = k / CHUNK;
        let step = |c: usize, h: usize, acc: &mut [[__m512; 2]; MI]| {
            if prefetch {
                crate::matvec::prefetch_ahead(wp.cast(), c * per_chunk, (c + 1) * per_chunk);
            }
            // SAFETY: rows 0..NJ of w hold k ≥ 8c + 8 elements (asserted by `tile`).
            let wv = as_bf16_pairs(unsafe { weight_quarters::<NJ>(wp, k, c) });
            for (i, a) in acc.iter_mut().enumerate() {
                // SAFETY: row i of x has k ≥ 8c + 8 elements.
                let xq = unsafe { _mm_loadu_si128(xp.add(i * k + c * CHUNK).cast()) };
                a[h] = _mm512_dpbf16_ps(a[h], as_bf16_pairs(_mm512_broadcast_i32x4(xq)), wv);
            }
        };
        for c in (0..chunks / 2 * 2).step_by(2) {
            step(c, 0, &mut acc);
            step(c + 1, 1, &mut acc);
        }
        if chunks % 2 == 1 {
            step(chunks - 1, 0, &mut acc);
        }
        for (i, &[a0, a1]) in acc.iter().enumerate() {
            let mut lanes = [0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), _mm512_add_ps(a0, a1));
            for j in 0..NJ {
                let l = &lanes[4 * j..4 * j + 4];
                out[i][j] = add_tail(
                    (l[0] + l[2]) + (l[1] + l[3]),
                    &x[i * k..(i + 1) * k],
                    &w[j * k..(j + 1) * k],
                );
            }
        }
    }

    /// 32 bf16 held as integers, as the pairs `vdpbf16ps` takes.
    #[inline(always)]
    fn as_bf16_pairs(v: __m512i) -> __m512bh {
        // SAFETY: both are 64 bytes of plain data; every bit pattern is a valid bf16 vector.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bf16 operands with varied magnitudes and signs, none denormal.
    fn operands(m: usize, k: usize, n: usize) -> (Vec<bf16>, Vec<bf16>) {
        let x = (0..m * k)
            .map(|i| bf16::from_f32(((i * 31 % 97) as f32 - 48.0) / 17.0))
            .collect();
        let w = (0..n * k)
            .map(|i| bf16::from_f32(((i * 13 % 89) as f32 - 44.0) / 23.0 * 1e-2))
            .collect();
        (x, w)
    }

    /// The kernel computes every output exactly as [`reference`] does, for tails, tiles past
    /// their edges and several tiles of rows.
    #[test]
    fn outputs_are_the_reference_arithmetic_bit_for_bit() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        for &(m, k, n) in &[
            (1, 576, 37),
            (3, 1536, 9),
            (9, 100, 13),
            (5, 31, 5),
            (2, 64, 130),
        ] {
            let (x, w) = operands(m, k, n);
            let got = matmul_nt(&x, &w, m, k, n);
            for i in 0..m {
                for j in 0..n {
                    let want = reference(&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                    assert_eq!(
                        got[i * n + j].to_bits(),
                        want.to_bits(),
                        "{m}x{k}x{n} at ({i}, {j}): {} vs {want}",
                        got[i * n + j]
                    );
                }
            }
        }
    }

    /// The property greedy speculation rests on: a row's bits alone equal its bits among
    /// other rows, at any position in the step.
    #[test]
    fn rows_are_bit_identical_to_single_row_calls() {
        if !available() {
            eprintln!("skipped: this CPU has no AVX512-BF16");
            return;
        }
        for &(m, k, n) in &[(9, 576, 37), (6, 100, 9), (3, 7, 5), (17, 64, 130)] {
            let (x, w) = operands(m, k, n);
            crate::matvec::assert_rows_independent(&x, (m, k, n), |x, m| matmul_nt(x, &w, m, k, n));
        }
    }

    /// The reference is a dot product: close to the f64 sum.
    #[test]
    fn the_reference_is_a_dot_product() {
        let (x, w) = operands(1, 100, 1);
        let exact: f64 = x.iter().zip(&w).map(|(a, b)| a.to_f64() * b.to_f64()).sum();
        let got = reference(&x, &w) as f64;
        assert!(
            (got - exact).abs() < 1e-5 * (1.0 + exact.abs()),
            "{got} vs {exact}"
        );
    }
}

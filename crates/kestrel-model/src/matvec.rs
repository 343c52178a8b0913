//! A multi-threaded CPU kernel for `x · wᵀ` when `x` has only a few rows (decode, drafts):
//! each weight row is streamed from memory once and dotted with every row of `x`. Weight
//! rows are split over the step's team (`team.rs`) or rayon's pool; the dot product is
//! written so that the compiler vectorises it, and an AVX2 copy is picked at run time where
//! the CPU has it (no `RUSTFLAGS` needed), with rows taken in pairs on AVX-512 (the same
//! arithmetic, two rows a register) and the weights prefetched ahead of the stream.
//! f16/bf16 weights are widened to f32 (exactly) in registers as they load, and accumulated
//! in f32. bf16 rows against bf16 weights take `matvec_bf16.rs` instead on CPUs with
//! AVX512-BF16.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, WithDType};
use half::{bf16, f16, slice::HalfFloatSliceExt};

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

/// Weight rows per task: enough for long sequential streams, few enough to balance.
pub(crate) fn rows_per_task(n: usize) -> usize {
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

/// How a weight type's elements become f32 lanes in the x86 kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lanes {
    F32,
    F16,
    Bf16,
}

/// Weight element types the kernel reads.
pub trait WeightElem: WithDType {
    /// How the x86 kernels load eight of them.
    const LANES: Lanes;
    /// Widens `src` into `dst` (same length).
    fn widen(src: &[Self], dst: &mut [f32]);
    /// True when the row is already f32 and can be used in place.
    fn as_f32(src: &[Self]) -> Option<&[f32]>;
    /// One element as f32 (exact for f16 and bf16).
    fn widen_one(self) -> f32;
}

impl WeightElem for f32 {
    const LANES: Lanes = Lanes::F32;
    fn widen_one(self) -> f32 {
        self
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src)
    }
    fn as_f32(src: &[f32]) -> Option<&[f32]> {
        Some(src)
    }
}
impl WeightElem for f16 {
    const LANES: Lanes = Lanes::F16;
    fn widen_one(self) -> f32 {
        self.to_f32()
    }
    fn widen(src: &[f16], dst: &mut [f32]) {
        src.convert_to_f32_slice(dst)
    }
    fn as_f32(_: &[f16]) -> Option<&[f32]> {
        None
    }
}
impl WeightElem for bf16 {
    const LANES: Lanes = Lanes::Bf16;
    fn widen_one(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    fn widen(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
    fn as_f32(_: &[bf16]) -> Option<&[f32]> {
        None
    }
}

/// Rows of `x` and of `w` one register tile covers: 2 × 4 outputs keep 8 accumulators, 4
/// weight vectors and one input vector in the 16 AVX2 registers, so each weight row loaded
/// from memory feeds two rows of `x` and each `x` vector feeds four weight rows.
const TILE_M: usize = 2;
pub(crate) const TILE_N: usize = 4;
/// f32 lanes of one accumulator (one AVX2 register).
const VEC: usize = 8;

/// `out[i][j] = Σ_t x[i][t] · w[j][t]` for `x: [m, k]` (f32) and `w: [n, k]`; returns `[m, n]`.
///
/// Batch invariance: every output element is computed by the same sequence of operations
/// whatever `m`, `n` or the tile it falls in: one 8-lane accumulator, `acc = fma(x, w, acc)`
/// over the 8-wide chunks of `k` in order, a fixed lane reduction ([`hsum_lanes`]), then the
/// `k % 8` tail added in order. Tiling only changes which loads are shared, never the
/// arithmetic of an element. f16/bf16 weights are widened to f32 (exactly) as they are
/// loaded, so they stream at half f32's bytes.
pub fn matmul_nt<W: WeightElem>(x: &[f32], w: &[W], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert_eq!(x.len(), m * k, "x has {} elements, not {m}x{k}", x.len());
    assert_eq!(w.len(), n * k, "w has {} elements, not {n}x{k}", w.len());
    let tile = pick_tile::<W>();
    // Rows in pairs on AVX-512; an odd last row rides along in 8-lane registers.
    let pairs = pick_pairs::<W>().filter(|_| m >= 2);
    let paired = pairs.map(|_| interleave(x, m, k));
    let n_pairs = m / 2;
    by_weight_tiles(m, n, TILE_N, |j, nj, out| {
        let wtile = &w[j * k..(j + nj) * k];
        if let (Some(pair), Some(xi)) = (pairs, &paired) {
            // The odd row joins the last pass if it has room, else takes one alone.
            let passes = if m % 2 == 1 && n_pairs.is_multiple_of(PAIRS_MAX) {
                n_pairs / PAIRS_MAX + 1
            } else {
                n_pairs.div_ceil(PAIRS_MAX)
            };
            for pass in 0..passes {
                let p0 = pass * PAIRS_MAX;
                let np = PAIRS_MAX.min(n_pairs - p0);
                let odd = m % 2 == 1 && pass + 1 == passes;
                let rows = 2 * np + usize::from(odd);
                let mut res = [[0f32; TILE_N]; 2 * PAIRS_MAX];
                if np == 0 {
                    let row = &x[(m - 1) * k..m * k];
                    let mut one = [[0f32; TILE_N]; TILE_M];
                    tile(row, wtile, k, 1, nj, &mut one);
                    res[0] = one[0];
                } else {
                    pair(xi, x, wtile, k, (p0, np, odd), nj, &mut res);
                }
                out.put(2 * p0, &res[..rows], nj);
            }
            return;
        }
        for ib in (0..m).step_by(TILE_M) {
            let mi = TILE_M.min(m - ib);
            let mut res = [[0f32; TILE_N]; TILE_M];
            tile(&x[ib * k..(ib + mi) * k], wtile, k, mi, nj, &mut res);
            out.put(ib, &res[..mi], nj);
        }
    })
}

/// The row-major `[m, n]` result a step's tasks write into, each into its own columns.
#[derive(Clone, Copy)]
struct SharedOut {
    base: *mut f32,
    m: usize,
    n: usize,
}
// SAFETY: tasks write through it only into their own columns (`by_weight_tiles`), while the
// buffer is borrowed by the loop that runs them.
unsafe impl Send for SharedOut {}
unsafe impl Sync for SharedOut {}

/// Where a tile of up to `TILE_N` weight rows writes its results: columns `col0..col0 + nj`
/// of the `[m, n]` result, which no other tile writes.
pub(crate) struct TileOut {
    out: SharedOut,
    col0: usize,
    width: usize,
}

impl TileOut {
    /// `res[r][j]` is row `i0 + r`'s product with the tile's weight row `j < nj`.
    #[inline]
    pub(crate) fn put(&mut self, i0: usize, res: &[[f32; TILE_N]], nj: usize) {
        assert!(nj <= self.width && i0 + res.len() <= self.out.m);
        for (r, row) in res.iter().enumerate() {
            for (j, &v) in row.iter().enumerate().take(nj) {
                // SAFETY: row i0 + r < m and column col0 + j < col0 + width ≤ n (asserted
                // above and by construction), a column only this tile writes.
                unsafe {
                    *self.out.base.add((i0 + r) * self.out.n + self.col0 + j) = v;
                }
            }
        }
    }
}

/// The `[m, n]` result of `tile(j, nj, out)` over tiles of `tile_n` weight rows (`nj` of
/// them from row `j`; fewer at the end of a task), split over the step's team in tasks of
/// [`rows_per_task`] weight rows. Each tile writes its own columns of the row-major result
/// in place (a column-major result transposed afterwards cost a verification step of two
/// rows ~0.2 ms on one thread while the other waited).
pub(crate) fn by_weight_tiles(
    m: usize,
    n: usize,
    tile_n: usize,
    tile: impl Fn(usize, usize, &mut TileOut) + Sync,
) -> Vec<f32> {
    let per_task = rows_per_task(n).next_multiple_of(tile_n);
    let mut result = vec![0f32; m * n];
    let out = SharedOut {
        base: result.as_mut_ptr(),
        m,
        n,
    };
    crate::team::for_each_task(n.div_ceil(per_task), |task| {
        let j0 = task * per_task;
        let rows = per_task.min(n - j0);
        for jb in (0..rows).step_by(tile_n) {
            let width = tile_n.min(rows - jb);
            tile(
                j0 + jb,
                width,
                &mut TileOut {
                    out,
                    col0: j0 + jb,
                    width,
                },
            );
        }
    });
    result
}

/// `x · wᵀ` for bf16 rows `x: [m, k]` and weights `w: [n, k]`, in f32: through
/// `vdpbf16ps` on CPUs with AVX512-BF16 (`matvec_bf16.rs`), else widened into
/// [`matmul_nt`]. A bf16 engine's every step takes this, so the choice depends on the machine
/// only.
pub fn matmul_nt_bf16(x: &[bf16], w: &[bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    if crate::matvec_bf16::available() {
        return crate::matvec_bf16::matmul_nt(x, w, m, k, n);
    }
    let mut xf = vec![0f32; m * k];
    bf16::widen(x, &mut xf);
    matmul_nt(&xf, w, m, k, n)
}

/// `[n, m]` (column-major results) → `[m, n]`, in blocks of 16 × 16 so that a long prompt's
/// rows are not walked one column at a time.
pub(crate) fn transpose(out_t: Vec<f32>, m: usize, n: usize) -> Vec<f32> {
    if m == 1 {
        return out_t;
    }
    const B: usize = 16;
    let mut out = vec![0f32; m * n];
    for j0 in (0..n).step_by(B) {
        for i0 in (0..m).step_by(B) {
            for j in j0..(j0 + B).min(n) {
                for i in i0..(i0 + B).min(m) {
                    out[i * n + j] = out_t[j * m + i];
                }
            }
        }
    }
    out
}

/// Computes the `mi × nj` outputs of one tile: `x` holds `mi` rows and `w` holds `nj` rows,
/// each `k` long.
type TileFn<W> = fn(&[f32], &[W], usize, usize, usize, &mut [[f32; TILE_N]; TILE_M]);

/// Whether this CPU runs the x86 kernels: AVX2 with FMA, and F16C for f16 weights.
#[cfg(target_arch = "x86_64")]
fn has_avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

fn pick_tile<W: WeightElem>() -> TileFn<W> {
    #[cfg(target_arch = "x86_64")]
    {
        if has_avx2() {
            // SAFETY: the CPU supports the features `avx2::tile` is compiled for.
            return |x, w, k, mi, nj, out| unsafe { avx2::tile(x, w, k, mi, nj, out) };
        }
    }
    portable_tile::<W>
}

/// Most pairs of rows of `x` one [`PairFn`] call takes (8 rows: 16 of AVX-512's 32 registers
/// hold their accumulators for 4 weight rows).
const PAIRS_MAX: usize = 4;

/// Computes pairs `p0..p0 + np` (`np` ≥ 1) of rows of `x` against `nj` weight rows on
/// AVX-512, and with `odd` also `x`'s last row (`2·(p0 + np)`, unpaired): `xi` is
/// [`interleave`]'s copy of `x` (the plain `x` gives the odd row and the `k % 8` tails),
/// results in `out[2·(p - p0) + r][j]` and the odd row's in `out[2·np][j]`.
///
/// Each 512-bit register holds one 8-lane accumulator for each row of a pair, and the odd
/// row has one 256-bit accumulator, so every output is computed by exactly the AVX2 tile's
/// operations (one `fma` a chunk of 8, the same lane reduction and tail): a row's bits do not
/// depend on whether it was paired (a one-row step takes the AVX2 tile). Why: once a weight
/// tile is in L1, a row's products are bound by the FMA latency of its 4 accumulator chains,
/// ~4 ms a row on a SmolLM2 step on the 2-core CI machine, which one pass with up to 9 rows
/// (20 chains, two rows a register) cuts. The odd row used to be paired with zeros, whose
/// products cost as much as a row's: a 3-row step is compute-bound on that machine.
type PairFn<W> = fn(
    &[f32],
    &[f32],
    &[W],
    usize,
    (usize, usize, bool),
    usize,
    &mut [[f32; TILE_N]; 2 * PAIRS_MAX],
);

fn pick_pairs<W: WeightElem>() -> Option<PairFn<W>> {
    #[cfg(target_arch = "x86_64")]
    {
        // Unpaired rows take the AVX2 tile, whose arithmetic the pairs repeat.
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512dq") && has_avx2()
        {
            // SAFETY: the CPU supports the features `avx512::pairs` is compiled for.
            return Some(|xi, x, w, k, ps, nj, out| unsafe {
                avx512::pairs(xi, x, w, k, ps, nj, out)
            });
        }
    }
    None
}

/// `x`'s rows in pairs, chunk by chunk of 8: pair p, chunk c is `x[2p][8c..8c + 8]` then
/// `x[2p + 1][8c..8c + 8]`, 16 contiguous floats (one 512-bit load). An odd last row and the
/// `k % 8` tails are left out.
fn interleave(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let chunks = k / VEC;
    let mut out = Vec::with_capacity(m / 2 * chunks * 2 * VEC);
    for p in 0..m / 2 {
        let a = &x[2 * p * k..(2 * p + 1) * k];
        let b = &x[(2 * p + 1) * k..(2 * p + 2) * k];
        for c in 0..chunks {
            out.extend_from_slice(&a[c * VEC..(c + 1) * VEC]);
            out.extend_from_slice(&b[c * VEC..(c + 1) * VEC]);
        }
    }
    out
}

/// The same arithmetic as the AVX2 tile without SIMD registers (`a * b + c` rounds twice
/// where FMA rounds once, so results differ from the AVX2 path, but are just as
/// batch-invariant on the machines that take this path).
fn portable_tile<W: WeightElem>(
    x: &[f32],
    w: &[W],
    k: usize,
    mi: usize,
    nj: usize,
    out: &mut [[f32; TILE_N]; TILE_M],
) {
    let body = k / VEC * VEC;
    for i in 0..mi {
        for j in 0..nj {
            let (xr, wr) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
            let mut acc = [0f32; VEC];
            for (xc, wc) in xr[..body]
                .chunks_exact(VEC)
                .zip(wr[..body].chunks_exact(VEC))
            {
                for l in 0..VEC {
                    acc[l] += xc[l] * wc[l].widen_one();
                }
            }
            let mut s = hsum_lanes(&acc);
            for t in body..k {
                s += xr[t] * wr[t].widen_one();
            }
            out[i][j] = s;
        }
    }
}

/// The fixed lane reduction every tile path uses: pairs 4 apart, then 2 apart, then 1 apart.
#[inline(always)]
pub(crate) fn hsum_lanes(a: &[f32; VEC]) -> f32 {
    let b = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
    let c = [b[0] + b[2], b[1] + b[3]];
    c[0] + c[1]
}

/// Bytes ahead of the weights being read that the kernels ask the caches for.
const PREFETCH_BYTES: usize = 9 << 10;

/// Asks for the cache lines of bytes `from..to` of a weight tile (at `tile`: the tile's rows,
/// contiguous) `PREFETCH_BYTES` ahead, as if the tile were read in address order: a kernel
/// that reads chunk `c` of each of its rows side by side passes chunk `c`'s share of the
/// tile's bytes, so over the tile it walks the bytes after it line by line, one stream.
/// Why: the hardware prefetchers do not follow a tile's rows read side by side as one
/// stream; on the 2-core Zen 4 machine a 1-row bf16 matvec streamed 18.5-19 GB/s with a line
/// ahead in each of its 4 rows and ~31 GB/s (its read bandwidth then) with this (session 29,
/// alternated in one run; `cargo bench -p kestrel-model --bench matvec` measures the kernels
/// now). The addresses may lie past the weights: a prefetch never faults.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_ahead(tile: *const u8, from: usize, to: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = tile.wrapping_add(PREFETCH_BYTES);
    let mut at = from.next_multiple_of(64);
    while at < to {
        // SAFETY: prefetching is a hint; it reads nothing and never faults.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(at).cast()) };
        at += 64;
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) use avx2::load8;

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{hsum_lanes, Lanes, WeightElem, TILE_M, TILE_N, VEC};
    use std::arch::x86_64::*;

    /// Dispatches a tile of `mi × nj` (at most `TILE_M × TILE_N`) to a fully unrolled body.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile<W: WeightElem>(
        x: &[f32],
        w: &[W],
        k: usize,
        mi: usize,
        nj: usize,
        out: &mut [[f32; TILE_N]; TILE_M],
    ) {
        match (mi, nj) {
            (2, 4) => body::<W, 2, 4>(x, w, k, out),
            (2, 3) => body::<W, 2, 3>(x, w, k, out),
            (2, 2) => body::<W, 2, 2>(x, w, k, out),
            (2, 1) => body::<W, 2, 1>(x, w, k, out),
            (1, 4) => body::<W, 1, 4>(x, w, k, out),
            (1, 3) => body::<W, 1, 3>(x, w, k, out),
            (1, 2) => body::<W, 1, 2>(x, w, k, out),
            (1, 1) => body::<W, 1, 1>(x, w, k, out),
            _ => unreachable!("tile {mi}x{nj} exceeds {TILE_M}x{TILE_N}"),
        }
    }

    /// 8 weights from `p` as f32 lanes (f16 and bf16 widen exactly).
    #[inline(always)]
    pub(crate) unsafe fn load8<W: WeightElem>(p: *const W) -> __m256 {
        // SAFETY (all arms): the caller vouches for 8 elements at `p`; every caller enables
        // AVX2 and F16C.
        unsafe {
            match W::LANES {
                Lanes::F32 => _mm256_loadu_ps(p.cast()),
                Lanes::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
                Lanes::Bf16 => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                    _mm_loadu_si128(p.cast()),
                ))),
            }
        }
    }

    /// See [`super::prefetch_ahead`]: chunk `c` of a tile of `NJ` weight rows.
    #[inline(always)]
    pub(super) fn prefetch_chunk<W, const NJ: usize>(tile: *const W, c: usize) {
        let per_chunk = NJ * VEC * std::mem::size_of::<W>();
        super::prefetch_ahead(tile.cast(), c * per_chunk, (c + 1) * per_chunk);
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn body<W: WeightElem, const MI: usize, const NJ: usize>(
        x: &[f32],
        w: &[W],
        k: usize,
        out: &mut [[f32; TILE_N]; TILE_M],
    ) {
        debug_assert!(x.len() >= MI * k && w.len() >= NJ * k);
        let chunks = k / VEC;
        let (xp, wp) = (x.as_ptr(), w.as_ptr());
        let mut acc = [[_mm256_setzero_ps(); NJ]; MI];
        for c in 0..chunks {
            let t = c * VEC;
            prefetch_chunk::<W, NJ>(wp, c);
            let mut wv = [_mm256_setzero_ps(); NJ];
            for (j, v) in wv.iter_mut().enumerate() {
                // SAFETY: row j of w has k ≥ t + 8 elements.
                *v = unsafe { load8(wp.add(j * k + t)) };
            }
            for (i, acc_i) in acc.iter_mut().enumerate() {
                // SAFETY: row i of x has k ≥ t + 8 elements.
                let xv = unsafe { _mm256_loadu_ps(xp.add(i * k + t)) };
                for (a, &wj) in acc_i.iter_mut().zip(&wv) {
                    *a = _mm256_fmadd_ps(xv, wj, *a);
                }
            }
        }
        for i in 0..MI {
            for j in 0..NJ {
                let mut lanes = [0f32; VEC];
                // SAFETY: `lanes` holds 8 f32.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[i][j]) };
                out[i][j] = finish(&lanes, &x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
            }
        }
    }

    /// An output from its accumulator's lanes: the fixed lane reduction, then the `k % 8`
    /// tail in order (`x` and `w` are the output's two rows).
    #[inline(always)]
    pub(super) fn finish<W: WeightElem>(lanes: &[f32; VEC], x: &[f32], w: &[W]) -> f32 {
        let mut s = hsum_lanes(lanes);
        for t in x.len() / VEC * VEC..x.len() {
            s += x[t] * w[t].widen_one();
        }
        s
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::avx2::{finish, load8, prefetch_chunk};
    use super::{WeightElem, PAIRS_MAX, TILE_N, VEC};
    use std::arch::x86_64::*;

    /// See [`super::PairFn`].
    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    pub(super) unsafe fn pairs<W: WeightElem>(
        xi: &[f32],
        x: &[f32],
        w: &[W],
        k: usize,
        (p0, np, odd): (usize, usize, bool),
        nj: usize,
        out: &mut [[f32; TILE_N]; 2 * PAIRS_MAX],
    ) {
        macro_rules! dispatch {
            ($(($np:literal, $nj:literal)),*) => {
                match (np, nj, odd) {
                    $(
                        ($np, $nj, false) => body::<W, $np, $nj, false>(xi, x, w, k, p0, out),
                        ($np, $nj, true) => body::<W, $np, $nj, true>(xi, x, w, k, p0, out),
                    )*
                    _ => unreachable!("{np} pairs x {nj} weight rows exceed {PAIRS_MAX} x {TILE_N}"),
                }
            };
        }
        dispatch!(
            (4, 4),
            (4, 3),
            (4, 2),
            (4, 1),
            (3, 4),
            (3, 3),
            (3, 2),
            (3, 1),
            (2, 4),
            (2, 3),
            (2, 2),
            (2, 1),
            (1, 4),
            (1, 3),
            (1, 2),
            (1, 1)
        )
    }

    #[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
    unsafe fn body<W: WeightElem, const NP: usize, const NJ: usize, const ODD: bool>(
        xi: &[f32],
        x: &[f32],
        w: &[W],
        k: usize,
        p0: usize,
        out: &mut [[f32; TILE_N]; 2 * PAIRS_MAX],
    ) {
        let chunks = k / VEC;
        let odd_row = 2 * (p0 + NP);
        assert!(xi.len() >= (p0 + NP) * chunks * 2 * VEC && w.len() >= NJ * k);
        assert!(!ODD || (NP < PAIRS_MAX && x.len() >= (odd_row + 1) * k));
        let (xp, wp) = (xi.as_ptr(), w.as_ptr());
        let xo = x.as_ptr().wrapping_add(odd_row * k);
        let mut acc = [[_mm512_setzero_ps(); NJ]; NP];
        let mut acc_odd = [_mm256_setzero_ps(); NJ];
        for c in 0..chunks {
            prefetch_chunk::<W, NJ>(wp, c);
            let mut w8 = [_mm256_setzero_ps(); NJ];
            for (j, v) in w8.iter_mut().enumerate() {
                // SAFETY: row j of w has k ≥ 8c + 8 elements.
                *v = unsafe { load8(wp.add(j * k + c * VEC)) };
            }
            let wv = w8.map(|v| _mm512_broadcast_f32x8(v));
            for (p, acc_p) in acc.iter_mut().enumerate() {
                // SAFETY: pair p0 + p's chunk c lies inside `xi` (asserted above).
                let xv = unsafe { _mm512_loadu_ps(xp.add(((p0 + p) * chunks + c) * 2 * VEC)) };
                for (a, &wj) in acc_p.iter_mut().zip(&wv) {
                    *a = _mm512_fmadd_ps(xv, wj, *a);
                }
            }
            if ODD {
                // SAFETY: the odd row has k ≥ 8c + 8 elements (asserted above).
                let xv = unsafe { _mm256_loadu_ps(xo.add(c * VEC)) };
                for (a, &wj) in acc_odd.iter_mut().zip(&w8) {
                    *a = _mm256_fmadd_ps(xv, wj, *a);
                }
            }
        }
        for (p, acc_p) in acc.iter().enumerate() {
            for (j, &a) in acc_p.iter().enumerate() {
                let mut lanes = [0f32; 2 * VEC];
                // SAFETY: `lanes` holds 16 f32.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), a) };
                for r in 0..2 {
                    let row = 2 * (p0 + p) + r;
                    let half: &[f32; VEC] =
                        lanes[r * VEC..(r + 1) * VEC].try_into().expect("8 lanes");
                    out[2 * p + r][j] =
                        finish(half, &x[row * k..(row + 1) * k], &w[j * k..(j + 1) * k]);
                }
            }
        }
        if ODD {
            for (j, &a) in acc_odd.iter().enumerate() {
                let mut lanes = [0f32; VEC];
                // SAFETY: `lanes` holds 8 f32.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), a) };
                out[2 * NP][j] = finish(
                    &lanes,
                    &x[odd_row * k..(odd_row + 1) * k],
                    &w[j * k..(j + 1) * k],
                );
            }
        }
    }
}

/// The candle op: `x: [m, k]`, `w: [n, k]`, both contiguous and of one dtype (f32, f16 or
/// bf16), CPU only. Results are rounded to the input dtype once, after f32 accumulation.
pub(crate) struct MatMulNt;

pub(crate) fn slice<'a, T>(s: &'a [T], l: &Layout) -> candle_core::Result<&'a [T]> {
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
                let out = matmul_nt_bf16(slice(x, l1)?, slice(w, l2)?, m, k, n);
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

/// Asserts the property greedy speculation rests on for a kernel `f(rows, m)` → `[m, n]` over
/// `x: [m, k]`: each row's bits among all the rows equal its bits computed alone.
#[cfg(test)]
pub(crate) fn assert_rows_independent<X>(
    x: &[X],
    (m, k, n): (usize, usize, usize),
    f: impl Fn(&[X], usize) -> Vec<f32>,
) {
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let all = f(x, m);
    for i in 0..m {
        let one = f(&x[i * k..(i + 1) * k], 1);
        assert_eq!(
            bits(&all[i * n..(i + 1) * n]),
            bits(&one),
            "{m}x{k}x{n}: row {i} differs from its single-row result"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic `x: [m, k]` and `w: [n, k]` with varied magnitudes and signs.
    fn operands(m: usize, k: usize, n: usize) -> (Vec<f32>, Vec<f32>) {
        let x = (0..m * k)
            .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
            .collect();
        let w = (0..n * k)
            .map(|i| ((i * 13 % 89) as f32 - 44.0) / 23.0)
            .collect();
        (x, w)
    }

    /// The property greedy speculation rests on: a row's result is bit-identical whether it
    /// is computed alone or among other rows, at any position in the batch and tile.
    #[test]
    fn rows_are_bit_identical_to_single_row_calls() {
        for &(m, k, n) in &[
            (9, 576, 37),
            (7, 64, 20),
            (5, 100, 9),
            (3, 7, 5),
            (2, 576, 9),
            (64, 64, 130),
        ] {
            let (x, w) = operands(m, k, n);
            assert_rows_independent(&x, (m, k, n), |x, m| matmul_nt(x, &w, m, k, n));
        }
    }

    /// Half-precision weights widen exactly as they load: the products are those of the
    /// same weights widened to f32 first, bit for bit, alone or among other rows.
    #[test]
    fn half_weights_give_the_bits_of_their_f32_widening() {
        for &(m, k, n) in &[(1, 576, 37), (3, 100, 9), (8, 64, 130), (5, 7, 5)] {
            let (x, w) = operands(m, k, n);
            let bits = |v: Vec<f32>| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wh: Vec<f16> = w.iter().map(|&v| f16::from_f32(v)).collect();
            let mut wide = vec![0f32; n * k];
            bf16::widen(&wb, &mut wide);
            assert_eq!(
                bits(matmul_nt(&x, &wb, m, k, n)),
                bits(matmul_nt(&x, &wide, m, k, n)),
                "bf16 {m}x{k}x{n}"
            );
            f16::widen(&wh, &mut wide);
            assert_eq!(
                bits(matmul_nt(&x, &wh, m, k, n)),
                bits(matmul_nt(&x, &wide, m, k, n)),
                "f16 {m}x{k}x{n}"
            );
        }
    }

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

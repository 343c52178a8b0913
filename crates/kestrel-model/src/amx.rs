//! bf16 `x · wᵀ` on Intel AMX (Sapphire Rapids and later), for the CPU's bf16 engines.
//!
//! Why: the AVX kernels of `matvec.rs` spend one 8-lane FMA per 8 weights per row, so each
//! row of a verification costs about what the weight stream does (on 2 cores a verified
//! SmolLM2 row cost ~15% of a bf16 step, and bf16 speculation ran slower than bf16 plain
//! decoding). A `tdpbf16ps` multiplies a 16 × 32 tile of weights by 32 × 16 inputs, so up
//! to 16 rows ride along with each weight load at no extra cost.
//!
//! Batch invariance, the property that keeps greedy speculation exact: output `(i, j)` is
//! one accumulator tile element, zeroed, then updated by one `tdpbf16ps` per 32-wide chunk
//! of K in order, each taking that chunk's products of row `i` of `x` and row `j` of `w`
//! only. Which 16 rows share the tile, and how many of them are real (the rest are zeros),
//! changes no arithmetic of a row. Whether this path runs depends on the machine and the
//! shape (K a multiple of 32, N of 16), never on the number of rows.
//!
//! The inputs are bf16 already (a bf16 engine's activations), so nothing is rounded on the
//! way in; products are exact in f32 and the tile sums them in f32 (AMX flushes subnormals).
//! The results therefore differ in the last bits from the AVX path, which sums in another
//! order: an engine takes one path or the other for the whole run.

use half::bf16;

/// Elements of K one tile op takes (64 bytes of bf16 a tile row).
pub(crate) const K_CHUNK: usize = 32;
/// Output columns (weight rows) and input rows of one accumulator tile.
pub(crate) const TILE: usize = 16;
/// Groups of 16 input rows a pass over the columns takes (128 rows: 384 KiB of SmolLM2's
/// widest inputs, within a core's L2).
const BAND_GROUPS: usize = 8;

/// Whether the bf16 products of this process run on AMX: the CPU has AMX-TILE and AMX-BF16,
/// Linux granted the tile state, and `KESTREL_CPU_AMX` is not `0` (which keeps the AVX
/// path, to compare the two on one machine).
pub(crate) fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KESTREL_CPU_AMX").as_deref() != Ok("0") && imp::enable())
}

/// Whether a bf16 product of `k`-wide rows into `n` columns takes AMX on this machine.
pub(crate) fn applies(k: usize, n: usize) -> bool {
    k > 0 && k.is_multiple_of(K_CHUNK) && n.is_multiple_of(TILE) && available()
}

/// `x [m, k] · w [n, k]ᵀ` as `[n, m]` (column-major, as `matvec::matmul_nt` builds it), f32.
/// Call only where [`applies`] holds.
pub(crate) fn matmul_nt_t(x: &[bf16], w: &[bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        applies(k, n),
        "amx: {m}x{k} · {n}x{k} does not take AMX here"
    );
    assert_eq!(
        x.len(),
        m * k,
        "amx: x has {} elements, not {m}x{k}",
        x.len()
    );
    assert_eq!(
        w.len(),
        n * k,
        "amx: w has {} elements, not {n}x{k}",
        w.len()
    );
    let packed = pack_inputs(x, m, k);
    let per_task = crate::matvec::rows_per_task(n).next_multiple_of(2 * TILE);
    let mut out_t = vec![0f32; n * m];
    crate::team::for_each_chunk_mut(&mut out_t, per_task * m, |task, out| {
        let j0 = task * per_task;
        imp::columns(&packed, w, false, k, m, j0, out);
    });
    out_t
}

/// As [`matmul_nt_t`] with `w` in [`pack_weights`]' layout.
pub(crate) fn matmul_nt_t_tiled(x: &[bf16], w: &[bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    assert!(
        applies(k, n),
        "amx: {m}x{k} · {n}x{k} does not take AMX here"
    );
    let packed = pack_inputs(x, m, k);
    let per_task = crate::matvec::rows_per_task(n).next_multiple_of(2 * TILE);
    let mut out_t = vec![0f32; n * m];
    crate::team::for_each_chunk_mut(&mut out_t, per_task * m, |task, out| {
        imp::columns(&packed, w, true, k, m, task * per_task, out);
    });
    out_t
}

/// `w [n, k]` in tile order: each block of 16 rows as its 32-wide chunks of K in turn, each
/// chunk its 16 rows of 64 bytes (one tile load of 1 KiB).
pub(crate) fn matmul_nt_t4(
    x: &[bf16],
    w: &[bf16],
    tiled: bool,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let packed = pack_inputs(x, m, k);
    let per_task = crate::matvec::rows_per_task(n).next_multiple_of(4 * TILE);
    let mut out_t = vec![0f32; n * m];
    crate::team::for_each_chunk_mut(&mut out_t, per_task * m, |task, out| {
        imp::columns4(&packed, w, tiled, k, m, task * per_task, out);
    });
    out_t
}

pub(crate) fn pack_weights(w: &[bf16], n: usize, k: usize) -> Vec<bf16> {
    let mut out = Vec::with_capacity(n * k);
    for block in w.chunks_exact(TILE * k) {
        for c in 0..k / K_CHUNK {
            for r in 0..TILE {
                out.extend_from_slice(&block[r * k + c * K_CHUNK..][..K_CHUNK]);
            }
        }
    }
    out
}

/// `x`'s rows as tdpbf16ps's second operand: for each group of 16 rows and each 32-wide chunk
/// of K, a 16 × 16 tile of bf16 pairs, element `(kk, i)` holding `x[16g + i][32c + 2kk ..
/// 32c + 2kk + 2]` (rows past `m` are zeros). Group g, chunk c starts at `(g·chunks + c)·512`.
pub(crate) fn pack_inputs(x: &[bf16], m: usize, k: usize) -> Vec<bf16> {
    let chunks = k / K_CHUNK;
    let groups = m.div_ceil(TILE);
    let mut out = vec![bf16::ZERO; groups * chunks * TILE * K_CHUNK];
    for (r, row) in x.chunks_exact(k).enumerate() {
        let (g, i) = (r / TILE, r % TILE);
        for c in 0..chunks {
            let tile = &mut out[(g * chunks + c) * TILE * K_CHUNK..][..TILE * K_CHUNK];
            for kk in 0..K_CHUNK / 2 {
                let at = kk * 2 * TILE + 2 * i;
                tile[at..at + 2].copy_from_slice(&row[c * K_CHUNK + 2 * kk..][..2]);
            }
        }
    }
    out
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod imp {
    use super::{BAND_GROUPS, K_CHUNK, TILE};
    use half::bf16;
    use std::arch::asm;

    /// The tile configuration (`ldtilecfg`'s 64-byte operand, palette 1): tmm0 and tmm1 the
    /// accumulators of two 16-column blocks (16 rows × 16 f32), tmm2 and tmm3 their weight
    /// tiles (16 weight rows × 32 bf16), tmm4 the inputs (16 pairs of K × 16 rows of x).
    #[repr(C, align(64))]
    struct TileConfig {
        palette: u8,
        start_row: u8,
        reserved: [u8; 14],
        colsb: [u16; 16],
        rows: [u8; 16],
    }

    const CONFIG: TileConfig = {
        let mut c = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        let mut t = 0;
        while t < 8 {
            c.colsb[t] = 64;
            c.rows[t] = TILE as u8;
            t += 1;
        }
        c
    };

    fn prefetch_distance() -> usize {
        static D: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
        *D.get_or_init(|| {
            std::env::var("KESTREL_AMX_PF")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(8)
        })
    }

    /// Asks for chunks `c` and `c + 1` (bytes 64c .. 64c + 128) of 16 weight rows from `rows`.
    #[inline(always)]
    unsafe fn prefetch_rows(rows: *const bf16, stride: usize, c: usize) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let base = (rows as *const i8).wrapping_add(c * 64);
        for r in 0..TILE {
            let p = base.wrapping_add(r * stride);
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
    }

    /// Four 16-column blocks a pass (tmm0-3 accumulate, tmm4/tmm5 take the weight tiles in
    /// turn, tmm6 the inputs).
    pub(super) fn columns4(
        packed: &[bf16],
        w: &[bf16],
        tiled: bool,
        k: usize,
        m: usize,
        j0: usize,
        out: &mut [f32],
    ) {
        let cols = out.len() / m;
        let chunks = k / K_CHUNK;
        let (stride, step) = if tiled {
            (64, TILE * K_CHUNK)
        } else {
            (k * std::mem::size_of::<bf16>(), K_CHUNK)
        };
        let mut acc = [[[0f32; TILE]; TILE]; 4];
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig) };
        let groups = m.div_ceil(TILE);
        for band in (0..groups).step_by(BAND_GROUPS) {
            for b in (0..cols).step_by(4 * TILE) {
                let blk = |i: usize| if b + i * TILE < cols { b + i * TILE } else { b };
                let col0 = [blk(0), blk(1), blk(2), blk(3)];
                let wp = col0.map(|c| w[(j0 + c) * k..].as_ptr());
                for g in band..groups.min(band + BAND_GROUPS) {
                    let x = packed[g * chunks * TILE * K_CHUNK..].as_ptr();
                    unsafe {
                        asm!(
                            "tilezero tmm0",
                            "tilezero tmm1",
                            "tilezero tmm2",
                            "tilezero tmm3"
                        );
                        for c in 0..chunks {
                            asm!(
                                "tileloadd tmm6, [{x} + {s64}*1]",
                                "tileloadd tmm4, [{w0} + {s}*1]",
                                "tdpbf16ps tmm0, tmm4, tmm6",
                                "tileloadd tmm5, [{w1} + {s}*1]",
                                "tdpbf16ps tmm1, tmm5, tmm6",
                                "tileloadd tmm4, [{w2} + {s}*1]",
                                "tdpbf16ps tmm2, tmm4, tmm6",
                                "tileloadd tmm5, [{w3} + {s}*1]",
                                "tdpbf16ps tmm3, tmm5, tmm6",
                                x = in(reg) x.add(c * TILE * K_CHUNK),
                                w0 = in(reg) wp[0].add(c * step),
                                w1 = in(reg) wp[1].add(c * step),
                                w2 = in(reg) wp[2].add(c * step),
                                w3 = in(reg) wp[3].add(c * step),
                                s = in(reg) stride,
                                s64 = in(reg) 64usize,
                                options(nostack, readonly),
                            );
                        }
                        asm!(
                            "tilestored [{a} + {s64}*1], tmm0",
                            "tilestored [{b} + {s64}*1], tmm1",
                            "tilestored [{c} + {s64}*1], tmm2",
                            "tilestored [{d} + {s64}*1], tmm3",
                            a = in(reg) acc[0].as_mut_ptr(),
                            b = in(reg) acc[1].as_mut_ptr(),
                            c = in(reg) acc[2].as_mut_ptr(),
                            d = in(reg) acc[3].as_mut_ptr(),
                            s64 = in(reg) 64usize,
                            options(nostack),
                        );
                    }
                    let rows = TILE.min(m - g * TILE);
                    for (a, &c0) in acc.iter().zip(&col0) {
                        for (c, lane) in a.iter().enumerate() {
                            out[(c0 + c) * m + g * TILE..][..rows].copy_from_slice(&lane[..rows]);
                        }
                    }
                }
            }
        }
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// CPUID leaf 7: AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24); then Linux's permission
    /// for the tile data state (`ARCH_REQ_XCOMP_PERM`, XFEATURE_XTILEDATA = 18), without
    /// which the first tile instruction faults.
    pub(super) fn enable() -> bool {
        let leaf0 = std::arch::x86_64::__cpuid(0);
        if leaf0.eax < 7 {
            return false;
        }
        let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
        if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
            return false;
        }
        const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
        const XFEATURE_XTILEDATA: libc::c_long = 18;
        // SAFETY: arch_prctl with an integer argument touches no memory of ours.
        unsafe {
            libc::syscall(
                libc::SYS_arch_prctl,
                ARCH_REQ_XCOMP_PERM,
                XFEATURE_XTILEDATA,
            ) == 0
        }
    }

    /// Output columns `j0 ..` of `out` (`[cols, m]`, column-major: `out.len() / m` weight rows
    /// from `j0`, a multiple of 16): every group of 16 input rows against them, two 16-column
    /// blocks at a time sharing each input tile.
    pub(super) fn columns(
        packed: &[bf16],
        w: &[bf16],
        tiled: bool,
        k: usize,
        m: usize,
        j0: usize,
        out: &mut [f32],
    ) {
        let cols = out.len() / m;
        let chunks = k / K_CHUNK;
        let (stride, step) = if tiled {
            (64, TILE * K_CHUNK)
        } else {
            (k * std::mem::size_of::<bf16>(), K_CHUNK)
        };
        let mut acc = [[[0f32; TILE]; TILE]; 2];
        let pf = prefetch_distance();
        // SAFETY: the CPU has AMX and the permission (`applies` held, checked by the caller);
        // the configuration is this thread's and released before returning.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &CONFIG as *const TileConfig) };
        let groups = m.div_ceil(TILE);
        // Long prompts: a band of input rows at a time, so that the band's tiles stay in L2
        // while every block of columns passes over them.
        for band in (0..groups).step_by(BAND_GROUPS) {
            for b in (0..cols).step_by(2 * TILE) {
                // An odd last block is computed twice, its copy discarded.
                let second = if b + TILE < cols { b + TILE } else { b };
                let w_lo = w[(j0 + b) * k..].as_ptr();
                let w_hi = w[(j0 + second) * k..].as_ptr();
                for g in band..groups.min(band + BAND_GROUPS) {
                    let x = packed[g * chunks * TILE * K_CHUNK..].as_ptr();
                    // SAFETY: each tile load reads 16 rows of 64 bytes: weight rows j0 + b ..
                    // j0 + b + 16 (and `second`'s), bytes 64c .. 64c + 64 of each with c < k / 32,
                    // all inside `w`; input tile (g, c) lies inside `packed`. The stores write
                    // 16 rows of 64 bytes into `acc`.
                    unsafe {
                        asm!("tilezero tmm0", "tilezero tmm1");
                        let mut c = 0;
                        // Two chunks a turn, in two sets of tiles, so that one chunk's loads
                        // overlap the other's products; the products still reach each
                        // accumulator in K's order.
                        while c + 2 <= chunks {
                            if pf > 0 && !tiled {
                                prefetch_rows(w_lo, stride, c + pf);
                                prefetch_rows(w_hi, stride, c + pf);
                            }
                            asm!(
                                "tileloadd tmm4, [{x} + {s64}*1]",
                                "tileloadd tmm2, [{lo} + {s}*1]",
                                "tileloadd tmm3, [{hi} + {s}*1]",
                                "tileloadd tmm7, [{x} + {s64}*1 + 1024]",
                                "tileloadd tmm5, [{lo2} + {s}*1]",
                                "tileloadd tmm6, [{hi2} + {s}*1]",
                                "tdpbf16ps tmm0, tmm2, tmm4",
                                "tdpbf16ps tmm1, tmm3, tmm4",
                                "tdpbf16ps tmm0, tmm5, tmm7",
                                "tdpbf16ps tmm1, tmm6, tmm7",
                                x = in(reg) x.add(c * TILE * K_CHUNK),
                                lo = in(reg) w_lo.add(c * step),
                                hi = in(reg) w_hi.add(c * step),
                                lo2 = in(reg) w_lo.add((c + 1) * step),
                                hi2 = in(reg) w_hi.add((c + 1) * step),
                                s = in(reg) stride,
                                s64 = in(reg) 64usize,
                                options(nostack, readonly),
                            );
                            c += 2;
                        }
                        if c < chunks {
                            asm!(
                                "tileloadd tmm4, [{x} + {s64}*1]",
                                "tileloadd tmm2, [{lo} + {s}*1]",
                                "tileloadd tmm3, [{hi} + {s}*1]",
                                "tdpbf16ps tmm0, tmm2, tmm4",
                                "tdpbf16ps tmm1, tmm3, tmm4",
                                x = in(reg) x.add(c * TILE * K_CHUNK),
                                lo = in(reg) w_lo.add(c * step),
                                hi = in(reg) w_hi.add(c * step),
                                s = in(reg) stride,
                                s64 = in(reg) 64usize,
                                options(nostack, readonly),
                            );
                        }
                        asm!(
                            "tilestored [{a} + {s64}*1], tmm0",
                            "tilestored [{b} + {s64}*1], tmm1",
                            a = in(reg) acc[0].as_mut_ptr(),
                            b = in(reg) acc[1].as_mut_ptr(),
                            s64 = in(reg) 64usize,
                            options(nostack),
                        );
                    }
                    let rows = TILE.min(m - g * TILE);
                    for (blk, col0) in [(0, b), (1, second)] {
                        for (c, lane) in acc[blk].iter().enumerate() {
                            let o = &mut out[(col0 + c) * m + g * TILE..][..rows];
                            o.copy_from_slice(&lane[..rows]);
                        }
                    }
                }
            }
        }
        // SAFETY: releases this thread's tile state.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
mod imp {
    pub(super) fn enable() -> bool {
        false
    }
    pub(super) fn columns(
        _: &[half::bf16],
        _: &[half::bf16],
        _: bool,
        _: usize,
        _: usize,
        _: usize,
        _: &mut [f32],
    ) {
        unreachable!("AMX is only enabled on x86_64 Linux")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic bf16 values of varied sign and magnitude.
    fn values(len: usize, seed: usize) -> Vec<bf16> {
        (0..len)
            .map(|i| {
                let v = ((i * 7919 + seed * 104_729) % 1_009) as f32 / 1_009.0 - 0.5;
                bf16::from_f32(v * (1 + (i + seed) % 5) as f32)
            })
            .collect()
    }

    fn skip() -> bool {
        if !available() {
            eprintln!("no AMX on this machine: the AMX tests check nothing here");
            return true;
        }
        false
    }

    #[test]
    fn rows_do_not_depend_on_the_step() {
        if skip() {
            return;
        }
        let (k, n, m) = (96, 80, 300);
        let (x, w) = (values(m * k, 1), values(n * k, 2));
        let full = matmul_nt_t(&x, &w, m, k, n);
        for (start, rows) in [
            (0, 1),
            (5, 1),
            (0, 2),
            (3, 15),
            (17, 16),
            (40, 17),
            (0, 64),
            (100, 200),
        ] {
            let part = matmul_nt_t(&x[start * k..(start + rows) * k], &w, rows, k, n);
            for j in 0..n {
                for i in 0..rows {
                    assert_eq!(
                        part[j * rows + i].to_bits(),
                        full[j * m + start + i].to_bits(),
                        "row {} of {rows} from {start}, column {j}",
                        start + i
                    );
                }
            }
        }
    }

    /// Every output within f32 summation error of the exact dot product. (The tile does not
    /// add in the order Intel's SDM writes for `tdpbf16ps`: a pairwise emulation, in any of
    /// the orders tried, matched 155-778 of these 912 outputs bit for bit; so this is a bound,
    /// not a bit pattern.)
    #[test]
    fn products_match_the_exact_dot_product() {
        if skip() {
            return;
        }
        let (k, n, m) = (576, 48, 19);
        let (x, w) = (values(m * k, 3), values(n * k, 4));
        let got = matmul_nt_t(&x, &w, m, k, n);
        for j in 0..n {
            for i in 0..m {
                let (xr, wr) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                let exact: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| a.to_f64() * b.to_f64())
                    .sum();
                let scale: f64 = xr
                    .iter()
                    .zip(wr)
                    .map(|(a, b)| (a.to_f64() * b.to_f64()).abs())
                    .sum();
                let g = got[j * m + i] as f64;
                assert!(
                    (g - exact).abs() <= 1e-6 * scale,
                    "({i}, {j}): {g} against {exact}"
                );
            }
        }
    }

    #[test]
    fn shapes_outside_the_tiles_do_not_apply() {
        assert!(!applies(48, 32), "K not a multiple of 32");
        assert!(!applies(64, 40), "N not a multiple of 16");
        assert!(!applies(0, 16), "empty rows");
    }
}
#[cfg(test)]
mod speed {
    use super::*;
    #[test]
    #[ignore]
    fn speed_probe() {
        for (n, k) in [(3072usize, 576usize), (576, 1536), (49152, 576), (768, 576)] {
            let w: Vec<bf16> = (0..n * k)
                .map(|i| bf16::from_f32(((i % 13) as f32 - 6.0) / 7.0))
                .collect();
            let wf: Vec<f32> = vec![0.0; 1];
            let _ = wf;
            for m in [1usize, 8] {
                let x: Vec<bf16> = (0..m * k)
                    .map(|i| bf16::from_f32(((i % 7) as f32 - 3.0) / 5.0))
                    .collect();
                let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
                let reps = 200;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(matmul_nt_t(&x, &w, m, k, n));
                }
                let amx = t.elapsed().as_secs_f64() / reps as f64;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(crate::matvec::matmul_nt(&xf, &w, m, k, n));
                }
                let avx = t.elapsed().as_secs_f64() / reps as f64;
                let wp = pack_weights(&w, n, k);
                assert_eq!(
                    matmul_nt_t_tiled(&x, &wp, m, k, n),
                    matmul_nt_t(&x, &w, m, k, n)
                );
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(matmul_nt_t_tiled(&x, &wp, m, k, n));
                }
                let tiled = t.elapsed().as_secs_f64() / reps as f64;
                for tiled in [false, true] {
                    let ww = if tiled { &wp } else { &w };
                    assert_eq!(
                        matmul_nt_t4(&x, ww, tiled, m, k, n),
                        matmul_nt_t(&x, &w, m, k, n)
                    );
                    let t = std::time::Instant::now();
                    for _ in 0..reps {
                        std::hint::black_box(matmul_nt_t4(&x, ww, tiled, m, k, n));
                    }
                    let e = t.elapsed().as_secs_f64() / reps as f64;
                    eprintln!(
                        "four tiled={tiled} {:.3} ms ({:.1} GB/s)",
                        e * 1e3,
                        (n * k * 2) as f64 / 1e9 / e
                    );
                }
                eprintln!(
                    "tiled {:.3} ms ({:.1} GB/s)",
                    tiled * 1e3,
                    (n * k * 2) as f64 / 1e9 / tiled
                );
                let gb = (n * k * 2) as f64 / 1e9;
                eprintln!(
                    "n {n} k {k} m {m}: amx {:.3} ms ({:.1} GB/s) avx {:.3} ms ({:.1} GB/s)",
                    amx * 1e3,
                    gb / amx,
                    avx * 1e3,
                    gb / avx
                );
            }
        }
    }
}

//! bf16 `x · wᵀ` on Intel AMX (Sapphire Rapids and later) for the prompts of the CPU's bf16
//! engines.
//!
//! Why prompts only: a `tdpbf16ps` multiplies 16 weight rows × 32 of K by up to 16 input
//! rows at once, so a 128-token SmolLM2 prompt prefills ~1.6× faster than through the AVX
//! kernel of `matvec.rs` on 2 cores. But a one-row decode step streamed the weights slower
//! through the tiles than through that kernel (~15 against ~13.5 ms a step), and decode and
//! verification steps must share one kernel to keep greedy speculation exact, so those
//! steps stay on `matvec.rs` (docs/gpu-results.md, session 20).
//!
//! Why that is exact: every decoding mode prefills a prompt through the same call
//! (`Llama::forward_prompt`), and this kernel's rows do not depend on how many rows a call
//! has: output `(i, j)` is one accumulator tile element, zeroed, then updated by one
//! `tdpbf16ps` per 32-wide chunk of K in order, each taking that chunk of row `i` of `x` and
//! row `j` of `w` only. So a prompt prefilled whole, or only its part past a cached prefix,
//! gets the same K/V bits. Whether it runs depends on the machine and the shape (K a
//! multiple of 32, N of 16), never on the rows.
//!
//! The inputs are bf16 already (a bf16 engine's activations), so nothing is rounded on the
//! way in; products are exact in f32 and the tile sums them in f32 (AMX flushes subnormals)
//! in its own order, so results differ in the last bits from the AVX kernel's.

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, Layout, Shape, Tensor};
use half::bf16;

/// Elements of K one tile op takes (64 bytes of bf16 a tile row).
const K_CHUNK: usize = 32;
/// Output columns (weight rows) and input rows of one accumulator tile.
const TILE: usize = 16;
/// Groups of 16 input rows a pass over the columns takes (128 rows: 384 KiB of SmolLM2's
/// widest inputs, within a core's L2).
const BAND_GROUPS: usize = 8;

/// Whether this process may use AMX: the CPU has AMX-TILE and AMX-BF16, Linux granted the
/// tile state, and `KESTREL_CPU_AMX` is not `0` (which keeps prompts on the AVX kernel, to
/// compare the two on one machine).
fn available() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("KESTREL_CPU_AMX").as_deref() != Ok("0") && imp::enable())
}

/// Whether `x [m, k] · w [n, k]ᵀ` takes [`MatMulTiles`]: both bf16 on the CPU, K a multiple
/// of 32, N of 16, on a machine with AMX.
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    let (Ok((_, k)), Ok((n, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    x.device().is_cpu()
        && x.dtype() == candle_core::DType::BF16
        && w.dtype() == candle_core::DType::BF16
        && k == wk
        && k > 0
        && k.is_multiple_of(K_CHUNK)
        && n.is_multiple_of(TILE)
        && available()
}

/// `x · wᵀ` on AMX as a candle op (bf16 in, bf16 out, f32 sums). Check [`applies`].
pub(crate) struct MatMulTiles;

impl CustomOp2 for MatMulTiles {
    fn name(&self) -> &'static str {
        "kestrel-amx-matmul"
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
        if k != k2 || !k.is_multiple_of(K_CHUNK) || !n.is_multiple_of(TILE) || !available() {
            candle_core::bail!("amx: {m}x{k} · ({n}x{k2})ᵀ does not take AMX here");
        }
        let (CpuStorage::BF16(x), CpuStorage::BF16(w)) = (s1, s2) else {
            candle_core::bail!("amx: {:?} · {:?}, not bf16", s1.dtype(), s2.dtype());
        };
        let (x, w) = (crate::matvec::slice(x, l1)?, crate::matvec::slice(w, l2)?);
        let out = crate::matvec::transpose(matmul_nt_t(x, w, m, k, n), m, n);
        let out = out.iter().map(|&v| bf16::from_f32(v)).collect();
        Ok((CpuStorage::BF16(out), Shape::from((m, n))))
    }
}

/// `x [m, k] · w [n, k]ᵀ` as `[n, m]` (column-major, as `matvec::matmul_nt` builds it), f32.
fn matmul_nt_t(x: &[bf16], w: &[bf16], m: usize, k: usize, n: usize) -> Vec<f32> {
    let packed = pack_inputs(x, m, k);
    let per_task = crate::matvec::rows_per_task(n).next_multiple_of(2 * TILE);
    let mut out_t = vec![0f32; n * m];
    crate::team::for_each_chunk_mut(&mut out_t, per_task * m, |task, out| {
        imp::columns(&packed, w, k, m, task * per_task, out);
    });
    out_t
}

/// `x`'s rows as tdpbf16ps's second operand: for each group of 16 rows and each 32-wide chunk
/// of K, a 16 × 16 tile of bf16 pairs, element `(kk, i)` holding `x[16g + i][32c + 2kk ..
/// 32c + 2kk + 2]` (rows past `m` are zeros). Group g, chunk c starts at `(g·chunks + c)·512`.
fn pack_inputs(x: &[bf16], m: usize, k: usize) -> Vec<bf16> {
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
    /// accumulators of two 16-column blocks (16 rows × 16 f32); tmm2, tmm3 (tmm5, tmm6)
    /// their weight tiles (16 weight rows × 32 bf16) of even (odd) chunks of K; tmm4 (tmm7)
    /// the inputs (16 pairs of K × 16 rows of x) of those chunks.
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
        k: usize,
        m: usize,
        j0: usize,
        out: &mut [f32],
    ) {
        let cols = out.len() / m;
        let chunks = k / K_CHUNK;
        let stride = k * std::mem::size_of::<bf16>();
        let mut acc = [[[0f32; TILE]; TILE]; 2];
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
                                lo = in(reg) w_lo.add(c * K_CHUNK),
                                hi = in(reg) w_hi.add(c * K_CHUNK),
                                lo2 = in(reg) w_lo.add((c + 1) * K_CHUNK),
                                hi2 = in(reg) w_hi.add((c + 1) * K_CHUNK),
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
                                lo = in(reg) w_lo.add(c * K_CHUNK),
                                hi = in(reg) w_hi.add(c * K_CHUNK),
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
        let t = |r: usize, c: usize, d: candle_core::DType| {
            Tensor::zeros((r, c), d, &candle_core::Device::Cpu).unwrap()
        };
        use candle_core::DType::{BF16, F16, F32};
        assert_eq!(applies(&t(3, 64, BF16), &t(32, 64, BF16)), available());
        assert!(
            !applies(&t(3, 48, BF16), &t(32, 48, BF16)),
            "K not a multiple of 32"
        );
        assert!(
            !applies(&t(3, 64, BF16), &t(40, 64, BF16)),
            "N not a multiple of 16"
        );
        assert!(!applies(&t(3, 64, BF16), &t(32, 96, BF16)), "K differs");
        assert!(!applies(&t(3, 64, F32), &t(32, 64, F32)), "f32");
        assert!(!applies(&t(3, 64, F16), &t(32, 64, F16)), "f16");
    }
}

//! 4- and 8-bit copies of a model's weights (`Llama::with_quantized_draft_weights`), for a
//! draft that is the target itself at about a third of its weight bytes (the runtime's
//! `Engine::self_draft`).
//!
//! Why: on a CPU a decode step streams every weight once, so its time follows the weight
//! bytes, and a draft computed from the target's own weights agrees with the target's greedy
//! token far more often than a trained drafter of SmolLM2 does (an f32 copy drafting for the
//! bf16 target makes 4.7 tokens a step at 4 drafts, against 1.4 for a distilled 4-layer
//! draft). Its numbers need not match anything: the target verifies every draft, so the
//! output stays the target's whatever the draft computes.
//!
//! Layout (GGUF's Q4_1, and its 8-bit analogue: asymmetric blocks of [`BLOCK`] = 32 along a
//! row, so SmolLM2's projections, Q4_1 in its GGUF, come back as they were): each block keeps
//! a scale `d` and a minimum `m` (f16, 0.125 bytes a weight) and 32 codes `q` in
//! 0..=15 (or 0..=255), the weight being `d·q + m`. Blocks go in pairs: at 4 bits byte `i` of a
//! pair's 32 holds element `i` of the first block in its low nibble and element `i` of the
//! second in its high one, so one 32-byte load split into nibbles gives the pair's 64 codes
//! in order; at 8 bits a pair is its 64 codes in order. The input rows are quantized per
//! block too (`x ≈ dx·xq`, `xq` in -127..=127), so a block's products are integers:
//! `Σ w·x ≈ d·dx·Σ q·xq + m·Σ x`, and `vpdpbusd` (AVX512-VNNI) takes a pair's 64 products
//! `q·xq` in one instruction.

use crate::matvec::{by_weight_tiles, TILE_N};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Shape, Tensor};
use half::{bf16, f16};
use kestrel_kernels::QuantGemvWeights;
use rayon::prelude::*;

/// Weights sharing one scale and minimum, along a row.
pub const BLOCK: usize = 32;
/// Two blocks: what one load of codes holds, and what a row's length must divide by.
const PAIR: usize = 2 * BLOCK;

/// Bits a weight's code takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bits {
    Four,
    Eight,
}

impl Bits {
    /// The largest code.
    fn top(self) -> f32 {
        match self {
            Bits::Four => 15.0,
            Bits::Eight => 255.0,
        }
    }

    /// Code bytes of `k` weights.
    fn bytes(self, k: usize) -> usize {
        match self {
            Bits::Four => k / 2,
            Bits::Eight => k,
        }
    }
}

/// A `[n, k]` weight matrix at 4 or 8 bits (the layout above).
#[derive(Debug)]
pub struct QuantWeights {
    bits: Bits,
    n: usize,
    k: usize,
    /// `bits.bytes(k)` bytes a row, row after row, pair of blocks after pair.
    codes: Vec<u8>,
    /// `[n, k / BLOCK]`.
    scales: Vec<f16>,
    mins: Vec<f16>,
}

/// An input row quantized per block: `x ≈ dx[b] · xq` over block `b`.
struct QuantRow {
    xq: Vec<i8>,
    dx: Vec<f32>,
    /// The exact sum of each block's inputs, for the weights' minimums.
    sum: Vec<f32>,
}

/// One weight row's blocks.
struct WeightRow<'a> {
    bits: Bits,
    codes: &'a [u8],
    scales: &'a [f16],
    mins: &'a [f16],
}

impl WeightRow<'_> {
    /// The code of element `t`.
    fn code(&self, t: usize) -> u8 {
        match self.bits {
            Bits::Eight => self.codes[t],
            Bits::Four => {
                let byte = self.codes[t / PAIR * BLOCK + t % BLOCK];
                if t % PAIR < BLOCK {
                    byte & 15
                } else {
                    byte >> 4
                }
            }
        }
    }
}

impl QuantWeights {
    /// The `bits`-bit copy of `w: [n, k]` (any float dtype, on any device), on the host;
    /// `None` when `k` is not a multiple of 64 (a pair of blocks).
    pub fn quantize(w: &Tensor, bits: Bits) -> candle_core::Result<Option<Self>> {
        let (n, k) = w.dims2()?;
        if !k.is_multiple_of(PAIR) {
            return Ok(None);
        }
        let values = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let blocks = k / BLOCK;
        let mut codes = vec![0u8; n * bits.bytes(k)];
        let mut scales = vec![f16::ZERO; n * blocks];
        let mut mins = vec![f16::ZERO; n * blocks];
        // In parallel: a 7B model's copy is billions of weights (its load on a GPU host).
        let per_pair = values
            .par_chunks_exact(PAIR)
            .zip(codes.par_chunks_exact_mut(bits.bytes(PAIR)))
            .zip(
                scales
                    .par_chunks_exact_mut(2)
                    .zip(mins.par_chunks_exact_mut(2)),
            );
        per_pair.for_each(|((v, c), (d, m))| {
            let (first, second) = v.split_at(BLOCK);
            let (lo, hi) = (block_codes(first, bits), block_codes(second, bits));
            match bits {
                Bits::Four => {
                    for (i, byte) in c.iter_mut().enumerate() {
                        *byte = lo.codes[i] | (hi.codes[i] << 4);
                    }
                }
                Bits::Eight => {
                    let (a, b) = c.split_at_mut(BLOCK);
                    a.copy_from_slice(&lo.codes);
                    b.copy_from_slice(&hi.codes);
                }
            }
            (d[0], m[0], d[1], m[1]) = (lo.scale, lo.min, hi.scale, hi.min);
        });
        Ok(Some(QuantWeights {
            bits,
            n,
            k,
            codes,
            scales,
            mins,
        }))
    }

    /// This matrix uploaded to the CUDA `device` for its kernel (rows of up to 19,648
    /// weights: `QuantGemvWeights::takes_rows_of`).
    pub fn to_cuda(&self, device: &candle_core::Device) -> candle_core::Result<QuantGemvWeights> {
        let bits = match self.bits {
            Bits::Four => 4,
            Bits::Eight => 8,
        };
        QuantGemvWeights::new(
            bits,
            (self.n, self.k),
            &self.codes,
            &self.scales,
            &self.mins,
            device,
        )
    }

    /// Bytes held (codes, scales and minimums).
    pub fn bytes(&self) -> usize {
        self.codes.len() + 2 * (self.scales.len() + self.mins.len())
    }

    /// The weight `(j, t)` as the kernel sees it.
    #[cfg(test)]
    fn value(&self, j: usize, t: usize) -> f32 {
        let at = j * self.k + t;
        let q = self.row(j).code(t);
        self.scales[at / BLOCK].to_f32() * q as f32 + self.mins[at / BLOCK].to_f32()
    }

    fn row(&self, j: usize) -> WeightRow<'_> {
        let (blocks, bytes) = (self.k / BLOCK, self.bits.bytes(self.k));
        WeightRow {
            bits: self.bits,
            codes: &self.codes[j * bytes..(j + 1) * bytes],
            scales: &self.scales[j * blocks..(j + 1) * blocks],
            mins: &self.mins[j * blocks..(j + 1) * blocks],
        }
    }

    /// `x [m, k] · wᵀ` → `[m, n]` in f32.
    pub fn matmul_nt(&self, x: &[f32], m: usize) -> Vec<f32> {
        assert_eq!(
            x.len(),
            m * self.k,
            "x has {} elements, not {m}x{}",
            x.len(),
            self.k
        );
        let rows: Vec<QuantRow> = x.chunks_exact(self.k).map(quantize_row).collect();
        let simd = vnni();
        by_weight_tiles(m, self.n, TILE_N, |j0, nj, out| {
            // The tile's rows, a short tile repeating its last.
            let tile_rows: [usize; TILE_N] = std::array::from_fn(|j| j0 + j.min(nj - 1));
            for i0 in (0..m).step_by(ROWS_AT_ONCE) {
                let group = &rows[i0..(i0 + ROWS_AT_ONCE).min(m)];
                let res = self.tile(&tile_rows, group, simd && i0 == 0, simd);
                out.put(i0, &res[..group.len()], nj);
            }
        })
    }
}

/// Input rows one pass over a tile of weight rows serves (each pair of blocks unpacked once
/// for all).
const ROWS_AT_ONCE: usize = 4;

impl QuantWeights {
    /// The products of the weight rows `rows_j` with up to [`ROWS_AT_ONCE`] quantized rows:
    /// `res[i][j]`.
    /// `prefetch`: the first pass over these weight rows, which asks for the lines ahead of
    /// them (as `matvec_bf16.rs` does: 8-bit rows read side by side streamed at half the
    /// memory's rate without it).
    fn tile(
        &self,
        rows_j: &[usize; TILE_N],
        rows: &[QuantRow],
        prefetch: bool,
        simd: bool,
    ) -> [[f32; TILE_N]; ROWS_AT_ONCE] {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is `vnni()`, which checked the features the kernel is compiled
            // for.
            return unsafe {
                match (self.bits, rows.len()) {
                    (Bits::Four, 1) => avx512::tile::<1, false>(self, rows_j, rows, prefetch),
                    (Bits::Four, 2) => avx512::tile::<2, false>(self, rows_j, rows, prefetch),
                    (Bits::Four, 3) => avx512::tile::<3, false>(self, rows_j, rows, prefetch),
                    (Bits::Four, _) => avx512::tile::<4, false>(self, rows_j, rows, prefetch),
                    (Bits::Eight, 1) => avx512::tile::<1, true>(self, rows_j, rows, prefetch),
                    (Bits::Eight, 2) => avx512::tile::<2, true>(self, rows_j, rows, prefetch),
                    (Bits::Eight, 3) => avx512::tile::<3, true>(self, rows_j, rows, prefetch),
                    (Bits::Eight, _) => avx512::tile::<4, true>(self, rows_j, rows, prefetch),
                }
            };
        }
        let _ = (simd, prefetch);
        let mut res = [[0f32; TILE_N]; ROWS_AT_ONCE];
        for (r, row) in res.iter_mut().zip(rows) {
            for (v, &j) in r.iter_mut().zip(rows_j) {
                *v = portable_dot(&self.row(j), row);
            }
        }
        res
    }
}

/// One block's codes (0..=15 or 0..=255), scale and minimum.
struct BlockCodes {
    codes: [u8; BLOCK],
    scale: f16,
    min: f16,
}

/// The codes are taken against the scale and minimum as stored (rounded to f16), so that a
/// block whose weights were `d·q + m` with f16 `d` and `m` (a GGUF's Q4_1) gets them back.
fn block_codes(v: &[f32], bits: Bits) -> BlockCodes {
    let lo = v.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let top = bits.top();
    let (scale, min) = (f16::from_f32((hi - lo) / top), f16::from_f32(lo));
    let (d, m) = (scale.to_f32(), min.to_f32());
    let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
    let mut codes = [0u8; BLOCK];
    for (c, &x) in codes.iter_mut().zip(v) {
        *c = round_small((x - m) * inv).clamp(0.0, top) as u8;
    }
    BlockCodes { codes, scale, min }
}

/// `v` rounded to the nearest integer (ties to even) for `|v| < 2²²`: adding and taking
/// away 1.5·2²³ leaves no fraction bits (`f32::round` is a library call without SSE4.1).
fn round_small(v: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
    (v + MAGIC) - MAGIC
}

fn quantize_row(x: &[f32]) -> QuantRow {
    let blocks = x.len() / BLOCK;
    let mut row = QuantRow {
        xq: vec![0; x.len()],
        dx: Vec::with_capacity(blocks),
        sum: Vec::with_capacity(blocks),
    };
    for (v, q) in x.chunks_exact(BLOCK).zip(row.xq.chunks_exact_mut(BLOCK)) {
        let amax = v.iter().fold(0f32, |a, &x| a.max(x.abs()));
        let dx = amax / 127.0;
        let inv = if dx > 0.0 { 1.0 / dx } else { 0.0 };
        for (q, &x) in q.iter_mut().zip(v) {
            *q = round_small(x * inv) as i8;
        }
        row.dx.push(dx);
        row.sum.push(v.iter().sum());
    }
    row
}

fn portable_dot(w: &WeightRow, row: &QuantRow) -> f32 {
    let mut acc = 0f32;
    for b in 0..w.scales.len() {
        let xq = &row.xq[b * BLOCK..(b + 1) * BLOCK];
        let mut s = 0i32;
        for (t, &x) in (b * BLOCK..).zip(xq) {
            s += w.code(t) as i32 * x as i32;
        }
        acc += w.scales[b].to_f32() * row.dx[b] * s as f32 + w.mins[b].to_f32() * row.sum[b];
    }
    acc
}

/// Whether this CPU takes the AVX512-VNNI kernel.
fn vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static VNNI: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        *VNNI.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::{QuantRow, QuantWeights, BLOCK, ROWS_AT_ONCE, TILE_N};
    use std::arch::x86_64::*;

    /// Blocks whose scales are multiplied out at once (one register of them).
    const GROUP: usize = 16;

    /// As `portable_dot` for `MI` rows against a tile's weight rows (8-bit codes when
    /// `EIGHT`): per pair of blocks, each weight row's codes loaded once (at 4 bits the 32
    /// bytes in both halves of a register, the upper half shifted down a nibble), then for each input row its 64 integer
    /// products in 16 lanes (`vpdpbusd`; lanes 0-7 the first block's, 8-15 the second's),
    /// scaled by each block's `d·dx` into 16 float lanes. The scales of a group of blocks
    /// stay in a register, the pair's two picked out by one permute (broadcasting them
    /// from a stack copy cost as much as the products), and the minimums' terms `m·Σx` are
    /// added a group of blocks at a time.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    pub(super) unsafe fn tile<const MI: usize, const EIGHT: bool>(
        weights: &QuantWeights,
        rows_j: &[usize; TILE_N],
        rows: &[QuantRow],
        prefetch: bool,
    ) -> [[f32; TILE_N]; ROWS_AT_ONCE] {
        let blocks = weights.k / BLOCK;
        assert!(blocks.is_multiple_of(2) && rows.len() >= MI);
        assert!(rows_j.iter().all(|&j| j < weights.n));
        // Each weight row's codes, scales and minimums by pointer: slices built per tile
        // went through the stack and cost a fifth of the kernel's time in stalled loads.
        assert_eq!(EIGHT, weights.bits == super::Bits::Eight);
        let row_bytes = weights.bits.bytes(weights.k);
        let pair_bytes = weights.bits.bytes(2 * BLOCK);
        // SAFETY: row j < n has `row_bytes` code bytes and `blocks` scales and minimums from
        // these offsets (the layout `QuantWeights::quantize` writes).
        let (codes, scales_f16, mins): ([*const u8; TILE_N], [*const half::f16; TILE_N], _) = unsafe {
            (
                rows_j.map(|j| weights.codes.as_ptr().add(j * row_bytes)),
                rows_j.map(|j| weights.scales.as_ptr().add(j * blocks)),
                rows_j.map(|j| weights.mins.as_ptr().add(j * blocks)),
            )
        };
        for row in &rows[..MI] {
            assert!(row.xq.len() >= blocks * BLOCK);
            assert!(row.dx.len() >= blocks && row.sum.len() >= blocks);
        }
        let nibble = _mm512_set1_epi8(15);
        // Bits each 16-bit lane shifts right: none in the low half, a nibble in the high one.
        let shifts = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
        // Which of a pair's two scales each lane takes, for the pair at blocks 0 and 1.
        let first_pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut acc = [[_mm512_setzero_ps(); TILE_N]; MI];
        for g in (0..blocks).step_by(GROUP) {
            let nb = GROUP.min(blocks - g);
            let mask = (((1u32 << nb) - 1) & 0xffff) as u16;
            // SAFETY (all loads below): blocks g..g + nb of every weight row and input row
            // are in bounds (asserted above); the masked loads touch only those, and nb is
            // even (blocks and GROUP are), so every pair is inside.
            unsafe {
                let dx: [__m512; MI] = std::array::from_fn(|i| {
                    _mm512_maskz_loadu_ps(mask, rows[i].dx.as_ptr().add(g))
                });
                let sum: [__m512; MI] = std::array::from_fn(|i| {
                    _mm512_maskz_loadu_ps(mask, rows[i].sum.as_ptr().add(g))
                });
                let mut scales = [[_mm512_setzero_ps(); TILE_N]; MI];
                for j in 0..TILE_N {
                    let half = |v: *const half::f16| {
                        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, v.add(g).cast()))
                    };
                    let (d, m) = (half(scales_f16[j]), half(mins[j]));
                    for i in 0..MI {
                        scales[i][j] = _mm512_mul_ps(d, dx[i]);
                        acc[i][j] = _mm512_fmadd_ps(m, sum[i], acc[i][j]);
                    }
                }
                for t in (0..nb).step_by(2) {
                    let b = g + t;
                    if prefetch {
                        // The tile's rows lie side by side: walk their bytes in address
                        // order, a pair's share of them each pair.
                        let per_pair = TILE_N * pair_bytes;
                        let done = b / 2 * per_pair;
                        crate::matvec::prefetch_ahead(codes[0], done, done + per_pair);
                    }
                    let pick = _mm512_add_epi32(first_pair, _mm512_set1_epi32(t as i32));
                    let xq: [__m512i; MI] = std::array::from_fn(|i| {
                        _mm512_loadu_si512(rows[i].xq.as_ptr().add(b * BLOCK).cast())
                    });
                    for j in 0..TILE_N {
                        // The first block's codes in the low 256 bits, the second's above.
                        let q = if EIGHT {
                            _mm512_loadu_si512(codes[j].add(b * BLOCK).cast())
                        } else {
                            let packed = _mm512_broadcast_i64x4(_mm256_loadu_si256(
                                codes[j].add(b * BLOCK / 2).cast(),
                            ));
                            _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), nibble)
                        };
                        for i in 0..MI {
                            let products = _mm512_dpbusd_epi32(_mm512_setzero_si512(), q, xq[i]);
                            let scale = _mm512_permutexvar_ps(pick, scales[i][j]);
                            acc[i][j] =
                                _mm512_fmadd_ps(_mm512_cvtepi32_ps(products), scale, acc[i][j]);
                        }
                    }
                }
            }
        }
        let mut out = [[0f32; TILE_N]; ROWS_AT_ONCE];
        for i in 0..MI {
            for j in 0..TILE_N {
                out[i][j] = _mm512_reduce_add_ps(acc[i][j]);
            }
        }
        out
    }
}

/// `x · wᵀ` through a [`QuantWeights`] copy of `w`, for `x: [m, k]` of any float dtype on the
/// CPU; the result in `x`'s dtype.
pub(crate) struct QuantMatMul<'a>(pub &'a QuantWeights);

impl CustomOp1 for QuantMatMul<'_> {
    fn name(&self) -> &'static str {
        "kestrel-matvec-quant"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        if k != self.0.k {
            candle_core::bail!(
                "matvec_quant: x is {m}x{k} but w is {}x{}",
                self.0.n,
                self.0.k
            );
        }
        let x: Vec<f32> = match s {
            CpuStorage::F32(v) => crate::matvec::slice(v, l)?.to_vec(),
            CpuStorage::BF16(v) => crate::matvec::slice(v, l)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            CpuStorage::F16(v) => crate::matvec::slice(v, l)?
                .iter()
                .map(|v| v.to_f32())
                .collect(),
            _ => candle_core::bail!("matvec_quant: unsupported input dtype {:?}", s.dtype()),
        };
        let out = self.0.matmul_nt(&x, m);
        let storage = match s.dtype() {
            DType::BF16 => CpuStorage::BF16(out.iter().map(|&v| bf16::from_f32(v)).collect()),
            DType::F16 => CpuStorage::F16(out.iter().map(|&v| f16::from_f32(v)).collect()),
            _ => CpuStorage::F32(out),
        };
        Ok((storage, Shape::from((m, self.0.n))))
    }
}

/// A linear layer's quantized copy where its steps read it: the host layout for the CPU
/// kernel, or its upload for the CUDA one (`kestrel_kernels::QuantGemvWeights`, the same
/// layout with each block's scale and minimum side by side).
#[derive(Debug)]
pub(crate) enum QuantCopy {
    Cpu(QuantWeights),
    Cuda(QuantGemvWeights),
}

impl QuantCopy {
    /// The `bits`-bit copy of `w: [n, k]` on `w`'s device; `None` where the kernel there
    /// does not take rows of `k` (not a multiple of 64; on CUDA, also past its limit).
    pub fn of(w: &Tensor, bits: Bits) -> candle_core::Result<Option<Self>> {
        let cuda = w.device().is_cuda();
        let k = w.dims2()?.1;
        if cuda && !QuantGemvWeights::takes_rows_of(k) {
            return Ok(None);
        }
        let Some(q) = QuantWeights::quantize(w, bits)? else {
            return Ok(None);
        };
        if !cuda {
            return Ok(Some(QuantCopy::Cpu(q)));
        }
        Ok(Some(QuantCopy::Cuda(q.to_cuda(w.device())?)))
    }

    /// Bytes held (codes, scales and minimums).
    pub fn bytes(&self) -> usize {
        match self {
            QuantCopy::Cpu(q) => q.bytes(),
            QuantCopy::Cuda(q) => q.bytes(),
        }
    }

    /// `x [m, k] · wᵀ` → `[m, n]` in `x`'s dtype.
    pub fn matmul(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        match self {
            QuantCopy::Cpu(q) => x.contiguous()?.apply_op1_no_bwd(&QuantMatMul(q)),
            QuantCopy::Cuda(q) => q.matmul(x),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Value `i` of a fixed pseudo-random sequence, uniform in [-1, 1) (a hash, so that test
    /// products do not cancel the way two periodic sequences can).
    fn uniform(seed: u64, i: usize) -> f32 {
        let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (i as u64 + 1);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn weights(n: usize, k: usize) -> Tensor {
        let v: Vec<f32> = (0..n * k).map(|i| 0.1 * uniform(1, i)).collect();
        Tensor::from_vec(v, (n, k), &Device::Cpu).unwrap()
    }

    fn inputs(m: usize, k: usize) -> Vec<f32> {
        (0..m * k).map(|i| 3.0 * uniform(2, i)).collect()
    }

    /// Weights already on a 16-level grid per block of 32 that spans all 16 levels, as a
    /// Q4_1 GGUF's are (its quantizer maps a block's minimum to code 0 and maximum to 15).
    fn grid_weights(n: usize, k: usize) -> Tensor {
        let v: Vec<f32> = (0..n * k)
            .map(|i| {
                // Steps and minimums exact in f16, as a GGUF's are.
                let step = (1.0 + ((i / BLOCK) % 7) as f32 / 8.0) / 128.0;
                let code = match i % BLOCK {
                    0 => 0.0,
                    1 => 15.0,
                    _ => ((uniform(3, i) + 1.0) * 8.0).floor(),
                };
                step * (code - 7.5)
            })
            .collect();
        Tensor::from_vec(v, (n, k), &Device::Cpu).unwrap()
    }

    /// Every weight comes back within half a step of its block's grid, and weights that were
    /// on a 4-bit grid come back as they were at 4 bits.
    #[test]
    fn codes_reproduce_each_weight() {
        let (n, k) = (5, 192);
        for bits in [Bits::Four, Bits::Eight] {
            for (w, on_grid) in [(weights(n, k), false), (grid_weights(n, k), true)] {
                let exact = on_grid && bits == Bits::Four;
                let q = QuantWeights::quantize(&w, bits).unwrap().unwrap();
                let v = w.to_vec2::<f32>().unwrap();
                for (j, row) in v.iter().enumerate() {
                    for (t, &want) in row.iter().enumerate() {
                        let d = q.scales[(j * k + t) / BLOCK].to_f32();
                        let err = (q.value(j, t) - want).abs();
                        let bound = if exact { 1e-6 } else { d / 2.0 + 1e-6 };
                        assert!(
                            err <= bound,
                            "{bits:?} ({j}, {t}): {} vs {want}",
                            q.value(j, t)
                        );
                    }
                }
            }
        }
    }

    /// The kernel's products equal the dequantized weights against the dequantized inputs
    /// (the integer sums are exact; only the float additions round), on every path.
    #[test]
    fn products_match_the_dequantized_arithmetic() {
        let (n, k) = (37, 576);
        for bits in [Bits::Four, Bits::Eight] {
            let q = QuantWeights::quantize(&weights(n, k), bits)
                .unwrap()
                .unwrap();
            for m in [1, 3, 6] {
                let x = inputs(m, k);
                let got = q.matmul_nt(&x, m);
                for i in 0..m {
                    let row = quantize_row(&x[i * k..(i + 1) * k]);
                    for j in 0..n {
                        let mut want = 0f64;
                        for t in 0..k {
                            let xd = row.dx[t / BLOCK] as f64 * row.xq[t] as f64;
                            let md = q.mins[(j * k + t) / BLOCK].to_f32() as f64;
                            // d·q against the quantized input, the minimum against the exact
                            // one.
                            want += (q.value(j, t) as f64 - md) * xd + md * x[i * k + t] as f64;
                        }
                        let tol = 1e-4 * (1.0 + want.abs());
                        let g = got[i * n + j] as f64;
                        assert!(
                            (g - want).abs() < tol,
                            "{bits:?}, {m} rows ({i}, {j}): {g} vs {want}"
                        );
                        let portable = portable_dot(&q.row(j), &row) as f64;
                        assert!(
                            (portable - want).abs() < tol,
                            "{bits:?}, portable ({i}, {j}): {portable}"
                        );
                    }
                }
            }
        }
    }

    /// The relative error of the kernel's products against the f64 products of `w` with the
    /// same inputs.
    fn relative_error(w: &Tensor, bits: Bits, m: usize) -> f64 {
        let (n, k) = w.dims2().unwrap();
        let q = QuantWeights::quantize(w, bits).unwrap().unwrap();
        let x = inputs(m, k);
        let got = q.matmul_nt(&x, m);
        let v = w.to_vec2::<f32>().unwrap();
        let (mut err, mut norm) = (0f64, 0f64);
        for i in 0..m {
            for j in 0..n {
                let exact: f64 = (0..k).map(|t| v[j][t] as f64 * x[i * k + t] as f64).sum();
                err += (got[i * n + j] as f64 - exact).powi(2);
                norm += exact.powi(2);
            }
        }
        (err / norm).sqrt()
    }

    /// Weights that were 4-bit already lose nothing, so only the inputs' 8 bits remain;
    /// arbitrary weights lose what 16 levels lose (a uniform block's rounding noise is 1/15
    /// of its spread over √12, as the weights' own spread is), or what 256 levels and the
    /// inputs' 8 bits lose.
    #[test]
    fn products_stay_close_to_full_precision() {
        let on_grid = relative_error(&grid_weights(64, 1536), Bits::Four, 2);
        assert!(on_grid < 0.01, "4-bit weights: relative error {on_grid}");
        let four = relative_error(&weights(64, 1536), Bits::Four, 2);
        assert!(
            four < 0.08,
            "arbitrary weights at 4 bits: relative error {four}"
        );
        let eight = relative_error(&weights(64, 1536), Bits::Eight, 2);
        assert!(
            eight < 0.01,
            "arbitrary weights at 8 bits: relative error {eight}"
        );
    }

    #[test]
    fn rows_whose_length_is_not_a_multiple_of_64_stay_unquantized() {
        for bits in [Bits::Four, Bits::Eight] {
            assert!(QuantWeights::quantize(&weights(3, 96), bits)
                .unwrap()
                .is_none());
        }
    }

    #[test]
    fn the_op_keeps_the_input_dtype() {
        let (m, n, k) = (2, 9, 128);
        let q = QuantWeights::quantize(&weights(n, k), Bits::Four)
            .unwrap()
            .unwrap();
        let x = Tensor::from_vec(inputs(m, k), (m, k), &Device::Cpu).unwrap();
        let f = x.apply_op1_no_bwd(&QuantMatMul(&q)).unwrap();
        let b = x
            .to_dtype(DType::BF16)
            .unwrap()
            .apply_op1_no_bwd(&QuantMatMul(&q))
            .unwrap();
        assert_eq!(b.dtype(), DType::BF16);
        assert_eq!(f.dims(), &[m, n]);
        let (f, b) = (
            f.to_vec2::<f32>().unwrap(),
            b.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap(),
        );
        for i in 0..m {
            for j in 0..n {
                assert!((f[i][j] - b[i][j]).abs() <= 0.02 * (1.0 + f[i][j].abs()));
            }
        }
    }
}

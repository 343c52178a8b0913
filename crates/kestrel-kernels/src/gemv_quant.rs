//! A weight matrix at 4 or 8 bits on a CUDA device and the gemv that reads it
//! ([`QuantGemvWeights`]), for a draft that is the target itself at a third of its weight
//! bytes (kestrel-model's `matvec_quant.rs`: the layout, the CPU kernel, and why). On a GPU
//! a large model's decode step is bound by the bytes its weights take, so such a draft step
//! costs about what its bytes do.
//!
//! The kernel (`gemv_quant.cuh`) takes any number of rows: a block quantizes
//! [`QUANT_GEMV_ROWS`] input rows into shared memory, and the blocks of one column group,
//! which read the same weights for different rows, run side by side and share them in L2.

use candle_core::{DType, Device, Result, Tensor};
use half::f16;

/// Weights sharing one scale and minimum, along a row.
pub const QUANT_GEMV_BLOCK: usize = 32;
/// Input rows one block of the kernel quantizes and serves (`QG_ROWS`).
pub const QUANT_GEMV_ROWS: usize = 2;
/// Bytes of shared memory a block stages its rows in, at most (a launch's default limit).
const STAGE_MAX_BYTES: usize = 48 * 1024;

/// Bytes a block stages for rows of `k` inputs: `QG_ROWS` rows of i8, then their scales and
/// sums (f32 a block of 32 each).
fn stage_bytes(k: usize) -> usize {
    QUANT_GEMV_ROWS * (k + 8 * (k / QUANT_GEMV_BLOCK))
}

/// A `[n, k]` matrix at `bits` bits on a CUDA device: `codes` u8 `[n, k · bits / 8]` and `dm`
/// f16 `[n, 2 · k / 32]` (each block's scale, then its minimum).
#[derive(Debug, Clone)]
pub struct QuantGemvWeights {
    bits: u32,
    n: usize,
    k: usize,
    codes: Tensor,
    dm: Tensor,
}

impl QuantGemvWeights {
    /// Uploads a matrix held as `matvec_quant.rs` holds it (codes row after row, a block's
    /// scale in `scales` and minimum in `mins`) to the CUDA `device`; `k` must pass
    /// [`QuantGemvWeights::takes_rows_of`] (multiples of 64 up to 19,648).
    pub fn new(
        bits: u32,
        (n, k): (usize, usize),
        codes: &[u8],
        scales: &[f16],
        mins: &[f16],
        device: &Device,
    ) -> Result<Self> {
        if bits != 4 && bits != 8 {
            candle_core::bail!("quantized gemv: {bits}-bit codes (4 or 8 expected)");
        }
        if !Self::takes_rows_of(k) {
            candle_core::bail!(
                "quantized gemv: rows of {k} weights (a multiple of 64, at most 19,648)"
            );
        }
        let blocks = n * k / QUANT_GEMV_BLOCK;
        let row_bytes = k * bits as usize / 8;
        if codes.len() != n * row_bytes || scales.len() != blocks || mins.len() != blocks {
            candle_core::bail!(
                "quantized gemv: {} code bytes, {} scales and {} minimums for {n}x{k} at {bits} bits",
                codes.len(),
                scales.len(),
                mins.len()
            );
        }
        if !device.is_cuda() {
            candle_core::bail!("quantized gemv: the weights go to a CUDA device");
        }
        let dm: Vec<f16> = scales
            .iter()
            .zip(mins)
            .flat_map(|(&d, &m)| [d, m])
            .collect();
        Ok(QuantGemvWeights {
            bits,
            n,
            k,
            codes: Tensor::from_slice(codes, (n, row_bytes), device)?,
            dm: Tensor::from_vec(dm, (n, 2 * k / QUANT_GEMV_BLOCK), device)?,
        })
    }

    /// Whether the kernel takes weight rows of `k` values: a multiple of 64 (a pair of
    /// blocks) whose staged input rows fit a block's shared memory.
    pub fn takes_rows_of(k: usize) -> bool {
        k > 0 && k.is_multiple_of(2 * QUANT_GEMV_BLOCK) && stage_bytes(k) <= STAGE_MAX_BYTES
    }

    /// Bits a weight's code takes (4 or 8).
    pub fn bits(&self) -> u32 {
        self.bits
    }

    /// Whether [`QuantGemvWeights::matmul`] takes `x`: `[m, k]` (m ≥ 1) of f32, f16 or bf16 on
    /// the weights' device.
    pub fn applies(&self, x: &Tensor) -> bool {
        x.dims2().is_ok_and(|(m, k)| m >= 1 && k == self.k)
            && matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
            && x.device().same_device(self.codes.device())
    }

    /// `x [m, k] · wᵀ` → `[m, n]` in `x`'s dtype, with f32 sums of integer block products
    /// (each input row quantized per block of 32 to i8, as on the CPU). Check
    /// [`QuantGemvWeights::applies`] first.
    pub fn matmul(&self, x: &Tensor) -> Result<Tensor> {
        if !self.applies(x) {
            candle_core::bail!(
                "quantized gemv: x {:?} {:?} against {}x{} weights on {:?}",
                x.dims(),
                x.dtype(),
                self.n,
                self.k,
                self.codes.device().location()
            );
        }
        #[cfg(feature = "cuda")]
        {
            // The kernel reads the rows as 16-byte vectors from their start.
            let x = x.contiguous()?;
            let size = x.dtype().size_in_bytes();
            let aligned = x
                .layout()
                .contiguous_offsets()
                .is_some_and(|(start, _)| (start * size).is_multiple_of(16));
            let x = if aligned { x } else { x.copy()? };
            x.apply_op3_no_bwd(
                &self.codes,
                &self.dm,
                &cuda::GemvQuant {
                    bits: self.bits,
                    n: self.n,
                    k: self.k,
                },
            )
        }
        #[cfg(not(feature = "cuda"))]
        crate::no_cuda("quantized gemv")
    }

    /// Device bytes held (codes, scales and minimums).
    pub fn bytes(&self) -> usize {
        self.codes.elem_count() + 2 * self.dm.elem_count()
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{stage_bytes, QUANT_GEMV_ROWS};
    use crate::cuda::{by_dtype, view};
    use crate::launch::{load_kernel, multiprocessors};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::LaunchConfig;
    use candle_core::cuda::CudaDType;
    use candle_core::{bail, CpuStorage, CudaStorage, CustomOp3, DType, Layout, Result, Shape};
    use half::{bf16, f16};

    /// Warps a block (`QG_WARPS`).
    const WARPS: usize = 8;
    /// Blocks a multiprocessor the grid aims at: as many as fit at once (the kernels take
    /// 88-113 registers a thread, two passes of loads in flight; `__launch_bounds__` holds
    /// them to 128, two blocks), so there is no second wave.
    const BLOCKS_PER_SM: usize = 2;

    /// Columns a warp reads side by side (`COLS`): the most of 4 and 2 with which the `n`
    /// columns still make 90% of `target` blocks (a column group each warp), else 1. Side by
    /// side, the columns share each piece's staged inputs, the kernel's largest instruction
    /// cost; but fewer blocks would leave multiprocessors without the warps that hide the
    /// loads.
    fn columns_at_once(n: usize, target: usize) -> usize {
        [4, 2]
            .into_iter()
            .find(|&cols| n.div_ceil(cols * WARPS) * 10 >= target * 9)
            .unwrap_or(1)
    }

    pub(crate) struct GemvQuant {
        pub bits: u32,
        pub n: usize,
        pub k: usize,
    }

    impl GemvQuant {
        fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
            &self,
            (x, xl): (&CudaStorage, &Layout),
            (codes, cl): (&CudaStorage, &Layout),
            (dm, dl): (&CudaStorage, &Layout),
            sfx: &str,
        ) -> Result<CudaStorage> {
            let dev = x.device().clone();
            let (m, _) = xl.shape().dims2()?;
            let xv = view::<T>(x, xl, "quantized gemv input")?;
            let cv = view::<u8>(codes, cl, "quantized gemv codes")?;
            let dv = view::<f16>(dm, dl, "quantized gemv scales")?;
            // SAFETY: every (row, column) of the output is written by the warp owning the
            // column in the block owning the row.
            let out = unsafe { dev.alloc::<T>(m * self.n)? };
            let groups = m.div_ceil(QUANT_GEMV_ROWS);
            // Column groups a warp takes, so that the grid is about BLOCKS_PER_SM blocks a
            // multiprocessor and every warp has as many as the next.
            let target = (multiprocessors(&dev)? * BLOCKS_PER_SM / groups).max(1);
            let cols = columns_at_once(self.n, target);
            let func = load_kernel(&dev, &format!("kestrel_gemv_q{}_c{cols}_{sfx}", self.bits))?;
            let per_warp = self.n.div_ceil(cols * WARPS * target).max(1);
            let column_blocks = self.n.div_ceil(cols * WARPS * per_warp);
            let (Ok(groups), Ok(column_blocks)) =
                (u32::try_from(groups), u16::try_from(column_blocks))
            else {
                bail!(
                    "quantized gemv: {m} rows of {} columns exceed one launch",
                    self.n
                )
            };
            let (m_a, n_a, k_a) = (m as i32, self.n as i32, self.k as i32);
            let mut b = func.builder();
            b.arg(&xv)
                .arg(&cv)
                .arg(&dv)
                .arg(&out)
                .arg(&m_a)
                .arg(&n_a)
                .arg(&k_a);
            let cfg = LaunchConfig {
                grid_dim: (groups, column_blocks as u32, 1),
                block_dim: ((WARPS * 32) as u32, 1, 1),
                shared_mem_bytes: stage_bytes(self.k) as u32,
            };
            // SAFETY: the parameters match kestrel_gemv_q{4,8}_* (three pointers in, one out,
            // three ints); the tensors hold m·k inputs, n rows of codes and of (d, m) pairs
            // (checked when the weights were made), and the output m·n values.
            unsafe { b.launch(cfg) }?;
            Ok(CudaStorage::wrap_cuda_slice(out, dev))
        }
    }

    impl CustomOp3 for GemvQuant {
        fn name(&self) -> &'static str {
            "kestrel-gemv-quant"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("the quantized gemv kernel runs on CUDA only")
        }

        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            xl: &Layout,
            codes: &CudaStorage,
            cl: &Layout,
            dm: &CudaStorage,
            dl: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            if codes.dtype() != DType::U8 || dm.dtype() != DType::F16 {
                bail!("quantized gemv: u8 codes and f16 scales expected");
            }
            let (m, _) = xl.shape().dims2()?;
            let out = by_dtype!(x.dtype(), "quantized gemv", |T, sfx| self.run::<T>(
                (x, xl),
                (codes, cl),
                (dm, dl),
                sfx
            )?);
            Ok((out, Shape::from((m, self.n))))
        }
    }
}

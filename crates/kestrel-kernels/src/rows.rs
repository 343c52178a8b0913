//! Row gather and scatter along dim 0, for any dtype ([`gather_rows`], [`scatter_rows`]).
//!
//! On CUDA they launch `rows.cuh`'s kernels instead of candle's `index_select` and
//! `scatter_set`: the first use of candle's indexing module grows the process's device memory
//! by ~90 MiB on the H200 (docs/gpu-results.md, session 15), a third of SmolLM2's weights,
//! and a decode step needs nothing else from it. On the CPU they are candle's ops, so callers
//! have one path for both devices.

use candle_core::{DType, Result, Tensor};

/// `src`'s rows at `ids` (u32 `[n]`): `[n, src.dims()[1..]]`. An id past `src`'s rows gives a
/// zero row on CUDA (candle's CPU `index_select` reports it as an error).
pub fn gather_rows(src: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let n = check_ids(ids, "gather_rows")?;
    if src.rank() == 0 {
        candle_core::bail!("gather_rows: a scalar has no rows");
    }
    if !src.device().is_cuda() {
        return src.index_select(ids, 0);
    }
    if n == 0 {
        return src.narrow(0, 0, 0);
    }
    #[cfg(feature = "cuda")]
    {
        src.contiguous()?
            .apply_op2_no_bwd(&ids.contiguous()?, &cuda::GatherRows)
    }
    #[cfg(not(feature = "cuda"))]
    crate::no_cuda("gather_rows")
}

/// Writes `rows` (`[n, dst.dims()[1..]]`) over `dst`'s rows at `ids` (u32 `[n]`), in place. On
/// CUDA an id past `dst`'s rows writes nothing; with an id given twice, either row may win.
pub fn scatter_rows(dst: &Tensor, ids: &Tensor, rows: &Tensor) -> Result<()> {
    let n = check_ids(ids, "scatter_rows")?;
    if dst.rank() == 0 || rows.dims().first() != Some(&n) || rows.dims()[1..] != dst.dims()[1..] {
        candle_core::bail!(
            "scatter_rows: rows {:?} for {n} ids into {:?}",
            rows.dims(),
            dst.dims()
        );
    }
    if rows.dtype() != dst.dtype() {
        candle_core::bail!(
            "scatter_rows: {:?} rows into a {:?} tensor",
            rows.dtype(),
            dst.dtype()
        );
    }
    if n == 0 {
        return Ok(());
    }
    if !dst.device().is_cuda() {
        // candle's scatter takes an index as wide as the rows.
        let index = ids.reshape((n, 1))?.broadcast_as(rows.shape())?;
        return dst.scatter_set(&index.contiguous()?, &rows.contiguous()?, 0);
    }
    #[cfg(feature = "cuda")]
    {
        dst.inplace_op3(&rows.contiguous()?, &ids.contiguous()?, &cuda::ScatterRows)
    }
    #[cfg(not(feature = "cuda"))]
    crate::no_cuda("scatter_rows")
}

/// The number of ids, which must be a u32 vector.
fn check_ids(ids: &Tensor, what: &str) -> Result<usize> {
    match (ids.dims(), ids.dtype()) {
        (&[n], DType::U32) => Ok(n),
        (dims, dtype) => candle_core::bail!("{what}: u32 [n] ids expected, got {dtype:?} {dims:?}"),
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use crate::launch::load_kernel;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::{DevicePtr, LaunchConfig};
    use candle_core::{
        bail, CpuStorage, CudaDevice, CudaStorage, CustomOp2, DType, InplaceOp3, Layout, Result,
        Shape,
    };

    /// `$body` with `$t` the Rust element type of a dtype candle's CUDA backend stores.
    macro_rules! by_elem {
        ($dtype:expr, |$t:ident| $body:expr) => {
            match $dtype {
                DType::U8 => {
                    type $t = u8;
                    $body
                }
                DType::U32 => {
                    type $t = u32;
                    $body
                }
                DType::I64 => {
                    type $t = i64;
                    $body
                }
                DType::F16 => {
                    type $t = half::f16;
                    $body
                }
                DType::BF16 => {
                    type $t = half::bf16;
                    $body
                }
                DType::F32 => {
                    type $t = f32;
                    $body
                }
                DType::F64 => {
                    type $t = f64;
                    $body
                }
                other => bail!("row gather and scatter do not support {other:?}"),
            }
        };
    }

    /// The device address of a contiguous tensor's first element.
    fn address(s: &CudaStorage, l: &Layout, what: &str) -> Result<u64> {
        let Some((start, _)) = l.contiguous_offsets() else {
            bail!("{what} must be contiguous")
        };
        let stream = s.device().cuda_stream();
        // The address only: candle's one stream orders the kernel after every earlier use.
        let base = by_elem!(s.dtype(), |T| s.as_cuda_slice::<T>()?.device_ptr(&stream).0);
        Ok(base + (start * s.dtype().size_in_bytes()) as u64)
    }

    /// One launch of `kestrel_{op}_rows_w*` moving `n` rows of `row_bytes` between `rows_at`
    /// (`n` rows, in id order) and `table_at` (`table_rows` rows, addressed by the ids).
    struct RowCopy {
        n: usize,
        row_bytes: usize,
        table_rows: usize,
    }

    impl RowCopy {
        fn launch(
            &self,
            dev: &CudaDevice,
            op: &str,
            (first, second): (u64, u64),
            ids: u64,
        ) -> Result<()> {
            // The widest word dividing the rows and both tensors' starts (cudaMalloc'd
            // buffers are 256-byte aligned; a view may start anywhere).
            let all = self.row_bytes as u64 | first | second;
            let (word, sfx) = match () {
                _ if all.is_multiple_of(16) => (16, "w16"),
                _ if all.is_multiple_of(4) => (4, "w4"),
                _ if all.is_multiple_of(2) => (2, "w2"),
                _ => bail!("{op} rows: rows of {} bytes", self.row_bytes),
            };
            let width = self.row_bytes / word;
            let total = self.n * width;
            let (Ok(table_rows), Ok(width_a)) =
                (u32::try_from(self.table_rows), i32::try_from(width))
            else {
                bail!(
                    "{op} rows: {} rows of {} bytes exceed the kernel's 32-bit counts",
                    self.table_rows,
                    self.row_bytes
                )
            };
            const THREADS: usize = 256;
            let Ok(blocks) = u32::try_from(total.div_ceil(THREADS)) else {
                bail!("{op} rows: {total} words exceed one launch")
            };
            let func = load_kernel(dev, &format!("kestrel_{op}_rows_{sfx}"))?;
            let mut b = func.builder();
            b.arg(&first);
            b.arg(&second);
            b.arg(&ids);
            b.arg(&total);
            b.arg(&table_rows);
            b.arg(&width_a);
            let cfg = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (THREADS as u32, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the parameters match kestrel_{gather,scatter}_rows_w* (pointers, size_t,
            // unsigned int, int); both tensors hold the rows the counts
            // say, in words of `word` bytes at aligned addresses, and the kernel checks every
            // id against `table_rows`.
            unsafe { b.launch(cfg) }
        }
    }

    pub(crate) struct GatherRows;

    impl CustomOp2 for GatherRows {
        fn name(&self) -> &'static str {
            "kestrel-gather-rows"
        }

        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            bail!("kestrel gather rows runs on CUDA only (the CPU takes candle's index_select)")
        }

        fn cuda_fwd(
            &self,
            src: &CudaStorage,
            sl: &Layout,
            ids: &CudaStorage,
            il: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let dims = sl.shape().dims();
            let n = il.shape().elem_count();
            let row_elems: usize = dims[1..].iter().product();
            let dev = src.device().clone();
            let copy = RowCopy {
                n,
                row_bytes: row_elems * src.dtype().size_in_bytes(),
                table_rows: dims[0],
            };
            let mut shape = dims.to_vec();
            shape[0] = n;
            let src_at = address(src, sl, "gathered tensor")?;
            let ids_at = address(ids, il, "row ids")?;
            let out = by_elem!(src.dtype(), |T| {
                // SAFETY: the kernel writes every element (a zero row for an id out of range).
                let out = unsafe { dev.alloc::<T>(n * row_elems)? };
                let stream = dev.cuda_stream();
                let out_at = out.device_ptr(&stream).0;
                copy.launch(&dev, "gather", (src_at, out_at), ids_at)?;
                CudaStorage::wrap_cuda_slice(out, dev.clone())
            });
            Ok((out, Shape::from(shape)))
        }
    }

    pub(crate) struct ScatterRows;

    impl InplaceOp3 for ScatterRows {
        fn name(&self) -> &'static str {
            "kestrel-scatter-rows"
        }

        fn cpu_fwd(
            &self,
            _: &mut CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<()> {
            bail!("kestrel scatter rows runs on CUDA only (the CPU takes candle's scatter_set)")
        }

        fn cuda_fwd(
            &self,
            dst: &mut CudaStorage,
            dl: &Layout,
            rows: &CudaStorage,
            rl: &Layout,
            ids: &CudaStorage,
            il: &Layout,
        ) -> Result<()> {
            let dims = dl.shape().dims();
            let copy = RowCopy {
                n: il.shape().elem_count(),
                row_bytes: dims[1..].iter().product::<usize>() * dst.dtype().size_in_bytes(),
                table_rows: dims[0],
            };
            let dst_at = address(dst, dl, "scattered-into tensor")?;
            let rows_at = address(rows, rl, "scattered rows")?;
            let ids_at = address(ids, il, "row ids")?;
            copy.launch(&dst.device().clone(), "scatter", (dst_at, rows_at), ids_at)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn table() -> Tensor {
        Tensor::arange(0f32, 12., &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap()
    }

    #[test]
    fn cpu_rows_are_candles_ops() {
        let t = table();
        let ids = Tensor::new(&[3u32, 0, 3], &Device::Cpu).unwrap();
        let got = gather_rows(&t, &ids).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(got, [[9., 10., 11.], [0., 1., 2.], [9., 10., 11.]]);
        let rows = Tensor::new(&[[-1f32, -2., -3.], [-4., -5., -6.]], &Device::Cpu).unwrap();
        scatter_rows(&t, &Tensor::new(&[2u32, 0], &Device::Cpu).unwrap(), &rows).unwrap();
        assert_eq!(
            t.to_vec2::<f32>().unwrap(),
            [
                [-4., -5., -6.],
                [3., 4., 5.],
                [-1., -2., -3.],
                [9., 10., 11.]
            ]
        );
    }

    /// The error's message (candle appends a backtrace when RUST_BACKTRACE is set).
    fn message(r: Result<impl std::fmt::Debug>) -> String {
        let e = r.unwrap_err().to_string();
        e.lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn bad_ids_and_rows_are_named() {
        let t = table();
        let i64_ids = Tensor::new(&[1i64], &Device::Cpu).unwrap();
        assert_eq!(
            message(gather_rows(&t, &i64_ids)),
            "gather_rows: u32 [n] ids expected, got I64 [1]"
        );
        let ids = Tensor::new(&[1u32, 2], &Device::Cpu).unwrap();
        let wide = Tensor::zeros((2, 4), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            message(scatter_rows(&t, &ids, &wide)),
            "scatter_rows: rows [2, 4] for 2 ids into [4, 3]"
        );
        let f16_rows = Tensor::zeros((2, 3), DType::F16, &Device::Cpu).unwrap();
        assert_eq!(
            message(scatter_rows(&t, &ids, &f16_rows)),
            "scatter_rows: F16 rows into a F32 tensor"
        );
    }
}

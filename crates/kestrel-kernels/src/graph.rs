//! CUDA graphs of whole model steps on candle's stream, and the in-place host uploads that
//! feed them.
//!
//! A decode step of a small model is hundreds of tiny launches, each costing more host time
//! than GPU time. Captured once per step shape and replayed, the step becomes one launch.
//! What changes between replays (token ids, positions, slot tables) must live in device
//! buffers the graph reads: [`upload_into`] overwrites them in place before each launch.
//!
//! Capture rules the caller must keep (checked by CUDA where it can):
//! - no host↔device copy inside the captured closure, except candle's small constant uploads
//!   (shapes, strides), which [`capture`] serves from candle's capture cache: run the same
//!   closure once under [`with_upload_cache`] first to fill it;
//! - no tensor allocated before the capture may be dropped inside it (its free would be
//!   replayed), and every tensor allocated inside it must be dropped inside it, so the graph
//!   owns no memory after a replay;
//! - every device pointer the graph reads or writes (weights, KV pools, input buffers) must
//!   outlive it and never move.

use candle_core::{Device, Result, Tensor, WithDType};

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
    use candle_core::cuda::cudarc::driver::{CudaGraph, DeviceRepr};
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::{
        bail, CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Result, Tensor, WithDType,
    };

    /// A captured step, replayed with [`StepGraph::launch`].
    pub struct StepGraph(CudaGraph);

    // SAFETY: a CUDA graph may be launched from any thread as long as calls on it are
    // serialised; `launch` takes `&mut self`, so Rust's borrow rules serialise them.
    unsafe impl Send for StepGraph {}

    impl StepGraph {
        pub fn launch(&mut self) -> Result<()> {
            self.0.launch().w()
        }
    }

    fn cuda(device: &Device) -> Result<&candle_core::CudaDevice> {
        match device {
            Device::Cuda(d) => Ok(d),
            _ => bail!("CUDA graphs need a CUDA device"),
        }
    }

    pub fn with_upload_cache<R>(device: &Device, f: impl FnOnce() -> R) -> Result<R> {
        let _guard = cuda(device)?.enable_cuda_graph_htod_cache();
        Ok(f())
    }

    pub fn capture<R, E: From<candle_core::Error>>(
        device: &Device,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> std::result::Result<(StepGraph, R), E> {
        let dev = cuda(device)?;
        let stream = dev.cuda_stream();
        let _guard = dev.enable_cuda_graph_htod_cache();
        stream
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let result = f();
        // The capture always ends, so a failed closure leaves the stream usable.
        let graph = stream.end_capture(CUgraphInstantiate_flags(0)).w();
        let r = result?;
        match graph? {
            Some(g) => Ok((StepGraph(g), r)),
            None => {
                Err(candle_core::Error::Msg("CUDA graph capture recorded nothing".into()).into())
            }
        }
    }

    struct Upload<'a, T> {
        host: &'a [T],
        offset: usize,
    }

    impl<T: WithDType + CudaDType + DeviceRepr> InplaceOp1 for Upload<'_, T> {
        fn name(&self) -> &'static str {
            "kestrel-upload"
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
            bail!("upload_into is for CUDA tensors")
        }

        fn cuda_fwd(&self, s: &mut CudaStorage, l: &Layout) -> Result<()> {
            let Some((start, end)) = l.contiguous_offsets() else {
                bail!("upload_into: the destination must be contiguous")
            };
            let (a, b) = (start + self.offset, start + self.offset + self.host.len());
            if b > end {
                bail!(
                    "upload_into: {} values at offset {} overflow a buffer of {}",
                    self.host.len(),
                    self.offset,
                    end - start
                );
            }
            let stream = s.device().cuda_stream();
            let mut view = s.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
            // Straight to the stream, not through candle's device: its capture cache would
            // keep a device copy of every distinct small upload.
            stream.memcpy_htod(self.host, &mut view).w()
        }
    }

    pub fn upload_into<T: WithDType + CudaDType + DeviceRepr>(
        dst: &Tensor,
        offset: usize,
        host: &[T],
    ) -> Result<()> {
        if dst.dtype() != T::DTYPE {
            bail!(
                "upload_into: {:?} values into a {:?} buffer",
                T::DTYPE,
                dst.dtype()
            );
        }
        dst.inplace_op1(&Upload { host, offset })
    }
}

#[cfg(feature = "cuda")]
pub use imp::StepGraph;

/// A captured step (this build has no CUDA: none can exist).
#[cfg(not(feature = "cuda"))]
pub struct StepGraph(());

#[cfg(not(feature = "cuda"))]
impl StepGraph {
    pub fn launch(&mut self) -> Result<()> {
        crate::no_cuda("CUDA graphs")
    }
}

/// Runs `f` with candle's capture cache on, so the small constant uploads of the ops it runs
/// are kept on the device for a later [`capture`] of the same ops.
pub fn with_upload_cache<R>(device: &Device, f: impl FnOnce() -> R) -> Result<R> {
    #[cfg(feature = "cuda")]
    {
        imp::with_upload_cache(device, f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, f);
        crate::no_cuda("CUDA graphs")
    }
}

/// Records what `f` launches on `device`'s stream as a graph instead of running it; returns
/// the graph and `f`'s result (tensors whose contents exist only once the graph runs).
pub fn capture<R, E: From<candle_core::Error>>(
    device: &Device,
    f: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<(StepGraph, R), E> {
    #[cfg(feature = "cuda")]
    {
        imp::capture(device, f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, f);
        crate::no_cuda("CUDA graphs").map_err(E::from)
    }
}

/// Element types a step uploads ([`upload_into`]): u32 ids and tables, f32 RoPE values.
#[cfg(feature = "cuda")]
pub trait UploadElem:
    WithDType + candle_core::cuda::CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr
{
}
/// Element types a step uploads ([`upload_into`]): u32 ids and tables, f32 RoPE values.
#[cfg(not(feature = "cuda"))]
pub trait UploadElem: WithDType {}
impl UploadElem for u32 {}
impl UploadElem for f32 {}

/// Copies `host` into the contiguous CUDA tensor `dst` at element `offset`, in place and in
/// stream order (so a graph launched after it reads the new values).
pub fn upload_into<T: UploadElem>(dst: &Tensor, offset: usize, host: &[T]) -> Result<()> {
    #[cfg(feature = "cuda")]
    {
        imp::upload_into(dst, offset, host)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dst, offset, host);
        crate::no_cuda("upload_into")
    }
}

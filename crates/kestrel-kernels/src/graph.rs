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
    use crate::graph_arena::relocate;
    use crate::RelocationStats;
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::driver::sys::{self, CUstreamCaptureMode};
    use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::{
        bail, CpuStorage, CudaStorage, Device, InplaceOp1, Layout, Result, Tensor, WithDType,
    };
    use std::sync::Arc;

    /// A captured step, replayed with [`StepGraph::launch`].
    pub struct StepGraph {
        exec: sys::CUgraphExec,
        stream: Arc<CudaStream>,
        /// Where the step's activations live when they were moved out of the driver's graph
        /// pool (kept alive for as long as the graph may run).
        _arena: Option<Arc<CudaSlice<u8>>>,
        relocation: Option<RelocationStats>,
    }

    // SAFETY: a CUDA graph may be launched from any thread as long as calls on it are
    // serialised; `launch` takes `&mut self`, so Rust's borrow rules serialise them.
    unsafe impl Send for StepGraph {}

    impl StepGraph {
        pub fn launch(&mut self) -> Result<()> {
            self.stream.context().bind_to_thread().w()?;
            // SAFETY: `exec` is a live instantiation on this stream's context; the memory it
            // touches (weights, KV pools, input buffers, the arena) outlives it.
            unsafe { sys::cuGraphLaunch(self.exec, self.stream.cu_stream()).result() }.w()
        }

        /// What moving the step's allocations into its arena did; None when the driver's
        /// graph pool serves them ([`set_graph_arena`](crate::set_graph_arena) off).
        pub fn relocation(&self) -> Option<RelocationStats> {
            self.relocation
        }
    }

    impl Drop for StepGraph {
        fn drop(&mut self) {
            let ctx = self.stream.context();
            // SAFETY: destroyed once; a replay still running completes first (CUDA defers it).
            ctx.record_err(unsafe { sys::cuGraphExecDestroy(self.exec).result() });
        }
    }

    /// The buffer a model's captured steps keep their activations in. Its steps run one at a
    /// time on one stream and keep nothing past their end, so all can share it; a step that
    /// needs more than it holds gets a bigger one, and the graphs captured before keep theirs.
    #[derive(Default)]
    pub struct GraphArena(Option<Arc<CudaSlice<u8>>>);

    impl GraphArena {
        /// A buffer of at least `bytes` (rounded up to 1 MiB, so that a few larger steps do
        /// not each grow it).
        fn at_least(&mut self, stream: &Arc<CudaStream>, bytes: u64) -> Result<Arc<CudaSlice<u8>>> {
            if let Some(buf) = self.0.as_ref().filter(|b| b.len() as u64 >= bytes) {
                return Ok(buf.clone());
            }
            let size = bytes.div_ceil(1 << 20) << 20;
            // SAFETY: the arena is written by a step before it is read (it holds what the
            // step allocated), like the allocations it replaces.
            let buf = Arc::new(unsafe { stream.alloc::<u8>(size as usize) }.w()?);
            self.0 = Some(buf.clone());
            Ok(buf)
        }

        /// Bytes held now.
        pub fn bytes(&self) -> usize {
            self.0.as_ref().map_or(0, |b| b.len())
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

    /// Destroys a graph template when dropped (it is not needed once instantiated).
    struct Template(sys::CUgraph);

    impl Drop for Template {
        fn drop(&mut self) {
            // SAFETY: a graph this module created, destroyed once.
            unsafe { sys::cuGraphDestroy(self.0) };
        }
    }

    pub fn capture<R, E: From<candle_core::Error>>(
        device: &Device,
        arena: &mut GraphArena,
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
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: ends the capture this function began on this stream.
        let ended = unsafe { sys::cuStreamEndCapture(stream.cu_stream(), &mut graph).result() };
        let template = (!graph.is_null()).then(|| Template(graph));
        let r = result?;
        ended.w()?;
        let Some(template) = template else {
            return Err(
                candle_core::Error::Msg("CUDA graph capture recorded nothing".into()).into(),
            );
        };
        let mut template = template;
        let (mut kept, mut relocation) = (None, None);
        if crate::graph_arena() {
            // SAFETY: the template was just captured on this context; the arena its copy is
            // given is kept by the StepGraph for as long as it exists.
            let copy = unsafe {
                relocate(template.0, crate::dependent_launch_on(device)?, |bytes| {
                    let buf = arena.at_least(&stream, bytes)?;
                    let (base, _sync) = buf.device_ptr(&stream);
                    kept = Some(buf.clone());
                    Ok(base)
                })
            }?;
            if let Some((graph, stats)) = copy {
                template = Template(graph);
                relocation = Some(stats);
            }
        }
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: instantiates the template on the current context.
        unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, template.0, 0).result() }.w()?;
        if relocation.is_some() {
            // Capturing reserved graph-pool memory for the allocation nodes since removed:
            // give back what no graph uses.
            // SAFETY: a plain driver call on the stream's device.
            unsafe { sys::cuDeviceGraphMemTrim(stream.context().cu_device()).result() }.w()?;
        }
        Ok((
            StepGraph {
                exec,
                stream,
                _arena: kept,
                relocation,
            },
            r,
        ))
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
pub use imp::{GraphArena, StepGraph};

/// A captured step (this build has no CUDA: none can exist).
#[cfg(not(feature = "cuda"))]
pub struct StepGraph(());

#[cfg(not(feature = "cuda"))]
impl StepGraph {
    pub fn launch(&mut self) -> Result<()> {
        crate::no_cuda("CUDA graphs")
    }

    pub fn relocation(&self) -> Option<crate::RelocationStats> {
        None
    }
}

/// The buffer a model's captured steps keep their activations in (this build has no CUDA:
/// it stays empty).
#[cfg(not(feature = "cuda"))]
#[derive(Default)]
pub struct GraphArena(());

#[cfg(not(feature = "cuda"))]
impl GraphArena {
    /// Bytes held now.
    pub fn bytes(&self) -> usize {
        0
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
/// the graph and `f`'s result (tensors whose contents exist only once the graph runs). With
/// [`set_graph_arena`](crate::set_graph_arena) on (the default), what the step allocates is
/// moved into `arena`, which the graph keeps alive (`graph_arena.rs`), so a replay takes no
/// memory from the driver's graph pool.
pub fn capture<R, E: From<candle_core::Error>>(
    device: &Device,
    arena: &mut GraphArena,
    f: impl FnOnce() -> std::result::Result<R, E>,
) -> std::result::Result<(StepGraph, R), E> {
    #[cfg(feature = "cuda")]
    {
        imp::capture(device, arena, f)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, arena, f);
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

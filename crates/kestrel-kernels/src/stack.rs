//! The per-thread stack a CUDA context reserves for every thread the GPU can hold.
//!
//! The driver keeps `stack limit × resident threads` of device memory for the life of the
//! context: at the default 1 KiB on an H200 (132 multiprocessors × 2,048 threads) that is
//! 264 MiB, more than SmolLM2's weights, whatever runs. Kestrel's largest frame is
//! `kestrel_topk_logp_f32`'s 256 bytes (ptxas; every other kernel has none), so the limit is
//! set to that: 66 MiB. A kernel with a larger frame (a library's) still launches: the driver
//! raises the limit for it and keeps the new size (`cuCtxSetLimit`'s documentation).
//! Measured on the H200 (real SmolLM2, bf16): the process's device memory 1,073 → 875 MiB.

use candle_core::{Device, Result};

/// The per-thread stack [`limit_thread_stack`] sets: the largest frame among Kestrel's
/// kernels.
pub const THREAD_STACK_BYTES: usize = 256;

/// Opens CUDA device `ordinal` with its per-thread stack limited ([`limit_thread_stack`]):
/// how Kestrel opens a device, so that no opener can forget the limit.
pub fn open_cuda(ordinal: usize) -> Result<Device> {
    let device = Device::new_cuda(ordinal)?;
    limit_thread_stack(&device)?;
    Ok(device)
}

/// Sets `device`'s per-thread stack limit to [`THREAD_STACK_BYTES`] (nothing on the CPU).
/// [`open_cuda`] calls it; call it yourself only on a device opened otherwise.
pub fn limit_thread_stack(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda::cudarc::driver::sys;
        use candle_core::cuda::WrapErr;
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        // SAFETY: a plain driver call on the context just made current; the limit is a
        // size in bytes, which the driver validates.
        let status =
            unsafe { sys::cuCtxSetLimit(sys::CUlimit::CU_LIMIT_STACK_SIZE, THREAD_STACK_BYTES) };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(candle_core::Error::Msg(format!(
                "cannot set the CUDA per-thread stack to {THREAD_STACK_BYTES} bytes: {status:?}"
            )));
        }
    }
    let _ = device;
    Ok(())
}

/// `device`'s per-thread stack limit now (`None` on the CPU): the driver raises it past
/// [`THREAD_STACK_BYTES`] when it launches a kernel with a larger frame, and keeps
/// `limit × resident threads` of device memory for it from then on.
pub fn thread_stack_limit(device: &Device) -> Result<Option<usize>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        use candle_core::cuda::cudarc::driver::sys;
        use candle_core::cuda::WrapErr;
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().w()?;
        let mut limit = 0usize;
        // SAFETY: a plain driver query on the context just made current, into a local.
        let status = unsafe { sys::cuCtxGetLimit(&mut limit, sys::CUlimit::CU_LIMIT_STACK_SIZE) };
        if status != sys::cudaError_enum::CUDA_SUCCESS {
            return Err(candle_core::Error::Msg(format!(
                "cannot read the CUDA per-thread stack limit: {status:?}"
            )));
        }
        return Ok(Some(limit));
    }
    let _ = device;
    Ok(None)
}

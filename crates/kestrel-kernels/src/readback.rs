//! Token ids read back from the device without waiting for the work queued after them.
//!
//! A plain read (`Tensor::to_vec1`) is a copy into pageable memory that the host waits for on
//! candle's stream, so it also waits for every kernel queued before it: a decode step launched
//! ahead of the read (plain decoding's `launch_ahead`) would have to finish before the ids of
//! the step before it reach the host, and the device would idle again while the host commits
//! them and prepares the next step. [`IdsReadback`] queues the copy into page-locked memory
//! and waits for an event recorded right after it: for the copy and what came before it only.

use candle_core::{Result, Tensor};

/// A page-locked host buffer, kept across reads, that u32 ids are copied into on their
/// tensor's stream ([`IdsReadback::start`]) and read from once that copy is done
/// ([`IdsReadback::finish`]). One read is in flight at a time.
#[derive(Default)]
pub struct IdsReadback {
    #[cfg(feature = "cuda")]
    pinned: Option<candle_core::cuda::cudarc::driver::PinnedHostSlice<u32>>,
    /// Recorded after each copy; `finish` waits for it (created once, with the buffer).
    #[cfg(feature = "cuda")]
    copied: Option<candle_core::cuda::cudarc::driver::CudaEvent>,
    pending: Pending,
}

#[derive(Default)]
enum Pending {
    #[default]
    Nothing,
    /// Ids that were on the host already (a CPU tensor).
    Host(Vec<u32>),
    /// This many ids on their way into the page-locked buffer.
    #[cfg(feature = "cuda")]
    Pinned(usize),
}

impl IdsReadback {
    /// Starts reading the u32 `ids` (any shape, row-major) back: on the CPU they are taken at
    /// once; on a CUDA device the copy is queued on the tensor's stream and this returns
    /// without waiting. A read started and not finished is an error.
    pub fn start(&mut self, ids: &Tensor) -> Result<()> {
        if !matches!(self.pending, Pending::Nothing) {
            candle_core::bail!("IdsReadback::start: the previous read was not finished");
        }
        let ids = ids.flatten_all()?.contiguous()?;
        if ids.device().is_cpu() {
            self.pending = Pending::Host(ids.to_vec1::<u32>()?);
            return Ok(());
        }
        self.start_on_device(&ids)
    }

    #[cfg(feature = "cuda")]
    fn start_on_device(&mut self, ids: &Tensor) -> Result<()> {
        use candle_core::backend::BackendStorage;
        use candle_core::cuda::cudarc::driver::DevicePtr;
        use candle_core::cuda::WrapErr;
        use candle_core::{bail, Storage};
        let n = ids.elem_count();
        let (storage, layout) = ids.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            bail!("IdsReadback::start: ids neither on the CPU nor on a CUDA device")
        };
        let Some((a, b)) = layout.contiguous_offsets() else {
            bail!("IdsReadback::start: ids must be contiguous")
        };
        let src = s.as_cuda_slice::<u32>()?.slice(a..b);
        let stream = s.device().cuda_stream();
        if self.pinned.as_ref().is_none_or(|p| p.len() < n) {
            // Allocated once (page-locking may synchronise the device), at least a batch's
            // worth; not write-combined, since the host reads it.
            // SAFETY: every element read later was written by the copy below first.
            let buf = unsafe {
                stream
                    .context()
                    .alloc_pinned_with_flags::<u32>(n.max(256), 0)
            };
            self.pinned = Some(buf.w()?);
        }
        let pinned = self.pinned.as_mut().expect("allocated above");
        // Waits for the buffer's own event, which no copy here records: returns at once.
        let dst = pinned.as_mut_ptr().w()?;
        if self.copied.is_none() {
            use candle_core::cuda::cudarc::driver::sys::CUevent_flags;
            let flags = Some(CUevent_flags::CU_EVENT_DISABLE_TIMING);
            self.copied = Some(stream.context().new_event(flags).w()?);
        }
        let copied = self.copied.as_ref().expect("created above");
        // The n ids only: cudarc's `memcpy_dtoh` copies the whole destination, which is
        // longer than the ids whenever fewer rows than the buffer holds are read.
        let (src_ptr, _record) = src.device_ptr(&stream);
        // SAFETY: the buffer holds at least n u32 (allocated above), the host touches them only
        // in `finish`, after the event recorded below; the copy is queued on the stream the
        // ids were written on.
        unsafe {
            let dst = std::slice::from_raw_parts_mut(dst, n);
            candle_core::cuda::cudarc::driver::result::memcpy_dtoh_async(
                dst,
                src_ptr,
                stream.cu_stream(),
            )
        }
        .w()?;
        copied.record(&stream).w()?;
        self.pending = Pending::Pinned(n);
        Ok(())
    }

    #[cfg(not(feature = "cuda"))]
    fn start_on_device(&mut self, _ids: &Tensor) -> Result<()> {
        crate::no_cuda("IdsReadback on a device")
    }

    /// The ids of the read started last, once their copy is done. Without a started read, an
    /// error.
    pub fn finish(&mut self) -> Result<Vec<u32>> {
        match std::mem::take(&mut self.pending) {
            Pending::Nothing => {
                candle_core::bail!("IdsReadback::finish: no read was started")
            }
            Pending::Host(ids) => Ok(ids),
            #[cfg(feature = "cuda")]
            Pending::Pinned(n) => {
                use candle_core::cuda::WrapErr;
                let copied = self
                    .copied
                    .as_ref()
                    .expect("a pinned read recorded its event");
                copied.synchronize().w()?;
                let pinned = self.pinned.as_ref().expect("a pinned read has its buffer");
                Ok(pinned.as_slice().w()?[..n].to_vec())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cpu_ids_come_back_in_row_major_order() {
        let ids = Tensor::new(&[[4u32, 9], [1, 7]], &Device::Cpu).unwrap();
        let mut r = IdsReadback::default();
        r.start(&ids).unwrap();
        assert_eq!(r.finish().unwrap(), vec![4, 9, 1, 7]);
        // The buffer is reusable once finished.
        r.start(&ids.narrow(0, 1, 1).unwrap()).unwrap();
        assert_eq!(r.finish().unwrap(), vec![1, 7]);
    }

    /// The message of an error, without the backtrace candle appends when one is enabled.
    fn message(e: candle_core::Error) -> String {
        e.to_string().lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn reads_must_alternate_start_and_finish() {
        let ids = Tensor::new(&[3u32], &Device::Cpu).unwrap();
        let mut r = IdsReadback::default();
        assert_eq!(
            message(r.finish().unwrap_err()),
            "IdsReadback::finish: no read was started"
        );
        r.start(&ids).unwrap();
        assert_eq!(
            message(r.start(&ids).unwrap_err()),
            "IdsReadback::start: the previous read was not finished"
        );
    }
}

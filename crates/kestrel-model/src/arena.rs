//! Packing a CPU model's weights into one buffer backed by transparent huge pages.
//!
//! Decoding at batch 1 streams every weight once per token, so it is bound by memory
//! bandwidth; with 4 KiB pages, TLB misses cost a large share of it. Packing all weights of
//! one dtype into a single allocation that is `madvise(MADV_HUGEPAGE)`d before it is first
//! written lets the kernel back it with 2 MiB pages; each weight then becomes a view into it
//! (candle tensors with an offset layout). Linux and CPU only; elsewhere a no-op.

use crate::error::Result;
use candle_core::{DType, Tensor};

#[cfg(target_os = "linux")]
fn advise_huge(ptr: usize, bytes: usize) {
    const HUGE: usize = 2 << 20;
    let start = ptr.next_multiple_of(HUGE);
    let end = (ptr + bytes) / HUGE * HUGE;
    if end > start {
        // SAFETY: [start, end) lies inside an allocation this process owns; MADV_HUGEPAGE
        // is advisory and changes no contents or permissions.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[cfg(target_os = "linux")]
fn pack_as<T: candle_core::WithDType>(tensors: &mut [&mut Tensor]) -> Result<()> {
    const HUGE: usize = 2 << 20;
    let size = std::mem::size_of::<T>();
    let total: usize = tensors.iter().map(|t| t.elem_count()).sum();
    let pad_max = HUGE / size;
    let mut buf: Vec<T> = Vec::with_capacity(total + pad_max);
    let ptr = buf.as_ptr() as usize;
    // Start the first weight on a huge-page boundary.
    let pad = (ptr.next_multiple_of(HUGE) - ptr) / size;
    advise_huge(ptr, (total + pad) * size);
    buf.resize(pad, T::zero());
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors.iter() {
        offsets.push(buf.len());
        // Straight from the tensor's storage: a copy through a Vec would touch (and fault in)
        // every weight byte once more while the model loads.
        let t = t.contiguous()?;
        crate::cpu_norm::cpu_slice::<T, _>(&t, |s| {
            buf.extend_from_slice(s);
            Ok(())
        })?;
    }
    let len = buf.len();
    let arena = Tensor::from_vec(buf, len, &candle_core::Device::Cpu)?;
    for (t, off) in tensors.iter_mut().zip(offsets) {
        let view = arena.narrow(0, off, t.elem_count())?.reshape(t.shape())?;
        **t = view;
    }
    Ok(())
}

/// Replaces the tensors by views into one huge-page-backed buffer, when they are all on the
/// CPU in one dtype; otherwise leaves them as they are.
pub(crate) fn pack(tensors: &mut [&mut Tensor]) -> Result<()> {
    let Some(first) = tensors.first() else {
        return Ok(());
    };
    let dtype = first.dtype();
    if !first.device().is_cpu()
        || tensors
            .iter()
            .any(|t| t.dtype() != dtype || !t.device().is_cpu())
    {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        match dtype {
            DType::F32 => pack_as::<f32>(tensors)?,
            DType::F16 => pack_as::<half::f16>(tensors)?,
            DType::BF16 => pack_as::<half::bf16>(tensors)?,
            _ => {}
        }
    }
    Ok(())
}

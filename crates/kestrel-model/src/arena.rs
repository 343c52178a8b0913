//! Packing a CPU model's weights into one buffer backed by transparent huge pages.
//!
//! Decoding at batch 1 streams every weight once per token, so it is bound by memory
//! bandwidth; with 4 KiB pages, TLB misses cost a large share of it. Packing all weights of
//! one dtype into a single allocation that is `madvise(MADV_HUGEPAGE)`d before it is first
//! written lets the kernel back it with 2 MiB pages; each weight then becomes a view into it
//! (candle tensors with an offset layout). Huge pages are Linux only; elsewhere the buffer is
//! an ordinary one.
//!
//! Two ways in: [`pack`] moves tensors a model already holds (random or in-memory weights),
//! and [`load_packed`] streams a checkpoint's tensors into the buffer one at a time, each
//! dropped once copied, so that a loading model holds its weights once (packing after
//! loading held every weight twice, and the fused projections' parts a third time).

use crate::cpu_norm::cpu_slice;
use crate::error::{ModelError, Result};
use candle_core::{DType, Device, Tensor, WithDType};
use std::collections::BTreeMap;

const HUGE: usize = 2 << 20;

#[cfg(target_os = "linux")]
fn advise_huge(ptr: usize, bytes: usize) {
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

#[cfg(not(target_os = "linux"))]
fn advise_huge(_ptr: usize, _bytes: usize) {}

/// An empty buffer with room for `total` elements after a padding that puts the next
/// element on a huge-page boundary, advised for huge pages before anything is written.
fn huge_buffer<T: WithDType>(total: usize) -> Vec<T> {
    let size = std::mem::size_of::<T>();
    let mut buf: Vec<T> = Vec::with_capacity(total + HUGE / size);
    let ptr = buf.as_ptr() as usize;
    let pad = (ptr.next_multiple_of(HUGE) - ptr) / size;
    advise_huge(ptr, (total + pad) * size);
    buf.resize(pad, T::zero());
    buf
}

/// Appends the elements of the CPU tensor `t` (of dtype `T`) to `buf`.
fn append<T: WithDType>(buf: &mut Vec<T>, t: &Tensor) -> Result<()> {
    cpu_slice::<T, _>(&t.contiguous()?, |s| {
        buf.extend_from_slice(s);
        Ok(())
    })
}

/// The buffer as one tensor, and a view into it of `shape` from element `offset`.
fn view(arena: &Tensor, offset: usize, shape: &[usize]) -> Result<Tensor> {
    let n = shape.iter().product();
    Ok(arena.narrow(0, offset, n)?.reshape(shape)?)
}

fn pack_as<T: WithDType>(tensors: &mut [&mut Tensor]) -> Result<()> {
    let total: usize = tensors.iter().map(|t| t.elem_count()).sum();
    let mut buf = huge_buffer::<T>(total);
    let mut offsets = Vec::with_capacity(tensors.len());
    for t in tensors.iter() {
        offsets.push(buf.len());
        append(&mut buf, t)?;
    }
    let len = buf.len();
    let arena = Tensor::from_vec(buf, len, &Device::Cpu)?;
    for (t, off) in tensors.iter_mut().zip(offsets) {
        **t = view(&arena, off, t.dims())?;
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
    match dtype {
        DType::F32 => pack_as::<f32>(tensors),
        DType::F16 => pack_as::<half::f16>(tensors),
        DType::BF16 => pack_as::<half::bf16>(tensors),
        _ => Ok(()),
    }
}

/// Weights in one huge-page-backed buffer, by name: [`load_packed`]'s result.
pub(crate) struct PackedWeights {
    arena: Tensor,
    /// Element offset and shape of each weight.
    at: BTreeMap<String, (usize, Vec<usize>)>,
}

impl PackedWeights {
    /// A view of weight `name`, with its shape; `None` when it was not loaded.
    pub(crate) fn get(&self, name: &str) -> Result<Option<Tensor>> {
        self.at
            .get(name)
            .map(|(off, shape)| view(&self.arena, *off, shape))
            .transpose()
    }

    /// Weights `names` concatenated along their first dimension as one view, when they lie
    /// back to back in the buffer in that order (a fused projection's parts, loaded in a
    /// row); `None` otherwise.
    pub(crate) fn get_adjacent(&self, names: &[&str]) -> Result<Option<Tensor>> {
        let mut parts = Vec::with_capacity(names.len());
        for name in names {
            let Some(p) = self.at.get(*name) else {
                return Ok(None);
            };
            parts.push(p);
        }
        let Some(&(start, ref first)) = parts.first().copied() else {
            return Ok(None);
        };
        let (mut end, mut rows) = (start, 0);
        for (off, shape) in parts {
            if *off != end || shape.is_empty() || shape[1..] != first[1..] {
                return Ok(None);
            }
            end += shape.iter().product::<usize>();
            rows += shape[0];
        }
        let mut shape = first.clone();
        shape[0] = rows;
        Ok(Some(view(&self.arena, start, &shape)?))
    }

    /// The buffer's dtype.
    pub(crate) fn dtype(&self) -> DType {
        self.arena.dtype()
    }
}

/// Loads `entries` (name, shape) through `load`, converted to `dtype`, into one buffer in
/// their order, each loaded tensor dropped as soon as it is copied. `dtype` must be f32,
/// f16 or bf16.
pub(crate) fn load_packed(
    dtype: DType,
    entries: &[(String, Vec<usize>)],
    load: impl Fn(&str, &[usize]) -> Result<Tensor>,
) -> Result<PackedWeights> {
    match dtype {
        DType::F32 => load_packed_as::<f32>(entries, load),
        DType::F16 => load_packed_as::<half::f16>(entries, load),
        DType::BF16 => load_packed_as::<half::bf16>(entries, load),
        other => Err(ModelError::InvalidInput(format!(
            "CPU weights are packed as f32, f16 or bf16, not {other:?}"
        ))),
    }
}

fn load_packed_as<T: WithDType>(
    entries: &[(String, Vec<usize>)],
    load: impl Fn(&str, &[usize]) -> Result<Tensor>,
) -> Result<PackedWeights> {
    let total = entries
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let mut buf = huge_buffer::<T>(total);
    let mut at = BTreeMap::new();
    for (name, shape) in entries {
        let t = load(name, shape)?.to_dtype(T::DTYPE)?;
        at.insert(name.clone(), (buf.len(), shape.clone()));
        append(&mut buf, &t)?;
    }
    let len = buf.len();
    Ok(PackedWeights {
        arena: Tensor::from_vec(buf, len, &Device::Cpu)?,
        at,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ramp(shape: &[usize], from: f32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| from + i as f32).collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
    }

    /// Loaded weights come back with their values, converted, as views of one buffer; parts
    /// loaded in a row come back as one view of their concatenation.
    #[test]
    fn loaded_weights_are_views_of_one_buffer() {
        let entries = vec![
            ("a".to_string(), vec![2, 3]),
            ("q".to_string(), vec![4, 3]),
            ("k".to_string(), vec![1, 3]),
            ("norm".to_string(), vec![3]),
        ];
        let source = |name: &str, shape: &[usize]| {
            // Integers below 256: exact in bf16.
            let from = match name {
                "a" => 0.0,
                "q" => 16.0,
                "k" => 32.0,
                _ => 48.0,
            };
            Ok(ramp(shape, from))
        };
        let packed = load_packed(DType::BF16, &entries, source).unwrap();
        assert_eq!(packed.dtype(), DType::BF16);
        let f32s = |t: Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        for (name, shape) in &entries {
            let got = packed.get(name).unwrap().unwrap();
            assert_eq!(got.dims(), shape.as_slice());
            let want = source(name, shape).unwrap().flatten_all().unwrap();
            assert_eq!(
                f32s(got).to_vec1::<f32>().unwrap(),
                want.to_vec1::<f32>().unwrap()
            );
        }
        assert!(packed.get("v").unwrap().is_none());
        let qk = packed.get_adjacent(&["q", "k"]).unwrap().unwrap();
        assert_eq!(qk.dims(), &[5, 3]);
        let cat = Tensor::cat(
            &[
                packed.get("q").unwrap().unwrap(),
                packed.get("k").unwrap().unwrap(),
            ],
            0,
        )
        .unwrap();
        assert_eq!(
            f32s(qk).to_vec1::<f32>().unwrap(),
            f32s(cat).to_vec1::<f32>().unwrap()
        );
        // Out of order, apart, of other widths, or absent: not one view.
        for names in [&["k", "q"][..], &["a", "k"], &["k", "norm"], &["q", "v"]] {
            assert!(packed.get_adjacent(names).unwrap().is_none(), "{names:?}");
        }
    }
}

//! The paged KV cache: per layer one K and one V pool of `num_blocks * block_size` slots,
//! a block allocator, and a block table per sequence.
//!
//! Slot `i` of a sequence lives in pool row `blocks[i / block_size] * block_size + i % block_size`.
//! Pools are plain candle tensors `[num_blocks * block_size, n_kv_heads, head_dim]` written in
//! place with `slice_set` (one call per run of slots inside a block) and read with
//! `index_select`, so the same code runs on CPU and CUDA.

use crate::error::{invalid, ModelError, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;

/// A sequence's handle in a [`PagedKvCache`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

#[derive(Debug, Clone, Default)]
struct SeqState {
    blocks: Vec<usize>,
    len: usize,
}

#[derive(Debug)]
pub struct PagedKvCache {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    n_kv_heads: usize,
    head_dim: usize,
    num_blocks: usize,
    block_size: usize,
    dtype: DType,
    device: Device,
    /// Free block ids; popped from the end.
    free: Vec<usize>,
    seqs: BTreeMap<SeqId, SeqState>,
    next_id: u64,
}

impl PagedKvCache {
    pub fn new(
        num_layers: usize,
        n_kv_heads: usize,
        head_dim: usize,
        num_blocks: usize,
        block_size: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if block_size == 0 || num_blocks == 0 || n_kv_heads == 0 || head_dim == 0 {
            return Err(invalid(format!(
                "KV cache sizes must be positive (num_blocks {num_blocks}, block_size {block_size}, \
                 n_kv_heads {n_kv_heads}, head_dim {head_dim})"
            )));
        }
        let slots = num_blocks * block_size;
        let mut k = Vec::with_capacity(num_layers);
        let mut v = Vec::with_capacity(num_layers);
        for _ in 0..num_layers {
            k.push(Tensor::zeros((slots, n_kv_heads, head_dim), dtype, device)?);
            v.push(Tensor::zeros((slots, n_kv_heads, head_dim), dtype, device)?);
        }
        Ok(PagedKvCache {
            k,
            v,
            n_kv_heads,
            head_dim,
            num_blocks,
            block_size,
            dtype,
            device: device.clone(),
            free: (0..num_blocks).rev().collect(),
            seqs: BTreeMap::new(),
            next_id: 0,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.k.len()
    }
    pub fn n_kv_heads(&self) -> usize {
        self.n_kv_heads
    }
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }
    pub fn block_size(&self) -> usize {
        self.block_size
    }
    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    /// Blocks not held by any sequence.
    pub fn free_blocks(&self) -> usize {
        self.free.len()
    }

    pub fn add_sequence(&mut self) -> SeqId {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        self.seqs.insert(id, SeqState::default());
        id
    }

    pub fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let state = self
            .seqs
            .remove(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        self.free.extend(state.blocks.into_iter().rev());
        Ok(())
    }

    pub fn contains(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    pub fn seq_len(&self, seq: SeqId) -> Result<usize> {
        Ok(self.state(seq)?.len)
    }

    /// The sequence's block table (for inspection and tests).
    pub fn block_table(&self, seq: SeqId) -> Result<&[usize]> {
        Ok(&self.state(seq)?.blocks)
    }

    fn state(&self, seq: SeqId) -> Result<&SeqState> {
        self.seqs.get(&seq).ok_or(ModelError::UnknownSequence(seq))
    }

    /// Rolls the sequence back to `len` slots, freeing whole blocks past the end.
    pub fn truncate(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let bs = self.block_size;
        let state = self
            .seqs
            .get_mut(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        if len > state.len {
            return Err(invalid(format!(
                "cannot truncate sequence {seq:?} to {len} slots: it holds only {}",
                state.len
            )));
        }
        state.len = len;
        let keep = len.div_ceil(bs);
        let freed: Vec<usize> = state.blocks.drain(keep..).collect();
        self.free.extend(freed.into_iter().rev());
        Ok(())
    }

    /// Blocks needed to hold `extra` more slots of each listed sequence.
    fn blocks_needed(&self, seq: SeqId, extra: usize) -> Result<usize> {
        let state = self.state(seq)?;
        Ok((state.len + extra)
            .div_ceil(self.block_size)
            .saturating_sub(state.blocks.len()))
    }

    /// Makes sure every listed sequence has room for its extra slots; allocates nothing when
    /// the cache cannot hold them all.
    pub fn reserve(&mut self, requests: &[(SeqId, usize)]) -> Result<()> {
        let mut needed = 0;
        for &(seq, extra) in requests {
            needed += self.blocks_needed(seq, extra)?;
        }
        if needed > self.free.len() {
            return Err(ModelError::OutOfBlocks {
                needed,
                free: self.free.len(),
            });
        }
        for &(seq, extra) in requests {
            let n = self.blocks_needed(seq, extra)?;
            for _ in 0..n {
                let b = self.free.pop().expect("checked above");
                self.seqs.get_mut(&seq).expect("checked").blocks.push(b);
            }
        }
        Ok(())
    }

    /// Pool rows of the sequence's slots `start..start + n` (the blocks must be allocated).
    pub fn slot_rows(&self, seq: SeqId, start: usize, n: usize) -> Result<Vec<u32>> {
        let state = self.state(seq)?;
        let bs = self.block_size;
        if (start + n).div_ceil(bs) > state.blocks.len() {
            return Err(invalid(format!(
                "slots {start}..{} of sequence {seq:?} are not allocated",
                start + n
            )));
        }
        Ok((start..start + n)
            .map(|i| (state.blocks[i / bs] * bs + i % bs) as u32)
            .collect())
    }

    /// Advances the sequence's length after its new slots have been written.
    pub(crate) fn set_len(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let bs = self.block_size;
        let state = self
            .seqs
            .get_mut(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        if len.div_ceil(bs) > state.blocks.len() {
            return Err(invalid(format!(
                "sequence {seq:?} has no blocks for {len} slots"
            )));
        }
        state.len = len;
        Ok(())
    }

    /// Writes `k`, `v` (`[n, n_kv_heads, head_dim]`) of `layer` into the given pool rows.
    pub(crate) fn write(&self, layer: usize, rows: &[u32], k: &Tensor, v: &Tensor) -> Result<()> {
        let k = k.contiguous()?;
        let v = v.contiguous()?;
        let mut i = 0;
        while i < rows.len() {
            let mut j = i + 1;
            while j < rows.len() && rows[j] == rows[j - 1] + 1 {
                j += 1;
            }
            let start = rows[i] as usize;
            self.k[layer].slice_set(&k.narrow(0, i, j - i)?, 0, start)?;
            self.v[layer].slice_set(&v.narrow(0, i, j - i)?, 0, start)?;
            i = j;
        }
        Ok(())
    }

    /// The K and V pools of `layer`.
    pub(crate) fn pools(&self, layer: usize) -> (&Tensor, &Tensor) {
        (&self.k[layer], &self.v[layer])
    }

    /// K and V of `layer` at the given pool rows: `[rows.len(), n_kv_heads, head_dim]` each.
    pub(crate) fn gather(&self, layer: usize, rows: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.k[layer].index_select(rows, 0)?,
            self.v[layer].index_select(rows, 0)?,
        ))
    }

    /// After a forward that appended tree tokens at slots `base_len..`, moves slot
    /// `base_len + kept[i]` to `base_len + i` in every layer and sets the length to
    /// `base_len + kept.len()`, freeing blocks past the end.
    pub fn compact(&mut self, seq: SeqId, base_len: usize, kept: &[usize]) -> Result<()> {
        let len = self.seq_len(seq)?;
        if base_len > len {
            return Err(invalid(format!(
                "compact of sequence {seq:?}: base_len {base_len} exceeds its length {len}"
            )));
        }
        let appended = len - base_len;
        if let Some(&bad) = kept.iter().find(|&&k| k >= appended) {
            return Err(invalid(format!(
                "compact of sequence {seq:?}: kept index {bad} is not among the {appended} appended slots"
            )));
        }
        let identity = kept.iter().enumerate().all(|(i, &k)| i == k);
        if !identity && !kept.is_empty() {
            let src = self.slot_rows(seq, base_len, appended)?;
            let src: Vec<u32> = kept.iter().map(|&k| src[k]).collect();
            let dst = self.slot_rows(seq, base_len, kept.len())?;
            let src = Tensor::new(src.as_slice(), &self.device)?;
            for layer in 0..self.num_layers() {
                let (k, v) = self.gather(layer, &src)?;
                self.write(layer, &dst, &k, &v)?;
            }
        }
        self.truncate(seq, base_len + kept.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_truncate_and_exhaustion() {
        let dev = Device::Cpu;
        let mut c = PagedKvCache::new(1, 1, 2, 4, 2, DType::F32, &dev).unwrap();
        let a = c.add_sequence();
        let b = c.add_sequence();
        c.reserve(&[(a, 3), (b, 2)]).unwrap();
        c.set_len(a, 3).unwrap();
        c.set_len(b, 2).unwrap();
        assert_eq!(c.free_blocks(), 1);
        let err = c.reserve(&[(a, 1), (b, 3)]).unwrap_err();
        assert!(
            matches!(err, ModelError::OutOfBlocks { needed: 2, free: 1 }),
            "{err}"
        );
        // Nothing was allocated by the failed reserve.
        assert_eq!(c.free_blocks(), 1);
        c.truncate(a, 1).unwrap();
        assert_eq!(c.seq_len(a).unwrap(), 1);
        assert_eq!(c.free_blocks(), 2);
        assert!(c.truncate(a, 5).is_err());
        c.free_sequence(b).unwrap();
        assert_eq!(c.free_blocks(), 3);
        assert!(matches!(c.seq_len(b), Err(ModelError::UnknownSequence(_))));
        assert!(c.free_sequence(b).is_err());
    }
}

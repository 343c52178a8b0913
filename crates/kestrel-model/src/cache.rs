//! The paged KV cache: per layer one K and one V pool of `num_blocks * block_size` slots,
//! a block allocator, and a block table per sequence.
//!
//! Slot `i` of a sequence lives in pool row `blocks[i / block_size] * block_size + i % block_size`.
//! Pools are plain candle tensors `[num_blocks * block_size, n_kv_heads, head_dim]` written in
//! place with `slice_set` (one call per run of slots inside a block) and read with
//! `index_select`, so the same code runs on CPU and CUDA.
//!
//! With prefix reuse on ([`PagedKvCache::enable_prefix_reuse`]), blocks are reference
//! counted: full prompt blocks a finished sequence registered stay cached (see
//! [`crate::prefix_cache`]) and a later sequence with the same prompt prefix attaches them
//! read-only instead of prefilling them again. Cached blocks nobody references still count as
//! free: the allocator takes them back, least recently released first, once its free list is
//! empty.

use crate::error::{invalid, ModelError, Result};
use crate::prefix_cache::{PrefixIndex, PrefixKeys};
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
    /// Per block: how many sequences hold it (more than one only for attached prefixes).
    refs: Vec<u32>,
    /// The cached prompt blocks, when prefix reuse is on.
    prefix: Option<PrefixIndex>,
    seqs: BTreeMap<SeqId, SeqState>,
    next_id: u64,
    /// Compaction moves rows with Kestrel's `kv_move` kernel (one launch for all layers).
    move_kernel: bool,
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
        let shape = (slots, n_kv_heads, head_dim);
        for _ in 0..num_layers {
            k.push(zeroed_pool(shape, dtype, device)?);
            v.push(zeroed_pool(shape, dtype, device)?);
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
            refs: vec![0; num_blocks],
            prefix: None,
            seqs: BTreeMap::new(),
            next_id: 0,
            move_kernel: false,
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
    /// Blocks not held by any sequence (cached prefix blocks among them).
    pub fn free_blocks(&self) -> usize {
        self.free.len() + self.prefix.as_ref().map_or(0, PrefixIndex::evictable)
    }

    /// Turns prefix reuse on: from now on [`PagedKvCache::register_prefix`] keeps prompt
    /// blocks for later sequences.
    pub fn enable_prefix_reuse(&mut self) {
        if self.prefix.is_none() {
            self.prefix = Some(PrefixIndex::new(self.num_blocks));
        }
    }

    pub fn prefix_reuse(&self) -> bool {
        self.prefix.is_some()
    }

    /// Cached prefix blocks that no sequence holds (reusable until evicted).
    pub fn cached_free_blocks(&self) -> usize {
        self.prefix.as_ref().map_or(0, PrefixIndex::evictable)
    }

    /// How many leading full blocks of `keys` are cached, at most `max_blocks` (0 when prefix
    /// reuse is off).
    pub fn cached_prefix_blocks(&self, keys: &PrefixKeys, max_blocks: usize) -> usize {
        match &self.prefix {
            Some(p) if keys.block_size() == self.block_size => {
                p.lookup(keys, max_blocks, &mut Vec::new())
            }
            _ => 0,
        }
    }

    /// Gives the empty sequence `seq` the first `blocks` cached blocks of `keys` (found by
    /// [`PagedKvCache::cached_prefix_blocks`]), read-only: its length becomes
    /// `blocks * block_size` and its next tokens go to fresh blocks.
    pub fn attach_prefix(&mut self, seq: SeqId, keys: &PrefixKeys, blocks: usize) -> Result<()> {
        if blocks == 0 {
            return Ok(());
        }
        let state = self.state(seq)?;
        if state.len != 0 || !state.blocks.is_empty() {
            return Err(invalid(format!(
                "cannot attach a cached prefix to sequence {seq:?}: it already holds {} slots",
                state.len
            )));
        }
        let mut found = Vec::with_capacity(blocks);
        let hits = match &self.prefix {
            Some(p) if keys.block_size() == self.block_size => p.lookup(keys, blocks, &mut found),
            _ => 0,
        };
        if hits < blocks {
            return Err(invalid(format!(
                "cannot attach {blocks} cached prefix blocks to sequence {seq:?}: only {hits} are cached"
            )));
        }
        for &b in &found {
            if self.refs[b] == 0 {
                if let Some(p) = &mut self.prefix {
                    p.acquire(b);
                }
            }
            self.refs[b] += 1;
        }
        let state = self.seqs.get_mut(&seq).expect("checked above");
        state.blocks = found;
        state.len = blocks * self.block_size;
        Ok(())
    }

    /// Offers the sequence's full blocks of `keys` (its prompt) for reuse by later sequences;
    /// only blocks whose slots have all been written count. The caller guarantees that those
    /// slots came from the prompt's prefill. A no-op when prefix reuse is off.
    pub fn register_prefix(&mut self, seq: SeqId, keys: &PrefixKeys) -> Result<()> {
        let bs = self.block_size;
        let state = self
            .seqs
            .get(&seq)
            .ok_or(ModelError::UnknownSequence(seq))?;
        let Some(p) = &mut self.prefix else {
            return Ok(());
        };
        if keys.block_size() != bs {
            return Err(invalid(format!(
                "prefix keys of block size {} for a cache of block size {bs}",
                keys.block_size()
            )));
        }
        let written = keys.full_blocks().min(state.len / bs);
        for (b, &block) in state.blocks.iter().enumerate().take(written) {
            p.insert(keys, b, block);
        }
        Ok(())
    }

    /// A free block: from the free list, else the least recently released cached one.
    fn alloc_block(&mut self) -> Option<usize> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => self.prefix.as_mut()?.evict()?,
        };
        self.refs[b] = 1;
        Some(b)
    }

    /// Drops one reference to `block`; unreferenced, it goes back to the free list, or stays
    /// cached when it holds a registered prompt block.
    fn release_block(&mut self, block: usize) {
        self.refs[block] = self.refs[block].saturating_sub(1);
        if self.refs[block] > 0 {
            return;
        }
        match &mut self.prefix {
            Some(p) if p.is_cached(block) => p.release(block),
            _ => self.free.push(block),
        }
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
        // Last block first: it is popped (or, cached, evicted) last.
        for b in state.blocks.into_iter().rev() {
            self.release_block(b);
        }
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
        let keep = len.div_ceil(bs);
        if !len.is_multiple_of(bs) {
            // The kept partial block will be written again: it must not stay cached.
            let partial = state.blocks[keep - 1];
            if let Some(p) = &mut self.prefix {
                if p.is_cached(partial) {
                    if self.refs[partial] > 1 {
                        return Err(invalid(format!(
                            "cannot truncate sequence {seq:?} to {len} slots: that cuts into a prefix block it shares"
                        )));
                    }
                    p.remove(partial);
                }
            }
        }
        state.len = len;
        // Last block first, popped one by one: a rollback every step allocates nothing.
        while let Some(b) = self
            .seqs
            .get_mut(&seq)
            .filter(|s| s.blocks.len() > keep)
            .and_then(|s| s.blocks.pop())
        {
            self.release_block(b);
        }
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
        let free = self.free_blocks();
        if needed > free {
            return Err(ModelError::OutOfBlocks { needed, free });
        }
        for &(seq, extra) in requests {
            let n = self.blocks_needed(seq, extra)?;
            for _ in 0..n {
                let b = self.alloc_block().expect("checked above");
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

    /// Whether compaction moves rows with Kestrel's `kv_move` CUDA kernel, one launch for
    /// all layers, instead of a gather and a write per layer (ignored off CUDA).
    pub fn set_move_kernel(&mut self, enabled: bool) {
        self.move_kernel = enabled && self.device.is_cuda();
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
        self.compact_all(&[Compaction {
            seq,
            base_len,
            kept,
        }])
    }

    /// [`PagedKvCache::compact`] of several sequences, their slot moves in one launch where
    /// the move kernel runs (the sequences' slots are disjoint, so their moves are too).
    pub fn compact_all(&mut self, items: &[Compaction]) -> Result<()> {
        let mut moves: Vec<(u32, u32)> = Vec::new();
        for c in items {
            let len = self.seq_len(c.seq)?;
            if c.base_len > len {
                return Err(invalid(format!(
                    "compact of sequence {:?}: base_len {} exceeds its length {len}",
                    c.seq, c.base_len
                )));
            }
            let appended = len - c.base_len;
            if let Some(&bad) = c.kept.iter().find(|&&k| k >= appended) {
                return Err(invalid(format!(
                    "compact of sequence {:?}: kept index {bad} is not among the {appended} appended slots",
                    c.seq
                )));
            }
            let identity = c.kept.iter().enumerate().all(|(i, &k)| i == k);
            if identity || c.kept.is_empty() {
                continue;
            }
            let src = self.slot_rows(c.seq, c.base_len, appended)?;
            if self.move_kernel {
                moves.extend(
                    c.kept
                        .iter()
                        .enumerate()
                        .filter(|&(i, &k)| i != k)
                        .map(|(i, &k)| (src[k], src[i])),
                );
            } else {
                let src: Vec<u32> = c.kept.iter().map(|&k| src[k]).collect();
                let dst = self.slot_rows(c.seq, c.base_len, c.kept.len())?;
                let src = Tensor::new(src.as_slice(), &self.device)?;
                for layer in 0..self.num_layers() {
                    let (k, v) = self.gather(layer, &src)?;
                    self.write(layer, &dst, &k, &v)?;
                }
            }
        }
        if !moves.is_empty() {
            let pools: Vec<Tensor> = self.k.iter().chain(&self.v).cloned().collect();
            kestrel_kernels::kv_move(&pools, &moves)?;
        }
        for c in items {
            self.truncate(c.seq, c.base_len + c.kept.len())?;
        }
        Ok(())
    }
}

/// One sequence's part of [`PagedKvCache::compact_all`].
pub struct Compaction<'a> {
    pub seq: SeqId,
    pub base_len: usize,
    pub kept: &'a [usize],
}

/// A zeroed pool. On the CPU a half-precision pool is allocated as zeroed integers, which
/// the allocator takes from fresh (already zero) pages without writing them: the pages of
/// blocks no sequence reaches are never touched, where candle's `zeros` writes every one
/// (190 MiB for SmolLM2's default engine, on every `generate` call).
fn zeroed_pool(shape: (usize, usize, usize), dtype: DType, device: &Device) -> Result<Tensor> {
    use half::vec::HalfBitsVecExt;
    let n = shape.0 * shape.1 * shape.2;
    Ok(match (dtype, device) {
        (DType::BF16, Device::Cpu) => Tensor::from_vec(
            vec![0u16; n].reinterpret_into::<half::bf16>(),
            shape,
            device,
        )?,
        (DType::F16, Device::Cpu) => {
            Tensor::from_vec(vec![0u16; n].reinterpret_into::<half::f16>(), shape, device)?
        }
        (DType::F32, Device::Cpu) => Tensor::from_vec(vec![0f32; n], shape, device)?,
        _ => Tensor::zeros(shape, dtype, device)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pools_start_zeroed_in_every_dtype() {
        for dtype in [DType::BF16, DType::F16, DType::F32] {
            let c = PagedKvCache::new(2, 3, 4, 5, 16, dtype, &Device::Cpu).unwrap();
            for pool in c.k.iter().chain(&c.v) {
                assert_eq!(pool.dims(), &[80, 3, 4]);
                assert_eq!(pool.dtype(), dtype);
                let sum = pool.to_dtype(DType::F32).unwrap().abs().unwrap();
                let sum = sum.sum_all().unwrap().to_scalar::<f32>().unwrap();
                assert_eq!(sum, 0.0, "{dtype:?}");
            }
        }
    }

    /// Two sequences compacted in one call end with the pools and lengths that compacting
    /// each on its own gives.
    #[test]
    fn compacting_sequences_together_equals_one_by_one() {
        let dev = Device::Cpu;
        let filled = || {
            // 2 layers, 1 KV head of width 2, 4 blocks of 8 slots.
            let mut c = PagedKvCache::new(2, 1, 2, 4, 8, DType::F32, &dev).unwrap();
            let (a, b) = (c.add_sequence(), c.add_sequence());
            c.reserve(&[(a, 9), (b, 7)]).unwrap();
            for (seq, n) in [(a, 9), (b, 7)] {
                let rows = c.slot_rows(seq, 0, n).unwrap();
                for layer in 0..2 {
                    let vals: Vec<f32> = rows
                        .iter()
                        .flat_map(|&r| [r as f32, (100 * layer) as f32 + r as f32])
                        .collect();
                    let k = Tensor::from_vec(vals.clone(), (n, 1, 2), &dev).unwrap();
                    let v = (k.clone() * -1.0).unwrap();
                    c.write(layer, &rows, &k, &v).unwrap();
                }
                c.set_len(seq, n).unwrap();
            }
            (c, a, b)
        };
        let pools = |c: &PagedKvCache| -> Vec<Vec<f32>> {
            c.k.iter()
                .chain(&c.v)
                .map(|t| t.flatten_all().unwrap().to_vec1().unwrap())
                .collect()
        };
        let (mut one_by_one, a, b) = filled();
        one_by_one.compact(a, 4, &[0, 2, 4]).unwrap();
        one_by_one.compact(b, 3, &[0, 3]).unwrap();
        let (mut together, a2, b2) = filled();
        together
            .compact_all(&[
                Compaction {
                    seq: a2,
                    base_len: 4,
                    kept: &[0, 2, 4],
                },
                Compaction {
                    seq: b2,
                    base_len: 3,
                    kept: &[0, 3],
                },
            ])
            .unwrap();
        assert_eq!(pools(&together), pools(&one_by_one));
        assert_eq!(together.seq_len(a2).unwrap(), 7);
        assert_eq!(together.seq_len(b2).unwrap(), 5);
        let err = together
            .compact_all(&[Compaction {
                seq: b2,
                base_len: 3,
                kept: &[0, 5],
            }])
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("kept index 5 is not among the 2 appended slots"),
            "{err}"
        );
    }

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

    /// A sequence that wrote `tokens` (all of them) into its own fresh blocks.
    fn filled(c: &mut PagedKvCache, tokens: usize) -> SeqId {
        let s = c.add_sequence();
        c.reserve(&[(s, tokens)]).unwrap();
        c.set_len(s, tokens).unwrap();
        s
    }

    #[test]
    fn registered_prompt_blocks_are_attached_shared_and_evicted_last_block_first() {
        let dev = Device::Cpu;
        let mut c = PagedKvCache::new(1, 1, 2, 6, 2, DType::F32, &dev).unwrap();
        c.enable_prefix_reuse();
        let prompt: Vec<u32> = (10..17).collect(); // 7 tokens: 3 full blocks of 2
        let keys = PrefixKeys::new(&[], &prompt, 2);
        let a = filled(&mut c, 7);
        let a_blocks = c.block_table(a).unwrap().to_vec();
        c.register_prefix(a, &keys).unwrap();
        c.free_sequence(a).unwrap();
        // The three full blocks stay cached, the partial one is free; all count as free.
        assert_eq!(c.cached_free_blocks(), 3);
        assert_eq!(c.free_blocks(), 6);
        assert_eq!(c.cached_prefix_blocks(&keys, 3), 3);
        assert_eq!(c.cached_prefix_blocks(&keys, 2), 2);

        // Two sequences share the first two blocks.
        let b = c.add_sequence();
        let d = c.add_sequence();
        c.attach_prefix(b, &keys, 2).unwrap();
        c.attach_prefix(d, &keys, 2).unwrap();
        assert_eq!(c.seq_len(b).unwrap(), 4);
        assert_eq!(c.block_table(b).unwrap(), &a_blocks[..2]);
        assert_eq!(c.block_table(d).unwrap(), &a_blocks[..2]);
        assert_eq!(c.cached_free_blocks(), 1);
        // Attaching to a non-empty sequence, or more than is cached, is refused.
        assert!(c.attach_prefix(b, &keys, 1).is_err());
        let e = c.add_sequence();
        assert!(c.attach_prefix(e, &keys, 4).is_err());
        // Truncating into a shared block is refused; past it, fine.
        assert!(c.truncate(b, 3).is_err());
        c.truncate(b, 4).unwrap();
        c.free_sequence(b).unwrap();
        c.free_sequence(d).unwrap();
        c.free_sequence(e).unwrap();
        assert_eq!(c.cached_free_blocks(), 3);

        // Filling the cache evicts cached blocks only once the free list is empty, the
        // prompt's last block first, which cuts the chain from the end.
        let f = filled(&mut c, 2 * 5);
        assert_eq!(c.cached_free_blocks(), 1);
        assert_eq!(c.cached_prefix_blocks(&keys, 3), 1);
        assert_eq!(c.block_table(f).unwrap().len(), 5);
        // All six blocks in use: nothing is left to evict.
        let g = c.add_sequence();
        c.attach_prefix(g, &keys, 1).unwrap();
        assert!(matches!(
            c.reserve(&[(g, 1)]),
            Err(ModelError::OutOfBlocks { needed: 1, free: 0 })
        ));
    }

    #[test]
    fn only_written_full_blocks_are_registered_and_reuse_off_caches_nothing() {
        let dev = Device::Cpu;
        let prompt: Vec<u32> = (0..8).collect();
        let keys = PrefixKeys::new(&[], &prompt, 2);
        let mut off = PagedKvCache::new(1, 1, 2, 4, 2, DType::F32, &dev).unwrap();
        let a = filled(&mut off, 8);
        off.register_prefix(a, &keys).unwrap();
        off.free_sequence(a).unwrap();
        assert_eq!(off.cached_prefix_blocks(&keys, 4), 0);
        assert_eq!(off.free_blocks(), 4);

        let mut on = PagedKvCache::new(1, 1, 2, 4, 2, DType::F32, &dev).unwrap();
        on.enable_prefix_reuse();
        let a = filled(&mut on, 5); // only blocks 0 and 1 are fully written
        on.register_prefix(a, &keys).unwrap();
        on.free_sequence(a).unwrap();
        assert_eq!(on.cached_prefix_blocks(&keys, 4), 2);
        // A registered block that a truncation cuts into is forgotten (it will be rewritten).
        let b = on.add_sequence();
        on.attach_prefix(b, &keys, 2).unwrap();
        on.free_sequence(b).unwrap();
        let c = filled(&mut on, 4);
        on.register_prefix(c, &PrefixKeys::new(&[], &[50, 51, 52, 53], 2))
            .unwrap();
        on.truncate(c, 3).unwrap();
        on.free_sequence(c).unwrap();
        assert_eq!(
            on.cached_prefix_blocks(&PrefixKeys::new(&[], &[50, 51, 52, 53], 2), 2),
            1
        );
    }
}

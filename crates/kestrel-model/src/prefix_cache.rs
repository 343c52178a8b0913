//! Prefix reuse for the paged KV cache (TensorRT-LLM's `kv_cache_enable_block_reuse`, vLLM's
//! automatic prefix caching): the index of full, read-only blocks that earlier requests'
//! prompts filled, keyed by a chained hash of their tokens, and the LRU order in which the
//! unreferenced ones are given back to the allocator.
//!
//! A block's K/V depend on every token before and inside it, so block `b` is identified by
//! `hash(key of block b − 1, tokens of block b)`; a new prompt walks its blocks from the
//! first and stops at the first miss. The index also keeps each block's exact tokens and its
//! parent's hash, and a hit must match them, so a 64-bit hash collision cannot hand a request
//! someone else's K/V.
//!
//! The index only knows block ids; reference counts and the free list stay in
//! [`crate::PagedKvCache`], which asks [`PrefixIndex::evict`] for a block when its free list
//! is empty.

use std::collections::hash_map::DefaultHasher;
use std::collections::{BTreeMap, HashMap};
use std::hash::{Hash, Hasher};

/// The per-block keys of a prompt: one chained hash per *full* block of `tokens`.
#[derive(Debug, Clone)]
pub struct PrefixKeys {
    /// The full blocks' tokens (a copy: the caller's token vector keeps growing).
    tokens: Vec<u32>,
    block_size: usize,
    /// `hashes[b]` identifies `context` + `tokens[..(b + 1) * block_size]`.
    hashes: Vec<u64>,
    /// The hash block 0 chains from: it folds in `context`.
    root: u64,
}

impl PrefixKeys {
    /// Keys of the full blocks of `tokens`. `context` holds tokens that are not cached in
    /// this cache's slots but still determine their contents (the EAGLE head's slot `p`
    /// depends on prompt token `p + 1`, so its keys are `prompt[1..]` under context
    /// `[prompt[0]]`); a plain model's prompt has an empty context.
    pub fn new(context: &[u32], tokens: &[u32], block_size: usize) -> Self {
        let root = chain(0x6b65_7374_7265_6c00, context);
        let full = tokens.len().checked_div(block_size).unwrap_or(0);
        let mut hashes = Vec::with_capacity(full);
        let mut parent = root;
        for b in 0..full {
            parent = chain(parent, &tokens[b * block_size..(b + 1) * block_size]);
            hashes.push(parent);
        }
        PrefixKeys {
            tokens: tokens[..full * block_size].to_vec(),
            block_size,
            hashes,
            root,
        }
    }

    /// Full blocks of the prompt (the only ones that may be cached).
    pub fn full_blocks(&self) -> usize {
        self.hashes.len()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    fn parent(&self, b: usize) -> u64 {
        if b == 0 {
            self.root
        } else {
            self.hashes[b - 1]
        }
    }

    fn block_tokens(&self, b: usize) -> &[u32] {
        &self.tokens[b * self.block_size..(b + 1) * self.block_size]
    }
}

/// `hash(parent, tokens)`: SipHash with fixed keys, so equal prefixes give equal keys for the
/// life of the process (the index never leaves it).
pub fn chain(parent: u64, tokens: &[u32]) -> u64 {
    let mut h = DefaultHasher::new();
    parent.hash(&mut h);
    tokens.hash(&mut h);
    h.finish()
}

/// What the index remembers of one cached block, to verify a hit exactly.
#[derive(Debug, Clone)]
struct Entry {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
}

/// Cached prompt blocks: hash → block, per block its entry, and the LRU order of those no
/// sequence references.
#[derive(Debug)]
pub(crate) struct PrefixIndex {
    by_hash: HashMap<u64, usize>,
    entries: Vec<Option<Entry>>,
    /// Unreferenced cached blocks by the tick they were released at; the oldest goes first.
    evictable: BTreeMap<u64, usize>,
    /// Per block: its key in `evictable` while it is there.
    evictable_tick: Vec<Option<u64>>,
    tick: u64,
}

impl PrefixIndex {
    pub fn new(num_blocks: usize) -> Self {
        PrefixIndex {
            by_hash: HashMap::new(),
            entries: vec![None; num_blocks],
            evictable: BTreeMap::new(),
            evictable_tick: vec![None; num_blocks],
            tick: 0,
        }
    }

    /// How many leading full blocks of `keys` are cached, at most `max_blocks`; with their
    /// block ids appended to `out`.
    pub fn lookup(&self, keys: &PrefixKeys, max_blocks: usize, out: &mut Vec<usize>) -> usize {
        let n = keys.full_blocks().min(max_blocks);
        for b in 0..n {
            let Some(&block) = keys.hashes.get(b).and_then(|h| self.by_hash.get(h)) else {
                return b;
            };
            let exact = self.entries[block]
                .as_ref()
                .is_some_and(|e| e.parent == keys.parent(b) && *e.tokens == *keys.block_tokens(b));
            if !exact {
                return b;
            }
            out.push(block);
        }
        n
    }

    pub fn is_cached(&self, block: usize) -> bool {
        self.entries[block].is_some()
    }

    /// Records `block` as holding full block `b` of `keys`; a key that is already cached (in
    /// another block) keeps its block, and this one stays private.
    pub fn insert(&mut self, keys: &PrefixKeys, b: usize, block: usize) {
        if self.entries[block].is_some() {
            return;
        }
        let hash = keys.hashes[b];
        if self.by_hash.contains_key(&hash) {
            return;
        }
        self.by_hash.insert(hash, block);
        self.entries[block] = Some(Entry {
            hash,
            parent: keys.parent(b),
            tokens: keys.block_tokens(b).into(),
        });
    }

    /// Forgets `block` (it is about to be overwritten).
    pub fn remove(&mut self, block: usize) {
        if let Some(e) = self.entries[block].take() {
            self.by_hash.remove(&e.hash);
        }
        if let Some(t) = self.evictable_tick[block].take() {
            self.evictable.remove(&t);
        }
    }

    /// A cached block that no sequence references any more: reusable until evicted.
    pub fn release(&mut self, block: usize) {
        self.tick += 1;
        self.evictable.insert(self.tick, block);
        self.evictable_tick[block] = Some(self.tick);
    }

    /// A cached block a sequence attaches: not evictable while referenced.
    pub fn acquire(&mut self, block: usize) {
        if let Some(t) = self.evictable_tick[block].take() {
            self.evictable.remove(&t);
        }
    }

    /// Unreferenced cached blocks.
    pub fn evictable(&self) -> usize {
        self.evictable.len()
    }

    /// Takes the least recently released cached block out of the index for reuse.
    pub fn evict(&mut self) -> Option<usize> {
        let (_, block) = self.evictable.pop_first()?;
        self.evictable_tick[block] = None;
        if let Some(e) = self.entries[block].take() {
            self.by_hash.remove(&e.hash);
        }
        Some(block)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_keys_depend_on_every_earlier_token() {
        let a: Vec<u32> = (0..12).collect();
        let mut b = a.clone();
        b[1] = 99; // differs in block 0 only
        let (ka, kb) = (PrefixKeys::new(&[], &a, 4), PrefixKeys::new(&[], &b, 4));
        assert_eq!(ka.full_blocks(), 3);
        for i in 0..3 {
            assert_ne!(ka.hashes[i], kb.hashes[i], "block {i}");
        }
        // A partial last block has no key; equal prefixes give equal keys.
        let c = &a[..11];
        let kc = PrefixKeys::new(&[], c, 4);
        assert_eq!(kc.full_blocks(), 2);
        assert_eq!(kc.hashes[..], ka.hashes[..2]);
        // The context is part of the key.
        let kd = PrefixKeys::new(&[7], &a, 4);
        assert_ne!(kd.hashes[0], ka.hashes[0]);
        assert_eq!(PrefixKeys::new(&[7], &a, 4).hashes, kd.hashes);
    }

    #[test]
    fn lookup_walks_the_chain_and_stops_at_the_first_miss() {
        let a: Vec<u32> = (0..16).collect();
        let ka = PrefixKeys::new(&[], &a, 4);
        let mut idx = PrefixIndex::new(8);
        for b in 0..4 {
            idx.insert(&ka, b, 4 + b);
        }
        let mut out = Vec::new();
        assert_eq!(idx.lookup(&ka, 4, &mut out), 4);
        assert_eq!(out, vec![4, 5, 6, 7]);
        out.clear();
        assert_eq!(idx.lookup(&ka, 2, &mut out), 2, "capped by max_blocks");
        // Same first two blocks, then a different third: two hits.
        let mut b = a.clone();
        b[9] = 77;
        out.clear();
        assert_eq!(idx.lookup(&PrefixKeys::new(&[], &b, 4), 4, &mut out), 2);
        assert_eq!(out, vec![4, 5]);
        // The same tokens later in a prompt are not a hit: block keys are chained.
        let shifted: Vec<u32> = [100, 101, 102, 103].iter().chain(&a).copied().collect();
        out.clear();
        assert_eq!(
            idx.lookup(&PrefixKeys::new(&[], &shifted, 4), 5, &mut out),
            0
        );
        // Evicting block 1 (id 5) cuts the chain there.
        idx.remove(5);
        out.clear();
        assert_eq!(idx.lookup(&ka, 4, &mut out), 1);
    }

    #[test]
    fn a_hash_collision_is_not_a_hit() {
        let a: Vec<u32> = (0..4).collect();
        let ka = PrefixKeys::new(&[], &a, 4);
        let mut idx = PrefixIndex::new(2);
        idx.insert(&ka, 0, 1);
        // Forge another prompt whose block key collides with ka's.
        let other = vec![9u32, 9, 9, 9];
        let mut forged = PrefixKeys::new(&[], &other, 4);
        forged.hashes[0] = ka.hashes[0];
        assert_eq!(idx.lookup(&forged, 1, &mut Vec::new()), 0);
    }

    #[test]
    fn eviction_is_least_recently_released_first() {
        let a: Vec<u32> = (0..12).collect();
        let ka = PrefixKeys::new(&[], &a, 4);
        let mut idx = PrefixIndex::new(3);
        for b in 0..3 {
            idx.insert(&ka, b, b);
        }
        for b in [2, 0, 1] {
            idx.release(b);
        }
        assert_eq!(idx.evictable(), 3);
        idx.acquire(0); // in use again: not evictable
        assert_eq!(idx.evict(), Some(2));
        assert_eq!(idx.evict(), Some(1));
        assert_eq!(idx.evict(), None);
        assert!(idx.is_cached(0) && !idx.is_cached(1) && !idx.is_cached(2));
    }
}

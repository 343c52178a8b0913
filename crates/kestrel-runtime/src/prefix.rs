//! Prompt prefix reuse as the decoders use it (`--kv_cache_enable_block_reuse`): a new
//! sequence attaches the cached full blocks its prompt starts with and prefills only the rest;
//! a freed sequence offers its prompt's full blocks to later ones.
//!
//! Only blocks that the prompt's prefill wrote are ever offered: the keys cover full blocks
//! of the prompt alone, and every decoder writes generated tokens at slots past the prompt.
//! At least the prompt's last token is always prefilled, so its logits (the first generated
//! token) come out of the prefill as they would without reuse.

use crate::error::Result;
use crate::sequence::Sequence;
use kestrel_model::{PagedKvCache, PrefixKeys, SeqId};

/// What a cache's slot `p` holds.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Slots {
    /// Prompt token `p`: a model's own cache.
    Tokens,
    /// The pair (prompt token `p + 1`, target feature `p`): the EAGLE head's cache, whose
    /// slot therefore depends on one token more.
    Pairs,
}

/// The prompt keys, in one cache, of every sequence a run has admitted (indexed by
/// [`Sequence::index`]); empty when the cache does not reuse prefixes.
pub(crate) struct PromptPrefixes {
    slots: Slots,
    keys: Vec<PrefixKeys>,
}

impl PromptPrefixes {
    pub fn new(slots: Slots) -> Self {
        PromptPrefixes {
            slots,
            keys: Vec::new(),
        }
    }

    /// Keys the prompts of newly admitted sequences (in index order, after every earlier one).
    pub fn add(&mut self, cache: &PagedKvCache, seqs: &[Sequence]) {
        if !cache.prefix_reuse() {
            return;
        }
        let bs = cache.block_size();
        for s in seqs {
            debug_assert_eq!(s.index, self.keys.len(), "sequences are admitted in order");
            let prompt = &s.tokens[..s.prompt_len];
            self.keys.push(match self.slots {
                Slots::Tokens => PrefixKeys::new(&[], prompt, bs),
                Slots::Pairs => PrefixKeys::new(&prompt[..1], &prompt[1..], bs),
            });
        }
    }

    /// Per sequence: how many leading blocks of its prompt the cache holds, leaving at least
    /// the prompt's last token to prefill.
    pub fn cached_blocks(&self, cache: &PagedKvCache, seqs: &[Sequence]) -> Vec<usize> {
        let bs = cache.block_size();
        seqs.iter()
            .map(|s| match self.keys.get(s.index) {
                Some(k) => cache.cached_prefix_blocks(k, (s.prompt_len - 1) / bs),
                None => 0,
            })
            .collect()
    }

    /// Attaches `blocks[i]` cached blocks to sequence `seqs[i]` (cache handle `ids[i]`);
    /// returns the prompt tokens each sequence got from the cache.
    pub fn attach(
        &self,
        cache: &mut PagedKvCache,
        seqs: &[Sequence],
        ids: &[SeqId],
        blocks: &[usize],
    ) -> Result<Vec<usize>> {
        let bs = cache.block_size();
        let mut reused = vec![0; ids.len()];
        for (i, ((s, &id), &n)) in seqs.iter().zip(ids).zip(blocks).enumerate() {
            if let Some(k) = self.keys.get(s.index) {
                cache.attach_prefix(id, k, n)?;
                reused[i] = n * bs;
            }
        }
        Ok(reused)
    }

    /// Offers the prompt blocks of the sequence of index `index` for reuse and frees it (when
    /// it is still there).
    pub fn free(&self, cache: &mut PagedKvCache, index: usize, id: SeqId) -> Result<()> {
        if !cache.contains(id) {
            return Ok(());
        }
        if let Some(k) = self.keys.get(index) {
            cache.register_prefix(id, k)?;
        }
        cache.free_sequence(id)?;
        Ok(())
    }
}

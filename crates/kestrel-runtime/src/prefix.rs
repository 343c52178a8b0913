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

/// The prompt keys of a batch in one cache; empty when the cache does not reuse prefixes.
pub(crate) struct PromptPrefixes {
    keys: Vec<PrefixKeys>,
}

impl PromptPrefixes {
    pub fn new(cache: &PagedKvCache, seqs: &[Sequence], slots: Slots) -> Self {
        if !cache.prefix_reuse() {
            return PromptPrefixes { keys: Vec::new() };
        }
        let bs = cache.block_size();
        let keys = seqs
            .iter()
            .map(|s| {
                let prompt = &s.tokens[..s.prompt_len];
                match slots {
                    Slots::Tokens => PrefixKeys::new(&[], prompt, bs),
                    Slots::Pairs => PrefixKeys::new(&prompt[..1], &prompt[1..], bs),
                }
            })
            .collect();
        PromptPrefixes { keys }
    }

    /// Per sequence: how many leading blocks of its prompt the cache holds, leaving at least
    /// the prompt's last token to prefill.
    pub fn cached_blocks(&self, cache: &PagedKvCache, seqs: &[Sequence]) -> Vec<usize> {
        let bs = cache.block_size();
        seqs.iter()
            .enumerate()
            .map(|(i, s)| match self.keys.get(i) {
                Some(k) => cache.cached_prefix_blocks(k, (s.prompt_len - 1) / bs),
                None => 0,
            })
            .collect()
    }

    /// Attaches `blocks[i]` cached blocks to sequence `ids[i]`; returns the prompt tokens
    /// each sequence got from the cache.
    pub fn attach(
        &self,
        cache: &mut PagedKvCache,
        ids: &[SeqId],
        blocks: &[usize],
    ) -> Result<Vec<usize>> {
        let bs = cache.block_size();
        let mut reused = vec![0; ids.len()];
        for (i, (&id, &n)) in ids.iter().zip(blocks).enumerate() {
            if let Some(k) = self.keys.get(i) {
                cache.attach_prefix(id, k, n)?;
                reused[i] = n * bs;
            }
        }
        Ok(reused)
    }

    /// Offers sequence `i`'s prompt blocks for reuse and frees it (when it is still there).
    pub fn free(&self, cache: &mut PagedKvCache, i: usize, id: SeqId) -> Result<()> {
        if !cache.contains(id) {
            return Ok(());
        }
        if let Some(k) = self.keys.get(i) {
            cache.register_prefix(id, k)?;
        }
        cache.free_sequence(id)?;
        Ok(())
    }
}

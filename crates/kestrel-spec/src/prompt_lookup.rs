//! Prompt lookup decoding (Saxena 2023; TensorRT-LLM's `prompt_lookup_config`, vLLM's
//! `ngram` speculator): the draft is what followed the last earlier occurrence of the
//! sequence's final n-gram, in its own prompt and output. No draft model, no training, and
//! drafting costs a scan of the sequence on the host; it pays where outputs repeat their
//! input or themselves (summaries, code edits, quoted names, lists), and the target's
//! verification keeps the output exactly the target's whatever the draft.
//!
//! With an n-gram model of the target's answers to other prompts ([`NgramCorpus`]), the
//! corpus drafts where the sequence has nothing longer than one token to copy.
//!
//! Which occurrence: the latest. On SmolLM2-135M's greedy MT-bench answers (20 first turns,
//! 128 tokens) the latest match gave 1.33 tokens a step at `num_tokens` 4 and
//! `max_ngram` 3, the earliest 1.31; n-grams longer than 3 changed nothing.

use crate::NgramCorpus;
use thiserror::Error;

/// How drafts are looked up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptLookupConfig {
    /// Draft tokens proposed per step at most (TensorRT-LLM's `prompt_lookup_num_tokens`).
    pub num_tokens: usize,
    /// Longest n-gram matched; shorter ones are tried down to 1
    /// (`max_matching_ngram_size`).
    pub max_ngram: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PromptLookupError {
    #[error("prompt_lookup_num_tokens must be at least 1")]
    NoTokens,
    #[error("max_matching_ngram_size must be at least 1")]
    NoNgram,
}

impl PromptLookupConfig {
    pub fn new(num_tokens: usize, max_ngram: usize) -> Result<Self, PromptLookupError> {
        if num_tokens == 0 {
            return Err(PromptLookupError::NoTokens);
        }
        if max_ngram == 0 {
            return Err(PromptLookupError::NoNgram);
        }
        Ok(PromptLookupConfig {
            num_tokens,
            max_ngram,
        })
    }

    /// Up to `limit` (and `num_tokens`) draft tokens for a sequence whose tokens so far are
    /// `tokens`: for the longest n (≤ `max_ngram`) whose final n-gram occurs earlier in
    /// `tokens`, the tokens that followed its latest earlier occurrence; empty when no suffix
    /// recurs. With an n-gram model of other answers (`corpus`): the sequence's own n-grams
    /// of two tokens or more first, then the corpus's chain, then an earlier occurrence of
    /// the sequence's last token alone. (A one-token match in the sequence is a weaker guess
    /// than the corpus's longer context: 1.66 against 1.64 tokens a step on SmolLM2's
    /// MT-bench answers, 4 drafts.)
    pub fn propose(&self, tokens: &[u32], limit: usize, corpus: Option<&NgramCorpus>) -> Vec<u32> {
        let want = self.num_tokens.min(limit);
        if want == 0 {
            return Vec::new();
        }
        let Some(corpus) = corpus else {
            return self.own(tokens, want, 1);
        };
        let own = self.own(tokens, want, 2);
        if !own.is_empty() {
            return own;
        }
        let drafts = corpus.chain(tokens, want);
        if !drafts.is_empty() {
            return drafts;
        }
        self.own(tokens, want, 1)
    }

    /// Up to `want` tokens after the latest earlier occurrence of the longest final n-gram
    /// (`min_n ≤ n ≤ max_ngram`) of `tokens`.
    fn own(&self, tokens: &[u32], want: usize, min_n: usize) -> Vec<u32> {
        let len = tokens.len();
        for n in (min_n..=self.max_ngram.min(len.saturating_sub(1))).rev() {
            let suffix = &tokens[len - n..];
            // Occurrences starting before the suffix itself, latest first.
            if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
                let from = start + n;
                return tokens[from..(from + want).min(len)].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(num_tokens: usize, max_ngram: usize) -> PromptLookupConfig {
        PromptLookupConfig::new(num_tokens, max_ngram).unwrap()
    }

    #[test]
    fn the_longest_recurring_suffix_wins_over_a_later_shorter_one() {
        // Suffix [7, 8, 9]: the 3-gram occurs at 1 (followed by 4, 5); the 1-gram 9 also
        // occurs later, at 7 (followed by 6).
        let tokens = [0, 7, 8, 9, 4, 5, 1, 9, 6, 7, 8, 9];
        assert_eq!(cfg(2, 3).propose(&tokens, 10, None), vec![4, 5]);
        // Capped at 1-grams, the latest 9 is the one at 7.
        assert_eq!(cfg(2, 1).propose(&tokens, 10, None), vec![6, 7]);
    }

    #[test]
    fn the_latest_occurrence_is_taken() {
        let tokens = [3, 1, 3, 2, 3];
        assert_eq!(cfg(1, 1).propose(&tokens, 10, None), vec![2]);
    }

    #[test]
    fn drafts_stop_at_the_end_of_the_sequence_and_at_the_limit() {
        // The suffix [5] last occurred at 3: only the one token after it exists before the end.
        let tokens = [5, 6, 7, 5, 5];
        assert_eq!(cfg(4, 2).propose(&tokens, 10, None), vec![5]);
        assert_eq!(
            cfg(4, 1).propose(&[1, 2, 3, 4, 1], 10, None),
            vec![2, 3, 4, 1]
        );
        assert_eq!(cfg(4, 1).propose(&[1, 2, 3, 4, 1], 2, None), vec![2, 3]);
        assert_eq!(
            cfg(4, 1).propose(&[1, 2, 3, 4, 1], 0, None),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn no_recurring_suffix_drafts_nothing() {
        assert_eq!(
            cfg(4, 3).propose(&[1, 2, 3, 4], 10, None),
            Vec::<u32>::new()
        );
        assert_eq!(cfg(4, 3).propose(&[1], 10, None), Vec::<u32>::new());
        assert_eq!(cfg(4, 3).propose(&[], 10, None), Vec::<u32>::new());
    }

    #[test]
    fn a_corpus_drafts_where_the_sequence_has_no_longer_repeat() {
        let answer: &[u32] = &[20, 21, 22, 23];
        let corpus = NgramCorpus::build([answer]);
        // A 2-gram repeat of the sequence comes first.
        let tokens = [5, 6, 7, 20, 5, 6];
        assert_eq!(cfg(2, 3).propose(&tokens, 9, Some(&corpus)), vec![7, 20]);
        // Only a 1-gram repeat (20): the corpus's chain after [.., 20] instead.
        let tokens = [20, 9, 8, 20];
        assert_eq!(cfg(2, 3).propose(&tokens, 9, Some(&corpus)), vec![21, 22]);
        assert_eq!(cfg(2, 3).propose(&tokens, 9, None), vec![9, 8]);
        // Nothing in the corpus: back to the 1-gram repeat.
        let tokens = [30, 31, 30];
        assert_eq!(cfg(2, 3).propose(&tokens, 9, Some(&corpus)), vec![31, 30]);
        assert_eq!(
            cfg(2, 3).propose(&tokens, 0, Some(&corpus)),
            Vec::<u32>::new()
        );
    }

    #[test]
    fn zero_sizes_are_refused() {
        assert_eq!(
            PromptLookupConfig::new(0, 2).unwrap_err().to_string(),
            "prompt_lookup_num_tokens must be at least 1"
        );
        assert_eq!(
            PromptLookupConfig::new(3, 0).unwrap_err().to_string(),
            "max_matching_ngram_size must be at least 1"
        );
    }
}

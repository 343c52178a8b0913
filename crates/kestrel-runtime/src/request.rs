//! What a caller asks for and what it gets back, whatever the decoding mode.

use kestrel_spec::SamplingParams;
use serde::Serialize;

#[derive(Debug, Clone)]
pub struct GenerationParams {
    /// New tokens per sequence at most.
    pub max_output_len: usize,
    pub sampling: SamplingParams,
    /// Generation of a sequence stops after any of these ids (which is kept in the output).
    pub end_ids: Vec<u32>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end id was generated.
    Stop,
    /// max_output_len, or the engine's max_seq_len, was reached.
    Length,
}

/// Per-sequence counters, filled by every decoding mode.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SeqStats {
    /// Target-model forward calls after the prompt (decode or verification steps).
    pub steps: usize,
    /// Tokens committed per step, on average (1 for plain decoding).
    pub tokens_per_step: f64,
    /// `histogram[k]` = steps that committed k + 1 tokens (accepted drafts + the bonus token).
    pub accepted_len_histogram: Vec<usize>,
    /// Draft tokens proposed and accepted (speculative modes).
    pub draft_tokens: usize,
    pub accepted_draft_tokens: usize,
    /// Seconds from the start of the request to its first token.
    pub time_to_first_token_s: f64,
    /// Prompt tokens whose K/V the target took from cached prefix blocks instead of
    /// prefilling them (`--kv_cache_enable_block_reuse`).
    pub reused_prompt_tokens: usize,
}

impl SeqStats {
    pub(crate) fn record_step(&mut self, committed: usize) {
        self.steps += 1;
        if self.accepted_len_histogram.len() < committed {
            self.accepted_len_histogram.resize(committed, 0);
        }
        if committed > 0 {
            self.accepted_len_histogram[committed - 1] += 1;
        }
    }

    pub(crate) fn finish(&mut self, generated: usize) {
        // The first token comes from the prompt's forward, not from a step.
        let from_steps = generated.saturating_sub(1);
        self.tokens_per_step = if self.steps == 0 {
            0.0
        } else {
            from_steps as f64 / self.steps as f64
        };
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct SequenceOutput {
    pub output_ids: Vec<u32>,
    pub finish_reason: FinishReason,
    pub stats: SeqStats,
}

/// Wall-clock split of a whole run and its KV pools, for `--run_profiling`.
#[derive(Debug, Clone, Default, Serialize)]
pub struct RunTimings {
    pub prefill_s: f64,
    pub draft_s: f64,
    pub verify_s: f64,
    /// Of `verify_s`, EAGLE's acceptance of the verified trees: mostly waiting for the
    /// verification to finish on the device and its tokens to reach the host, so
    /// `verify_s - accept_s` is host work the device may have waited for.
    pub accept_s: f64,
    /// Of `draft_s`, EAGLE's head reading the newly committed pairs (the rest is the tree's
    /// draft levels).
    pub head_s: f64,
    /// Of `verify_s`, EAGLE's work after acceptance: KV compaction, the kept rows' features,
    /// commits.
    pub update_s: f64,
    pub total_s: f64,
    pub generated_tokens: usize,
    /// Decode or speculative steps run (each over every live sequence of the batch).
    pub batch_steps: usize,
    /// One entry per KV cache the decoder holds: the target's first, then the draft's or
    /// the EAGLE head's.
    pub kv_pools: Vec<KvPoolStats>,
}

/// One KV block pool of a run: its size and how the prompts got into it.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KvPoolStats {
    /// `target`, `draft` or `eagle_head`.
    pub name: &'static str,
    pub blocks: usize,
    pub block_size: usize,
    /// Prompt tokens whose K/V came from cached prefix blocks.
    pub reused_prompt_tokens: usize,
    /// Prompt tokens that went through a prefill forward.
    pub prefilled_prompt_tokens: usize,
}

/// Receives tokens as soon as they are committed (streaming).
pub trait TokenSink {
    fn on_tokens(&mut self, seq_index: usize, tokens: &[u32]);
}

/// A sink that ignores everything (no streaming).
pub struct NoSink;

impl TokenSink for NoSink {
    fn on_tokens(&mut self, _: usize, _: &[u32]) {}
}

//! Per-sequence bookkeeping shared by every decoding mode: the tokens so far, the stop
//! rules, the random stream and the stats.

use crate::error::{Result, RuntimeError};
use crate::request::{FinishReason, GenerationParams, SeqStats, TokenSink};
use kestrel_core::plan::BuildLimits;
use kestrel_spec::SeqRng;

pub(crate) struct Sequence {
    /// Index of the request in the caller's batch.
    pub index: usize,
    pub prompt_len: usize,
    /// Prompt followed by the committed output.
    pub tokens: Vec<u32>,
    pub rng: SeqRng,
    pub finish: Option<FinishReason>,
    pub stats: SeqStats,
    max_total: usize,
}

impl Sequence {
    pub fn new(
        index: usize,
        prompt: &[u32],
        params: &GenerationParams,
        limits: &BuildLimits,
    ) -> Self {
        Sequence {
            index,
            prompt_len: prompt.len(),
            tokens: prompt.to_vec(),
            rng: SeqRng::new(params.sampling.seed, index as u64),
            finish: None,
            stats: SeqStats::default(),
            max_total: (prompt.len() + params.max_output_len).min(limits.max_seq_len),
        }
    }

    pub fn is_live(&self) -> bool {
        self.finish.is_none()
    }

    /// Whether the sequence is still live after one more token, unless that token is an
    /// end id: the next token cannot end it by length.
    pub fn outlives_next_token(&self) -> bool {
        self.finish.is_none() && self.tokens.len() + 1 < self.max_total
    }

    pub fn output(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Room left before the length limit.
    pub fn remaining(&self) -> usize {
        self.max_total - self.tokens.len()
    }

    /// Appends tokens in order until a stop rule fires; returns how many were kept and
    /// streams them.
    pub fn commit(
        &mut self,
        new: &[u32],
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
    ) -> usize {
        let mut kept = 0;
        for &t in new {
            if self.finish.is_some() {
                break;
            }
            self.tokens.push(t);
            kept += 1;
            if params.end_ids.contains(&t) {
                self.finish = Some(FinishReason::Stop);
            } else if self.tokens.len() >= self.max_total {
                self.finish = Some(FinishReason::Length);
            }
        }
        sink.on_tokens(self.index, &new[..kept]);
        kept
    }
}

/// Refuses requests the engine was not built for, naming the input and the limit.
pub(crate) fn validate_prompts(
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    limits: &BuildLimits,
) -> Result<()> {
    if params.max_output_len == 0 {
        return Err(RuntimeError::InvalidRequest(
            "--max_output_len must be at least 1".into(),
        ));
    }
    for (i, p) in prompts.iter().enumerate() {
        if p.is_empty() {
            return Err(RuntimeError::InvalidRequest(format!("input {i} is empty")));
        }
        if p.len() > limits.max_input_len {
            return Err(RuntimeError::InvalidRequest(format!(
                "input {i} has {} tokens, more than the engine's max_input_len {}: shorten it or rebuild with a larger --max_input_len",
                p.len(),
                limits.max_input_len
            )));
        }
    }
    params
        .sampling
        .validate()
        .map_err(|e| RuntimeError::InvalidRequest(e.to_string()))
}

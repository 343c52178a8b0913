//! The driver shared by all decoding modes: validates the request, splits it into batches of
//! at most `max_batch_size` (and no more than the decoder's KV pools hold) and hands each
//! batch to a [`Decoder`].

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::kv_budget::{PoolShape, FRACTION_FLAG};
use crate::logit_rows::row_tokens;
use crate::request::{GenerationParams, KvPoolStats, RunTimings, SequenceOutput, TokenSink};
use crate::sequence::{validate_prompts, Sequence};
use candle_core::Tensor;
use kestrel_core::plan::BuildLimits;
use kestrel_model::{OutputRows, SeqId, SeqInput};
use std::time::Instant;

/// One decoding mode: runs a batch of sequences to completion.
pub(crate) trait Decoder {
    fn run_batch(
        &mut self,
        seqs: &mut [Sequence],
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<()>;

    /// The decoder's KV pools, the target's first: for batching and `RunTimings::kv_pools`,
    /// whose counters `run_batch` adds to in the same order.
    fn pools(&self) -> Vec<PoolShape>;
}

pub(crate) fn drive(
    engine: &Engine,
    decoder: &mut dyn Decoder,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    sink: &mut dyn TokenSink,
) -> Result<(Vec<SequenceOutput>, RunTimings)> {
    let limits = &engine.plan.limits;
    validate_prompts(prompts, params, limits)?;
    let start = Instant::now();
    let pools = decoder.pools();
    let mut timings = RunTimings {
        kv_pools: pools
            .iter()
            .map(|p| KvPoolStats {
                name: p.name,
                blocks: p.blocks,
                block_size: p.block_size,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    };
    let mut outputs = Vec::with_capacity(prompts.len());
    let mut first = 0;
    while first < prompts.len() {
        let end = batch_end(&pools, prompts, first, params, limits)?;
        let mut seqs: Vec<Sequence> = prompts[first..end]
            .iter()
            .enumerate()
            .map(|(i, p)| Sequence::new(first + i, p, params, limits))
            .collect();
        decoder.run_batch(&mut seqs, params, sink, &mut timings)?;
        for mut s in seqs {
            let generated = s.output().len();
            s.stats.finish(generated);
            timings.generated_tokens += generated;
            outputs.push(SequenceOutput {
                output_ids: s.output().to_vec(),
                finish_reason: s.finish.expect("a finished batch has finished sequences"),
                stats: s.stats,
            });
        }
        first = end;
    }
    timings.total_s = start.elapsed().as_secs_f64();
    Ok((outputs, timings))
}

/// The end of the batch that starts at prompt `first`: at most `max_batch_size` prompts,
/// and only as many as every pool holds at their longest (prompt + `max_output_len`, capped
/// at `max_seq_len`, plus a verification step). Pools of the default size always hold a
/// full batch, so only `--kv_cache_free_gpu_memory_fraction` makes batches smaller.
fn batch_end(
    pools: &[PoolShape],
    prompts: &[Vec<u32>],
    first: usize,
    params: &GenerationParams,
    limits: &BuildLimits,
) -> Result<usize> {
    let longest = |p: &[u32]| (p.len() + params.max_output_len).min(limits.max_seq_len);
    let mut used = vec![0; pools.len()];
    let mut end = first;
    while end < prompts.len() && end - first < limits.max_batch_size {
        let len = longest(&prompts[end]);
        if pools
            .iter()
            .zip(&used)
            .any(|(p, &u)| u + p.blocks_for(len) > p.blocks)
        {
            break;
        }
        for (p, u) in pools.iter().zip(used.iter_mut()) {
            *u += p.blocks_for(len);
        }
        end += 1;
    }
    if end == first {
        let len = longest(&prompts[first]);
        let p = pools
            .iter()
            .find(|p| p.blocks_for(len) > p.blocks)
            .expect("some pool is too small");
        return Err(RuntimeError::InvalidRequest(format!(
            "input {first} needs {} KV blocks of {} tokens in the {} cache, which has {}: raise {FRACTION_FLAG} or lower --max_output_len",
            p.blocks_for(len),
            p.block_size,
            p.name,
            p.blocks
        )));
    }
    Ok(end)
}

/// Picks the next token of each row of `logits` (`[rows, vocab]`, f32) for `seqs`, in order:
/// the argmax when greedy, else a draw with one uniform from each sequence's stream, on the
/// device when the rows are there (`logit_rows::row_tokens`: one id a row crosses, not
/// the row).
pub(crate) fn sample_rows(
    logits: &Tensor,
    seqs: &mut [&mut Sequence],
    params: &GenerationParams,
) -> Result<Vec<u32>> {
    let uniforms: Vec<f64> = if params.sampling.is_greedy() {
        Vec::new()
    } else {
        seqs.iter_mut().map(|s| s.rng.uniform()).collect()
    };
    row_tokens(logits, &params.sampling, &uniforms)
}

/// Every sequence's prompt from token `starts[i]` on (the tokens before it came from cached
/// prefix blocks) as one varlen prefill batch; `pos` must hold [`prompt_positions`] of the
/// same sequences and starts.
pub(crate) fn prompt_batch<'a>(
    seqs: &'a [Sequence],
    ids: &[SeqId],
    starts: &[usize],
    pos: &'a [Vec<u32>],
    rows: OutputRows,
) -> Vec<SeqInput<'a>> {
    seqs.iter()
        .zip(ids)
        .zip(starts)
        .zip(pos)
        .map(|(((s, &seq), &start), p)| SeqInput {
            seq,
            tokens: &s.tokens[start..s.prompt_len],
            positions: p,
            mask: None,
            output_rows: rows.clone(),
        })
        .collect()
}

/// The RoPE positions of every sequence's prompt from token `starts[i]` on.
pub(crate) fn prompt_positions(seqs: &[Sequence], starts: &[usize]) -> Vec<Vec<u32>> {
    seqs.iter()
        .zip(starts)
        .map(|(s, &start)| positions(start, s.prompt_len - start))
        .collect()
}

/// Adds a batch's prompt counts to pool `pool` of the run: `reused[i]` of sequence i's
/// prompt slots came from cached blocks, the rest of its `slots[i]` were prefilled.
pub(crate) fn count_prompt(
    timings: &mut RunTimings,
    pool: usize,
    slots: impl Iterator<Item = usize>,
    reused: &[usize],
) {
    if let Some(p) = timings.kv_pools.get_mut(pool) {
        for (n, &r) in slots.zip(reused) {
            p.reused_prompt_tokens += r;
            p.prefilled_prompt_tokens += n - r;
        }
    }
}

/// Positions `start..start+n` as RoPE positions.
pub(crate) fn positions(start: usize, n: usize) -> Vec<u32> {
    (start as u32..(start + n) as u32).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kestrel_spec::SamplingParams;

    #[test]
    fn batches_are_cut_to_what_every_pool_holds() {
        let limits = BuildLimits {
            max_batch_size: 4,
            max_input_len: 32,
            max_seq_len: 64,
            max_beam_width: 1,
            max_draft_len: 3,
            num_eagle_layers: 0,
            max_non_leaves_per_layer: 0,
            tokens_per_block: 8,
        };
        let pool = |name, blocks, block_size| PoolShape {
            name,
            blocks,
            block_size,
            headroom: 4,
        };
        let params = GenerationParams {
            max_output_len: 12,
            sampling: SamplingParams::greedy(),
            end_ids: vec![],
        };
        // Prompts of 4 tokens: 4 + 12 + 4 = 20 slots, 3 blocks of 8 or 5 blocks of 4.
        let prompts = vec![vec![1u32; 4]; 6];
        let roomy = [pool("target", 100, 8), pool("draft", 100, 4)];
        assert_eq!(batch_end(&roomy, &prompts, 0, &params, &limits).unwrap(), 4);
        assert_eq!(batch_end(&roomy, &prompts, 4, &params, &limits).unwrap(), 6);
        // The draft pool (11 blocks of 4) holds two such sequences.
        let tight = [pool("target", 100, 8), pool("draft", 11, 4)];
        assert_eq!(batch_end(&tight, &prompts, 0, &params, &limits).unwrap(), 2);
        // A longer prompt needs more: 30 + 12 + 4 = 46 slots, 12 blocks of 4.
        let mut mixed = prompts.clone();
        mixed[1] = vec![1; 30];
        assert_eq!(batch_end(&tight, &mixed, 0, &params, &limits).unwrap(), 1);
        let err = batch_end(&tight, &mixed, 1, &params, &limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            "input 1 needs 12 KV blocks of 4 tokens in the draft cache, which has 11: raise --kv_cache_free_gpu_memory_fraction or lower --max_output_len"
        );
    }
}

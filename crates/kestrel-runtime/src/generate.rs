//! The driver shared by all decoding modes: validates the request, splits it into batches of
//! at most `max_batch_size` and hands each batch to a [`Decoder`].

use crate::engine::Engine;
use crate::error::Result;
use crate::request::{GenerationParams, RunTimings, SequenceOutput, TokenSink};
use crate::sequence::{validate_prompts, Sequence};
use candle_core::Tensor;
use kestrel_model::{OutputRows, SeqId, SeqInput};
use kestrel_spec::sampling;
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
    let mut timings = RunTimings::default();
    let mut outputs = Vec::with_capacity(prompts.len());
    for (chunk_index, chunk) in prompts.chunks(limits.max_batch_size).enumerate() {
        let first = chunk_index * limits.max_batch_size;
        let mut seqs: Vec<Sequence> = chunk
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
    }
    timings.total_s = start.elapsed().as_secs_f64();
    Ok((outputs, timings))
}

/// Picks the next token of each row of `logits` (`[rows, vocab]`, f32) for `seqs`, in order.
pub(crate) fn sample_rows(
    logits: &Tensor,
    seqs: &mut [&mut Sequence],
    params: &GenerationParams,
) -> Result<Vec<u32>> {
    let rows = logits.to_vec2::<f32>()?;
    Ok(rows
        .iter()
        .zip(seqs.iter_mut())
        .map(|(row, s)| sampling::sample_token(row, &params.sampling, &mut s.rng))
        .collect())
}

/// Every sequence's whole prompt as one varlen prefill batch; `pos` must hold
/// [`prompt_positions`] of the same sequences.
pub(crate) fn prompt_batch<'a>(
    seqs: &'a [Sequence],
    ids: &[SeqId],
    pos: &'a [Vec<u32>],
    rows: OutputRows,
) -> Vec<SeqInput<'a>> {
    seqs.iter()
        .zip(ids)
        .zip(pos)
        .map(|((s, &seq), p)| SeqInput {
            seq,
            tokens: &s.tokens,
            positions: p,
            mask: None,
            output_rows: rows.clone(),
        })
        .collect()
}

/// The RoPE positions of every sequence's prompt.
pub(crate) fn prompt_positions(seqs: &[Sequence]) -> Vec<Vec<u32>> {
    seqs.iter().map(|s| positions(0, s.tokens.len())).collect()
}

/// Positions `start..start+n` as RoPE positions.
pub(crate) fn positions(start: usize, n: usize) -> Vec<u32> {
    (start as u32..(start + n) as u32).collect()
}

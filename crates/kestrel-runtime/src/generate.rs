//! The driver shared by all decoding modes: validates the request and hands it to a
//! [`Decoder`], which admits prompts through an [`Admission`] as its batch has room (in-flight
//! batching: a finished sequence's slot and KV blocks go to the next prompt at once, rather
//! than when its whole batch is done).

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::kv_budget::{PoolShape, FRACTION_FLAG};
use crate::logit_rows::{row_ids, RowIds};
use crate::request::{GenerationParams, KvPoolStats, RunTimings, SequenceOutput, TokenSink};
use crate::sequence::{validate_prompts, Sequence};
use candle_core::Tensor;
use kestrel_core::plan::BuildLimits;
use kestrel_model::{OutputRows, SeqId, SeqInput};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// One decoding mode: runs every prompt of `admission` to completion, admitting them as its
/// batch has room, and returns the sequences in admission (= prompt) order.
pub(crate) trait Decoder {
    fn run(
        &mut self,
        admission: &mut Admission,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Sequence>>;

    /// The decoder's KV pools, the target's first: for admission and `RunTimings::kv_pools`,
    /// whose counters `run` adds to in the same order.
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
    let mut admission = Admission::new(prompts, pools, params, limits);
    let seqs = decoder.run(&mut admission, params, sink, &mut timings)?;
    let mut outputs = Vec::with_capacity(prompts.len());
    for mut s in seqs {
        let generated = s.output().len();
        s.stats.finish(generated);
        timings.generated_tokens += generated;
        outputs.push(SequenceOutput {
            output_ids: s.output().to_vec(),
            finish_reason: s.finish.expect("a finished run has finished sequences"),
            stats: s.stats,
        });
    }
    timings.total_s = start.elapsed().as_secs_f64();
    Ok((outputs, timings))
}

static IN_FLIGHT: AtomicBool = AtomicBool::new(true);

/// Whether a finished sequence's place goes to the next prompt at once (the default) or only
/// once its whole batch has finished (static batches, for comparisons: `spec-bench
/// --in_flight off`). Outputs are the same either way.
pub fn set_in_flight_batching(enabled: bool) {
    IN_FLIGHT.store(enabled, Ordering::Relaxed);
}

/// The prompts of a request waiting for a place in the batch. A prompt is admitted, in
/// order, while fewer than `max_batch_size` sequences are live and every pool still holds its
/// longest length (prompt + `max_output_len`, capped at `max_seq_len`, plus a verification
/// step) on top of the live sequences' own; a finished sequence's reservation is released at
/// once. Pools of the default size always hold a full batch, so only
/// `--kv_cache_free_gpu_memory_fraction` makes batches smaller.
pub(crate) struct Admission<'a> {
    prompts: &'a [Vec<u32>],
    pools: Vec<PoolShape>,
    params: &'a GenerationParams,
    limits: &'a BuildLimits,
    next: usize,
    /// Blocks reserved in each pool by the live sequences.
    used: Vec<usize>,
    /// Per admitted sequence: the blocks it reserved in each pool.
    held: Vec<Vec<usize>>,
    /// The admitted sequences not retired yet, ascending.
    active: Vec<usize>,
}

impl<'a> Admission<'a> {
    pub fn new(
        prompts: &'a [Vec<u32>],
        pools: Vec<PoolShape>,
        params: &'a GenerationParams,
        limits: &'a BuildLimits,
    ) -> Self {
        let used = vec![0; pools.len()];
        Admission {
            prompts,
            pools,
            params,
            limits,
            next: 0,
            used,
            held: Vec::new(),
            active: Vec::new(),
        }
    }

    /// Whether every prompt has been admitted.
    pub fn is_empty(&self) -> bool {
        self.next == self.prompts.len()
    }

    /// Appends the next prompts that fit to `seqs` as new sequences and returns the index of
    /// the first (`None` when the batch is full or the next prompt waits for blocks). A prompt
    /// that cannot fit even alone is an error.
    pub fn admit_into(&mut self, seqs: &mut Vec<Sequence>) -> Result<Option<usize>> {
        let first = seqs.len();
        if self.waits_for_retirement() {
            return Ok(None);
        }
        while !self.is_empty() && self.active.len() < self.limits.max_batch_size {
            let i = self.next;
            let len =
                (self.prompts[i].len() + self.params.max_output_len).min(self.limits.max_seq_len);
            let need: Vec<usize> = self.pools.iter().map(|p| p.blocks_for(len)).collect();
            let fits = |used: &[usize]| {
                self.pools
                    .iter()
                    .zip(used)
                    .zip(&need)
                    .all(|((p, &u), &n)| u + n <= p.blocks)
            };
            if !fits(&self.used) {
                if self.active.is_empty() {
                    let (p, n) = self
                        .pools
                        .iter()
                        .zip(&need)
                        .find(|(p, &n)| n > p.blocks)
                        .expect("some pool is too small");
                    return Err(RuntimeError::InvalidRequest(format!(
                        "input {i} needs {n} KV blocks of {} tokens in the {} cache, which has {}: raise {FRACTION_FLAG} or lower --max_output_len",
                        p.block_size, p.name, p.blocks
                    )));
                }
                break;
            }
            for (u, n) in self.used.iter_mut().zip(&need) {
                *u += n;
            }
            self.held.push(need);
            self.active.push(i);
            seqs.push(Sequence::new(i, &self.prompts[i], self.params, self.limits));
            self.next += 1;
        }
        Ok((seqs.len() > first).then_some(first))
    }

    /// Releases the sequences of `seqs` (indexed as admitted) that finished since the last
    /// call and returns their indices, for the decoder to free them from its caches. Walks the
    /// live sequences only, not every finished one.
    pub fn retire(&mut self, seqs: &[Sequence]) -> Vec<usize> {
        let finished: Vec<usize> = self
            .active
            .iter()
            .copied()
            .filter(|&i| !seqs[i].is_live())
            .collect();
        self.active.retain(|&i| seqs[i].is_live());
        for &i in &finished {
            for (u, n) in self.used.iter_mut().zip(&self.held[i]) {
                *u -= n;
            }
        }
        finished
    }

    /// Whether no prompt can join the batch before one of its sequences retires: every
    /// prompt is admitted, the batch is full, or in-flight batching is off. (A prompt waiting
    /// for KV blocks counts as able to join.)
    pub fn waits_for_retirement(&self) -> bool {
        self.is_empty()
            || self.active.len() >= self.limits.max_batch_size
            || (!IN_FLIGHT.load(Ordering::Relaxed) && !self.active.is_empty())
    }

    /// A decoder's turn: retires the sequences that finished (`free(i)` releases each from
    /// the decoder's caches), then admits the prompts that fit, else names the live ones.
    pub fn next_turn(
        &mut self,
        seqs: &mut Vec<Sequence>,
        mut free: impl FnMut(usize) -> Result<()>,
    ) -> Result<Turn> {
        for i in self.retire(seqs) {
            free(i)?;
        }
        if let Some(first) = self.admit_into(seqs)? {
            return Ok(Turn::Prefill(first));
        }
        let live = self.active.clone();
        Ok(if live.is_empty() {
            Turn::Done
        } else {
            Turn::Step(live)
        })
    }
}

/// What a decoder does next ([`Admission::next_turn`]).
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// Prefill the sequences admitted from this index of `seqs` on.
    Prefill(usize),
    /// A step of these live sequences (ascending).
    Step(Vec<usize>),
    /// Every sequence is done.
    Done,
}

/// `&mut` to the sequences at the ascending indices `at`, in order, without walking the rest.
pub(crate) fn seqs_at<'a>(seqs: &'a mut [Sequence], at: &[usize]) -> Vec<&'a mut Sequence> {
    let mut out = Vec::with_capacity(at.len());
    let mut rest = seqs;
    let mut base = 0;
    for &i in at {
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(i - base);
        let (s, tail) = tail
            .split_first_mut()
            .expect("indices within the sequences");
        out.push(s);
        rest = tail;
        base = i + 1;
    }
    out
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
    pick_rows(logits, seqs, params)?.fetch()
}

/// [`sample_rows`], the tokens left where they were picked (on a GPU, the device).
pub(crate) fn pick_rows(
    logits: &Tensor,
    seqs: &mut [&mut Sequence],
    params: &GenerationParams,
) -> Result<RowIds> {
    let uniforms: Vec<f64> = if params.sampling.is_greedy() {
        Vec::new()
    } else {
        seqs.iter_mut().map(|s| s.rng.uniform()).collect()
    };
    row_ids(logits, &params.sampling, &uniforms)
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
    use crate::request::FinishReason;
    use kestrel_spec::SamplingParams;

    #[test]
    fn prompts_are_admitted_while_every_pool_holds_them() {
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
        let indices_of = |seqs: &[Sequence]| seqs.iter().map(|s| s.index).collect::<Vec<_>>();
        let finish = |seqs: &mut [Sequence], i: usize| seqs[i].finish = Some(FinishReason::Stop);
        // Prompts of 4 tokens: 4 + 12 + 4 = 20 slots, 3 blocks of 8 or 5 blocks of 4.
        let prompts = vec![vec![1u32; 4]; 6];
        let roomy = vec![pool("target", 100, 8), pool("draft", 100, 4)];
        let mut a = Admission::new(&prompts, roomy, &params, &limits);
        let mut seqs = Vec::new();
        assert_eq!(a.admit_into(&mut seqs).unwrap(), Some(0));
        assert_eq!(indices_of(&seqs), vec![0, 1, 2, 3]);
        // The batch is full until a sequence finishes; its place goes to the next prompt.
        assert_eq!(a.admit_into(&mut seqs).unwrap(), None);
        assert!(a.retire(&seqs).is_empty());
        finish(&mut seqs, 2);
        assert_eq!(a.retire(&seqs), vec![2]);
        assert_eq!(a.retire(&seqs), Vec::<usize>::new());
        assert_eq!(a.admit_into(&mut seqs).unwrap(), Some(4));
        assert_eq!(indices_of(&seqs[4..]), vec![4]);
        assert!(!a.is_empty());
        // A decoder's turns: a full batch steps its live sequences, in order; a finished one
        // is freed and its place prefilled; once all are done, the run is.
        let mut freed = Vec::new();
        let mut turn = |a: &mut Admission, seqs: &mut Vec<Sequence>| {
            a.next_turn(seqs, |i| {
                freed.push(i);
                Ok(())
            })
            .unwrap()
        };
        assert_eq!(turn(&mut a, &mut seqs), Turn::Step(vec![0, 1, 3, 4]));
        finish(&mut seqs, 1);
        assert_eq!(turn(&mut a, &mut seqs), Turn::Prefill(5));
        assert_eq!(turn(&mut a, &mut seqs), Turn::Step(vec![0, 3, 4, 5]));
        for i in [0, 3, 4, 5] {
            finish(&mut seqs, i);
        }
        assert_eq!(turn(&mut a, &mut seqs), Turn::Done);
        assert_eq!(freed, vec![1, 0, 3, 4, 5]);
        // The live ones, in order, mutably.
        let live: Vec<usize> = seqs_at(&mut seqs, &[1, 3, 4])
            .iter()
            .map(|s| s.index)
            .collect();
        assert_eq!(live, vec![1, 3, 4]);
        // The draft pool (11 blocks of 4) holds two such sequences.
        let tight = vec![pool("target", 100, 8), pool("draft", 11, 4)];
        let mut a = Admission::new(&prompts, tight.clone(), &params, &limits);
        let mut seqs = Vec::new();
        a.admit_into(&mut seqs).unwrap();
        assert_eq!(indices_of(&seqs), vec![0, 1]);
        finish(&mut seqs, 0);
        a.retire(&seqs);
        assert_eq!(a.admit_into(&mut seqs).unwrap(), Some(2));
        assert_eq!(indices_of(&seqs[2..]), vec![2]);
        // A longer prompt needs more: 30 + 12 + 4 = 46 slots, 12 blocks of 4, more than the
        // pool has even empty.
        let mut mixed = prompts.clone();
        mixed[1] = vec![1; 30];
        let mut a = Admission::new(&mixed, tight, &params, &limits);
        let mut seqs = Vec::new();
        a.admit_into(&mut seqs).unwrap();
        assert_eq!(indices_of(&seqs), vec![0]);
        assert_eq!(a.admit_into(&mut seqs).unwrap(), None);
        finish(&mut seqs, 0);
        a.retire(&seqs);
        assert_eq!(
            a.admit_into(&mut seqs).unwrap_err().to_string(),
            "input 1 needs 12 KV blocks of 4 tokens in the draft cache, which has 11: raise --kv_cache_free_gpu_memory_fraction or lower --max_output_len"
        );
    }
}

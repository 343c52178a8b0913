//! Plain autoregressive decoding: the baseline every speculative mode must reproduce.

use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{
    count_prompt, pick_rows, prompt_batch, prompt_positions, sample_rows, seqs_at, Admission,
    Decoder, Turn,
};
use crate::kv_budget::{size_pools, KvCacheOptions, PoolShape, PoolSpec};
use crate::logit_rows::RowIds;
use crate::prefix::{PromptPrefixes, Slots};
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use candle_core::Tensor;
use kestrel_kernels::IdsReadback;
use kestrel_model::{OutputRows, PagedKvCache, SeqId, SeqInput};
use std::time::Instant;

pub(crate) struct PlainDecoder<'e> {
    engine: &'e Engine,
    cache: PagedKvCache,
    pools: Vec<PoolShape>,
    /// Where a step's ids come back through when the next step has gone out first.
    readback: IdsReadback,
}

impl<'e> PlainDecoder<'e> {
    pub fn new(engine: &'e Engine, kv: &KvCacheOptions, max_output_len: usize) -> Result<Self> {
        let specs = [PoolSpec::for_engine("target", engine)];
        let pools = size_pools(&specs, kv, engine, max_output_len)?;
        let cache = kv.new_cache(&pools[0], |n, b| engine.model.new_cache(n, b))?;
        Ok(PlainDecoder {
            engine,
            cache,
            pools,
            readback: IdsReadback::default(),
        })
    }
}

impl PlainDecoder<'_> {
    /// Newly admitted sequences: cached prefix blocks first, then every prompt's remaining
    /// tokens in one varlen forward, whose last row of each gives its first token.
    fn prefill(
        &mut self,
        seqs: &mut [Sequence],
        ids: &[SeqId],
        prefixes: &mut PromptPrefixes,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<()> {
        let model = &self.engine.model;
        let start = Instant::now();
        prefixes.add(&self.cache, seqs);
        let blocks = prefixes.cached_blocks(&self.cache, seqs);
        let reused = prefixes.attach(&mut self.cache, seqs, ids, &blocks)?;
        count_prompt(timings, 0, seqs.iter().map(|s| s.prompt_len), &reused);
        let pos = prompt_positions(seqs, &reused);
        let batch = prompt_batch(seqs, ids, &reused, &pos, OutputRows::Last);
        let hidden = model.forward_prompt(&batch, &mut self.cache)?;
        let logits = model.logits(&hidden)?;
        let mut all: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let first = sample_rows(&logits, &mut all, params)?;
        let ttft = start.elapsed().as_secs_f64();
        timings.prefill_s += ttft;
        for ((s, t), &r) in all.iter_mut().zip(first).zip(&reused) {
            s.stats.time_to_first_token_s = ttft;
            s.stats.reused_prompt_tokens = r;
            s.commit(&[t], params, sink);
        }
        Ok(())
    }

    /// Puts a decode step of the sequences `live` on the device and picks their next tokens
    /// there, without waiting for them. Each sequence is fed its last committed token, or,
    /// given `fed` (u32 `[live.len()]`, the tokens the step before picked and not committed
    /// yet), that token at the position after it.
    fn launch(
        &mut self,
        seqs: &mut [Sequence],
        ids: &[SeqId],
        live: Vec<usize>,
        fed: Option<&Tensor>,
        params: &GenerationParams,
    ) -> Result<Launched> {
        let model = &self.engine.model;
        let logits = {
            let pos: Vec<[u32; 1]> = live
                .iter()
                .map(|&i| {
                    let len = seqs[i].tokens.len();
                    [(if fed.is_some() { len } else { len - 1 }) as u32]
                })
                .collect();
            let batch: Vec<SeqInput> = live
                .iter()
                .zip(&pos)
                .map(|(&i, p)| SeqInput {
                    seq: ids[i],
                    tokens: match fed {
                        Some(_) => &[],
                        None => std::slice::from_ref(seqs[i].tokens.last().expect("non-empty")),
                    },
                    positions: p,
                    mask: None,
                    output_rows: OutputRows::Last,
                })
                .collect();
            let hidden = match fed {
                Some(fed) => model.forward_tapped_device_ids(&batch, fed, &mut self.cache, &[])?,
                None => model.forward(&batch, &mut self.cache)?,
            };
            model.logits(&hidden)?
        };
        let picked = pick_rows(&logits, &mut seqs_at(seqs, &live), params)?;
        Ok(Launched { live, ids: picked })
    }
}

/// A decode step on the device whose tokens have not been read back: its sequences (indices
/// into the run's, ascending) and their next tokens, where they were picked.
struct Launched {
    live: Vec<usize>,
    ids: RowIds,
}

impl Decoder for PlainDecoder<'_> {
    fn run(
        &mut self,
        admission: &mut Admission,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Sequence>> {
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut ids: Vec<SeqId> = Vec::new();
        let mut prefixes = PromptPrefixes::new(Slots::Tokens);
        let mut launched: Option<Launched> = None;
        // When the last step's tokens were committed (or its batch was first launched): a
        // step's time runs from there to its own commit, so overlapped steps are not
        // counted twice.
        let mut mark = Instant::now();
        loop {
            let step = match launched.take() {
                Some(step) => step,
                None => match admission
                    .next_turn(&mut seqs, |i| prefixes.free(&mut self.cache, i, ids[i]))?
                {
                    Turn::Prefill(first) => {
                        ids.extend((first..seqs.len()).map(|_| self.cache.add_sequence()));
                        self.prefill(
                            &mut seqs[first..],
                            &ids[first..],
                            &mut prefixes,
                            params,
                            sink,
                            timings,
                        )?;
                        continue;
                    }
                    Turn::Done => return Ok(seqs),
                    Turn::Step(live) => {
                        mark = Instant::now();
                        self.launch(&mut seqs, &ids, live, None, params)?
                    }
                },
            };
            // The next step goes to the device before this one's tokens come back, fed them
            // where they were picked, when it is sure to be the next step: every sequence
            // takes it unless this step gives it an end id (whose row the next step then
            // computes for nothing), and no prompt can join before a sequence retires.
            let ahead = if self.engine.launch_ahead
                && admission.waits_for_retirement()
                && step.live.iter().all(|&i| seqs[i].outlives_next_token())
            {
                let fed = step.ids.on(self.engine.model.device())?;
                // Queued before the next step, so that reading them back waits for this
                // step alone, not for the one going out behind it.
                self.readback.start(&fed)?;
                Some(self.launch(&mut seqs, &ids, step.live.clone(), Some(&fed), params)?)
            } else {
                None
            };
            let next = match ahead {
                Some(_) => self.readback.finish()?,
                None => step.ids.fetch()?,
            };
            for (s, t) in seqs_at(&mut seqs, &step.live).into_iter().zip(next) {
                // A sequence that ended on the step before this one had no step here.
                if s.is_live() {
                    s.stats.record_step(1);
                    s.commit(&[t], params, sink);
                }
            }
            timings.verify_s += mark.elapsed().as_secs_f64();
            mark = Instant::now();
            timings.batch_steps += 1;
            launched = ahead;
        }
    }

    fn pools(&self) -> Vec<PoolShape> {
        self.pools.clone()
    }
}

//! Plain autoregressive decoding: the baseline every speculative mode must reproduce.

use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{
    count_prompt, prompt_batch, prompt_positions, sample_rows, seqs_at, Admission, Decoder,
};
use crate::kv_budget::{size_pools, KvCacheOptions, PoolShape, PoolSpec};
use crate::prefix::{PromptPrefixes, Slots};
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use kestrel_model::{OutputRows, PagedKvCache, SeqId, SeqInput};
use std::time::Instant;

pub(crate) struct PlainDecoder<'e> {
    engine: &'e Engine,
    cache: PagedKvCache,
    pools: Vec<PoolShape>,
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
}

impl Decoder for PlainDecoder<'_> {
    fn run(
        &mut self,
        admission: &mut Admission,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Sequence>> {
        let model = &self.engine.model;
        let mut seqs: Vec<Sequence> = Vec::new();
        let mut ids: Vec<SeqId> = Vec::new();
        let mut prefixes = PromptPrefixes::new(Slots::Tokens);
        loop {
            for i in admission.retire(&seqs) {
                prefixes.free(&mut self.cache, i, ids[i])?;
            }
            if let Some(first) = admission.admit_into(&mut seqs)? {
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
            let live = admission.active().to_vec();
            if live.is_empty() {
                return Ok(seqs);
            }
            let step_start = Instant::now();
            let pos: Vec<[u32; 1]> = live
                .iter()
                .map(|&i| [(seqs[i].tokens.len() - 1) as u32])
                .collect();
            let batch: Vec<SeqInput> = live
                .iter()
                .zip(&pos)
                .map(|(&i, p)| SeqInput {
                    seq: ids[i],
                    tokens: std::slice::from_ref(seqs[i].tokens.last().expect("non-empty")),
                    positions: p,
                    mask: None,
                    output_rows: OutputRows::Last,
                })
                .collect();
            let hidden = model.forward(&batch, &mut self.cache)?;
            let logits = model.logits(&hidden)?;
            let mut rows = seqs_at(&mut seqs, &live);
            let next = sample_rows(&logits, &mut rows, params)?;
            for (s, t) in rows.iter_mut().zip(next) {
                s.stats.record_step(1);
                s.commit(&[t], params, sink);
            }
            timings.verify_s += step_start.elapsed().as_secs_f64();
            timings.batch_steps += 1;
        }
    }

    fn pools(&self) -> Vec<PoolShape> {
        self.pools.clone()
    }
}

//! Plain autoregressive decoding: the baseline every speculative mode must reproduce.

use crate::engine::Engine;
use crate::error::Result;
use crate::generate::{prompt_batch, prompt_positions, sample_rows, Decoder};
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use kestrel_model::{OutputRows, PagedKvCache, SeqId, SeqInput};
use std::time::Instant;

pub(crate) struct PlainDecoder<'e> {
    engine: &'e Engine,
    cache: PagedKvCache,
}

impl<'e> PlainDecoder<'e> {
    pub fn new(engine: &'e Engine) -> Result<Self> {
        let cache = engine
            .model
            .new_cache(engine.kv_blocks(), engine.plan.limits.tokens_per_block)?;
        Ok(PlainDecoder { engine, cache })
    }
}

impl Decoder for PlainDecoder<'_> {
    fn run_batch(
        &mut self,
        seqs: &mut [Sequence],
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<()> {
        let model = &self.engine.model;
        let start = Instant::now();
        let ids: Vec<SeqId> = seqs.iter().map(|_| self.cache.add_sequence()).collect();

        // Prefill every prompt in one varlen forward; the last row of each gives its first token.
        let pos = prompt_positions(seqs);
        let batch = prompt_batch(seqs, &ids, &pos, OutputRows::Last);
        let hidden = model.forward_prompt(&batch, &mut self.cache)?;
        let logits = model.logits(&hidden)?;
        let mut all: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let first = sample_rows(&logits, &mut all, params)?;
        let ttft = start.elapsed().as_secs_f64();
        timings.prefill_s += ttft;
        for (s, t) in all.iter_mut().zip(first) {
            s.stats.time_to_first_token_s = ttft;
            s.commit(&[t], params, sink);
        }

        let step_start = Instant::now();
        loop {
            let live: Vec<usize> = (0..seqs.len()).filter(|&i| seqs[i].is_live()).collect();
            for (i, s) in seqs.iter().enumerate() {
                if !s.is_live() && self.cache.contains(ids[i]) {
                    self.cache.free_sequence(ids[i])?;
                }
            }
            if live.is_empty() {
                break;
            }
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
            let mut rows: Vec<&mut Sequence> = seqs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| live.contains(i))
                .map(|(_, s)| s)
                .collect();
            let next = sample_rows(&logits, &mut rows, params)?;
            for (s, t) in rows.iter_mut().zip(next) {
                s.stats.record_step(1);
                s.commit(&[t], params, sink);
            }
        }
        timings.verify_s += step_start.elapsed().as_secs_f64();
        Ok(())
    }
}

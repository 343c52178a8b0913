//! Draft-target speculative decoding (Leviathan et al. 2023; TensorRT-LLM's
//! `draft_tokens_external` mode): a separate, smaller draft engine proposes up to `draft_len`
//! tokens autoregressively, the target scores the last committed token and all drafts in one
//! causal forward, and the drafts are accepted by rejection sampling (`use_logits`) or by
//! matching the target's own tokens. Both KV caches are then rolled back to the committed
//! sequence.
//!
//! Cache invariant between steps, per sequence of `L` committed tokens: the target cache holds
//! the first `L − 1` tokens (the last committed token is fed by the next verification), the
//! draft cache holds at least `L − 2` of them (when every draft was accepted, the last draft
//! and the bonus token are both fed by the next step's first draft forward).
//!
//! The target's own copy ([`Engine::self_draft`]: at 4 bits, or skipping layers) keeps no
//! cache: it drafts over the target's, whose layout is its own, reading the target's K/V of
//! the committed tokens and writing its own past them, which are dropped before the
//! verification writes the target's there (so the target never reads a draft's K/V, and its
//! output stays plain decoding's). Its first forward of a step is then always the one last
//! committed token, it prefills nothing, and it takes no KV memory of its own.
//!
//! With prefix reuse, each cache attaches the cached blocks of its own that the prompt
//! starts with (the two engines may differ in block size) and prefills only the rest.
//!
//! Prompt lookup decoding is the same loop with the drafts looked up in the sequence's own
//! tokens ([`kestrel_spec::prompt_lookup`]) instead of drawn from a draft engine, as
//! TensorRT-LLM runs it through its external-draft-tokens path: no draft model or cache, and
//! drafts accepted by token matching (the target's own token at each position, argmax or
//! sampled), so output is the target's exactly.

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::{
    count_prompt, positions, prompt_positions, sample_rows, Admission, Decoder, Turn,
};
use crate::kv_budget::{size_pools, KvCacheOptions, PoolShape, PoolSpec};
use crate::logit_rows::{draws_on_device, row_tokens, LogitRows, LogitSlice};
use crate::prefix::{PromptPrefixes, Slots};
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use crate::{DraftTargetOptions, PromptLookup};
use candle_core::Tensor;
use kestrel_core::checkpoint::TOKENIZER_FILE;
use kestrel_core::SpeculativeMode;
use kestrel_model::{OutputRows, PagedKvCache, SeqId, SeqInput};
use kestrel_spec::accept::{draft_target, draft_target_token_match, ChainAcceptance};
use kestrel_spec::sampling::{probs, sample, sample_at};
use kestrel_spec::PromptLookupConfig;
use std::path::Path;
use std::time::Instant;

pub(crate) struct DraftTargetDecoder<'e> {
    target: &'e Engine,
    drafter: Drafter<'e>,
    options: DraftTargetOptions,
    target_cache: PagedKvCache,
    pools: Vec<PoolShape>,
}

/// Where a step's drafts come from.
enum Drafter<'e> {
    /// A draft engine, with its own KV cache (draft-target decoding), or with none when it is
    /// the target's own copy (`Engine::self_draft`), which drafts over the target's cache.
    Model {
        engine: &'e Engine,
        cache: Option<Box<PagedKvCache>>,
    },
    /// The sequence's own tokens, backed by an n-gram model of other answers (prompt lookup
    /// decoding): no model, no cache.
    Lookup(PromptLookup),
}

/// A run's prompt keys in the two caches (the draft's only with a draft model).
struct Prefixes {
    target: PromptPrefixes,
    draft: Option<PromptPrefixes>,
}

/// A sequence's handles in the two caches.
#[derive(Clone, Copy)]
struct Ids {
    target: SeqId,
    draft: Option<SeqId>,
}

/// One live sequence's drafts of the current step.
struct Proposal {
    /// Index into the batch.
    index: usize,
    /// Draft tokens wanted this step (may be 0 near the length limit).
    k: usize,
    tokens: Vec<u32>,
    /// The laws the tokens were drawn from (speculative sampling only).
    q: DraftLaws,
}

impl Proposal {
    /// No drafts for the sequence of batch index `index`.
    fn none(index: usize) -> Self {
        Proposal {
            index,
            k: 0,
            tokens: Vec::new(),
            q: DraftLaws::None,
        }
    }
}

/// Where a proposal's draft laws are, for speculative sampling.
enum DraftLaws {
    /// Not kept: greedy, or token matching.
    None,
    /// `k × vocab` probabilities on the host.
    Host(Vec<f32>),
    /// The rows of the step's draft logits ([`Proposals::device_logits`]) each draft was drawn
    /// from, for `kestrel_kernels::chain_accept`.
    Device(Vec<u32>),
}

/// A step's proposals, and the draft logits their device laws index.
struct Proposals {
    list: Vec<Proposal>,
    /// Every draft forward's logits rows, in order (speculative sampling on a device).
    device_logits: Option<Tensor>,
}

impl<'e> DraftTargetDecoder<'e> {
    pub fn new(
        target: &'e Engine,
        draft: &'e Engine,
        options: DraftTargetOptions,
        kv: &KvCacheOptions,
        max_output_len: usize,
    ) -> Result<Self> {
        check_compatible(target, draft, &options)?;
        let shares_cache = draft.derived_from.as_deref() == Some(target.dir.as_path())
            && draft.device.same_device(&target.device);
        let mut specs = vec![PoolSpec::for_engine("target", target)];
        if !shares_cache {
            specs.push(PoolSpec::for_engine("draft", draft));
        }
        let pools = size_pools(&specs, kv, target, max_output_len)?;
        let target_cache = kv.new_cache(&pools[0], |n, b| target.model.new_cache(n, b))?;
        let draft_cache = if shares_cache {
            None
        } else {
            let cache = kv.new_cache(&pools[1], |n, b| draft.model.new_cache(n, b))?;
            Some(Box::new(cache))
        };
        Ok(DraftTargetDecoder {
            target,
            drafter: Drafter::Model {
                engine: draft,
                cache: draft_cache,
            },
            options,
            target_cache,
            pools,
        })
    }

    /// Prompt lookup decoding on `target`.
    pub fn prompt_lookup(
        target: &'e Engine,
        lookup: PromptLookup,
        disable_by_batch_size: Option<usize>,
        kv: &KvCacheOptions,
        max_output_len: usize,
    ) -> Result<Self> {
        check_lookup(target, &lookup.config)?;
        let pools = size_pools(
            &[PoolSpec::for_engine("target", target)],
            kv,
            target,
            max_output_len,
        )?;
        let target_cache = kv.new_cache(&pools[0], |n, b| target.model.new_cache(n, b))?;
        Ok(DraftTargetDecoder {
            target,
            options: DraftTargetOptions {
                draft_len: lookup.config.num_tokens,
                use_logits: false,
                disable_by_batch_size,
            },
            target_cache,
            pools,
            drafter: Drafter::Lookup(lookup),
        })
    }

    /// Admits prompts as the batch has room and decodes until every sequence is done.
    #[allow(clippy::too_many_arguments)]
    fn decode(
        &mut self,
        admission: &mut Admission,
        seqs: &mut Vec<Sequence>,
        ids: &mut Vec<Ids>,
        prefixes: &mut Prefixes,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<()> {
        loop {
            let live = match admission.next_turn(seqs, |i| self.free(i, ids[i], prefixes))? {
                Turn::Step(live) => live,
                Turn::Done => return Ok(()),
                Turn::Prefill(first) => {
                    for _ in first..seqs.len() {
                        let draft = match &mut self.drafter {
                            Drafter::Model {
                                cache: Some(cache), ..
                            } => Some(cache.add_sequence()),
                            _ => None,
                        };
                        ids.push(Ids {
                            target: self.target_cache.add_sequence(),
                            draft,
                        });
                    }
                    self.prefill(
                        &mut seqs[first..],
                        &ids[first..],
                        prefixes,
                        params,
                        sink,
                        timings,
                    )?;
                    continue;
                }
            };
            let draft_start = Instant::now();
            let proposals = self.propose(seqs, ids, &live, params)?;
            timings.draft_s += draft_start.elapsed().as_secs_f64();
            let verify_start = Instant::now();
            self.verify(seqs, ids, &proposals, params, sink)?;
            timings.verify_s += verify_start.elapsed().as_secs_f64();
            timings.batch_steps += 1;
        }
    }

    /// Both models read every newly admitted prompt (past its cached blocks) in one varlen
    /// forward each; the target's last row gives the first token.
    fn prefill(
        &mut self,
        seqs: &mut [Sequence],
        ids: &[Ids],
        prefixes: &mut Prefixes,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<()> {
        let start = Instant::now();
        let target_ids: Vec<SeqId> = ids.iter().map(|id| id.target).collect();
        prefixes.target.add(&self.target_cache, seqs);
        let blocks = prefixes.target.cached_blocks(&self.target_cache, seqs);
        let reused = prefixes
            .target
            .attach(&mut self.target_cache, seqs, &target_ids, &blocks)?;
        count_prompt(timings, 0, seqs.iter().map(|s| s.prompt_len), &reused);

        let pos = prompt_positions(seqs, &reused);
        let batch: Vec<SeqInput> = seqs
            .iter()
            .zip(ids)
            .zip(&reused)
            .zip(&pos)
            .map(|(((s, id), &r), p)| SeqInput {
                seq: id.target,
                tokens: &s.tokens[r..s.prompt_len],
                positions: p,
                mask: None,
                output_rows: OutputRows::Last,
            })
            .collect();
        let model = &self.target.model;
        let logits = model.logits(&model.forward_prompt(&batch, &mut self.target_cache)?)?;
        let mut all: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let first = sample_rows(&logits, &mut all, params)?;
        let ttft = start.elapsed().as_secs_f64();
        for ((s, t), &r) in all.iter_mut().zip(first).zip(&reused) {
            s.stats.time_to_first_token_s = ttft;
            s.stats.reused_prompt_tokens = r;
            s.commit(&[t], params, sink);
        }

        // A draft with a cache of its own reads the prompts of the sequences that go on; the
        // first generated token is fed by the first draft step.
        let (
            Drafter::Model {
                engine,
                cache: Some(cache),
            },
            Some(draft_prefixes),
        ) = (&mut self.drafter, &mut prefixes.draft)
        else {
            timings.prefill_s += start.elapsed().as_secs_f64();
            return Ok(());
        };
        let draft_ids: Vec<SeqId> = ids.iter().filter_map(|id| id.draft).collect();
        draft_prefixes.add(cache, seqs);
        let blocks = draft_prefixes.cached_blocks(cache, seqs);
        let draft_reused = draft_prefixes.attach(cache, seqs, &draft_ids, &blocks)?;
        let live: Vec<bool> = seqs.iter().map(Sequence::is_live).collect();
        let prompt_lens = seqs
            .iter()
            .zip(&live)
            .filter(|(_, &l)| l)
            .map(|(s, _)| s.prompt_len);
        let live_reused: Vec<usize> = draft_reused
            .iter()
            .zip(&live)
            .filter(|(_, &l)| l)
            .map(|(&r, _)| r)
            .collect();
        count_prompt(timings, 1, prompt_lens, &live_reused);
        let pos = prompt_positions(seqs, &draft_reused);
        let batch: Vec<SeqInput> = seqs
            .iter()
            .zip(ids)
            .zip(&draft_reused)
            .zip(&pos)
            .filter(|(((s, _), _), _)| s.is_live())
            .map(|(((s, id), &r), p)| SeqInput {
                seq: id.draft.expect("a draft model's sequences have draft ids"),
                tokens: &s.tokens[r..s.prompt_len],
                positions: p,
                mask: None,
                output_rows: OutputRows::Last,
            })
            .collect();
        if !batch.is_empty() {
            engine.model.forward_prompt(&batch, cache)?;
        }
        timings.prefill_s += start.elapsed().as_secs_f64();
        Ok(())
    }

    /// Frees the sequence of index `i` from both caches, offering its prompt blocks for reuse.
    fn free(&mut self, i: usize, id: Ids, prefixes: &Prefixes) -> Result<()> {
        prefixes.target.free(&mut self.target_cache, i, id.target)?;
        match (&mut self.drafter, &prefixes.draft, id.draft) {
            (
                Drafter::Model {
                    cache: Some(cache), ..
                },
                Some(draft),
                Some(seq),
            ) => draft.free(cache, i, seq),
            _ => Ok(()),
        }
    }

    /// The draft proposes `k` tokens for each live sequence: one batched draft forward per
    /// draft position. The first forward of a step also feeds the committed tokens the draft
    /// cache lacks (the last committed token, and the last draft after a fully accepted step).
    /// Sampled drafts take one uniform each from their sequence's stream and are drawn on the
    /// device when the logits are there; speculative sampling then keeps the rows they were
    /// drawn from on the device too (else their laws on the host).
    fn propose(
        &mut self,
        seqs: &mut [Sequence],
        ids: &[Ids],
        live: &[usize],
        params: &GenerationParams,
    ) -> Result<Proposals> {
        if self
            .options
            .disable_by_batch_size
            .is_some_and(|n| live.len() > n)
        {
            // A plain step: nothing drafted. The draft model's cache catches up in the next
            // step it drafts (its first forward feeds every committed token it lacks).
            return Ok(Proposals {
                list: live.iter().map(|&i| Proposal::none(i)).collect(),
                device_logits: None,
            });
        }
        let (engine, cache, shared) = match &mut self.drafter {
            Drafter::Model {
                engine,
                cache: Some(cache),
            } => (*engine, &mut **cache, false),
            Drafter::Model {
                engine,
                cache: None,
            } => (*engine, &mut self.target_cache, true),
            Drafter::Lookup(lookup) => return Ok(look_up(lookup, seqs, live)),
        };
        // The sequence's handle in the cache the draft runs over.
        let draft_id = |id: Ids| {
            if shared {
                id.target
            } else {
                id.draft.expect("a draft model's sequences have draft ids")
            }
        };
        let sampling = &params.sampling;
        let keep_q = self.options.use_logits && !sampling.is_greedy();
        let mut proposals: Vec<Proposal> = live
            .iter()
            .map(|&i| {
                let k = self
                    .options
                    .draft_len
                    .min(seqs[i].remaining().saturating_sub(1));
                Proposal {
                    index: i,
                    k,
                    tokens: Vec::with_capacity(k),
                    q: DraftLaws::None,
                }
            })
            .collect();
        let max_k = proposals.iter().map(|p| p.k).max().unwrap_or(0);
        let model = &engine.model;
        let mut device_logits: Vec<Tensor> = Vec::new();
        let mut device_rows = 0;
        for j in 0..max_k {
            let active: Vec<usize> = (0..proposals.len())
                .filter(|&p| proposals[p].k > j)
                .collect();
            let mut inputs: Vec<(SeqId, Vec<u32>, Vec<u32>)> = Vec::with_capacity(active.len());
            for &p in &active {
                let prop = &proposals[p];
                let s = &seqs[prop.index];
                let id = draft_id(ids[prop.index]);
                let len = s.tokens.len();
                if j == 0 {
                    let cached = cache.seq_len(id)?;
                    if cached >= len {
                        return Err(RuntimeError::Engine(format!(
                            "draft KV cache of sequence {} holds {cached} tokens, but only {len} are committed and the last one is never cached before the step",
                            s.index
                        )));
                    }
                    inputs.push((
                        id,
                        s.tokens[cached..].to_vec(),
                        positions(cached, len - cached),
                    ));
                } else {
                    inputs.push((id, vec![prop.tokens[j - 1]], positions(len + j - 1, 1)));
                }
            }
            let batch: Vec<SeqInput> = inputs
                .iter()
                .map(|(seq, tokens, pos)| SeqInput {
                    seq: *seq,
                    tokens,
                    positions: pos,
                    mask: None,
                    output_rows: OutputRows::Last,
                })
                .collect();
            let logits = model.logits(&model.forward(&batch, cache)?)?;
            let uniforms: Vec<f64> = if sampling.is_greedy() {
                Vec::new()
            } else {
                let seqs = &mut *seqs;
                active
                    .iter()
                    .map(|&p| seqs[proposals[p].index].rng.uniform())
                    .collect()
            };
            // The kernel needs the target's rows where the draft's are.
            let laws_on_device =
                draws_on_device(&logits) && logits.device().same_device(&self.target.device);
            if keep_q && !laws_on_device {
                // Speculative sampling on the host: each draft's law, and the draft drawn
                // from it.
                for ((row, &p), &u) in logits.to_vec2::<f32>()?.iter().zip(&active).zip(&uniforms) {
                    let q = probs(row, sampling);
                    let prop = &mut proposals[p];
                    prop.tokens.push(sample_at(&q, u));
                    match &mut prop.q {
                        DraftLaws::Host(all) => all.extend_from_slice(&q),
                        laws => *laws = DraftLaws::Host(q),
                    }
                }
                continue;
            }
            for (row, (&p, t)) in active
                .iter()
                .zip(row_tokens(&logits, sampling, &uniforms)?)
                .enumerate()
            {
                let prop = &mut proposals[p];
                prop.tokens.push(t);
                if keep_q {
                    let at = (device_rows + row) as u32;
                    match &mut prop.q {
                        DraftLaws::Device(rows) => rows.push(at),
                        laws => *laws = DraftLaws::Device(vec![at]),
                    }
                }
            }
            if keep_q {
                device_rows += active.len();
                device_logits.push(logits);
            }
        }
        if shared {
            // Back to the target's K/V of the first L − 1 tokens: the verification writes its
            // own where the draft's were.
            for prop in proposals.iter().filter(|p| p.k > 0) {
                let keep = seqs[prop.index].tokens.len() - 1;
                cache.truncate(draft_id(ids[prop.index]), keep)?;
            }
        }
        let device_logits = match device_logits.len() {
            0 => None,
            1 => device_logits.pop(),
            _ => Some(Tensor::cat(&device_logits, 0)?),
        };
        Ok(Proposals {
            list: proposals,
            device_logits,
        })
    }

    /// The target scores `[last committed, d_1..d_k]` of every live sequence in one forward;
    /// the accepted drafts and the bonus token are committed and both caches rolled back.
    fn verify(
        &mut self,
        seqs: &mut [Sequence],
        ids: &[Ids],
        proposals: &Proposals,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
    ) -> Result<()> {
        let inputs: Vec<(Vec<u32>, Vec<u32>)> = proposals
            .list
            .iter()
            .map(|prop| {
                let s = &seqs[prop.index];
                let len = s.tokens.len();
                let mut tokens = Vec::with_capacity(prop.k + 1);
                tokens.push(s.tokens[len - 1]);
                tokens.extend_from_slice(&prop.tokens);
                (tokens, positions(len - 1, prop.k + 1))
            })
            .collect();
        let batch: Vec<SeqInput> = proposals
            .list
            .iter()
            .zip(&inputs)
            .map(|(prop, (tokens, pos))| SeqInput {
                seq: ids[prop.index].target,
                tokens,
                positions: pos,
                mask: None,
                output_rows: OutputRows::All,
            })
            .collect();
        let model = &self.target.model;
        let logits = model.logits(&model.forward(&batch, &mut self.target_cache)?)?;
        let acceptances = self.accept_all(&logits, proposals, seqs, params)?;
        for (prop, acceptance) in proposals.list.iter().zip(acceptances) {
            let s = &mut seqs[prop.index];
            let committed = s.commit(&acceptance.tokens, params, sink);
            s.stats.record_step(committed);
            s.stats.draft_tokens += prop.k;
            s.stats.accepted_draft_tokens += acceptance.accepted_len.min(committed);

            // Roll back to the committed sequence minus its last token (fed next step).
            let keep = s.tokens.len() - 1;
            let id = ids[prop.index];
            self.target_cache.truncate(id.target, keep)?;
            if let (
                Drafter::Model {
                    cache: Some(cache), ..
                },
                Some(draft),
            ) = (&mut self.drafter, id.draft)
            {
                if cache.seq_len(draft)? > keep {
                    cache.truncate(draft, keep)?;
                }
            }
        }
        Ok(())
    }

    /// Every proposal's acceptance from the target's verification `logits` (`k + 1` rows per
    /// proposal, in order). Where the rows are on a device and only tokens or outcomes need
    /// cross: token matching draws the target's token at each of a sequence's `k + 1` rows
    /// there, and speculative sampling runs there (`kestrel_kernels::chain_accept`), each
    /// from uniforms taken ahead from a copy of the sequence's stream; the stream then
    /// advances by what the host would have drawn for the same outcome. Otherwise the rows
    /// come to the host, which draws from the streams as it goes.
    fn accept_all(
        &self,
        logits: &Tensor,
        proposals: &Proposals,
        seqs: &mut [Sequence],
        params: &GenerationParams,
    ) -> Result<Vec<ChainAcceptance>> {
        let sampling = &params.sampling;
        let on_device = !sampling.is_greedy() && draws_on_device(logits);
        if self.options.use_logits && on_device {
            if let Some(draft_logits) = &proposals.device_logits {
                return self.chain_accept(logits, draft_logits, proposals, seqs, params);
            }
        }
        let rows = if sampling.is_greedy() || (on_device && !self.options.use_logits) {
            let uniforms: Vec<f64> = if sampling.is_greedy() {
                Vec::new()
            } else {
                proposals
                    .list
                    .iter()
                    .flat_map(|prop| seqs[prop.index].rng.peek_f32(prop.k + 1))
                    .map(f64::from)
                    .collect()
            };
            LogitRows::Tokens(row_tokens(logits, sampling, &uniforms)?)
        } else {
            LogitRows::logits(logits)?
        };
        let mut offset = 0;
        let mut out = Vec::with_capacity(proposals.list.len());
        for prop in &proposals.list {
            let target_rows = rows.slice(offset, prop.k + 1);
            offset += prop.k + 1;
            let s = &mut seqs[prop.index];
            let acceptance = self.accept(prop, target_rows, s, params)?;
            if !sampling.is_greedy() && target_rows.tokens().is_some() {
                // The host would have drawn one uniform per target token taken.
                s.rng.skip(acceptance.tokens.len());
            }
            out.push(acceptance);
        }
        Ok(out)
    }

    /// Speculative sampling of every proposal on the device, from the target's verification
    /// `logits` and the drafts' `draft_logits`.
    fn chain_accept(
        &self,
        logits: &Tensor,
        draft_logits: &Tensor,
        proposals: &Proposals,
        seqs: &mut [Sequence],
        params: &GenerationParams,
    ) -> Result<Vec<ChainAcceptance>> {
        let uniforms: Vec<Vec<f32>> = proposals
            .list
            .iter()
            .map(|prop| seqs[prop.index].rng.peek_f32(prop.k + 1))
            .collect();
        let mut target_row = 0;
        let chains: Vec<kestrel_kernels::ChainSeq> = proposals
            .list
            .iter()
            .zip(&uniforms)
            .map(|(prop, u)| {
                let draft_rows = match &prop.q {
                    DraftLaws::Device(rows) => rows.as_slice(),
                    _ => &[],
                };
                let chain = kestrel_kernels::ChainSeq {
                    target_row,
                    draft_rows,
                    tokens: &prop.tokens,
                    uniforms: u,
                };
                target_row += prop.k + 1;
                chain
            })
            .collect();
        let sampling = &params.sampling;
        let outcomes = kestrel_kernels::chain_accept(
            logits,
            draft_logits,
            &chains,
            sampling.temperature,
            sampling.top_k,
            sampling.top_p,
        )?;
        Ok(proposals
            .list
            .iter()
            .zip(outcomes)
            .map(|(prop, o)| {
                let mut tokens = prop.tokens[..o.accepted].to_vec();
                tokens.push(o.token);
                let acceptance = ChainAcceptance {
                    accepted_len: o.accepted,
                    tokens,
                };
                seqs[prop.index]
                    .rng
                    .skip(acceptance.speculative_uniforms(prop.k));
                acceptance
            })
            .collect())
    }

    /// One proposal's acceptance on the host: from the target's own tokens (token matching,
    /// greedy or drawn already), or from its rows.
    fn accept(
        &self,
        prop: &Proposal,
        target_rows: LogitSlice<'_>,
        s: &mut Sequence,
        params: &GenerationParams,
    ) -> Result<ChainAcceptance> {
        let index = s.index;
        let bad = |e: kestrel_spec::AcceptError| {
            RuntimeError::Engine(format!("draft-target acceptance of sequence {index}: {e}"))
        };
        let rows = match target_rows {
            LogitSlice::Tokens(tokens) => {
                return draft_target_token_match(&prop.tokens, tokens).map_err(bad);
            }
            LogitSlice::Logits(rows) => rows,
        };
        if self.options.use_logits {
            let q: &[f32] = match &prop.q {
                DraftLaws::Host(q) => q,
                DraftLaws::None => &[], // no drafts this step: the bonus alone
                DraftLaws::Device(_) => {
                    return Err(RuntimeError::Engine(format!(
                        "draft-target acceptance of sequence {index}: the draft laws are on the device but the target's rows on the host"
                    )))
                }
            };
            let vocab = rows.first().map_or(0, Vec::len);
            let p: Vec<f32> = rows
                .iter()
                .flat_map(|row| probs(row, &params.sampling))
                .collect();
            return draft_target(&prop.tokens, q, &p, vocab, &mut s.rng).map_err(bad);
        }
        // Token matching on the host: the target's own token at each position, drawn from its
        // distribution, taken only as far as the drafts agree.
        let mut target_tokens = Vec::with_capacity(prop.k + 1);
        for row in rows {
            let t = sample(&probs(row, &params.sampling), &mut s.rng);
            target_tokens.push(t);
            if prop.tokens.get(target_tokens.len() - 1) != Some(&t) {
                break;
            }
        }
        let drafts = &prop.tokens[..target_tokens.len() - 1];
        draft_target_token_match(drafts, &target_tokens).map_err(bad)
    }
}

impl Decoder for DraftTargetDecoder<'_> {
    fn run(
        &mut self,
        admission: &mut Admission,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Sequence>> {
        let mut seqs = Vec::new();
        let mut ids = Vec::new();
        let mut prefixes = Prefixes {
            target: PromptPrefixes::new(Slots::Tokens),
            draft: matches!(self.drafter, Drafter::Model { cache: Some(_), .. })
                .then(|| PromptPrefixes::new(Slots::Tokens)),
        };
        let result = self.decode(
            admission,
            &mut seqs,
            &mut ids,
            &mut prefixes,
            params,
            sink,
            timings,
        );
        // Whatever happened, the caches hold nothing of this run afterwards (but cached
        // prompt blocks).
        for (s, id) in seqs.iter().zip(&ids) {
            self.free(s.index, *id, &prefixes)?;
        }
        result.map(|()| seqs)
    }

    fn pools(&self) -> Vec<PoolShape> {
        self.pools.clone()
    }
}

/// Every live sequence's drafts looked up in its own tokens (or the corpus), as many as fit
/// before its length limit (none when nothing matches).
fn look_up(lookup: &PromptLookup, seqs: &[Sequence], live: &[usize]) -> Proposals {
    let list = live
        .iter()
        .map(|&i| {
            let s = &seqs[i];
            let limit = s.remaining().saturating_sub(1);
            let tokens = lookup.propose(&s.tokens, limit);
            Proposal {
                index: i,
                k: tokens.len(),
                tokens,
                q: DraftLaws::None,
            }
        })
        .collect();
    Proposals {
        list,
        device_logits: None,
    }
}

/// Prompt lookup needs an engine that verifies `num_tokens + 1` rows a step: one built for
/// external draft tokens or for EAGLE, with that `max_draft_len`.
fn check_lookup(target: &Engine, lookup: &PromptLookupConfig) -> Result<()> {
    let max = target.plan.limits.max_draft_len;
    let rebuild = format!(
        "rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len {}",
        lookup.num_tokens
    );
    if target.plan.speculative_mode == SpeculativeMode::None {
        return Err(RuntimeError::Engine(format!(
            "{}: the engine was built with --speculative_decoding_mode none, but prompt lookup decoding verifies drafts: {rebuild}",
            target.dir.display()
        )));
    }
    if lookup.num_tokens > max {
        return Err(RuntimeError::InvalidRequest(format!(
            "--prompt_lookup_config: prompt_lookup_num_tokens {} exceeds the engine's max_draft_len {max}: lower it or {rebuild}",
            lookup.num_tokens
        )));
    }
    Ok(())
}

/// The checks TensorRT-LLM leaves to the user: a target that verifies drafts (built for
/// external drafts or for EAGLE), a draft length it can verify, a plain draft engine with the
/// target's vocabulary and limits.
fn check_compatible(target: &Engine, draft: &Engine, options: &DraftTargetOptions) -> Result<()> {
    let tl = &target.plan.limits;
    let dl = &draft.plan.limits;
    // Any engine that verifies drafts will do: an EAGLE engine verifies a chain as a tree of
    // one branch, so one engine serves EAGLE, prompt lookup and a self-draft alike.
    if target.plan.speculative_mode == SpeculativeMode::None {
        return Err(RuntimeError::Engine(format!(
            "{}: the target engine was built with --speculative_decoding_mode none, but draft-target decoding needs a target that verifies drafts: rebuild it with --speculative_decoding_mode draft_tokens_external --max_draft_len K (or for EAGLE)",
            target.dir.display(),
        )));
    }
    if options.draft_len == 0 {
        return Err(RuntimeError::InvalidRequest(
            "--draft_target_model_config: draft_len must be at least 1".into(),
        ));
    }
    if options.draft_len > tl.max_draft_len {
        return Err(RuntimeError::InvalidRequest(format!(
            "--draft_target_model_config: draft_len {} exceeds the target engine's max_draft_len {}: lower draft_len or rebuild the target with --speculative_decoding_mode draft_tokens_external --max_draft_len {}",
            options.draft_len, tl.max_draft_len, options.draft_len
        )));
    }
    if draft.plan.speculative_mode != SpeculativeMode::None {
        return Err(RuntimeError::Engine(format!(
            "{}: the draft engine was built with --speculative_decoding_mode {}: build the draft as a plain engine (--speculative_decoding_mode none)",
            draft.dir.display(),
            draft.plan.speculative_mode.as_str()
        )));
    }
    if draft.config.vocab_size != target.config.vocab_size {
        return Err(RuntimeError::Engine(format!(
            "the draft engine {} has vocab_size {} but the target engine {} has vocab_size {}: draft-target decoding needs both models to share one vocabulary",
            draft.dir.display(),
            draft.config.vocab_size,
            target.dir.display(),
            target.config.vocab_size
        )));
    }
    check_tokenizers(&draft.dir, &target.dir)?;
    for (flag, d, t) in [
        ("--max_batch_size", dl.max_batch_size, tl.max_batch_size),
        ("--max_seq_len", dl.max_seq_len, tl.max_seq_len),
    ] {
        if d < t {
            return Err(RuntimeError::Engine(format!(
                "{}: the draft engine was built with {flag} {d}, smaller than the target engine's {t}: rebuild the draft with {flag} {t}",
                draft.dir.display()
            )));
        }
    }
    Ok(())
}

/// When both engines carry a tokenizer, their vocabularies (token → id) must be identical.
fn check_tokenizers(draft_dir: &Path, target_dir: &Path) -> Result<()> {
    let (dp, tp) = (
        draft_dir.join(TOKENIZER_FILE),
        target_dir.join(TOKENIZER_FILE),
    );
    if !dp.is_file() || !tp.is_file() {
        return Ok(());
    }
    let read = |p: &Path| {
        std::fs::read(p).map_err(|e| RuntimeError::Tokenizer(format!("{}: {e}", p.display())))
    };
    if read(&dp)? == read(&tp)? {
        return Ok(());
    }
    let vocab = |p: &Path| -> Result<std::collections::BTreeMap<String, u32>> {
        let tok = tokenizers::Tokenizer::from_file(p).map_err(|e| {
            RuntimeError::Tokenizer(format!("{}: cannot load the tokenizer ({e})", p.display()))
        })?;
        Ok(tok.get_vocab(true).into_iter().collect())
    };
    let (dv, tv) = (vocab(&dp)?, vocab(&tp)?);
    if dv == tv {
        return Ok(());
    }
    let shown = |id: Option<&u32>| id.map_or("absent".to_string(), |i| format!("id {i}"));
    let differing = dv
        .iter()
        .filter(|(t, id)| tv.get(*t) != Some(id))
        .map(|(t, _)| t)
        .chain(tv.keys().filter(|t| !dv.contains_key(*t)))
        .min();
    let detail = differing
        .map(|t| {
            format!(
                " (token {t:?} is {} in the draft and {} in the target)",
                shown(dv.get(t)),
                shown(tv.get(t))
            )
        })
        .unwrap_or_default();
    Err(RuntimeError::Engine(format!(
        "{} and {} have different vocabularies{detail}: draft-target decoding needs both models to share one tokenizer",
        dp.display(),
        tp.display()
    )))
}

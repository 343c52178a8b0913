//! EAGLE-1 (static tree) and EAGLE-2 (dynamic tree) speculative decoding.
//!
//! Per step and sequence: the head consumes the newly committed (token, feature) pairs and
//! predicts the next feature; a tree is drafted from it; the target verifies the whole tree
//! in one forward with the tree's ancestor mask and depth positions; the accepted path's KV
//! slots are compacted into place and the rest dropped; the accepted tokens and the target's
//! bonus token are committed. The features are the target's final-normed hidden states (with
//! the states of the head's `feature_layers`, fused by the head), so the next step's pairs
//! come straight out of the verification forward.

mod accept;
mod draft;
mod feed;
mod node_outputs;
mod node_tokens;

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::{
    count_prompt, positions, prompt_batch, prompt_positions, sample_rows, seqs_at, Admission,
    Decoder, Turn,
};
use crate::kv_budget::{size_pools, KvCacheOptions, PoolShape, PoolSpec};
use crate::prefix::{PromptPrefixes, Slots};
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use crate::{Acceptance, EagleOptions, EagleTreeKind, PromptLookup};
use candle_core::Tensor;
use draft::{ChildChoice, DraftRoot, DraftVocab, DraftedTree, Drafter};
use kestrel_kernels::gather_rows;
use kestrel_model::{
    Compaction, EagleHead, EagleSeqInput, OutputRows, PagedKvCache, SeqId, SeqInput,
};
use kestrel_spec::dynamic::DynamicTreeConfig;
use kestrel_spec::{graft_chain, SeqRng};
use std::borrow::Cow;
use std::time::Instant;

pub(crate) struct EagleDecoder<'e> {
    engine: &'e Engine,
    head: &'e EagleHead,
    options: EagleOptions,
    dynamic: Option<DynamicTreeConfig>,
    base_cache: PagedKvCache,
    head_cache: PagedKvCache,
    pools: Vec<PoolShape>,
    draft_vocab: Option<DraftVocab>,
}

/// Committed (token, feature) pairs the head has not consumed yet.
struct Pending {
    tokens: Vec<u32>,
    /// The pairs' features in chunks of rows, joined when the head reads them: steps that do
    /// not draft (`--speculative_disable_by_batch_size`) each add a chunk, and joining them
    /// at every step would copy the whole backlog each time.
    features: Vec<Tensor>,
    /// Head position of the first pair.
    start: usize,
}

impl Pending {
    fn new(tokens: Vec<u32>, features: Tensor, start: usize) -> Self {
        Pending {
            tokens,
            features: vec![features],
            start,
        }
    }

    /// Every pending pair's feature, one row a pair.
    fn features(&self) -> Result<Tensor> {
        Ok(match self.features.as_slice() {
            [one] => one.clone(),
            chunks => Tensor::cat(chunks, 0)?,
        })
    }
}

impl<'e> EagleDecoder<'e> {
    pub fn new(
        engine: &'e Engine,
        options: EagleOptions,
        kv: &KvCacheOptions,
        max_output_len: usize,
    ) -> Result<Self> {
        let head = engine.eagle.as_ref().ok_or_else(|| {
            RuntimeError::InvalidRequest(format!(
                "{} has no EAGLE head: build it with spec-build --speculative_decoding_mode eagle from a checkpoint converted with --eagle_model_dir",
                engine.dir.display()
            ))
        })?;
        let dynamic = match &options.tree {
            EagleTreeKind::Static(_) => None,
            EagleTreeKind::Dynamic {
                top_k,
                max_draft_len,
                num_layers,
                min_prob,
            } => Some(dynamic_config(
                engine,
                *top_k,
                *max_draft_len,
                *num_layers,
                *min_prob,
            )?),
        };
        let draft_vocab = options
            .draft_vocab
            .map(|n| draft_vocab(engine, &options.tree, n))
            .transpose()?;
        let specs = [
            PoolSpec::for_engine("target", engine),
            PoolSpec::for_model(
                "eagle_head",
                engine,
                &head.config().llama,
                head.num_layers(),
            ),
        ];
        let pools = size_pools(&specs, kv, engine, max_output_len)?;
        let base_cache = kv.new_cache(&pools[0], |n, b| engine.model.new_cache(n, b))?;
        let head_cache = kv.new_cache(&pools[1], |n, b| head.new_cache(n, b))?;
        Ok(EagleDecoder {
            engine,
            head,
            options,
            dynamic,
            base_cache,
            head_cache,
            pools,
            draft_vocab,
        })
    }

    /// The head consumes every live sequence's pending pairs; returns each one's draft root.
    fn advance_head(
        &mut self,
        live: &[usize],
        seqs: &[Sequence],
        head_ids: &[SeqId],
        pending: &[Option<Pending>],
    ) -> Result<Vec<DraftRoot>> {
        let pos: Vec<Vec<u32>> = live
            .iter()
            .map(|&i| {
                let p = pending[i]
                    .as_ref()
                    .expect("live sequences have pending pairs");
                positions(p.start, p.tokens.len())
            })
            .collect();
        let batch = live
            .iter()
            .zip(&pos)
            .map(|(&i, p)| {
                let pend = pending[i].as_ref().expect("checked above");
                Ok(EagleSeqInput {
                    seq: head_ids[i],
                    tokens: &pend.tokens,
                    features: pend.features()?,
                    positions: p,
                    mask: None,
                    output_rows: OutputRows::Last,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let out = self
            .head
            .forward(&self.engine.model, &batch, &mut self.head_cache)?;
        live.iter()
            .enumerate()
            .map(|(row, &i)| {
                let committed = self.head_cache.seq_len(head_ids[i])?;
                // One pair a committed token after the first: a head that fell behind (pairs
                // lost while it did not draft) would draft from the wrong context unnoticed.
                let want = seqs[i].tokens.len() - 1;
                if committed != want {
                    return Err(RuntimeError::Engine(format!(
                        "internal error: the EAGLE head holds {committed} pairs of sequence {i}, which has committed {want}"
                    )));
                }
                Ok(DraftRoot {
                    seq: head_ids[i],
                    committed,
                    root_pos: committed - 1,
                    token: *seqs[i].tokens.last().expect("non-empty"),
                    output: out.narrow(0, row, 1)?,
                })
            })
            .collect()
    }
}

impl EagleDecoder<'_> {
    /// Newly admitted sequences: cached prefix blocks (a sequence reuses a block only when
    /// both caches hold it, since the head's pairs need the base features of every position
    /// it has not cached), then every uncached prompt position's feature, whose last one's
    /// logits give the first token; returns each sequence's pairs for the head.
    #[allow(clippy::too_many_arguments)]
    fn prefill(
        &mut self,
        seqs: &mut [Sequence],
        base_ids: &[SeqId],
        head_ids: &[SeqId],
        base_prefixes: &mut PromptPrefixes,
        head_prefixes: &mut PromptPrefixes,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Option<Pending>>> {
        let model = &self.engine.model;
        let start = Instant::now();
        base_prefixes.add(&self.base_cache, seqs);
        head_prefixes.add(&self.head_cache, seqs);
        let blocks: Vec<usize> = base_prefixes
            .cached_blocks(&self.base_cache, seqs)
            .into_iter()
            .zip(head_prefixes.cached_blocks(&self.head_cache, seqs))
            .map(|(b, h)| b.min(h))
            .collect();
        let reused = base_prefixes.attach(&mut self.base_cache, seqs, base_ids, &blocks)?;
        head_prefixes.attach(&mut self.head_cache, seqs, head_ids, &blocks)?;
        for pool in 0..2 {
            count_prompt(timings, pool, seqs.iter().map(|s| s.prompt_len), &reused);
        }
        let pos = prompt_positions(seqs, &reused);
        let batch = prompt_batch(seqs, base_ids, &reused, &pos, OutputRows::All);
        let taps = &self.head.config().feature_layers;
        let tapped = model.forward_tapped(&batch, &mut self.base_cache, taps, true)?;
        let hidden = self.head.fuse_features(&tapped)?;
        let mut lasts = Vec::with_capacity(seqs.len());
        let mut offset = 0;
        for (s, &r) in seqs.iter().zip(&reused) {
            offset += s.tokens.len() - r;
            lasts.push(tapped.narrow(0, offset - 1, 1)?);
        }
        let logits = model.logits(&model.final_hidden(&Tensor::cat(&lasts, 0)?)?)?;
        let mut pending = Vec::with_capacity(seqs.len());
        let mut all: Vec<&mut Sequence> = seqs.iter_mut().collect();
        let first = sample_rows(&logits, &mut all, params)?;
        let ttft = start.elapsed().as_secs_f64();
        timings.prefill_s += ttft;
        let mut offset = 0;
        for ((s, t), &r) in all.iter_mut().zip(first).zip(&reused) {
            let n = s.tokens.len();
            s.stats.time_to_first_token_s = ttft;
            s.stats.reused_prompt_tokens = r;
            s.commit(&[t], params, sink);
            // Pairs r.. of (token p + 1, feature p); the head caches those before r.
            let mut tokens = s.tokens[r + 1..n].to_vec();
            tokens.push(t);
            pending.push(Some(Pending::new(
                tokens,
                hidden.narrow(0, offset, n - r)?,
                r,
            )));
            offset += n - r;
        }
        let head_start = Instant::now();
        self.head_prefill(head_ids, &mut pending)?;
        timings.prefill_s += head_start.elapsed().as_secs_f64();
        Ok(pending)
    }

    /// The head reads all but the last of each new sequence's prompt pairs as part of the
    /// prefill, so that the next step's head forward takes one pair from a sequence admitted
    /// in flight, as from the others, rather than a whole prompt in the middle of the batch's
    /// step (a shape no graph holds: measured 8-10% of EAGLE's decode time at batch 4 on the
    /// H200).
    fn head_prefill(&mut self, head_ids: &[SeqId], pending: &mut [Option<Pending>]) -> Result<()> {
        let mut inputs = Vec::new();
        for (&seq, p) in head_ids.iter().zip(pending.iter_mut()) {
            let Some(p) = p.as_mut() else { continue };
            let read = p.tokens.len() - 1;
            if read == 0 {
                continue;
            }
            let features = p.features()?;
            inputs.push((
                seq,
                p.tokens[..read].to_vec(),
                features.narrow(0, 0, read)?,
                p.start,
            ));
            p.tokens.drain(..read);
            p.features = vec![features.narrow(0, read, 1)?];
            p.start += read;
        }
        if inputs.is_empty() {
            return Ok(());
        }
        let pos: Vec<Vec<u32>> = inputs
            .iter()
            .map(|(_, tokens, _, start)| positions(*start, tokens.len()))
            .collect();
        let batch: Vec<EagleSeqInput> = inputs
            .iter()
            .zip(&pos)
            .map(|((seq, tokens, features, _), p)| EagleSeqInput {
                seq: *seq,
                tokens,
                features: features.clone(),
                positions: p,
                mask: None,
                output_rows: OutputRows::Last,
            })
            .collect();
        self.head
            .forward(&self.engine.model, &batch, &mut self.head_cache)?;
        Ok(())
    }
}

impl Decoder for EagleDecoder<'_> {
    fn run(
        &mut self,
        admission: &mut Admission,
        params: &GenerationParams,
        sink: &mut dyn TokenSink,
        timings: &mut RunTimings,
    ) -> Result<Vec<Sequence>> {
        let model = &self.engine.model;
        let taps = &self.head.config().feature_layers;
        let mut seqs: Vec<Sequence> = Vec::new();
        let (mut base_ids, mut head_ids) = (Vec::new(), Vec::new());
        let mut pending: Vec<Option<Pending>> = Vec::new();
        let mut base_prefixes = PromptPrefixes::new(Slots::Tokens);
        let mut head_prefixes = PromptPrefixes::new(Slots::Pairs);
        loop {
            let turn = admission.next_turn(&mut seqs, |i| {
                base_prefixes.free(&mut self.base_cache, i, base_ids[i])?;
                head_prefixes.free(&mut self.head_cache, i, head_ids[i])?;
                pending[i] = None;
                Ok(())
            })?;
            let live = match turn {
                Turn::Step(live) => live,
                Turn::Done => return Ok(seqs),
                Turn::Prefill(first) => {
                    for _ in first..seqs.len() {
                        base_ids.push(self.base_cache.add_sequence());
                        head_ids.push(self.head_cache.add_sequence());
                    }
                    let new = self.prefill(
                        &mut seqs[first..],
                        &base_ids[first..],
                        &head_ids[first..],
                        &mut base_prefixes,
                        &mut head_prefixes,
                        params,
                        sink,
                        timings,
                    )?;
                    pending.extend(new);
                    continue;
                }
            };

            // Above the batch size that disables speculation, a plain step: each sequence's
            // root alone, while the head's pairs wait in `pending` until it drafts again.
            let speculate = self
                .options
                .disable_by_batch_size
                .is_none_or(|n| live.len() <= n);
            let (mut trees, tree_tokens, device_laws) = if speculate {
                let draft_start = Instant::now();
                let roots = self.advance_head(&live, &seqs, &head_ids, &pending)?;
                timings.head_s += draft_start.elapsed().as_secs_f64();
                let mut drafter = Drafter {
                    head: self.head,
                    base: model,
                    cache: &mut self.head_cache,
                    draft_vocab: self.draft_vocab.as_ref(),
                    device_laws: Vec::new(),
                };
                let drafted = match (&self.options.tree, &self.dynamic) {
                    (EagleTreeKind::Static(tree), _) => {
                        let choice = if self.options.acceptance == Acceptance::Exact
                            && !params.sampling.is_greedy()
                        {
                            ChildChoice::Sample(&params.sampling)
                        } else {
                            ChildChoice::TopK
                        };
                        let mut rngs: Vec<&mut SeqRng> = seqs_at(&mut seqs, &live)
                            .into_iter()
                            .map(|s| &mut s.rng)
                            .collect();
                        if self.options.lookup.is_some() && matches!(choice, ChildChoice::Sample(_))
                        {
                            return Err(RuntimeError::InvalidRequest(
                                "prompt lookup cannot join a static EAGLE tree under exact acceptance with sampling: the tree's children are drawn and the lookup's drafts have no draft law; use --eagle_sampling token_match or typical".into(),
                            ));
                        }
                        let host_tokens = self.options.lookup.is_some();
                        drafter.draft_static(tree, &roots, &choice, &mut rngs, host_tokens)?
                    }
                    (EagleTreeKind::Dynamic { .. }, Some(cfg)) => {
                        drafter.draft_dynamic(cfg, &roots)?
                    }
                    (EagleTreeKind::Dynamic { .. }, None) => unreachable!("validated in new"),
                };
                let device_laws = match drafter.device_laws.len() {
                    0 => None,
                    1 => drafter.device_laws.pop(),
                    _ => Some(Tensor::cat(&drafter.device_laws, 0)?),
                };
                timings.draft_s += draft_start.elapsed().as_secs_f64();
                let mut trees = drafted.trees;
                if let Some(lookup) = &self.options.lookup {
                    let max_nodes = self.engine.plan.limits.max_draft_len + 1;
                    graft_lookups(lookup, &mut trees, &live, &seqs, max_nodes);
                }
                (trees, drafted.device_tokens, device_laws)
            } else {
                let roots = live
                    .iter()
                    .map(|&i| DraftedTree::root_only(*seqs[i].tokens.last().expect("non-empty")))
                    .collect();
                (roots, None, None)
            };

            // Verify every tree in one target forward.
            let verify_start = Instant::now();
            let bases: Vec<usize> = live.iter().map(|&i| seqs[i].tokens.len() - 1).collect();
            let pos: Vec<Vec<u32>> = trees
                .iter()
                .zip(&bases)
                .map(|(t, &b)| t.buffers.depths().iter().map(|&d| (b + d) as u32).collect())
                .collect();
            let batch: Vec<SeqInput> = live
                .iter()
                .zip(&trees)
                .zip(&pos)
                .map(|((&i, t), p)| SeqInput {
                    seq: base_ids[i],
                    tokens: &t.tokens,
                    positions: p,
                    mask: Some(t.buffers.mask()),
                    output_rows: OutputRows::All,
                })
                .collect();
            let tapped = match &tree_tokens {
                Some(ids) => {
                    model.forward_tapped_device_ids(&batch, ids, &mut self.base_cache, taps)?
                }
                None => model.forward_tapped(&batch, &mut self.base_cache, taps, false)?,
            };
            let logits = model.logits(&model.final_hidden(&tapped)?)?;
            let accept_start = Instant::now();
            let accepted = accept::accept_trees(
                &logits,
                self.options.acceptance,
                &mut trees,
                tree_tokens.as_ref(),
                &live,
                &mut seqs,
                &params.sampling,
                device_laws.as_ref(),
                self.draft_vocab.as_ref().and_then(|v| v.col_of.as_ref()),
            )?;
            timings.accept_s += accept_start.elapsed().as_secs_f64();
            let update_start = Instant::now();
            // Every sequence's accepted slots move into place in one launch, and their features
            // (the verification's rows at the accepted nodes) come out in one gather.
            let compactions: Vec<Compaction> = live
                .iter()
                .zip(&bases)
                .zip(&accepted)
                .map(|((&i, &base_len), acc)| Compaction {
                    seq: base_ids[i],
                    base_len,
                    kept: &acc.accepted_nodes,
                })
                .collect();
            self.base_cache.compact_all(&compactions)?;
            let mut kept_rows: Vec<u32> = Vec::new();
            let mut offset = 0;
            for (tree, acc) in trees.iter().zip(&accepted) {
                kept_rows.extend(acc.accepted_nodes.iter().map(|&r| (offset + r) as u32));
                offset += tree.tokens.len();
            }
            // Where every row is kept (a step that drafted nothing) they need no gather.
            let kept = if kept_rows.len() == offset {
                tapped
            } else {
                gather_rows(
                    &tapped,
                    &Tensor::new(kept_rows.as_slice(), tapped.device())?,
                )?
            };
            let features = self.head.fuse_features(&kept)?;
            let mut first_row = 0;
            for (((&i, tree), &base_len), acc) in live.iter().zip(&trees).zip(&bases).zip(accepted)
            {
                let s = &mut seqs[i];
                let kept = acc.accepted_nodes.len();
                s.stats.draft_tokens += tree.tokens.len() - 1;
                s.stats.accepted_draft_tokens += acc.accepted_len;
                s.stats.record_step(acc.tokens.len());
                s.commit(&acc.tokens, params, sink);
                let features = features.narrow(0, first_row, kept)?;
                first_row += kept;
                match &mut pending[i] {
                    // A plain step: the new pairs join those the head has yet to read.
                    Some(p) if !speculate => {
                        debug_assert_eq!(p.start + p.tokens.len(), base_len);
                        p.tokens.extend_from_slice(&acc.tokens);
                        p.features.push(features);
                    }
                    slot => *slot = Some(Pending::new(acc.tokens, features, base_len)),
                }
            }
            timings.update_s += update_start.elapsed().as_secs_f64();
            timings.verify_s += verify_start.elapsed().as_secs_f64();
            timings.batch_steps += 1;
        }
    }

    fn pools(&self) -> Vec<PoolShape> {
        self.pools.clone()
    }
}

/// Grafts each live sequence's prompt lookup drafts onto its drafted tree, keeping every tree
/// within `max_nodes` (the engine verifies at most `max_draft_len + 1` rows a sequence).
fn graft_lookups(
    lookup: &PromptLookup,
    trees: &mut [DraftedTree],
    live: &[usize],
    seqs: &[Sequence],
    max_nodes: usize,
) {
    for (tree, &i) in trees.iter_mut().zip(live) {
        let s = &seqs[i];
        let chain = lookup.propose(&s.tokens, s.remaining().saturating_sub(1));
        let room = max_nodes.saturating_sub(tree.tokens.len());
        if let Some(g) = graft_chain(&tree.tokens, &tree.buffers, &chain, room) {
            tree.tokens = g.tokens;
            tree.buffers = Cow::Owned(g.buffers);
        }
    }
}

/// EAGLE-2's tree limits: the engine's, or run-time caps within them.
fn dynamic_config(
    engine: &Engine,
    top_k: usize,
    max_draft_len: Option<usize>,
    num_layers: Option<usize>,
    min_prob: f32,
) -> Result<DynamicTreeConfig> {
    let limits = &engine.plan.limits;
    // A cap within the engine's limit; `rebuild` says how to raise the limit.
    let within = |asked: Option<usize>, limit: usize, flag: &str, rebuild: &str| match asked {
        Some(0) => Err(RuntimeError::InvalidRequest(format!(
            "{flag} 0: EAGLE-2 needs at least 1"
        ))),
        Some(n) if n > limit => Err(RuntimeError::InvalidRequest(format!(
            "{flag} {n} exceeds {limit}, the limit {} was built with; more needs {rebuild} {n}",
            engine.dir.display()
        ))),
        _ => Ok(asked.unwrap_or(limit)),
    };
    let cfg = DynamicTreeConfig {
        top_k,
        num_layers: within(
            num_layers,
            limits.num_eagle_layers,
            "--eagle_dynamic_tree_num_layers",
            "convert-checkpoint --num_eagle_layers",
        )?,
        max_draft_len: within(
            max_draft_len,
            limits.max_draft_len,
            "--eagle_dynamic_tree_max_draft_len",
            "spec-build --max_draft_len",
        )?,
        max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
        min_prob,
    };
    if let Some(cap) = max_draft_len.filter(|&cap| top_k > cap) {
        // Otherwise the check below would blame the engine's max_draft_len.
        return Err(RuntimeError::InvalidRequest(format!(
            "--eagle_dynamic_tree_max_top_k {top_k} exceeds --eagle_dynamic_tree_max_draft_len {cap}: the first layer alone drafts {top_k} nodes"
        )));
    }
    cfg.validate()
        .map_err(|e| RuntimeError::InvalidRequest(e.to_string()))?;
    Ok(cfg)
}

/// The `n` tokens the head drafts from: the engine's `n` most frequent when it carries a
/// ranking, else the first `n` ids.
fn draft_vocab(engine: &Engine, tree: &EagleTreeKind, n: usize) -> Result<DraftVocab> {
    let vocab = engine.config.vocab_size;
    let per_node = match tree {
        EagleTreeKind::Static(t) => t.buffers().ranks().iter().max().map_or(1, |r| r + 1),
        EagleTreeKind::Dynamic { top_k, .. } => *top_k,
    };
    if n < per_node || n > vocab {
        return Err(RuntimeError::InvalidRequest(format!(
            "a draft vocabulary of {n} tokens: it must hold the tree's {per_node} candidates per node and at most the model's {vocab} tokens"
        )));
    }
    let ids: Vec<u32> = match &engine.draft_vocab {
        Some(ranked) => ranked[..n].to_vec(),
        None => (0..n as u32).collect(),
    };
    let rows = engine.model.lm_head_rows(&ids)?;
    let ids_tensor = Tensor::new(ids.as_slice(), &engine.device)?;
    // Exact acceptance on a device looks the draft's column of a token up there.
    let col_of = if engine.device.is_cpu() {
        None
    } else {
        let mut table = vec![u32::MAX; vocab];
        for (c, &t) in ids.iter().enumerate() {
            table[t as usize] = c as u32;
        }
        Some(Tensor::from_vec(table, vocab, &engine.device)?)
    };
    Ok(DraftVocab {
        ids,
        ids_tensor,
        rows,
        col_of,
    })
}

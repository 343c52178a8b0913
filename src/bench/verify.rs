//! `verify:T` and `verify:TREE`: what verifying a draft costs next to a plain decode step.
//! Both kinds of step run over the same batch at the same context lengths: forward, LM head,
//! greedy argmax where the rows are (the runtime's own, [`kestrel_runtime::greedy_tokens`])
//! and the chosen ids copied to the host (which is what a greedy verification needs, and
//! which synchronises the device). `verify:T` verifies a chain of T tokens (a causal mask):
//! the projections' work is a tree's of T tokens, the attention's more (row i sees i new
//! tokens, where a tree's node sees only its ancestors). `verify:TREE` verifies a static
//! tree's root and nodes under its ancestor mask, each at its depth's position, as EAGLE does.

use super::measure::MemProbe;
use anyhow::{Context, Result};
use kestrel_model::{Llama, OutputRows, SeqId, SeqInput};
use kestrel_spec::{EagleTree, TreeLimits};
use std::time::Instant;

/// The draft a `verify:` mode verifies after each sequence's last token.
#[derive(Debug, Clone, PartialEq)]
pub enum DraftShape {
    /// The last token and T − 1 drafts in a chain.
    Chain(usize),
    /// A tree's root (the last token) and nodes: the `(n+1) × (n+1)` ancestor mask and each
    /// node's depth.
    Tree { mask: Vec<bool>, depths: Vec<usize> },
}

impl DraftShape {
    /// The tree `spec` (a preset name, JSON paths or a JSON file, as `eagle1:TREE`), limited
    /// in nothing but being a tree: here it is only a mask. Errors name `flag` and `spec`.
    pub fn tree(flag: &str, spec: &str) -> Result<Self> {
        let any = TreeLimits {
            num_eagle_layers: usize::MAX,
            max_non_leaves_per_layer: usize::MAX,
            max_draft_len: usize::MAX,
            max_top_k: usize::MAX,
        };
        let json = crate::decoding::tree_json(flag, spec)?;
        let tree = EagleTree::from_spec(&json, &any).with_context(|| format!("{flag}{spec}"))?;
        let b = tree.buffers();
        Ok(Self::Tree {
            mask: b.mask().to_vec(),
            depths: b.depths().to_vec(),
        })
    }

    /// Tokens a sequence's verification step brings.
    pub fn tokens(&self) -> usize {
        match self {
            Self::Chain(t) => *t,
            Self::Tree { depths, .. } => depths.len(),
        }
    }

    /// Position offset of token `i` of the step from the sequence's length.
    fn offset(&self, i: usize) -> usize {
        match self {
            Self::Chain(_) => i,
            Self::Tree { depths, .. } => depths[i],
        }
    }

    fn mask(&self) -> Option<&[bool]> {
        match self {
            Self::Chain(_) => None,
            Self::Tree { mask, .. } => Some(mask),
        }
    }
}

pub struct VerifyTiming {
    /// Mean seconds of a one-token step and of a T-token step.
    pub one_token_step_s: f64,
    pub tree_step_s: f64,
    pub steps: usize,
    /// Mean context length (cached tokens) a step attends to, per sequence.
    pub mean_context_len: f64,
}

/// Times `steps` one-token steps, then `steps` steps of `draft` at the same context lengths:
/// after each verification the cache keeps one token, as if only the root were accepted.
pub fn time_verify(
    model: &Llama,
    prompts: &[Vec<u32>],
    draft: &DraftShape,
    steps: usize,
    block_size: usize,
    probe: &mut MemProbe,
) -> Result<VerifyTiming> {
    let tree_tokens = draft.tokens();
    let max_prompt = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let per_seq = (max_prompt + steps + tree_tokens + 1).div_ceil(block_size);
    let mut cache = model.new_cache(prompts.len() * per_seq, block_size)?;
    let ids: Vec<SeqId> = prompts.iter().map(|_| cache.add_sequence()).collect();

    let pos: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| (0..p.len() as u32).collect())
        .collect();
    let batch: Vec<SeqInput> = prompts
        .iter()
        .zip(&ids)
        .zip(&pos)
        .map(|((p, &seq), pos)| SeqInput {
            seq,
            tokens: p,
            positions: pos,
            mask: None,
            output_rows: OutputRows::Last,
        })
        .collect();
    let hidden = model.forward_prompt(&batch, &mut cache)?;
    let mut last: Vec<u32> = argmax_ids(model, &hidden)?;
    let prompt_lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
    // Draft tokens: any ids of the vocabulary will do; the prompt's own, cycled.
    let drafts: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| p.iter().cycle().take(tree_tokens).copied().collect())
        .collect();

    // One step of `n` tokens per sequence at its current length; returns the seconds.
    let step =
        |cache: &mut kestrel_model::PagedKvCache, last: &mut Vec<u32>, n: usize| -> Result<f64> {
            let lens: Vec<usize> = ids
                .iter()
                .map(|&s| cache.seq_len(s))
                .collect::<kestrel_model::Result<_>>()?;
            let toks: Vec<Vec<u32>> = last
                .iter()
                .zip(&drafts)
                .map(|(&t, d)| {
                    std::iter::once(t)
                        .chain(d[..n - 1].iter().copied())
                        .collect()
                })
                .collect();
            let pos: Vec<Vec<u32>> = lens
                .iter()
                .map(|&l| (0..n).map(|i| (l + draft.offset(i)) as u32).collect())
                .collect();
            // A one-token step is causal; a verification takes the draft's mask.
            let mask = if n == tree_tokens { draft.mask() } else { None };
            let batch: Vec<SeqInput> = ids
                .iter()
                .zip(&toks)
                .zip(&pos)
                .map(|((&seq, t), p)| SeqInput {
                    seq,
                    tokens: t,
                    positions: p,
                    mask,
                    output_rows: OutputRows::All,
                })
                .collect();
            let t = Instant::now();
            let hidden = model.forward(&batch, cache)?;
            let chosen = argmax_ids(model, &hidden)?;
            let secs = t.elapsed().as_secs_f64();
            // Keep the root's slot (one accepted token), drop the rest of the draft.
            for (i, (&seq, &l)) in ids.iter().zip(&lens).enumerate() {
                cache.truncate(seq, l + 1)?;
                last[i] = chosen[i * n];
            }
            Ok(secs)
        };

    // Warm-up of both shapes (first kernel launches, allocator growth), then back to the
    // prompts.
    let first = last.clone();
    step(&mut cache, &mut last, 1)?;
    step(&mut cache, &mut last, tree_tokens)?;
    let rewind = |cache: &mut kestrel_model::PagedKvCache| -> Result<()> {
        for (&seq, &l) in ids.iter().zip(&prompt_lens) {
            cache.truncate(seq, l)?;
        }
        Ok(())
    };
    rewind(&mut cache)?;
    last.clone_from(&first);

    let mut one = 0.0;
    for _ in 0..steps {
        one += step(&mut cache, &mut last, 1)?;
        probe.sample();
    }
    rewind(&mut cache)?;
    last.clone_from(&first);
    let mut tree = 0.0;
    for _ in 0..steps {
        tree += step(&mut cache, &mut last, tree_tokens)?;
        probe.sample();
    }
    let mean_prompt = prompt_lens.iter().sum::<usize>() as f64 / prompt_lens.len().max(1) as f64;
    let n = steps.max(1) as f64;
    Ok(VerifyTiming {
        one_token_step_s: one / n,
        tree_step_s: tree / n,
        steps,
        // Step k attends to prompt + k cached tokens plus its own.
        mean_context_len: mean_prompt + (steps as f64 - 1.0) / 2.0 + 1.0,
    })
}

/// Greedy ids of every row of `hidden`, chosen on the device.
fn argmax_ids(model: &Llama, hidden: &candle_core::Tensor) -> Result<Vec<u32>> {
    Ok(kestrel_runtime::greedy_tokens(&model.logits(hidden)?)?)
}

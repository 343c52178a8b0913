//! Choosing the accepted path of a verified tree, per the requested acceptance rule.

use super::draft::{DraftLaws, DraftedTree};
use crate::error::{Result, RuntimeError};
use crate::logit_rows::{
    draws_on_device, fetch_ids, row_ids, typical_row_ids, LogitRows, LogitSlice,
};
use crate::sequence::Sequence;
use crate::Acceptance;
use candle_core::Tensor;
use kestrel_spec::accept::{self, DraftProposal, TreeAcceptance, TypicalParams};
use kestrel_spec::sampling::{self, SamplingParams};
use kestrel_spec::SeqRng;

/// What `rule` needs of the verified trees' rows (`logits`, the `trees` of the sequences
/// `live` in order): the target's own token at every node when it matches tokens (its argmax
/// when greedy, which every rule then is; a draw per node when sampling, with uniforms taken
/// from each sequence's stream in node order, as the host draws them: from the warped law for
/// token matching, and on a device from typical acceptance's law), or the full rows (exact
/// acceptance; typical acceptance on the CPU). Also returns the values of `drafted` (the
/// trees' tokens, when they were drafted where the rows are), fetched in the same copy as the
/// target's tokens.
pub(crate) fn target_rows(
    logits: &Tensor,
    rule: Acceptance,
    trees: &[DraftedTree],
    live: &[usize],
    seqs: &mut [Sequence],
    params: &SamplingParams,
    drafted: Option<&Tensor>,
) -> Result<(LogitRows, Vec<u32>)> {
    let typical_on_device = matches!(rule, Acceptance::Typical { .. }) && draws_on_device(logits);
    if !params.is_greedy() && rule != Acceptance::TokenMatch && !typical_on_device {
        let rows = LogitRows::logits(logits)?;
        return Ok((rows, fetch_ids(drafted)?));
    }
    let mut uniforms = Vec::new();
    if !params.is_greedy() {
        for (tree, &i) in trees.iter().zip(live) {
            uniforms.extend((0..tree.buffers.num_nodes()).map(|_| seqs[i].rng.uniform()));
        }
    }
    let ids = match rule {
        Acceptance::Typical {
            posterior_threshold,
        } if !params.is_greedy() => {
            typical_row_ids(logits, params.temperature, posterior_threshold, &uniforms)?
        }
        _ => row_ids(logits, params, &uniforms)?,
    };
    let (target, drafted) = ids.fetch_with(drafted)?;
    Ok((LogitRows::Tokens(target), drafted))
}

/// Every live sequence's acceptance of its verified tree (`logits`: the trees' rows, in
/// order). Trees drafted on the device have their tokens in `drafted` (u32, tree after tree)
/// and none yet on the host: they are filled in here, from the copy that brings the target's
/// tokens. Exact acceptance of sampled trees on a device runs there
/// (`kestrel_kernels::tree_accept`: children drawn on the device have their laws in
/// `device_laws`, a draft vocabulary its column table `col_of`), from uniforms taken ahead from
/// copies of the streams, which then advance by the uniforms the walk used; every other case
/// goes through [`target_rows`] and [`accept_tree`].
#[allow(clippy::too_many_arguments)]
pub(crate) fn accept_trees(
    logits: &Tensor,
    rule: Acceptance,
    trees: &mut [DraftedTree],
    drafted: Option<&Tensor>,
    live: &[usize],
    seqs: &mut [Sequence],
    params: &SamplingParams,
    device_laws: Option<&Tensor>,
    col_of: Option<&Tensor>,
) -> Result<Vec<TreeAcceptance>> {
    let host_laws = trees
        .iter()
        .any(|t| matches!(t.draft_laws, DraftLaws::Host(_)));
    if rule == Acceptance::Exact && !params.is_greedy() && draws_on_device(logits) && !host_laws {
        fill_tokens(trees, fetch_ids(drafted)?);
        return exact_on_device(logits, trees, live, seqs, params, device_laws, col_of);
    }
    let (target, drafted) = target_rows(logits, rule, trees, live, seqs, params, drafted)?;
    fill_tokens(trees, drafted);
    let mut offset = 0;
    trees
        .iter()
        .zip(live)
        .map(|(tree, &i)| {
            let n = tree.tokens.len();
            let acc = accept_tree(
                tree,
                target.slice(offset, n),
                rule,
                params,
                &mut seqs[i].rng,
            );
            offset += n;
            acc
        })
        .collect()
}

/// Gives trees drafted on the device their tokens (`drafted`, tree after tree; empty when
/// the trees were drafted on the host and have them).
fn fill_tokens(trees: &mut [DraftedTree], drafted: Vec<u32>) {
    if drafted.is_empty() {
        return;
    }
    let mut rest = drafted.as_slice();
    for tree in trees {
        let (mine, others) = rest.split_at(tree.buffers.num_nodes());
        tree.tokens = mine.to_vec();
        rest = others;
    }
}

fn exact_on_device(
    logits: &Tensor,
    trees: &[DraftedTree],
    live: &[usize],
    seqs: &mut [Sequence],
    params: &SamplingParams,
    device_laws: Option<&Tensor>,
    col_of: Option<&Tensor>,
) -> Result<Vec<TreeAcceptance>> {
    let uniforms: Vec<Vec<f32>> = trees
        .iter()
        .zip(live)
        .map(|(tree, &i)| seqs[i].rng.peek_f32(tree.tokens.len()))
        .collect();
    let mut root_row = 0;
    let tree_seqs: Vec<kestrel_kernels::TreeSeq> = trees
        .iter()
        .zip(&uniforms)
        .map(|(tree, u)| {
            let n = tree.tokens.len();
            let seq = kestrel_kernels::TreeSeq {
                root_row,
                tokens: &tree.tokens,
                ranks: tree.buffers.ranks(),
                children: (0..n).map(|i| tree.buffers.children(i)).collect(),
                draft_rows: match &tree.draft_laws {
                    DraftLaws::Device(rows) => Some(rows.clone()),
                    _ => None,
                },
                uniforms: u,
            };
            root_row += n;
            seq
        })
        .collect();
    let outcomes = kestrel_kernels::tree_accept(
        logits,
        device_laws,
        col_of,
        &tree_seqs,
        params.temperature,
        params.top_k,
        params.top_p,
    )?;
    Ok(trees
        .iter()
        .zip(live)
        .zip(outcomes)
        .map(|((tree, &i), o)| {
            seqs[i].rng.skip(o.uniforms_used);
            TreeAcceptance::from_walk(&tree.buffers, &tree.tokens, o.accepted_nodes, o.bonus)
        })
        .collect())
}

/// `target`: [`target_rows`]' rows for the tree's nodes, root first.
pub(crate) fn accept_tree(
    tree: &DraftedTree,
    target: LogitSlice<'_>,
    rule: Acceptance,
    params: &SamplingParams,
    rng: &mut SeqRng,
) -> Result<TreeAcceptance> {
    let paths = tree.buffers.retrieve_paths();
    let outcome = if let Some(tokens) = target.tokens() {
        // The target's own token at every node (drawn from typical acceptance's law under
        // that rule); drafts only guess them, so the committed tokens are exactly the
        // target's (greedy: every rule is argmax matching).
        accept::greedy_tree(&tree.tokens, tokens, paths)
    } else {
        let logits = target.logits().unwrap_or_default();
        let vocab = logits.first().map_or(0, Vec::len);
        match rule {
            Acceptance::TokenMatch => {
                return Err(RuntimeError::Engine(
                    "token-match acceptance takes the target's tokens, not its rows".into(),
                ))
            }
            Acceptance::Typical {
                posterior_threshold,
            } => accept::typical_tree(
                &tree.tokens,
                &logits.concat(),
                vocab,
                paths,
                &TypicalParams {
                    posterior_threshold,
                    temperature: params.temperature,
                },
                rng,
            ),
            Acceptance::Exact => {
                let target: Vec<f32> = logits
                    .iter()
                    .flat_map(|r| sampling::probs(r, params))
                    .collect();
                let proposal = match &tree.draft_laws {
                    DraftLaws::Host(q) => DraftProposal::WithoutReplacement { draft_probs: q },
                    DraftLaws::None => DraftProposal::Deterministic,
                    DraftLaws::Device(_) => {
                        return Err(RuntimeError::Engine(
                            "exact acceptance: the draft laws are on the device but the target's rows on the host".into(),
                        ))
                    }
                };
                accept::exact_tree_sampling(
                    &tree.buffers,
                    &tree.tokens,
                    &target,
                    vocab,
                    proposal,
                    rng,
                )
            }
        }
    };
    outcome.map_err(|e| RuntimeError::Engine(format!("tree acceptance failed: {e}")))
}

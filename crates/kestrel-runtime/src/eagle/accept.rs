//! Choosing the accepted path of a verified tree, per the requested acceptance rule.

use super::draft::DraftedTree;
use crate::error::{Result, RuntimeError};
use crate::logit_rows::{row_tokens, LogitRows, LogitSlice};
use crate::sequence::Sequence;
use crate::Acceptance;
use candle_core::Tensor;
use kestrel_spec::accept::{self, DraftProposal, TreeAcceptance, TypicalParams};
use kestrel_spec::sampling::{self, SamplingParams};
use kestrel_spec::SeqRng;

/// What `rule` needs of the verified trees' rows (`logits`, the `trees` of the sequences
/// `live` in order): the target's own token at every node when matching tokens (its argmax
/// when greedy, which every rule then is; a draw per node when sampling, with uniforms taken
/// from each sequence's stream in node order, as the host drew them), or the full rows for
/// typical and exact acceptance.
pub(crate) fn target_rows(
    logits: &Tensor,
    rule: Acceptance,
    trees: &[DraftedTree],
    live: &[usize],
    seqs: &mut [Sequence],
    params: &SamplingParams,
) -> Result<LogitRows> {
    if !params.is_greedy() && rule != Acceptance::TokenMatch {
        return LogitRows::logits(logits);
    }
    let mut uniforms = Vec::new();
    if !params.is_greedy() {
        for (tree, &i) in trees.iter().zip(live) {
            uniforms.extend((0..tree.tokens.len()).map(|_| seqs[i].rng.uniform()));
        }
    }
    Ok(LogitRows::Tokens(row_tokens(logits, params, &uniforms)?))
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
        // The target's own token at every node; drafts only guess them, so the committed
        // tokens are exactly the target's (greedy: every rule is argmax matching).
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
                let proposal = match &tree.draft_probs {
                    Some(q) => DraftProposal::WithoutReplacement { draft_probs: q },
                    None => DraftProposal::Deterministic,
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

//! Choosing the accepted path of a verified tree, per the requested acceptance rule.

use super::draft::DraftedTree;
use crate::error::{Result, RuntimeError};
use crate::logit_rows::LogitSlice;
use crate::Acceptance;
use kestrel_spec::accept::{self, DraftProposal, TreeAcceptance, TypicalParams};
use kestrel_spec::sampling::{self, SamplingParams};
use kestrel_spec::SeqRng;

/// `target`: the target's rows for the tree's nodes, root first (only their argmaxes when
/// sampling is greedy).
pub(crate) fn accept_tree(
    tree: &DraftedTree,
    target: LogitSlice<'_>,
    rule: Acceptance,
    params: &SamplingParams,
    rng: &mut SeqRng,
) -> Result<TreeAcceptance> {
    let paths = tree.buffers.retrieve_paths();
    let outcome = if params.is_greedy() {
        // Every rule is argmax matching under greedy sampling.
        let argmax: Vec<u32> = (0..target.len()).map(|i| target.argmax(i)).collect();
        accept::greedy_tree(&tree.tokens, &argmax, paths)
    } else {
        let logits = target.logits().ok_or_else(|| {
            RuntimeError::Engine("sampled tree acceptance needs the target's logits".into())
        })?;
        let vocab = logits.first().map_or(0, Vec::len);
        match rule {
            Acceptance::TokenMatch => {
                // The target samples its own token at every node; drafts only guess them, so
                // the committed tokens are exactly target samples.
                let sampled: Vec<u32> = logits
                    .iter()
                    .map(|r| sampling::sample(&sampling::probs(r, params), rng))
                    .collect();
                accept::greedy_tree(&tree.tokens, &sampled, paths)
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

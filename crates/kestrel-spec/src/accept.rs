//! Acceptance rules on plain slices.
//!
//! Tree rules take node tokens (`tree_tokens[0]` = root) and per-node target outputs, where
//! the target output at node `i` is the distribution of the token that FOLLOWS node `i`.
//! A node is accepted when its parent is accepted and its token agrees with (or is accepted
//! against) the target output at its parent. Every rule returns the accepted nodes (root
//! first: the KV slots to keep) and one extra token from the target (the "bonus").
//!
//! | rule | lossless | reference |
//! |---|---|---|
//! | [`greedy_tree`] | = greedy decoding | EAGLE/Medusa `evaluate_posterior` (greedy) |
//! | [`typical_tree`] | no (typical-truncated) | TensorRT-LLM `eagle_posterior_threshold` |
//! | [`exact_tree_sampling`] | yes | SpecInfer / EAGLE `evaluate_posterior` (sampling) |
//! | [`draft_target`] | yes | Leviathan et al. 2023 speculative sampling |
//! | [`draft_target_token_match`] | = target sampling | TensorRT-LLM `use_logits=False` |

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::sampling::{argmax, normalise, sample_f64, softmax_f64, SeqRng, GREEDY_TEMPERATURE};
use crate::tree::TreeBuffers;

/// Why an acceptance call was refused (inconsistent inputs from the caller).
#[derive(Debug, Clone, PartialEq, Error)]
pub enum AcceptError {
    #[error("{what} has {got} entries, expected {expected}")]
    Length {
        what: &'static str,
        got: usize,
        expected: usize,
    },
    #[error("vocab_size must be at least 1")]
    EmptyVocab,
    #[error(
        "retrieve path #{path} refers to node {node}, but the tree has only {num_nodes} nodes"
    )]
    NodeOutOfRange {
        path: usize,
        node: usize,
        num_nodes: usize,
    },
    #[error("retrieve path #{path} does not start at the root (node 0)")]
    PathNotFromRoot { path: usize },
    #[error("token {token} at {what} {index} is outside the vocabulary of {vocab_size} tokens")]
    TokenOutOfVocab {
        what: &'static str,
        index: usize,
        token: u32,
        vocab_size: usize,
    },
    #[error("{what} row {row} is not a distribution: it has a negative or non-finite entry or sums to 0")]
    BadDistribution { what: &'static str, row: usize },
    #[error("draft token {token} at tree node {node} has zero draft probability at its parent node {parent}: pass the draft distribution its children were sampled from, without duplicate siblings")]
    ZeroDraftProbTree {
        node: usize,
        parent: usize,
        token: u32,
    },
    #[error("draft token {token} at chain position {position} has zero draft probability: pass the draft distribution it was sampled from")]
    ZeroDraftProbChain { position: usize, token: u32 },
}

/// The outcome of a tree acceptance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeAcceptance {
    /// Index of a retrieve path containing the accepted nodes (the first such path).
    pub path_index: usize,
    /// Accepted nodes, root first (`accepted_len + 1` entries): the KV slots to keep, in order.
    pub accepted_nodes: Vec<usize>,
    /// Number of accepted draft tokens (the root excluded).
    pub accepted_len: usize,
    /// The target's token after the last accepted node.
    pub bonus_token: u32,
    /// Tokens to append to the sequence: the accepted draft tokens, then the bonus.
    pub tokens: Vec<u32>,
}

/// The outcome of a chain (draft-target) acceptance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChainAcceptance {
    /// Number of accepted draft tokens.
    pub accepted_len: usize,
    /// Tokens to append: the accepted drafts, then the correction (on rejection) or the bonus
    /// (all accepted); `accepted_len + 1` entries.
    pub tokens: Vec<u32>,
}

impl TreeAcceptance {
    /// The outcome of a walk from the root that accepted `accepted_nodes` (root first, each a
    /// child of the one before) and drew `bonus_token` after them, as
    /// [`exact_tree_sampling`] (or a device doing its walk) ends.
    pub fn from_walk(
        tree: &TreeBuffers,
        tree_tokens: &[u32],
        accepted_nodes: Vec<usize>,
        bonus_token: u32,
    ) -> Self {
        let accepted_len = accepted_nodes.len().saturating_sub(1);
        let path_index = tree
            .retrieve_paths()
            .iter()
            .position(|path| path.starts_with(&accepted_nodes))
            .unwrap_or(0);
        let mut tokens: Vec<u32> = accepted_nodes
            .iter()
            .skip(1)
            .map(|&i| tree_tokens[i])
            .collect();
        tokens.push(bonus_token);
        TreeAcceptance {
            path_index,
            accepted_nodes,
            accepted_len,
            bonus_token,
            tokens,
        }
    }
}

impl ChainAcceptance {
    /// How many uniforms [`draft_target`] drew for this outcome of `k` drafts: a test per
    /// draft up to and including the first rejection, then one draw (the residual's or the
    /// bonus's). A caller that draws the tests elsewhere (on a device, from `k + 1` uniforms
    /// taken ahead from a copy of the stream) advances the stream by this much to leave it
    /// where the host would.
    pub fn speculative_uniforms(&self, k: usize) -> usize {
        (self.accepted_len + 1).min(k) + 1
    }
}

fn check_paths(paths: &[Vec<usize>], num_nodes: usize) -> Result<(), AcceptError> {
    for (pi, path) in paths.iter().enumerate() {
        if path.first() != Some(&0) {
            return Err(AcceptError::PathNotFromRoot { path: pi });
        }
        if let Some(&node) = path.iter().find(|&&n| n >= num_nodes) {
            return Err(AcceptError::NodeOutOfRange {
                path: pi,
                node,
                num_nodes,
            });
        }
    }
    Ok(())
}

fn check_len(what: &'static str, got: usize, expected: usize) -> Result<(), AcceptError> {
    if got != expected {
        return Err(AcceptError::Length {
            what,
            got,
            expected,
        });
    }
    Ok(())
}

/// Longest-path matching against one target token per node (shared by greedy and typical).
fn match_paths(
    tree_tokens: &[u32],
    target: &[u32],
    paths: &[Vec<usize>],
) -> Result<TreeAcceptance, AcceptError> {
    check_len("target tokens", target.len(), tree_tokens.len())?;
    if tree_tokens.is_empty() {
        return Err(AcceptError::Length {
            what: "tree tokens",
            got: 0,
            expected: 1,
        });
    }
    check_paths(paths, tree_tokens.len())?;
    let mut best = (0usize, 0usize); // (path, accepted_len)
    for (pi, path) in paths.iter().enumerate() {
        let len = path
            .windows(2)
            .take_while(|w| tree_tokens[w[1]] == target[w[0]])
            .count();
        if len > best.1 {
            best = (pi, len);
        }
    }
    let (path_index, accepted_len) = best;
    let accepted_nodes: Vec<usize> = match paths.get(path_index) {
        Some(p) => p[..=accepted_len].to_vec(),
        None => vec![0],
    };
    let last = *accepted_nodes.last().unwrap_or(&0);
    let bonus_token = target[last];
    let mut tokens: Vec<u32> = accepted_nodes[1..]
        .iter()
        .map(|&n| tree_tokens[n])
        .collect();
    tokens.push(bonus_token);
    Ok(TreeAcceptance {
        path_index,
        accepted_nodes,
        accepted_len,
        bonus_token,
        tokens,
    })
}

/// Greedy tree acceptance (EAGLE `evaluate_posterior`, greedy): the longest retrieve path
/// whose tokens equal the target's argmax at their parents (first such path on ties); bonus =
/// the target argmax at the last accepted node. `target_argmax[i]` is the target's argmax
/// after node `i`.
pub fn greedy_tree(
    tree_tokens: &[u32],
    target_argmax: &[u32],
    retrieve_paths: &[Vec<usize>],
) -> Result<TreeAcceptance, AcceptError> {
    match_paths(tree_tokens, target_argmax, retrieve_paths)
}

/// TensorRT-LLM typical acceptance parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TypicalParams {
    /// ε (`--eagle_posterior_threshold`); TensorRT-LLM's default is 0.09.
    pub posterior_threshold: f32,
    /// Temperature T; `< 1e-6` means greedy.
    pub temperature: f32,
}

impl TypicalParams {
    /// α = sqrt(ε).
    pub fn alpha(&self) -> f32 {
        self.posterior_threshold.max(0.0).sqrt()
    }
}

/// The typical-truncated distribution: p = softmax(logits / T), H = −Σ p ln p, tokens with
/// p < min(ε, α·exp(−H)) removed (the most likely token always kept), renormalised.
pub fn typical_probs(logits: &[f32], params: &TypicalParams) -> Vec<f32> {
    typical_probs_f64(logits, params)
        .into_iter()
        .map(|p| p as f32)
        .collect()
}

fn typical_probs_f64(logits: &[f32], params: &TypicalParams) -> Vec<f64> {
    let mut p = softmax_f64(logits, params.temperature);
    if p.is_empty() {
        return p;
    }
    let h: f64 = -p
        .iter()
        .filter(|&&x| x > 0.0)
        .map(|&x| x * x.ln())
        .sum::<f64>();
    let eps = params.posterior_threshold as f64;
    let thr = eps.min(params.alpha() as f64 * (-h).exp());
    let top = p
        .iter()
        .enumerate()
        .fold(0usize, |b, (i, &x)| if x > p[b] { i } else { b });
    for (i, x) in p.iter_mut().enumerate() {
        if *x < thr && i != top {
            *x = 0.0;
        }
    }
    normalise(&mut p);
    p
}

/// TensorRT-LLM typical acceptance: per node, one target token is drawn from
/// [`typical_probs`] of `target_logits` row (argmax when greedy); then the longest path whose
/// draft tokens equal the drawn tokens at their parents is accepted; bonus = the drawn token
/// at the last accepted node. `target_logits` is `tree_tokens.len() × vocab_size`, row-major.
/// Not distribution-preserving (by design).
pub fn typical_tree(
    tree_tokens: &[u32],
    target_logits: &[f32],
    vocab_size: usize,
    retrieve_paths: &[Vec<usize>],
    params: &TypicalParams,
    rng: &mut SeqRng,
) -> Result<TreeAcceptance, AcceptError> {
    if vocab_size == 0 {
        return Err(AcceptError::EmptyVocab);
    }
    check_len(
        "target logits",
        target_logits.len(),
        tree_tokens.len() * vocab_size,
    )?;
    let greedy = params.temperature < GREEDY_TEMPERATURE;
    let target: Vec<u32> = target_logits
        .chunks_exact(vocab_size)
        .map(|row| {
            if greedy {
                argmax(row)
            } else {
                sample_f64(&typical_probs_f64(row, params), rng)
            }
        })
        .collect();
    match_paths(tree_tokens, &target, retrieve_paths)
}

/// How the children of each expanded node were proposed, for [`exact_tree_sampling`].
#[derive(Debug, Clone, Copy)]
pub enum DraftProposal<'a> {
    /// Children drawn WITHOUT replacement from the draft distribution `q` at their parent, in
    /// rank order (rank 0 = first draw). `draft_probs` is `num_nodes × vocab_size`, row `i` =
    /// the full draft distribution at node `i` (rows of leaves are ignored). The children are
    /// tried while their ranks are 0, 1, 2, …; a missing rank ends the trials at that node
    /// (the skipped draw is unknown), which stays lossless.
    WithoutReplacement { draft_probs: &'a [f32] },
    /// Children fixed independently of the target's randomness (e.g. the draft's top-k, as in
    /// EAGLE-2 with `qx = 1`): accept child x with prob p(x), else zero p(x) and renormalise.
    Deterministic,
}

fn row_f64(
    what: &'static str,
    flat: &[f32],
    row: usize,
    vocab: usize,
) -> Result<Vec<f64>, AcceptError> {
    let r = &flat[row * vocab..(row + 1) * vocab];
    if r.iter().any(|x| !x.is_finite() || *x < 0.0) {
        return Err(AcceptError::BadDistribution { what, row });
    }
    let mut v: Vec<f64> = r.iter().map(|&x| x as f64).collect();
    let sum: f64 = v.iter().sum();
    if sum <= 0.0 {
        return Err(AcceptError::BadDistribution { what, row });
    }
    v.iter_mut().for_each(|x| *x /= sum);
    Ok(v)
}

/// p ← norm(max(0, p − q)); if that is all zero (p = q up to rounding), p is kept.
fn residual(p: &mut [f64], q: &[f64]) {
    let r: Vec<f64> = p.iter().zip(q).map(|(a, b)| (a - b).max(0.0)).collect();
    let sum: f64 = r.iter().sum();
    if sum > 1e-12 {
        p.iter_mut().zip(r).for_each(|(a, b)| *a = b / sum);
    }
}

fn check_tokens(what: &'static str, tokens: &[u32], vocab: usize) -> Result<(), AcceptError> {
    if let Some((index, &token)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(AcceptError::TokenOutOfVocab {
            what,
            index,
            token,
            vocab_size: vocab,
        });
    }
    Ok(())
}

/// Lossless multi-candidate tree rejection sampling (SpecInfer; EAGLE `evaluate_posterior`
/// sampling). From the root, at each accepted node with target distribution p (row of
/// `target_probs`, `num_nodes × vocab_size`, already warped) the children are tried in rank
/// order: with [`DraftProposal::WithoutReplacement`], child x is accepted with probability
/// min(1, p(x)/q(x)); on rejection p ← norm(max(0, p − q)) and q ← q with x zeroed,
/// renormalised. An accepted child becomes the current node. When no child is accepted (or
/// the node is a leaf) the bonus is drawn from the current (residual) p. The emitted tokens
/// are distributed exactly as sampling the target token by token.
pub fn exact_tree_sampling(
    tree: &TreeBuffers,
    tree_tokens: &[u32],
    target_probs: &[f32],
    vocab_size: usize,
    proposal: DraftProposal<'_>,
    rng: &mut SeqRng,
) -> Result<TreeAcceptance, AcceptError> {
    if vocab_size == 0 {
        return Err(AcceptError::EmptyVocab);
    }
    let n = tree.num_nodes();
    check_len("tree tokens", tree_tokens.len(), n)?;
    check_len("target probs", target_probs.len(), n * vocab_size)?;
    if let DraftProposal::WithoutReplacement { draft_probs } = proposal {
        check_len("draft probs", draft_probs.len(), n * vocab_size)?;
    }
    check_tokens("tree node", &tree_tokens[1..], vocab_size).map_err(|e| match e {
        AcceptError::TokenOutOfVocab {
            what,
            index,
            token,
            vocab_size,
        } => AcceptError::TokenOutOfVocab {
            what,
            index: index + 1,
            token,
            vocab_size,
        },
        other => other,
    })?;
    let mut node = 0usize;
    let mut accepted_nodes = vec![0usize];
    let bonus_token = 'walk: loop {
        let mut p = row_f64("target probs", target_probs, node, vocab_size)?;
        let children = tree.children(node);
        match proposal {
            DraftProposal::Deterministic => {
                for &c in children {
                    let x = tree_tokens[c] as usize;
                    if rng.uniform() < p[x] {
                        node = c;
                        accepted_nodes.push(c);
                        continue 'walk;
                    }
                    p[x] = 0.0;
                    normalise(&mut p);
                }
            }
            DraftProposal::WithoutReplacement { draft_probs } => {
                if !children.is_empty() {
                    let mut q = row_f64("draft probs", draft_probs, node, vocab_size)?;
                    for (expected_rank, &c) in children.iter().enumerate() {
                        if tree.ranks()[c] != expected_rank {
                            break;
                        }
                        let x = tree_tokens[c] as usize;
                        if q[x] <= 0.0 {
                            return Err(AcceptError::ZeroDraftProbTree {
                                node: c,
                                parent: node,
                                token: x as u32,
                            });
                        }
                        if rng.uniform() * q[x] < p[x] {
                            node = c;
                            accepted_nodes.push(c);
                            continue 'walk;
                        }
                        residual(&mut p, &q);
                        q[x] = 0.0;
                        let qs: f64 = q.iter().sum();
                        if qs <= 1e-12 {
                            break;
                        }
                        q.iter_mut().for_each(|v| *v /= qs);
                    }
                }
            }
        }
        break sample_f64(&p, rng);
    };
    Ok(TreeAcceptance::from_walk(
        tree,
        tree_tokens,
        accepted_nodes,
        bonus_token,
    ))
}

/// Draft-target speculative sampling (Leviathan et al. 2023) for a chain of γ drafts.
/// `draft_probs` is `γ × vocab_size` (row i = q_i that `draft_tokens[i]` was drawn from),
/// `target_probs` is `(γ + 1) × vocab_size` (row i = p_i at the same position, row γ for the
/// bonus). Accept x_i with probability min(1, p_i(x_i)/q_i(x_i)); on the first rejection draw
/// from norm(max(0, p_i − q_i)) and stop; if all are accepted draw the bonus from p_γ.
pub fn draft_target(
    draft_tokens: &[u32],
    draft_probs: &[f32],
    target_probs: &[f32],
    vocab_size: usize,
    rng: &mut SeqRng,
) -> Result<ChainAcceptance, AcceptError> {
    if vocab_size == 0 {
        return Err(AcceptError::EmptyVocab);
    }
    let gamma = draft_tokens.len();
    check_len("draft probs", draft_probs.len(), gamma * vocab_size)?;
    check_len("target probs", target_probs.len(), (gamma + 1) * vocab_size)?;
    check_tokens("draft position", draft_tokens, vocab_size)?;
    let mut tokens = Vec::with_capacity(gamma + 1);
    for (i, &x) in draft_tokens.iter().enumerate() {
        let mut p = row_f64("target probs", target_probs, i, vocab_size)?;
        let q = row_f64("draft probs", draft_probs, i, vocab_size)?;
        let xi = x as usize;
        if q[xi] <= 0.0 {
            return Err(AcceptError::ZeroDraftProbChain {
                position: i,
                token: x,
            });
        }
        if rng.uniform() * q[xi] < p[xi] {
            tokens.push(x);
            continue;
        }
        residual(&mut p, &q);
        tokens.push(sample_f64(&p, rng));
        return Ok(ChainAcceptance {
            accepted_len: i,
            tokens,
        });
    }
    let p = row_f64("target probs", target_probs, gamma, vocab_size)?;
    tokens.push(sample_f64(&p, rng));
    Ok(ChainAcceptance {
        accepted_len: gamma,
        tokens,
    })
}

/// Token-match draft-target acceptance (TensorRT-LLM `use_logits=False`; greedy speculative
/// decoding): accept drafts while they equal the target's own token at the same position
/// (`target_tokens`, γ + 1 entries: argmax or the target's sample); the next token is the
/// target's token at the first mismatch (or position γ).
pub fn draft_target_token_match(
    draft_tokens: &[u32],
    target_tokens: &[u32],
) -> Result<ChainAcceptance, AcceptError> {
    check_len("target tokens", target_tokens.len(), draft_tokens.len() + 1)?;
    let accepted_len = draft_tokens
        .iter()
        .zip(target_tokens)
        .take_while(|(d, t)| d == t)
        .count();
    Ok(ChainAcceptance {
        accepted_len,
        tokens: target_tokens[..=accepted_len].to_vec(),
    })
}

#[cfg(test)]
mod tests;

//! EAGLE-2 dynamic tree expansion (TensorRT-LLM `--eagle_use_dynamic_tree
//! --eagle_dynamic_tree_max_top_k N`; EAGLE repo `cnets1.py::topK_genrate`).
//!
//! Protocol, with `N = top_k` and `L = num_layers` (the engine's EAGLE layers):
//! 1. [`DynamicTreeBuilder::push_root_layer`]: layer 0, the root's top-N tokens and their
//!    log-probs. These N candidates are the first frontier.
//! 2. For layers `1..L`: the caller runs the draft on [`DynamicTreeBuilder::frontier`] (N
//!    candidates, best first) and calls [`DynamicTreeBuilder::push_layer`] with, for frontier
//!    row `i`, that node's top-N children (`tokens[i*N..(i+1)*N]`, `logp[...]`, child rank =
//!    column). Each child's score is its parent's score plus its log-prob. All N² children are
//!    kept as candidates; the next frontier is the global top N of this layer by score.
//! 3. [`DynamicTreeBuilder::finish`]: the top `min(N + N²(L−1), max_draft_len)` candidates by
//!    score (ties broken by creation order, earlier first) re-sorted into creation order, as a
//!    tree with the root token first.
//!
//! Log-probs must be ≤ 0 (log-softmax values), so a child never outranks its parent and the
//! selection is closed under ancestors.
//!
//! With `min_prob` p > 0, a candidate whose cumulative draft probability is below p is
//! neither expanded nor verified (a confidence gate: where the draft is unsure, its rows cost
//! more than they are likely to return). Since scores never increase along a path, this is
//! exactly the ungated tree's nodes of score ≥ ln p, found without expanding any node below
//! it; a step may draft nothing and verify the root alone, a plain decode step.

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::tree::TreeBuffers;

/// Log-probs up to this much above 0 are rounding noise and are clamped to 0.
const LOGP_SLACK: f32 = 1e-4;

/// Why an EAGLE-2 configuration or layer was refused.
#[derive(Debug, Clone, PartialEq, Error)]
pub enum DynamicTreeError {
    #[error("eagle_dynamic_tree_max_top_k must be at least 1")]
    ZeroTopK,
    #[error("eagle_dynamic_tree_max_top_k = {top_k} exceeds max_non_leaves_per_layer = {max_non_leaves_per_layer} of the engine: lower the top-k or rebuild with --max_non_leaves_per_layer {top_k}")]
    TopKAboveNonLeaves {
        top_k: usize,
        max_non_leaves_per_layer: usize,
    },
    #[error("eagle_dynamic_tree_max_top_k = {top_k} exceeds max_draft_len = {max_draft_len} of the engine: lower the top-k or rebuild with --max_draft_len {top_k}")]
    TopKAboveDraftLen { top_k: usize, max_draft_len: usize },
    #[error("num_eagle_layers must be at least 1 for an EAGLE-2 dynamic tree")]
    ZeroLayers,
    #[error("EAGLE-2 layer 0 (the root's top-k) has already been pushed")]
    RootTwice,
    #[error("EAGLE-2 layer 0 (the root's top-k) must be pushed before layer {layer}")]
    NoRoot { layer: usize },
    #[error("EAGLE-2 tree already has all {num_layers} layers (num_eagle_layers): call finish")]
    TooManyLayers { num_layers: usize },
    #[error("EAGLE-2 layer {layer}: got {tokens} tokens and {logp} log-probs, expected {expected} of each ({rows} × top_k {top_k})")]
    LayerShape {
        layer: usize,
        tokens: usize,
        logp: usize,
        expected: usize,
        rows: usize,
        top_k: usize,
    },
    #[error("EAGLE-2 layer {layer}: log-prob {logp} of token {token} (frontier row {row}, rank {rank}) is NaN or positive: pass log-softmax values (<= 0)")]
    BadLogProb {
        layer: usize,
        row: usize,
        rank: usize,
        token: u32,
        logp: f32,
    },
    #[error("EAGLE-2 tree has no layers yet: push layer 0 (the root's top-k) before finish")]
    Empty,
    #[error("eagle_dynamic_tree_min_prob must be a probability in [0, 1], got {min_prob}")]
    MinProb { min_prob: f32 },
}

/// EAGLE-2 parameters and the engine limits they are checked against.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct DynamicTreeConfig {
    /// N: children per expanded node, and frontier size.
    pub top_k: usize,
    /// L: number of draft layers (EagleNet0 + L−1 expansions).
    pub num_layers: usize,
    /// Maximum number of draft nodes in the final tree.
    pub max_draft_len: usize,
    /// Engine limit that N must not exceed.
    pub max_non_leaves_per_layer: usize,
    /// Candidates whose cumulative draft probability is below this are neither expanded nor
    /// verified (0: every candidate counts, EAGLE-2 as published).
    pub min_prob: f32,
}

impl DynamicTreeConfig {
    /// Checks `N ≥ 1`, `L ≥ 1`, `N ≤ max_non_leaves_per_layer`, `N ≤ max_draft_len`,
    /// `0 ≤ min_prob ≤ 1`.
    pub fn validate(&self) -> Result<(), DynamicTreeError> {
        if !(0.0..=1.0).contains(&self.min_prob) {
            return Err(DynamicTreeError::MinProb {
                min_prob: self.min_prob,
            });
        }
        if self.top_k == 0 {
            return Err(DynamicTreeError::ZeroTopK);
        }
        if self.top_k > self.max_non_leaves_per_layer {
            return Err(DynamicTreeError::TopKAboveNonLeaves {
                top_k: self.top_k,
                max_non_leaves_per_layer: self.max_non_leaves_per_layer,
            });
        }
        if self.top_k > self.max_draft_len {
            return Err(DynamicTreeError::TopKAboveDraftLen {
                top_k: self.top_k,
                max_draft_len: self.max_draft_len,
            });
        }
        if self.num_layers == 0 {
            return Err(DynamicTreeError::ZeroLayers);
        }
        Ok(())
    }
    /// `N + N²(L−1)`: candidates recorded over all layers.
    pub fn num_candidates(&self) -> usize {
        self.top_k + self.top_k * self.top_k * self.num_layers.saturating_sub(1)
    }
    /// `min(N + N²(L−1), max_draft_len)`: the most draft nodes in the final tree.
    pub fn num_selected(&self) -> usize {
        self.num_candidates().min(self.max_draft_len)
    }
    /// The lowest score (cumulative log-prob) a candidate may have to count.
    fn min_score(&self) -> f32 {
        self.min_prob.ln()
    }
}

/// One scored draft token.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    pub token: u32,
    /// Cumulative log-prob from the root.
    pub score: f32,
    /// Parent candidate id (`None` = child of the root).
    pub parent: Option<usize>,
    /// Depth from the root (layer 0 candidates have depth 1).
    pub depth: usize,
    /// Column in the parent's top-N (0 = best).
    pub rank: usize,
}

/// Incremental EAGLE-2 expansion; see the module docs for the protocol.
#[derive(Debug, Clone)]
pub struct DynamicTreeBuilder {
    cfg: DynamicTreeConfig,
    candidates: Vec<Candidate>,
    frontier: Vec<usize>,
    layers: usize,
}

impl DynamicTreeBuilder {
    /// Validates `cfg` and starts an empty tree.
    pub fn new(cfg: DynamicTreeConfig) -> Result<Self, DynamicTreeError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            candidates: Vec::with_capacity(cfg.num_candidates()),
            frontier: Vec::new(),
            layers: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &DynamicTreeConfig {
        &self.cfg
    }
    /// All candidates so far, in creation order (their ids are indices here).
    pub fn candidates(&self) -> &[Candidate] {
        &self.candidates
    }
    /// Candidate ids of the current frontier, best score first: the nodes to feed to the
    /// draft next. Row `i` of the next [`Self::push_layer`] holds `frontier()[i]`'s children.
    pub fn frontier(&self) -> &[usize] {
        &self.frontier
    }
    /// Layers pushed so far.
    pub fn layers_done(&self) -> usize {
        self.layers
    }
    /// Whether all `num_layers` layers were pushed.
    pub fn is_complete(&self) -> bool {
        self.layers == self.cfg.num_layers
    }
    /// Ancestor chain of candidate `id`, from its depth-1 ancestor down to `id` itself (for
    /// draft-time attention masks).
    pub fn ancestors(&self, id: usize) -> Vec<usize> {
        let mut chain = Vec::new();
        let mut cur = Some(id);
        while let Some(c) = cur {
            if c >= self.candidates.len() {
                break;
            }
            chain.push(c);
            cur = self.candidates[c].parent;
        }
        chain.reverse();
        chain
    }

    fn check_logp(
        layer: usize,
        row: usize,
        rank: usize,
        token: u32,
        logp: f32,
    ) -> Result<f32, DynamicTreeError> {
        if logp.is_nan() || logp > LOGP_SLACK {
            return Err(DynamicTreeError::BadLogProb {
                layer,
                row,
                rank,
                token,
                logp,
            });
        }
        Ok(logp.min(0.0))
    }

    /// Layer 0: the root's top-N tokens and log-probs.
    pub fn push_root_layer(
        &mut self,
        tokens: &[u32],
        logp: &[f32],
    ) -> Result<(), DynamicTreeError> {
        if self.layers > 0 {
            return Err(DynamicTreeError::RootTwice);
        }
        let n = self.cfg.top_k;
        if tokens.len() != n || logp.len() != n {
            return Err(DynamicTreeError::LayerShape {
                layer: 0,
                tokens: tokens.len(),
                logp: logp.len(),
                expected: n,
                rows: 1,
                top_k: n,
            });
        }
        let mut new = Vec::with_capacity(n);
        for (rank, (&token, &lp)) in tokens.iter().zip(logp).enumerate() {
            let score = Self::check_logp(0, 0, rank, token, lp)?;
            new.push(Candidate {
                token,
                score,
                parent: None,
                depth: 1,
                rank,
            });
        }
        self.candidates = new;
        self.frontier = top_ids(&self.candidates, 0..n, n, self.cfg.min_score());
        self.layers = 1;
        Ok(())
    }

    /// Layers `1..L`: for each frontier row `i`, its top-N children in
    /// `tokens[i*N..(i+1)*N]` / `logp[i*N..(i+1)*N]` (column = rank).
    pub fn push_layer(&mut self, tokens: &[u32], logp: &[f32]) -> Result<(), DynamicTreeError> {
        let layer = self.layers;
        if layer == 0 {
            return Err(DynamicTreeError::NoRoot { layer: 1 });
        }
        if layer >= self.cfg.num_layers {
            return Err(DynamicTreeError::TooManyLayers {
                num_layers: self.cfg.num_layers,
            });
        }
        let n = self.cfg.top_k;
        let rows = self.frontier.len();
        let expected = rows * n;
        if tokens.len() != expected || logp.len() != expected {
            return Err(DynamicTreeError::LayerShape {
                layer,
                tokens: tokens.len(),
                logp: logp.len(),
                expected,
                rows,
                top_k: n,
            });
        }
        let mut new = Vec::with_capacity(expected);
        for (row, &parent) in self.frontier.iter().enumerate() {
            let p = self.candidates[parent];
            for rank in 0..n {
                let k = row * n + rank;
                let lp = Self::check_logp(layer, row, rank, tokens[k], logp[k])?;
                new.push(Candidate {
                    token: tokens[k],
                    score: p.score + lp,
                    parent: Some(parent),
                    depth: p.depth + 1,
                    rank,
                });
            }
        }
        let start = self.candidates.len();
        self.candidates.extend(new);
        self.frontier = top_ids(
            &self.candidates,
            start..self.candidates.len(),
            n,
            self.cfg.min_score(),
        );
        self.layers += 1;
        Ok(())
    }

    /// Final rerank: the top `min(#candidates, max_draft_len)` candidates (at most
    /// `N + N²(L−1)`) as a tree whose root carries `root_token`. May be called before all
    /// layers were pushed (a shallower tree).
    pub fn finish(&self, root_token: u32) -> Result<DynamicTree, DynamicTreeError> {
        if self.layers == 0 {
            return Err(DynamicTreeError::Empty);
        }
        let m = self.candidates.len().min(self.cfg.max_draft_len);
        let mut chosen = top_ids(
            &self.candidates,
            0..self.candidates.len(),
            m,
            self.cfg.min_score(),
        );
        // Creation order is topological (parents are created before children). Scores never
        // increase along a path and ties favour the earlier id, so the set is closed under
        // ancestors; drop any orphan defensively (cannot happen with valid input).
        chosen.sort_unstable();
        let mut node_of = vec![usize::MAX; self.candidates.len()];
        let mut parents = vec![None];
        let mut ranks = vec![0];
        let mut tokens = vec![root_token];
        let mut scores = vec![0.0];
        let mut ids = vec![None];
        for &id in &chosen {
            let c = &self.candidates[id];
            let parent_node = match c.parent {
                None => 0,
                Some(p) if node_of[p] != usize::MAX => node_of[p],
                Some(_) => continue,
            };
            node_of[id] = parents.len();
            parents.push(Some(parent_node));
            ranks.push(c.rank);
            tokens.push(c.token);
            scores.push(c.score);
            ids.push(Some(id));
        }
        Ok(DynamicTree {
            tokens,
            scores,
            candidate_ids: ids,
            buffers: TreeBuffers::from_parents(parents, ranks),
        })
    }
}

/// The `k` best ids in `range` by (score desc, id asc), best first, of those scoring at
/// least `min_score`.
fn top_ids(c: &[Candidate], range: std::ops::Range<usize>, k: usize, min_score: f32) -> Vec<usize> {
    let mut ids: Vec<usize> = range.filter(|&i| c[i].score >= min_score).collect();
    ids.sort_by(|&a, &b| c[b].score.total_cmp(&c[a].score).then(a.cmp(&b)));
    ids.truncate(k);
    ids
}

/// A finished EAGLE-2 tree: node 0 is the root.
#[derive(Debug, Clone, PartialEq)]
pub struct DynamicTree {
    /// Token per node (root first).
    pub tokens: Vec<u32>,
    /// Cumulative log-prob per node (root 0).
    pub scores: Vec<f32>,
    /// Candidate id per node (`None` for the root).
    pub candidate_ids: Vec<Option<usize>>,
    buffers: TreeBuffers,
}

impl DynamicTree {
    /// Parents, depths, ancestor mask, retrieve paths (same layout as static trees).
    pub fn buffers(&self) -> &TreeBuffers {
        &self.buffers
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn cfg(n: usize, l: usize, max_draft_len: usize) -> DynamicTreeConfig {
        DynamicTreeConfig {
            top_k: n,
            num_layers: l,
            max_draft_len,
            max_non_leaves_per_layer: 10,
            min_prob: 0.0,
        }
    }

    #[test]
    fn config_errors() {
        let e = |c: DynamicTreeConfig| c.validate().unwrap_err().to_string();
        assert_eq!(
            e(cfg(0, 4, 63)),
            "eagle_dynamic_tree_max_top_k must be at least 1"
        );
        assert_eq!(
            e(cfg(11, 4, 63)),
            "eagle_dynamic_tree_max_top_k = 11 exceeds max_non_leaves_per_layer = 10 of the engine: lower the top-k or rebuild with --max_non_leaves_per_layer 11"
        );
        assert_eq!(
            e(cfg(8, 4, 5)),
            "eagle_dynamic_tree_max_top_k = 8 exceeds max_draft_len = 5 of the engine: lower the top-k or rebuild with --max_draft_len 8"
        );
        assert_eq!(
            e(cfg(2, 0, 5)),
            "num_eagle_layers must be at least 1 for an EAGLE-2 dynamic tree"
        );
        assert_eq!(cfg(10, 4, 63).num_candidates(), 310);
        assert_eq!(cfg(10, 4, 63).num_selected(), 63);
        assert_eq!(cfg(2, 3, 63).num_selected(), 10);
    }

    #[test]
    fn protocol_errors() {
        let mut b = DynamicTreeBuilder::new(cfg(2, 2, 10)).unwrap();
        assert_eq!(
            b.finish(0).unwrap_err().to_string(),
            "EAGLE-2 tree has no layers yet: push layer 0 (the root's top-k) before finish"
        );
        assert_eq!(
            b.push_layer(&[1, 2, 3, 4], &[0.0; 4])
                .unwrap_err()
                .to_string(),
            "EAGLE-2 layer 0 (the root's top-k) must be pushed before layer 1"
        );
        assert_eq!(
            b.push_root_layer(&[1], &[0.0]).unwrap_err().to_string(),
            "EAGLE-2 layer 0: got 1 tokens and 1 log-probs, expected 2 of each (1 × top_k 2)"
        );
        assert_eq!(
            b.push_root_layer(&[1, 2], &[-0.1, 0.5]).unwrap_err().to_string(),
            "EAGLE-2 layer 0: log-prob 0.5 of token 2 (frontier row 0, rank 1) is NaN or positive: pass log-softmax values (<= 0)"
        );
        b.push_root_layer(&[1, 2], &[-0.1, -0.2]).unwrap();
        assert_eq!(
            b.push_root_layer(&[1, 2], &[-0.1, -0.2])
                .unwrap_err()
                .to_string(),
            "EAGLE-2 layer 0 (the root's top-k) has already been pushed"
        );
        b.push_layer(&[3, 4, 5, 6], &[-0.1; 4]).unwrap();
        assert_eq!(
            b.push_layer(&[3, 4, 5, 6], &[-0.1; 4])
                .unwrap_err()
                .to_string(),
            "EAGLE-2 tree already has all 2 layers (num_eagle_layers): call finish"
        );
    }

    #[test]
    fn worked_example() {
        // N = 2, L = 3, max_draft_len 5.
        let mut b = DynamicTreeBuilder::new(cfg(2, 3, 5)).unwrap();
        let ln = |p: f32| p.ln();
        b.push_root_layer(&[10, 11], &[ln(0.6), ln(0.3)]).unwrap(); // ids 0 (0.6), 1 (0.3)
        assert_eq!(b.frontier(), &[0, 1]);
        // Children of 0: 20 (0.6*0.9=.54), 21 (0.6*0.05=.03); of 1: 22 (0.3*0.5=.15), 23 (.3*.4=.12)
        b.push_layer(&[20, 21, 22, 23], &[ln(0.9), ln(0.05), ln(0.5), ln(0.4)])
            .unwrap(); // ids 2,3,4,5
        assert_eq!(b.frontier(), &[2, 4]);
        // Children of 2 (.54): 30 (.54*.5=.27), 31 (.54*.1=.054); of 4 (.15): 32 (.15*.9=.135), 33 (.015)
        b.push_layer(&[30, 31, 32, 33], &[ln(0.5), ln(0.1), ln(0.9), ln(0.1)])
            .unwrap(); // ids 6..9
        assert!(b.is_complete());
        assert_eq!(b.ancestors(8), vec![1, 4, 8]);
        // Scores: 0:.6 1:.3 2:.54 3:.03 4:.15 5:.12 6:.27 7:.054 8:.135 9:.015
        // Top 5: 0 (.6), 2 (.54), 1 (.3), 6 (.27), 4 (.15) → creation order 0,1,2,4,6.
        let t = b.finish(99).unwrap();
        assert_eq!(t.tokens, vec![99, 10, 11, 20, 22, 30]);
        assert_eq!(
            t.candidate_ids,
            vec![None, Some(0), Some(1), Some(2), Some(4), Some(6)]
        );
        let buf = t.buffers();
        assert_eq!(
            buf.parents(),
            &[None, Some(0), Some(0), Some(1), Some(2), Some(3)]
        );
        assert_eq!(buf.depths(), &[0, 1, 1, 2, 2, 3]);
        assert_eq!(buf.ranks(), &[0, 0, 1, 0, 0, 0]);
        assert_eq!(buf.retrieve_paths(), &[vec![0, 1, 3, 5], vec![0, 2, 4]]);
    }

    #[test]
    fn ties_break_by_creation_order() {
        let mut b = DynamicTreeBuilder::new(cfg(2, 2, 3)).unwrap();
        b.push_root_layer(&[1, 2], &[-1.0, -1.0]).unwrap();
        assert_eq!(b.frontier(), &[0, 1]);
        b.push_layer(&[3, 4, 5, 6], &[0.0, -1.0, 0.0, -1.0])
            .unwrap();
        // ids 2 (-1), 3 (-2), 4 (-1), 5 (-2): frontier 2, 4.
        assert_eq!(b.frontier(), &[2, 4]);
        // Top 3 of 0(-1),1(-1),2(-1),4(-1): ids 0,1,2.
        let t = b.finish(0).unwrap();
        assert_eq!(t.candidate_ids, vec![None, Some(0), Some(1), Some(2)]);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn selection_is_global_top_and_a_valid_tree(
            n in 1usize..4, l in 1usize..4, max_draft_len in 1usize..40,
            seed_logps in proptest::collection::vec(-6.0f32..0.0, 64),
        ) {
            prop_assume!(n <= max_draft_len);
            let mut b = DynamicTreeBuilder::new(cfg(n, l, max_draft_len)).unwrap();
            let mut k = 0usize;
            let mut next = |count: usize| -> (Vec<u32>, Vec<f32>) {
                let toks: Vec<u32> = (0..count).map(|i| (k + i) as u32).collect();
                let lps: Vec<f32> = (0..count).map(|i| seed_logps[(k + i) % 64]).collect();
                k += count;
                (toks, lps)
            };
            let (t, lp) = next(n);
            b.push_root_layer(&t, &lp).unwrap();
            for _ in 1..l {
                let (t, lp) = next(n * n);
                b.push_layer(&t, &lp).unwrap();
            }
            let tree = b.finish(u32::MAX).unwrap();
            let c = b.candidates();
            prop_assert_eq!(c.len(), b.config().num_candidates());
            let m = b.config().num_selected();
            prop_assert_eq!(tree.tokens.len(), m + 1);
            // The selected set = the m best by (score desc, id asc).
            let mut all: Vec<usize> = (0..c.len()).collect();
            all.sort_by(|&a, &bb| c[bb].score.total_cmp(&c[a].score).then(a.cmp(&bb)));
            let mut want: Vec<usize> = all[..m].to_vec();
            want.sort_unstable();
            let got: Vec<usize> = tree.candidate_ids[1..].iter().map(|x| x.unwrap()).collect();
            prop_assert_eq!(got, want);
            // Structure matches the candidates.
            let buf = tree.buffers();
            for i in 1..buf.num_nodes() {
                let id = tree.candidate_ids[i].unwrap();
                prop_assert_eq!(buf.depths()[i], c[id].depth);
                let p = buf.parents()[i].unwrap();
                prop_assert!(p < i);
                prop_assert_eq!(tree.candidate_ids[p], c[id].parent);
            }
        }

        #[test]
        fn a_gated_tree_is_the_ungated_one_above_the_gate(
            n in 1usize..4, l in 1usize..4, max_draft_len in 1usize..40,
            min_prob in 0.0f32..0.9,
            seed_logps in proptest::collection::vec(-3.0f32..0.0, 64),
        ) {
            prop_assume!(n <= max_draft_len);
            let ungated = grow(cfg(n, l, max_draft_len), &seed_logps);
            let gated = grow(
                DynamicTreeConfig { min_prob, ..cfg(n, l, max_draft_len) },
                &seed_logps,
            );
            let keep: Vec<usize> = (0..ungated.tokens.len())
                .filter(|&i| i == 0 || ungated.scores[i] >= min_prob.ln())
                .collect();
            let pick = |v: &[u32]| keep.iter().map(|&i| v[i]).collect::<Vec<_>>();
            prop_assert_eq!(&gated.tokens, &pick(&ungated.tokens));
            let depths: Vec<u32> = ungated.buffers().depths().iter().map(|&d| d as u32).collect();
            let gated_depths: Vec<u32> =
                gated.buffers().depths().iter().map(|&d| d as u32).collect();
            prop_assert_eq!(gated_depths, pick(&depths));
        }
    }

    /// Grows a tree whose children depend on their parent's token alone: node token t's
    /// rank-r child is `t * 4 + r + 1` with log-prob `logps[(t * 7 + r) % 64]`, so gated and
    /// ungated builders meet the same tree whatever each expands.
    fn grow(cfg: DynamicTreeConfig, logps: &[f32]) -> DynamicTree {
        let children = |parents: &[u32]| -> (Vec<u32>, Vec<f32>) {
            let mut toks = Vec::new();
            let mut lps = Vec::new();
            for &t in parents {
                for r in 0..cfg.top_k as u32 {
                    toks.push(t * 4 + r + 1);
                    lps.push(logps[((t * 7 + r) % 64) as usize]);
                }
            }
            (toks, lps)
        };
        let mut b = DynamicTreeBuilder::new(cfg).unwrap();
        let (t, lp) = children(&[0]);
        b.push_root_layer(&t, &lp).unwrap();
        for _ in 1..cfg.num_layers {
            let frontier: Vec<u32> = b
                .frontier()
                .iter()
                .map(|&c| b.candidates()[c].token)
                .collect();
            let (t, lp) = children(&frontier);
            b.push_layer(&t, &lp).unwrap();
        }
        b.finish(0).unwrap()
    }

    #[test]
    fn the_gate_keeps_what_the_draft_is_sure_of() {
        // The worked example's tree (N = 2, L = 3, max_draft_len 5) gated at 0.2: of its
        // nodes 0 (.6), 1 (.3), 2 (.54), 4 (.15), 6 (.27), node 4 and its child go.
        let ln = |p: f32| p.ln();
        let mut b = DynamicTreeBuilder::new(DynamicTreeConfig {
            min_prob: 0.2,
            ..cfg(2, 3, 5)
        })
        .unwrap();
        b.push_root_layer(&[10, 11], &[ln(0.6), ln(0.3)]).unwrap();
        assert_eq!(b.frontier(), &[0, 1]);
        b.push_layer(&[20, 21, 22, 23], &[ln(0.9), ln(0.05), ln(0.5), ln(0.4)])
            .unwrap(); // ids 2 (.54), 3 (.03), 4 (.15), 5 (.12)
        assert_eq!(b.frontier(), &[2], "only node 2 clears the gate");
        b.push_layer(&[30, 31], &[ln(0.5), ln(0.1)]).unwrap(); // ids 6 (.27), 7 (.054)
        assert_eq!(b.frontier(), &[6]);
        let t = b.finish(99).unwrap();
        assert_eq!(t.tokens, vec![99, 10, 11, 20, 30]);
        assert_eq!(
            t.buffers().parents(),
            &[None, Some(0), Some(0), Some(1), Some(3)]
        );
    }

    #[test]
    fn a_gate_nothing_clears_drafts_nothing() {
        let mut b = DynamicTreeBuilder::new(DynamicTreeConfig {
            min_prob: 0.5,
            ..cfg(2, 2, 5)
        })
        .unwrap();
        b.push_root_layer(&[10, 11], &[0.4f32.ln(), 0.3f32.ln()])
            .unwrap();
        assert!(b.frontier().is_empty());
        b.push_layer(&[], &[]).unwrap();
        let t = b.finish(7).unwrap();
        assert_eq!(t.tokens, vec![7]);
        assert_eq!(t.buffers().num_nodes(), 1);
        assert_eq!(t.buffers().retrieve_paths(), &[vec![0]]);
    }

    #[test]
    fn the_gate_must_be_a_probability() {
        for min_prob in [-0.1, 1.5, f32::NAN] {
            assert_eq!(
                DynamicTreeConfig {
                    min_prob,
                    ..cfg(2, 2, 5)
                }
                .validate()
                .unwrap_err()
                .to_string(),
                format!(
                    "eagle_dynamic_tree_min_prob must be a probability in [0, 1], got {min_prob}"
                )
            );
        }
    }
}

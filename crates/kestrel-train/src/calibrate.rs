//! Tree calibration: measure how often an EAGLE head's rank-r guess is the base model's
//! greedy token at each tree depth, then derive the static `eagle_choices` tree that
//! maximises the expected accepted length for a node budget (as Medusa derived its
//! `mc_sim_7b_63` tree from measured top-k accuracies).
//!
//! **Measurement.** On a prompt set the base model answers greedily (through the runtime,
//! [`crate::distill`]); the answer is the truth. At every decoding position n (the committed
//! tokens are `x_0..=x_n`, `x_n` being the tree's root) the head drafts a chain along the
//! *true* continuation, exactly as spec-run's drafter would along the tree path whose tokens
//! are right: its cache holds the committed pairs `(x_{t+1}, F_t)` for `t < n` (F = the base
//! model's final-normed hidden state), the root's output `o_0` predicts depth 1, and the
//! depth-j node `(x_{n+j}, o_{j-1})` at head position `n - 1 + j` gives `o_j`, which predicts
//! depth j + 1. At depth d we record the rank of `x_{n+d}` among the head's top-k (ranks
//! ordered as the runtime orders them: logit, then lower token id), or a miss. This gives
//! `p[d][r] = P(x_{n+d} is the head's rank-r candidate | the path to depth d - 1 was right)`.
//!
//! **Approximation.** A tree node given by ranks `(r_1, …, r_d)` is accepted when every
//! depth's true token is the candidate of that rank. We estimate that probability as
//! `Π p[i][r_i]` — Medusa's independence approximation: whether depth i is right is treated
//! as independent of the ranks the true tokens had at the depths above it. The expected
//! accepted length of a tree (tokens committed per verification step, the bonus token
//! included) is then `1 + Σ_nodes P(node)`.
//!
//! **Derivation.** Since `P(child) = P(parent) · p ≤ P(parent)`, the `N` nodes of largest
//! probability (ties broken shallower first) always contain each other's parents, so they
//! form a tree, and no tree of `N` nodes has a larger sum. A best-first walk from the root
//! that always adds the frontier node of largest probability picks exactly those nodes.

use crate::error::{file_err, invalid, Result};
use crate::step_cost::{fastest_tree, StepCosts};
use candle_core::Tensor;
use kestrel_core::plan::BuildLimits;
use kestrel_model::matvec::MAX_ROWS;
use kestrel_model::{EagleHead, EagleSeqInput, Llama, OutputRows, PagedKvCache, SeqId, SeqInput};
use kestrel_spec::tree::{parse_choices, preset, preset_names, TreeLimits, DEFAULT_MAX_TOP_K};
use kestrel_spec::EagleTree;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const DEFAULT_TOP_K: usize = 10;
pub const DEFAULT_MAX_DEPTH: usize = 6;
pub const DEFAULT_NUM_NODES: usize = 63;
pub const CALIBRATION_FORMAT: &str = "kestrel-eagle-calibration";
pub const CALIBRATION_VERSION: u32 = 1;

/// The tree limits spec-run validates `eagle_choices` against for an engine.
pub fn engine_tree_limits(limits: &BuildLimits) -> TreeLimits {
    TreeLimits {
        num_eagle_layers: limits.num_eagle_layers,
        max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
        max_draft_len: limits.max_draft_len,
        max_top_k: DEFAULT_MAX_TOP_K,
    }
}

/// What to measure and how large a tree to derive. `None` takes the default, lowered to the
/// engine's limit; a value given explicitly must fit the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BudgetFlags {
    pub top_k: Option<usize>,
    pub max_depth: Option<usize>,
    pub num_nodes: Option<usize>,
}

/// Checked settings of one calibration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeBudget {
    /// Ranks measured per depth (candidates per node).
    pub top_k: usize,
    /// Depths measured, and the deepest the tree may go.
    pub max_depth: usize,
    /// Draft nodes of the tree, the root excluded.
    pub num_nodes: usize,
    /// Expanded nodes allowed per depth.
    pub max_non_leaves_per_layer: usize,
}

impl TreeBudget {
    /// Resolves `flags` against the engine's tree limits; errors name the flag and the limit.
    pub fn resolve(flags: &BudgetFlags, limits: &TreeLimits) -> Result<Self> {
        let top_k = flags.top_k.unwrap_or(DEFAULT_TOP_K.min(limits.max_top_k));
        if top_k == 0 {
            return Err(invalid(
                "--top_k 0: measure at least the head's best guess (--top_k 1 or more)",
            ));
        }
        if top_k > limits.max_top_k {
            return Err(invalid(format!(
                "--top_k {top_k} exceeds max_top_k = {}: eagle_choices ranks must be below {} (spec-run drafts from the head's top {})",
                limits.max_top_k, limits.max_top_k, limits.max_top_k
            )));
        }
        let max_depth = match flags.max_depth {
            Some(0) => return Err(invalid("--max_depth 0: the tree needs depth 1 or more")),
            Some(d) if d > limits.num_eagle_layers => {
                return Err(invalid(format!(
                    "--max_depth {d} exceeds the engine's num_eagle_layers = {n}: the engine drafts at most {n} levels (pass --max_depth {n} or less, or convert the checkpoint with a larger --num_eagle_layers)",
                    n = limits.num_eagle_layers
                )))
            }
            Some(d) => d,
            None => DEFAULT_MAX_DEPTH.min(limits.num_eagle_layers),
        };
        let num_nodes = match flags.num_nodes {
            Some(0) => {
                return Err(invalid(
                    "--num_nodes 0: the tree needs at least one node (--num_nodes 1 or more)",
                ))
            }
            Some(n) if n > limits.max_draft_len => {
                return Err(invalid(format!(
                    "--num_nodes {n} exceeds the engine's max_draft_len = {m}: a tree has at most {m} draft nodes (pass --num_nodes {m} or less, or rebuild the engine with a larger spec-build --max_draft_len)",
                    m = limits.max_draft_len
                )))
            }
            Some(n) => n,
            None => DEFAULT_NUM_NODES.min(limits.max_draft_len),
        };
        if max_depth == 0 || num_nodes == 0 {
            return Err(invalid(format!(
                "the engine allows no tree (num_eagle_layers = {}, max_draft_len = {}): build it with --speculative_decoding_mode eagle",
                limits.num_eagle_layers, limits.max_draft_len
            )));
        }
        Ok(TreeBudget {
            top_k,
            max_depth,
            num_nodes,
            max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
        })
    }
}

/// Rank counts per depth, summed over the measured positions.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankTable {
    pub top_k: usize,
    pub max_depth: usize,
    /// `hits[d - 1][r]`: positions whose true depth-d token was the head's rank-r candidate.
    pub hits: Vec<Vec<u64>>,
    /// `samples[d - 1]`: positions that have a true depth-d token (the answer's last tokens
    /// have fewer depths ahead of them).
    pub samples: Vec<u64>,
    /// Sequences that contributed at least one position.
    pub sequences: usize,
}

impl RankTable {
    pub fn new(top_k: usize, max_depth: usize) -> Self {
        RankTable {
            top_k,
            max_depth,
            hits: vec![vec![0; top_k]; max_depth],
            samples: vec![0; max_depth],
            sequences: 0,
        }
    }

    /// Records one position at `depth` (1-based): the true token's rank, or `None` when it
    /// was not among the top-k.
    pub fn record(&mut self, depth: usize, rank: Option<usize>) {
        self.samples[depth - 1] += 1;
        if let Some(r) = rank.filter(|&r| r < self.top_k) {
            self.hits[depth - 1][r] += 1;
        }
    }

    /// Decoding positions measured (each has at least depth 1).
    pub fn positions(&self) -> u64 {
        self.samples.first().copied().unwrap_or(0)
    }

    /// `p[d - 1][r]`; zero at depths without samples.
    pub fn probs(&self) -> Vec<Vec<f64>> {
        self.hits
            .iter()
            .zip(&self.samples)
            .map(|(h, &n)| {
                h.iter()
                    .map(|&c| if n == 0 { 0.0 } else { c as f64 / n as f64 })
                    .collect()
            })
            .collect()
    }

    /// Per depth, the fraction of positions whose true token was outside the top-k.
    pub fn miss_rates(&self) -> Vec<f64> {
        self.hits
            .iter()
            .zip(&self.samples)
            .map(|(h, &n)| {
                if n == 0 {
                    0.0
                } else {
                    (n - h.iter().sum::<u64>()) as f64 / n as f64
                }
            })
            .collect()
    }
}

/// The rank of `token` in `row` as the runtime's top-k orders it (larger logit first, lower
/// token id first on ties), or `None` when it is not among the first `k`.
pub fn rank_of(row: &[f32], token: u32, k: usize) -> Option<usize> {
    let t = token as usize;
    let x = *row.get(t)?;
    let mut rank = 0;
    for (j, y) in row.iter().enumerate() {
        let before = match y.total_cmp(&x) {
            Ordering::Greater => true,
            Ordering::Equal => j < t,
            Ordering::Less => false,
        };
        if before {
            rank += 1;
            if rank >= k {
                return None;
            }
        }
    }
    Some(rank)
}

/// The rank of the true token at each depth (`ranks[d - 1]`, `None` = outside the top-k),
/// for each root of one sequence (`roots[n - prompt_len]`); the answer's last roots have
/// fewer depths ahead of them.
pub type SeqRanks = Vec<Vec<Option<usize>>>;

impl RankTable {
    /// Sums per-root ranks (from [`measure_ranks`]) into a table.
    pub fn from_ranks(top_k: usize, max_depth: usize, seqs: &[SeqRanks]) -> Self {
        let mut table = RankTable::new(top_k, max_depth);
        for roots in seqs {
            if !roots.is_empty() {
                table.sequences += 1;
            }
            for ranks in roots {
                for (d, &r) in ranks.iter().enumerate().take(max_depth) {
                    table.record(d + 1, r);
                }
            }
        }
        table
    }
}

/// Measures `p[d][r]` over `seqs` = `(prompt + greedy answer, prompt_len)`; see
/// [`measure_ranks`].
pub fn measure(
    base: &Llama,
    head: &EagleHead,
    seqs: &[(Vec<u32>, usize)],
    top_k: usize,
    max_depth: usize,
    batch_size: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<RankTable> {
    let ranks = measure_ranks(base, head, seqs, top_k, max_depth, batch_size, progress)?;
    Ok(RankTable::from_ranks(top_k, max_depth, &ranks))
}

/// For every position of every answer in `seqs` = `(prompt + greedy answer, prompt_len)`,
/// the head drafts along the true continuation (see the module docs) and the true token's
/// rank is recorded at each depth up to `max_depth`. Sequences are processed `batch_size` at
/// a time, one head forward per depth serving all of them; `progress(done, total)` is
/// called after each group.
pub fn measure_ranks(
    base: &Llama,
    head: &EagleHead,
    seqs: &[(Vec<u32>, usize)],
    top_k: usize,
    max_depth: usize,
    batch_size: usize,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<SeqRanks>> {
    if top_k == 0 || max_depth == 0 {
        return Err(invalid("calibration needs top_k ≥ 1 and max_depth ≥ 1"));
    }
    let vocab = base.config().vocab_size;
    for (i, (t, p)) in seqs.iter().enumerate() {
        if *p == 0 || *p > t.len() {
            return Err(invalid(format!(
                "sequence {i}: prompt length {p} must be between 1 and its {} tokens",
                t.len()
            )));
        }
        if let Some(&bad) = t.iter().find(|&&x| x as usize >= vocab) {
            return Err(invalid(format!(
                "sequence {i}: token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
    }
    let mut out = Vec::with_capacity(seqs.len());
    for group in seqs.chunks(batch_size.max(1)) {
        out.extend(measure_group(base, head, group, top_k, max_depth)?);
        progress(out.len(), seqs.len());
    }
    Ok(out)
}

/// One sequence's walk over its answer positions.
struct Walk<'a> {
    tokens: &'a [u32],
    /// `F_0..F_{len-2}`: the base model's feature at every position but the last.
    features: Tensor,
    head_seq: SeqId,
    /// The current root position n.
    root: usize,
    /// Committed pairs in the head cache.
    fed: usize,
}

impl Walk<'_> {
    /// The last root with a true token after it.
    fn last_root(&self) -> usize {
        self.tokens.len() - 2
    }
    /// Depths with a true token ahead of the current root.
    fn depths_ahead(&self) -> usize {
        self.tokens.len() - 1 - self.root
    }
}

const BLOCK: usize = 16;

fn measure_group(
    base: &Llama,
    head: &EagleHead,
    group: &[(Vec<u32>, usize)],
    k: usize,
    depth: usize,
) -> Result<Vec<SeqRanks>> {
    let mut ranks: Vec<SeqRanks> = vec![Vec::new(); group.len()];
    // Only answers of two tokens or more have a root followed by a true token.
    let useful: Vec<usize> = (0..group.len())
        .filter(|&i| group[i].0.len() >= group[i].1 + 2)
        .collect();
    if useful.is_empty() {
        return Ok(ranks);
    }
    let blocks: usize = useful
        .iter()
        .map(|&i| (group[i].0.len() + depth).div_ceil(BLOCK))
        .sum();
    let mut head_cache = head.new_cache(blocks + useful.len(), BLOCK)?;
    // One base cache for the group, reused sequence after sequence.
    let longest = useful.iter().map(|&i| group[i].0.len()).max().unwrap_or(0);
    let mut base_cache = base.new_cache(longest.div_ceil(BLOCK) + 1, BLOCK)?;
    let mut walks = Vec::with_capacity(useful.len());
    for &i in &useful {
        let (tokens, prompt_len) = &group[i];
        walks.push(Walk {
            tokens,
            features: features(base, head, &mut base_cache, tokens, *prompt_len)?,
            head_seq: head_cache.add_sequence(),
            root: *prompt_len,
            fed: 0,
        });
    }
    let mut live: Vec<usize> = (0..walks.len()).collect();
    while !live.is_empty() {
        // The head consumes the pairs committed since the last root, as spec-run's head does
        // after each step (here one pair per step; all of the prompt's at the first root).
        let pos: Vec<Vec<u32>> = live
            .iter()
            .map(|&i| (walks[i].fed as u32..walks[i].root as u32).collect())
            .collect();
        let mut inputs = Vec::with_capacity(live.len());
        for (&i, p) in live.iter().zip(&pos) {
            let w = &walks[i];
            inputs.push(EagleSeqInput {
                seq: w.head_seq,
                tokens: &w.tokens[w.fed + 1..=w.root],
                features: w.features.narrow(0, w.fed, w.root - w.fed)?,
                positions: p,
                mask: None,
                output_rows: OutputRows::Last,
            });
        }
        let out = head.forward(base, &inputs, &mut head_cache)?;
        drop(inputs);
        for &i in &live {
            walks[i].fed = walks[i].root;
        }
        // `cur[j]`: the output of live[j]'s chain node at the previous depth (the root first).
        let mut cur: Vec<Option<Tensor>> = (0..live.len())
            .map(|j| out.narrow(0, j, 1).map(Some))
            .collect::<candle_core::Result<_>>()?;
        let mut active: Vec<usize> = (0..live.len()).collect();
        for &i in &live {
            ranks[useful[i]].push(Vec::with_capacity(depth));
        }
        for d in 1..=depth {
            active.retain(|&j| walks[live[j]].depths_ahead() >= d);
            if active.is_empty() {
                break;
            }
            if d > 1 {
                // The true depth-(d-1) token paired with its parent's output, at the head
                // position spec-run gives a depth-(d-1) node: root_pos + d - 1 = n + d - 2.
                let pos: Vec<[u32; 1]> = active
                    .iter()
                    .map(|&j| [(walks[live[j]].root + d - 2) as u32])
                    .collect();
                let inputs: Vec<EagleSeqInput> = active
                    .iter()
                    .zip(&pos)
                    .map(|(&j, p)| {
                        let w = &walks[live[j]];
                        EagleSeqInput {
                            seq: w.head_seq,
                            tokens: std::slice::from_ref(&w.tokens[w.root + d - 1]),
                            features: cur[j].clone().expect("active nodes have an output"),
                            positions: p,
                            mask: None,
                            output_rows: OutputRows::Last,
                        }
                    })
                    .collect();
                let out = head.forward(base, &inputs, &mut head_cache)?;
                for (row, &j) in active.iter().enumerate() {
                    cur[j] = Some(out.narrow(0, row, 1)?);
                }
            }
            let rows: Vec<Tensor> = active
                .iter()
                .map(|&j| cur[j].clone().expect("active nodes have an output"))
                .collect();
            let logits = base.logits(&Tensor::cat(&rows, 0)?)?.to_vec2::<f32>()?;
            for (row, &j) in logits.iter().zip(&active) {
                let w = &walks[live[j]];
                let at_root = ranks[useful[live[j]]].last_mut().expect("pushed above");
                at_root.push(rank_of(row, w.tokens[w.root + d], k));
            }
        }
        // Drop the chain: the cache returns to the committed pairs, as after drafting.
        for &i in &live {
            head_cache.truncate(walks[i].head_seq, walks[i].fed)?;
            walks[i].root += 1;
        }
        live.retain(|&i| walks[i].root <= walks[i].last_root());
    }
    for w in &walks {
        head_cache.free_sequence(w.head_seq)?;
    }
    Ok(ranks)
}

/// The features `F_0..F_{len-2}` of one sequence that `head` is fed, computed as spec-run
/// computes them: the base's prompt rows through the prompt (GEMM) path, the answer through
/// the batch-invariant decode path (row for row what one-token decode or tree verification
/// steps give), each part with the states of the head's `feature_layers` fused as spec-run
/// fuses them: the prompt's rows in one call, answer rows through the same row-invariant
/// kernels that fuse a step's few accepted rows.
fn features(
    base: &Llama,
    head: &EagleHead,
    cache: &mut PagedKvCache,
    tokens: &[u32],
    prompt_len: usize,
) -> Result<Tensor> {
    let taps = &head.config().feature_layers;
    let n = tokens.len() - 1;
    let seq = cache.add_sequence();
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut parts = vec![head.fuse_features(&base.forward_tapped(
        &[SeqInput {
            seq,
            tokens: &tokens[..prompt_len],
            positions: &pos[..prompt_len],
            mask: None,
            output_rows: OutputRows::All,
        }],
        cache,
        taps,
        true,
    )?)?];
    let mut start = prompt_len;
    while start < n {
        let end = (start + MAX_ROWS).min(n);
        parts.push(head.fuse_features(&base.forward_tapped(
            &[SeqInput {
                seq,
                tokens: &tokens[start..end],
                positions: &pos[start..end],
                mask: None,
                output_rows: OutputRows::All,
            }],
            cache,
            taps,
            false,
        )?)?);
        start = end;
    }
    cache.free_sequence(seq)?;
    Ok(Tensor::cat(&parts, 0)?)
}

/// A node of a derived tree: its rank path from the root and estimated acceptance
/// probability `Π p[i][r_i]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TreeNode {
    pub path: Vec<usize>,
    pub prob: f64,
}

/// A frontier node; the heap pops the largest probability, then the shallower node, then
/// the lexicographically smaller path, so the result is deterministic and a parent always
/// comes before a child of equal probability.
#[derive(Debug, PartialEq)]
struct Frontier(TreeNode);

impl Eq for Frontier {}
impl PartialOrd for Frontier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Frontier {
    fn cmp(&self, other: &Self) -> Ordering {
        let (a, b) = (&self.0, &other.0);
        a.prob
            .total_cmp(&b.prob)
            .then_with(|| b.path.len().cmp(&a.path.len()))
            .then_with(|| b.path.cmp(&a.path))
    }
}

/// The tree of at most `num_nodes` nodes with the largest expected accepted length under
/// `p` (`p[d - 1][r]`, depth ≤ `p.len()`, rank < `p[d - 1].len()`), in the order the nodes
/// were chosen (non-increasing probability).
///
/// Best-first from the root (optimal, see the module docs). Nodes of probability 0 are
/// never added — they cost verification work and are never accepted — so the tree may have
/// fewer than `num_nodes` nodes. With `max_non_leaves_per_layer` binding, a node whose parent
/// would be one expanded node too many at its depth is passed over for the next best; the
/// result is then a good feasible tree rather than a proven optimum.
pub fn greedy_tree(
    p: &[Vec<f64>],
    num_nodes: usize,
    max_non_leaves_per_layer: usize,
) -> Vec<TreeNode> {
    let mut heap = BinaryHeap::new();
    let push_children = |heap: &mut BinaryHeap<Frontier>, parent: &[usize], prob: f64| {
        if let Some(row) = p.get(parent.len()) {
            for (r, &q) in row.iter().enumerate() {
                let mut path = parent.to_vec();
                path.push(r);
                heap.push(Frontier(TreeNode {
                    path,
                    prob: prob * q,
                }));
            }
        }
    };
    push_children(&mut heap, &[], 1.0);
    let mut nodes = Vec::with_capacity(num_nodes);
    let mut expanded: HashSet<Vec<usize>> = HashSet::new();
    let mut expanded_per_depth = vec![0usize; p.len() + 1];
    while nodes.len() < num_nodes {
        let Some(Frontier(node)) = heap.pop() else {
            break;
        };
        // Everything left is no more likely than this node.
        if node.prob <= 0.0 {
            break;
        }
        let d = node.path.len();
        if d >= 2 {
            let parent = &node.path[..d - 1];
            if !expanded.contains(parent) {
                if expanded_per_depth[d - 1] >= max_non_leaves_per_layer {
                    continue;
                }
                expanded.insert(parent.to_vec());
                expanded_per_depth[d - 1] += 1;
            }
        }
        push_children(&mut heap, &node.path, node.prob);
        nodes.push(node);
    }
    nodes
}

/// `Π p[i][r_i]` along `path`, or `None` when the path is deeper than `p` or uses a rank
/// that was not measured.
pub fn path_prob(p: &[Vec<f64>], path: &[usize]) -> Option<f64> {
    path.iter()
        .enumerate()
        .try_fold(1.0, |acc, (i, &r)| Some(acc * p.get(i)?.get(r)?))
}

/// Expected tokens committed per verification step with `choices`: `1 + Σ P(node)`.
pub fn expected_length(p: &[Vec<f64>], choices: &[Vec<usize>]) -> Option<f64> {
    choices
        .iter()
        .try_fold(1.0, |acc, path| Some(acc + path_prob(p, path)?))
}

/// `choices` sorted by (depth, path), as the presets and `EagleTree` order them.
pub fn sorted_choices(nodes: &[TreeNode]) -> Vec<Vec<usize>> {
    let mut choices: Vec<Vec<usize>> = nodes.iter().map(|n| n.path.clone()).collect();
    choices.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
    choices
}

/// `[[0], [1], [0, 0]]`: the layout of `configs/eagle_choices/*.json`.
pub fn choices_json(choices: &[Vec<usize>]) -> String {
    let paths: Vec<String> = choices
        .iter()
        .map(|p| {
            let ranks: Vec<String> = p.iter().map(|r| r.to_string()).collect();
            format!("[{}]", ranks.join(", "))
        })
        .collect();
    format!("[{}]\n", paths.join(", "))
}

/// Shape and expected length of a tree under the measured statistics.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TreeScore {
    pub name: String,
    pub nodes: usize,
    pub depth: usize,
    /// `1 + Σ P(node)`; `None` when the tree is deeper than the measured depths or uses
    /// ranks beyond `--top_k` (see `note`).
    pub expected_length: Option<f64>,
    /// Whether spec-run accepts the tree on this engine.
    pub fits_engine: bool,
    /// Expected tokens per plain decode step's time under the calibration's step costs
    /// (`--step_costs`), when given.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_speedup: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// Scores `choices` (named `name`) under `p`, the engine's `limits` and, when given, the
/// step `costs`.
pub fn score(
    name: &str,
    choices: &[Vec<usize>],
    p: &[Vec<f64>],
    limits: &TreeLimits,
    costs: Option<&StepCosts>,
) -> TreeScore {
    let depth = choices.iter().map(Vec::len).max().unwrap_or(0);
    let top = choices.iter().flatten().copied().max().map_or(0, |r| r + 1);
    let expected_length = expected_length(p, choices);
    let measured_k = p.first().map_or(0, Vec::len);
    let note = expected_length.is_none().then(|| {
        if depth > p.len() {
            format!(
                "depth {depth} is deeper than the {} depths measured",
                p.len()
            )
        } else {
            format!(
                "uses rank {} but only the top {measured_k} were measured",
                top.saturating_sub(1)
            )
        }
    });
    TreeScore {
        name: name.to_string(),
        nodes: choices.len(),
        depth,
        expected_length,
        fits_engine: EagleTree::new(choices, limits).is_ok(),
        expected_speedup: costs
            .zip(expected_length)
            .map(|(c, e)| c.speedup(e, depth, choices.len())),
        note,
    }
}

/// The presets of `configs/eagle_choices`, scored under `p` (and `costs`).
pub fn score_presets(
    p: &[Vec<f64>],
    limits: &TreeLimits,
    costs: Option<&StepCosts>,
) -> Vec<TreeScore> {
    preset_names()
        .into_iter()
        .filter_map(|name| {
            let choices = parse_choices(preset(name)?).ok()?;
            Some(score(name, &choices, p, limits, costs))
        })
        .collect()
}

/// Where the measured statistics came from (recorded in the side JSON).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CalibrationSource {
    pub engine_dir: String,
    pub prompts_file: String,
    pub chat_template: bool,
    pub num_prompts: usize,
    pub max_output_len: usize,
}

/// The side JSON next to a derived tree.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationReport {
    pub format: String,
    pub version: u32,
    pub source: CalibrationSource,
    pub budget: TreeBudget,
    /// The step costs the tree was chosen for (`--step_costs`); without them, the tree is
    /// the longest for the budget.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_costs: Option<StepCosts>,
    pub sequences: usize,
    /// Decoding positions measured.
    pub positions: u64,
    /// Positions measured at each depth 1..=max_depth.
    pub samples_per_depth: Vec<u64>,
    /// `p[d - 1][r]`: the true depth-d token was the head's rank-r candidate, given the
    /// true tokens of depths < d.
    pub p: Vec<Vec<f64>>,
    /// Per depth, how often the true token was outside the top-k.
    pub miss: Vec<f64>,
    /// The derived tree's nodes in the order chosen, with their estimated probability.
    pub nodes: Vec<TreeNode>,
    pub tree: TreeScore,
    pub presets: Vec<TreeScore>,
}

/// Derives the tree for `budget` from `table` — the longest, or with `costs` the fastest
/// ([`fastest_tree`]) — and scores it and the presets.
pub fn derive(
    table: &RankTable,
    budget: &TreeBudget,
    limits: &TreeLimits,
    source: CalibrationSource,
    tree_name: &str,
    costs: Option<&StepCosts>,
) -> Result<(Vec<Vec<usize>>, CalibrationReport)> {
    if table.positions() == 0 {
        return Err(invalid(
            "no decoding position was measured: every answer was shorter than two tokens (raise --max_output_len or use other prompts)",
        ));
    }
    let p = table.probs();
    let presets = score_presets(&p, limits, costs);
    let depths = &p[..budget.max_depth.min(p.len())];
    let nodes = match costs {
        Some(c) => fastest_tree(depths, budget.num_nodes, budget.max_non_leaves_per_layer, c),
        None => greedy_tree(depths, budget.num_nodes, budget.max_non_leaves_per_layer),
    };
    if nodes.is_empty() {
        return Err(invalid(format!(
            "the head never ranked the true next token within its top {} on these prompts: no tree can be derived (train the head further or raise --top_k)",
            budget.top_k
        )));
    }
    let choices = sorted_choices(&nodes);
    // The derived tree must be one spec-run takes; a failure here is a bug, reported as such.
    EagleTree::new(&choices, limits).map_err(|e| {
        invalid(format!(
            "internal error: the derived tree is refused by the engine's limits: {e}"
        ))
    })?;
    let tree = score(tree_name, &choices, &p, limits, costs);
    let report = CalibrationReport {
        format: CALIBRATION_FORMAT.into(),
        version: CALIBRATION_VERSION,
        source,
        budget: *budget,
        step_costs: costs.copied(),
        sequences: table.sequences,
        positions: table.positions(),
        samples_per_depth: table.samples.clone(),
        miss: table.miss_rates(),
        p,
        nodes,
        tree,
        presets,
    };
    Ok((choices, report))
}

/// Reads a side JSON written by [`save`] (to derive another tree from its statistics).
pub fn load_report(path: &Path) -> Result<CalibrationReport> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e))?;
    let report: CalibrationReport = serde_json::from_str(&text).map_err(|e| {
        invalid(format!(
            "{}: not a calibration statistics file ({e}); give the .stats.json that spec-train calibrate wrote",
            path.display()
        ))
    })?;
    if report.format != CALIBRATION_FORMAT || report.version != CALIBRATION_VERSION {
        return Err(invalid(format!(
            "{}: format {:?} version {}, expected {CALIBRATION_FORMAT:?} version {CALIBRATION_VERSION}",
            path.display(),
            report.format,
            report.version
        )));
    }
    Ok(report)
}

impl RankTable {
    /// The counts behind a report's probabilities (each `p · samples` is an integer count
    /// divided by its samples, so rounding recovers it).
    pub fn from_report(report: &CalibrationReport) -> Result<Self> {
        let top_k = report.p.first().map_or(0, Vec::len);
        let consistent = report.p.len() == report.samples_per_depth.len()
            && report.p.iter().all(|row| row.len() == top_k);
        if !consistent || top_k == 0 {
            return Err(invalid(
                "the statistics' p and samples_per_depth disagree in shape: regenerate them with spec-train calibrate",
            ));
        }
        let hits = report
            .p
            .iter()
            .zip(&report.samples_per_depth)
            .map(|(row, &n)| row.iter().map(|&q| (q * n as f64).round() as u64).collect())
            .collect();
        Ok(RankTable {
            top_k,
            max_depth: report.p.len(),
            hits,
            samples: report.samples_per_depth.clone(),
            sequences: report.sequences,
        })
    }
}

/// The side JSON's default path: `tree.json` → `tree.stats.json`.
pub fn default_stats_path(output: &Path) -> PathBuf {
    let name = output
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "eagle_choices.json".into());
    let stem = name.strip_suffix(".json").unwrap_or(&name);
    output.with_file_name(format!("{stem}.stats.json"))
}

/// Writes `contents` to `path` all-or-nothing: into a hidden sibling, synced, then renamed
/// over `path`, so a reader never sees a half-written file and a failure leaves no debris.
pub fn write_atomic(path: &Path, contents: &str) -> Result<()> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(|e| file_err(&parent, e))?;
    let name = path
        .file_name()
        .ok_or_else(|| file_err(path, "not a file name"))?
        .to_string_lossy()
        .into_owned();
    let tmp = parent.join(format!(".{name}.partial-{}", std::process::id()));
    let written = std::fs::File::create(&tmp).and_then(|mut f| {
        f.write_all(contents.as_bytes())?;
        f.sync_all()
    });
    let result = written.and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(file_err(path, e));
    }
    Ok(())
}

/// Writes the tree (`output`, eagle_choices JSON) and the report (`stats`), each atomically;
/// the report first, so a tree file on disk always has its statistics next to it.
pub fn save(
    output: &Path,
    stats: &Path,
    choices: &[Vec<usize>],
    report: &CalibrationReport,
) -> Result<()> {
    let body = serde_json::to_string_pretty(report).expect("the report serialises");
    write_atomic(stats, &(body + "\n"))?;
    write_atomic(output, &choices_json(choices))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table() -> Vec<Vec<f64>> {
        vec![vec![0.6, 0.2, 0.1], vec![0.5, 0.3, 0.1]]
    }

    fn paths(nodes: &[TreeNode]) -> Vec<Vec<usize>> {
        nodes.iter().map(|n| n.path.clone()).collect()
    }

    #[test]
    fn greedy_tree_on_a_hand_made_table() {
        let p = table();
        // Node probabilities: [0] .6, [0,0] .3, [1] .2, [0,1] .18, then [2] .1 and
        // [1,0] .1 (tie: the shallower first), [0,2] .06, [1,1] .06, [2,0] .05, …
        let nodes = greedy_tree(&p, 4, 10);
        assert_eq!(
            paths(&nodes),
            vec![vec![0], vec![0, 0], vec![1], vec![0, 1]]
        );
        let e = expected_length(&p, &sorted_choices(&nodes)).unwrap();
        assert!((e - 2.28).abs() < 1e-12, "{e}");
        let nodes = greedy_tree(&p, 6, 10);
        assert_eq!(
            sorted_choices(&nodes),
            vec![
                vec![0],
                vec![1],
                vec![2],
                vec![0, 0],
                vec![0, 1],
                vec![1, 0]
            ]
        );
        let e = expected_length(&p, &sorted_choices(&nodes)).unwrap();
        assert!((e - 2.48).abs() < 1e-12, "{e}");
        // A budget beyond the whole measured tree (3 + 9 nodes) stops at all of it.
        assert_eq!(greedy_tree(&p, 63, 10).len(), 12);
        assert_eq!(
            choices_json(&sorted_choices(&greedy_tree(&p, 3, 10))),
            "[[0], [1], [0, 0]]\n"
        );
    }

    #[test]
    fn greedy_tree_is_optimal_for_its_budget() {
        // Brute force over every prefix-closed tree of depth ≤ 2 with ranks < 3 (the 12
        // possible nodes), for several tables and budgets.
        let all: Vec<Vec<usize>> = (0..3)
            .map(|a| vec![a])
            .chain((0..3).flat_map(|a| (0..3).map(move |b| vec![a, b])))
            .collect();
        let tables = [
            table(),
            vec![vec![0.3, 0.3, 0.25], vec![0.9, 0.05, 0.01]],
            vec![vec![0.1, 0.5, 0.05], vec![0.2, 0.7, 0.0]],
        ];
        for p in &tables {
            for budget in 1..=all.len() {
                let mut best = 0f64;
                for mask in 0u32..(1 << all.len()) {
                    let tree: Vec<Vec<usize>> = (0..all.len())
                        .filter(|&i| mask & (1 << i) != 0)
                        .map(|i| all[i].clone())
                        .collect();
                    let closed = tree
                        .iter()
                        .all(|t| t.len() == 1 || tree.contains(&t[..1].to_vec()));
                    if closed && tree.len() <= budget {
                        best = best.max(expected_length(p, &tree).unwrap());
                    }
                }
                let got = expected_length(p, &sorted_choices(&greedy_tree(p, budget, 10))).unwrap();
                assert!(
                    (got - best).abs() < 1e-12,
                    "budget {budget}: {got} vs {best}"
                );
            }
        }
    }

    #[test]
    fn greedy_tree_respects_the_non_leaf_limit_and_skips_impossible_nodes() {
        let p = table();
        // One expanded node per depth: [0] is expanded first, so [1, 0] (.1) and [1, 1] are
        // passed over for [0, 2] (.06).
        let nodes = greedy_tree(&p, 6, 1);
        assert_eq!(
            paths(&nodes),
            vec![
                vec![0],
                vec![0, 0],
                vec![1],
                vec![0, 1],
                vec![2],
                vec![0, 2]
            ]
        );
        let limits = TreeLimits {
            num_eagle_layers: 2,
            max_non_leaves_per_layer: 1,
            max_draft_len: 6,
            max_top_k: 3,
        };
        assert!(EagleTree::new(&sorted_choices(&nodes), &limits).is_ok());
        // A head that is always right at rank 0: a chain, however large the budget.
        let sure = vec![vec![1.0, 0.0], vec![1.0, 0.0], vec![1.0, 0.0]];
        let nodes = greedy_tree(&sure, 63, 10);
        assert_eq!(paths(&nodes), vec![vec![0], vec![0, 0], vec![0, 0, 0]]);
        assert_eq!(expected_length(&sure, &paths(&nodes)), Some(4.0));
        // A head that is never right: no tree.
        assert!(greedy_tree(&[vec![0.0, 0.0]], 4, 10).is_empty());
    }

    #[test]
    fn rank_follows_the_runtime_order() {
        let row = [0.5, 2.0, 2.0, -1.0, 1.0];
        assert_eq!(rank_of(&row, 1, 10), Some(0));
        assert_eq!(rank_of(&row, 2, 10), Some(1));
        assert_eq!(rank_of(&row, 4, 10), Some(2));
        assert_eq!(rank_of(&row, 3, 10), Some(4));
        assert_eq!(rank_of(&row, 3, 4), None);
        assert_eq!(rank_of(&row, 9, 10), None);
    }

    #[test]
    fn table_probabilities_and_preset_scores() {
        let mut t = RankTable::new(2, 2);
        for r in [Some(0), Some(0), Some(1), None] {
            t.record(1, r);
        }
        t.record(2, Some(0));
        t.record(2, None);
        assert_eq!(t.positions(), 4);
        assert_eq!(t.probs(), vec![vec![0.5, 0.25], vec![0.5, 0.0]]);
        assert_eq!(t.miss_rates(), vec![0.25, 0.5]);
        let p = t.probs();
        let limits = TreeLimits::default();
        let s = score("two", &[vec![0], vec![1], vec![0, 0]], &p, &limits, None);
        assert_eq!(s.expected_length, Some(1.0 + 0.5 + 0.25 + 0.25));
        assert!(s.fits_engine && s.note.is_none() && s.expected_speedup.is_none());
        // With step costs: 2 tokens a step at 1 + 0.5 + 0.25 (one more level) + 3 · 0.125.
        let costs = StepCosts::parse("--step_costs", "0.5,0.25,0.125").unwrap();
        let s = score(
            "two",
            &[vec![0], vec![1], vec![0, 0]],
            &p,
            &limits,
            Some(&costs),
        );
        assert_eq!(s.expected_speedup, Some(2.0 / 2.125));
        let deep = score(
            "deep",
            &[vec![0], vec![0, 0], vec![0, 0, 0]],
            &p,
            &limits,
            None,
        );
        assert_eq!(deep.expected_length, None);
        assert!(deep.note.unwrap().contains("deeper"));
        let wide = score("wide", &[vec![0], vec![5]], &p, &limits, Some(&costs));
        assert!(wide.note.unwrap().contains("rank 5") && wide.expected_speedup.is_none());
        let presets = score_presets(&p, &limits, None);
        assert_eq!(presets.len(), preset_names().len());
    }

    #[test]
    fn budget_flags_are_checked_against_the_engine() {
        let limits = TreeLimits {
            num_eagle_layers: 4,
            max_non_leaves_per_layer: 10,
            max_draft_len: 30,
            max_top_k: 10,
        };
        let b = TreeBudget::resolve(&BudgetFlags::default(), &limits).unwrap();
        assert_eq!((b.top_k, b.max_depth, b.num_nodes), (10, 4, 30));
        let err = |f: BudgetFlags| TreeBudget::resolve(&f, &limits).unwrap_err().to_string();
        assert!(err(BudgetFlags {
            num_nodes: Some(31),
            ..Default::default()
        })
        .starts_with("--num_nodes 31 exceeds the engine's max_draft_len = 30"));
        assert!(err(BudgetFlags {
            max_depth: Some(5),
            ..Default::default()
        })
        .starts_with("--max_depth 5 exceeds the engine's num_eagle_layers = 4"));
        assert!(err(BudgetFlags {
            top_k: Some(11),
            ..Default::default()
        })
        .starts_with("--top_k 11 exceeds max_top_k = 10"));
    }

    #[test]
    fn writes_are_atomic_and_paths_derived() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("sub/tree.json");
        write_atomic(&out, "[[0]]\n").unwrap();
        assert_eq!(std::fs::read_to_string(&out).unwrap(), "[[0]]\n");
        let names: Vec<_> = std::fs::read_dir(out.parent().unwrap())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec!["tree.json"]);
        assert_eq!(
            default_stats_path(&out),
            dir.path().join("sub/tree.stats.json")
        );
        // A directory in the way: an error naming the path, and no debris.
        let blocked = dir.path().join("blocked.json");
        std::fs::create_dir_all(blocked.join("x")).unwrap();
        let err = write_atomic(&blocked, "[]").unwrap_err().to_string();
        assert!(err.starts_with(&blocked.display().to_string()), "{err}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
    }
}

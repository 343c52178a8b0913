//! EAGLE-1 static trees: `eagle_choices` parsing, validation and buffers.
//!
//! A choice (path) such as `[0, 3, 1]` means root → the root's best child (rank 0) → that
//! node's 4th-best child (rank 3) → that node's 2nd-best child (rank 1). The tree is the set of
//! paths; every prefix of a path must be present.
//!
//! [`TreeBuffers`] follows EAGLE/Medusa `generate_tree_buffers`: nodes sorted by
//! `(depth, lexicographic path)`, node 0 the root, an ancestor mask with column 0 always set,
//! position offsets = depth, and one retrieve path per leaf.

use std::collections::{HashMap, HashSet};

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// Default for [`TreeLimits::max_top_k`]: the EAGLE heads propose their top 10 tokens.
pub const DEFAULT_MAX_TOP_K: usize = 10;

/// The engine limits a static tree is validated against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeLimits {
    /// Maximum tree depth (the number of EAGLE layers of the engine). Shallower trees are
    /// accepted.
    pub num_eagle_layers: usize,
    /// Maximum number of non-leaf nodes (nodes that are expanded) at any depth ≥ 1.
    pub max_non_leaves_per_layer: usize,
    /// Maximum number of draft nodes (paths), the root excluded.
    pub max_draft_len: usize,
    /// Child ranks must be `< max_top_k` (the draft head's top-k).
    pub max_top_k: usize,
}

impl Default for TreeLimits {
    /// TensorRT-LLM's example build: `--max_draft_len 63 --num_eagle_layers 4
    /// --max_non_leaves_per_layer 10`, top-10.
    fn default() -> Self {
        Self {
            num_eagle_layers: 4,
            max_non_leaves_per_layer: 10,
            max_draft_len: 63,
            max_top_k: DEFAULT_MAX_TOP_K,
        }
    }
}

/// Why `eagle_choices` were refused. Each message names the offending path.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TreeError {
    #[error("eagle_choices is not a JSON list of paths of non-negative integers such as [[0], [1], [0, 0]]: {reason}")]
    Parse { reason: String },
    #[error("eagle_choices is empty: give at least one path, e.g. [[0]]")]
    NoPaths,
    #[error(
        "eagle_choices path #{index} is empty: every path needs at least one child rank, e.g. [0]"
    )]
    EmptyPath { index: usize },
    #[error("eagle_choices path {path:?} uses child rank {rank}, but ranks must be below max_top_k = {max_top_k} (the draft head proposes only its top {max_top_k} tokens)")]
    RankTooLarge {
        path: Vec<usize>,
        rank: usize,
        max_top_k: usize,
    },
    #[error("eagle_choices path {path:?} has depth {depth}, deeper than num_eagle_layers = {num_eagle_layers}: the engine drafts at most {num_eagle_layers} levels")]
    TooDeep {
        path: Vec<usize>,
        depth: usize,
        num_eagle_layers: usize,
    },
    #[error("eagle_choices path {path:?} appears more than once")]
    DuplicatePath { path: Vec<usize> },
    #[error("eagle_choices path {path:?} has no parent {parent:?}: every prefix of a path must be in the tree")]
    MissingParent {
        path: Vec<usize>,
        parent: Vec<usize>,
    },
    #[error("eagle_choices has {count} paths (draft tokens), more than max_draft_len = {max_draft_len}: path {first_over:?} is the first beyond the limit")]
    TooManyNodes {
        count: usize,
        max_draft_len: usize,
        first_over: Vec<usize>,
    },
    #[error("eagle_choices has {count} non-leaf nodes at depth {depth} ({}), more than max_non_leaves_per_layer = {max_non_leaves_per_layer}", fmt_paths(.paths))]
    TooManyNonLeaves {
        depth: usize,
        count: usize,
        max_non_leaves_per_layer: usize,
        paths: Vec<Vec<usize>>,
    },
    #[error("unknown eagle_choices preset {name:?}: known presets are {}", preset_names().join(", "))]
    UnknownPreset { name: String },
}

fn fmt_paths(paths: &[Vec<usize>]) -> String {
    paths
        .iter()
        .map(|p| format!("{p:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses `eagle_choices` from JSON (`[[0], [1], [0, 0], ...]`). Does not validate the tree.
pub fn parse_choices(json: &str) -> Result<Vec<Vec<usize>>, TreeError> {
    serde_json::from_str(json).map_err(|e| TreeError::Parse {
        reason: e.to_string(),
    })
}

/// Checks `choices` against `limits`. Errors, in order of checking: no paths, empty path,
/// rank ≥ max_top_k, depth > num_eagle_layers, duplicate path, missing prefix, more than
/// max_draft_len paths, more than max_non_leaves_per_layer non-leaf nodes at one depth.
pub fn validate(choices: &[Vec<usize>], limits: &TreeLimits) -> Result<(), TreeError> {
    if choices.is_empty() {
        return Err(TreeError::NoPaths);
    }
    for (index, path) in choices.iter().enumerate() {
        if path.is_empty() {
            return Err(TreeError::EmptyPath { index });
        }
        if let Some(&rank) = path.iter().find(|&&r| r >= limits.max_top_k) {
            return Err(TreeError::RankTooLarge {
                path: path.clone(),
                rank,
                max_top_k: limits.max_top_k,
            });
        }
        if path.len() > limits.num_eagle_layers {
            return Err(TreeError::TooDeep {
                path: path.clone(),
                depth: path.len(),
                num_eagle_layers: limits.num_eagle_layers,
            });
        }
    }
    let mut seen: HashSet<&[usize]> = HashSet::with_capacity(choices.len());
    for path in choices {
        if !seen.insert(path.as_slice()) {
            return Err(TreeError::DuplicatePath { path: path.clone() });
        }
    }
    for path in choices {
        let parent = &path[..path.len() - 1];
        if !parent.is_empty() && !seen.contains(parent) {
            return Err(TreeError::MissingParent {
                path: path.clone(),
                parent: parent.to_vec(),
            });
        }
    }
    if choices.len() > limits.max_draft_len {
        return Err(TreeError::TooManyNodes {
            count: choices.len(),
            max_draft_len: limits.max_draft_len,
            first_over: choices[limits.max_draft_len].clone(),
        });
    }
    // Non-leaf nodes per depth (depth = path length; the root, depth 0, is always expanded).
    let mut non_leaves: HashSet<&[usize]> = HashSet::new();
    for path in choices {
        if path.len() >= 2 {
            non_leaves.insert(&path[..path.len() - 1]);
        }
    }
    let max_depth = choices.iter().map(Vec::len).max().unwrap_or(0);
    for depth in 1..=max_depth {
        let mut at_depth: Vec<Vec<usize>> = non_leaves
            .iter()
            .filter(|p| p.len() == depth)
            .map(|p| p.to_vec())
            .collect();
        if at_depth.len() > limits.max_non_leaves_per_layer {
            at_depth.sort();
            return Err(TreeError::TooManyNonLeaves {
                depth,
                count: at_depth.len(),
                max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
                paths: at_depth,
            });
        }
    }
    Ok(())
}

/// One drafting step of a static tree: run the draft head on the non-leaf nodes at `depth`
/// and take each node at `depth + 1` from its parent's top-k output.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftLevel {
    /// Depth of the expanded nodes (0 = the root, whose draft output comes from the
    /// committed prefix).
    pub depth: usize,
    /// The non-leaf nodes at `depth`, in node order: the nodes whose draft output is needed.
    pub expand: Vec<usize>,
    /// The nodes at `depth + 1`, in node order, with where their token comes from.
    pub picks: Vec<DraftPick>,
    /// The top-k this step needs: 1 + the largest rank among `picks`.
    pub top_k: usize,
}

/// Where a drafted node's token comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftPick {
    /// The node being filled.
    pub node: usize,
    /// Index into [`DraftLevel::expand`] of its parent (whose top-k output it takes).
    pub parent_slot: usize,
    /// Which entry of the parent's top-k (0 = best).
    pub rank: usize,
}

/// Tree structure for drafting and verification (static or dynamic trees alike).
///
/// Node 0 is the root; every other node's parent has a smaller index and nodes are sorted by
/// depth. Retrieve paths are in depth-first order with children visited by rank (for a static
/// tree: lexicographic order of the leaves' choices).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TreeBuffers {
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
    ranks: Vec<usize>,
    children: Vec<Vec<usize>>,
    mask: Vec<bool>,
    retrieve_paths: Vec<Vec<usize>>,
    draft_levels: Vec<DraftLevel>,
}

impl TreeBuffers {
    /// The root alone: what a step that drafts nothing verifies (a plain decode step).
    pub fn root_only() -> Self {
        Self::from_parents(vec![None], vec![0])
    }

    /// Builds the buffers from parent links and child ranks. Callers guarantee
    /// `parents[0] == None`, `parents[i] = Some(p)` with `p < i` for `i > 0`, depth
    /// non-decreasing with the index, and distinct ranks among siblings.
    pub(crate) fn from_parents(parents: Vec<Option<usize>>, ranks: Vec<usize>) -> Self {
        let n = parents.len();
        let mut depths = vec![0usize; n];
        let mut children = vec![Vec::new(); n];
        for i in 1..n {
            if let Some(p) = parents[i] {
                depths[i] = depths[p] + 1;
                children[p].push(i);
            }
        }
        for c in &mut children {
            c.sort_by_key(|&i| ranks[i]);
        }
        let mut mask = vec![false; n * n];
        for i in 0..n {
            if let Some(p) = parents[i] {
                let (before, row) = mask.split_at_mut(i * n);
                row[..n].copy_from_slice(&before[p * n..p * n + n]);
            }
            mask[i * n + i] = true;
            mask[i * n] = true;
        }
        // Depth-first, children by rank: one path per leaf.
        let mut retrieve_paths = Vec::new();
        let mut stack = vec![(0usize, vec![0usize])];
        while let Some((node, path)) = stack.pop() {
            if children[node].is_empty() {
                retrieve_paths.push(path);
                continue;
            }
            for &c in children[node].iter().rev() {
                let mut p = path.clone();
                p.push(c);
                stack.push((c, p));
            }
        }
        let max_depth = depths.iter().copied().max().unwrap_or(0);
        let mut draft_levels = Vec::new();
        for depth in 0..max_depth {
            let expand: Vec<usize> = (0..n)
                .filter(|&i| depths[i] == depth && !children[i].is_empty())
                .collect();
            let picks: Vec<DraftPick> = (0..n)
                .filter(|&i| depths[i] == depth + 1)
                .filter_map(|i| {
                    let p = parents[i]?;
                    let parent_slot = expand.iter().position(|&e| e == p)?;
                    Some(DraftPick {
                        node: i,
                        parent_slot,
                        rank: ranks[i],
                    })
                })
                .collect();
            let top_k = picks.iter().map(|p| p.rank + 1).max().unwrap_or(0);
            draft_levels.push(DraftLevel {
                depth,
                expand,
                picks,
                top_k,
            });
        }
        Self {
            parents,
            depths,
            ranks,
            children,
            mask,
            retrieve_paths,
            draft_levels,
        }
    }

    /// Number of nodes including the root (`n + 1`).
    pub fn num_nodes(&self) -> usize {
        self.parents.len()
    }
    /// Number of draft nodes (the root excluded).
    pub fn num_draft_nodes(&self) -> usize {
        self.parents.len() - 1
    }
    /// Parent of each node (`None` for the root).
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }
    /// Depth of each node = its position offset from the root (root 0).
    pub fn depths(&self) -> &[usize] {
        &self.depths
    }
    /// Depth of the deepest node.
    pub fn max_depth(&self) -> usize {
        self.depths.iter().copied().max().unwrap_or(0)
    }
    /// Rank of each node among its parent's top-k (root 0).
    pub fn ranks(&self) -> &[usize] {
        &self.ranks
    }
    /// Children of `node`, sorted by rank.
    pub fn children(&self, node: usize) -> &[usize] {
        &self.children[node]
    }
    /// The `(n+1) × (n+1)` ancestor mask, row-major: row `i` is true at `i`, its ancestors
    /// and column 0.
    pub fn mask(&self) -> &[bool] {
        &self.mask
    }
    /// Row `i` of the ancestor mask.
    pub fn mask_row(&self, i: usize) -> &[bool] {
        let n = self.num_nodes();
        &self.mask[i * n..(i + 1) * n]
    }
    /// One path per leaf, root (0) first, as node indices.
    pub fn retrieve_paths(&self) -> &[Vec<usize>] {
        &self.retrieve_paths
    }
    /// Retrieve paths padded with -1 to `max_depth + 1` columns (EAGLE's `retrieve_indices`).
    pub fn retrieve_indices_padded(&self) -> Vec<Vec<i64>> {
        let width = self.max_depth() + 1;
        self.retrieve_paths
            .iter()
            .map(|p| {
                let mut row: Vec<i64> = p.iter().map(|&i| i as i64).collect();
                row.resize(width, -1);
                row
            })
            .collect()
    }
    /// Drafting plan, one entry per depth `0..max_depth`.
    pub fn draft_levels(&self) -> &[DraftLevel] {
        &self.draft_levels
    }
    /// Whether `node` has no children.
    pub fn is_leaf(&self, node: usize) -> bool {
        self.children[node].is_empty()
    }
}

/// A validated static tree: the choices sorted by (depth, lexicographic) and its buffers.
/// Node `i ≥ 1` corresponds to `choices()[i - 1]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EagleTree {
    choices: Vec<Vec<usize>>,
    buffers: TreeBuffers,
}

impl EagleTree {
    /// Validates `choices` against `limits` and builds the buffers.
    pub fn new(choices: &[Vec<usize>], limits: &TreeLimits) -> Result<Self, TreeError> {
        validate(choices, limits)?;
        let mut sorted = choices.to_vec();
        sorted.sort_by(|a, b| a.len().cmp(&b.len()).then_with(|| a.cmp(b)));
        let index: HashMap<&[usize], usize> = sorted
            .iter()
            .enumerate()
            .map(|(i, p)| (p.as_slice(), i + 1))
            .collect();
        let mut parents = vec![None];
        let mut ranks = vec![0];
        for path in &sorted {
            let parent = &path[..path.len() - 1];
            parents.push(Some(if parent.is_empty() { 0 } else { index[parent] }));
            ranks.push(path[path.len() - 1]);
        }
        let buffers = TreeBuffers::from_parents(parents, ranks);
        Ok(Self {
            choices: sorted,
            buffers,
        })
    }

    /// Parses JSON choices, validates them and builds the buffers.
    pub fn from_json(json: &str, limits: &TreeLimits) -> Result<Self, TreeError> {
        Self::new(&parse_choices(json)?, limits)
    }

    /// Builds a named preset (see [`preset_names`]).
    pub fn from_preset(name: &str, limits: &TreeLimits) -> Result<Self, TreeError> {
        let json = preset(name).ok_or_else(|| TreeError::UnknownPreset {
            name: name.to_string(),
        })?;
        Self::from_json(json, limits)
    }

    /// `spec` as `--eagle_choices` spells it inline: JSON paths (`[[0], [1], …]`) or a preset
    /// name.
    pub fn from_spec(spec: &str, limits: &TreeLimits) -> Result<Self, TreeError> {
        let spec = spec.trim();
        if spec.starts_with('[') {
            Self::from_json(spec, limits)
        } else {
            Self::from_preset(spec, limits)
        }
    }

    /// The choices in node order (sorted by depth, then lexicographically).
    pub fn choices(&self) -> &[Vec<usize>] {
        &self.choices
    }
    /// The choice of node `i` (empty for the root).
    pub fn node_path(&self, node: usize) -> &[usize] {
        if node == 0 {
            &[]
        } else {
            &self.choices[node - 1]
        }
    }
    /// The buffers.
    pub fn buffers(&self) -> &TreeBuffers {
        &self.buffers
    }
    /// Number of nodes per depth 1..=max_depth.
    pub fn nodes_per_depth(&self) -> Vec<usize> {
        let b = &self.buffers;
        (1..=b.max_depth())
            .map(|d| b.depths().iter().filter(|&&x| x == d).count())
            .collect()
    }
    /// Number of non-leaf nodes per depth 1..=max_depth.
    pub fn non_leaves_per_depth(&self) -> Vec<usize> {
        let b = &self.buffers;
        (1..=b.max_depth())
            .map(|d| {
                (0..b.num_nodes())
                    .filter(|&i| b.depths()[i] == d && !b.is_leaf(i))
                    .count()
            })
            .collect()
    }
}

const PRESETS: &[(&str, &str)] = &[
    (
        "mc_sim_7b_63",
        include_str!("../../../configs/eagle_choices/mc_sim_7b_63.json"),
    ),
    (
        "eagle_mc_sim_7b_63",
        include_str!("../../../configs/eagle_choices/eagle_mc_sim_7b_63.json"),
    ),
    (
        "chain_4",
        include_str!("../../../configs/eagle_choices/chain_4.json"),
    ),
    (
        "small_8",
        include_str!("../../../configs/eagle_choices/small_8.json"),
    ),
];

/// The name of TensorRT-LLM's default tree (Medusa's 63-node list).
pub const DEFAULT_PRESET: &str = "mc_sim_7b_63";

/// The JSON of a preset tree, or `None` if there is no preset of that name.
pub fn preset(name: &str) -> Option<&'static str> {
    PRESETS.iter().find(|(n, _)| *n == name).map(|(_, j)| *j)
}

/// The names of all preset trees.
pub fn preset_names() -> Vec<&'static str> {
    PRESETS.iter().map(|(n, _)| *n).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn big_limits() -> TreeLimits {
        TreeLimits {
            num_eagle_layers: 8,
            max_non_leaves_per_layer: 64,
            max_draft_len: 256,
            max_top_k: 10,
        }
    }

    fn err(json: &str, limits: &TreeLimits) -> String {
        EagleTree::from_json(json, limits).unwrap_err().to_string()
    }

    #[test]
    fn medusa_preset_stats() {
        let t = EagleTree::from_preset("mc_sim_7b_63", &TreeLimits::default()).unwrap();
        assert_eq!(t.buffers().num_draft_nodes(), 63);
        assert_eq!(t.buffers().max_depth(), 4);
        assert_eq!(t.nodes_per_depth(), vec![10, 28, 23, 2]);
        assert_eq!(t.non_leaves_per_depth(), vec![10, 10, 1, 0]);
        assert_eq!(t.buffers().retrieve_paths().len(), 42);
        assert_eq!(t.buffers().ranks().iter().max(), Some(&9));
        assert_eq!(preset(DEFAULT_PRESET), preset("mc_sim_7b_63"));
    }

    #[test]
    fn eagle_preset_stats() {
        let limits = TreeLimits {
            num_eagle_layers: 5,
            ..TreeLimits::default()
        };
        let t = EagleTree::from_preset("eagle_mc_sim_7b_63", &limits).unwrap();
        assert_eq!(t.buffers().num_nodes(), 26);
        assert_eq!(t.nodes_per_depth(), vec![4, 8, 8, 3, 2]);
        assert_eq!(t.non_leaves_per_depth(), vec![4, 4, 1, 1, 0]);
        assert_eq!(t.buffers().retrieve_paths().len(), 15);
        // Depth 5 does not fit 4 layers.
        assert_eq!(
            err(preset("eagle_mc_sim_7b_63").unwrap(), &TreeLimits::default()),
            "eagle_choices path [0, 0, 0, 0, 0] has depth 5, deeper than num_eagle_layers = 4: the engine drafts at most 4 levels"
        );
    }

    #[test]
    fn small_presets() {
        let t = EagleTree::from_preset("chain_4", &TreeLimits::default()).unwrap();
        assert_eq!(t.buffers().retrieve_paths(), &[vec![0, 1, 2, 3, 4]]);
        let t = EagleTree::from_preset("small_8", &TreeLimits::default()).unwrap();
        assert_eq!(t.nodes_per_depth(), vec![3, 3, 2]);
        assert_eq!(t.non_leaves_per_depth(), vec![2, 1, 0]);
        for name in preset_names() {
            assert!(
                EagleTree::from_preset(name, &big_limits()).is_ok(),
                "{name}"
            );
        }
        assert_eq!(
            EagleTree::from_preset("nope", &big_limits())
                .unwrap_err()
                .to_string(),
            "unknown eagle_choices preset \"nope\": known presets are mc_sim_7b_63, eagle_mc_sim_7b_63, chain_4, small_8"
        );
    }

    #[test]
    fn buffers_of_small_tree() {
        // Given out of order on purpose.
        let t = EagleTree::from_json(
            "[[1], [0, 1], [0], [0, 0], [1, 0], [0, 0, 0]]",
            &big_limits(),
        )
        .unwrap();
        assert_eq!(
            t.choices(),
            &[
                vec![0],
                vec![1],
                vec![0, 0],
                vec![0, 1],
                vec![1, 0],
                vec![0, 0, 0]
            ]
        );
        let b = t.buffers();
        assert_eq!(
            b.parents(),
            &[None, Some(0), Some(0), Some(1), Some(1), Some(2), Some(3)]
        );
        assert_eq!(b.depths(), &[0, 1, 1, 2, 2, 2, 3]);
        assert_eq!(b.ranks(), &[0, 0, 1, 0, 1, 0, 0]);
        assert_eq!(
            b.retrieve_paths(),
            &[vec![0, 1, 3, 6], vec![0, 1, 4], vec![0, 2, 5]]
        );
        assert_eq!(
            b.retrieve_indices_padded(),
            vec![vec![0, 1, 3, 6], vec![0, 1, 4, -1], vec![0, 2, 5, -1]]
        );
        let row6: Vec<usize> = (0..7).filter(|&j| b.mask_row(6)[j]).collect();
        assert_eq!(row6, vec![0, 1, 3, 6]);
        let row5: Vec<usize> = (0..7).filter(|&j| b.mask_row(5)[j]).collect();
        assert_eq!(row5, vec![0, 2, 5]);
        let lv = b.draft_levels();
        assert_eq!(lv.len(), 3);
        assert_eq!(lv[0].expand, vec![0]);
        assert_eq!(lv[0].top_k, 2);
        assert_eq!(lv[1].expand, vec![1, 2]);
        assert_eq!(
            lv[1].picks,
            vec![
                DraftPick {
                    node: 3,
                    parent_slot: 0,
                    rank: 0
                },
                DraftPick {
                    node: 4,
                    parent_slot: 0,
                    rank: 1
                },
                DraftPick {
                    node: 5,
                    parent_slot: 1,
                    rank: 0
                },
            ]
        );
        assert_eq!(lv[2].expand, vec![3]);
        assert_eq!(
            lv[2].picks,
            vec![DraftPick {
                node: 6,
                parent_slot: 0,
                rank: 0
            }]
        );
    }

    #[test]
    fn validation_messages() {
        let l = TreeLimits::default();
        assert_eq!(
            err("[[0], {}]", &l),
            "eagle_choices is not a JSON list of paths of non-negative integers such as [[0], [1], [0, 0]]: invalid type: map, expected a sequence at line 1 column 6"
        );
        assert!(err("[[-1]]", &l).starts_with("eagle_choices is not a JSON list"));
        assert_eq!(
            err("[]", &l),
            "eagle_choices is empty: give at least one path, e.g. [[0]]"
        );
        assert_eq!(
            err("[[0], []]", &l),
            "eagle_choices path #1 is empty: every path needs at least one child rank, e.g. [0]"
        );
        assert_eq!(
            err("[[0], [0, 10]]", &l),
            "eagle_choices path [0, 10] uses child rank 10, but ranks must be below max_top_k = 10 (the draft head proposes only its top 10 tokens)"
        );
        assert_eq!(
            err("[[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]]", &l),
            "eagle_choices path [0, 0, 0, 0, 0] has depth 5, deeper than num_eagle_layers = 4: the engine drafts at most 4 levels"
        );
        assert_eq!(
            err("[[0], [0, 1], [1], [0, 1]]", &l),
            "eagle_choices path [0, 1] appears more than once"
        );
        assert_eq!(
            err("[[0], [0, 3, 1]]", &l),
            "eagle_choices path [0, 3, 1] has no parent [0, 3]: every prefix of a path must be in the tree"
        );
        let small = TreeLimits {
            max_draft_len: 3,
            ..l
        };
        assert_eq!(
            err("[[0], [1], [2], [3], [4]]", &small),
            "eagle_choices has 5 paths (draft tokens), more than max_draft_len = 3: path [3] is the first beyond the limit"
        );
        let narrow = TreeLimits {
            max_non_leaves_per_layer: 2,
            ..l
        };
        assert_eq!(
            err("[[0], [1], [2], [2, 0], [0, 0], [1, 0], [0, 0, 0]]", &narrow),
            "eagle_choices has 3 non-leaf nodes at depth 1 ([0], [1], [2]), more than max_non_leaves_per_layer = 2"
        );
        // Shallower trees than num_eagle_layers are accepted.
        assert!(EagleTree::from_json("[[0]]", &l).is_ok());
    }

    use proptest::prelude::*;

    /// Random valid trees: each step adds a child (random unused rank) to a random node of
    /// depth < 5; then the paths are shuffled.
    fn random_tree() -> impl Strategy<Value = Vec<Vec<usize>>> {
        proptest::collection::vec((any::<u16>(), any::<u16>()), 1..40)
            .prop_map(|ops| {
                let mut nodes: Vec<Vec<usize>> = vec![vec![]];
                for (a, r) in ops {
                    let parent = nodes[a as usize % nodes.len()].clone();
                    if parent.len() >= 5 {
                        continue;
                    }
                    let used: Vec<usize> = nodes
                        .iter()
                        .filter(|n| n.len() == parent.len() + 1 && n.starts_with(&parent))
                        .map(|n| n[n.len() - 1])
                        .collect();
                    let start = r as usize % DEFAULT_MAX_TOP_K;
                    let Some(rank) = (0..DEFAULT_MAX_TOP_K)
                        .map(|k| (start + k) % DEFAULT_MAX_TOP_K)
                        .find(|k| !used.contains(k))
                    else {
                        continue;
                    };
                    let mut child = parent;
                    child.push(rank);
                    nodes.push(child);
                }
                nodes.remove(0);
                nodes
            })
            .prop_filter("at least one path", |n| !n.is_empty())
            .prop_shuffle()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn random_trees_validate_and_buffers_hold(choices in random_tree()) {
            let limits = TreeLimits { num_eagle_layers: 5, max_non_leaves_per_layer: 64, max_draft_len: 64, max_top_k: 10 };
            let json = serde_json::to_string(&choices).unwrap();
            prop_assert_eq!(&parse_choices(&json).unwrap(), &choices);
            let t = EagleTree::from_json(&json, &limits).unwrap();
            let b = t.buffers();
            let n = b.num_nodes();
            prop_assert_eq!(n, choices.len() + 1);
            // Sorted by (depth, lexicographic); same set of paths.
            for w in t.choices().windows(2) {
                prop_assert!((w[0].len(), &w[0]) < (w[1].len(), &w[1]));
            }
            let mut a = choices.clone(); a.sort();
            let mut c = t.choices().to_vec(); c.sort();
            prop_assert_eq!(a, c);
            for i in 0..n {
                let path = t.node_path(i);
                prop_assert_eq!(b.depths()[i], path.len());
                // Ancestor set by walking parents.
                let mut anc = vec![i];
                let mut cur = i;
                while let Some(p) = b.parents()[cur] {
                    prop_assert!(p < cur);
                    anc.push(p);
                    cur = p;
                }
                prop_assert_eq!(cur, 0);
                if i > 0 {
                    let p = b.parents()[i].unwrap();
                    prop_assert_eq!(t.node_path(p), &path[..path.len() - 1]);
                    prop_assert_eq!(b.ranks()[i], path[path.len() - 1]);
                }
                let row: Vec<usize> = (0..n).filter(|&j| b.mask_row(i)[j]).collect();
                anc.sort_unstable();
                prop_assert_eq!(row, anc);
            }
            // Retrieve paths: root-to-leaf chains, one per leaf, sorted by choice.
            let leaves: Vec<usize> = (0..n).filter(|&i| b.is_leaf(i)).collect();
            prop_assert_eq!(b.retrieve_paths().len(), leaves.len());
            let mut seen = Vec::new();
            for path in b.retrieve_paths() {
                prop_assert_eq!(path[0], 0);
                for w in path.windows(2) {
                    prop_assert_eq!(b.parents()[w[1]], Some(w[0]));
                }
                let last = *path.last().unwrap();
                prop_assert!(b.is_leaf(last));
                prop_assert_eq!(path.len(), b.depths()[last] + 1);
                seen.push(last);
            }
            for w in b.retrieve_paths().windows(2) {
                prop_assert!(t.node_path(*w[0].last().unwrap()) < t.node_path(*w[1].last().unwrap()));
            }
            seen.sort_unstable();
            prop_assert_eq!(seen, leaves);
            // Draft levels: every non-root node is picked once from its parent's output.
            let mut picked = vec![0usize; n];
            for lv in b.draft_levels() {
                for pk in &lv.picks {
                    picked[pk.node] += 1;
                    prop_assert_eq!(Some(lv.expand[pk.parent_slot]), b.parents()[pk.node]);
                    prop_assert_eq!(pk.rank, b.ranks()[pk.node]);
                    prop_assert_eq!(b.depths()[pk.node], lv.depth + 1);
                    prop_assert!(pk.rank < lv.top_k);
                }
                for &e in &lv.expand {
                    prop_assert!(!b.is_leaf(e));
                    prop_assert_eq!(b.depths()[e], lv.depth);
                }
            }
            prop_assert_eq!(picked[0], 0);
            prop_assert!(picked[1..].iter().all(|&k| k == 1));
        }

        #[test]
        fn removing_a_parent_is_reported(choices in random_tree()) {
            let limits = TreeLimits { num_eagle_layers: 5, max_non_leaves_per_layer: 64, max_draft_len: 64, max_top_k: 10 };
            let Some(deep) = choices.iter().find(|p| p.len() >= 2).cloned() else { return Ok(()); };
            let parent = deep[..deep.len() - 1].to_vec();
            let broken: Vec<Vec<usize>> = choices.iter().filter(|p| **p != parent).cloned().collect();
            let e = EagleTree::new(&broken, &limits).unwrap_err();
            let is_missing_parent = matches!(e, TreeError::MissingParent { .. });
            prop_assert!(is_missing_parent, "{}", e);
        }
    }
}

//! Trees chosen for speed rather than for length: the expected accepted length of a tree
//! divided by what its speculative step costs.
//!
//! The longest tree for a node budget is not the fastest: every draft level is a head step
//! with a round trip to the host, and every node is a row to verify. On SmolLM2 with the
//! shipped head (H200, bf16) the 12-node, 2-level tree that maximises the expected length
//! (1.81) ran at 0.84-1.02× plain decoding, while the 7 root candidates alone (1.66, one
//! level, so no head step while drafting) ran at 1.09-1.11×. A step is modelled as
//! `1 + fixed + level·(depth − 1) + node·nodes` plain decode steps, from three costs measured
//! once per model and device (spec-bench's `step_latency_ms` of a few trees against plain
//! decoding's), and the tree maximising `expected length / step cost` is searched among the
//! best-first trees of every depth cap and node count within the budget.

use crate::calibrate::{greedy_tree, TreeNode};
use crate::error::{invalid, Result};
use serde::{Deserialize, Serialize};

/// What a speculative step costs beyond a plain decode step, in plain decode steps.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StepCosts {
    /// Whatever the tree: the root's candidates, the head's step over the accepted tokens,
    /// the acceptance and the KV compaction.
    pub fixed: f64,
    /// Each draft level after the first (a head step over the level's nodes).
    pub level: f64,
    /// Each draft node verified.
    pub node: f64,
}

impl StepCosts {
    /// Parses `FIXED,LEVEL,NODE` (three non-negative numbers); errors name `flag`.
    pub fn parse(flag: &str, text: &str) -> Result<Self> {
        let values: Vec<&str> = text.split(',').map(str::trim).collect();
        let parsed: Vec<f64> = values
            .iter()
            .filter_map(|v| v.parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
            .collect();
        if values.len() != 3 || parsed.len() != 3 {
            return Err(invalid(format!(
                "{flag} {text}: expected FIXED,LEVEL,NODE, three non-negative numbers in plain decode steps (e.g. 0.33,0.32,0.02)"
            )));
        }
        Ok(StepCosts {
            fixed: parsed[0],
            level: parsed[1],
            node: parsed[2],
        })
    }

    /// A step's cost with a tree of `nodes` draft nodes `depth` levels deep.
    pub fn of(&self, depth: usize, nodes: usize) -> f64 {
        1.0 + self.fixed + self.level * depth.saturating_sub(1) as f64 + self.node * nodes as f64
    }

    /// Expected tokens per plain-step time: `expected_length / of(depth, nodes)`.
    pub fn speedup(&self, expected_length: f64, depth: usize, nodes: usize) -> f64 {
        expected_length / self.of(depth, nodes)
    }
}

/// The tree of at most `num_nodes` nodes and `p.len()` levels with the largest expected
/// speedup under `costs`: for every depth cap, the best-first tree ([`greedy_tree`]) and each
/// of its prefixes (best-first trees of fewer nodes) are scored; ties go to fewer nodes, then
/// to fewer levels. Empty when no node has a positive probability.
pub fn fastest_tree(
    p: &[Vec<f64>],
    num_nodes: usize,
    max_non_leaves_per_layer: usize,
    costs: &StepCosts,
) -> Vec<TreeNode> {
    let mut best: Option<(f64, usize, usize, Vec<TreeNode>)> = None;
    for cap in 1..=p.len() {
        let nodes = greedy_tree(&p[..cap], num_nodes, max_non_leaves_per_layer);
        let (mut expected, mut depth) = (1.0, 0);
        for (n, node) in nodes.iter().enumerate() {
            expected += node.prob;
            depth = depth.max(node.path.len());
            let speedup = costs.speedup(expected, depth, n + 1);
            let better = best.as_ref().is_none_or(|(s, bn, bd, _)| {
                speedup > *s || (speedup == *s && (n + 1, depth) < (*bn, *bd))
            });
            if better {
                best = Some((speedup, n + 1, depth, nodes[..=n].to_vec()));
            }
        }
    }
    best.map(|(_, _, _, nodes)| nodes).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibrate::{expected_length, sorted_choices};

    /// The shipped head's measured acceptance on MT-bench (heads/smollm2-eagle/
    /// tree_12.stats.json), first two depths, top 8.
    fn smollm2_p() -> Vec<Vec<f64>> {
        vec![
            vec![0.365, 0.114, 0.072, 0.042, 0.027, 0.020, 0.018, 0.015],
            vec![0.179, 0.085, 0.062, 0.035, 0.026, 0.019, 0.014, 0.020],
        ]
    }

    #[test]
    fn costly_levels_give_a_one_level_tree_and_free_ones_the_longest() {
        let p = smollm2_p();
        // The H200 costs measured with SmolLM2: one level wins, and it stops where one more
        // candidate adds less than it costs (p = 0.020 against 0.02 of a step times the
        // speedup, 1.13: 5 nodes).
        let h200 = StepCosts::parse("--step_costs", "0.33,0.32,0.02").unwrap();
        let fast = sorted_choices(&fastest_tree(&p, 12, 10, &h200));
        assert_eq!(fast, vec![vec![0], vec![1], vec![2], vec![3], vec![4]]);
        // With nothing costing anything, the fastest tree is the longest one of the budget.
        let free = StepCosts::parse("--step_costs", "0,0,0").unwrap();
        let nodes = fastest_tree(&p, 12, 10, &free);
        let longest = greedy_tree(&p, 12, 10);
        assert_eq!(sorted_choices(&nodes), sorted_choices(&longest));
        let e = expected_length(&p, &sorted_choices(&nodes)).unwrap();
        assert!((h200.speedup(e, 2, 12) - e / (1.0 + 0.33 + 0.32 + 0.24)).abs() < 1e-12);
        // A head that is usually right, cheap levels and dear nodes: a chain.
        let sure = vec![vec![0.9, 0.05], vec![0.9, 0.05]];
        let deep = StepCosts::parse("--step_costs", "0.1,0.01,0.2").unwrap();
        let chain = sorted_choices(&fastest_tree(&sure, 12, 10, &deep));
        assert_eq!(chain, vec![vec![0], vec![0, 0]]);
        // The same costs with SmolLM2's head: the root's best candidate alone.
        assert_eq!(
            sorted_choices(&fastest_tree(&p, 12, 10, &deep)),
            vec![vec![0]]
        );
    }

    #[test]
    fn no_positive_probability_gives_no_tree() {
        let costs = StepCosts::parse("--step_costs", "0.3,0.3,0.02").unwrap();
        assert!(fastest_tree(&[vec![0.0, 0.0]], 5, 10, &costs).is_empty());
    }

    #[test]
    fn bad_costs_are_refused_with_the_flag_named() {
        for text in [
            "0.3,0.3",
            "0.3,0.3,0.1,1",
            "a,b,c",
            "0.3,-1,0.1",
            "0.3,inf,0.1",
        ] {
            assert_eq!(
                StepCosts::parse("--step_costs", text).unwrap_err().to_string(),
                format!("--step_costs {text}: expected FIXED,LEVEL,NODE, three non-negative numbers in plain decode steps (e.g. 0.33,0.32,0.02)")
            );
        }
    }
}

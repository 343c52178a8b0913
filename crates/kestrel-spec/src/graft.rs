//! Grafting a chain of draft tokens onto a drafted tree: the union of two drafters' guesses
//! verified in one target forward.
//!
//! A tree drafter (EAGLE) and a chain drafter (prompt lookup) miss in different places: the
//! head guesses the next token from the target's features, the lookup copies what followed
//! the same words earlier. The chain is walked down the tree while its tokens equal a child's
//! (those guesses agree and cost nothing more), and what is left hangs below the last match
//! as one new branch. Siblings therefore never share a token, so token matching still finds
//! at most one child to follow at every node, and the committed tokens are the target's.

use crate::tree::TreeBuffers;

/// A tree after grafting: node tokens (root first) and the new structure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GraftedTree {
    pub tokens: Vec<u32>,
    pub buffers: TreeBuffers,
    /// How many of the chain's tokens became new nodes.
    pub added: usize,
}

/// Grafts `chain` (the tokens proposed after the root, in order) onto the tree of `tokens` and
/// `tree`, adding at most `max_new` nodes. `None` when nothing is added: the chain is empty,
/// already a path of the tree, or `max_new` is 0.
///
/// New nodes take a rank after their siblings' (a rank orders a node's children; the head's
/// own children keep theirs), and the nodes are renumbered so that depth stays
/// non-decreasing with the index, as [`TreeBuffers`] requires.
pub fn graft_chain(
    tokens: &[u32],
    tree: &TreeBuffers,
    chain: &[u32],
    max_new: usize,
) -> Option<GraftedTree> {
    debug_assert_eq!(tokens.len(), tree.num_nodes());
    // Follow the chain down the tree while a child carries its next token.
    let mut at = 0;
    let mut matched = 0;
    while let Some(&next) = chain.get(matched) {
        match tree.children(at).iter().find(|&&c| tokens[c] == next) {
            Some(&c) => {
                at = c;
                matched += 1;
            }
            None => break,
        }
    }
    let rest = &chain[matched..chain.len().min(matched + max_new)];
    if rest.is_empty() {
        return None;
    }

    // Old nodes keep their links; new node j hangs below the previous one (the first below
    // `at`).
    let n = tokens.len();
    let mut parents: Vec<Option<usize>> = tree.parents().to_vec();
    let mut ranks: Vec<usize> = tree.ranks().to_vec();
    let mut depths: Vec<usize> = tree.depths().to_vec();
    let mut all_tokens = tokens.to_vec();
    let first_rank = tree
        .children(at)
        .iter()
        .map(|&c| ranks[c] + 1)
        .max()
        .unwrap_or(0);
    for (j, &t) in rest.iter().enumerate() {
        let parent = if j == 0 { at } else { n + j - 1 };
        parents.push(Some(parent));
        ranks.push(if j == 0 { first_rank } else { 0 });
        depths.push(depths[parent] + 1);
        all_tokens.push(t);
    }

    // Renumber by depth, keeping the order within a depth (a stable sort), so the old nodes
    // keep their relative order and the root stays node 0.
    let total = all_tokens.len();
    let mut order: Vec<usize> = (0..total).collect();
    order.sort_by_key(|&i| depths[i]);
    let mut new_index = vec![0; total];
    for (new, &old) in order.iter().enumerate() {
        new_index[old] = new;
    }
    let parents = order
        .iter()
        .map(|&old| parents[old].map(|p| new_index[p]))
        .collect();
    let ranks = order.iter().map(|&old| ranks[old]).collect();
    let tokens = order.iter().map(|&old| all_tokens[old]).collect();
    Some(GraftedTree {
        tokens,
        buffers: TreeBuffers::from_parents(parents, ranks),
        added: rest.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::accept::greedy_tree;
    use crate::tree::{EagleTree, TreeLimits};

    /// Root 10 with children 11 (rank 0) and 12 (rank 1); 11 has child 13.
    fn small() -> (Vec<u32>, TreeBuffers) {
        let tree = EagleTree::new(&[vec![0], vec![1], vec![0, 0]], &TreeLimits::default())
            .expect("valid tree");
        (vec![10, 11, 12, 13], tree.buffers().clone())
    }

    fn paths_as_tokens(g: &GraftedTree) -> Vec<Vec<u32>> {
        g.buffers
            .retrieve_paths()
            .iter()
            .map(|p| p.iter().map(|&i| g.tokens[i]).collect())
            .collect()
    }

    #[test]
    fn a_chain_that_agrees_then_differs_branches_at_the_last_match() {
        let (tokens, tree) = small();
        let g = graft_chain(&tokens, &tree, &[11, 20, 21], 8).expect("adds nodes");
        assert_eq!(g.added, 2);
        assert_eq!(
            paths_as_tokens(&g),
            vec![vec![10, 11, 13], vec![10, 11, 20, 21], vec![10, 12]]
        );
        // Sorted by depth, parents before children.
        let depths = g.buffers.depths();
        assert!(depths.windows(2).all(|w| w[0] <= w[1]));
        for (i, p) in g.buffers.parents().iter().enumerate().skip(1) {
            assert!(p.expect("non-root nodes have parents") < i);
        }
    }

    #[test]
    fn a_chain_that_misses_at_the_root_is_a_new_root_branch_ranked_last() {
        let (tokens, tree) = small();
        let g = graft_chain(&tokens, &tree, &[30, 31], 8).expect("adds nodes");
        let root_children: Vec<u32> = g.buffers.children(0).iter().map(|&c| g.tokens[c]).collect();
        assert_eq!(root_children, vec![11, 12, 30]);
        assert_eq!(g.buffers.num_nodes(), 6);
    }

    #[test]
    fn nothing_is_grafted_when_the_chain_is_already_a_path_or_no_node_may_be_added() {
        let (tokens, tree) = small();
        assert_eq!(graft_chain(&tokens, &tree, &[11, 13], 8), None);
        assert_eq!(graft_chain(&tokens, &tree, &[], 8), None);
        assert_eq!(graft_chain(&tokens, &tree, &[12, 40], 0), None);
    }

    #[test]
    fn the_node_budget_cuts_the_chain_not_the_tree() {
        let (tokens, tree) = small();
        let g = graft_chain(&tokens, &tree, &[12, 40, 41, 42], 2).expect("adds nodes");
        assert_eq!(g.added, 2);
        assert_eq!(
            paths_as_tokens(&g),
            vec![vec![10, 11, 13], vec![10, 12, 40, 41]]
        );
    }

    #[test]
    fn token_matching_follows_the_graft_where_the_target_agrees_with_the_chain() {
        let (tokens, tree) = small();
        let g = graft_chain(&tokens, &tree, &[11, 20, 21], 8).expect("adds nodes");
        // The target's token at each node: 11 after the root, 20 after 11, 21 after 20, 5
        // after 21 (the bonus); wrong guesses elsewhere.
        let target: Vec<u32> = g
            .tokens
            .iter()
            .map(|&t| match t {
                10 => 11,
                11 => 20,
                20 => 21,
                21 => 5,
                _ => 99,
            })
            .collect();
        let acc = greedy_tree(&g.tokens, &target, g.buffers.retrieve_paths()).expect("accepts");
        assert_eq!(acc.tokens, vec![11, 20, 21, 5]);
        assert_eq!(acc.accepted_len, 3);
    }
}

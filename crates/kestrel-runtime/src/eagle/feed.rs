//! Feeding draft-tree nodes to the EAGLE head.
//!
//! The head's KV cache holds only committed pairs. To draft one tree level, the nodes that
//! lead to that level (the expanded nodes and their ancestors) are fed in one forward with an
//! ancestor mask, their outputs read, and the cache truncated back to the committed pairs.
//! Re-feeding the few ancestors costs little and keeps rejected branches out of the cache
//! without a mask over previously cached slots (TensorRT-LLM's EagleNets re-feed likewise).

use super::node_outputs::{NodeOutputs, NodeRef};
use crate::error::Result;
use candle_core::Tensor;
use kestrel_model::{EagleHead, EagleSeqInput, Llama, OutputRows, PagedKvCache, SeqId};

/// Node ids are local to one sequence's tree; id 0 is the root, whose output is the head's
/// prediction from the committed pairs.
pub(crate) struct TreeFeed {
    /// Which of the drafted roots' trees this grows (its nodes' outputs in [`NodeOutputs`]).
    pub tree: usize,
    pub seq: SeqId,
    /// Committed head pairs: the cache length to return to.
    pub committed: usize,
    /// Head position of the root's pair; a node at depth d sits at `root_pos + d`.
    pub root_pos: usize,
    /// Nodes to feed (never the root), parents before children.
    pub nodes: Vec<usize>,
    /// Their tokens; empty when they are on the device ([`feed_trees`]' `device_ids`).
    pub tokens: Vec<u32>,
    pub parents: Vec<usize>,
    pub depths: Vec<usize>,
    /// Indices into `nodes` whose outputs are wanted.
    pub want: Vec<usize>,
}

/// Runs one head forward over the feeds (each grows its `tree` of `outputs`, which must hold
/// the output of each fed node's parent: the feature it is paired with);
/// returns the outputs of the wanted nodes, `[Σ want, hidden]`, feed by feed. The fed tokens
/// are the feeds' own, or `device_ids` (u32, feed after feed) when they were drafted on the
/// device, in which case the feeds carry none.
pub(crate) fn feed_trees(
    head: &EagleHead,
    base: &Llama,
    cache: &mut PagedKvCache,
    feeds: &[TreeFeed],
    device_ids: Option<&Tensor>,
    outputs: &NodeOutputs,
) -> Result<Tensor> {
    let positions: Vec<Vec<u32>> = feeds
        .iter()
        .map(|f| f.depths.iter().map(|&d| (f.root_pos + d) as u32).collect())
        .collect();
    let masks: Vec<Vec<bool>> = feeds.iter().map(ancestor_mask).collect();
    let parents: Vec<NodeRef> = feeds
        .iter()
        .flat_map(|f| f.parents.iter().map(move |&p| (f.tree, p)))
        .collect();
    let features = outputs.gather(&parents)?;
    let mut offset = 0;
    let mut batch = Vec::with_capacity(feeds.len());
    for (i, f) in feeds.iter().enumerate() {
        batch.push(EagleSeqInput {
            seq: f.seq,
            tokens: &f.tokens,
            features: features.narrow(0, offset, f.nodes.len())?,
            positions: &positions[i],
            mask: Some(&masks[i]),
            output_rows: OutputRows::Rows(f.want.clone()),
        });
        offset += f.nodes.len();
    }
    let out = match device_ids {
        Some(ids) => head.forward_device_ids(base, &batch, ids, cache)?,
        None => head.forward(base, &batch, cache)?,
    };
    for f in feeds {
        cache.truncate(f.seq, f.committed)?;
    }
    Ok(out)
}

/// Row i, column j: node j is node i or one of its ancestors (among the fed nodes).
fn ancestor_mask(feed: &TreeFeed) -> Vec<bool> {
    let n = feed.nodes.len();
    let mut mask = vec![false; n * n];
    for i in 0..n {
        let mut cur = feed.nodes[i];
        while let Some(j) = feed.nodes.iter().position(|&x| x == cur) {
            mask[i * n + j] = true;
            cur = feed.parents[j];
        }
    }
    mask
}

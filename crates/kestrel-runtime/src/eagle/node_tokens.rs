//! The tokens of the static trees being drafted. Sampled children (exact acceptance: their
//! ids come back from the draw, which the host must know to walk the tree's laws) and, with
//! `device::set_draft_on_device(false)`, top-k children are host tokens. Otherwise each
//! level's top-k stays where the head's logits are, in a pool that feeds and the
//! verification gather their ids from, so drafting a tree never waits for the device: on a
//! GPU the host queues every level and the verification without a round trip, and the
//! drafted tokens cross once, with the target's, after the verification.

use super::draft::DraftRoot;
use crate::error::Result;
use candle_core::{Device, Tensor};
use kestrel_kernels::gather_rows;
use kestrel_spec::tree::DraftPick;

pub(crate) enum NodeTokens {
    /// `tokens[tree][node]`.
    Host(Vec<Vec<u32>>),
    Pooled(TokenPool),
}

pub(crate) struct TokenPool {
    /// u32: the roots' tokens, then each level's children (`[rows, k]`, flattened) in turn.
    pool: Tensor,
    /// `at[tree][node]`: the node's entry of `pool` (the root's until the node is drafted).
    at: Vec<Vec<u32>>,
}

/// The drafted tokens of a batch of trees.
pub(crate) struct DraftedTokens {
    /// `[tree][node]`, or empty vectors when the tokens are in `device`.
    pub host: Vec<Vec<u32>>,
    /// u32, tree after tree, node by node.
    pub device: Option<Tensor>,
}

impl NodeTokens {
    /// Trees of `nodes` nodes, each set to its root's token for now.
    pub fn host(roots: &[DraftRoot], nodes: usize) -> Self {
        NodeTokens::Host(roots.iter().map(|r| vec![r.token; nodes]).collect())
    }

    /// [`NodeTokens::host`]'s trees, kept on `device`.
    pub fn pooled(roots: &[DraftRoot], nodes: usize, device: &Device) -> Result<Self> {
        let tokens: Vec<u32> = roots.iter().map(|r| r.token).collect();
        Ok(NodeTokens::Pooled(TokenPool {
            pool: Tensor::from_vec(tokens, roots.len(), device)?,
            at: (0..roots.len() as u32).map(|s| vec![s; nodes]).collect(),
        }))
    }

    /// The tokens of nodes `fed` of every tree, for a head feed: per tree on the host, or
    /// (empty per tree) as one device tensor, tree after tree.
    pub fn feed(&self, fed: &[usize]) -> Result<DraftedTokens> {
        match self {
            NodeTokens::Host(tokens) => Ok(DraftedTokens {
                host: tokens
                    .iter()
                    .map(|t| fed.iter().map(|&i| t[i]).collect())
                    .collect(),
                device: None,
            }),
            NodeTokens::Pooled(p) => p.gather(|at| fed.iter().map(|&i| at[i]).collect()),
        }
    }

    /// Sets a level's picked nodes from the children of its expanded nodes: host rows
    /// (`children[tree · width + slot]`, best first) or, pooled, u32 `[trees · width, k]` ids
    /// where the pool is.
    pub fn place(&mut self, children: Children, width: usize, picks: &[DraftPick]) -> Result<()> {
        match (self, children) {
            (NodeTokens::Host(tokens), Children::Host(rows)) => {
                for (t, rows) in tokens.iter_mut().zip(rows.chunks(width)) {
                    for pick in picks {
                        t[pick.node] = rows[pick.parent_slot][pick.rank];
                    }
                }
            }
            (NodeTokens::Pooled(p), Children::Device(ids)) => {
                let k = ids.dim(1)?;
                let base = p.pool.dim(0)?;
                for (s, at) in p.at.iter_mut().enumerate() {
                    for pick in picks {
                        at[pick.node] =
                            (base + (s * width + pick.parent_slot) * k + pick.rank) as u32;
                    }
                }
                p.pool = Tensor::cat(&[&p.pool, &ids.flatten_all()?], 0)?;
            }
            _ => unreachable!("children are drawn where the trees' tokens are kept"),
        }
        Ok(())
    }

    /// Every tree's tokens.
    pub fn finish(self) -> Result<DraftedTokens> {
        match self {
            NodeTokens::Host(host) => Ok(DraftedTokens { host, device: None }),
            NodeTokens::Pooled(p) => p.gather(|at| at.to_vec()),
        }
    }
}

/// A level's children of every expanded node.
pub(crate) enum Children {
    Host(Vec<Vec<u32>>),
    Device(Tensor),
}

impl TokenPool {
    /// The entries `entries(at[tree])` of every tree, in one gather.
    fn gather(&self, entries: impl Fn(&[u32]) -> Vec<u32>) -> Result<DraftedTokens> {
        let index: Vec<u32> = self.at.iter().flat_map(|at| entries(at)).collect();
        let len = index.len();
        let index = Tensor::from_vec(index, len, self.pool.device())?;
        Ok(DraftedTokens {
            host: vec![Vec::new(); self.at.len()],
            device: Some(gather_rows(&self.pool, &index)?),
        })
    }
}

//! The head's output (a predicted feature) for every node of the trees being drafted, kept in
//! one device buffer. A level's parents and its expanded nodes are each gathered with one
//! row gather, and a level's outputs written with one row scatter, where keeping a tensor per
//! node cost a copy per node (on a GPU, a launch each) every time they were concatenated.

use super::draft::{root_outputs, DraftRoot};
use crate::error::Result;
use candle_core::Tensor;
use kestrel_kernels::{gather_rows, scatter_rows};

/// A node: `(tree, node id within the tree)`, trees in the order of the drafted roots.
pub(crate) type NodeRef = (usize, usize);

pub(crate) struct NodeOutputs {
    /// `[trees × per_tree, hidden]`.
    buf: Tensor,
    per_tree: usize,
}

impl NodeOutputs {
    /// Room for `per_tree` nodes in each root's tree; node 0 of tree s holds root s's output.
    pub fn new(roots: &[DraftRoot], per_tree: usize) -> Result<Self> {
        let first = &roots
            .first()
            .expect("drafting starts from at least one root")
            .output;
        let hidden = first.dim(1)?;
        let buf = Tensor::zeros(
            (roots.len() * per_tree, hidden),
            first.dtype(),
            first.device(),
        )?;
        let mut outputs = NodeOutputs { buf, per_tree };
        let ids: Vec<NodeRef> = (0..roots.len()).map(|s| (s, 0)).collect();
        outputs.set(&ids, &root_outputs(roots)?)?;
        Ok(outputs)
    }

    fn rows<'a>(&'a self, ids: &'a [NodeRef]) -> impl Iterator<Item = u32> + 'a {
        ids.iter().map(|&(s, n)| {
            debug_assert!(n < self.per_tree, "node {n} past the tree's room");
            (s * self.per_tree + n) as u32
        })
    }

    /// Stores `rows` (`[ids.len(), hidden]`) as the outputs of the nodes `ids`.
    pub fn set(&mut self, ids: &[NodeRef], rows: &Tensor) -> Result<()> {
        let index: Vec<u32> = self.rows(ids).collect();
        let index = Tensor::from_vec(index, ids.len(), self.buf.device())?;
        Ok(scatter_rows(&self.buf, &index, rows)?)
    }

    /// The outputs of the nodes `ids` (stored before), `[ids.len(), hidden]`.
    pub fn gather(&self, ids: &[NodeRef]) -> Result<Tensor> {
        let index: Vec<u32> = self.rows(ids).collect();
        let index = Tensor::from_vec(index, ids.len(), self.buf.device())?;
        Ok(gather_rows(&self.buf, &index)?)
    }
}

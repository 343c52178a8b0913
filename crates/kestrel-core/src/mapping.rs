//! Tensor-parallel sharding rules for Llama weights (Megatron style).
//!
//! Column-parallel projections (q, k, v, gate, up) split their output rows; row-parallel
//! ones (o, down) split their input columns, so each rank's partial output is summed by an
//! all-reduce. When a model has fewer KV heads than ranks, each KV head is replicated onto
//! `tp_size / num_kv_heads` consecutive ranks, as TensorRT-LLM does.

use crate::config::ModelConfig;
use serde::{Deserialize, Serialize};
use std::ops::Range;

/// Which dimension of a weight a rank takes a slice of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardDim {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Split along dim 0 (output features of a column-parallel linear).
    Rows,
    /// Split along dim 1 (input features of a row-parallel linear).
    Cols,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    pub tp_size: usize,
}

/// The unit a tensor is split by: whole heads or plain features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    QueryHeads,
    KvHeads,
    Features,
}

impl Mapping {
    pub fn new(tp_size: usize) -> Self {
        Mapping { tp_size }
    }

    /// Checks that the model can be split into `tp_size` ranks.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<(), String> {
        let tp = self.tp_size;
        if tp == 0 {
            return Err("--tp_size must be at least 1".into());
        }
        let kv = cfg.num_kv_heads();
        let checks = [
            ("num_attention_heads", cfg.num_attention_heads),
            ("intermediate_size", cfg.intermediate_size),
        ];
        for (name, value) in checks {
            if !value.is_multiple_of(tp) {
                return Err(format!(
                    "{name} ({value}) is not divisible by --tp_size {tp}: choose a tp_size that divides it"
                ));
            }
        }
        if !kv.is_multiple_of(tp) && !tp.is_multiple_of(kv) {
            return Err(format!(
                "num_key_value_heads ({kv}) and --tp_size {tp} must divide one another"
            ));
        }
        Ok(())
    }

    /// How a tensor with this HF name is split.
    pub fn shard_dim(name: &str) -> ShardDim {
        let column = ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"];
        let row = ["o_proj", "down_proj"];
        if column.iter().any(|p| name.contains(p)) {
            ShardDim::Rows
        } else if row.iter().any(|p| name.contains(p)) {
            ShardDim::Cols
        } else {
            ShardDim::Replicated
        }
    }

    fn unit(name: &str) -> Unit {
        if name.contains("k_proj") || name.contains("v_proj") {
            Unit::KvHeads
        } else if name.contains("q_proj") || name.contains("o_proj") {
            Unit::QueryHeads
        } else {
            Unit::Features
        }
    }

    /// Query heads and KV heads held by each rank.
    pub fn heads_per_rank(&self, cfg: &ModelConfig) -> (usize, usize) {
        let kv = cfg.num_kv_heads();
        (
            cfg.num_attention_heads / self.tp_size,
            (kv / self.tp_size).max(1),
        )
    }

    /// The slice (along the split dimension, in elements) that `rank` holds of tensor `name`
    /// whose split dimension has `len` elements; `None` for a replicated tensor.
    pub fn shard_range(
        &self,
        cfg: &ModelConfig,
        name: &str,
        len: usize,
        rank: usize,
    ) -> Option<Range<usize>> {
        if Self::shard_dim(name) == ShardDim::Replicated || self.tp_size == 1 {
            return None;
        }
        let tp = self.tp_size;
        match Self::unit(name) {
            Unit::KvHeads if cfg.num_kv_heads() < tp => {
                let head_dim = len / cfg.num_kv_heads();
                let head = rank * cfg.num_kv_heads() / tp;
                Some(head * head_dim..(head + 1) * head_dim)
            }
            _ => {
                let per_rank = len / tp;
                Some(rank * per_rank..(rank + 1) * per_rank)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        serde_json::from_str(&format!(
            r#"{{"vocab_size": 32, "hidden_size": {}, "intermediate_size": 48,
                "num_hidden_layers": 1, "num_attention_heads": {heads}, "num_key_value_heads": {kv}}}"#,
            heads * 4
        ))
        .unwrap()
    }

    #[test]
    fn splits_follow_megatron() {
        assert_eq!(
            Mapping::shard_dim("model.layers.0.self_attn.q_proj.weight"),
            ShardDim::Rows
        );
        assert_eq!(
            Mapping::shard_dim("model.layers.0.mlp.down_proj.weight"),
            ShardDim::Cols
        );
        assert_eq!(
            Mapping::shard_dim("model.norm.weight"),
            ShardDim::Replicated
        );
    }

    #[test]
    fn kv_heads_replicate_when_fewer_than_ranks() {
        let c = cfg(8, 2);
        let m = Mapping::new(4);
        assert_eq!(m.validate(&c), Ok(()));
        // 2 KV heads of dim 4 over 4 ranks: ranks 0,1 share head 0 and ranks 2,3 head 1.
        let ranges: Vec<_> = (0..4)
            .map(|r| m.shard_range(&c, "model.layers.0.self_attn.k_proj.weight", 8, r))
            .collect();
        assert_eq!(ranges, vec![Some(0..4), Some(0..4), Some(4..8), Some(4..8)]);
        assert_eq!(
            m.shard_range(&c, "model.layers.0.self_attn.q_proj.weight", 32, 3),
            Some(24..32)
        );
    }

    #[test]
    fn indivisible_heads_are_refused() {
        let c = cfg(9, 3);
        assert_eq!(
            Mapping::new(2).validate(&c).unwrap_err(),
            "num_attention_heads (9) is not divisible by --tp_size 2: choose a tp_size that divides it"
        );
    }
}

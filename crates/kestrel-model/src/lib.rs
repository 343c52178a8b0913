//! The Llama-family decoder and the EAGLE-1 draft head on candle, with a paged KV cache.
//!
//! This crate knows nothing about speculation: [`Llama::forward`] runs one step over an
//! explicit batch ([`SeqInput`]: tokens, RoPE positions, an optional attention mask over the
//! step's new tokens, the rows whose hidden states are wanted) and writes the new K/V into
//! the sequence's next slots of a [`PagedKvCache`]. Tree verification is a forward with a tree
//! mask and depth positions followed by [`PagedKvCache::compact`].
//!
//! On CPU, projections of a few rows (decode, short drafts) go through a hand-written
//! multi-threaded matrix-vector kernel ([`matvec`]); everything else is plain candle and runs
//! on candle's CUDA backend as well. On CUDA, the ops a plan assigns to Kestrel's own kernels
//! ([`CudaKernels`]: paged attention, KV append, fused add + RMSNorm, SwiGLU) run those
//! (`kestrel-kernels`) instead of sequences of candle ops.

mod amx;
mod arena;
mod batched_attn;
pub mod cache;
mod cpu_attn;
mod cpu_elementwise;
mod cpu_norm;
pub mod cuda_kernels;
pub mod eagle;
pub mod error;
mod layer;
pub mod llama;
pub mod matvec;
mod matvec_bf16;
pub mod matvec_quant;
pub mod prefix_cache;
mod rope;
mod row_gemm;
mod step;
mod step_graph;
mod step_ids;
mod team;
pub mod unshard;
mod weights;

pub use cache::{Compaction, PagedKvCache, SeqId};
pub use cuda_kernels::CudaKernels;
pub use eagle::{EagleHead, EagleSeqInput, TrainUnroll};
pub use error::{ModelError, Result};
pub use llama::{Llama, LmHeadRows, OutputRows, SeqInput};
pub use prefix_cache::PrefixKeys;
pub use rope::inv_freq;
pub use step_graph::GraphActivity;

/// The candle dtype of a Kestrel dtype.
pub fn candle_dtype(dtype: kestrel_core::DType) -> candle_core::DType {
    match dtype {
        kestrel_core::DType::F32 => candle_core::DType::F32,
        kestrel_core::DType::F16 => candle_core::DType::F16,
        kestrel_core::DType::BF16 => candle_core::DType::BF16,
    }
}

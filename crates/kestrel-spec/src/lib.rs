//! Speculative-decoding algorithms on plain vectors: no tensors, no devices.
//!
//! - [`tree`]: EAGLE-1 static trees (`eagle_choices`): parsing, validation against the engine's
//!   limits, and the verification/drafting buffers ([`tree::TreeBuffers`]); preset trees.
//! - [`dynamic`]: EAGLE-2 dynamic tree expansion (cumulative log-prob scores, global top-k
//!   frontier, final rerank) producing the same [`tree::TreeBuffers`].
//! - [`prompt_lookup`]: prompt lookup decoding's drafts (the tokens after the latest earlier
//!   occurrence of the sequence's final n-gram), backed by [`ngram_corpus`], an n-gram model
//!   of the target's answers to other prompts.
//! - [`graft`]: a chain drafter's tokens grafted onto a drafted tree, so that one
//!   verification checks both drafters' guesses.
//! - [`sampling`]: temperature / top-k / top-p warping, greedy argmax, seeded per-sequence RNG.
//! - [`accept`]: acceptance rules: greedy tree matching, TensorRT-LLM typical acceptance,
//!   lossless multi-candidate tree rejection sampling, and draft-target speculative sampling.
//!
//! Conventions shared by every module:
//! - Tokens are `u32`. A tree has `n + 1` nodes; node 0 is the root (the token already sampled
//!   from the target), nodes `1..=n` are draft tokens in topological order (sorted by depth).
//! - Per-node distributions are flat row-major slices: `num_nodes * vocab_size` values.

pub mod accept;
pub mod dynamic;
pub mod graft;
pub mod ngram_corpus;
pub mod prompt_lookup;
pub mod sampling;
pub mod tree;

pub use accept::{AcceptError, ChainAcceptance, DraftProposal, TreeAcceptance, TypicalParams};
pub use dynamic::{DynamicTree, DynamicTreeBuilder, DynamicTreeConfig, DynamicTreeError};
pub use graft::{graft_chain, GraftedTree};
pub use ngram_corpus::NgramCorpus;
pub use prompt_lookup::{PromptLookupConfig, PromptLookupError};
pub use sampling::{SamplingError, SamplingParams, SeqRng};
pub use tree::{EagleTree, TreeBuffers, TreeError, TreeLimits};

#[cfg(test)]
mod stats;

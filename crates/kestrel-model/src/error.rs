//! Errors of the model crate; each names the tensor, file or sequence at fault.

use crate::cache::SeqId;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("tensor '{name}' is missing from {origin}")]
    MissingTensor { name: String, origin: String },
    #[error("tensor '{name}' in {origin} has shape {got:?}, expected {expected:?}")]
    ShapeMismatch {
        name: String,
        origin: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("cannot read {path}: {message}")]
    File { path: String, message: String },
    #[error("invalid model config: {0}")]
    Config(String),
    #[error("KV cache out of blocks: {needed} more needed, {free} free (raise num_blocks or finish sequences)")]
    OutOfBlocks { needed: usize, free: usize },
    #[error("unknown sequence {0:?} (never added or already freed)")]
    UnknownSequence(SeqId),
    #[error("invalid input: {0}")]
    InvalidInput(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, ModelError>;

pub(crate) fn invalid(msg: impl Into<String>) -> ModelError {
    ModelError::InvalidInput(msg.into())
}

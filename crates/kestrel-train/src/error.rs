//! Errors of the training library; each message names the file, flag or tensor at fault.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum TrainError {
    #[error("{path}: {message}")]
    File { path: String, message: String },
    #[error("{0}")]
    InvalidInput(String),
    #[error("{path}: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
    #[error(transparent)]
    Model(#[from] kestrel_model::ModelError),
    #[error(transparent)]
    Runtime(#[from] kestrel_runtime::RuntimeError),
    #[error(transparent)]
    Core(#[from] kestrel_core::CoreError),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, TrainError>;

pub(crate) fn invalid(message: impl Into<String>) -> TrainError {
    TrainError::InvalidInput(message.into())
}

pub(crate) fn file_err(path: &std::path::Path, message: impl std::fmt::Display) -> TrainError {
    TrainError::File {
        path: path.display().to_string(),
        message: message.to_string(),
    }
}

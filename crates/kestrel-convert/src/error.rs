use kestrel_core::CoreError;
use kestrel_formats::FormatError;
use thiserror::Error;

/// Errors of a conversion; each message is one line naming the flag, file or tensor.
#[derive(Debug, Error)]
pub enum ConvertError {
    /// Reading the source checkpoint or EAGLE head failed.
    #[error(transparent)]
    Format(#[from] FormatError),
    /// A configuration or checkpoint contract error from kestrel-core.
    #[error(transparent)]
    Core(#[from] CoreError),
    /// A flag's value is out of range or inconsistent with the model.
    #[error("{0}")]
    Invalid(String),
    /// Reading an input to digest it, or writing the output, failed.
    #[error("{path}: {message}")]
    Io { path: String, message: String },
}

use kestrel_core::CoreError;
use std::path::Path;
use thiserror::Error;

/// Errors raised while reading a checkpoint.
///
/// Every message is one line that names the file (and the tensor or metadata key, when there is
/// one) and says what to do, because the command-line tools print it verbatim.
#[derive(Debug, Error)]
pub enum FormatError {
    /// A problem with a whole file or directory.
    #[error("{path}: {message}")]
    File { path: String, message: String },
    /// A problem with one tensor of a file.
    #[error("{path}: tensor '{tensor}': {message}")]
    Tensor {
        path: String,
        tensor: String,
        message: String,
    },
    /// An invalid `config.json` (reported by kestrel-core, which names the file and key).
    #[error(transparent)]
    Config(#[from] CoreError),
}

impl FormatError {
    pub(crate) fn file(path: &Path, message: impl Into<String>) -> Self {
        FormatError::File {
            path: path.display().to_string(),
            message: message.into(),
        }
    }

    pub(crate) fn tensor(path: &Path, tensor: &str, message: impl Into<String>) -> Self {
        FormatError::Tensor {
            path: path.display().to_string(),
            tensor: tensor.to_string(),
            message: message.into(),
        }
    }
}

/// Flattens a (possibly multi-line, backtrace-carrying) candle error into one line.
pub(crate) fn one_line(e: impl std::fmt::Display) -> String {
    let text = e.to_string();
    let first = text.lines().next().unwrap_or("").trim();
    first.to_string()
}

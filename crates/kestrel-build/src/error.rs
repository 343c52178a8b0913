use std::path::Path;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum BuildError {
    #[error(transparent)]
    Checkpoint(#[from] kestrel_core::CoreError),
    /// A flag (or combination of flags) that cannot be built; the message names it.
    #[error("{0}")]
    InvalidOption(String),
    /// A weight file that does not match the checkpoint's config.
    #[error("{file}: {message}")]
    InvalidWeights { file: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

impl BuildError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> Self {
        BuildError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    pub(crate) fn option(message: impl Into<String>) -> Self {
        BuildError::InvalidOption(message.into())
    }
}

use thiserror::Error;

/// Errors raised while validating configurations and reading or writing plans.
///
/// Every message names the offending field or file and what to do about it, because these
/// messages reach users verbatim through the command-line tools.
#[derive(Debug, Error)]
pub enum CoreError {
    #[error("{0}")]
    InvalidConfig(String),
    #[error("{path}: {message}")]
    InvalidPlan { path: String, message: String },
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: invalid JSON: {source}")]
    Json {
        path: String,
        #[source]
        source: serde_json::Error,
    },
}

pub type Result<T> = std::result::Result<T, CoreError>;

impl CoreError {
    pub fn config(message: impl Into<String>) -> Self {
        CoreError::InvalidConfig(message.into())
    }
}

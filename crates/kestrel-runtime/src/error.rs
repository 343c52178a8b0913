use thiserror::Error;

#[derive(Debug, Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Plan(#[from] kestrel_core::CoreError),
    #[error(transparent)]
    Model(#[from] kestrel_model::ModelError),
    #[error("{0}")]
    Engine(String),
    #[error("{0}")]
    Tokenizer(String),
    /// A request the engine cannot serve; the message names the input and the limit.
    #[error("{0}")]
    InvalidRequest(String),
}

impl From<candle_core::Error> for RuntimeError {
    fn from(e: candle_core::Error) -> Self {
        RuntimeError::Model(kestrel_model::ModelError::from(e))
    }
}

pub type Result<T> = std::result::Result<T, RuntimeError>;

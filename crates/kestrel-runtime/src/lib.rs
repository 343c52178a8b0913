//! Runs engines: loads the plan and weights, batches requests and generates text with plain
//! decoding or a speculative mode. Greedy speculative output equals plain greedy output
//! token for token; sampled speculative output follows the target model's distribution.

pub mod chat;
pub mod device;
pub mod engine;
pub mod error;
mod generate;
mod plain;
pub mod request;
mod sequence;

pub use chat::{ChatMessage, ChatTemplate};
pub use engine::{Engine, TextCodec};
pub use error::{Result, RuntimeError};
pub use request::{
    FinishReason, GenerationParams, NoSink, RunTimings, SeqStats, SequenceOutput, TokenSink,
};

/// How to decode.
#[derive(Debug, Clone)]
pub enum DecodeMode {
    Plain,
}

/// Generates for every prompt (token ids) with `mode`, streaming committed tokens to `sink`.
pub fn generate(
    engine: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    sink: &mut dyn TokenSink,
) -> Result<(Vec<SequenceOutput>, RunTimings)> {
    match mode {
        DecodeMode::Plain => {
            let mut decoder = plain::PlainDecoder::new(engine)?;
            generate::drive(engine, &mut decoder, prompts, params, sink)
        }
    }
}

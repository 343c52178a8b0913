//! EAGLE-1/2 decoding (being written; see issue 3).

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::Decoder;
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use crate::EagleOptions;

pub(crate) struct EagleDecoder;

impl EagleDecoder {
    pub fn new(_engine: &Engine, _options: EagleOptions) -> Result<Self> {
        Err(RuntimeError::InvalidRequest(
            "EAGLE decoding is not available yet".into(),
        ))
    }
}

impl Decoder for EagleDecoder {
    fn run_batch(
        &mut self,
        _: &mut [Sequence],
        _: &GenerationParams,
        _: &mut dyn TokenSink,
        _: &mut RunTimings,
    ) -> Result<()> {
        unreachable!("EagleDecoder::new never succeeds yet")
    }
}

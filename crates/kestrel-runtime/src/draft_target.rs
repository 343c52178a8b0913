//! Draft-target speculative decoding (being written; see issue 4).

use crate::engine::Engine;
use crate::error::{Result, RuntimeError};
use crate::generate::Decoder;
use crate::request::{GenerationParams, RunTimings, TokenSink};
use crate::sequence::Sequence;
use crate::DraftTargetOptions;

pub(crate) struct DraftTargetDecoder;

impl DraftTargetDecoder {
    pub fn new(_target: &Engine, _draft: &Engine, _options: DraftTargetOptions) -> Result<Self> {
        Err(RuntimeError::InvalidRequest(
            "draft-target decoding is not available yet".into(),
        ))
    }
}

impl Decoder for DraftTargetDecoder {
    fn run_batch(
        &mut self,
        _: &mut [Sequence],
        _: &GenerationParams,
        _: &mut dyn TokenSink,
        _: &mut RunTimings,
    ) -> Result<()> {
        unreachable!("DraftTargetDecoder::new never succeeds yet")
    }
}

//! The draft engine of draft-target decoding, as spec-run and spec-bench load it: from its
//! directory, or re-quantized (`--draft_quantization q4`: projections at 4 bits, LM head at
//! 8), in which case the
//! target's own engine can be its draft without a second copy of its weights.

use anyhow::{Context, Result};
use candle_core::Device;
use kestrel_runtime::Engine;
use std::path::Path;

/// How a draft engine's projections are read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum DraftQuantization {
    /// As built.
    #[default]
    None,
    /// 4-bit copies of the decoder layers' projections and an 8-bit copy of the LM head,
    /// made when the draft loads (on the CPU or on CUDA).
    Q4,
}

/// The draft in `dir` for `target`. With [`DraftQuantization::Q4`], a `dir` that is the
/// target's own (on the same device) reuses the loaded target rather than loading it again.
pub fn load_draft(
    target: &Engine,
    dir: &Path,
    device: &Device,
    quantization: DraftQuantization,
) -> Result<Engine> {
    // The engine's own errors name its directory.
    let load = || Engine::load(dir, device).map_err(anyhow::Error::from);
    match quantization {
        DraftQuantization::None => load(),
        DraftQuantization::Q4 => {
            let loaded;
            let source = if same_dir(dir, &target.dir) && device.same_device(&target.device) {
                target
            } else {
                loaded = load()?;
                &loaded
            };
            let (draft, _) = source
                .quantized_draft()
                .with_context(|| format!("--draft_quantization q4 on {}", dir.display()))?;
            Ok(draft)
        }
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

//! The draft engine of draft-target decoding, as spec-run and spec-bench load it: from its
//! directory, or derived from an engine's weights (`--draft_quantization q4`: projections at
//! 4 bits, LM head at 8; `--draft_skip_layers`: some decoder layers passed over), in which
//! case the target's own engine can be its draft without a second copy of its weights.

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

/// How the draft derives from the engine it loads (spec-run's and spec-bench's flags).
#[derive(Debug, Clone, Default, clap::Args)]
#[command(rename_all = "snake_case")]
pub struct DraftDerivation {
    /// How the draft engine's weights are read: `none` (as built) or `q4` (4-bit copies of
    /// its decoder projections and an 8-bit LM head, made as it loads, on the CPU or CUDA).
    /// The target's own engine may be the draft.
    #[arg(long, value_enum, default_value_t)]
    pub draft_quantization: DraftQuantization,
    /// Decoder layers the draft passes over, e.g. "10-19" or "4,9,12-15" (0-based): the
    /// draft runs the others, self-speculation's layer skipping. With the target's own
    /// engine as the draft it adds no weights and reads the target's KV cache.
    #[arg(long, value_parser = parse_layer_list, default_value = "")]
    pub draft_skip_layers: LayerList,
}

impl DraftDerivation {
    /// Whether the draft is a derived copy rather than the engine as built.
    pub fn derives(&self) -> bool {
        self.draft_quantization != DraftQuantization::None || !self.draft_skip_layers.0.is_empty()
    }

    /// The flag that asked for a derived draft, for messages.
    pub fn flag(&self) -> &'static str {
        if self.draft_quantization != DraftQuantization::None {
            "--draft_quantization"
        } else {
            "--draft_skip_layers"
        }
    }

    /// `source`'s model as a draft for itself, as these flags derive it.
    pub fn self_draft(&self, source: &Engine) -> Result<Engine> {
        let quantize = self.draft_quantization == DraftQuantization::Q4;
        let (draft, _) = source
            .self_draft(quantize, &self.draft_skip_layers.0)
            .with_context(|| format!("the draft derived from {}", source.dir.display()))?;
        Ok(draft)
    }
}

/// Decoder layer indices, as `--draft_skip_layers` takes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LayerList(pub Vec<usize>);

/// "4,9,12-15" → [4, 9, 12, 13, 14, 15]; "" → none.
pub fn parse_layer_list(text: &str) -> Result<LayerList, String> {
    let mut layers = Vec::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let bad = || {
            format!("bad layer list {text:?}: {part:?} is not a layer index or a range like 10-19")
        };
        let index = |s: &str| s.trim().parse::<usize>().map_err(|_| bad());
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b) = (index(a)?, index(b)?);
                if a > b {
                    return Err(format!(
                        "bad layer list {text:?}: the range {part:?} is empty"
                    ));
                }
                layers.extend(a..=b);
            }
            None => layers.push(index(part)?),
        }
    }
    Ok(LayerList(layers))
}

/// The draft in `dir` for `target`, derived as `derivation` says. A derived draft whose `dir`
/// is the target's own (on the same device) reuses the loaded target rather than loading it
/// again.
pub fn load_draft(
    target: &Engine,
    dir: &Path,
    device: &Device,
    derivation: &DraftDerivation,
) -> Result<Engine> {
    // The engine's own errors name its directory.
    let load = || Engine::load(dir, device).map_err(anyhow::Error::from);
    if !derivation.derives() {
        return load();
    }
    if same_dir(dir, &target.dir) && device.same_device(&target.device) {
        return derivation.self_draft(target);
    }
    derivation.self_draft(&load()?)
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    }
}

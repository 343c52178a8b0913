use crate::error::BuildError;
use crate::kernels::TargetDevice;
use kestrel_core::checkpoint::CheckpointMeta;
use kestrel_core::plan::BuildLimits;
use kestrel_core::{DType, ModelConfig, SpeculativeMode};
use std::path::PathBuf;
use std::str::FromStr;

/// TensorRT-LLM's `--gemm_plugin`: which dtype the GEMMs run in, or `disable` for the
/// generic kernel. Kestrel runs GEMMs in the checkpoint dtype, so a named dtype must match it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPlugin {
    Auto,
    Disable,
    DType(DType),
}

impl FromStr for GemmPlugin {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(GemmPlugin::Auto),
            "disable" => Ok(GemmPlugin::Disable),
            other => other.parse::<DType>().map(GemmPlugin::DType).map_err(|_| {
                format!(
                    "unknown --gemm_plugin '{other}': expected auto, disable, float32, float16 or bfloat16"
                )
            }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub checkpoint_dir: PathBuf,
    pub output_dir: PathBuf,
    pub max_batch_size: usize,
    pub max_input_len: usize,
    pub max_seq_len: usize,
    pub max_beam_width: usize,
    pub speculative_mode: SpeculativeMode,
    /// `None` takes the checkpoint's value in EAGLE mode and is required otherwise.
    pub max_draft_len: Option<usize>,
    pub tokens_per_block: usize,
    pub use_paged_context_fmha: bool,
    pub gemm_plugin: GemmPlugin,
    pub target_device: TargetDevice,
    /// EAGLE engines: the default EAGLE-1 tree, as JSON paths or a preset name, validated
    /// against the engine's limits and written as `eagle_choices.json`.
    pub eagle_choices: Option<String>,
}

/// The most draft tokens one verification step may carry (TensorRT-LLM's bound).
pub const MAX_DRAFT_LEN_LIMIT: usize = 256;

impl BuildOptions {
    /// Validates the flags against the model and the checkpoint and derives the limits.
    pub fn limits(
        &self,
        model: &ModelConfig,
        meta: &CheckpointMeta,
    ) -> Result<BuildLimits, BuildError> {
        let fail = |m: String| Err(BuildError::option(m));
        if self.max_beam_width != 1 {
            return fail(format!(
                "--max_beam_width {} is not supported: Kestrel decodes with beam width 1 (speculative decoding has no beam search)",
                self.max_beam_width
            ));
        }
        for (flag, value) in [
            ("--max_batch_size", self.max_batch_size),
            ("--max_input_len", self.max_input_len),
            ("--max_seq_len", self.max_seq_len),
            ("--tokens_per_block", self.tokens_per_block),
        ] {
            if value == 0 {
                return fail(format!("{flag} must be at least 1"));
            }
        }
        if self.max_input_len >= self.max_seq_len {
            return fail(format!(
                "--max_input_len {} must be smaller than --max_seq_len {} (the sequence holds the input and at least one output token)",
                self.max_input_len, self.max_seq_len
            ));
        }
        if self.max_seq_len > model.max_position_embeddings {
            return fail(format!(
                "--max_seq_len {} exceeds the model's max_position_embeddings {}",
                self.max_seq_len, model.max_position_embeddings
            ));
        }
        if let GemmPlugin::DType(d) = self.gemm_plugin {
            if d != meta.dtype {
                return fail(format!(
                    "--gemm_plugin {d} does not match the checkpoint dtype {}: use --gemm_plugin auto or reconvert with --dtype {d}",
                    meta.dtype
                ));
            }
        }
        let (max_draft_len, num_eagle_layers, max_non_leaves) = match self.speculative_mode {
            SpeculativeMode::None => {
                if let Some(n) = self.max_draft_len.filter(|&n| n > 0) {
                    return fail(format!(
                        "--max_draft_len {n} needs a speculative mode: add --speculative_decoding_mode eagle or draft_tokens_external"
                    ));
                }
                (0, 0, 0)
            }
            SpeculativeMode::Eagle => {
                let Some(eagle) = &meta.eagle else {
                    return fail(format!(
                        "--speculative_decoding_mode eagle needs an EAGLE head, but {} has none: convert with --eagle_model_dir",
                        self.checkpoint_dir.display()
                    ));
                };
                let n = self.max_draft_len.unwrap_or(eagle.max_draft_len);
                (n, eagle.num_eagle_layers, eagle.max_non_leaves_per_layer)
            }
            SpeculativeMode::DraftTokensExternal => match self.max_draft_len {
                Some(n) if n > 0 => (n, 0, 0),
                _ => {
                    return fail(
                        "--speculative_decoding_mode draft_tokens_external needs --max_draft_len K (K ≥ 1)".into(),
                    )
                }
            },
        };
        if max_draft_len > MAX_DRAFT_LEN_LIMIT {
            return fail(format!(
                "--max_draft_len {max_draft_len} exceeds the limit of {MAX_DRAFT_LEN_LIMIT}"
            ));
        }
        Ok(BuildLimits {
            max_batch_size: self.max_batch_size,
            max_input_len: self.max_input_len,
            max_seq_len: self.max_seq_len,
            max_beam_width: 1,
            max_draft_len,
            num_eagle_layers,
            max_non_leaves_per_layer: max_non_leaves,
            tokens_per_block: self.tokens_per_block,
        })
    }
}

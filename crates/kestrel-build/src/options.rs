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

/// Which family of attention kernels a CUDA engine runs (`--attention_kernel`). Every step
/// of the engine (decode, drafting, verification, prefill) takes the same one, since the two
/// sum in different orders and a verified row must have the bits its decode step would.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// FMAs a (row, head) at a time or four rows sharing staged chunks: the fastest decode
    /// steps, batched decode included.
    Scalar,
    /// Tiles of 64 K/V rows staged once for 16 rows a warp and summed on the tensor cores
    /// (f16/bf16, heads of 64 or 128, trees of at most [`TENSOR_CORE_MAX_TREE`] tokens):
    /// verifications and long contexts several times faster, one-row steps slower.
    TensorCores,
}

/// Most tokens a tree verification may bring for `--attention_kernel tensor_cores`
/// (`kestrel_kernels::TC_MAX_MASKED_NEW`; a kestrel-runtime test holds them equal).
pub const TENSOR_CORE_MAX_TREE: usize = 64;

impl FromStr for AttentionKernel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "scalar" => Ok(AttentionKernel::Scalar),
            "tensor_cores" => Ok(AttentionKernel::TensorCores),
            other => Err(format!(
                "unknown --attention_kernel '{other}': expected scalar or tensor_cores"
            )),
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
    pub attention_kernel: AttentionKernel,
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
        if self.attention_kernel == AttentionKernel::TensorCores {
            self.check_tensor_cores(model, meta, max_draft_len)?;
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

    /// `--attention_kernel tensor_cores` needs a CUDA target, 16-bit weights, heads of 64 or
    /// 128 and, for EAGLE, verification trees (the root and `max_draft_len` drafts) of at most
    /// [`TENSOR_CORE_MAX_TREE`] tokens.
    fn check_tensor_cores(
        &self,
        model: &ModelConfig,
        meta: &CheckpointMeta,
        max_draft_len: usize,
    ) -> Result<(), BuildError> {
        let fail = |m: String| Err(BuildError::option(m));
        if self.target_device == TargetDevice::Cpu {
            return fail(
                "--attention_kernel tensor_cores needs a CUDA target: add --target_device cuda:sm_XY".into(),
            );
        }
        if meta.dtype == DType::F32 {
            return fail(
                "--attention_kernel tensor_cores needs float16 or bfloat16 weights, but the checkpoint is float32: reconvert with --dtype bfloat16".into(),
            );
        }
        let head_dim = model.head_dim();
        if head_dim != 64 && head_dim != 128 {
            return fail(format!(
                "--attention_kernel tensor_cores takes heads of 64 or 128 values; this model's have {head_dim}: use --attention_kernel scalar"
            ));
        }
        if self.speculative_mode == SpeculativeMode::Eagle
            && max_draft_len + 1 > TENSOR_CORE_MAX_TREE
        {
            return fail(format!(
                "--attention_kernel tensor_cores verifies trees of at most {TENSOR_CORE_MAX_TREE} tokens, but --max_draft_len {max_draft_len} makes {}: use --max_draft_len {} or less",
                max_draft_len + 1,
                TENSOR_CORE_MAX_TREE - 1
            ));
        }
        Ok(())
    }
}

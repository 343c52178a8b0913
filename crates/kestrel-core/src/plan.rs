//! The engine plan: everything `spec-run` needs to know about an engine besides its weights.
//!
//! On disk, `plan.bin` is `MAGIC | format version (u32 LE) | SHA-256 of payload | payload`,
//! where the payload is the plan encoded with bincode 2. `plan.json` beside it is the same
//! plan for people to read; the runtime only trusts `plan.bin`. The model configuration is
//! kept as canonical JSON inside the plan because HF's config uses shapes (an id or a list of
//! ids) that a non-self-describing format like bincode cannot decode.

use crate::config::ModelConfig;
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::mapping::Mapping;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::path::Path;

pub const PLAN_FILE: &str = "plan.bin";
pub const PLAN_JSON_FILE: &str = "plan.json";
/// An EAGLE engine's default EAGLE-1 tree (`spec-build --eagle_choices`): the validated paths
/// as JSON, beside the plan. spec-run and spec-bench draft it when no tree is given, so a tree
/// calibrated for the engine's device (`spec-train calibrate`) travels with the engine.
pub const EAGLE_CHOICES_FILE: &str = "eagle_choices.json";
const MAGIC: &[u8; 8] = b"KSTRLPLN";
/// Bumped whenever the plan's fields or the weight layout change meaning.
pub const PLAN_FORMAT_VERSION: u32 = 1;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpeculativeMode {
    None,
    Eagle,
    DraftTokensExternal,
}

impl SpeculativeMode {
    pub fn as_str(self) -> &'static str {
        match self {
            SpeculativeMode::None => "none",
            SpeculativeMode::Eagle => "eagle",
            SpeculativeMode::DraftTokensExternal => "draft_tokens_external",
        }
    }

    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(SpeculativeMode::None),
            "eagle" => Ok(SpeculativeMode::Eagle),
            "draft_tokens_external" => Ok(SpeculativeMode::DraftTokensExternal),
            other => Err(format!(
                "unknown --speculative_decoding_mode '{other}': expected none, eagle or draft_tokens_external"
            )),
        }
    }
}

/// The limits an engine is built for; the runtime refuses requests beyond them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BuildLimits {
    pub max_batch_size: usize,
    pub max_input_len: usize,
    pub max_seq_len: usize,
    pub max_beam_width: usize,
    pub max_draft_len: usize,
    pub num_eagle_layers: usize,
    pub max_non_leaves_per_layer: usize,
    pub tokens_per_block: usize,
}

/// The implementation picked for one operation on the engine's target device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelChoice {
    pub op: String,
    pub kernel: String,
}

/// One weight file of the engine and its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFile {
    pub rank: usize,
    pub file: String,
    pub sha256: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnginePlan {
    /// Canonical JSON of the target model's [`ModelConfig`].
    pub model_config_json: String,
    /// Canonical JSON of the EAGLE head's configuration, when the engine carries one.
    pub eagle_head_config_json: Option<String>,
    pub dtype: DType,
    pub mapping: Mapping,
    pub limits: BuildLimits,
    pub speculative_mode: SpeculativeMode,
    /// "cpu", or "cuda:sm_XY" for the compute capability the kernels were chosen for.
    pub target_device: String,
    pub kernels: Vec<KernelChoice>,
    pub weights: Vec<WeightFile>,
    /// The checkpoint's config.json digest, so an engine can be traced back to its source.
    pub source_checkpoint_sha256: String,
}

impl EnginePlan {
    pub fn model_config(&self) -> Result<ModelConfig> {
        serde_json::from_str::<ModelConfig>(&self.model_config_json)
            .map(ModelConfig::normalized)
            .map_err(|source| CoreError::Json {
                path: "plan model config".into(),
                source,
            })
    }

    /// Encodes the plan as `plan.bin` bytes (header, digest, payload).
    pub fn to_bytes(&self) -> Vec<u8> {
        let payload = bincode::serde::encode_to_vec(self, bincode::config::standard())
            .expect("an engine plan always encodes");
        let mut out = Vec::with_capacity(payload.len() + 44);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&PLAN_FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&Sha256::digest(&payload));
        out.extend_from_slice(&payload);
        out
    }

    /// Decodes `plan.bin` bytes, refusing other versions and corrupted files.
    pub fn from_bytes(bytes: &[u8], path: &str) -> Result<Self> {
        let bad = |message: String| CoreError::InvalidPlan {
            path: path.to_string(),
            message,
        };
        if bytes.len() < 44 || &bytes[..8] != MAGIC {
            return Err(bad(
                "not a Kestrel engine plan (bad magic): build the engine with spec-build".into(),
            ));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if version != PLAN_FORMAT_VERSION {
            return Err(bad(format!(
                "engine plan format version {version}, but this spec-run reads version {PLAN_FORMAT_VERSION}: rebuild the engine with this release's spec-build"
            )));
        }
        let payload = &bytes[44..];
        if Sha256::digest(payload).as_slice() != &bytes[12..44] {
            return Err(bad(
                "checksum mismatch: the engine plan is corrupted; rebuild the engine".into(),
            ));
        }
        let (plan, _) = bincode::serde::decode_from_slice::<EnginePlan, _>(
            payload,
            bincode::config::standard(),
        )
        .map_err(|e| bad(format!("cannot decode the engine plan: {e}")))?;
        Ok(plan)
    }

    /// Reads `<dir>/plan.bin`.
    pub fn load(dir: &Path) -> Result<Self> {
        let path = dir.join(PLAN_FILE);
        if !dir.is_dir() {
            return Err(CoreError::InvalidPlan {
                path: dir.display().to_string(),
                message: "engine directory does not exist".into(),
            });
        }
        let bytes = std::fs::read(&path).map_err(|_| CoreError::InvalidPlan {
            path: dir.display().to_string(),
            message: format!("not an engine directory (no {PLAN_FILE}): build one with spec-build"),
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// The plan as pretty JSON, for `plan.json`.
    pub fn to_pretty_json(&self) -> String {
        let mut value = serde_json::to_value(self).expect("plan serialises to JSON");
        // Show the embedded configs as objects rather than escaped strings.
        for key in ["model_config_json", "eagle_head_config_json"] {
            if let Some(serde_json::Value::String(s)) = value.get(key).cloned() {
                if let Ok(inner) = serde_json::from_str::<serde_json::Value>(&s) {
                    value[key] = inner;
                }
            }
        }
        value["format_version"] = PLAN_FORMAT_VERSION.into();
        serde_json::to_string_pretty(&value).expect("JSON value prints")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> EnginePlan {
        EnginePlan {
            model_config_json: r#"{"vocab_size":32}"#.into(),
            eagle_head_config_json: None,
            dtype: DType::F32,
            mapping: Mapping::new(1),
            limits: BuildLimits {
                max_batch_size: 4,
                max_input_len: 128,
                max_seq_len: 256,
                max_beam_width: 1,
                max_draft_len: 0,
                num_eagle_layers: 0,
                max_non_leaves_per_layer: 0,
                tokens_per_block: 16,
            },
            speculative_mode: SpeculativeMode::None,
            target_device: "cpu".into(),
            kernels: vec![KernelChoice {
                op: "gemm".into(),
                kernel: "candle-cpu".into(),
            }],
            weights: vec![],
            source_checkpoint_sha256: "00".into(),
        }
    }

    #[test]
    fn round_trips() {
        let p = plan();
        assert_eq!(EnginePlan::from_bytes(&p.to_bytes(), "x").unwrap(), p);
    }

    #[test]
    fn corruption_is_detected() {
        let mut bytes = plan().to_bytes();
        let last = bytes.len() - 1;
        bytes[last] ^= 1;
        assert_eq!(
            EnginePlan::from_bytes(&bytes, "e/plan.bin")
                .unwrap_err()
                .to_string(),
            "e/plan.bin: checksum mismatch: the engine plan is corrupted; rebuild the engine"
        );
    }

    #[test]
    fn other_versions_are_refused() {
        let mut bytes = plan().to_bytes();
        bytes[8] = 99;
        assert_eq!(
            EnginePlan::from_bytes(&bytes, "e/plan.bin").unwrap_err().to_string(),
            "e/plan.bin: engine plan format version 99, but this spec-run reads version 1: rebuild the engine with this release's spec-build"
        );
    }

    #[test]
    fn identical_plans_encode_identically() {
        assert_eq!(plan().to_bytes(), plan().to_bytes());
    }
}

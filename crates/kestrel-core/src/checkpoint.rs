//! The contract between `convert-checkpoint` (which writes it) and `spec-build` (which reads
//! it): a checkpoint directory's `config.json` is the model's HF config plus a `"kestrel"`
//! object described by [`CheckpointMeta`].

use crate::config::{EagleHeadConfig, ModelConfig};
use crate::dtype::DType;
use crate::error::{CoreError, Result};
use crate::mapping::Mapping;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const CHECKPOINT_FORMAT: &str = "kestrel-checkpoint";
pub const CHECKPOINT_VERSION: u32 = 1;
pub const CONFIG_FILE: &str = "config.json";
pub const TOKENIZER_FILE: &str = "tokenizer.json";
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
/// Tensor-name prefix of the EAGLE head's weights inside rank files.
pub const EAGLE_PREFIX: &str = "eagle.";

/// The weights file of one tensor-parallel rank, in checkpoints and engines alike.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank{rank}.safetensors")
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceFile {
    pub file: String,
    pub sha256: String,
}

/// The EAGLE head carried by a checkpoint, with the tree limits it was converted for.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EagleMeta {
    pub max_draft_len: usize,
    pub num_eagle_layers: usize,
    pub max_non_leaves_per_layer: usize,
    pub head_config: EagleHeadConfig,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointMeta {
    pub format: String,
    pub version: u32,
    pub dtype: DType,
    pub mapping: Mapping,
    pub source_files: Vec<SourceFile>,
    pub eagle: Option<EagleMeta>,
}

/// Reads a checkpoint directory's `config.json`: the model config and Kestrel's metadata.
pub fn read_checkpoint_config(dir: &Path) -> Result<(ModelConfig, CheckpointMeta)> {
    let path = dir.join(CONFIG_FILE);
    let shown = path.display().to_string();
    if !dir.is_dir() {
        return Err(CoreError::config(format!(
            "{}: checkpoint directory does not exist",
            dir.display()
        )));
    }
    let text = std::fs::read_to_string(&path).map_err(|_| {
        CoreError::config(format!(
            "{}: not a Kestrel checkpoint (no {CONFIG_FILE}): create one with convert-checkpoint",
            dir.display()
        ))
    })?;
    let mut value: serde_json::Value =
        serde_json::from_str(&text).map_err(|source| CoreError::Json {
            path: shown.clone(),
            source,
        })?;
    let meta_value = value
        .as_object_mut()
        .and_then(|o| o.remove("kestrel"))
        .ok_or_else(|| {
            CoreError::config(format!(
                "{shown}: has no \"kestrel\" section: this is a Hugging Face config, not a converted checkpoint; run convert-checkpoint first"
            ))
        })?;
    let meta: CheckpointMeta =
        serde_json::from_value(meta_value).map_err(|source| CoreError::Json {
            path: shown.clone(),
            source,
        })?;
    if meta.format != CHECKPOINT_FORMAT || meta.version != CHECKPOINT_VERSION {
        return Err(CoreError::config(format!(
            "{shown}: checkpoint format {} v{} is not {CHECKPOINT_FORMAT} v{CHECKPOINT_VERSION}: reconvert with this release's convert-checkpoint",
            meta.format, meta.version
        )));
    }
    let config: ModelConfig = serde_json::from_value::<ModelConfig>(value)
        .map_err(|source| CoreError::Json {
            path: shown.clone(),
            source,
        })?
        .normalized();
    config
        .validate()
        .map_err(|e| CoreError::config(format!("{shown}: {e}")))?;
    Ok((config, meta))
}

/// Renders a checkpoint `config.json`: the model config with the metadata under "kestrel".
pub fn checkpoint_config_json(config: &ModelConfig, meta: &CheckpointMeta) -> String {
    let mut value = serde_json::to_value(config).expect("config serialises");
    value["kestrel"] = serde_json::to_value(meta).expect("meta serialises");
    serde_json::to_string_pretty(&value).expect("JSON prints")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_through_a_directory() {
        let dir = std::env::temp_dir().join(format!("kestrel-ckpt-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config: ModelConfig = serde_json::from_str(
            r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
                "num_hidden_layers": 2, "num_attention_heads": 4}"#,
        )
        .unwrap();
        let meta = CheckpointMeta {
            format: CHECKPOINT_FORMAT.into(),
            version: CHECKPOINT_VERSION,
            dtype: DType::F32,
            mapping: Mapping::new(1),
            source_files: vec![],
            eagle: None,
        };
        std::fs::write(
            dir.join(CONFIG_FILE),
            checkpoint_config_json(&config, &meta),
        )
        .unwrap();
        let (c2, m2) = read_checkpoint_config(&dir).unwrap();
        assert_eq!((c2, m2), (config, meta));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_hf_config_is_not_a_checkpoint() {
        let dir = std::env::temp_dir().join(format!("kestrel-hf-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join(CONFIG_FILE), r#"{"vocab_size": 32}"#).unwrap();
        let err = read_checkpoint_config(&dir).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "{}: has no \"kestrel\" section: this is a Hugging Face config, not a converted checkpoint; run convert-checkpoint first",
                dir.join(CONFIG_FILE).display()
            )
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

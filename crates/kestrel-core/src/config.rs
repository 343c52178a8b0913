//! The Llama-family model configuration, read from Hugging Face `config.json`.

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// Architectures whose forward pass Kestrel implements.
pub const SUPPORTED_ARCHITECTURES: &[&str] = &["LlamaForCausalLM"];

/// `rope_scaling` as Llama-3.1 writes it (`rope_type: "llama3"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    pub factor: f64,
    #[serde(default = "default_low_freq_factor")]
    pub low_freq_factor: f64,
    #[serde(default = "default_high_freq_factor")]
    pub high_freq_factor: f64,
    #[serde(default = "default_original_max_pos")]
    pub original_max_position_embeddings: usize,
}

fn default_low_freq_factor() -> f64 {
    1.0
}
fn default_high_freq_factor() -> f64 {
    4.0
}
fn default_original_max_pos() -> usize {
    8192
}

/// transformers 5's `rope_parameters`: the theta and, unless `rope_type` is "default", the
/// scaling of the older `rope_scaling` key.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub rope_type: Option<String>,
    #[serde(default)]
    pub factor: Option<f64>,
    #[serde(default = "default_low_freq_factor")]
    pub low_freq_factor: f64,
    #[serde(default = "default_high_freq_factor")]
    pub high_freq_factor: f64,
    #[serde(default = "default_original_max_pos")]
    pub original_max_position_embeddings: usize,
}

/// One id or a list of ids: HF writes `eos_token_id` either way.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
}

/// A Llama-family decoder configuration, with HF's defaults for absent keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    #[serde(default = "default_architectures")]
    pub architectures: Vec<String>,
    #[serde(default = "default_model_type")]
    pub model_type: String,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Absent means multi-head attention (as many KV heads as query heads).
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Absent means hidden_size / num_attention_heads.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<RopeScaling>,
    /// transformers ≥ 5 writes RoPE settings here instead of `rope_theta`/`rope_scaling`;
    /// [`ModelConfig::normalized`] folds it into those two fields.
    #[serde(default, skip_serializing)]
    pub rope_parameters: Option<RopeParameters>,
    #[serde(default = "default_rms_norm_eps")]
    pub rms_norm_eps: f64,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "default_hidden_act")]
    pub hidden_act: String,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default)]
    pub mlp_bias: bool,
    #[serde(default)]
    pub bos_token_id: Option<u32>,
    #[serde(default)]
    pub eos_token_id: Option<TokenIds>,
    #[serde(default)]
    pub pad_token_id: Option<u32>,
}

fn default_architectures() -> Vec<String> {
    vec!["LlamaForCausalLM".to_string()]
}
fn default_model_type() -> String {
    "llama".to_string()
}
fn default_rope_theta() -> f64 {
    10000.0
}
fn default_rms_norm_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    2048
}
fn default_hidden_act() -> String {
    "silu".to_string()
}

impl ModelConfig {
    /// Reads and validates an HF `config.json`.
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let cfg: ModelConfig = serde_json::from_str(&text).map_err(|source| CoreError::Json {
            path: path.display().to_string(),
            source,
        })?;
        let cfg = cfg.normalized();
        cfg.validate()
            .map_err(|e| CoreError::config(format!("{}: {e}", path.display())))?;
        Ok(cfg)
    }

    /// Folds transformers 5's `rope_parameters` into `rope_theta` and `rope_scaling`, so the
    /// rest of Kestrel reads one spelling.
    pub fn normalized(mut self) -> Self {
        if let Some(p) = self.rope_parameters.take() {
            if let Some(theta) = p.rope_theta {
                self.rope_theta = theta;
            }
            match p.rope_type.as_deref() {
                None | Some("default") => {}
                Some(kind) => {
                    self.rope_scaling = Some(RopeScaling {
                        rope_type: kind.to_string(),
                        factor: p.factor.unwrap_or(1.0),
                        low_freq_factor: p.low_freq_factor,
                        high_freq_factor: p.high_freq_factor,
                        original_max_position_embeddings: p.original_max_position_embeddings,
                    })
                }
            }
        }
        self
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id
            .as_ref()
            .map(TokenIds::to_vec)
            .unwrap_or_default()
    }

    /// Number of parameters, counting a tied lm_head once.
    pub fn num_parameters(&self) -> usize {
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim();
        let kv = self.num_kv_heads() * self.head_dim();
        let per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        embed + head + h + per_layer * self.num_hidden_layers
    }

    /// Checks the invariants the forward pass relies on; messages name the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let arch_ok = self
            .architectures
            .iter()
            .any(|a| SUPPORTED_ARCHITECTURES.contains(&a.as_str()));
        if !arch_ok {
            return Err(format!(
                "unsupported architecture {:?} (\"architectures\" in config.json): Kestrel supports {}",
                self.architectures,
                SUPPORTED_ARCHITECTURES.join(", ")
            ));
        }
        if self.hidden_act != "silu" {
            return Err(format!(
                "unsupported hidden_act '{}': Llama models use 'silu'",
                self.hidden_act
            ));
        }
        for (name, value) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_kv_heads()),
        ] {
            if value == 0 {
                return Err(format!("{name} must be positive"));
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_kv_heads()) {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_kv_heads()
            ));
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return Err(format!(
                "hidden_size ({}) must be a multiple of num_attention_heads ({})",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for RoPE",
                self.head_dim()
            ));
        }
        if let Some(scaling) = &self.rope_scaling {
            if scaling.rope_type != "llama3" {
                return Err(format!(
                    "unsupported rope_scaling type '{}': only 'llama3' is implemented",
                    scaling.rope_type
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> ModelConfig {
        serde_json::from_str(json).unwrap()
    }

    const MINIMAL: &str = r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
        "num_hidden_layers": 2, "num_attention_heads": 4}"#;

    #[test]
    fn absent_keys_take_hf_defaults() {
        let cfg = parse(MINIMAL);
        assert_eq!(cfg.num_kv_heads(), 4);
        assert_eq!(cfg.head_dim(), 4);
        assert_eq!(cfg.rope_theta, 10000.0);
        assert!(!cfg.tie_word_embeddings);
        assert_eq!(cfg.validate(), Ok(()));
    }

    #[test]
    fn transformers5_rope_parameters_are_folded_in() {
        let cfg = parse(
            r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}}"#,
        )
        .normalized();
        assert_eq!(cfg.rope_theta, 500000.0);
        let s = cfg.rope_scaling.unwrap();
        assert_eq!(
            (
                s.rope_type.as_str(),
                s.factor,
                s.original_max_position_embeddings
            ),
            ("llama3", 8.0, 64)
        );
        let plain = parse(
            r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4,
            "rope_parameters": {"rope_theta": 20000.0, "rope_type": "default"}}"#,
        )
        .normalized();
        assert_eq!((plain.rope_theta, plain.rope_scaling), (20000.0, None));
    }

    #[test]
    fn eos_may_be_a_list() {
        let cfg = parse(
            r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "eos_token_id": [1, 7]}"#,
        );
        assert_eq!(cfg.eos_token_ids(), vec![1, 7]);
    }

    #[test]
    fn unknown_architecture_is_named() {
        let mut cfg = parse(MINIMAL);
        cfg.architectures = vec!["GPT2LMHeadModel".into()];
        assert_eq!(
            cfg.validate().unwrap_err(),
            "unsupported architecture [\"GPT2LMHeadModel\"] (\"architectures\" in config.json): Kestrel supports LlamaForCausalLM"
        );
    }

    #[test]
    fn kv_heads_must_divide_heads() {
        let mut cfg = parse(MINIMAL);
        cfg.num_key_value_heads = Some(3);
        assert_eq!(
            cfg.validate().unwrap_err(),
            "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"
        );
    }
}

/// An EAGLE-1/EAGLE-2 draft head's `config.json` as published: a Llama config (one layer in
/// published heads; EAGLE's code, like Kestrel, stacks `num_hidden_layers`, the first without
/// an input norm) plus the optional `bias` key of its `fc` projection (EAGLE's code defaults it
/// to true), and Kestrel's optional `feature_layers`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EagleHeadConfig {
    #[serde(flatten)]
    pub llama: ModelConfig,
    #[serde(default = "default_fc_bias")]
    pub bias: bool,
    /// Base decoder layers (0-based) whose output residual states, RMS-normalised without a
    /// weight, the head reads next to the base's final feature (EAGLE-3's low/mid-layer
    /// features): a `fuse` projection maps `cat(final, layer states…)` to the feature the
    /// head is fed for committed tokens. Empty (the published EAGLE-1 layout): the final
    /// feature alone, no `fuse`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub feature_layers: Vec<usize>,
}

fn default_fc_bias() -> bool {
    true
}

impl EagleHeadConfig {
    pub fn from_json_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let mut cfg: EagleHeadConfig =
            serde_json::from_str(&text).map_err(|source| CoreError::Json {
                path: path.display().to_string(),
                source,
            })?;
        cfg.llama = cfg.llama.normalized();
        cfg.llama
            .validate()
            .map_err(|e| CoreError::config(format!("{}: {e}", path.display())))?;
        Ok(cfg)
    }

    /// Width of the base features the head reads per token: the final feature plus one
    /// state per entry of `feature_layers`.
    pub fn feature_width(&self) -> usize {
        (1 + self.feature_layers.len()) * self.llama.hidden_size
    }

    /// Checks that the head fits the base model it drafts for.
    pub fn check_compatible(&self, base: &ModelConfig) -> std::result::Result<(), String> {
        if let Some(&l) = self
            .feature_layers
            .iter()
            .find(|&&l| l + 1 >= base.num_hidden_layers)
        {
            return Err(format!(
                "EAGLE head feature layer {l} is not below the base model's last layer {} \
                 (its output is the final feature, which the head always reads)",
                base.num_hidden_layers - 1
            ));
        }
        if let Some(w) = self.feature_layers.windows(2).find(|w| w[0] >= w[1]) {
            return Err(format!(
                "EAGLE head feature_layers must be strictly increasing, found {} then {}",
                w[0], w[1]
            ));
        }
        if self.llama.hidden_size != base.hidden_size {
            return Err(format!(
                "EAGLE head hidden_size {} differs from the base model's {}",
                self.llama.hidden_size, base.hidden_size
            ));
        }
        if self.llama.vocab_size != base.vocab_size {
            return Err(format!(
                "EAGLE head vocab_size {} differs from the base model's {}",
                self.llama.vocab_size, base.vocab_size
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod eagle_tests {
    use super::*;

    #[test]
    fn fc_bias_defaults_to_true_and_follows_config() {
        let base = r#""vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 1, "num_attention_heads": 4"#;
        let absent: EagleHeadConfig = serde_json::from_str(&format!("{{{base}}}")).unwrap();
        assert!(absent.bias);
        let off: EagleHeadConfig =
            serde_json::from_str(&format!("{{{base}, \"bias\": false}}")).unwrap();
        assert!(!off.bias);
        assert!(off.feature_layers.is_empty());
        assert!(!serde_json::to_string(&off)
            .unwrap()
            .contains("feature_layers"));
    }

    #[test]
    fn feature_layers_must_lie_below_the_last_base_layer_in_order() {
        let text = r#"{"vocab_size": 32, "hidden_size": 16, "intermediate_size": 40,
            "num_hidden_layers": 1, "num_attention_heads": 4, "feature_layers": [0, 2]}"#;
        let mut head: EagleHeadConfig = serde_json::from_str(text).unwrap();
        assert_eq!(head.feature_width(), 48);
        let mut base = head.llama.clone();
        base.num_hidden_layers = 4;
        assert_eq!(head.check_compatible(&base), Ok(()));
        base.num_hidden_layers = 3;
        assert_eq!(
            head.check_compatible(&base).unwrap_err(),
            "EAGLE head feature layer 2 is not below the base model's last layer 2 (its output \
             is the final feature, which the head always reads)"
        );
        base.num_hidden_layers = 4;
        head.feature_layers = vec![1, 1];
        assert_eq!(
            head.check_compatible(&base).unwrap_err(),
            "EAGLE head feature_layers must be strictly increasing, found 1 then 1"
        );
    }
}

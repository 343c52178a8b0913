use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Floating-point types that weights and activations may be stored in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    #[serde(rename = "float32")]
    F32,
    #[serde(rename = "float16")]
    F16,
    #[serde(rename = "bfloat16")]
    BF16,
}

impl DType {
    /// The name used on the command line and in config.json (TensorRT-LLM's spelling).
    pub fn as_str(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
        }
    }

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F16 | DType::BF16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for DType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "float32" | "f32" | "fp32" => Ok(DType::F32),
            "float16" | "f16" | "fp16" | "half" => Ok(DType::F16),
            "bfloat16" | "bf16" => Ok(DType::BF16),
            other => Err(format!(
                "unknown dtype '{other}': expected one of float32, float16, bfloat16"
            )),
        }
    }
}

//! Kernel selection: which implementation runs each op on the engine's target device.
//!
//! The choice is recorded in the plan so that an engine says what it will run, and so that
//! the runtime can refuse an engine built for a device it is not running on.

use crate::error::BuildError;
use crate::options::{BuildOptions, GemmPlugin};
use kestrel_core::{DType, KernelChoice};
use std::fmt;
use std::str::FromStr;

/// The device an engine is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TargetDevice {
    Cpu,
    /// A CUDA GPU of compute capability major.minor, e.g. (9, 0) for the H100/H200.
    Cuda {
        major: u32,
        minor: u32,
    },
}

impl fmt::Display for TargetDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TargetDevice::Cpu => f.write_str("cpu"),
            TargetDevice::Cuda { major, minor } => write!(f, "cuda:sm_{major}{minor}"),
        }
    }
}

impl FromStr for TargetDevice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "cpu" {
            return Ok(TargetDevice::Cpu);
        }
        let bad = || {
            format!("unknown --target_device '{s}': expected cpu or cuda:sm_XY (for example cuda:sm_90)")
        };
        let digits = s.strip_prefix("cuda:sm_").ok_or_else(bad)?;
        if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        Ok(TargetDevice::Cuda {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
        })
    }
}

fn choice(op: &str, kernel: &str) -> KernelChoice {
    KernelChoice {
        op: op.into(),
        kernel: kernel.into(),
    }
}

/// Picks the kernel for every op of a decode, prefill and verification step.
pub fn choose_kernels(
    target: TargetDevice,
    _dtype: DType,
    opts: &BuildOptions,
) -> Result<Vec<KernelChoice>, BuildError> {
    match target {
        TargetDevice::Cpu => {
            let gemm = match opts.gemm_plugin {
                GemmPlugin::Disable => "candle-cpu-gemm",
                _ => "kestrel-cpu-skinny-gemm+candle-cpu-gemm",
            };
            let context = if opts.use_paged_context_fmha {
                "kestrel-cpu-paged-attention"
            } else {
                "kestrel-cpu-contiguous-context-attention"
            };
            Ok(vec![
                choice("gemm", gemm),
                choice("attention.decode", "kestrel-cpu-paged-attention"),
                choice("attention.context", context),
                choice("attention.tree", "kestrel-cpu-paged-attention"),
                choice("rmsnorm", "candle-cpu"),
                choice("rope", "candle-cpu"),
                choice("sampling", "kestrel-host"),
            ])
        }
        TargetDevice::Cuda { major, minor } => {
            if major < 8 {
                return Err(BuildError::option(format!(
                    "--target_device cuda:sm_{major}{minor} is below compute capability 8.0: Kestrel's CUDA kernels need Ampere (sm_80) or newer"
                )));
            }
            let arch = if major >= 9 { "sm_90" } else { "sm_80" };
            Ok(vec![
                choice("gemm", "cublas"),
                choice("attention.decode", &format!("candle-cuda-{arch}")),
                choice("attention.context", &format!("candle-cuda-{arch}")),
                choice("attention.tree", &format!("candle-cuda-{arch}")),
                choice("rmsnorm", "candle-cuda"),
                choice("rope", "candle-cuda"),
                choice("sampling", "kestrel-host"),
            ])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!("cpu".parse::<TargetDevice>(), Ok(TargetDevice::Cpu));
        assert_eq!(
            "cuda:sm_90".parse::<TargetDevice>(),
            Ok(TargetDevice::Cuda { major: 9, minor: 0 })
        );
        assert_eq!(
            "cuda:sm_120".parse::<TargetDevice>(),
            Ok(TargetDevice::Cuda {
                major: 12,
                minor: 0
            })
        );
        assert_eq!(
            "gpu".parse::<TargetDevice>().unwrap_err(),
            "unknown --target_device 'gpu': expected cpu or cuda:sm_XY (for example cuda:sm_90)"
        );
    }
}

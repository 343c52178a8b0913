//! Kernel selection: which implementation runs each op on the engine's target device.
//!
//! The choice is recorded in the plan so that an engine says what it will run, and so that
//! the runtime can refuse an engine built for a device it is not running on.

use crate::error::BuildError;
use crate::options::{AttentionKernel, BuildOptions, GemmPlugin};
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
    dtype: DType,
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
            // Kestrel's own kernels (crates/kestrel-kernels, PTX for compute_80, so sm_80 and
            // newer) under their extern "C" names; kestrel-model's `CudaKernels::from_choices`
            // dispatches on the name's prefix. Engines built before they existed name
            // candle ops for these ops and keep running those.
            let dt = match dtype {
                DType::F32 => "f32",
                DType::F16 => "f16",
                DType::BF16 => "bf16",
            };
            let attention = match opts.attention_kernel {
                AttentionKernel::Scalar => format!("kestrel_paged_attention_{dt}"),
                AttentionKernel::TensorCores => format!("kestrel_paged_attention_tc_{dt}"),
            };
            // Step rows (decode, drafts, verification) take Kestrel's gemv kernels, steps of
            // many f16/bf16 rows on compute capability 9.0 its warpgroup engine (the
            // compute_90a PTX is that target's alone); prompts cuBLAS.
            let gemm = if (major, minor) == (9, 0) && dtype != DType::F32 {
                format!("kestrel_gemv_{dt}+kestrel_gemv_wgmma_{dt}+cublas")
            } else {
                format!("kestrel_gemv_{dt}+cublas")
            };
            Ok(vec![
                choice("gemm", &gemm),
                choice("attention.decode", &attention),
                choice("attention.context", &attention),
                choice("attention.tree", &attention),
                choice("kv_append", &format!("kestrel_kv_append_{dt}")),
                choice("rmsnorm", &format!("kestrel_add_rmsnorm_{dt}")),
                choice("swiglu", &format!("kestrel_swiglu_{dt}")),
                choice("rope", &format!("kestrel_qkv_rope_{dt}")),
                choice("sampling", "kestrel-host"),
            ])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_targets_pick_kestrel_kernels() {
        let opts = BuildOptions {
            checkpoint_dir: "ckpt".into(),
            output_dir: "engine".into(),
            max_batch_size: 1,
            max_input_len: 8,
            max_seq_len: 16,
            max_beam_width: 1,
            speculative_mode: kestrel_core::SpeculativeMode::None,
            max_draft_len: None,
            tokens_per_block: 8,
            use_paged_context_fmha: true,
            gemm_plugin: GemmPlugin::Auto,
            attention_kernel: AttentionKernel::Scalar,
            target_device: TargetDevice::Cuda { major: 9, minor: 0 },
            eagle_choices: None,
        };
        let k = choose_kernels(
            TargetDevice::Cuda { major: 9, minor: 0 },
            DType::BF16,
            &opts,
        )
        .unwrap();
        let get = |op: &str| k.iter().find(|c| c.op == op).unwrap().kernel.clone();
        assert_eq!(get("attention.decode"), "kestrel_paged_attention_bf16");
        assert_eq!(get("kv_append"), "kestrel_kv_append_bf16");
        assert_eq!(get("rmsnorm"), "kestrel_add_rmsnorm_bf16");
        assert_eq!(get("swiglu"), "kestrel_swiglu_bf16");
        assert_eq!(get("rope"), "kestrel_qkv_rope_bf16");
        assert_eq!(
            get("gemm"),
            "kestrel_gemv_bf16+kestrel_gemv_wgmma_bf16+cublas"
        );
        // --attention_kernel tensor_cores names the tensor-core family for every attention op.
        let tc = BuildOptions {
            attention_kernel: AttentionKernel::TensorCores,
            ..opts.clone()
        };
        let k = choose_kernels(TargetDevice::Cuda { major: 9, minor: 0 }, DType::F16, &tc).unwrap();
        for op in ["attention.decode", "attention.tree", "attention.context"] {
            let kernel = &k.iter().find(|c| c.op == op).unwrap().kernel;
            assert_eq!(kernel, "kestrel_paged_attention_tc_f16", "{op}");
        }
        // The warpgroup engine is compute capability 9.0's alone, and never f32's.
        let gemm = |target, dtype| {
            let k = choose_kernels(target, dtype, &opts).unwrap();
            k.iter().find(|c| c.op == "gemm").unwrap().kernel.clone()
        };
        assert_eq!(
            gemm(TargetDevice::Cuda { major: 8, minor: 0 }, DType::BF16),
            "kestrel_gemv_bf16+cublas"
        );
        assert_eq!(
            gemm(
                TargetDevice::Cuda {
                    major: 12,
                    minor: 0
                },
                DType::F16
            ),
            "kestrel_gemv_f16+cublas"
        );
        assert_eq!(
            gemm(TargetDevice::Cuda { major: 9, minor: 0 }, DType::F32),
            "kestrel_gemv_f32+cublas"
        );
    }

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

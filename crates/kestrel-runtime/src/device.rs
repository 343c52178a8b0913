//! Choosing the device from a command-line spelling.

use crate::error::{Result, RuntimeError};
pub use candle_core::Device;
/// Programmatic dependent launch of Kestrel's kernels on Hopper, on by default.
pub use kestrel_kernels::{dependent_launch_on, set_dependent_launch};

/// `cpu`, or `cuda:N` / `cuda` (ordinal 0) in a build with the `cuda` feature.
pub fn parse(spec: &str) -> Result<Device> {
    if spec == "cpu" {
        return Ok(Device::Cpu);
    }
    let ordinal = match spec {
        "cuda" => Some(0),
        _ => spec
            .strip_prefix("cuda:")
            .and_then(|n| n.parse::<usize>().ok()),
    };
    let Some(ordinal) = ordinal else {
        return Err(RuntimeError::InvalidRequest(format!(
            "unknown --device '{spec}': expected cpu or cuda:N"
        )));
    };
    if !cfg!(feature = "cuda") {
        return Err(RuntimeError::InvalidRequest(format!(
            "--device {spec}: this binary was built without CUDA support; rebuild with --features cuda"
        )));
    }
    kestrel_kernels::open_cuda(ordinal).map_err(|e| {
        RuntimeError::InvalidRequest(format!("--device {spec}: cannot open the CUDA device: {e}"))
    })
}

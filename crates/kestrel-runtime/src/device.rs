//! Choosing the device from a command-line spelling, and the process-wide switches of what
//! runs on it.

use crate::error::{Result, RuntimeError};
pub use candle_core::Device;
/// Where replayed CUDA graphs keep their activations: their model's arena (the default) or
/// the driver's graph pool.
pub use kestrel_kernels::set_graph_arena;
/// The context's per-thread stack limit, which decides a fixed share of device memory.
pub use kestrel_kernels::thread_stack_limit;
/// Programmatic dependent launch of Kestrel's kernels on Hopper, on by default.
pub use kestrel_kernels::{dependent_launch_on, set_dependent_launch};
use std::sync::atomic::{AtomicBool, Ordering};

static DEVICE_SAMPLING: AtomicBool = AtomicBool::new(true);

/// Where sampled steps on a GPU draw their tokens and accept drafts: on the device (the
/// default: a row's token, or a draft-target chain's outcome, is all that crosses to the
/// host) or, switched off, on the host from the full rows, as before there were kernels for
/// it, for comparisons in one process (`spec-bench --device_sampling off`). Either way a
/// sequence consumes its random stream alike, so the same seed gives the same tokens,
/// rounding at a probability boundary aside. Greedy steps always take their argmax on the
/// device; the CPU always samples on the host.
pub fn set_device_sampling(enabled: bool) {
    DEVICE_SAMPLING.store(enabled, Ordering::Relaxed);
}

/// Whether [`set_device_sampling`] leaves sampling on the device.
pub fn device_sampling() -> bool {
    DEVICE_SAMPLING.load(Ordering::Relaxed)
}

static DRAFT_ON_DEVICE: AtomicBool = AtomicBool::new(true);

/// Where EAGLE's static trees keep their top-k drafted tokens: where the head runs (the
/// default: no level waits for the device, and the tokens cross once, with the target's,
/// after verification) or, switched off, on the host, fetched after every level as before,
/// for comparisons in one process (`spec-bench --draft_on_device off`). The tokens are the
/// same either way.
pub fn set_draft_on_device(enabled: bool) {
    DRAFT_ON_DEVICE.store(enabled, Ordering::Relaxed);
}

/// Whether [`set_draft_on_device`] keeps drafted tokens on the device.
pub fn draft_on_device() -> bool {
    DRAFT_ON_DEVICE.load(Ordering::Relaxed)
}

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

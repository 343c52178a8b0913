//! What the benchmark measures about the machine rather than the model: the copy bandwidth
//! the roofline is taken against, the device's name, and peak memory.

use anyhow::Result;
use kestrel_runtime::device::Device;
use std::time::Instant;

/// Copy bandwidth in bytes/s, counting read and write bytes (PyTorch's convention: a copy
/// of N bytes moves 2N), measured on `device` with buffers of `bytes`. Best of a few runs
/// after a warm-up, so page faults and first-call costs stay out of it.
pub fn copy_bandwidth(device: &Device, bytes: usize) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if let Ok(dev) = device.as_cuda_device() {
        return cuda_copy_bandwidth(dev, bytes);
    }
    let _ = device;
    cpu_copy_bandwidth(bytes)
}

/// A chunked memcpy on every core: decode steps stream weights from all cores at once, so a
/// one-thread copy would understate what the machine can give them.
fn cpu_copy_bandwidth(bytes: usize) -> Result<f64> {
    let bytes = bytes.max(1 << 20);
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let chunk = bytes.div_ceil(threads);
    let mut best = f64::INFINITY;
    for rep in 0..4 {
        let t = Instant::now();
        std::thread::scope(|s| {
            for (d, c) in dst.chunks_mut(chunk).zip(src.chunks(chunk)) {
                s.spawn(move || d.copy_from_slice(c));
            }
        });
        let secs = t.elapsed().as_secs_f64();
        if rep > 0 {
            best = best.min(secs);
        }
    }
    // Keep the copy observable so it cannot be optimised away.
    std::hint::black_box(&dst);
    Ok(2.0 * bytes as f64 / best.max(f64::EPSILON))
}

/// Device-to-device copies (`cuMemcpyDtoDAsync`, as PyTorch's `copy_` of a contiguous
/// tensor) between two buffers allocated once, a few back to back between two
/// synchronisations. Allocating the destination per copy (`Tensor::copy`) also timed the
/// mapping of fresh pages (~1.4 TB/s on an H200), and candle's strided copy kernel
/// (`slice_set`) moves ~2.0 TB/s; the H200 copies ~4.3 TB/s.
#[cfg(feature = "cuda")]
fn cuda_copy_bandwidth(dev: &candle_core::CudaDevice, bytes: usize) -> Result<f64> {
    const COPIES: usize = 4;
    let fail = |what: &str, e: candle_core::cuda::cudarc::driver::DriverError| {
        anyhow::anyhow!("copy-bandwidth probe: {what} failed: {e:?}")
    };
    let n = bytes.max(1 << 20);
    let stream = dev.cuda_stream();
    let src = stream
        .alloc_zeros::<u8>(n)
        .map_err(|e| fail("allocation", e))?;
    let mut dst = stream
        .alloc_zeros::<u8>(n)
        .map_err(|e| fail("allocation", e))?;
    let mut best = f64::INFINITY;
    for rep in 0..6 {
        stream.synchronize().map_err(|e| fail("synchronize", e))?;
        let t = Instant::now();
        for _ in 0..COPIES {
            stream
                .memcpy_dtod(&src, &mut dst)
                .map_err(|e| fail("copy", e))?;
        }
        stream.synchronize().map_err(|e| fail("synchronize", e))?;
        let secs = t.elapsed().as_secs_f64() / COPIES as f64;
        if rep > 0 {
            best = best.min(secs);
        }
    }
    Ok(2.0 * n as f64 / best.max(f64::EPSILON))
}

/// The device's name: the GPU's, or the CPU's model name and core count.
pub fn device_name(device: &Device) -> String {
    #[cfg(feature = "cuda")]
    if let Ok(dev) = device.as_cuda_device() {
        let stream = dev.cuda_stream();
        if let Ok(name) = stream.context().name() {
            return name;
        }
    }
    let _ = device;
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{model} ({cores} cores)")
}

/// Peak memory of a run. On CUDA: the device's used memory (total − free), sampled after
/// every committed step and relative to what was in use before the model was loaded. On the
/// CPU: the process's peak resident set (`VmHWM`), reset before each run where the kernel
/// allows it, relative to the resident set before loading.
pub struct MemProbe {
    pub kind: &'static str,
    /// Bytes in use before the model was loaded.
    pub baseline: u64,
    peak: u64,
    on_cuda: bool,
    #[cfg(feature = "cuda")]
    ctx: Option<std::sync::Arc<candle_core::cuda::cudarc::driver::CudaContext>>,
}

impl MemProbe {
    /// Call before loading the model (after the device was opened).
    pub fn new(device: &Device) -> Result<Self> {
        #[cfg(feature = "cuda")]
        if let Ok(dev) = device.as_cuda_device() {
            let ctx = dev.cuda_stream().context().clone();
            let mut probe = MemProbe {
                kind: "cuda used memory (total - free) above the pre-load level",
                baseline: 0,
                peak: 0,
                on_cuda: true,
                ctx: Some(ctx),
            };
            probe.baseline = probe.cuda_used()?;
            return Ok(probe);
        }
        let _ = device;
        Ok(MemProbe {
            kind: "process peak RSS (VmHWM) above the pre-load RSS",
            baseline: proc_status_kib("VmRSS:").unwrap_or(0) * 1024,
            peak: 0,
            on_cuda: false,
            #[cfg(feature = "cuda")]
            ctx: None,
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_used(&self) -> Result<u64> {
        use anyhow::Context;
        let ctx = self.ctx.as_ref().context("not a CUDA probe")?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| anyhow::anyhow!("cannot read the GPU's memory use: {e:?}"))?;
        Ok((total - free) as u64)
    }

    /// Starts a run's peak from what is in use now.
    pub fn start_run(&mut self) {
        self.peak = 0;
        if self.on_cuda {
            self.sample();
        } else {
            // Writing 5 to clear_refs resets VmHWM to the current RSS (Linux ≥ 4.0); where
            // that is refused, the peak is the process's so far.
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
    }

    /// Records the current use (CUDA; the CPU's peak is kept by the kernel).
    pub fn sample(&mut self) {
        #[cfg(feature = "cuda")]
        if self.ctx.is_some() {
            if let Ok(used) = self.cuda_used() {
                self.peak = self.peak.max(used);
            }
        }
    }

    /// The run's peak above the baseline, in bytes.
    pub fn peak_above_baseline(&mut self) -> Option<u64> {
        let peak = if self.on_cuda {
            self.sample();
            self.peak
        } else {
            proc_status_kib("VmHWM:")? * 1024
        };
        Some(peak.saturating_sub(self.baseline))
    }
}

/// Samples memory after every committed step of a generation.
pub struct ProbeSink<'a>(pub &'a mut MemProbe);

impl kestrel_runtime::TokenSink for ProbeSink<'_> {
    fn on_tokens(&mut self, _seq_index: usize, _tokens: &[u32]) {
        // Called once per sequence per step. Sampling on every call keeps tracking after any
        // one sequence has finished; a driver query costs about a microsecond, next to steps
        // of milliseconds (and the CPU probe does nothing here).
        self.0.sample();
    }
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    line[key.len()..]
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

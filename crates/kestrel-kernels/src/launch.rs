//! How `cuda.rs` launches the kernels of `kernels.cu`: the PTX module for the device, and on
//! Hopper (compute capability 9.0 and later) programmatic dependent launch.
//!
//! A decode step is a chain of a few hundred small dependent kernels. Launched plainly, each
//! starts only once the one before it has drained, then ramps its memory traffic up from
//! nothing. With `CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION` a kernel's blocks may
//! become resident while its predecessor runs, load their weights, and wait in `pdl_enter`
//! (kernels.cu) for the predecessor's results. The attribute needs the `compute_90` PTX, whose
//! kernels carry the `griddepcontrol` instructions. Compute capability 9.0 itself (H100,
//! H200) takes the `compute_90a` PTX: the same kernels plus the warpgroup engine
//! (`gemv_wgmma.cuh`), whose instructions only that arch-specific target has. Captured in a
//! CUDA graph such a launch gets no programmatic edge, because its stream predecessor is its
//! output's allocation; `graph_arena.rs` adds the edges when it copies the graph without the
//! allocations.
//!
//! cudarc's launch builder calls `cuLaunchKernelEx` without attributes, so [`Args`] packs the
//! kernel parameters itself. candle runs one stream per device, where cudarc tracks no events,
//! so a device pointer is all a parameter needs.

use candle_core::cuda::cudarc::driver::{
    sys, CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, LaunchConfig,
};
use candle_core::cuda::WrapErr;
use candle_core::{CudaDevice, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

const PTX_SM80: &str = include_str!(concat!(env!("OUT_DIR"), "/kestrel_kernels.ptx"));
const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/kestrel_kernels_sm90.ptx"));
const PTX_SM90A: &str = include_str!(concat!(env!("OUT_DIR"), "/kestrel_kernels_sm90a.ptx"));

/// Per device ordinal, an attribute the launchers ask for: 0 not asked yet, else value + 1.
type AttributeCache = [AtomicU32; 64];
static CC_MAJOR: AttributeCache = [const { AtomicU32::new(0) }; 64];
static CC_MINOR: AttributeCache = [const { AtomicU32::new(0) }; 64];
static MULTIPROCESSORS: AttributeCache = [const { AtomicU32::new(0) }; 64];
static SHARED_OPTIN: AttributeCache = [const { AtomicU32::new(0) }; 64];

/// `attr` of `dev`, asked of the driver once per device.
fn device_attribute(
    cache: &AttributeCache,
    dev: &CudaDevice,
    attr: sys::CUdevice_attribute,
) -> Result<u32> {
    let stream = dev.cuda_stream();
    let ctx = stream.context();
    let slot = cache.get(ctx.ordinal());
    if let Some(known) = slot.map(|s| s.load(Ordering::Relaxed)).filter(|&v| v != 0) {
        return Ok(known - 1);
    }
    let value = ctx.attribute(attr).w()?.max(0) as u32;
    if let Some(s) = slot {
        s.store(value.saturating_add(1), Ordering::Relaxed);
    }
    Ok(value)
}

/// `dev`'s compute capability, (major, minor).
fn compute_capability(dev: &CudaDevice) -> Result<(u32, u32)> {
    use sys::CUdevice_attribute::*;
    Ok((
        device_attribute(&CC_MAJOR, dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        device_attribute(&CC_MINOR, dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}

/// Whether `dev` has compute capability 9.0 or later.
pub(crate) fn is_hopper(dev: &CudaDevice) -> Result<bool> {
    Ok(compute_capability(dev)?.0 >= 9)
}

/// Whether `dev` has compute capability 9.0 exactly, the one target of the `compute_90a` PTX
/// and so of the warpgroup engine.
pub(crate) fn is_sm90(dev: &CudaDevice) -> Result<bool> {
    Ok(compute_capability(dev)? == (9, 0))
}

/// `dev`'s streaming multiprocessors (132 on an H200).
pub(crate) fn multiprocessors(dev: &CudaDevice) -> Result<usize> {
    let sms = device_attribute(
        &MULTIPROCESSORS,
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    )?;
    Ok(sms as usize)
}

/// Dynamic shared memory a block of `func` may take on `dev`: the most a block may opt in to
/// (227 KiB on an H100 or H200, 163 KiB on an A100, 99 KiB on sm_86 / sm_89) less the
/// function's static shared memory.
pub(crate) fn dynamic_shared_limit(dev: &CudaDevice, func: &Kernel) -> Result<usize> {
    let optin = device_attribute(
        &SHARED_OPTIN,
        dev,
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )? as usize;
    let fixed = func.func.shared_size_bytes().w()?.max(0) as usize;
    Ok(optin.saturating_sub(fixed))
}

/// A kernel of `kernels.cu` loaded on a device, ready to take its parameters.
pub(crate) struct Kernel {
    func: CudaFunction,
    stream: Arc<CudaStream>,
    dependent: bool,
    /// Never launched: named in `KESTREL_SKIP_KERNELS` (see [`skipped`]).
    skip: bool,
}

/// Whether `name` starts with one of the comma-separated prefixes in `KESTREL_SKIP_KERNELS`,
/// read once. A measuring aid, not a mode: a skipped kernel's outputs are never written, so
/// every result after it is wrong, but the step's time without it is what it costs the real
/// step, overlaps included, which Nsight Compute's serialised timings are not
/// (docs/gpu-results.md, session 27: `KESTREL_SKIP_KERNELS=kestrel_paged_attention`).
fn skipped(name: &str) -> bool {
    static PREFIXES: OnceLock<Vec<String>> = OnceLock::new();
    let prefixes = PREFIXES.get_or_init(|| {
        let list: Vec<String> = std::env::var("KESTREL_SKIP_KERNELS")
            .unwrap_or_default()
            .split(',')
            .filter(|p| !p.is_empty())
            .map(str::to_owned)
            .collect();
        if !list.is_empty() {
            eprintln!(
                "kestrel-kernels: KESTREL_SKIP_KERNELS={}: these kernels are not launched and \
                 every output is wrong (a measuring aid)",
                list.join(",")
            );
        }
        list
    });
    prefixes.iter().any(|p| name.starts_with(p.as_str()))
}

/// `name` (with its dtype suffix) from the module for `dev`'s architecture.
pub(crate) fn load_kernel(dev: &CudaDevice, name: &str) -> Result<Kernel> {
    let hopper = is_hopper(dev)?;
    let (module, ptx) = if is_sm90(dev)? {
        ("kestrel_kernels_sm90a", PTX_SM90A)
    } else if hopper {
        ("kestrel_kernels_sm90", PTX_SM90)
    } else {
        ("kestrel_kernels", PTX_SM80)
    };
    Ok(Kernel {
        func: dev
            .get_or_load_custom_func(name, module, ptx)?
            .into_cuda_function(),
        stream: dev.cuda_stream(),
        dependent: hopper && crate::dependent_launch(),
        skip: skipped(name),
    })
}

impl std::ops::Deref for Kernel {
    type Target = CudaFunction;
    fn deref(&self) -> &CudaFunction {
        &self.func
    }
}

impl Kernel {
    /// An empty parameter list for one launch.
    pub(crate) fn builder(&self) -> Args<'_> {
        Args {
            kernel: self,
            params: [0; MAX_PARAMS],
            len: 0,
        }
    }

    /// Blocks of `threads` threads (and no dynamic shared memory) that one multiprocessor
    /// holds at once: the driver's occupancy calculator, asked once per function and size.
    pub(crate) fn resident_blocks(&self, threads: u32) -> Result<usize> {
        static KNOWN: Mutex<Option<HashMap<(usize, u32), usize>>> = Mutex::new(None);
        let key = (self.func.cu_function() as usize, threads);
        let cached = KNOWN
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .and_then(|known| known.get(&key).copied());
        if let Some(n) = cached {
            return Ok(n);
        }
        let n = self
            .func
            .occupancy_max_active_blocks_per_multiprocessor(threads, 0, None)
            .w()? as usize;
        KNOWN
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get_or_insert_with(HashMap::new)
            .insert(key, n);
        Ok(n)
    }
}

/// One kernel parameter: its bytes, at most 8, in the low bytes of a `u64` (the target is
/// little-endian, so the driver, reading the parameter's size from its address, gets them).
pub(crate) trait KernelArg {
    fn bits(&self, stream: &CudaStream) -> u64;
}

impl<T> KernelArg for CudaView<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> KernelArg for CudaViewMut<'_, T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl<T> KernelArg for CudaSlice<T> {
    fn bits(&self, stream: &CudaStream) -> u64 {
        self.device_ptr(stream).0
    }
}

impl KernelArg for i32 {
    fn bits(&self, _: &CudaStream) -> u64 {
        *self as u32 as u64
    }
}

impl KernelArg for u32 {
    fn bits(&self, _: &CudaStream) -> u64 {
        *self as u64
    }
}

impl KernelArg for f32 {
    fn bits(&self, _: &CudaStream) -> u64 {
        self.to_bits() as u64
    }
}

/// A `size_t` parameter (or a null pointer, 0).
impl KernelArg for u64 {
    fn bits(&self, _: &CudaStream) -> u64 {
        *self
    }
}

impl KernelArg for usize {
    fn bits(&self, _: &CudaStream) -> u64 {
        *self as u64
    }
}

/// The most parameters a kernel of `kernels.cu` takes (12 today), held inline so that an
/// eager step's few hundred launches allocate nothing for them.
const MAX_PARAMS: usize = 16;

/// A kernel's parameters, in the order of its `extern "C"` signature.
pub(crate) struct Args<'a> {
    kernel: &'a Kernel,
    params: [u64; MAX_PARAMS],
    len: usize,
}

impl Args<'_> {
    pub(crate) fn arg(&mut self, a: &impl KernelArg) -> &mut Self {
        assert!(
            self.len < MAX_PARAMS,
            "a kernel of kernels.cu takes at most {MAX_PARAMS} parameters"
        );
        self.params[self.len] = a.bits(&self.kernel.stream);
        self.len += 1;
        self
    }

    /// Submits the kernel to candle's stream.
    ///
    /// # Safety
    /// The parameters must match the kernel's signature in number, order and size, and the
    /// memory they point to must stay alive until the kernel has run (the stream orders it
    /// after every earlier use and before every later one).
    pub(crate) unsafe fn launch(&mut self, cfg: LaunchConfig) -> Result<()> {
        if self.kernel.skip {
            return Ok(());
        }
        let stream = &self.kernel.stream;
        stream.context().bind_to_thread().w()?;
        let mut ptrs = [std::ptr::null_mut::<std::ffi::c_void>(); MAX_PARAMS];
        for (ptr, p) in ptrs.iter_mut().zip(&mut self.params[..self.len]) {
            *ptr = p as *mut u64 as *mut std::ffi::c_void;
        }
        // SAFETY: a zeroed attribute is a valid union; the field set is the one the id names.
        let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(self.kernel.dependent),
        };
        // SAFETY: `ptrs` points at `self.params`, alive and unmoved for the call; the caller
        // vouches for the parameters themselves.
        sys::cuLaunchKernelEx(
            &config,
            self.kernel.func.cu_function(),
            ptrs.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .w()
    }
}

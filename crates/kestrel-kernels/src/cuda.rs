//! candle custom ops that launch the kernels of `kernels.cu` on a tensor's CUDA device.
//!
//! The PTX is loaded once per device as a custom module (`get_or_load_custom_func` caches it
//! by module name) and launched on candle's stream, so the kernels are ordered with candle's
//! own work and no synchronisation is needed.

use crate::launch::{load_kernel, Args};
use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaView, LaunchConfig};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::{
    bail, CpuStorage, CudaDevice, CudaStorage, CustomOp1, CustomOp3, DType, InplaceOp3, Layout,
    Result, Shape, Storage, Tensor,
};
use half::{bf16, f16};

/// `t`'s elements as a device view, which must be contiguous (possibly at an offset).
pub(crate) fn view<'a, T: CudaDType>(
    s: &'a CudaStorage,
    l: &Layout,
    what: &str,
) -> Result<candle_core::cuda::cudarc::driver::CudaView<'a, T>> {
    match l.contiguous_offsets() {
        Some((a, b)) => Ok(s.as_cuda_slice::<T>()?.slice(a..b)),
        None => bail!("{what} must be contiguous"),
    }
}

/// `$body` with `$t` the element type of `$dtype` (f32, f16 or bf16) and `$sfx` its kernel
/// name suffix; other dtypes are an error naming `$what`.
macro_rules! by_dtype {
    ($dtype:expr, $what:expr, |$t:ident, $sfx:ident| $body:expr) => {
        match $dtype {
            DType::F32 => {
                type $t = f32;
                let $sfx = "f32";
                $body
            }
            DType::F16 => {
                type $t = f16;
                let $sfx = "f16";
                $body
            }
            DType::BF16 => {
                type $t = bf16;
                let $sfx = "bf16";
                $body
            }
            other => bail!("{} does not support {other:?}", $what),
        }
    };
}
pub(crate) use by_dtype;

/// `t`'s CUDA storage, for an op that reads (or, for the KV pools, writes) more tensors than
/// candle's custom ops pass in.
macro_rules! cuda_storage {
    ($guard:ident, $layout:ident = $t:expr, $what:expr) => {
        let ($guard, $layout) = $t.storage_and_layout();
        let Storage::Cuda($guard) = &*$guard else {
            bail!("{} is not on the CUDA device", $what)
        };
    };
}

fn launch_cfg(grid: (u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid.0, grid.1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Threads per block for a loop over `width` elements: a multiple of 32, 32 to 1024.
fn threads_for(width: usize) -> u32 {
    (width.div_ceil(32) * 32).clamp(32, 1024) as u32
}

/// Whether every one of `layouts` starts on a 16-byte boundary (elements of `elem_bytes`),
/// as a kernel's 16-byte accesses need.
fn start_aligned(layouts: &[&Layout], elem_bytes: usize) -> bool {
    layouts
        .iter()
        .all(|l| (l.start_offset() * elem_bytes).is_multiple_of(16))
}

fn i32_arg(x: usize, what: &str) -> Result<i32> {
    i32::try_from(x).map_err(|_| candle_core::Error::Msg(format!("{what} {x} exceeds i32")))
}

/// A launch choice forced by the environment variable `var` (1, 2, 4 or 8), to measure it
/// against the automatic one; read once into `cell`.
fn forced_count(cell: &'static std::sync::OnceLock<Option<usize>>, var: &str) -> Option<usize> {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| [1, 2, 4, 8].contains(n))
    })
}

/// The attention kernel's virtual warps (`PA_VWARPS` in kernels.cu). Fixed, never chosen per
/// step: slot chunk c goes to virtual warp c mod this, and the virtual warps' partial softmax
/// states merge in their order, so a query row's result depends on its keys only. A decode step
/// and a verification step then attend bit-identically, which greedy speculation's equality
/// with plain decoding relies on. Measured on the H200 (docs/gpu-results.md): 4 left a SmolLM2
/// decode step latency-bound (24 µs per layer), 16 slowed 64-row trees.
const PA_VIRTUAL_WARPS: u32 = 8;

/// Real warps a (query row, head) block of the attention kernel gets; each runs
/// `PA_VIRTUAL_WARPS / warps` virtual warps one after the other, which changes no bits. A
/// decode step's few blocks take one warp per virtual warp, so that a row's chunks are walked
/// side by side. A verification's thousands of blocks fill every multiprocessor many times
/// over, and a block's virtual warps past the row's last chunk would hold registers doing
/// nothing; there fewer real warps a block keep more rows in flight. The most warps (8, 4,
/// 2) with which every block is resident at once (the driver's occupancy for this function),
/// else 1. `KESTREL_PA_WARPS` (1, 2, 4 or 8) forces the count, to measure the choice.
fn attention_warps(func: &crate::launch::Kernel, dev: &CudaDevice, blocks: usize) -> Result<u32> {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    if let Some(w) = forced_count(&FORCED, "KESTREL_PA_WARPS") {
        return Ok(w as u32);
    }
    let sms = crate::launch::multiprocessors(dev)?;
    for warps in [PA_VIRTUAL_WARPS, 4, 2] {
        if blocks <= sms * func.resident_blocks(warps * 32)? {
            return Ok(warps);
        }
    }
    Ok(1)
}

/// The block-per-row kernel for a step of `blocks` (query row, head) blocks, and its real
/// warps a block: `kestrel_paged_attention_*` where every block is resident at once with a
/// warp per virtual warp (a decode step), else `kestrel_paged_attention_many_*` (fewer loads
/// in flight a lane, more blocks a multiprocessor: attention.cuh's `PA_MANY_BATCH`). Both give
/// a row the same bits. `KESTREL_PA_MANY=0` keeps the first for every step, to measure the
/// choice; `many` forces one (`Some(true)`: the second).
fn attention_rows_kernel(
    dev: &CudaDevice,
    sfx: &str,
    blocks: usize,
    many: Option<bool>,
) -> Result<(crate::launch::Kernel, u32)> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("KESTREL_PA_MANY").as_deref() == Ok("0"));
    let func = load_kernel(dev, &format!("kestrel_paged_attention_{sfx}"))?;
    let warps = attention_warps(&func, dev, blocks)?;
    let many = many.unwrap_or(!off && warps < PA_VIRTUAL_WARPS);
    if !many {
        return Ok((func, warps));
    }
    let func = load_kernel(dev, &format!("kestrel_paged_attention_many_{sfx}"))?;
    let warps = attention_warps(&func, dev, blocks)?;
    Ok((func, warps))
}

pub(crate) struct PagedAttention {
    pub table: Tensor,
    pub n_seq: usize,
    pub lmax: usize,
    pub max_new: usize,
    pub launch: crate::AttnLaunch,
}

impl PagedAttention {
    #[allow(clippy::too_many_arguments)]
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaDevice,
        q: (&CudaStorage, &Layout),
        k: (&CudaStorage, &Layout),
        v: (&CudaStorage, &Layout),
        table: (&CudaStorage, &Layout),
        dims: (usize, usize, usize, usize),
        sfx: &str,
    ) -> Result<CudaStorage> {
        let (n_tok, nh, nkv, d) = dims;
        let qv = view::<T>(q.0, q.1, "attention q")?;
        let kv = view::<T>(k.0, k.1, "K pool")?;
        let vv = view::<T>(v.0, v.1, "V pool")?;
        let tv = view::<u32>(table.0, table.1, "attention metadata")?;
        // SAFETY: every element is written by the kernel (each block writes its row's d values).
        let out = unsafe { dev.alloc::<T>(n_tok * nh * d)? };
        let (n_tok_a, n_seq, lmax, nh_a, nkv_a, d_a) = (
            i32_arg(n_tok, "query rows")?,
            i32_arg(self.n_seq, "sequences")?,
            i32_arg(self.lmax, "slots")?,
            i32_arg(nh, "heads")?,
            i32_arg(nkv, "KV heads")?,
            i32_arg(d, "head_dim")?,
        );
        let scale = 1.0f32 / (d as f32).sqrt();
        if let crate::AttnLaunch::TensorCores { merged } = self.launch {
            let dims = (n_tok, nh, d, std::mem::size_of::<T>());
            let args = (n_tok_a, n_seq, lmax, nh_a, nkv_a, scale);
            let hopper = crate::launch::is_hopper(dev)?;
            self.tensor_cores(
                dev,
                (&qv, &kv, &vv, &tv),
                &out,
                dims,
                args,
                sfx,
                !merged && hopper,
            )?;
            return Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()));
        }
        let groups = match self.launch {
            crate::AttnLaunch::Auto => {
                let blocks = nh * self.n_seq * self.max_new.div_ceil(crate::ATTN_GROUP_ROWS);
                let sms = crate::launch::multiprocessors(dev)?;
                crate::attention_groups_step(self.max_new, self.lmax, blocks, sms)
            }
            crate::AttnLaunch::Rows { .. } | crate::AttnLaunch::TensorCores { .. } => false,
            crate::AttnLaunch::Groups => true,
        };
        let grouped = if groups {
            self.groups_launch(dev, nh, d, std::mem::size_of::<T>(), sfx)?
        } else {
            None
        };
        let (func, cfg) = match grouped {
            Some(launch) => launch,
            None => {
                let (func, warps) = match self.launch {
                    crate::AttnLaunch::Rows { warps, many } => (
                        attention_rows_kernel(dev, sfx, n_tok * nh, Some(many))?.0,
                        warps,
                    ),
                    _ => attention_rows_kernel(dev, sfx, n_tok * nh, None)?,
                };
                // grid.y = heads ≤ 65535; static shared memory (~11 KiB) only.
                let cfg = launch_cfg((n_tok as u32, nh as u32), warps * 32);
                (func, cfg)
            }
        };
        let mut b = func.builder();
        b.arg(&qv);
        b.arg(&kv);
        b.arg(&vv);
        b.arg(&out);
        b.arg(&tv);
        b.arg(&n_tok_a);
        b.arg(&n_seq);
        b.arg(&lmax);
        b.arg(&nh_a);
        b.arg(&nkv_a);
        b.arg(&d_a);
        b.arg(&scale);
        // SAFETY: argument types and order match kestrel_paged_attention_*,
        // kestrel_paged_attention_many_* and kestrel_paged_attention_groups_* in kernels.cu; the metadata was built by
        // PagedAttnMeta for these n_tok / n_seq / lmax / max_new.
        unsafe { b.launch(cfg) }?;
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    /// The tensor-core attention (attention_tc.cuh) into `out`: [`crate::TC_SPLITS`] split
    /// blocks a (head, sequence, rows), each leaving its rows' states in a scratch buffer for
    /// a second launch to fold, or, for blocks of 4 warps where `cluster_fold` (compute
    /// capability 9.0 and up), folding them together inside their cluster; the same bits.
    /// Blocks of 4 warps (64 rows) for steps of more than 16 new tokens a sequence, else of
    /// one (a row's bits do not depend on it). Why the one-warp blocks keep the second
    /// launch: their cluster fold made one-row steps 4% slower on an H100 (Llama-2-7B decode
    /// 5.07 → 5.29 ms, batch 16 6.9 → 8.2), while it made 64-row steps up to 4% faster
    /// (docs/gpu-results.md, session 62). Heads of 64 and 128 in f16 or bf16 (the caller
    /// checked: `tensor_core_attention_applies`).
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    fn tensor_cores<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        dev: &CudaDevice,
        (q, k, v, table): (&CudaView<T>, &CudaView<T>, &CudaView<T>, &CudaView<u32>),
        out: &CudaSlice<T>,
        (n_tok, nh, d, elem_bytes): (usize, usize, usize, usize),
        (n_tok_a, n_seq, lmax, nh_a, nkv_a, scale): (i32, i32, i32, i32, i32, f32),
        sfx: &str,
        cluster_fold: bool,
    ) -> Result<()> {
        const TILE: usize = 64;
        const STAGES: usize = 2;
        const SW_LD: usize = 2 * TILE + 4;
        let splits = crate::TC_SPLITS;
        let warps = if self.max_new > 16 { 4 } else { 1 };
        let cluster = cluster_fold && warps == 4;
        let name = if cluster {
            format!("kestrel_paged_attention_tc_cluster_d{d}_w{warps}_{sfx}")
        } else {
            format!("kestrel_paged_attention_tc_d{d}_w{warps}_s{splits}_{sfx}")
        };
        let func = load_kernel(dev, &name)?;
        // tc_smem_bytes in attention_tc.cuh.
        let bytes = 2 * STAGES * TILE * (d + 8) * elem_bytes
            + warps * 16 * (SW_LD * 4 + crate::TC_MAX_MASKED_NEW + 4);
        let limit = crate::launch::dynamic_shared_limit(dev, &func)?;
        if bytes > limit {
            bail!(
                "tensor-core paged attention: a head of {d} {elem_bytes}-byte values needs \
                 {bytes} bytes of shared memory a block; the device allows {limit}"
            );
        }
        allow_shared_memory(&func, limit)?;
        // SAFETY: the kernel writes every (split, row, head)'s o, m and l it reads back in the
        // merge (each split block writes its rows' states, empty or not). A cluster folds them
        // in shared memory and never touches `part`: it gets a null pointer, not a buffer.
        let part = if cluster {
            None
        } else {
            Some(unsafe { dev.alloc::<f32>(splits * n_tok * nh * (d + 2))? })
        };
        const NO_SCRATCH: u64 = 0;
        let rows = 16 * warps;
        // grid: heads, sequences × splits ≤ 65535, row groups ≤ 65535.
        let cfg = LaunchConfig {
            grid_dim: (
                nh as u32,
                (self.n_seq * splits) as u32,
                self.max_new.div_ceil(rows) as u32,
            ),
            block_dim: ((warps * 32) as u32, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        let mut b = func.builder();
        b.arg(q);
        b.arg(k);
        b.arg(v);
        b.arg(out);
        match &part {
            Some(part) => b.arg(part),
            None => b.arg(&NO_SCRATCH),
        };
        b.arg(table);
        b.arg(&n_tok_a);
        b.arg(&n_seq);
        b.arg(&lmax);
        b.arg(&nh_a);
        b.arg(&nkv_a);
        b.arg(&scale);
        // SAFETY: argument types and order match kestrel_paged_attention_tc_* in kernels.cu
        // (the cluster kernels' grid.y, sequences × splits, is a whole number of clusters);
        // the metadata was built by PagedAttnMeta for these n_tok / n_seq / lmax / max_new,
        // and its trees bring at most TC_MAX_MASKED_NEW nodes (checked by the caller).
        unsafe { b.launch(cfg) }?;
        let Some(part) = part else {
            return Ok(());
        };
        let merge = load_kernel(dev, &format!("kestrel_paged_attention_tc_merge_d{d}_{sfx}"))?;
        let mut b = merge.builder();
        b.arg(&part);
        b.arg(out);
        b.arg(&n_tok_a);
        b.arg(&nh_a);
        // SAFETY: matches kestrel_paged_attention_tc_merge_*: grid (rows, heads), d threads.
        unsafe { b.launch(launch_cfg((n_tok as u32, nh as u32), d as u32)) }?;
        Ok(())
    }

    /// The grouped kernel and its launch for head size `d` of `elem_bytes` values, or `None`
    /// (an error when forced) where the step's new tokens (at most
    /// [`crate::ATTN_GROUPS_MAX_NEW`] a sequence), the head size (64 and 128 only) or the
    /// device's shared memory rules it out (~71 KiB a block for Llama heads in f16/bf16, ~134
    /// KiB for d = 128 in f32).
    fn groups_launch(
        &self,
        dev: &CudaDevice,
        nh: usize,
        d: usize,
        elem_bytes: usize,
        sfx: &str,
    ) -> Result<Option<(crate::launch::Kernel, LaunchConfig)>> {
        let forced = self.launch == crate::AttnLaunch::Groups;
        if self.max_new > crate::ATTN_GROUPS_MAX_NEW {
            if forced {
                bail!(
                    "grouped paged attention: {} new tokens a sequence; the kernel takes at \
                     most {}",
                    self.max_new,
                    crate::ATTN_GROUPS_MAX_NEW
                );
            }
            return Ok(None);
        }
        let Some(bytes) = crate::attention_groups_shared_bytes(d, elem_bytes) else {
            if forced {
                bail!(
                    "grouped paged attention: a head of {d} {elem_bytes}-byte values; the \
                     kernel is compiled for heads of 64 and 128"
                );
            }
            return Ok(None);
        };
        let func = load_kernel(dev, &format!("kestrel_paged_attention_groups_{sfx}"))?;
        let limit = crate::launch::dynamic_shared_limit(dev, &func)?;
        if bytes > limit {
            if forced {
                bail!(
                    "grouped paged attention: a head of {d} {elem_bytes}-byte values needs \
                     {bytes} bytes of shared memory a block; the device allows {limit}"
                );
            }
            return Ok(None);
        }
        // The whole limit, whatever this launch needs, so that models of different head
        // sizes in one process share the function's one setting.
        allow_shared_memory(&func, limit)?;
        let groups = self.max_new.div_ceil(crate::ATTN_GROUP_ROWS) as u32;
        // grid: heads, sequences ≤ 65535, row groups ≤ 65535 (trees of ≤ 1,024 nodes).
        let cfg = LaunchConfig {
            grid_dim: (nh as u32, self.n_seq as u32, groups),
            block_dim: (PA_VIRTUAL_WARPS * 32, 1, 1),
            shared_mem_bytes: bytes as u32,
        };
        Ok(Some((func, cfg)))
    }
}

impl CustomOp3 for PagedAttention {
    fn name(&self) -> &'static str {
        "kestrel-paged-attention"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel paged attention runs on CUDA only (the CPU has its own kernel)")
    }

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        ql: &Layout,
        k: &CudaStorage,
        kl: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (n_tok, nh, d) = ql.shape().dims3()?;
        let (_, nkv, _) = kl.shape().dims3()?;
        let (ts, tl) = self.table.storage_and_layout();
        let Storage::Cuda(ts) = &*ts else {
            bail!("paged attention metadata is not on the CUDA device")
        };
        let dev = q.device();
        let dims = (n_tok, nh, nkv, d);
        let args = ((q, ql), (k, kl), (v, vl), (ts, tl));
        let out = by_dtype!(q.dtype(), "paged attention", |T, sfx| self
            .run::<T>(dev, args.0, args.1, args.2, args.3, dims, sfx)?);
        Ok((out, Shape::from((n_tok, nh, d))))
    }
}

pub(crate) struct KvAppend;

impl KvAppend {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        pool: &mut CudaStorage,
        pl: &Layout,
        rows: (&CudaStorage, &Layout),
        slots: (&CudaStorage, &Layout),
        sfx: &str,
    ) -> Result<()> {
        let dev = pool.device().clone();
        let n = rows.1.shape().dims()[0];
        if n == 0 {
            return Ok(());
        }
        let width = rows.1.shape().elem_count() / n;
        let rv = view::<T>(rows.0, rows.1, "appended rows")?;
        let sv = view::<u32>(slots.0, slots.1, "slot ids")?;
        let (a, b) = match pl.contiguous_offsets() {
            Some(o) => o,
            None => bail!("KV pool must be contiguous"),
        };
        let pv = pool.as_cuda_slice_mut::<T>()?.slice_mut(a..b);
        let func = load_kernel(&dev, &format!("kestrel_kv_append_{sfx}"))?;
        let width_a = i32_arg(width, "row width")?;
        let mut bld = func.builder();
        bld.arg(&pv);
        bld.arg(&rv);
        bld.arg(&sv);
        bld.arg(&width_a);
        let cfg = launch_cfg((n as u32, 1), threads_for(width).min(256));
        // SAFETY: argument types match kestrel_kv_append_*; slot ids index pool rows (the
        // cache hands out only rows of its own pool).
        unsafe { bld.launch(cfg) }?;
        Ok(())
    }
}

impl InplaceOp3 for KvAppend {
    fn name(&self) -> &'static str {
        "kestrel-kv-append"
    }

    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<()> {
        bail!("kestrel kv append runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        pool: &mut CudaStorage,
        pl: &Layout,
        rows: &CudaStorage,
        rl: &Layout,
        slots: &CudaStorage,
        sl: &Layout,
    ) -> Result<()> {
        by_dtype!(pool.dtype(), "kv append", |T, sfx| Self::run::<T>(
            pool,
            pl,
            (rows, rl),
            (slots, sl),
            sfx
        ))
    }
}

/// Vectors a thread of `kestrel_add_rmsnorm_*`'s one-pass path holds (`ADD_RMS_VECS`).
const ADD_RMS_VECS: usize = 4;

/// Threads of `kestrel_add_rmsnorm_cols_*` (`NORM_COL_THREADS` in kernels.cu), and the
/// 16-column blocks each takes at most (`NORM_COL_BLOCKS`).
const NORM_COL_THREADS: usize = 256;
const NORM_COL_BLOCKS: usize = 2;

/// Whether rows of `h` elements of `elem_bytes`, 16-byte aligned (`aligned`), are normed in
/// column blocks (`kestrel_add_rmsnorm_cols_*`): 16-bit values, whole blocks of 16, at most
/// `NORM_COL_BLOCKS` a thread. A rule on h, the dtype and alignment, never on the rows, so a
/// decode row and a verification's rows are normed in the same order.
fn column_blocks(h: usize, elem_bytes: usize, aligned: bool) -> bool {
    elem_bytes == 2
        && aligned
        && h > 0
        && h.is_multiple_of(16)
        && h <= 16 * NORM_COL_THREADS * NORM_COL_BLOCKS
}

pub(crate) struct AddRmsNorm {
    pub eps: f32,
    /// `kestrel_add_rmsnorm_rows_*`: the arithmetic of `gemv_add_rms_norm`'s staging, one
    /// warp per row (for that op's steps of many rows), instead of candle's order.
    pub gemv_order: bool,
    /// With `gemv_order`: the normed rows in the warpgroup engine's layout
    /// ([`gemv_wgmma_laid_len`] values after the sums) instead of after them as stored.
    pub laid: bool,
}

impl AddRmsNorm {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        x: (&CudaStorage, &Layout),
        r: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        sfx: &str,
    ) -> Result<CudaStorage> {
        let dev = x.0.device().clone();
        let (rows, h) = x.1.shape().dims2()?;
        let xv = view::<T>(x.0, x.1, "x")?;
        let rv = view::<T>(r.0, r.1, "residual")?;
        let wv = view::<T>(w.0, w.1, "norm weight")?;
        let len = if self.laid {
            rows * h + gemv_wgmma_laid_len(rows, h)
        } else {
            2 * rows * h
        };
        // SAFETY: the kernel writes both halves of every row (laid: the sums and every row
        // below `rows` of the layout, whose other rows no product reads into a stored output).
        let out = unsafe { dev.alloc::<T>(len)? };
        let elem_bytes = std::mem::size_of::<T>();
        let aligned = start_aligned(&[x.1, r.1, w.1], elem_bytes);
        let cols = !self.gemv_order && column_blocks(h, elem_bytes, aligned);
        if rows > 0 {
            let kernel = if self.gemv_order {
                "kestrel_add_rmsnorm_rows"
            } else if cols {
                "kestrel_add_rmsnorm_cols"
            } else {
                "kestrel_add_rmsnorm"
            };
            let func = load_kernel(&dev, &format!("{kernel}_{sfx}"))?;
            let (rows_a, h_a) = (i32_arg(rows, "rows")?, i32_arg(h, "hidden size")?);
            let mut b = func.builder();
            b.arg(&xv);
            b.arg(&rv);
            b.arg(&wv);
            b.arg(&out);
            let laid = self.laid.then(|| out.slice(rows * h..));
            let null: u64 = 0;
            if self.gemv_order {
                match &laid {
                    Some(v) => b.arg(v),
                    None => b.arg(&null),
                };
            }
            b.arg(&rows_a);
            b.arg(&h_a);
            b.arg(&self.eps);
            // The one-pass path of kestrel_add_rmsnorm: 16-byte vectors, at most
            // ADD_RMS_VECS a thread, every row 16-byte aligned.
            let vec_elems = 16 / elem_bytes;
            let vectors = h / vec_elems;
            let vec = h % vec_elems == 0 && aligned && vectors <= ADD_RMS_VECS * 1024;
            let vec_arg = i32::from(vec);
            if !self.gemv_order && !cols {
                b.arg(&vec_arg);
            }
            let cfg = if self.gemv_order {
                // A warp per row, 8 a block.
                launch_cfg((rows.div_ceil(8) as u32, 1), 256)
            } else if cols {
                // column_blocks checked h, the dtype and alignment.
                launch_cfg((rows as u32, 1), NORM_COL_THREADS as u32)
            } else if vec {
                // A vector a thread where 1,024 threads suffice.
                launch_cfg((rows as u32, 1), threads_for(vectors))
            } else {
                // block_sum needs a multiple of 32 threads, at most 1024.
                launch_cfg((rows as u32, 1), threads_for(h).min(1024))
            };
            // SAFETY: argument types match kestrel_add_rmsnorm_{,rows_,cols_}* (`laid` only in
            // the rows variant, null or the layout's part of `out`; `vec` only in the first).
            unsafe { b.launch(cfg) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp3 for AddRmsNorm {
    fn name(&self) -> &'static str {
        "kestrel-add-rmsnorm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel add_rms_norm runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        r: &CudaStorage,
        rl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (rows, h) = xl.shape().dims2()?;
        let out = by_dtype!(x.dtype(), "add_rms_norm", |T, sfx| self.run::<T>(
            (x, xl),
            (r, rl),
            (w, wl),
            sfx
        )?);
        let shape = if self.laid {
            Shape::from(rows * h + gemv_wgmma_laid_len(rows, h))
        } else {
            Shape::from((2, rows, h))
        };
        Ok((out, shape))
    }
}

/// `kestrel_swiglu_*`; with `laid`, its rows in the warpgroup engine's layout
/// ([`gemv_wgmma_laid_len`] values) for the down projection.
pub(crate) struct SwiGlu {
    pub laid: bool,
}

impl SwiGlu {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        s: &CudaStorage,
        l: &Layout,
        sfx: &str,
    ) -> Result<CudaStorage> {
        let dev = s.device().clone();
        let (rows, two_i) = l.shape().dims2()?;
        let inter = two_i / 2;
        let total = rows * inter;
        let sv = view::<T>(s, l, "gate_up")?;
        let len = if self.laid {
            gemv_wgmma_laid_len(rows, inter)
        } else {
            total
        };
        // SAFETY: the grid-stride loop writes every element (laid: every row below `rows`).
        let out = unsafe { dev.alloc::<T>(len)? };
        if total > 0 {
            let func = load_kernel(&dev, &format!("kestrel_swiglu_{sfx}"))?;
            let inter_a = i32_arg(inter, "intermediate size")?;
            let null: u64 = 0;
            let mut b = func.builder();
            b.arg(&sv);
            if self.laid {
                b.arg(&null);
                b.arg(&out);
            } else {
                b.arg(&out);
                b.arg(&null);
            }
            b.arg(&total);
            b.arg(&inter_a);
            // 16-byte accesses where the rows allow them: a thread then takes that many columns.
            let elem_bytes = std::mem::size_of::<T>();
            let per_vec = 16 / elem_bytes;
            let vec = inter.is_multiple_of(per_vec) && start_aligned(&[l], elem_bytes);
            let vec_a = i32::from(vec);
            b.arg(&vec_a);
            let units = if vec { total / per_vec } else { total };
            let blocks = units.div_ceil(256).min(65535) as u32;
            // SAFETY: argument types match kestrel_swiglu_* (total is size_t there).
            unsafe { b.launch(launch_cfg((blocks, 1), 256)) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp1 for SwiGlu {
    fn name(&self) -> &'static str {
        "kestrel-swiglu"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel swiglu runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (rows, two_i) = l.shape().dims2()?;
        let out = by_dtype!(s.dtype(), "swiglu", |T, sfx| self.run::<T>(s, l, sfx)?);
        let shape = if self.laid {
            Shape::from(gemv_wgmma_laid_len(rows, two_i / 2))
        } else {
            Shape::from((rows, two_i / 2))
        };
        Ok((out, shape))
    }
}

/// What a kernel writing one u32 id a row of f32 logits `[rows, vocab]` (one block of 1,024
/// threads a row) is launched with.
struct RowIds<'a> {
    dev: CudaDevice,
    rows: usize,
    logits: candle_core::cuda::cudarc::driver::CudaView<'a, f32>,
    out: candle_core::cuda::cudarc::driver::CudaSlice<u32>,
    vocab: i32,
}

impl<'a> RowIds<'a> {
    fn new(s: &'a CudaStorage, l: &Layout) -> Result<Self> {
        let dev = s.device().clone();
        let (rows, vocab) = l.shape().dims2()?;
        let logits = view::<f32>(s, l, "logits")?;
        // SAFETY: one block per row writes its id.
        let out = unsafe { dev.alloc::<u32>(rows)? };
        Ok(Self {
            dev,
            rows,
            logits,
            out,
            vocab: i32_arg(vocab, "vocabulary")?,
        })
    }

    fn any(&self) -> bool {
        self.rows > 0 && self.vocab > 0
    }

    fn cfg(&self) -> LaunchConfig {
        launch_cfg((self.rows as u32, 1), 1024)
    }

    fn finish(self) -> (CudaStorage, Shape) {
        (
            CudaStorage::wrap_cuda_slice(self.out, self.dev),
            Shape::from(self.rows),
        )
    }
}

pub(crate) struct ArgMax;

impl CustomOp1 for ArgMax {
    fn name(&self) -> &'static str {
        "kestrel-argmax"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel argmax runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let r = RowIds::new(s, l)?;
        if r.any() {
            let func = load_kernel(&r.dev, "kestrel_argmax_f32")?;
            let mut b = func.builder();
            b.arg(&r.logits);
            b.arg(&r.out);
            b.arg(&r.vocab);
            // SAFETY: argument types match kestrel_argmax_f32.
            unsafe { b.launch(r.cfg()) }?;
        }
        Ok(r.finish())
    }
}

/// `kestrel_sample_f32` (top-k, top-p) or `kestrel_sample_typical_f32`: one token id a row of
/// f32 logits, drawn at `1 / inv_t` temperature from the filtered law with the row's uniform
/// (the second input, f32 `[rows]`).
pub(crate) struct Sample {
    pub inv_t: f32,
    pub filter: SampleFilter,
}

pub(crate) enum SampleFilter {
    /// Top-k (0: none), then top-p (≥ 1: none).
    TopKP { top_k: usize, top_p: f32 },
    /// Typical acceptance's cut at posterior threshold ε.
    Typical { eps: f32 },
}

impl candle_core::CustomOp2 for Sample {
    fn name(&self) -> &'static str {
        "kestrel-sample"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel sample runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let r = RowIds::new(s, l)?;
        let uniforms = view::<f32>(u, ul, "uniforms")?;
        if r.any() {
            let name = match self.filter {
                SampleFilter::TopKP { .. } => "kestrel_sample_f32",
                SampleFilter::Typical { .. } => "kestrel_sample_typical_f32",
            };
            let func = load_kernel(&r.dev, name)?;
            let mut b = func.builder();
            b.arg(&r.logits);
            b.arg(&uniforms);
            b.arg(&r.out);
            b.arg(&r.vocab);
            b.arg(&self.inv_t);
            match &self.filter {
                SampleFilter::TopKP { top_k, top_p } => {
                    // Beyond the vocabulary top-k keeps everything, as 0 does.
                    b.arg(&i32::try_from(*top_k).unwrap_or(0));
                    b.arg(top_p);
                }
                SampleFilter::Typical { eps } => {
                    b.arg(eps);
                }
            }
            // SAFETY: argument types match the kernel picked above; one uniform a row (lib.rs).
            unsafe { b.launch(r.cfg()) }?;
        }
        Ok(r.finish())
    }
}

/// `kestrel_row_laws_f32`: each row's warped law (`LAW_WORDS` u32 a row) for
/// [`ChainAccept`].
pub(crate) struct RowLaws {
    pub inv_t: f32,
    pub top_k: usize,
    pub top_p: f32,
}

/// `LAW_WORDS` in logit_rows.cuh.
const LAW_WORDS: usize = 6;

impl CustomOp1 for RowLaws {
    fn name(&self) -> &'static str {
        "kestrel-row-laws"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel row laws run on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let (rows, vocab) = l.shape().dims2()?;
        let logits = view::<f32>(s, l, "logits")?;
        // SAFETY: one block per row writes its LAW_WORDS words.
        let out = unsafe { dev.alloc::<u32>(rows * LAW_WORDS)? };
        if rows > 0 && vocab > 0 {
            let func = load_kernel(&dev, "kestrel_row_laws_f32")?;
            let mut b = func.builder();
            b.arg(&logits);
            b.arg(&out);
            b.arg(&i32_arg(vocab, "vocabulary")?);
            b.arg(&self.inv_t);
            // Beyond the vocabulary top-k keeps everything, as 0 does.
            b.arg(&i32::try_from(self.top_k).unwrap_or(0));
            b.arg(&self.top_p);
            // SAFETY: argument types match kestrel_row_laws_f32.
            unsafe { b.launch(launch_cfg((rows as u32, 1), 1024)) }?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((rows, LAW_WORDS)),
        ))
    }
}

/// The target's and the draft's logits with their laws ([`RowLaws`]), the first four
/// parameters of the acceptance kernels.
pub(crate) struct Laws {
    pub p: Tensor,
    pub p_laws: Tensor,
    pub q: Tensor,
    pub q_laws: Tensor,
}

impl Laws {
    /// Passes p, p's laws, q, q's laws (a kernel parameter holds the address itself).
    fn push_args(&self, b: &mut Args<'_>) -> Result<()> {
        cuda_storage!(ps, pl = self.p, "target logits");
        cuda_storage!(pls, pll = self.p_laws, "target laws");
        cuda_storage!(qs, ql = self.q, "draft logits");
        cuda_storage!(qls, qll = self.q_laws, "draft laws");
        b.arg(&view::<f32>(ps, pl, "target logits")?);
        b.arg(&view::<u32>(pls, pll, "target laws")?);
        b.arg(&view::<f32>(qs, ql, "draft logits")?);
        b.arg(&view::<u32>(qls, qll, "draft laws")?);
        Ok(())
    }
}

/// `kestrel_chain_accept_f32` over its metadata (the input): `[n_seq, 2]` u32, each
/// sequence's accepted count and next token.
pub(crate) struct ChainAccept {
    pub laws: Laws,
    pub n_seq: usize,
    pub kmax: usize,
    pub inv_t: f32,
}

impl CustomOp1 for ChainAccept {
    fn name(&self) -> &'static str {
        "kestrel-chain-accept"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel chain acceptance runs on CUDA only")
    }

    fn cuda_fwd(&self, m: &CudaStorage, ml: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = m.device().clone();
        let vocab = self.laws.p.dim(1)?;
        let meta = view::<u32>(m, ml, "chain metadata")?;
        // SAFETY: one block per sequence writes its two words.
        let out = unsafe { dev.alloc::<u32>(self.n_seq * 2)? };
        let func = load_kernel(&dev, "kestrel_chain_accept_f32")?;
        let mut b = func.builder();
        self.laws.push_args(&mut b)?;
        b.arg(&meta);
        b.arg(&out);
        let (v, n_seq, kmax) = (
            i32_arg(vocab, "vocabulary")?,
            i32_arg(self.n_seq, "sequences")?,
            i32_arg(self.kmax, "drafts")?,
        );
        b.arg(&v);
        b.arg(&n_seq);
        b.arg(&kmax);
        b.arg(&self.inv_t);
        // SAFETY: argument types match kestrel_chain_accept_f32; chain_accept (lib.rs) checked
        // every row, token and uniform against the tensors.
        unsafe { b.launch(launch_cfg((self.n_seq as u32, 1), 1024)) }?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((self.n_seq, 2)),
        ))
    }
}

/// `kestrel_draw_children_f32` over a level's draft logits (first input) with each
/// sequence's uniforms (second): `[rows · k + n_seq]` u32, the rows' columns then each
/// sequence's uniforms used.
pub(crate) struct DrawChildren {
    pub laws: Tensor,
    pub n_seq: usize,
    pub width: usize,
    pub k: usize,
    pub inv_t: f32,
}

impl candle_core::CustomOp2 for DrawChildren {
    fn name(&self) -> &'static str {
        "kestrel-draw-children"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel draw_children runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        u: &CudaStorage,
        ul: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let (rows, columns) = l.shape().dims2()?;
        let logits = view::<f32>(s, l, "draft logits")?;
        let uniforms = view::<f32>(u, ul, "uniforms")?;
        cuda_storage!(ls, ll = self.laws, "draft laws");
        let laws = view::<u32>(ls, ll, "draft laws")?;
        let len = rows * self.k + self.n_seq;
        // SAFETY: every row's k picks and every sequence's count are written.
        let out = unsafe { dev.alloc::<u32>(len)? };
        let func = load_kernel(&dev, "kestrel_draw_children_f32")?;
        let mut b = func.builder();
        b.arg(&logits);
        b.arg(&laws);
        b.arg(&uniforms);
        b.arg(&out);
        let (v, n_seq, width, k) = (
            i32_arg(columns, "draft columns")?,
            i32_arg(self.n_seq, "sequences")?,
            i32_arg(self.width, "expanded nodes")?,
            i32_arg(self.k, "children")?,
        );
        b.arg(&v);
        b.arg(&n_seq);
        b.arg(&width);
        b.arg(&k);
        b.arg(&self.inv_t);
        // SAFETY: argument types match kestrel_draw_children_f32; draw_children (lib.rs)
        // checked rows = n_seq · width, k ≤ TREE_MAX_CHILDREN and width · k uniforms each.
        unsafe { b.launch(launch_cfg((self.n_seq as u32, 1), 1024)) }?;
        Ok((CudaStorage::wrap_cuda_slice(out, dev), Shape::from(len)))
    }
}

/// `kestrel_tree_accept_f32` over its metadata (the input): `[n_seq, 3 + nmax]` u32.
pub(crate) struct TreeAccept {
    pub laws: Laws,
    pub col_of: Option<Tensor>,
    pub n_seq: usize,
    pub nmax: usize,
    pub inv_t: f32,
    pub sampled: bool,
}

impl CustomOp1 for TreeAccept {
    fn name(&self) -> &'static str {
        "kestrel-tree-accept"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel tree acceptance runs on CUDA only")
    }

    fn cuda_fwd(&self, m: &CudaStorage, ml: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = m.device().clone();
        let vocab = self.laws.p.dim(1)?;
        let columns = self.laws.q.dim(1)?;
        let meta = view::<u32>(m, ml, "tree metadata")?;
        let width = 3 + self.nmax;
        // SAFETY: one block per sequence writes its row's header and accepted nodes; the rest
        // of the row is never read.
        let out = unsafe { dev.alloc::<u32>(self.n_seq * width)? };
        let func = load_kernel(&dev, "kestrel_tree_accept_f32")?;
        let mut b = func.builder();
        self.laws.push_args(&mut b)?;
        let col_storage = self.col_of.as_ref().map(|c| c.storage_and_layout());
        let col_view = match &col_storage {
            Some((g, l)) => {
                let Storage::Cuda(c) = &**g else {
                    bail!("draft column table is not on the CUDA device")
                };
                Some(view::<u32>(c, l, "draft column table")?)
            }
            None => None,
        };
        let null = 0u64;
        match &col_view {
            Some(c) => b.arg(c),
            None => b.arg(&null), // no table: column = token
        };
        b.arg(&meta);
        b.arg(&out);
        let (v, vq, n_seq, nmax) = (
            i32_arg(vocab, "vocabulary")?,
            i32_arg(columns, "draft columns")?,
            i32_arg(self.n_seq, "sequences")?,
            i32_arg(self.nmax, "nodes")?,
        );
        let sampled = i32::from(self.sampled);
        b.arg(&v);
        b.arg(&vq);
        b.arg(&n_seq);
        b.arg(&nmax);
        b.arg(&self.inv_t);
        b.arg(&sampled);
        // SAFETY: argument types match kestrel_tree_accept_f32; tree_accept (lib.rs) checked
        // every node, row, child and uniform against the tensors.
        unsafe { b.launch(launch_cfg((self.n_seq as u32, 1), 1024)) }?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((self.n_seq, width)),
        ))
    }
}

/// `kestrel_topk_logp_f32`: `[rows, 2k]` u32, ids then log-probability bits.
pub(crate) struct TopKLogp {
    pub k: usize,
}

impl CustomOp1 for TopKLogp {
    fn name(&self) -> &'static str {
        "kestrel-topk-logp"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel top-k runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let dev = s.device().clone();
        let (rows, vocab) = l.shape().dims2()?;
        let sv = view::<f32>(s, l, "logits")?;
        // SAFETY: one block per row writes its 2k entries.
        let out = unsafe { dev.alloc::<u32>(rows * 2 * self.k)? };
        if rows > 0 {
            let func = load_kernel(&dev, "kestrel_topk_logp_f32")?;
            let (v_a, k_a) = (i32_arg(vocab, "vocabulary")?, i32_arg(self.k, "k")?);
            let mut b = func.builder();
            b.arg(&sv);
            b.arg(&out);
            b.arg(&v_a);
            b.arg(&k_a);
            // SAFETY: argument types match kestrel_topk_logp_f32; k ≤ TOPK_MAX was checked.
            unsafe { b.launch(launch_cfg((rows as u32, 1), 256)) }?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev),
            Shape::from((rows, 2 * self.k)),
        ))
    }
}

/// `kestrel_qkv_rope_*`: the fused projection's split, RoPE and K/V append (see kernels.cu).
pub(crate) struct QkvRope {
    pub cos: Tensor,
    pub sin: Tensor,
    pub slots: Tensor,
    pub k_pool: Tensor,
    pub v_pool: Tensor,
    pub nh: usize,
    pub nkv: usize,
}

impl QkvRope {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        qkv: (&CudaStorage, &Layout),
        sfx: &str,
    ) -> Result<CudaStorage> {
        let dev = qkv.0.device().clone();
        let (n_tok, width) = qkv.1.shape().dims2()?;
        let d = width / (self.nh + 2 * self.nkv);
        cuda_storage!(cs, cl = self.cos, "RoPE cos");
        cuda_storage!(ss, sl = self.sin, "RoPE sin");
        cuda_storage!(ids, idl = self.slots, "slot ids");
        cuda_storage!(ks, kl = self.k_pool, "K pool");
        cuda_storage!(vs, vl = self.v_pool, "V pool");
        let qv = view::<T>(qkv.0, qkv.1, "fused qkv")?;
        let cv = view::<T>(cs, cl, "RoPE cos")?;
        let sv = view::<T>(ss, sl, "RoPE sin")?;
        let idv = view::<u32>(ids, idl, "slot ids")?;
        let kv = view::<T>(ks, kl, "K pool")?;
        let vv = view::<T>(vs, vl, "V pool")?;
        // SAFETY: the kernel writes every element of every q head.
        let out = unsafe { dev.alloc::<T>(n_tok * self.nh * d)? };
        if n_tok > 0 {
            let func = load_kernel(&dev, &format!("kestrel_qkv_rope_{sfx}"))?;
            let (nh, nkv, d_a) = (
                i32_arg(self.nh, "heads")?,
                i32_arg(self.nkv, "KV heads")?,
                i32_arg(d, "head_dim")?,
            );
            let mut b = func.builder();
            b.arg(&qv);
            b.arg(&cv);
            b.arg(&sv);
            b.arg(&idv);
            b.arg(&out);
            b.arg(&kv);
            b.arg(&vv);
            b.arg(&nh);
            b.arg(&nkv);
            b.arg(&d_a);
            // 16-byte accesses where every row allows them: a thread then takes that many
            // pairs of a head.
            let elem_bytes = std::mem::size_of::<T>();
            let per_vec = 16 / elem_bytes;
            let vec = (d / 2).is_multiple_of(per_vec)
                && start_aligned(&[qkv.1, cl, sl, kl, vl], elem_bytes);
            let vec_a = i32::from(vec);
            b.arg(&vec_a);
            let units = (self.nh + 2 * self.nkv) * (d / 2) / if vec { per_vec } else { 1 };
            let threads = threads_for(units).min(128);
            let cfg = launch_cfg(
                (n_tok as u32, units.div_ceil(threads as usize) as u32),
                threads,
            );
            // SAFETY: argument types match kestrel_qkv_rope_*; the kernel writes the pools
            // (through views of read guards: nothing on the host reads them meanwhile, and
            // the stream orders it with every other use) only at the given slots.
            unsafe { b.launch(cfg) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl CustomOp1 for QkvRope {
    fn name(&self) -> &'static str {
        "kestrel-qkv-rope"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel qkv rope runs on CUDA only")
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        let (n_tok, width) = l.shape().dims2()?;
        let d = width / (self.nh + 2 * self.nkv);
        let out = by_dtype!(s.dtype(), "qkv rope", |T, sfx| self
            .run::<T>((s, l), sfx)?);
        Ok((out, Shape::from((n_tok, self.nh, d))))
    }
}

/// `kestrel_kv_move_*` over `pools` (same shape, dtype and device; see kernels.cu).
pub(crate) fn kv_move(pools: &[Tensor], moves: &[(u32, u32)]) -> Result<()> {
    by_dtype!(pools[0].dtype(), "kv move", |T, sfx| kv_move_typed::<T>(
        pools, moves, sfx
    ))
}

fn kv_move_typed<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    pools: &[Tensor],
    moves: &[(u32, u32)],
    sfx: &str,
) -> Result<()> {
    use candle_core::cuda::cudarc::driver::DevicePtr;
    let dev = match pools[0].device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("kv move: the pools are not on a CUDA device"),
    };
    let stream = dev.cuda_stream();
    let width = pools[0].dims()[1..].iter().product::<usize>();
    let mut table = Vec::with_capacity(2 * pools.len() + 2 * moves.len());
    for (i, pool) in pools.iter().enumerate() {
        cuda_storage!(ps, pl = pool, format!("KV pool {i}"));
        let pv = view::<T>(ps, pl, "KV pool")?;
        // The address only: the kernel is ordered after every earlier use by the stream.
        let (ptr, _sync) = pv.device_ptr(&stream);
        table.extend([ptr as u32, (ptr >> 32) as u32]);
    }
    table.extend(moves.iter().map(|m| m.0));
    table.extend(moves.iter().map(|m| m.1));
    let table = dev.clone_htod(&table)?;
    // SAFETY: the kernel writes every element before reading it back.
    let scratch = unsafe { dev.alloc::<T>(pools.len() * moves.len() * width)? };
    let func = load_kernel(&dev, &format!("kestrel_kv_move_{sfx}"))?;
    let (np, m, w) = (
        i32_arg(pools.len(), "pools")?,
        i32_arg(moves.len(), "moves")?,
        i32_arg(width, "row width")?,
    );
    let mut b = func.builder();
    b.arg(&table);
    b.arg(&scratch);
    b.arg(&np);
    b.arg(&m);
    b.arg(&w);
    // SAFETY: argument types match kestrel_kv_move_*; the table holds live pools of T with
    // `width` elements per row, and the rows were checked against the pools' lengths.
    unsafe { b.launch(launch_cfg((pools.len() as u32, 1), 256)) }?;
    Ok(())
}

/// Warps per block of the `kestrel_gemv*` kernels (`GEMV_WARPS` in kernels.cu).
const GEMV_WARPS: usize = 8;

/// The launch of a gemv kernel over `n` output columns of width `k` (elements of
/// `elem_bytes`), with `stage_bytes` of dynamic shared memory, and its `split`: how many
/// warps share a column. Each warp should get a full 16-byte vector per lane for every pass
/// over its part of K, so K = 576 in bf16 (72 vectors) takes 2 warps, not 4 with the last one
/// idle; fewer warps per column also means fewer blocks (one wave for SmolLM2's gate_up
/// rather than two). Depends on K alone, so a row's sum order never depends on M.
/// The tensor-core engine (split `GEMV_MMA` = 0) takes 16 columns a block, its 8 warps
/// sharing K.
fn gemv_launch(n: usize, k: usize, elem_bytes: usize, stage_bytes: usize) -> (LaunchConfig, i32) {
    if crate::gemv_tensor_cores(elem_bytes, k) {
        let mut cfg = launch_cfg((n.div_ceil(16) as u32, 1), (GEMV_WARPS * 32) as u32);
        cfg.shared_mem_bytes = stage_bytes as u32;
        return (cfg, 0);
    }
    let vec = 16 / elem_bytes;
    let rounds = k / (32 * vec);
    let split = match rounds {
        0 | 1 => 1,
        2 | 3 => 2,
        _ => 4,
    };
    let mut cfg = launch_cfg(
        (n.div_ceil(GEMV_WARPS / split) as u32, 1),
        (GEMV_WARPS * 32) as u32,
    );
    cfg.shared_mem_bytes = stage_bytes as u32;
    (cfg, split as i32)
}

/// Blocks per multiprocessor up to which a one-row launch takes the deeper weight ring of
/// `kestrel_gemv_row_mma_deep_*` (2 blocks of K a warp in flight instead of 1): with so few
/// warps on a multiprocessor one block of K each leaves the memory idle between requests.
/// H200, bf16 (tools/gpu/gemv_probe.cu): Llama-2-7B's o_proj and down_proj (256 blocks,
/// 1.9 a multiprocessor) 12.6 → 11.7 and 26.6 → 24.1 µs; q/k/v (768 blocks, 5.8) 26.6 →
/// 27.5 and gate_up (1,376) 44.7 → 45.8 µs, which is why bigger grids keep the ring of 1.
/// The ring's depth changes no warp's order of blocks, so no bits.
const GEMV_DEEP_RING_MAX_BLOCKS_PER_SM: usize = 2;

/// The one-row tensor-core kernel for `n` columns (`gemv_launch` gives 16 a block).
fn gemv_row_kernel(dev: &CudaDevice, n: usize) -> Result<&'static str> {
    let deep =
        n.div_ceil(16) <= GEMV_DEEP_RING_MAX_BLOCKS_PER_SM * crate::launch::multiprocessors(dev)?;
    Ok(if deep {
        "kestrel_gemv_row_mma_deep"
    } else {
        "kestrel_gemv_row_mma"
    })
}

/// Whether a gemv launch of `m` rows over `K = k` reads its weights evict-first from L2 (the
/// `kestrel_gemv*_evict_*` instances: the same bits). On the H200 (session 31, random weights,
/// bf16, graphs) Llama-2-7B's verifications got shorter with it: 16 rows 5.61 → 5.04 ms, 8 rows
/// 4.30 → 4.21, 64 rows 9.13 → 9.01, and 10-13% at 16 rows with the attention left out too, so
/// the gain is in the gemvs' own L2 traffic; one-row steps keep plain loads (marking them cost
/// decode 5% in session 27), and SmolLM2's narrow K gained nothing (session 28: verify:8 +4% with
/// every multi-row load marked). `KESTREL_GEMV_EVICT` overrides the default `wide` (steps of
/// several rows with K ≥ 2,048): `0` never, `all` every step of several rows.
fn evict_weights(m: usize, k: usize, elem_bytes: usize) -> bool {
    #[derive(Clone, Copy, PartialEq)]
    enum Evict {
        Never,
        Wide,
        All,
    }
    static MODE: std::sync::OnceLock<Evict> = std::sync::OnceLock::new();
    let mode = *MODE.get_or_init(|| match std::env::var("KESTREL_GEMV_EVICT").as_deref() {
        Ok("0") => Evict::Never,
        Ok("all") => Evict::All,
        _ => Evict::Wide,
    });
    elem_bytes == 2
        && m > 1
        && match mode {
            Evict::Never => false,
            Evict::Wide => k >= EVICT_MIN_K,
            Evict::All => true,
        }
}

/// The narrowest K whose multi-row gemvs load weights evict-first by default.
const EVICT_MIN_K: usize = 2048;

/// The kernel `base` of a gemv launch, with `_evict` where [`evict_weights`] says so.
fn gemv_kernel_name(base: &str, m: usize, k: usize, elem_bytes: usize, sfx: &str) -> String {
    if evict_weights(m, k, elem_bytes) {
        format!("{base}_evict_{sfx}")
    } else {
        format!("{base}_{sfx}")
    }
}

/// Columns and rows of a `kestrel_gemv_tiled_*` block (`TILED_COLS`, `TILED_ROWS`).
const TILED_COLS: usize = 128;
const TILED_ROWS: usize = 64;
/// Blocks of K in its shared memory (`TILED_STAGES`), each the block's weight rows and input
/// rows of `GEMV_MMA_K_BLOCK` elements padded by 8 (`TILED_LD`).
const TILED_STAGES: usize = 4;
/// The one-row engine's partial sums per output (`TILED_CHAINS`: its warps), which the tiled
/// engine may split between blocks.
const TILED_CHAINS: usize = GEMV_WARPS;
/// Blocks a tiled launch aims for: two resident on each of an H200's 132 multiprocessors
/// (110.6 KiB of shared memory and 128 registers a thread each).
const TILED_TARGET_BLOCKS: usize = 264;

/// How many blocks share each tile's chains (`groups` of `kestrel_gemv_tiled_*`): the most,
/// of 8, 4 and 2, that keep a launch within [`TILED_TARGET_BLOCKS`], else 1. Llama-2-7B at 64
/// rows: q/k/v 96 tiles → 2, gate_up 172 → 1, o_proj and down_proj 32 → 8. A split costs
/// 8 f32 partial sums an output and a second launch, and changes no bits.
/// `KESTREL_GEMV_TILED_GROUPS` (1, 2, 4 or 8) overrides it, to measure the choice.
fn gemv_tiled_groups(tiles: usize) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    forced_count(&FORCED, "KESTREL_GEMV_TILED_GROUPS").unwrap_or_else(|| {
        [8, 4, 2]
            .into_iter()
            .find(|g| tiles * g <= TILED_TARGET_BLOCKS)
            .unwrap_or(1)
    })
}

/// The launch of the tiled engine over `[m, k] · [n, k]ᵀ` with `groups` blocks a tile: a
/// block per group of chains (the fastest index: a tile's groups read adjacent pieces of
/// the same weight rows), `TILED_ROWS` rows (next, so the blocks that share weight columns
/// run together and the weights cross from memory about once) and `TILED_COLS` columns.
/// Its shared memory is past the 48 KiB a launch gets by default ([`allow_shared_memory`]).
fn gemv_tiled_launch(
    func: &crate::launch::Kernel,
    m: usize,
    n: usize,
    groups: usize,
    elem_bytes: usize,
) -> Result<LaunchConfig> {
    let smem =
        TILED_STAGES * (TILED_COLS + TILED_ROWS) * (crate::GEMV_MMA_K_BLOCK + 8) * elem_bytes;
    allow_shared_memory(func, smem)?;
    Ok(LaunchConfig {
        grid_dim: (
            groups as u32,
            m.div_ceil(TILED_ROWS) as u32,
            n.div_ceil(TILED_COLS) as u32,
        ),
        block_dim: ((GEMV_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    })
}

/// Lets `func` launch with `bytes` of dynamic shared memory (past the 48 KiB a launch gets by
/// default) where it may not yet: driver calls, not stream operations (legal inside a graph
/// capture). The function's own attribute says whether it may, not a set of functions already
/// allowed: a handle is only an address, which a module loaded after another's unloading (a
/// second device opened in one process, as the GPU tests do) may reuse, and a launch through
/// it then failed for want of the attribute.
fn allow_shared_memory(func: &crate::launch::Kernel, bytes: usize) -> Result<()> {
    use candle_core::cuda::cudarc::driver::sys::CUfunction_attribute;
    let allowed = func
        .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)
        .w()?;
    if (allowed.max(0) as usize) < bytes {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .w()?;
        // All of the L1/shared split as shared memory, so that the blocks the engines count
        // on (2 × 108 KiB tiled, 3 × 68 KiB warpgroup) fit a multiprocessor whatever the
        // driver's default.
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        )
        .w()?;
    }
    Ok(())
}

/// Rows of a warpgroup engine block, and of its weight groups (`gemv_wgmma.cuh`).
const WGMMA_ROWS: usize = 64;
/// Its shared memory: 4 stages of a 64-k block of 64 step rows and of 64 weight rows padded
/// by 8 values (`WG_STAGES`, `WG_STAGE_ELEMS`).
const WGMMA_SMEM_BYTES: usize =
    4 * (WGMMA_ROWS * crate::GEMV_MMA_K_BLOCK + WGMMA_ROWS * (crate::GEMV_MMA_K_BLOCK + 8)) * 2;

/// Whether steps of many rows take the warpgroup engine (`kestrel_gemv_wgmma_*`) rather than
/// the tiled one on `dev`: f16/bf16 on compute capability 9.0, the only target of its PTX. Both
/// give every row the one-row engine's bits, so this changes speed only.
/// `KESTREL_GEMV_WGMMA=0` keeps the tiled engine, to measure the choice.
fn gemv_wgmma_applies(dev: &CudaDevice, elem_bytes: usize) -> Result<bool> {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var("KESTREL_GEMV_WGMMA").is_ok_and(|v| v == "0"));
    Ok(!off && elem_bytes == 2 && crate::launch::is_sm90(dev)?)
}

/// How many blocks (a cluster) share each 64-row group's 8 chains in the warpgroup engine: 1
/// when the groups alone fill the GPU's multiprocessors (Llama-2-7B's q/k/v, gate_up and LM
/// head at 64 rows), else 4, or 8 for the smallest products (SmolLM2's). Measured on an H100
/// (`tools/gpu/frag_probe.cu`, build 9; docs/gpu-results.md, session 46).
/// `KESTREL_GEMV_WGMMA_SPLIT` (1, 4 or 8; there is no 2: its later block would hold 3 chains'
/// sums in registers) overrides it, to measure the choice.
fn gemv_wgmma_split(blocks: usize) -> usize {
    static FORCED: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    match forced_count(&FORCED, "KESTREL_GEMV_WGMMA_SPLIT") {
        Some(forced) if forced != 2 => forced,
        _ if blocks >= 96 => 1,
        _ if blocks >= 24 => 4,
        _ => 8,
    }
}

/// Values of `m` rows of `k` in the warpgroup engine's layout (`wg_rows_offset` in
/// kernels.cu): whole 64-row tiles.
pub(crate) fn gemv_wgmma_laid_len(m: usize, k: usize) -> usize {
    m.div_ceil(WGMMA_ROWS) * WGMMA_ROWS * k
}

/// `kestrel_gemv_wgmma_rows_*` (the rows in the engine's order, into a workspace), then
/// [`gemv_wgmma_laid`].
fn gemv_wgmma<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    xv: &CudaView<'_, T>,
    wv: &CudaView<'_, T>,
    out: &CudaSlice<T>,
    (m, n, k): (usize, usize, usize),
    sfx: &str,
) -> Result<()> {
    let tiles = m.div_ceil(WGMMA_ROWS);
    let (m_a, k_a) = (i32_arg(m, "rows")?, i32_arg(k, "K")?);
    // SAFETY: the rows kernel writes every element (zeros past row m) before the gemv reads.
    let rows = unsafe { dev.alloc::<T>(gemv_wgmma_laid_len(m, k))? };
    let func = load_kernel(dev, &format!("kestrel_gemv_wgmma_rows_{sfx}"))?;
    let mut b = func.builder();
    b.arg(xv);
    b.arg(&rows);
    b.arg(&m_a);
    b.arg(&k_a);
    let blocks = ((k / crate::GEMV_MMA_K_BLOCK) as u32, tiles as u32, 1);
    // SAFETY: argument types match kestrel_gemv_wgmma_rows_*: x [m, k] in, tiles · 64 · k out.
    unsafe {
        b.launch(LaunchConfig {
            grid_dim: blocks,
            block_dim: (512, 1, 1),
            shared_mem_bytes: 0,
        })
    }?;
    gemv_wgmma_laid(dev, &rows.slice(..), wv, out, (m, n, k), sfx)
}

/// `kestrel_gemv_wgmma_s{split}[_evict]_*` over `m` rows of `k` already in the engine's layout
/// (`laid`, [`gemv_wgmma_laid_len`] values) and `w [n, k]` into `out [m, n]`.
fn gemv_wgmma_laid<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    laid: &CudaView<'_, T>,
    wv: &CudaView<'_, T>,
    out: &CudaSlice<T>,
    (m, n, k): (usize, usize, usize),
    sfx: &str,
) -> Result<()> {
    let (groups, tiles) = (n.div_ceil(WGMMA_ROWS), m.div_ceil(WGMMA_ROWS));
    let (m_a, n_a, k_a) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "columns")?,
        i32_arg(k, "K")?,
    );
    let split = gemv_wgmma_split(groups * tiles);
    let evict = if evict_weights(m, k, std::mem::size_of::<T>()) {
        "_evict"
    } else {
        ""
    };
    let func = load_kernel(dev, &format!("kestrel_gemv_wgmma_s{split}{evict}_{sfx}"))?;
    allow_shared_memory(&func, WGMMA_SMEM_BYTES)?;
    let cfg = LaunchConfig {
        grid_dim: (groups as u32, split as u32, tiles as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: WGMMA_SMEM_BYTES as u32,
    };
    let mut b = func.builder();
    b.arg(laid);
    b.arg(wv);
    b.arg(out);
    b.arg(&m_a);
    b.arg(&n_a);
    b.arg(&k_a);
    // SAFETY: argument types match kestrel_gemv_wgmma_*; shapes and alignment were checked by
    // the launcher in lib.rs (K a multiple of the K block, 16-byte aligned rows); the grid's
    // y is the kernel's cluster size.
    unsafe { b.launch(cfg) }
}

/// Whether a product of `m` rows over `k` into `n` columns of `elem_bytes` values takes the
/// warpgroup engine on `dev`, so that the kernel producing its rows may write them in the
/// engine's layout (then [`Gemv`] with `laid_rows`) and spare the layout's launch.
pub(crate) fn gemv_takes_wgmma(
    dev: &CudaDevice,
    (m, n, k): (usize, usize, usize),
    elem_bytes: usize,
) -> Result<bool> {
    Ok(crate::gemv_tiled_applies(m, n, k, elem_bytes) && gemv_wgmma_applies(dev, elem_bytes)?)
}

/// `kestrel_gemv_tiled_*` over `x [m, k] · wᵀ` into `out [m, n]`, and with its chains split
/// between blocks, `kestrel_gemv_tiled_sum_*` after it.
fn gemv_tiled<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
    dev: &CudaDevice,
    xv: &CudaView<'_, T>,
    wv: &CudaView<'_, T>,
    out: &CudaSlice<T>,
    (m, n, k): (usize, usize, usize),
    sfx: &str,
) -> Result<()> {
    let func = load_kernel(
        dev,
        &gemv_kernel_name("kestrel_gemv_tiled", m, k, std::mem::size_of::<T>(), sfx),
    )?;
    let tiles = m.div_ceil(TILED_ROWS) * n.div_ceil(TILED_COLS);
    let groups = gemv_tiled_groups(tiles);
    let cfg = gemv_tiled_launch(&func, m, n, groups, std::mem::size_of::<T>())?;
    // SAFETY: the blocks write every chain's sum of every output before the sum reads it.
    let parts = if groups > 1 {
        Some(unsafe { dev.alloc::<f32>(TILED_CHAINS * m * n)? })
    } else {
        None
    };
    let (m_a, n_a, k_a, g_a) = (
        i32_arg(m, "rows")?,
        i32_arg(n, "columns")?,
        i32_arg(k, "K")?,
        i32_arg(groups, "groups")?,
    );
    let null: u64 = 0;
    let mut b = func.builder();
    b.arg(xv);
    b.arg(wv);
    b.arg(out);
    match &parts {
        Some(p) => b.arg(p),
        None => b.arg(&null),
    };
    b.arg(&m_a);
    b.arg(&n_a);
    b.arg(&k_a);
    b.arg(&g_a);
    // SAFETY: argument types match kestrel_gemv_tiled_*; shapes and alignment were checked by
    // the launcher in lib.rs (K a multiple of the K block); `parts` holds 8·m·n f32 whenever
    // groups > 1, the only case the kernel touches it.
    unsafe { b.launch(cfg) }?;
    if let Some(parts) = &parts {
        let func = load_kernel(dev, &format!("kestrel_gemv_tiled_sum_{sfx}"))?;
        let mn = (m * n) as u64;
        let mut b = func.builder();
        b.arg(parts);
        b.arg(out);
        b.arg(&mn);
        // SAFETY: argument types match kestrel_gemv_tiled_sum_*: 8·mn partial sums in, mn out.
        unsafe { b.launch(launch_cfg(((m * n).div_ceil(256).min(4096) as u32, 1), 256)) }?;
    }
    Ok(())
}

/// `kestrel_gemv_*`: `x [M, K] · wᵀ` for the weight `w [N, K]`; with `swiglu`,
/// `kestrel_gemv_swiglu_*`: `x` is a fused gate_up output `[M, 2K]` and the product takes
/// `silu(gate) · up` of it; with `laid_rows: Some(M)`, `x` is M rows already in the
/// warpgroup engine's layout ([`gemv_wgmma_laid_len`] values), which that engine takes.
pub(crate) struct Gemv {
    pub swiglu: bool,
    pub laid_rows: Option<usize>,
}

impl Gemv {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        x: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        sfx: &str,
    ) -> Result<CudaStorage> {
        let dev = x.0.device().clone();
        let (n, k) = w.1.shape().dims2()?;
        if let Some(m) = self.laid_rows {
            if x.1.shape().elem_count() != gemv_wgmma_laid_len(m, k) {
                bail!(
                    "gemv of laid-out rows: {:?} for {m} rows of {k}",
                    x.1.shape()
                );
            }
            let lv = view::<T>(x.0, x.1, "laid-out rows")?;
            let wv = view::<T>(w.0, w.1, "gemv weight")?;
            // SAFETY: every (row, column) below m is written by the engine.
            let out = unsafe { dev.alloc::<T>(m * n)? };
            gemv_wgmma_laid(&dev, &lv, &wv, &out, (m, n, k), sfx)?;
            return Ok(CudaStorage::wrap_cuda_slice(out, dev));
        }
        let (m, _) = x.1.shape().dims2()?;
        let xv = view::<T>(x.0, x.1, "gemv input")?;
        let wv = view::<T>(w.0, w.1, "gemv weight")?;
        // SAFETY: every (row, column) is written by its column's warp.
        let out = unsafe { dev.alloc::<T>(m * n)? };
        if m > 0 && n > 0 {
            let (kernel, stage) = if self.swiglu {
                let stage = crate::gemv_swiglu_stage(m, k, std::mem::size_of::<T>());
                ("kestrel_gemv_swiglu", stage)
            } else if m == 1 && crate::gemv_tensor_cores(std::mem::size_of::<T>(), k) {
                // A decode step's row: the tensor-core engine alone, M = 1 compiled in.
                (gemv_row_kernel(&dev, n)?, 0)
            } else if m <= crate::GEMV_MAX_ROWS {
                // One tile of rows: the kernel that keeps one tile of partial sums.
                ("kestrel_gemv_one_tile", 0)
            } else {
                ("kestrel_gemv", 0)
            };
            let elem_bytes = std::mem::size_of::<T>();
            if !self.swiglu && crate::gemv_tiled_applies(m, n, k, elem_bytes) {
                if gemv_wgmma_applies(&dev, elem_bytes)? {
                    gemv_wgmma(&dev, &xv, &wv, &out, (m, n, k), sfx)?;
                } else {
                    gemv_tiled(&dev, &xv, &wv, &out, (m, n, k), sfx)?;
                }
            } else {
                let (m_a, n_a, k_a) = (
                    i32_arg(m, "rows")?,
                    i32_arg(n, "columns")?,
                    i32_arg(k, "K")?,
                );
                let func = load_kernel(
                    &dev,
                    &gemv_kernel_name(kernel, m, k, std::mem::size_of::<T>(), sfx),
                )?;
                let (cfg, split) = gemv_launch(n, k, std::mem::size_of::<T>(), stage);
                let mut b = func.builder();
                b.arg(&xv);
                b.arg(&wv);
                b.arg(&out);
                b.arg(&m_a);
                b.arg(&n_a);
                b.arg(&k_a);
                b.arg(&split);
                // SAFETY: argument types match kestrel_gemv_{,one_tile_,row_mma_{,deep_}}* and
                // kestrel_gemv_swiglu_*; shapes, alignment and the staging size were checked
                // by the launcher in lib.rs.
                unsafe { b.launch(cfg) }?;
            }
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

/// `kestrel_gemv_add_rmsnorm_*` over the rows `x [M, K]` and the norm weight `[K]`, with the
/// residual `res` (or none) and the projection `w [N, K]`: one buffer holding `x + res`
/// `[M·K]` (only with `res`), then the product `[M·N]`.
pub(crate) struct GemvAddRmsNorm {
    pub res: Option<Tensor>,
    pub w: Tensor,
    pub eps: f32,
}

impl GemvAddRmsNorm {
    fn run<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
        &self,
        x: (&CudaStorage, &Layout),
        nw: (&CudaStorage, &Layout),
        sfx: &str,
    ) -> Result<CudaStorage> {
        let dev = x.0.device().clone();
        let (m, _) = x.1.shape().dims2()?;
        cuda_storage!(ws, wl = self.w, "gemv weight");
        let (n, k) = wl.shape().dims2()?;
        let xv = view::<T>(x.0, x.1, "residual input")?;
        let nv = view::<T>(nw.0, nw.1, "norm weight")?;
        let wv = view::<T>(ws, wl, "gemv weight")?;
        let sums = if self.res.is_some() { m * k } else { 0 };
        // SAFETY: block 0 writes the M·K sums, the columns' warps write the M·N products.
        let out = unsafe { dev.alloc::<T>(sums + m * n)? };
        if m > 0 && n > 0 {
            let size = std::mem::size_of::<T>();
            let func = load_kernel(
                &dev,
                &gemv_kernel_name("kestrel_gemv_add_rmsnorm", m, k, size, sfx),
            )?;
            let stage = crate::gemv_add_rms_norm_stage(m, k, size);
            let (cfg, split) = gemv_launch(n, k, size, stage);
            let (m_a, n_a, k_a) = (
                i32_arg(m, "rows")?,
                i32_arg(n, "columns")?,
                i32_arg(k, "K")?,
            );
            let sum_view = out.slice(..sums);
            let y = out.slice(sums..);
            let mut b = func.builder();
            b.arg(&xv);
            // The residual's guard lives as long as the launch; null for no add.
            let res_guard;
            let res_view;
            let null: u64 = 0;
            match &self.res {
                Some(r) => {
                    res_guard = r.storage_and_layout();
                    let (Storage::Cuda(rs), rl) = (&*res_guard.0, &res_guard.1) else {
                        bail!("the residual is not on the CUDA device")
                    };
                    res_view = view::<T>(rs, rl, "residual")?;
                    b.arg(&res_view);
                }
                None => {
                    b.arg(&null);
                }
            }
            b.arg(&nv);
            b.arg(&wv);
            b.arg(&y);
            b.arg(&sum_view);
            b.arg(&m_a);
            b.arg(&n_a);
            b.arg(&k_a);
            b.arg(&self.eps);
            b.arg(&split);
            // SAFETY: argument types match kestrel_gemv_add_rmsnorm_* (a null pointer for no
            // residual, which the kernel checks); shapes, alignment and the staging size were
            // checked by the launcher in lib.rs.
            unsafe { b.launch(cfg) }?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev))
    }
}

impl candle_core::CustomOp2 for GemvAddRmsNorm {
    fn name(&self) -> &'static str {
        "kestrel-gemv-add-rmsnorm"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel gemv_add_rms_norm runs on CUDA only")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        nw: &CudaStorage,
        nwl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, _) = self.w.dims2()?;
        let sums = if self.res.is_some() { m * k } else { 0 };
        let out = by_dtype!(x.dtype(), "gemv_add_rms_norm", |T, sfx| self.run::<T>(
            (x, xl),
            (nw, nwl),
            sfx
        )?);
        Ok((out, Shape::from(sums + m * n)))
    }
}

impl candle_core::CustomOp2 for Gemv {
    fn name(&self) -> &'static str {
        "kestrel-gemv"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        bail!("kestrel gemv runs on CUDA only (the CPU has its own matvec kernel)")
    }

    fn cuda_fwd(
        &self,
        x: &CudaStorage,
        xl: &Layout,
        w: &CudaStorage,
        wl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let m = match self.laid_rows {
            Some(m) => m,
            None => xl.shape().dims2()?.0,
        };
        let (n, _) = wl.shape().dims2()?;
        let out = by_dtype!(x.dtype(), "gemv", |T, sfx| self.run::<T>(
            (x, xl),
            (w, wl),
            sfx
        )?);
        Ok((out, Shape::from((m, n))))
    }
}

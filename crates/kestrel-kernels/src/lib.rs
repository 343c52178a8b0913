//! Kestrel's own CUDA kernels for the decode hot path, launched through candle's CUDA device.
//!
//! - [`paged_attention`]: attention of every sequence's new query rows over its paged KV slots
//!   (slot table, GQA, causal or tree mask over the new tokens) in one launch per layer.
//! - [`kv_append`]: writes a step's new K or V rows into a pool at u32 slot ids.
//! - [`kv_move`]: compaction after a verification, every layer's pools in one launch.
//! - [`gemv`]: the projections of a step of a few rows, each weight read once;
//!   [`gemv_add_rms_norm`] and [`gemv_swiglu`] fold the kernel before a projection into it.
//! - [`QuantGemvWeights`]: a matrix at 4 or 8 bits and its gemv, for a self-draft that reads
//!   the target's weights at a third of their bytes.
//! - [`add_rms_norm`]: residual add fused with RMSNorm, returning both results.
//! - [`swiglu`]: `silu(gate) · up` on the fused gate_up projection.
//! - [`qkv_rope_append`]: the fused QKV projection split, RoPE applied to q and k, K and V
//!   written into the pools, in one launch.
//! - [`argmax_rows`]: greedy token ids of f32 logits rows, on the device.
//! - [`sample_rows`]: sampled token ids of f32 logits rows (temperature, top-k, top-p) from
//!   host-drawn uniforms, on the device.
//! - [`sample_typical_rows`]: the target's token at verified nodes under typical acceptance.
//! - [`draw_children`] / [`tree_accept`]: EAGLE's exact sampling on the device: a static
//!   tree's children drawn without replacement, then tree rejection sampling.
//! - [`chain_accept`]: draft-target speculative sampling (accept, residual, bonus) from the
//!   target's and the draft's logits rows, on the device.
//! - [`top_k_logp`]: the k best tokens of f32 logits rows with their log-probabilities.
//! - [`gather_rows`] / [`scatter_rows`]: rows by u32 ids, any dtype (embedding lookup, output
//!   rows, EAGLE's node outputs and token pool), so that candle's indexing module, and the
//!   device memory its loading takes, stays out of the process; candle's ops on the CPU.
//! - [`capture`] / [`StepGraph`]: a whole step captured as a CUDA graph and replayed, fed
//!   through [`upload_into`]; what the step allocates is moved into a [`GraphArena`] its
//!   model's graphs share (`graph_arena.rs`), so replays take nothing from the driver's pool.
//! - [`IdsReadback`]: token ids read back through page-locked memory, the host waiting for
//!   their copy only, not for a step queued after it.
//! - [`open_cuda`] / [`limit_thread_stack`]: a device whose context's per-thread stack is cut
//!   to what these kernels need.
//! - [`set_dependent_launch`]: programmatic dependent launch on Hopper (on by default), which
//!   lets each kernel of a step start while the one before it finishes (`launch.rs`).
//!
//! The `.cu` source is compiled to PTX by build.rs only with the `cuda` feature; without it
//! this crate holds only the host-side metadata layout ([`PagedAttnMeta::host`]) and the
//! kernel launchers return an error, so the CPU build needs no CUDA toolkit.

use candle_core::{DType, Device, Result, Tensor, D};

#[cfg(feature = "cuda")]
mod cuda;
mod gemv_quant;
mod graph;
mod graph_arena;
#[cfg(feature = "cuda")]
mod launch;
mod readback;
mod rows;
mod stack;

pub use gemv_quant::{QuantGemvWeights, QUANT_GEMV_BLOCK, QUANT_GEMV_ROWS};
pub use graph::{capture, upload_into, with_upload_cache, GraphArena, StepGraph, UploadElem};
pub use graph_arena::RelocationStats;
pub use readback::IdsReadback;
pub use rows::{gather_rows, scatter_rows};
pub use stack::{limit_thread_stack, open_cuda, thread_stack_limit, THREAD_STACK_BYTES};

/// Whether captured steps keep their allocations in their model's arena (see
/// [`set_graph_arena`]).
static GRAPH_ARENA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Where the memory a captured step allocates comes from at replay, for every later capture
/// of this process: the model's arena (on, the default: `graph_arena.rs`) or the driver's
/// graph memory pool, which reserves 32 MiB at a time (off, to compare the two in one process:
/// `spec-bench --graph_memory driver`). Outputs do not change either way.
pub fn set_graph_arena(enabled: bool) {
    GRAPH_ARENA.store(enabled, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_graph_arena`] leaves the arena on.
pub fn graph_arena() -> bool {
    GRAPH_ARENA.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether kernels launched on Hopper carry programmatic dependent launch (see
/// [`set_dependent_launch`]).
static DEPENDENT_LAUNCH: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns programmatic dependent launch on or off for every later launch of this process (on
/// by default; it applies on compute capability 9.0 and later only), for comparisons in one
/// process (`spec-bench --dependent_launch off`). Graphs captured before keep what they were
/// captured with. Off, the kernels run as on Ampere: their `griddepcontrol.wait` returns at
/// once. Outputs do not change either way: every kernel waits for its predecessor before it
/// reads or writes anything but weights.
pub fn set_dependent_launch(enabled: bool) {
    DEPENDENT_LAUNCH.store(enabled, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_dependent_launch`] leaves programmatic dependent launch on.
pub fn dependent_launch() -> bool {
    DEPENDENT_LAUNCH.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether kernels launched now on `device` use programmatic dependent launch: switched on
/// and a CUDA device of compute capability 9.0 or later.
pub fn dependent_launch_on(device: &Device) -> Result<bool> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = device {
        return Ok(dependent_launch() && launch::is_hopper(dev)?);
    }
    let _ = device;
    Ok(false)
}

/// Kernel names (their `extern "C"` names, dtype suffix appended) as recorded in plans.
pub mod names {
    pub const PAGED_ATTENTION: &str = "kestrel_paged_attention";
    /// The tensor-core family (`paged_attention_tensor_cores`); a plan names it for every
    /// attention op as `kestrel_paged_attention_tc_{dtype}`.
    pub const PAGED_ATTENTION_TC: &str = "kestrel_paged_attention_tc";
    pub const KV_APPEND: &str = "kestrel_kv_append";
    pub const ADD_RMSNORM: &str = "kestrel_add_rmsnorm";
    pub const SWIGLU: &str = "kestrel_swiglu";
    pub const QKV_ROPE: &str = "kestrel_qkv_rope";
    pub const GEMV: &str = "kestrel_gemv";
    pub const ARGMAX: &str = "kestrel_argmax";

    /// `"kestrel_paged_attention_bf16"` etc.: the suffix the kernels use for a dtype.
    pub fn with_dtype(kernel: &str, dtype: &str) -> String {
        format!("{kernel}_{dtype}")
    }
}

/// The largest head dimension [`paged_attention`] supports (its per-block shared memory and
/// per-lane registers are sized for it).
pub const MAX_HEAD_DIM: usize = 256;

/// Most new tokens of one sequence under an explicit mask (a draft tree) that
/// [`paged_attention`] takes: a row's visible ones are listed in shared memory
/// (`PA_MAX_MASKED_NEW` in kernels.cu).
pub const MAX_MASKED_NEW: usize = 1024;

/// Query rows a block of the grouped attention kernel takes (`PA_GROUP_ROWS` in
/// attention.cuh). On an H100 (tools/gpu/tree_attn_probe.cu, a 64-node Llama-2-7B tree) 8
/// were slower than 4 at every context length from 128 to 2,048.
pub const ATTN_GROUP_ROWS: usize = 4;

/// Most new tokens a sequence of a step may bring for [`paged_attention`] to take the grouped
/// kernel (a block per head, sequence and [`ATTN_GROUP_ROWS`] query rows, the K/V rows all of
/// them see read once for the group): verifications and draft trees. A longer step is a
/// prefill, whose rows see few cached slots to share, and its blocks, a quarter as many, each
/// walk four rows one after the other; it keeps the block-per-row kernel. Both give every row
/// the same bits.
pub const ATTN_GROUPS_MAX_NEW: usize = 128;

/// Fewest slots in the step's longest sequence (its slot-table row, `PagedAttnMeta::lmax`,
/// which a graphed step pads to a multiple of 256) from which the grouped kernel takes a step
/// whatever its size: over long contexts it wins for every head shape measured.
pub const ATTN_GROUPS_MIN_SLOTS: usize = 1024;

/// Blocks of the grouped attention kernel a multiprocessor holds (`PA_GROUPS_MIN_BLOCKS` in
/// attention.cuh: 128 registers a thread, ~71 KiB of shared memory for d = 128 in bf16).
pub const ATTN_GROUPS_BLOCKS_PER_SM: usize = 2;

/// Whether a step whose longest sequence brings `max_new` new tokens over `lmax` slots takes
/// the grouped attention kernel (where the head size allows, [`attention_groups_shared_bytes`]):
/// over [`ATTN_GROUPS_MIN_SLOTS`] slots, or at any context when its `group_blocks` (heads ×
/// sequences × row groups) fill the `multiprocessors` [`ATTN_GROUPS_BLOCKS_PER_SM`] deep. A
/// grid that leaves multiprocessors idle loses to the block-per-row kernel at short contexts,
/// where that kernel's repeated reads of the same rows still hit L2. H100, spec-bench
/// verify:64 (64-token chains), grouped against block-per-row in the step: Llama-2-7B (512
/// blocks) 8.53 / 8.97 ms at 128-token prompts, 10.30 / 11.64 at 512, 13.12 / 15.45 at 1,536;
/// SmolLM2 (144 blocks) 1.71 / 1.57 at 128, 2.68 / 2.79 at 1,536 (docs/gpu-results.md,
/// session 48). Both give every row the same bits. `KESTREL_PA_GROUPS=0` keeps every step on
/// the block-per-row kernel, `1` sends every step of 2 to [`ATTN_GROUPS_MAX_NEW`] new tokens to
/// the grouped one, to measure the choice.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn attention_groups_step(
    max_new: usize,
    lmax: usize,
    group_blocks: usize,
    multiprocessors: usize,
) -> bool {
    static FORCED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    let forced = *FORCED.get_or_init(|| match std::env::var("KESTREL_PA_GROUPS").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    });
    let fills = group_blocks >= ATTN_GROUPS_BLOCKS_PER_SM * multiprocessors;
    (2..=ATTN_GROUPS_MAX_NEW).contains(&max_new)
        && forced.unwrap_or(lmax >= ATTN_GROUPS_MIN_SLOTS || fills)
}

/// Dynamic shared memory of the grouped attention kernel for head size `d` of `elem_bytes`
/// values, or `None` for a head size it is not compiled for (64 and 128, Llama-family heads:
/// attention.cuh says why). 8 warps' stages of 32 rows (a chunk's K, then its V) padded by 16
/// bytes, then the group's query rows in f32.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn attention_groups_shared_bytes(d: usize, elem_bytes: usize) -> Option<usize> {
    [64, 128]
        .contains(&d)
        .then(|| 8 * 32 * (d * elem_bytes + 16) + ATTN_GROUP_ROWS * d * 4)
}

/// Most new tokens of one tree-masked sequence the tensor-core attention takes
/// (`TC_MAX_NODES` in attention_tc.cuh: a warp lists its rows' visible nodes and scores every
/// candidate of the tail in shared memory). Causal sequences take any number.
pub const TC_MAX_MASKED_NEW: usize = 64;

/// Splits of a row's tiles in the tensor-core attention (`TC_SPLITS` in attention_tc.cuh):
/// tile t in split t mod this, each split a block of its own, their states folded in split
/// order. A row's bits depend on it, so every step of a model takes the same count.
pub const TC_SPLITS: usize = 4;

/// Whether the tensor-core attention ([`paged_attention_tensor_cores`]) is compiled for heads
/// of `head_dim` values of `dtype`: f16 and bf16 (the MMA's inputs), heads of 64 and 128
/// (Llama-family heads; SmolLM2's and Llama-2-7B's).
pub fn tensor_core_attention_applies(dtype: DType, head_dim: usize) -> bool {
    matches!(dtype, DType::F16 | DType::BF16) && matches!(head_dim, 64 | 128)
}

/// `mask_off` of a sequence without an explicit mask: causal over its new tokens.
const CAUSAL: u32 = u32::MAX;

/// One sequence of a paged attention step.
#[derive(Debug, Clone, Copy)]
pub struct AttnSeq<'a> {
    /// Pool rows of all its slots, cached then new (`L` of them).
    pub slots: &'a [u32],
    /// Its new tokens: the query rows, whose K/V are the last `n_new` slots.
    pub n_new: usize,
    /// `n_new × n_new` row-major over the new tokens, `true` = may attend; `None` = causal.
    /// Every new token sees all cached slots.
    pub mask: Option<&'a [bool]>,
}

/// A step's attention metadata, uploaded once and shared by every layer: the slot table,
/// per-sequence lengths and masks, and the new tokens' slot ids for [`kv_append`].
#[derive(Debug, Clone)]
pub struct PagedAttnMeta {
    /// `[n_tok]` u32: pool row of every new token, in query order (for [`kv_append`]).
    pub new_slots: Tensor,
    /// The rest of the buffer, read by the attention kernel (layout in `kernels.cu`).
    pub table: Tensor,
    pub n_tok: usize,
    pub n_seq: usize,
    pub lmax: usize,
    /// New tokens of the sequence that brings the most (the grouped kernel's grid).
    pub max_new: usize,
    /// New tokens of the tree-masked sequence that brings the most; 0 when none is masked
    /// (the tensor-core attention takes trees of up to [`TC_MAX_MASKED_NEW`]).
    pub tree_max_new: usize,
}

impl PagedAttnMeta {
    /// The host buffer: `new_slots[n_tok]` then the table (see `kernels.cu`):
    /// `tok_seq[n_tok] | seq_len[b] | seq_new[b] | q_start[b] | mask_off[b] | slots[b·lmax] |
    /// masks`. Returns it with `(n_tok, lmax)`.
    pub fn host(seqs: &[AttnSeq]) -> Result<(Vec<u32>, usize, usize)> {
        Self::host_padded(seqs, 0)
    }

    /// [`PagedAttnMeta::host`] with every slot row padded to at least `min_lmax` entries,
    /// so that steps of different lengths share one layout (a replayed CUDA graph's).
    pub fn host_padded(seqs: &[AttnSeq], min_lmax: usize) -> Result<(Vec<u32>, usize, usize)> {
        let b = seqs.len();
        if b == 0 {
            candle_core::bail!("paged attention: empty batch");
        }
        for (i, s) in seqs.iter().enumerate() {
            if s.n_new == 0 || s.n_new > s.slots.len() {
                candle_core::bail!(
                    "paged attention: sequence {i} has {} new tokens for {} slots",
                    s.n_new,
                    s.slots.len()
                );
            }
            if let Some(m) = s.mask {
                if s.n_new > MAX_MASKED_NEW {
                    candle_core::bail!(
                        "paged attention: sequence {i} brings {} new tokens under a tree mask; \
                         the kernel takes at most {MAX_MASKED_NEW}",
                        s.n_new
                    );
                }
                if m.len() != s.n_new * s.n_new {
                    candle_core::bail!(
                        "paged attention: sequence {i} has a mask of {} entries for {} new tokens",
                        m.len(),
                        s.n_new
                    );
                }
            }
        }
        let n_tok: usize = seqs.iter().map(|s| s.n_new).sum();
        let lmax = seqs
            .iter()
            .map(|s| s.slots.len())
            .max()
            .unwrap_or(0)
            .max(min_lmax);
        let masked: usize = seqs
            .iter()
            .filter(|s| s.mask.is_some())
            .map(|s| s.n_new * s.n_new)
            .sum();
        let mut buf = Vec::with_capacity(2 * n_tok + 4 * b + b * lmax + masked);
        for s in seqs {
            buf.extend_from_slice(&s.slots[s.slots.len() - s.n_new..]);
        }
        for (i, s) in seqs.iter().enumerate() {
            buf.extend(std::iter::repeat_n(i as u32, s.n_new));
        }
        buf.extend(seqs.iter().map(|s| s.slots.len() as u32));
        buf.extend(seqs.iter().map(|s| s.n_new as u32));
        let mut start = 0u32;
        for s in seqs {
            buf.push(start);
            start += s.n_new as u32;
        }
        let mut off = 0u32;
        for s in seqs {
            match s.mask {
                Some(_) => {
                    buf.push(off);
                    off += (s.n_new * s.n_new) as u32;
                }
                None => buf.push(CAUSAL),
            }
        }
        for s in seqs {
            buf.extend_from_slice(s.slots);
            // Padding is never read (the kernel stops at the sequence's length).
            buf.extend(std::iter::repeat_n(0, lmax - s.slots.len()));
        }
        for s in seqs {
            if let Some(m) = s.mask {
                buf.extend(m.iter().map(|&a| a as u32));
            }
        }
        Ok((buf, n_tok, lmax))
    }

    /// Builds the buffer and uploads it in one copy.
    pub fn new(seqs: &[AttnSeq], device: &Device) -> Result<Self> {
        let (buf, n_tok, lmax) = Self::host(seqs)?;
        let len = buf.len();
        let all = Tensor::from_vec(buf, len, device)?;
        Ok(PagedAttnMeta {
            new_slots: all.narrow(0, 0, n_tok)?,
            table: all.narrow(0, n_tok, len - n_tok)?,
            n_tok,
            n_seq: seqs.len(),
            lmax,
            max_new: seqs.iter().map(|s| s.n_new).max().unwrap_or(0),
            tree_max_new: Self::tree_max_new(seqs),
        })
    }

    /// New tokens of the tree-masked sequence of `seqs` that brings the most (0: none).
    pub fn tree_max_new(seqs: &[AttnSeq]) -> usize {
        seqs.iter()
            .filter(|s| s.mask.is_some())
            .map(|s| s.n_new)
            .max()
            .unwrap_or(0)
    }
}

fn dtype_suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::F16 => "f16",
        DType::BF16 => "bf16",
        other => candle_core::bail!("Kestrel's CUDA kernels do not support {other:?}"),
    })
}

/// The name a plan records for `kernel` on `dtype` (e.g. `kestrel_paged_attention_bf16`).
pub fn kernel_name(kernel: &str, dtype: DType) -> Result<String> {
    Ok(names::with_dtype(kernel, dtype_suffix(dtype)?))
}

#[cfg(not(feature = "cuda"))]
fn no_cuda<T>(what: &str) -> Result<T> {
    candle_core::bail!("{what}: kestrel-kernels was built without the `cuda` feature")
}

/// Attention of the step's query rows `q: [n_tok, n_heads, head_dim]` (RoPE applied) over
/// the pools `[slots, n_kv, head_dim]` as described by `meta`; returns
/// `[n_tok, n_heads·head_dim]` in `q`'s dtype. Scores, softmax and accumulation in f32.
pub fn paged_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
) -> Result<Tensor> {
    paged_attention_launch(q, k_pool, v_pool, meta, AttnLaunch::Auto)
}

/// [`paged_attention`] on the tensor cores (attention_tc.cuh) where
/// [`tensor_core_attention_applies`] to the heads and no tree-masked sequence brings more than
/// [`TC_MAX_MASKED_NEW`] new tokens; elsewhere the scalar kernels. The two families sum in
/// different orders, so a row's bits differ between them (by about one step of the 16-bit
/// type) but never within one: a model runs every step through one family, chosen by its
/// engine's plan, and spec-build keeps such a target's verification trees within the limit.
pub fn paged_attention_tensor_cores(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
) -> Result<Tensor> {
    let fits = tensor_core_attention_applies(q.dtype(), q.dim(D::Minus1)?)
        && meta.tree_max_new <= TC_MAX_MASKED_NEW;
    let launch = if fits {
        AttnLaunch::TensorCores { merged: false }
    } else {
        AttnLaunch::Auto
    };
    paged_attention_launch(q, k_pool, v_pool, meta, launch)
}

/// [`paged_attention_tensor_cores`] with the splits always folded by a second launch (never
/// in a cluster), where the family applies (an error elsewhere): for tests that both forms
/// give a row the same bits.
#[doc(hidden)]
pub fn paged_attention_tensor_cores_merged(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
) -> Result<Tensor> {
    if !tensor_core_attention_applies(q.dtype(), q.dim(D::Minus1)?)
        || meta.tree_max_new > TC_MAX_MASKED_NEW
    {
        candle_core::bail!("tensor-core paged attention: not for this step's heads or trees");
    }
    paged_attention_launch(
        q,
        k_pool,
        v_pool,
        meta,
        AttnLaunch::TensorCores { merged: true },
    )
}

/// Which attention kernel a launch takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) enum AttnLaunch {
    /// The grouped kernel where [`attention_groups_step`] and the head size allow, else the
    /// block-per-row kernel with the warp count the step's size suggests.
    Auto,
    /// The block-per-row kernel with this many real warps a block: the one for steps of many
    /// blocks (`kestrel_paged_attention_many_*`) when `many`, else the decode step's.
    Rows { warps: u32, many: bool },
    /// The grouped kernel, or an error where the head size or the device's shared memory
    /// does not allow it.
    Groups,
    /// The tensor-core kernel ([`TC_SPLITS`] split blocks, folded by a second launch, or in
    /// their cluster for 64-row blocks on compute capability 9.0 and later; `merged` forces
    /// the second launch).
    TensorCores { merged: bool },
}

/// [`paged_attention`] on the block-per-row kernel with its blocks' real warp count forced
/// (1, 2, 4 or 8) instead of chosen from the step's size, on the decode step's build of it or
/// (`many`) the one for steps of many blocks: for tests that every count, and every kernel,
/// gives a row the same bits.
#[doc(hidden)]
pub fn paged_attention_with_warps(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
    warps: u32,
    many: bool,
) -> Result<Tensor> {
    if ![1, 2, 4, 8].contains(&warps) {
        candle_core::bail!("paged attention: {warps} warps a block (1, 2, 4 or 8)");
    }
    paged_attention_launch(q, k_pool, v_pool, meta, AttnLaunch::Rows { warps, many })
}

/// [`paged_attention`] on the grouped kernel whatever the step's size (an error where the
/// head size or the device does not allow it): for tests that it gives a row the bits the
/// block-per-row kernel gives.
#[doc(hidden)]
pub fn paged_attention_grouped(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
) -> Result<Tensor> {
    paged_attention_launch(q, k_pool, v_pool, meta, AttnLaunch::Groups)
}

fn paged_attention_launch(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    meta: &PagedAttnMeta,
    launch: AttnLaunch,
) -> Result<Tensor> {
    let (n_tok, nh, d) = q.dims3()?;
    let (_, nkv, dk) = k_pool.dims3()?;
    if n_tok != meta.n_tok
        || dk != d
        || v_pool.dims() != k_pool.dims()
        || nkv == 0
        || nh % nkv != 0
        || d == 0
        || d > MAX_HEAD_DIM
        || q.dtype() != k_pool.dtype()
        || v_pool.dtype() != k_pool.dtype()
    {
        candle_core::bail!(
            "paged attention: q {:?} {:?}, pools {:?} {:?} / {:?} {:?}, {} query rows in the \
             metadata (head_dim at most {MAX_HEAD_DIM}, heads a multiple of KV heads)",
            q.dims(),
            q.dtype(),
            k_pool.dims(),
            k_pool.dtype(),
            v_pool.dims(),
            v_pool.dtype(),
            meta.n_tok
        );
    }
    dtype_suffix(q.dtype())?;
    #[cfg(feature = "cuda")]
    {
        let q = q.contiguous()?;
        let op = cuda::PagedAttention {
            table: meta.table.clone(),
            n_seq: meta.n_seq,
            lmax: meta.lmax,
            max_new: meta.max_new,
            launch,
        };
        q.apply_op3_no_bwd(k_pool, v_pool, &op)?
            .reshape((n_tok, nh * d))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = launch;
        no_cuda("paged attention")
    }
}

/// Writes `rows: [n, n_kv, head_dim]` into `pool: [slots, n_kv, head_dim]` at the pool rows
/// `slots: [n]` u32 (in place).
pub fn kv_append(pool: &Tensor, rows: &Tensor, slots: &Tensor) -> Result<()> {
    let n = rows.dim(0)?;
    if rows.dims()[1..] != pool.dims()[1..]
        || rows.dtype() != pool.dtype()
        || slots.dims() != [n]
        || slots.dtype() != DType::U32
    {
        candle_core::bail!(
            "kv append: rows {:?} {:?}, pool {:?} {:?}, slots {:?} {:?}",
            rows.dims(),
            rows.dtype(),
            pool.dims(),
            pool.dtype(),
            slots.dims(),
            slots.dtype()
        );
    }
    dtype_suffix(pool.dtype())?;
    #[cfg(feature = "cuda")]
    {
        pool.inplace_op3(&rows.contiguous()?, slots, &cuda::KvAppend)
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("kv append")
}

/// Rows per chunk of the gemv kernels (`GEMV_MAX_ROWS` in kernels.cu): a block loads its
/// weights once and applies them to a step's rows a chunk at a time.
pub const GEMV_MAX_ROWS: usize = 8;

/// Most rows [`gemv_swiglu`] fuses into one launch. Every block of the fused kernel computes
/// SwiGLU of all the step's rows before its products; past 4 rows that costs more than the
/// separate SwiGLU launch it saves (H200, random SmolLM2 bf16, graphs: 6- and 8-row steps
/// 3-5% shorter apart, 4 rows alike, 2 rows shorter fused; docs/gpu-results.md, session 26).
/// `KESTREL_GEMV_SWIGLU_MAX_ROWS` (1 to 8) overrides it, to measure the choice.
pub const GEMV_SWIGLU_MAX_FUSED_ROWS: usize = 4;
static SWIGLU_MAX_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
/// [`gemv_add_rms_norm`] fuses a whole chunk ([`GEMV_MAX_ROWS`]): apart, its 2- to 8-row
/// steps took 12-19% longer (same measurement). `KESTREL_GEMV_NORM_MAX_ROWS` overrides it.
static NORM_MAX_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// Most rows a fused gemv takes in one launch: `default`, or `var` (1 to
/// [`GEMV_MAX_ROWS`]); past it the op runs as two launches with the same bits.
fn fused_max_rows(cell: &'static std::sync::OnceLock<usize>, var: &str, default: usize) -> usize {
    *cell.get_or_init(|| {
        std::env::var(var)
            .ok()
            .and_then(|v| v.parse().ok())
            .filter(|n| (1..=GEMV_MAX_ROWS).contains(n))
            .unwrap_or(default)
    })
}

/// Largest K (input width) [`gemv`]'s FMA engine takes (f32, and f16/bf16 with K not a
/// multiple of [`GEMV_MMA_K_BLOCK`]). Measured on the H200 (docs/gpu-results.md): with every
/// linear through it, SmolLM2 (K = 576 and 1,536) ran as fast or faster than with cuBLAS and
/// Llama-2-7B (K = 4,096 and 11,008) slower (121 against 185 tok/s at batch 1, bf16), where
/// cuBLAS streams long rows closer to the bandwidth. The tensor-core engine has no limit.
pub const GEMV_MAX_K: usize = 2048;

/// The block of K the tensor-core engine takes at a time (`MMA_KB` in kernels.cu): f16/bf16
/// products whose K is a multiple of it go through `mma.m16n8k16`, up to 8 rows with each
/// weight load, so that a verification of many rows costs little more than one row.
pub const GEMV_MMA_K_BLOCK: usize = 64;

/// Whether a product of `elem_bytes` elements over `k` takes the tensor-core engine. Depends
/// on the dtype and K alone, as every choice of the gemv kernels must (a row's bits may not
/// depend on how many rows a step has).
pub(crate) fn gemv_tensor_cores(elem_bytes: usize, k: usize) -> bool {
    elem_bytes == 2 && k.is_multiple_of(GEMV_MMA_K_BLOCK)
}

/// Fewest rows a tensor-core product over K < [`GEMV_TILED_WIDE_K`] takes the tiled engine
/// (`kestrel_gemv_tiled_*`) with: more than the one-row engine takes in one pass (32), past
/// which that engine reads the weights again for every 32 rows. It computes every row exactly
/// as the one-row engine does, so the switch changes speed only. Measured on the H200 (bf16,
/// random weights, `spec-bench verify:T` against a one-row step, docs/gpu-results.md, session
/// 13): SmolLM2 T = 24 1.57× on the one-row engine, 1.75× tiled; T = 32 1.86× and 1.98×;
/// T = 64 2.33× tiled.
pub const GEMV_TILED_MIN_ROWS: usize = 33;

/// K from which the tiled engine takes steps of [`GEMV_TILED_MIN_ROWS_WIDE`] rows or more.
pub const GEMV_TILED_WIDE_K: usize = 2048;

/// Fewest rows the tiled engine takes over K ≥ [`GEMV_TILED_WIDE_K`]: long weight rows make the
/// one-row engine's per-row passes dearer. Llama-2-7B (same runs): T = 24 1.77× on the one-row
/// engine, 1.61× tiled; T = 32 2.15× and 1.75×; T = 16 1.39× and 1.48×.
pub const GEMV_TILED_MIN_ROWS_WIDE: usize = 17;

/// Whether a product of `m` rows over `k` elements of `elem_bytes` bytes into `n` columns runs
/// on the tiled tensor-core engine: enough rows, and inputs and weights small enough for its
/// 32-bit element offsets (a larger product takes the one-row engine, with the same bits).
/// `KESTREL_GEMV_TILED_MIN_ROWS` overrides both thresholds, to measure the choice.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn gemv_tiled_applies(m: usize, n: usize, k: usize, elem_bytes: usize) -> bool {
    static MIN_ROWS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let min_rows = *MIN_ROWS.get_or_init(|| {
        std::env::var("KESTREL_GEMV_TILED_MIN_ROWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    });
    let min_rows = match (min_rows, k >= GEMV_TILED_WIDE_K) {
        (0, false) => GEMV_TILED_MIN_ROWS,
        (0, true) => GEMV_TILED_MIN_ROWS_WIDE,
        (forced, _) => forced,
    };
    gemv_tensor_cores(elem_bytes, k)
        && m >= min_rows
        && m.max(n).saturating_mul(k) <= i32::MAX as usize
}

/// Bytes of the tensor-core engine's partial sums for one tile of rows (`GEMV_PART_BYTES` in
/// kernels.cu): 8 warps × 16 columns × 8 rows of f32. The fused variants keep them in their
/// staging memory, which is therefore at least this large.
const GEMV_PART_BYTES: usize = 8 * 16 * 8 * 4;

/// Whether [`gemv`] takes `x · wᵀ`: at least one row, a weight `[N, K]` with K ≤
/// [`GEMV_MAX_K`] (any K on tensor cores: f16/bf16 with K a multiple of
/// [`GEMV_MMA_K_BLOCK`]) and the same dtype (f32, f16, bf16), both contiguous, K a multiple
/// of the 16-byte vector and every row starting 16-byte aligned.
pub fn gemv_applies(x: &Tensor, w: &Tensor) -> bool {
    x.dims2().is_ok_and(|(_, k)| gemv_fits(x, k, w))
}

/// Whether the gemv kernels take an input `x` `[M, ..]` whose rows give `k` values each
/// (the input's own width, or half of a fused gate_up's) against `w`.
fn gemv_fits(x: &Tensor, k: usize, w: &Tensor) -> bool {
    let (Ok((m, _)), Ok((_, wk))) = (x.dims2(), w.dims2()) else {
        return false;
    };
    let size = x.dtype().size_in_bytes();
    let aligned = |t: &Tensor| {
        t.layout()
            .contiguous_offsets()
            .is_some_and(|(start, _)| (start * size).is_multiple_of(16))
    };
    m >= 1
        && k == wk
        && (k <= GEMV_MAX_K || gemv_tensor_cores(size, k))
        && x.dtype() == w.dtype()
        && dtype_suffix(x.dtype()).is_ok()
        && (k * size).is_multiple_of(16)
        && aligned(x)
        && aligned(w)
}

fn gemv_misfit(op: &str, x: &Tensor, w: &Tensor) -> candle_core::Error {
    candle_core::Error::Msg(format!(
        "{op}: x {:?} {:?} and w {:?} {:?} do not fit the kernel (at least one row, \
         same dtype, K a multiple of 16 bytes, aligned rows)",
        x.dims(),
        x.dtype(),
        w.dims(),
        w.dtype()
    ))
}

/// `x [M, K] · wᵀ` for a linear layer's weight `w [N, K]` → `[M, N]`, with f32 accumulation,
/// reading the weight once; every row's sum is taken in the same order whatever M is, so a
/// row's result never depends on the other rows.
/// Check [`gemv_applies`] first.
pub fn gemv(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !gemv_applies(x, w) {
        return Err(gemv_misfit("gemv", x, w));
    }
    #[cfg(feature = "cuda")]
    {
        x.apply_op2_no_bwd(
            w,
            &cuda::Gemv {
                swiglu: false,
                laid_rows: None,
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("gemv")
}

/// Most bytes a fused gemv variant stages in a block's dynamic shared memory (48 KiB with
/// the kernels' static shared memory): a chunk of input rows (`rows·K` elements, `rows` ≤
/// [`GEMV_MAX_ROWS`]), plus for [`gemv_add_rms_norm`] a sum of squares per vector and the
/// norm weight; at least the tensor-core engine's partial sums. The fused variants apply
/// where a full chunk fits: every bf16/f16 K up to [`GEMV_MAX_K`]; in f32, SmolLM2's K = 576
/// but not its 1,536.
pub const GEMV_STAGE_MAX_BYTES: usize = 46 * 1024;

/// Bytes [`gemv_swiglu`] stages for `m` rows of `k` elements of `elem` bytes: a chunk of
/// rows, whose space then takes the engine's partial sums.
pub(crate) fn gemv_swiglu_stage(m: usize, k: usize, elem: usize) -> usize {
    (m.min(GEMV_MAX_ROWS) * k * elem).max(GEMV_PART_BYTES)
}

/// Whether [`gemv_swiglu`] takes the fused gate_up rows `gu [M, 2K]` against `w [N, K]`
/// (the conditions of [`gemv_applies`] with K = half of `gu`'s width, and the staged rows
/// within [`GEMV_STAGE_MAX_BYTES`]).
pub fn gemv_swiglu_applies(gu: &Tensor, w: &Tensor) -> bool {
    // A full chunk must fit whatever the rows (as for gemv_add_rms_norm_applies).
    gu.dims2().is_ok_and(|(_, two_k)| {
        two_k % 2 == 0
            && gemv_fits(gu, two_k / 2, w)
            && gemv_swiglu_stage(usize::MAX, two_k / 2, gu.dtype().size_in_bytes())
                <= GEMV_STAGE_MAX_BYTES
    })
}

/// `swiglu(gu) · wᵀ` in one launch: [`swiglu`]'s output (same roundings) computed inside the
/// [`gemv`] that consumes it, e.g. an MLP's down projection; steps of more than
/// [`GEMV_SWIGLU_MAX_FUSED_ROWS`] rows run the two apart (the same bits). Check
/// [`gemv_swiglu_applies`].
pub fn gemv_swiglu(gu: &Tensor, w: &Tensor) -> Result<Tensor> {
    if !gemv_swiglu_applies(gu, w) {
        return Err(gemv_misfit("gemv_swiglu", gu, w));
    }
    let fused_rows = fused_max_rows(
        &SWIGLU_MAX_ROWS,
        "KESTREL_GEMV_SWIGLU_MAX_ROWS",
        GEMV_SWIGLU_MAX_FUSED_ROWS,
    );
    let m = gu.dim(0)?;
    if m > fused_rows {
        // Apart is cheaper there and gives the same bits; where the product takes the
        // warpgroup engine, SwiGLU writes its rows in the engine's layout.
        if lays_out("swiglu") && takes_wgmma(gu, m, w)? {
            return gemv_laid(&swiglu_op(gu, true)?, m, w);
        }
        return gemv(&swiglu(gu)?, w);
    }
    #[cfg(feature = "cuda")]
    {
        gu.apply_op2_no_bwd(
            w,
            &cuda::Gemv {
                swiglu: true,
                laid_rows: None,
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("gemv_swiglu")
}

/// Whether [`gemv_add_rms_norm`] takes the rows `x` (and a residual like them) against `w`:
/// [`gemv_applies`], with the staged rows within [`GEMV_STAGE_MAX_BYTES`].
///
/// Whether it applies depends on K and the dtype only, never on the number of rows: the fused
/// kernel's normed rows differ from [`add_rms_norm`]'s in the last bit, and a decode step and
/// a verification must take the same one.
pub fn gemv_add_rms_norm_applies(x: &Tensor, w: &Tensor) -> bool {
    gemv_applies(x, w)
        && x.dims2().is_ok_and(|(_, k)| {
            let full_chunk = gemv_add_rms_norm_stage(usize::MAX, k, x.dtype().size_in_bytes());
            full_chunk <= GEMV_STAGE_MAX_BYTES
        })
}

/// Bytes [`gemv_add_rms_norm`] stages for `m` rows of `k` elements of `elem` bytes: a chunk
/// of rows and an f32 sum of squares per 16-byte vector of the chunk (at least
/// `GEMV_PART_BYTES` in all, which the engine's partial sums overwrite), then the norm
/// weight (`gemv_add_rmsnorm_norm_offset` in kernels.cu).
fn gemv_add_rms_norm_stage(m: usize, k: usize, elem: usize) -> usize {
    let chunk = m.min(GEMV_MAX_ROWS);
    let used = chunk * k * elem + chunk * (k * elem / 16) * 4;
    used.next_multiple_of(16).max(GEMV_PART_BYTES) + k * elem
}

/// `(x + res, rms_norm(x + res) · norm_w · wᵀ)` in one launch: [`add_rms_norm`] fused into
/// the [`gemv`] of the projection after it (with `res` `None`: no add, the sum is `x`). The
/// normed rows equal [`add_rms_norm`]'s up to the order of the sum of squares (taken per row
/// in an order fixed by K, so a row's result does not depend on the other rows); the sum is
/// exact. Steps of more than [`GEMV_MAX_ROWS`] rows run as two launches with the same
/// arithmetic (the rows normed in the fused kernel's order, then [`gemv`]).
/// Check [`gemv_add_rms_norm_applies`].
pub fn gemv_add_rms_norm(
    x: &Tensor,
    res: Option<&Tensor>,
    norm_w: &Tensor,
    eps: f32,
    w: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (m, k) = x.dims2()?;
    let fits = gemv_add_rms_norm_applies(x, w)
        && res.is_none_or(|r| r.dims() == x.dims() && gemv_applies(r, w))
        && norm_w.dims() == [k]
        && norm_w.dtype() == x.dtype()
        && norm_w.is_contiguous();
    if !fits {
        return Err(gemv_misfit("gemv_add_rms_norm", x, w));
    }
    if m > fused_max_rows(&NORM_MAX_ROWS, "KESTREL_GEMV_NORM_MAX_ROWS", GEMV_MAX_ROWS) {
        // Every block of the fused kernel would stage (add, norm) all the rows for its 16 or
        // so columns: past one chunk, two launches cost less, with the same arithmetic.
        let zeros;
        let r = match res {
            Some(r) => r,
            None => {
                zeros = x.zeros_like()?;
                &zeros
            }
        };
        // Where the product takes the warpgroup engine, the norm writes its rows in the
        // engine's layout, which spares the layout's own launch; the same values either way.
        let (sum, y) = if lays_out("norm") && takes_wgmma(x, m, w)? {
            let (sum, laid) = add_rms_norm_in(x, r, norm_w, eps, true, true)?;
            (sum, gemv_laid(&laid, m, w)?)
        } else {
            let (sum, normed) = add_rms_norm_in(x, r, norm_w, eps, true, false)?;
            (sum, gemv(&normed, w)?)
        };
        let sum = if res.is_some() { sum } else { x.clone() };
        return Ok((sum, y));
    }
    #[cfg(feature = "cuda")]
    {
        let n = w.dim(0)?;
        let op = cuda::GemvAddRmsNorm {
            res: res.cloned(),
            w: w.clone(),
            eps,
        };
        let out = x.apply_op2_no_bwd(norm_w, &op)?;
        Ok(match res {
            Some(_) => (
                out.narrow(0, 0, m * k)?.reshape((m, k))?,
                out.narrow(0, m * k, m * n)?.reshape((m, n))?,
            ),
            None => (x.clone(), out.reshape((m, n))?),
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (m, eps);
        no_cuda("gemv_add_rms_norm")
    }
}

/// Moves pool rows `src → dst` (`moves`) in every one of `pools` (a cache's K and V pools of
/// all layers: `[slots, n_kv, head_dim]` each, same shape and dtype), in place and in one
/// launch. All sources are read before any destination is written.
pub fn kv_move(pools: &[Tensor], moves: &[(u32, u32)]) -> Result<()> {
    let Some(first) = pools.first() else {
        return Ok(());
    };
    let slots = first.dim(0)?;
    for (i, p) in pools.iter().enumerate() {
        if p.dims() != first.dims() || p.dtype() != first.dtype() || !p.is_contiguous() {
            candle_core::bail!(
                "kv move: pool {i} is {:?} {:?}, pool 0 {:?} {:?} (all contiguous)",
                p.dims(),
                p.dtype(),
                first.dims(),
                first.dtype()
            );
        }
    }
    if let Some(&(s, d)) = moves
        .iter()
        .find(|&&(s, d)| s as usize >= slots || d as usize >= slots)
    {
        candle_core::bail!("kv move: row {s} → {d} is outside pools of {slots} slots");
    }
    if moves.is_empty() {
        return Ok(());
    }
    dtype_suffix(first.dtype())?;
    #[cfg(feature = "cuda")]
    {
        cuda::kv_move(pools, moves)
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("kv move")
}

/// `(x + res, rms_norm(x + res) · w)` for `x`, `res: [rows, h]`, `w: [h]`: the sum rounded to
/// the dtype, then normalised in f32 (like candle's `rms_norm` for f32; normalised, stored in
/// the dtype, then scaled for f16/bf16, like the model's RMSNorm). Each row's sum of squares
/// is taken in an order fixed by h and the dtype alone (f16/bf16 rows of whole 16-column
/// blocks up to 8,192 wide: in those blocks, `kestrel_add_rmsnorm_cols_*`).
pub fn add_rms_norm(x: &Tensor, res: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    add_rms_norm_in(x, res, w, eps, false, false)
}

/// [`add_rms_norm`]; with `gemv_order`, in the order of [`gemv_add_rms_norm`]'s staging
/// (16-byte vectors, lane-strided, one warp per row), which needs what [`gemv_applies`] asks
/// of rows; with `laid` too, the normed rows in the warpgroup engine's layout (for
/// [`gemv_laid`]), as one flat tensor.
fn add_rms_norm_in(
    x: &Tensor,
    res: &Tensor,
    w: &Tensor,
    eps: f32,
    gemv_order: bool,
    laid: bool,
) -> Result<(Tensor, Tensor)> {
    let (rows, h) = x.dims2()?;
    if res.dims() != x.dims()
        || w.dims() != [h]
        || res.dtype() != x.dtype()
        || w.dtype() != x.dtype()
    {
        candle_core::bail!(
            "add_rms_norm: x {:?} {:?}, res {:?} {:?}, w {:?} {:?}",
            x.dims(),
            x.dtype(),
            res.dims(),
            res.dtype(),
            w.dims(),
            w.dtype()
        );
    }
    dtype_suffix(x.dtype())?;
    #[cfg(feature = "cuda")]
    {
        let both = x.contiguous()?.apply_op3_no_bwd(
            &res.contiguous()?,
            &w.contiguous()?,
            &cuda::AddRmsNorm {
                eps,
                gemv_order,
                laid: gemv_order && laid,
            },
        )?;
        if gemv_order && laid {
            let len = both.dim(0)?;
            let sum = both.narrow(0, 0, rows * h)?.reshape((rows, h))?;
            return Ok((sum, both.narrow(0, rows * h, len - rows * h)?));
        }
        Ok((both.get(0)?, both.get(1)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (rows, eps, gemv_order, laid);
        no_cuda("add_rms_norm")
    }
}

/// `silu(gate) · up` for the fused projection `gu: [rows, 2·inter]` (gate columns first) →
/// `[rows, inter]`, rounded to the dtype after the silu like candle's two ops.
pub fn swiglu(gu: &Tensor) -> Result<Tensor> {
    let (_, two_i) = gu.dims2()?;
    if two_i % 2 != 0 {
        candle_core::bail!("swiglu: odd fused width {two_i}");
    }
    dtype_suffix(gu.dtype())?;
    swiglu_op(gu, false)
}

/// [`swiglu`]'s launch; `laid`: its rows in the warpgroup engine's layout, for [`gemv_laid`].
fn swiglu_op(gu: &Tensor, laid: bool) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        gu.contiguous()?.apply_op1_no_bwd(&cuda::SwiGlu { laid })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (gu, laid);
        no_cuda("swiglu")
    }
}

/// Whether `producer` ("norm" or "swiglu": the many-row paths of [`gemv_add_rms_norm`] and
/// [`gemv_swiglu`]) writes the rows of a product that takes the warpgroup engine in its
/// layout: yes, unless `KESTREL_LAID_OFF` names it (comma-separated, or `all`), which leaves
/// the layout to its own launch, with the same bits: to measure what each producer's layout
/// saves (on Llama-2-7B's shapes, where those paths do not apply, such producers were slower
/// than the layout's launch: docs/gpu-results.md, session 51).
fn lays_out(producer: &str) -> bool {
    static OFF: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    let off = OFF.get_or_init(|| {
        std::env::var("KESTREL_LAID_OFF")
            .map(|v| v.split(',').map(|p| p.trim().to_string()).collect())
            .unwrap_or_default()
    });
    !off.iter().any(|p| p == producer || p == "all")
}

/// Whether the product of `m` rows of `x`'s device and dtype by `w [n, k]` takes the warpgroup
/// engine (Hopper, f16/bf16, many rows), whose rows the kernel before it can lay out.
fn takes_wgmma(x: &Tensor, m: usize, w: &Tensor) -> Result<bool> {
    let (n, k) = w.dims2()?;
    #[cfg(feature = "cuda")]
    if let Device::Cuda(dev) = x.device() {
        return cuda::gemv_takes_wgmma(dev, (m, n, k), x.dtype().size_in_bytes());
    }
    let _ = (x, m, n, k);
    Ok(false)
}

/// The gemv of `m` rows that the kernel before it wrote in the warpgroup engine's layout
/// (`laid`, from [`add_rms_norm_in`] or [`swiglu_op`]) against `w [n, k]`: `[m, n]`.
fn gemv_laid(laid: &Tensor, m: usize, w: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    {
        laid.apply_op2_no_bwd(
            w,
            &cuda::Gemv {
                swiglu: false,
                laid_rows: Some(m),
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (laid, m, w);
        no_cuda("gemv")
    }
}

/// Largest `k` of [`top_k_logp`] (`TOPK_MAX` in kernels.cu).
pub const TOP_K_MAX: usize = 32;

/// The `k` best entries of every row of f32 `logits: [rows, vocab]` (larger first, lower
/// index on equal values, NaN never chosen) with their log-probabilities under the row's
/// softmax, as u32 `[rows, 2k]`: the ids, then the log-probabilities' f32 bits. A row with
/// fewer than `k` choosable entries ends with id 0 at log-probability `-inf`.
pub fn top_k_logp(logits: &Tensor, k: usize) -> Result<Tensor> {
    let (_, vocab) = logits.dims2()?;
    if logits.dtype() != DType::F32 || k == 0 || k > vocab.min(TOP_K_MAX) {
        candle_core::bail!(
            "top_k_logp: f32 logits and 1 ≤ k ≤ {} expected, got {:?} and k = {k}",
            vocab.min(TOP_K_MAX),
            logits.dtype()
        );
    }
    #[cfg(feature = "cuda")]
    {
        logits.contiguous()?.apply_op1_no_bwd(&cuda::TopKLogp { k })
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("top_k_logp")
}

/// The fused projection `qkv: [n_tok, (nh + 2·nkv)·d]` (q heads, k heads, v heads) split:
/// RoPE (`cos`, `sin: [n_tok, d/2]`, non-interleaved halves, like candle's `rope_thd`) on q
/// and k, k and v written into `k_pool`, `v_pool: [slots, nkv, d]` at `slots: [n_tok]` u32 (in
/// place, like [`kv_append`]); returns the roped q `[n_tok, nh, d]`.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_append(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    nh: usize,
    nkv: usize,
) -> Result<Tensor> {
    let (n_tok, width) = qkv.dims2()?;
    let (_, pool_kv, d) = k_pool.dims3()?;
    let ok = nkv > 0
        && pool_kv == nkv
        && d % 2 == 0
        && width == (nh + 2 * nkv) * d
        && cos.dims() == [n_tok, d / 2]
        && sin.dims() == cos.dims()
        && slots.dims() == [n_tok]
        && slots.dtype() == DType::U32
        && v_pool.dims() == k_pool.dims()
        && [cos, sin, k_pool, v_pool]
            .iter()
            .all(|t| t.dtype() == qkv.dtype());
    if !ok {
        candle_core::bail!(
            "qkv rope: qkv {:?} {:?} for {nh} + 2×{nkv} heads, cos/sin {:?}/{:?} {:?}, slots {:?} \
             {:?}, pools {:?}/{:?} {:?}",
            qkv.dims(),
            qkv.dtype(),
            cos.dims(),
            sin.dims(),
            cos.dtype(),
            slots.dims(),
            slots.dtype(),
            k_pool.dims(),
            v_pool.dims(),
            k_pool.dtype()
        );
    }
    dtype_suffix(qkv.dtype())?;
    #[cfg(feature = "cuda")]
    {
        let op = cuda::QkvRope {
            cos: cos.contiguous()?,
            sin: sin.contiguous()?,
            slots: slots.clone(),
            k_pool: k_pool.clone(),
            v_pool: v_pool.clone(),
            nh,
            nkv,
        };
        qkv.contiguous()?.apply_op1_no_bwd(&op)
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("qkv rope")
}

/// Index of the largest value of every row of f32 `logits: [rows, vocab]` → u32 `[rows]`;
/// ties go to the lowest index.
pub fn argmax_rows(logits: &Tensor) -> Result<Tensor> {
    logits.dims2()?;
    if logits.dtype() != DType::F32 {
        candle_core::bail!("argmax_rows: f32 logits expected, got {:?}", logits.dtype());
    }
    #[cfg(feature = "cuda")]
    {
        logits.contiguous()?.apply_op1_no_bwd(&cuda::ArgMax)
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("argmax_rows")
}

/// A token id for every row of f32 `logits: [rows, vocab]` drawn from
/// `softmax(row / temperature)`, filtered to its `top_k` largest logits (0: no limit; ties
/// with the k-th kept) and then to the smallest most likely set of mass ≥ `top_p` (1: no
/// limit; ties by the lower id first), renormalised — `kestrel_spec::sampling::probs` — by
/// inverse CDF with the row's uniform in `[0, 1)` (`uniforms`: f32 `[rows]`) → u32 `[rows]`:
/// the first id whose cumulative probability exceeds it, as `kestrel_spec::sampling::sample`
/// picks from the same draw. NaN logits weigh nothing; a row without a finite maximum gives
/// [`argmax_rows`]'s id.
pub fn sample_rows(
    logits: &Tensor,
    uniforms: &Tensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<Tensor> {
    check_uniforms(logits, uniforms, "sample_rows")?;
    check_warp(temperature, top_p, "sample_rows")?;
    #[cfg(feature = "cuda")]
    {
        logits.contiguous()?.apply_op2_no_bwd(
            &uniforms.contiguous()?,
            &cuda::Sample {
                inv_t: 1.0 / temperature,
                filter: cuda::SampleFilter::TopKP { top_k, top_p },
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = top_k;
        no_cuda("sample_rows")
    }
}

/// A token id for every row of f32 `logits: [rows, vocab]` drawn from typical acceptance's
/// law (`kestrel_spec::accept::typical_probs`: `softmax(row / temperature)` less the tokens
/// below `min(ε, √ε · exp(−H))`, the most likely always kept, renormalised) by inverse CDF
/// at the row's uniform (`uniforms`: f32 `[rows]`) → u32 `[rows]`, as the host's
/// `typical_tree` draws a node's target token from the same uniform. A row without a finite
/// maximum gives [`argmax_rows`]'s id.
pub fn sample_typical_rows(
    logits: &Tensor,
    uniforms: &Tensor,
    temperature: f32,
    posterior_threshold: f32,
) -> Result<Tensor> {
    check_uniforms(logits, uniforms, "sample_typical_rows")?;
    check_warp(temperature, 1.0, "sample_typical_rows")?;
    if !(posterior_threshold.is_finite() && posterior_threshold >= 0.0) {
        candle_core::bail!(
            "sample_typical_rows: posterior threshold {posterior_threshold} must be finite and >= 0"
        );
    }
    #[cfg(feature = "cuda")]
    {
        logits.contiguous()?.apply_op2_no_bwd(
            &uniforms.contiguous()?,
            &cuda::Sample {
                inv_t: 1.0 / temperature,
                filter: cuda::SampleFilter::Typical {
                    eps: posterior_threshold,
                },
            },
        )
    }
    #[cfg(not(feature = "cuda"))]
    no_cuda("sample_typical_rows")
}

/// f32 `logits: [rows, vocab]` and one f32 uniform a row.
fn check_uniforms(logits: &Tensor, uniforms: &Tensor, what: &str) -> Result<()> {
    let (rows, _) = logits.dims2()?;
    if logits.dtype() != DType::F32 || uniforms.dtype() != DType::F32 {
        candle_core::bail!(
            "{what}: f32 logits and uniforms expected, got {:?} and {:?}",
            logits.dtype(),
            uniforms.dtype()
        );
    }
    if uniforms.dims() != [rows] {
        candle_core::bail!(
            "{what}: one uniform a row expected: logits {:?}, uniforms {:?}",
            logits.dims(),
            uniforms.dims()
        );
    }
    Ok(())
}

/// One sequence of a [`chain_accept`] call: its drafts and the rows that score them.
#[derive(Debug, Clone, Copy)]
pub struct ChainSeq<'a> {
    /// The row of the target's logits after the sequence's last committed token; the rows
    /// after each draft follow it (`k + 1` rows in all).
    pub target_row: usize,
    /// For each draft, the row of the draft's logits it was drawn from (`k` rows).
    pub draft_rows: &'a [u32],
    /// The `k` draft tokens.
    pub tokens: &'a [u32],
    /// `k + 1` uniforms in `[0, 1]` from the sequence's stream, in the order the host's
    /// `kestrel_spec::accept::draft_target` draws them: test `i` takes `uniforms[i]`, the token
    /// drawn after a rejection at `j` takes `uniforms[j + 1]`, the bonus `uniforms[k]`.
    pub uniforms: &'a [f32],
}

/// What [`chain_accept`] decided for a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainOutcome {
    /// Drafts accepted, in order.
    pub accepted: usize,
    /// The token after them: drawn from the residual after a rejection, else the bonus.
    pub token: u32,
}

/// `kestrel_chain_accept_f32`'s metadata (layout in logit_rows.cuh): per sequence its first
/// target row and draft count, then every sequence's draft rows, its tokens, and its
/// uniforms' f32 bits, each padded to `kmax` (`kmax + 1` uniforms).
pub fn chain_accept_meta(seqs: &[ChainSeq<'_>], kmax: usize) -> Vec<u32> {
    let n = seqs.len();
    let mut meta = vec![0u32; 2 * n + 2 * n * kmax + n * (kmax + 1)];
    let (head, rest) = meta.split_at_mut(2 * n);
    let (rows, rest) = rest.split_at_mut(n * kmax);
    let (tokens, uniforms) = rest.split_at_mut(n * kmax);
    for (s, seq) in seqs.iter().enumerate() {
        head[2 * s] = seq.target_row as u32;
        head[2 * s + 1] = seq.tokens.len() as u32;
        rows[s * kmax..][..seq.draft_rows.len()].copy_from_slice(seq.draft_rows);
        tokens[s * kmax..][..seq.tokens.len()].copy_from_slice(seq.tokens);
        for (dst, u) in uniforms[s * (kmax + 1)..].iter_mut().zip(seq.uniforms) {
            *dst = u.to_bits();
        }
    }
    meta
}

/// Draft-target speculative sampling on the device (Leviathan et al. 2023; the host's
/// `kestrel_spec::accept::draft_target`): for each sequence, draft `i` is accepted with
/// probability `min(1, p_i(x_i) / q_i(x_i))`; at the first rejection the next token is drawn
/// from `norm(max(0, p_i − q_i))` (`p_i` where that is all zero), and with every draft
/// accepted it is the bonus drawn from `p_k`. `p` and `q` are the warped laws
/// (`softmax(row / temperature)`, then `top_k`, then `top_p`, as [`sample_rows`] applies them)
/// of the rows of f32 `target` and `draft` logits `[rows, vocab]` that `seqs` name; only the
/// outcomes cross to the host. Draws use each sequence's uniforms as the host consumes its
/// stream ([`ChainSeq::uniforms`]), so the same uniforms give the host's outcome, rounding
/// at a boundary aside. A draft with probability 0 under its own row's law (not drawn from
/// it) is an error naming the sequence and position.
pub fn chain_accept(
    target: &Tensor,
    draft: &Tensor,
    seqs: &[ChainSeq<'_>],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<Vec<ChainOutcome>> {
    let (target_rows, vocab) = target.dims2()?;
    let (draft_rows, draft_vocab) = draft.dims2()?;
    if target.dtype() != DType::F32 || draft.dtype() != DType::F32 || vocab != draft_vocab {
        candle_core::bail!(
            "chain_accept: f32 logits of one vocabulary expected, got target {:?} {:?} and draft {:?} {:?}",
            target.dims(),
            target.dtype(),
            draft.dims(),
            draft.dtype()
        );
    }
    check_warp(temperature, top_p, "chain_accept")?;
    for (s, seq) in seqs.iter().enumerate() {
        let k = seq.tokens.len();
        let fits = seq.draft_rows.len() == k
            && seq.uniforms.len() == k + 1
            && seq.target_row + k < target_rows
            && seq.draft_rows.iter().all(|&r| (r as usize) < draft_rows)
            && seq.tokens.iter().all(|&t| (t as usize) < vocab)
            && seq.uniforms.iter().all(|u| (0.0..=1.0).contains(u));
        if !fits {
            candle_core::bail!(
                "chain_accept: sequence {s} ({k} drafts, target row {}, draft rows {:?}, {} uniforms) does not fit target {:?} / draft {:?} logits",
                seq.target_row,
                seq.draft_rows,
                seq.uniforms.len(),
                target.dims(),
                draft.dims()
            );
        }
    }
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    let kmax = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
    let meta = Tensor::from_vec(
        chain_accept_meta(seqs, kmax),
        2 * seqs.len() + 2 * seqs.len() * kmax + seqs.len() * (kmax + 1),
        target.device(),
    )?;
    #[cfg(feature = "cuda")]
    {
        let inv_t = 1.0 / temperature;
        let op = cuda::ChainAccept {
            laws: laws(target, Some(draft), inv_t, top_k, top_p)?,
            n_seq: seqs.len(),
            kmax,
            inv_t,
        };
        let out = meta.apply_op1_no_bwd(&op)?.to_vec2::<u32>()?;
        out.iter()
            .enumerate()
            .map(|(s, o)| {
                if o[0] == CHAIN_ZERO_Q {
                    candle_core::bail!(
                        "chain_accept: draft token {} of sequence {s} (position {}) has probability 0 under its draft row's law: it was not drawn from it",
                        seqs[s].tokens[o[1] as usize],
                        o[1]
                    );
                }
                Ok(ChainOutcome {
                    accepted: o[0] as usize,
                    token: o[1],
                })
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (meta, top_k);
        no_cuda("chain_accept")
    }
}

/// Most children a node of [`tree_accept`] may try, and most a row of [`draw_children`] may
/// draw (`TREE_MAX_CHILDREN` in logit_rows.cuh).
pub const TREE_MAX_CHILDREN: usize = 64;

/// "None" in [`tree_accept`]'s tables (`TREE_NONE` in logit_rows.cuh).
const TREE_NONE: u32 = u32::MAX;

/// `k` distinct draft columns for each row of f32 `logits: [n_seq · width, columns]` (row
/// `s · width + j` is sequence s's j-th expanded node), each drawn by inverse CDF from the
/// row's warped law (temperature, top-k, top-p, as [`sample_rows`]) less the columns drawn
/// before it; when none is left, the row's first draw (0 for none) fills in and takes no
/// uniform. Sequence s takes its uniforms from `uniforms[s]` (`width · k`, in order), as the
/// host's draws without replacement take them from its stream. Returns each row's columns and
/// each sequence's count of uniforms used.
#[allow(clippy::too_many_arguments)]
pub fn draw_children(
    logits: &Tensor,
    n_seq: usize,
    width: usize,
    k: usize,
    uniforms: &[Vec<f32>],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<(Vec<Vec<u32>>, Vec<usize>)> {
    let (rows, columns) = logits.dims2()?;
    if logits.dtype() != DType::F32
        || rows != n_seq * width
        || k == 0
        || k > TREE_MAX_CHILDREN.min(columns)
        || uniforms.len() != n_seq
        || uniforms.iter().any(|u| u.len() != width * k)
    {
        candle_core::bail!(
            "draw_children: f32 logits of {n_seq} × {width} rows and {n_seq} lists of {width} × {k} uniforms expected (k ≤ {}), got {:?} {:?}",
            TREE_MAX_CHILDREN.min(columns),
            logits.dims(),
            logits.dtype()
        );
    }
    check_warp(temperature, top_p, "draw_children")?;
    if rows == 0 {
        return Ok((Vec::new(), vec![0; n_seq]));
    }
    let flat: Vec<f32> = uniforms.concat();
    let u = Tensor::from_vec(flat, n_seq * width * k, logits.device())?;
    #[cfg(feature = "cuda")]
    {
        let inv_t = 1.0 / temperature;
        let (logits, laws) = with_laws(logits, inv_t, top_k, top_p)?;
        let out = logits
            .apply_op2_no_bwd(
                &u,
                &cuda::DrawChildren {
                    laws,
                    n_seq,
                    width,
                    k,
                    inv_t,
                },
            )?
            .to_vec1::<u32>()?;
        let (picks, used) = out.split_at(rows * k);
        Ok((
            picks.chunks(k).map(<[u32]>::to_vec).collect(),
            used.iter().map(|&n| n as usize).collect(),
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (u, top_k);
        no_cuda("draw_children")
    }
}

/// One sequence's verified tree for [`tree_accept`].
#[derive(Debug, Clone)]
pub struct TreeSeq<'a> {
    /// The target's logits row of the root; node i's is `root_row + i`.
    pub root_row: usize,
    /// Node tokens, root first.
    pub tokens: &'a [u32],
    /// Each node's rank among its siblings (sampled children are tried while their ranks run
    /// 0, 1, 2, …).
    pub ranks: &'a [usize],
    /// Each node's children, in the order they are tried.
    pub children: Vec<&'a [usize]>,
    /// Sampled children: each node's row of the draft logits (`None` for leaves). `None`
    /// altogether: the children were fixed independently of the target (top-k).
    pub draft_rows: Option<Vec<Option<u32>>>,
    /// `tokens.len()` uniforms from the sequence's stream, used in order (a test per tried
    /// child, then the bonus), as the host's `exact_tree_sampling` draws them.
    pub uniforms: &'a [f32],
}

/// What [`tree_accept`] decided for a sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeOutcome {
    /// The accepted nodes, root first.
    pub accepted_nodes: Vec<usize>,
    /// The token after the last of them.
    pub bonus: u32,
    /// Uniforms used.
    pub uniforms_used: usize,
}

/// EAGLE's lossless tree rejection sampling on the device (the host's
/// `kestrel_spec::accept::exact_tree_sampling`): from the root, each accepted node's children
/// are tried in order against the target's warped law `p` at the node (rows of f32 `target`
/// logits `[rows, vocab]`): a sampled child x with probability `min(1, p(x)/q(x))` against the
/// draft's law `q` at the node (rows of `draft` logits `[rows, columns]`, column `c` being
/// token `col_of`'s inverse: `col_of[token]` is its column or `u32::MAX`; `None`: column =
/// token), a rejection leaving `p ← norm(max(0, p − q))`, `q ← q` without x; a child fixed in
/// advance (`draft_rows: None`) with probability `p(x)`, a rejection zeroing `p(x)`. The bonus
/// is drawn from the last node's `p`. Laws are warped as [`sample_rows`] warps them; only the
/// outcomes cross to the host. A sampled child with probability 0 under its parent's draft
/// law is an error naming the sequence and node.
#[allow(clippy::too_many_arguments)]
pub fn tree_accept(
    target: &Tensor,
    draft: Option<&Tensor>,
    col_of: Option<&Tensor>,
    seqs: &[TreeSeq<'_>],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<Vec<TreeOutcome>> {
    let (target_rows, vocab) = target.dims2()?;
    let draft_dims = draft.map(Tensor::dims2).transpose()?;
    let sampled = seqs.iter().any(|s| s.draft_rows.is_some());
    if target.dtype() != DType::F32
        || draft.is_some_and(|d| d.dtype() != DType::F32)
        || (sampled && draft.is_none())
        || col_of.is_some_and(|c| c.dims() != [vocab] || c.dtype() != DType::U32)
    {
        candle_core::bail!(
            "tree_accept: f32 target {:?} and draft logits (for sampled children), and a u32 column table of {vocab} entries expected",
            target.dims()
        );
    }
    check_warp(temperature, top_p, "tree_accept")?;
    for (s, seq) in seqs.iter().enumerate() {
        let n = seq.tokens.len();
        let fits = n > 0
            && seq.root_row + n <= target_rows
            && seq.ranks.len() == n
            && seq.children.len() == n
            && seq.uniforms.len() == n
            && seq.children.iter().flat_map(|c| c.iter()).all(|&c| c < n)
            && seq.children.iter().all(|c| c.len() <= TREE_MAX_CHILDREN)
            && seq.tokens.iter().all(|&t| (t as usize) < vocab)
            && seq.draft_rows.is_some() == sampled
            && seq.draft_rows.as_ref().is_none_or(|rows| {
                rows.len() == n
                    && rows
                        .iter()
                        .flatten()
                        .all(|&r| draft_dims.is_some_and(|(dr, _)| (r as usize) < dr))
            });
        if !fits {
            candle_core::bail!(
                "tree_accept: sequence {s} ({n} nodes, root row {}, {} uniforms) does not fit target {:?} / draft {:?} logits",
                seq.root_row,
                seq.uniforms.len(),
                target.dims(),
                draft_dims
            );
        }
    }
    if seqs.is_empty() {
        return Ok(Vec::new());
    }
    let nmax = seqs.iter().map(|s| s.tokens.len()).max().unwrap_or(1);
    let meta = tree_accept_meta(seqs, nmax);
    let meta = Tensor::from_vec(meta.clone(), meta.len(), target.device())?;
    #[cfg(feature = "cuda")]
    {
        let inv_t = 1.0 / temperature;
        let op = cuda::TreeAccept {
            laws: laws(target, draft.filter(|_| sampled), inv_t, top_k, top_p)?,
            col_of: col_of.cloned(),
            n_seq: seqs.len(),
            nmax,
            inv_t,
            sampled,
        };
        let out = meta.apply_op1_no_bwd(&op)?.to_vec2::<u32>()?;
        out.iter()
            .enumerate()
            .map(|(s, o)| {
                if o[0] == TREE_NONE {
                    candle_core::bail!(
                        "tree_accept: node {} of sequence {s} (token {}) has probability 0 under its parent's draft law: it was not drawn from it",
                        o[1],
                        seqs[s].tokens[o[1] as usize]
                    );
                }
                let accepted = o[0] as usize;
                Ok(TreeOutcome {
                    accepted_nodes: o[3..4 + accepted].iter().map(|&n| n as usize).collect(),
                    bonus: o[1],
                    uniforms_used: o[2] as usize,
                })
            })
            .collect()
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (meta, top_k);
        no_cuda("tree_accept")
    }
}

/// `kestrel_tree_accept_f32`'s metadata (layout in logit_rows.cuh).
pub fn tree_accept_meta(seqs: &[TreeSeq<'_>], nmax: usize) -> Vec<u32> {
    let n_seq = seqs.len();
    let table = n_seq * nmax;
    let mut meta = vec![0u32; 2 * n_seq + 6 * table + table];
    let (head, rest) = meta.split_at_mut(2 * n_seq);
    let (tokens, rest) = rest.split_at_mut(table);
    let (ranks, rest) = rest.split_at_mut(table);
    let (draft_rows, rest) = rest.split_at_mut(table);
    let (child_at, rest) = rest.split_at_mut(table);
    let (child_n, rest) = rest.split_at_mut(table);
    let (children, uniforms) = rest.split_at_mut(table);
    for (s, seq) in seqs.iter().enumerate() {
        let n = seq.tokens.len();
        let at = s * nmax;
        head[s] = n as u32;
        head[n_seq + s] = seq.root_row as u32;
        tokens[at..at + n].copy_from_slice(seq.tokens);
        let mut next = 0;
        for i in 0..n {
            ranks[at + i] = seq.ranks[i] as u32;
            draft_rows[at + i] = seq
                .draft_rows
                .as_ref()
                .and_then(|rows| rows[i])
                .unwrap_or(TREE_NONE);
            child_at[at + i] = next as u32;
            child_n[at + i] = seq.children[i].len() as u32;
            for &c in seq.children[i] {
                children[at + next] = c as u32;
                next += 1;
            }
        }
        for (dst, u) in uniforms[at..].iter_mut().zip(seq.uniforms) {
            *dst = u.to_bits();
        }
    }
    meta
}

/// `logits` (contiguous) and each of its rows' warped law (`kestrel_row_laws_f32`).
#[cfg(feature = "cuda")]
fn with_laws(logits: &Tensor, inv_t: f32, top_k: usize, top_p: f32) -> Result<(Tensor, Tensor)> {
    let logits = logits.contiguous()?;
    let laws = logits.apply_op1_no_bwd(&cuda::RowLaws {
        inv_t,
        top_k,
        top_p,
    })?;
    Ok((logits, laws))
}

/// The target's and the draft's rows with their laws for the acceptance kernels; without a
/// draft the target stands in for it, never read.
#[cfg(feature = "cuda")]
fn laws(
    target: &Tensor,
    draft: Option<&Tensor>,
    inv_t: f32,
    top_k: usize,
    top_p: f32,
) -> Result<cuda::Laws> {
    let (p, p_laws) = with_laws(target, inv_t, top_k, top_p)?;
    let (q, q_laws) = match draft {
        Some(d) => with_laws(d, inv_t, top_k, top_p)?,
        None => (p.clone(), p_laws.clone()),
    };
    Ok(cuda::Laws {
        p,
        p_laws,
        q,
        q_laws,
    })
}

/// `CHAIN_ZERO_Q` in logit_rows.cuh: a draft the draft's law gives probability 0.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const CHAIN_ZERO_Q: u32 = u32::MAX;

/// The sampling parameters [`sample_rows`] and [`chain_accept`] take.
fn check_warp(temperature: f32, top_p: f32, what: &str) -> Result<()> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        candle_core::bail!("{what}: temperature {temperature} must be finite and > 0");
    }
    if !(top_p > 0.0 && top_p <= 1.0) {
        candle_core::bail!("{what}: top_p {top_p} must be in (0, 1]");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_layout() {
        let a = [10u32, 11, 12];
        let b = [20u32, 21];
        let mask = [true, false, true, true];
        let seqs = [
            AttnSeq {
                slots: &a,
                n_new: 1,
                mask: None,
            },
            AttnSeq {
                slots: &b,
                n_new: 2,
                mask: Some(&mask),
            },
        ];
        let (buf, n_tok, lmax) = PagedAttnMeta::host(&seqs).unwrap();
        assert_eq!((n_tok, lmax), (3, 3));
        // The uploaded metadata also carries the longest sequence's new tokens, which the
        // grouped attention kernel's grid is cut from.
        let meta = PagedAttnMeta::new(&seqs, &Device::Cpu).unwrap();
        assert_eq!(
            (meta.n_tok, meta.n_seq, meta.lmax, meta.max_new),
            (3, 2, 3, 2)
        );
        #[rustfmt::skip]
        let want = vec![
            12, 20, 21,        // new slots
            0, 1, 1,           // tok_seq
            3, 2,              // seq_len
            1, 2,              // seq_new
            0, 1,              // q_start
            CAUSAL, 0,         // mask_off
            10, 11, 12, 20, 21, 0, // slots, padded
            1, 0, 1, 1,        // masks
        ];
        assert_eq!(buf, want);

        let (padded, _, lmax) = PagedAttnMeta::host_padded(&seqs, 4).unwrap();
        assert_eq!(lmax, 4);
        #[rustfmt::skip]
        let slots = [10, 11, 12, 0, 20, 21, 0, 0];
        assert_eq!(padded[..14], want[..14]);
        assert_eq!(padded[14..22], slots);
        assert_eq!(padded[22..], want[20..]);
    }

    #[test]
    fn rejects_bad_sequences() {
        let a = [1u32];
        let err = PagedAttnMeta::host(&[AttnSeq {
            slots: &a,
            n_new: 2,
            mask: None,
        }])
        .unwrap_err();
        assert!(
            err.to_string().contains("2 new tokens for 1 slots"),
            "{err}"
        );
    }

    /// Verifications and draft trees over long contexts, or with enough row groups to fill the
    /// GPU, take the grouped kernel; decode steps, prefills and small short steps keep the
    /// block-per-row one; heads of other sizes than 64 and 128 are refused, and a taken head's
    /// shared memory is 8 stages of 32 padded rows plus 4 query rows in f32.
    #[test]
    fn grouped_attention_takes_long_or_large_trees_of_llama_heads() {
        // 132 multiprocessors (an H100 or H200); 100 blocks leave most of them idle.
        let steps: Vec<bool> = [1, 2, 64, 128, 129, 2048]
            .into_iter()
            .map(|new| attention_groups_step(new, 1024, 100, 132))
            .collect();
        assert_eq!(steps, [false, true, true, true, false, false]);
        // Short contexts keep the block-per-row kernel unless the groups fill the GPU:
        // Llama-2-7B's 64-row verification (32 heads × 16 groups) does, SmolLM2's (9 × 16)
        // does not.
        assert!(!attention_groups_step(64, 1023, 100, 132));
        assert!(attention_groups_step(64, 4096, 100, 132));
        assert!(attention_groups_step(64, 256, 32 * 16, 132));
        assert!(!attention_groups_step(64, 256, 9 * 16, 132));
        assert!(attention_groups_step(64, 256, 264, 132));
        assert!(!attention_groups_step(64, 256, 263, 132));
        assert!(!attention_groups_step(129, 256, 32 * 33, 132));
        // (head size, value bytes, padded row bytes)
        for (d, elem, row) in [(128, 2, 272), (64, 2, 144), (64, 4, 272), (128, 4, 528)] {
            let want = 8 * 32 * row + 4 * d * 4;
            assert_eq!(attention_groups_shared_bytes(d, elem), Some(want), "d {d}");
        }
        for d in [40, 80, 96, 256] {
            assert_eq!(attention_groups_shared_bytes(d, 2), None, "d {d}");
        }
    }
}

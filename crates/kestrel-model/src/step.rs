//! One paged forward step, whatever the model: validating the batch, reserving its cache
//! slots and working out on the host what the step's attention needs ([`plan_step`]), then
//! putting that on the device: freshly uploaded tensors for an eager step
//! ([`StepPlan::upload`]) or packed buffers that a replayed CUDA graph reads
//! ([`StepPlan::graph_inputs`]).

use crate::batched_attn::{BatchedStep, KernelAttn};
use crate::cache::{PagedKvCache, SeqId};
use crate::cuda_kernels::CudaKernels;
use crate::error::{invalid, Result};
use crate::layer::PagedSeq;
use crate::llama::OutputRows;
use crate::rope::Rope;
use candle_core::{DType, Device, Tensor};

/// What the paged step needs to know of one sequence, whatever the model.
pub(crate) struct StepSeq<'a> {
    pub seq: SeqId,
    pub n: usize,
    pub positions: &'a [u32],
    pub mask: Option<&'a [bool]>,
    pub output_rows: &'a OutputRows,
}

/// A validated, cache-reserved step on the device: per-sequence attention plans, RoPE
/// tables, the concatenated output rows and the lengths to commit once the forward succeeded.
pub(crate) struct Step {
    pub seqs: Vec<PagedSeq>,
    /// The batch as one attention call, when the portable path runs and it applies.
    pub batched: Option<BatchedStep>,
    /// The step through Kestrel's paged-attention CUDA kernel, when the plan picks it.
    pub kernel: Option<KernelAttn>,
    pub cos: Tensor,
    pub sin: Tensor,
    /// Rows of the concatenated tokens to return, or `None` for all of them in order.
    pub out_rows: Option<Tensor>,
}

/// A validated, cache-reserved step, still on the host.
pub(crate) struct StepPlan<'a> {
    pub seqs: Vec<PagedSeq>,
    /// Each sequence's length once the step succeeded (for `PagedKvCache::set_len`).
    pub commit: Vec<(SeqId, usize)>,
    /// Each sequence's mask over its new tokens, as given.
    masks: Vec<Option<&'a [bool]>>,
    positions: Vec<u32>,
    /// Rows of the concatenated tokens to return, or `None` for all of them in order.
    out_rows: Option<Vec<u32>>,
    /// Attention takes Kestrel's paged kernel.
    pub kernel_attn: bool,
    /// Attention on the tensor-core kernels (`kestrel_kernels::paged_attention_tensor_cores`)
    /// rather than the scalar ones: the plan's choice, the same for every step of a model.
    pub tensor_cores: bool,
    /// New K/V go through the `kv_append` kernel.
    pub kv_append: bool,
    /// Whether the batch may become one portable attention call.
    portable: bool,
}

/// Validates `inputs`, reserves their slots in `cache` and plans the step. `portable`: the
/// candle path (not the CPU kernels); `cuda`: the kernel choices on a CUDA device; `prompt`:
/// a prompt's forward.
pub(crate) fn plan_step<'a>(
    inputs: &[StepSeq<'a>],
    cache: &mut PagedKvCache,
    device: &Device,
    portable: bool,
    cuda: Option<&CudaKernels>,
    prompt: bool,
) -> Result<StepPlan<'a>> {
    if inputs.is_empty() {
        return Err(invalid("empty batch"));
    }
    let mut seen = std::collections::BTreeSet::new();
    let mut positions = Vec::new();
    for s in inputs {
        if s.n == 0 {
            return Err(invalid(format!("sequence {:?} brings no tokens", s.seq)));
        }
        if !seen.insert(s.seq) {
            return Err(invalid(format!(
                "sequence {:?} appears twice in one batch",
                s.seq
            )));
        }
        if s.positions.len() != s.n {
            return Err(invalid(format!(
                "sequence {:?}: {} positions for {} tokens",
                s.seq,
                s.positions.len(),
                s.n
            )));
        }
        if let Some(m) = s.mask {
            if m.len() != s.n * s.n {
                return Err(invalid(format!(
                    "sequence {:?}: mask has {} entries, expected {}x{}",
                    s.seq,
                    m.len(),
                    s.n,
                    s.n
                )));
            }
        }
        positions.extend_from_slice(s.positions);
    }
    let requests: Vec<(SeqId, usize)> = inputs.iter().map(|s| (s.seq, s.n)).collect();
    cache.reserve(&requests)?;
    let single = inputs.iter().all(|s| s.n == 1);
    let kernel_attn = cuda.is_some_and(|k| k.attention(prompt, single));
    let tensor_cores = kernel_attn && cuda.is_some_and(|k| k.attention_tensor_cores(prompt));
    // Per-sequence slot and mask tensors are for the candle path only.
    let per_seq_tensors = !device.is_cpu() && !kernel_attn;

    let mut seqs = Vec::with_capacity(inputs.len());
    let mut out_rows = Vec::new();
    let mut all_out = true;
    let mut commit = Vec::with_capacity(inputs.len());
    let mut offset = 0;
    for s in inputs {
        let past = cache.seq_len(s.seq)?;
        let total = past + s.n;
        let rows = s.output_rows.resolve(s.n)?;
        if rows.len() != s.n || rows.iter().enumerate().any(|(i, &r)| i != r) {
            all_out = false;
        }
        out_rows.extend(rows.iter().map(|&r| (offset + r) as u32));
        let new_rows = cache.slot_rows(s.seq, past, s.n)?;
        let all_rows = cache.slot_rows(s.seq, 0, total)?;
        let all_rows_t = if !per_seq_tensors {
            None
        } else {
            Some(Tensor::new(all_rows.as_slice(), device)?)
        };
        let mask = if s.n == 1 && s.mask.is_none_or(|m| m[0]) {
            None
        } else {
            let mut m = vec![0f32; s.n * total];
            for i in 0..s.n {
                for j in 0..s.n {
                    let allowed = match s.mask {
                        Some(mask) => mask[i * s.n + j],
                        None => j <= i,
                    };
                    if !allowed {
                        m[i * total + past + j] = f32::MIN;
                    }
                }
            }
            Some(m)
        };
        let mask_t = match &mask {
            Some(m) if per_seq_tensors => Some(Tensor::from_slice(m, (s.n, total), device)?),
            _ => None,
        };
        seqs.push(PagedSeq {
            offset,
            n: s.n,
            new_rows,
            all_rows,
            all_rows_t,
            mask,
            mask_t,
        });
        commit.push((s.seq, total));
        offset += s.n;
    }
    Ok(StepPlan {
        seqs,
        commit,
        masks: inputs.iter().map(|s| s.mask).collect(),
        positions,
        out_rows: (!all_out).then_some(out_rows),
        kernel_attn,
        tensor_cores,
        kv_append: cuda.is_some_and(|k| k.kv_append),
        portable,
    })
}

/// Where each input of a graphed step lies in its two packed buffers (see
/// [`StepPlan::graph_inputs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct GraphLayout {
    pub n_tok: usize,
    pub n_seq: usize,
    /// Slot-table row length, padded up so that growing sequences keep the layout.
    pub lmax: usize,
    /// New tokens of the sequence that brings the most (the grid of the grouped attention
    /// kernel: steps of one n_tok and n_seq may split their tokens differently).
    pub max_new: usize,
    /// Longest tree-masked sequence's new tokens (0: none masked).
    pub tree_max_new: usize,
    /// Attention on the tensor-core kernels ([`StepPlan::tensor_cores`]).
    pub tensor_cores: bool,
    /// Length of the attention table (after the new tokens' slot ids).
    pub table_len: usize,
    /// Returned rows when not all of them in order.
    pub out_rows: Option<usize>,
    /// Values per RoPE table (`n_tok × head_dim / 2`).
    pub rope_len: usize,
    /// Bit `l` set: the step also returns the state after decoder layer `l`
    /// ([`crate::Llama::forward_tapped`]), so its output is wider than a plain step's.
    pub taps: u128,
}

/// A graphed step's host inputs: `u32 = ids | new_slots | table | out_rows` and
/// `f32 = cos | sin` (f32, cast to the model's dtype inside the graph).
pub(crate) struct GraphInputs {
    pub layout: GraphLayout,
    pub u32s: Vec<u32>,
    pub f32s: Vec<f32>,
}

impl GraphLayout {
    /// The step as views into the graph's buffers (`u32s`, `f32s` laid out as described by
    /// [`GraphInputs`]); `dtype`: the model's. Returns the token ids and the step, which
    /// has no per-sequence host plans: the kernels need none.
    pub fn step(&self, u32s: &Tensor, f32s: &Tensor, dtype: DType) -> Result<(Tensor, Step)> {
        let n = self.n_tok;
        let half = self.rope_len / n;
        let ids = u32s.narrow(0, 0, n)?;
        let meta = kestrel_kernels::PagedAttnMeta {
            new_slots: u32s.narrow(0, n, n)?,
            table: u32s.narrow(0, 2 * n, self.table_len)?,
            n_tok: n,
            n_seq: self.n_seq,
            lmax: self.lmax,
            max_new: self.max_new,
            tree_max_new: self.tree_max_new,
        };
        let out_rows = match self.out_rows {
            Some(r) => Some(u32s.narrow(0, 2 * n + self.table_len, r)?),
            None => None,
        };
        let rope = |i: usize| -> Result<Tensor> {
            Ok(f32s
                .narrow(0, i * self.rope_len, self.rope_len)?
                .reshape((n, half))?
                .to_dtype(dtype)?)
        };
        let step = Step {
            seqs: Vec::new(),
            batched: None,
            kernel: Some(KernelAttn {
                meta,
                kv_append: true,
                tensor_cores: self.tensor_cores,
            }),
            cos: rope(0)?,
            sin: rope(1)?,
            out_rows,
        };
        Ok((ids, step))
    }
}

/// Slot-table rows of graphed steps are padded to a multiple of this, so a sequence that
/// grows by one token per step needs a new graph only every this many tokens.
pub(crate) const GRAPH_SLOT_BUCKET: usize = 256;

impl<'a> StepPlan<'a> {
    fn attn_seqs(&self) -> Vec<kestrel_kernels::AttnSeq<'_>> {
        self.seqs
            .iter()
            .zip(&self.masks)
            .map(|(p, mask)| kestrel_kernels::AttnSeq {
                slots: &p.all_rows,
                n_new: p.n,
                mask: *mask,
            })
            .collect()
    }

    /// Whether the step can replay a CUDA graph: attention and K/V writes through Kestrel's
    /// kernels, whose inputs all come from device buffers.
    pub fn graphable(&self) -> bool {
        self.kernel_attn && self.kv_append
    }

    /// The packed inputs of a graphed step over `tokens` (checked against the vocabulary
    /// by the caller).
    pub fn graph_inputs(&self, tokens: &[u32], rope: &Rope) -> Result<GraphInputs> {
        let lmax = self
            .seqs
            .iter()
            .map(|s| s.all_rows.len())
            .max()
            .unwrap_or(0);
        let padded = lmax.div_ceil(GRAPH_SLOT_BUCKET) * GRAPH_SLOT_BUCKET;
        let attn_seqs = self.attn_seqs();
        let (meta, n_tok, lmax) = kestrel_kernels::PagedAttnMeta::host_padded(&attn_seqs, padded)?;
        let mut u32s = Vec::with_capacity(n_tok + meta.len() + tokens.len());
        u32s.extend_from_slice(tokens);
        u32s.extend_from_slice(&meta);
        if let Some(rows) = &self.out_rows {
            u32s.extend_from_slice(rows);
        }
        let (mut f32s, sin) = rope.cos_sin_host(&self.positions);
        let rope_len = f32s.len();
        f32s.extend_from_slice(&sin);
        Ok(GraphInputs {
            layout: GraphLayout {
                n_tok,
                n_seq: self.seqs.len(),
                lmax,
                max_new: self.seqs.iter().map(|s| s.n).max().unwrap_or(0),
                tree_max_new: kestrel_kernels::PagedAttnMeta::tree_max_new(&attn_seqs),
                tensor_cores: self.tensor_cores,
                table_len: meta.len() - n_tok,
                out_rows: self.out_rows.as_ref().map(Vec::len),
                rope_len,
                taps: 0,
            },
            u32s,
            f32s,
        })
    }

    /// The step on the device, through freshly uploaded tensors (take `commit` first).
    pub fn upload(
        self,
        rope: &Rope,
        cache: &PagedKvCache,
        dtype: DType,
        device: &Device,
    ) -> Result<Step> {
        let kernel = if self.kernel_attn {
            Some(KernelAttn {
                meta: kestrel_kernels::PagedAttnMeta::new(&self.attn_seqs(), device)?,
                kv_append: self.kv_append,
                tensor_cores: self.tensor_cores,
            })
        } else {
            None
        };
        let batched = if self.portable && kernel.is_none() {
            BatchedStep::new(
                &self.seqs,
                cache.n_kv_heads(),
                cache.head_dim(),
                device,
                self.kv_append,
            )?
        } else {
            None
        };
        let (cos, sin) = rope.cos_sin(&self.positions, dtype, device)?;
        let out_rows = match self.out_rows {
            Some(rows) => {
                let n = rows.len();
                Some(Tensor::from_vec(rows, n, device)?)
            }
            None => None,
        };
        Ok(Step {
            seqs: self.seqs,
            batched,
            kernel,
            cos,
            sin,
            out_rows,
        })
    }
}

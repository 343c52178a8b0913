//! Which of Kestrel's own CUDA kernels (`kestrel-kernels`) a model runs on a CUDA device, per
//! op, as recorded in the engine plan by spec-build. Off a CUDA device the choice is ignored:
//! the CPU kernels and the portable candle path are untouched by it.

use kestrel_core::KernelChoice;

/// Plan op names whose kernel choice this module reads.
pub mod ops {
    pub const ATTENTION_DECODE: &str = "attention.decode";
    pub const ATTENTION_TREE: &str = "attention.tree";
    pub const ATTENTION_CONTEXT: &str = "attention.context";
    pub const KV_APPEND: &str = "kv_append";
    pub const RMSNORM: &str = "rmsnorm";
    pub const SWIGLU: &str = "swiglu";
    pub const ROPE: &str = "rope";
    pub const GEMM: &str = "gemm";
}

/// Per op: `true` = Kestrel's kernel, `false` = candle ops (the portable path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaKernels {
    /// Steps where every sequence brings one token.
    pub attention_decode: bool,
    /// Other non-prompt steps (tree verification, drafting several tokens).
    pub attention_tree: bool,
    /// Prompt prefill ([`crate::Llama::forward_prompt`]).
    pub attention_context: bool,
    /// Writing new K/V rows into the paged pools by u32 slot ids.
    pub kv_append: bool,
    /// Residual add fused with the following RMSNorm.
    pub add_rmsnorm: bool,
    /// `silu(gate) · up` on the fused gate_up projection.
    pub swiglu: bool,
    /// The fused QKV projection's split, RoPE and K/V append in one kernel (steps through
    /// the attention and `kv_append` kernels only).
    pub qkv_rope: bool,
    /// Projections of decode, draft and verification steps (any row count) through the
    /// row-invariant `gemv` kernels where `kestrel_kernels::gemv_applies` (every f16/bf16
    /// weight with K a multiple of 64; f32 up to `GEMV_MAX_K`); prompts through cuBLAS.
    pub gemv: bool,
}

impl Default for CudaKernels {
    /// Everything on: models built in memory (benchmarks, tests) take the fastest path.
    fn default() -> Self {
        Self::all()
    }
}

impl CudaKernels {
    pub fn all() -> Self {
        CudaKernels {
            attention_decode: true,
            attention_tree: true,
            attention_context: true,
            kv_append: true,
            add_rmsnorm: true,
            swiglu: true,
            qkv_rope: true,
            gemv: true,
        }
    }

    /// candle ops only (the path of engines built before these kernels existed).
    pub fn none() -> Self {
        CudaKernels {
            attention_decode: false,
            attention_tree: false,
            attention_context: false,
            kv_append: false,
            add_rmsnorm: false,
            swiglu: false,
            qkv_rope: false,
            gemv: false,
        }
    }

    /// The plan's choices: an op runs Kestrel's kernel when the plan names one for it
    /// (`kestrel_paged_attention_bf16`, ...); any other name, or no entry, keeps candle.
    pub fn from_choices(choices: &[KernelChoice]) -> Self {
        let picks = |op: &str, kernel: &str| {
            choices
                .iter()
                .any(|c| c.op == op && c.kernel.starts_with(kernel))
        };
        use kestrel_kernels::names;
        CudaKernels {
            attention_decode: picks(ops::ATTENTION_DECODE, names::PAGED_ATTENTION),
            attention_tree: picks(ops::ATTENTION_TREE, names::PAGED_ATTENTION),
            attention_context: picks(ops::ATTENTION_CONTEXT, names::PAGED_ATTENTION),
            kv_append: picks(ops::KV_APPEND, names::KV_APPEND),
            add_rmsnorm: picks(ops::RMSNORM, names::ADD_RMSNORM),
            swiglu: picks(ops::SWIGLU, names::SWIGLU),
            qkv_rope: picks(ops::ROPE, names::QKV_ROPE),
            gemv: picks(ops::GEMM, names::GEMV),
        }
    }

    /// Whether a step's attention takes the paged-attention kernel. Tree steps take it
    /// whatever their size (when the plan picks it): a verification must attend exactly as
    /// the decode step it stands for, and the kernel gives a query row the same bits in both
    /// (candle's batched matmuls, ~25% faster on big trees before the kernel read V rows as
    /// vectors, do not).
    pub(crate) fn attention(&self, prompt: bool, single_tokens: bool) -> bool {
        if prompt {
            self.attention_context
        } else if single_tokens {
            self.attention_decode
        } else {
            self.attention_tree
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn choice(op: &str, kernel: &str) -> KernelChoice {
        KernelChoice {
            op: op.into(),
            kernel: kernel.into(),
        }
    }

    #[test]
    fn reads_plan_choices() {
        let old = [
            choice("attention.decode", "candle-cuda-sm_90"),
            choice("rmsnorm", "candle-cuda"),
        ];
        assert_eq!(CudaKernels::from_choices(&old), CudaKernels::none());
        let new = [
            choice("attention.decode", "kestrel_paged_attention_bf16"),
            choice("attention.tree", "kestrel_paged_attention_bf16"),
            choice("attention.context", "candle-cuda-sm_90"),
            choice("kv_append", "kestrel_kv_append_bf16"),
            choice("rmsnorm", "kestrel_add_rmsnorm_bf16"),
            choice("swiglu", "kestrel_swiglu_bf16"),
            choice("rope", "kestrel_qkv_rope_bf16"),
            choice("gemm", "kestrel_gemv_bf16+cublas"),
        ];
        let k = CudaKernels::from_choices(&new);
        assert!(k.attention(false, true) && k.attention(false, false));
        assert!(!k.attention(true, false));
        assert!(k.kv_append && k.add_rmsnorm && k.swiglu && k.qkv_rope && k.gemv);
    }
}

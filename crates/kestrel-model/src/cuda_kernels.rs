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
    /// Steps (decode, drafts, verification) attend on the tensor-core kernels
    /// (`kestrel_kernels::paged_attention_tensor_cores`) instead of the scalar ones. One
    /// choice for all of them: a row's bits differ between the two families, and a
    /// verification must give a row the bits its decode step would.
    pub attention_tensor_cores: bool,
    /// Prompts attend on the tensor-core kernels.
    pub context_tensor_cores: bool,
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
    /// Every kernel, the attention's family as `KESTREL_ATTENTION` says (`tensor_cores`, or
    /// the scalar kernels otherwise): models built in memory by benchmarks take it from there.
    pub fn all() -> Self {
        static TENSOR_CORES: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let tc = *TENSOR_CORES
            .get_or_init(|| std::env::var("KESTREL_ATTENTION").as_deref() == Ok("tensor_cores"));
        CudaKernels {
            attention_decode: true,
            attention_tree: true,
            attention_context: true,
            attention_tensor_cores: tc,
            context_tensor_cores: tc,
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
            attention_tensor_cores: false,
            context_tensor_cores: false,
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
            attention_tensor_cores: picks(ops::ATTENTION_DECODE, names::PAGED_ATTENTION_TC)
                && picks(ops::ATTENTION_TREE, names::PAGED_ATTENTION_TC),
            context_tensor_cores: picks(ops::ATTENTION_CONTEXT, names::PAGED_ATTENTION_TC),
            kv_append: picks(ops::KV_APPEND, names::KV_APPEND),
            add_rmsnorm: picks(ops::RMSNORM, names::ADD_RMSNORM),
            swiglu: picks(ops::SWIGLU, names::SWIGLU),
            qkv_rope: picks(ops::ROPE, names::QKV_ROPE),
            gemv: picks(ops::GEMM, names::GEMV),
        }
    }

    /// Whether a step's attention (taking the paged-attention kernels) runs on the tensor-core
    /// family.
    pub(crate) fn attention_tensor_cores(&self, prompt: bool) -> bool {
        if prompt {
            self.context_tensor_cores
        } else {
            self.attention_tensor_cores
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
        assert!(!k.attention_tensor_cores && !k.context_tensor_cores);
        // The tensor-core family: steps take it only when decode and tree steps both name it.
        let tc = |decode: &str, tree: &str| {
            CudaKernels::from_choices(&[
                choice("attention.decode", decode),
                choice("attention.tree", tree),
                choice("attention.context", "kestrel_paged_attention_tc_bf16"),
            ])
        };
        let both = tc(
            "kestrel_paged_attention_tc_bf16",
            "kestrel_paged_attention_tc_bf16",
        );
        assert!(both.attention(false, true) && both.attention(false, false));
        assert!(both.attention_tensor_cores && both.context_tensor_cores);
        let mixed = tc(
            "kestrel_paged_attention_tc_bf16",
            "kestrel_paged_attention_bf16",
        );
        assert!(!mixed.attention_tensor_cores);
    }
}

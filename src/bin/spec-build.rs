//! `spec-build`: a converted checkpoint → an engine (TensorRT-LLM's `trtllm-build`).

use anyhow::Result;
use clap::Parser;
use kestrel::cli::{exit_on_error, parse_flag};
use kestrel_build::{build_engine, AttentionKernel, BuildOptions, GemmPlugin, TargetDevice};
use kestrel_core::SpeculativeMode;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "spec-build",
    rename_all = "snake_case",
    version,
    about = "Build a Kestrel engine from a converted checkpoint"
)]
struct Args {
    /// Checkpoint directory written by convert-checkpoint.
    #[arg(long)]
    checkpoint_dir: PathBuf,
    /// Where to write the engine (replaced atomically if it exists).
    #[arg(long)]
    output_dir: PathBuf,
    #[arg(long, default_value_t = 8)]
    max_batch_size: usize,
    #[arg(long, default_value_t = 1024)]
    max_input_len: usize,
    #[arg(long, default_value_t = 2048)]
    max_seq_len: usize,
    /// Only 1 is supported: speculative decoding has no beam search.
    #[arg(long, default_value_t = 1)]
    max_beam_width: usize,
    /// none, eagle or draft_tokens_external.
    #[arg(long, default_value = "none")]
    speculative_decoding_mode: String,
    /// Draft tokens verified per step (EAGLE: defaults to the checkpoint's).
    #[arg(long)]
    max_draft_len: Option<usize>,
    /// KV-cache block size in tokens.
    #[arg(long, default_value_t = 32)]
    tokens_per_block: usize,
    /// enable or disable: paged KV for the context phase too.
    #[arg(long, default_value = "enable")]
    use_paged_context_fmha: String,
    /// auto, disable, float32, float16 or bfloat16.
    #[arg(long, default_value = "auto")]
    gemm_plugin: String,
    /// scalar or tensor_cores: the attention kernels of a CUDA engine's every step
    /// (tensor_cores: f16/bf16, heads of 64 or 128, EAGLE trees of at most 64 tokens;
    /// verifications and long contexts faster, decode steps slower; docs/gpu-results.md).
    #[arg(long, default_value = "scalar")]
    attention_kernel: String,
    /// cpu or cuda:sm_XY.
    #[arg(long, default_value = "cpu")]
    target_device: String,
    /// EAGLE engines: the EAGLE-1 tree spec-run drafts when given none (JSON paths, a preset
    /// name or a JSON file, e.g. one `spec-train calibrate` derived for this device);
    /// without it, mc_sim_7b_63.
    #[arg(long)]
    eagle_choices: Option<String>,
}

fn run(args: Args) -> Result<()> {
    let use_paged_context_fmha = match args.use_paged_context_fmha.as_str() {
        "enable" => true,
        "disable" => false,
        other => {
            anyhow::bail!("unknown --use_paged_context_fmha '{other}': expected enable or disable")
        }
    };
    let opts = BuildOptions {
        checkpoint_dir: args.checkpoint_dir,
        output_dir: args.output_dir,
        max_batch_size: args.max_batch_size,
        max_input_len: args.max_input_len,
        max_seq_len: args.max_seq_len,
        max_beam_width: args.max_beam_width,
        speculative_mode: parse_flag(SpeculativeMode::parse(&args.speculative_decoding_mode))?,
        max_draft_len: args.max_draft_len,
        tokens_per_block: args.tokens_per_block,
        use_paged_context_fmha,
        gemm_plugin: parse_flag(args.gemm_plugin.parse::<GemmPlugin>())?,
        attention_kernel: parse_flag(args.attention_kernel.parse::<AttentionKernel>())?,
        target_device: parse_flag(args.target_device.parse::<TargetDevice>())?,
        eagle_choices: args
            .eagle_choices
            .as_deref()
            .map(|spec| kestrel::decoding::tree_json("--eagle_choices ", spec))
            .transpose()?,
    };
    let summary = build_engine(&opts)?;
    let l = &summary.plan.limits;
    println!(
        "Built engine {} ({}, {}, tp_size {}, mode {}, max_batch_size {}, max_seq_len {}, max_draft_len {})",
        summary.output_dir.display(),
        summary.plan.target_device,
        summary.plan.dtype,
        summary.plan.mapping.tp_size,
        summary.plan.speculative_mode.as_str(),
        l.max_batch_size,
        l.max_seq_len,
        l.max_draft_len
    );
    Ok(())
}

fn main() {
    exit_on_error("spec-build", run(Args::parse()));
}

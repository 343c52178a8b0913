//! convert-checkpoint: HF directory or GGUF file (+ EAGLE head) → Kestrel checkpoint.
//!
//! Flags follow TensorRT-LLM's `convert_checkpoint.py`. Errors print as one line,
//! `convert-checkpoint: error: <message>`, and exit 1; usage errors exit 2.

use clap::{ArgGroup, Parser};
use kestrel_convert::{ConvertOptions, EagleOptions, Source};
use kestrel_core::DType;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "convert-checkpoint",
    version,
    rename_all = "snake_case",
    about = "Convert an HF or GGUF Llama checkpoint (and an optional EAGLE head) into a Kestrel checkpoint"
)]
#[command(group(ArgGroup::new("source").required(true).args(["model_dir", "gguf"])))]
struct Args {
    /// Hugging Face model directory (config.json + safetensors or pytorch_model.bin).
    #[arg(long, value_name = "DIR")]
    model_dir: Option<PathBuf>,
    /// llama.cpp GGUF model file (llama architecture; F32/F16/BF16/Q4_0/Q4_1/Q8_0).
    #[arg(long, value_name = "FILE")]
    gguf: Option<PathBuf>,
    /// Where to write the checkpoint (replaced atomically if it holds an earlier one).
    #[arg(long, value_name = "DIR")]
    output_dir: PathBuf,
    /// Weight dtype: float32, float16 or bfloat16.
    #[arg(long, default_value = "float32", value_parser = parse_dtype)]
    dtype: DType,
    /// Tensor-parallel size: number of rank files to write.
    #[arg(long, default_value_t = 1)]
    tp_size: usize,
    /// Threads used to slice and cast tensors.
    #[arg(long, default_value_t = 1)]
    workers: usize,
    /// EAGLE-1/2 head directory (config.json + pytorch_model.bin or model.safetensors).
    #[arg(long, value_name = "DIR")]
    eagle_model_dir: Option<PathBuf>,
    /// Most draft tokens in an EAGLE tree (at most 256).
    #[arg(long, default_value_t = 63)]
    max_draft_len: usize,
    /// Depth of the EAGLE draft tree.
    #[arg(long, default_value_t = 4)]
    num_eagle_layers: usize,
    /// Nodes expanded per EAGLE tree level.
    #[arg(long, default_value_t = 10)]
    max_non_leaves_per_layer: usize,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The library's messages already name the file, tensor or flag; print one line.
            let message = e.to_string().replace('\n', " ");
            eprintln!("convert-checkpoint: error: {message}");
            ExitCode::from(1)
        }
    }
}

fn run(args: Args) -> anyhow::Result<()> {
    let source = match (args.model_dir, args.gguf) {
        (Some(dir), None) => Source::HfDir(dir),
        (None, Some(file)) => Source::Gguf(file),
        // clap's "source" group admits exactly one.
        _ => anyhow::bail!("pass exactly one of --model_dir and --gguf"),
    };
    let opts = ConvertOptions {
        source,
        output_dir: args.output_dir,
        dtype: args.dtype,
        tp_size: args.tp_size,
        workers: args.workers,
        eagle: args.eagle_model_dir.map(|dir| EagleOptions {
            dir,
            max_draft_len: args.max_draft_len,
            num_eagle_layers: args.num_eagle_layers,
            max_non_leaves_per_layer: args.max_non_leaves_per_layer,
        }),
        progress: std::io::stderr().is_terminal(),
    };
    let summary = kestrel_convert::convert(&opts)?;
    println!("convert-checkpoint: {summary}");
    Ok(())
}

//! The self-distillation data both trainers learn from: the engine answers prompts, then
//! gives its final-normed hidden state at every position.

use crate::parse_dtype;
use anyhow::{bail, Result};
use kestrel_core::DType;
use kestrel_runtime::{Engine, TextCodec};
use kestrel_spec::SamplingParams;
use kestrel_train::dataset::FeatureDataset;
use kestrel_train::distill::{distill, encode_prompts, DistillOptions};
use kestrel_train::prompts::read_prompts;
use kestrel_train::synthetic::{synthesize_prompts, SyntheticOptions};
use std::path::{Path, PathBuf};
use std::time::Instant;

/// How the self-distillation data is made (shared by `eagle` and `draft`).
#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct DataArgs {
    /// Prompts: ShareGPT JSON, GSM8K JSONL, MT-bench JSONL, or a list of strings; repeat the
    /// flag to read several files, in order.
    #[arg(long)]
    pub prompts: Vec<PathBuf>,
    #[arg(long, default_value_t = 300)]
    pub num_prompts: usize,
    /// Longest prompt kept (tokens after the chat template); longer ones are skipped.
    #[arg(long, default_value_t = 256)]
    pub max_prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// 0 = greedy answers.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Do not wrap prompts in the engine's chat template.
    #[arg(long)]
    pub no_chat: bool,
    /// Also let the engine write this many user prompts itself (Magpie: it continues its
    /// chat template's user-turn opener), then answer the distinct ones after --prompts'.
    /// They are kept in <data_dir>/synthetic_prompts.json.
    #[arg(long, default_value_t = 0)]
    pub synthetic_prompts: usize,
    /// Longest synthetic prompt, in tokens: ones that have not ended by then are dropped.
    #[arg(long, default_value_t = 128)]
    pub synthetic_prompt_len: usize,
    /// Sampling temperature of the synthetic prompts.
    #[arg(long, default_value_t = 1.0)]
    pub synthetic_temperature: f32,
    /// Base decoder layers (0-based, comma-separated, increasing) whose states the cache
    /// keeps next to the final feature, for an EAGLE head that reads several layers
    /// (EAGLE-3's low/mid features; e.g. 2,15 on a 30-layer model). The head trained on the
    /// cache reads the same layers.
    #[arg(long, value_delimiter = ',')]
    pub feature_layers: Vec<usize>,
    /// Tokens per varlen batch of the feature pass.
    #[arg(long, default_value_t = 2048)]
    pub feature_batch_tokens: usize,
    /// Dtype of the cached features.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    pub feature_dtype: DType,
    /// Generate the data even if --data_dir already holds some (--stage all; draft).
    #[arg(long)]
    pub regenerate: bool,
}

/// Self-distillation data into `data_dir`: `engine` answers the prompts, then gives the
/// features.
pub fn generate_data(
    args: &DataArgs,
    engine_dir: &Path,
    data_dir: &Path,
    seed: u64,
    engine: &Engine,
) -> Result<()> {
    if args.prompts.is_empty() && args.synthetic_prompts == 0 {
        bail!("--prompts FILE or --synthetic_prompts N is needed to generate data (ShareGPT JSON, GSM8K JSONL, ...)");
    }
    if args.synthetic_prompts > 0 && args.no_chat {
        bail!("--synthetic_prompts continues the chat template's user turn: drop --no_chat");
    }
    let codec = TextCodec::load(engine_dir, &engine.config)?;
    let mut texts = Vec::new();
    for file in &args.prompts {
        texts.extend(read_prompts(file)?);
    }
    let prompts_file = args
        .prompts
        .iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(",");
    let opts = DistillOptions {
        num_prompts: args.num_prompts,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_new_tokens,
        chat: !args.no_chat,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed,
        },
    };
    let max_input_len = engine.plan.limits.max_input_len;
    let mut prompts = if texts.is_empty() {
        Vec::new()
    } else {
        encode_prompts(&codec, &texts, &opts, max_input_len)?
    };
    let synthetic = synthetic_prompts(args, engine, &codec, seed)?;
    if !synthetic.is_empty() {
        let all = DistillOptions {
            num_prompts: usize::MAX,
            ..opts.clone()
        };
        prompts.extend(encode_prompts(&codec, &synthetic, &all, max_input_len)?);
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    eprintln!(
        "spec-train: {} prompts ({prompt_tokens} tokens) of {} read from [{}] and {} synthetic; answering up to {} tokens each",
        prompts.len(),
        texts.len(),
        prompts_file,
        synthetic.len(),
        args.max_new_tokens
    );
    let t0 = Instant::now();
    let seqs = distill(engine, &prompts, &opts, &mut |done, total| {
        eprintln!(
            "spec-train: answered {done}/{total} [{:.0}s]",
            t0.elapsed().as_secs_f64()
        )
    })?;
    let generate_s = t0.elapsed().as_secs_f64();
    let answer: usize = seqs.iter().map(|(t, p)| t.len() - p).sum();
    eprintln!("spec-train: {answer} answer tokens in {generate_s:.0}s");
    let t1 = Instant::now();
    let mut data = FeatureDataset::extract(
        &engine.model,
        seqs,
        &args.feature_layers,
        args.feature_batch_tokens,
        &mut |done, total| {
            eprintln!(
                "spec-train: features {done}/{total} [{:.0}s]",
                t1.elapsed().as_secs_f64()
            )
        },
    )?;
    data.source = kestrel_train::dataset::DatasetSource {
        engine_dir: engine_dir.display().to_string(),
        prompts_file,
        synthetic_prompts: synthetic.len(),
        chat_template: !args.no_chat,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed,
        generate_s,
        features_s: t1.elapsed().as_secs_f64(),
    };
    let synthetic_json = serde_json::to_string_pretty(&synthetic)?;
    let extra: &[(&str, &[u8])] = if synthetic.is_empty() {
        &[]
    } else {
        &[("synthetic_prompts.json", synthetic_json.as_bytes())]
    };
    data.save_with(
        data_dir,
        kestrel_model::candle_dtype(args.feature_dtype),
        extra,
    )?;
    eprintln!(
        "spec-train: wrote {} sequences ({} tokens, {} answer tokens) to {}",
        data.len(),
        data.tokens.len(),
        data.answer_tokens(),
        data_dir.display()
    );
    Ok(())
}

/// The --synthetic_prompts the engine writes itself (none unless asked).
fn synthetic_prompts(
    args: &DataArgs,
    engine: &Engine,
    codec: &TextCodec,
    seed: u64,
) -> Result<Vec<String>> {
    if args.synthetic_prompts == 0 {
        return Ok(Vec::new());
    }
    let opts = SyntheticOptions {
        count: args.synthetic_prompts,
        max_len: args.synthetic_prompt_len,
        sampling: SamplingParams {
            temperature: args.synthetic_temperature,
            top_k: 0,
            top_p: 1.0,
            seed,
        },
    };
    let t0 = Instant::now();
    let made = synthesize_prompts(engine, codec, &opts, &mut |done, total| {
        eprintln!(
            "spec-train: sampled {done}/{total} synthetic prompts [{:.0}s]",
            t0.elapsed().as_secs_f64()
        )
    })?;
    eprintln!(
        "spec-train: {} synthetic prompts kept of {} ({} unfinished within {} tokens, {} blank or repeated)",
        made.prompts.len(),
        args.synthetic_prompts,
        made.unfinished,
        args.synthetic_prompt_len,
        made.repeated_or_blank
    );
    if made.prompts.is_empty() {
        bail!(
            "none of the {} synthetic prompts ended within --synthetic_prompt_len {}: raise it",
            args.synthetic_prompts,
            args.synthetic_prompt_len
        );
    }
    Ok(made.prompts)
}

//! `spec-train`: trains drafts for Kestrel engines.
//!
//! `spec-train eagle` self-distils an EAGLE-1 head: the base engine answers prompts through
//! Kestrel's runtime (`--stage data`, cached in `--data_dir`), then a one-layer head learns to
//! predict the base model's next final-normed hidden state (`--stage train`, written to
//! `--output_dir` in the published EAGLE layout for `convert-checkpoint --eagle_model_dir`).
//!
//! `spec-train calibrate` measures an EAGLE engine's head per tree depth and rank on a prompt
//! set and writes the static eagle_choices tree with the best expected accepted length for a
//! node budget, a file that `spec-run --eagle_choices` takes.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kestrel::cli::exit_on_error;
use kestrel_core::DType;
use kestrel_runtime::{Engine, TextCodec};
use kestrel_spec::SamplingParams;
use kestrel_train::calibrate;
use kestrel_train::dataset::FeatureDataset;
use kestrel_train::distill::{distill, encode_prompts, DistillOptions};
use kestrel_train::eagle::{
    head_config, load_head, split, train, EagleTrainer, FrozenBase, HeadInit, SaveOptions,
    TrainConfig,
};
use kestrel_train::prompts::read_prompts;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    name = "spec-train",
    version,
    about = "Train drafts for Kestrel engines"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Train an EAGLE-1 head for a base engine by self-distillation.
    Eagle(Box<EagleArgs>),
    /// Derive the best static eagle_choices tree for an EAGLE engine from measured acceptance.
    Calibrate(Box<CalibrateArgs>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Stage {
    /// Generate the data if --data_dir holds none, then train.
    All,
    /// Only generate the self-distillation data and features into --data_dir.
    Data,
    /// Only train, on the data already in --data_dir.
    Train,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Init {
    /// The base model's last decoder layer, fc = [0 | I] (feature passthrough).
    Copy,
    /// Random weights.
    Random,
}

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
struct EagleArgs {
    /// Base engine directory (spec-build output): answers the prompts, gives the features,
    /// the embedding and the LM head.
    #[arg(long)]
    engine_dir: PathBuf,
    /// Feature cache: written by the data stage, read by the train stage.
    #[arg(long)]
    data_dir: PathBuf,
    /// Where the head goes (config.json + model.safetensors + train_log.json), replaced
    /// atomically after every epoch. Needed unless --stage data.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Stage::All)]
    stage: Stage,
    /// Where the base engine runs and the head trains: cpu or cuda:N (CUDA builds only).
    #[arg(long, default_value = "cpu")]
    device: String,

    // --- data ---
    /// Prompts: ShareGPT JSON, GSM8K JSONL, MT-bench JSONL, or a list of strings; repeat the
    /// flag to read several files, in order.
    #[arg(long)]
    prompts: Vec<PathBuf>,
    #[arg(long, default_value_t = 300)]
    num_prompts: usize,
    /// Longest prompt kept (tokens after the chat template); longer ones are skipped.
    #[arg(long, default_value_t = 256)]
    max_prompt_len: usize,
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// 0 = greedy answers.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Do not wrap prompts in the engine's chat template.
    #[arg(long)]
    no_chat: bool,
    /// Tokens per varlen batch of the feature pass.
    #[arg(long, default_value_t = 2048)]
    feature_batch_tokens: usize,
    /// Dtype of the cached features.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    feature_dtype: DType,
    /// Generate the data even if --data_dir already holds some (--stage all).
    #[arg(long)]
    regenerate: bool,

    // --- training ---
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    #[arg(long, default_value_t = 5e-4)]
    lr: f64,
    #[arg(long, default_value_t = 20)]
    warmup_steps: usize,
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 0.5)]
    grad_clip: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Longest training window (head positions); longer sequences keep their end.
    #[arg(long, default_value_t = 512)]
    max_len: usize,
    /// Input features get uniform noise in [-noise, noise].
    #[arg(long, default_value_t = 0.1)]
    noise: f32,
    /// Weight of the distribution (cross-entropy) term.
    #[arg(long, default_value_t = 0.1)]
    ce_weight: f64,
    /// Held-out fraction of the sequences (validation: loss and top-1 proxy).
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    #[arg(long, value_enum, default_value_t = Init::Copy)]
    init: Init,
    /// With --init copy: scale of the copied layer's o_proj and down_proj (0 = the head
    /// starts as the identity on the feature).
    #[arg(long, default_value_t = 0.0)]
    out_scale: f64,
    /// Train fc without a bias (writes "bias": false).
    #[arg(long)]
    no_bias: bool,
    /// Start from this head directory (config.json + model.safetensors) instead of --init.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Dtype of the written head.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    save_dtype: DType,
    /// Also write the training log here (it is always written into --output_dir).
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Rows per chunk of vocabulary-sized logits.
    #[arg(long, default_value_t = 256)]
    logits_chunk: usize,
    /// Seed of prompt sampling, noise, shuffling and the split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

fn generate_data(args: &EagleArgs, engine: &Engine) -> Result<()> {
    if args.prompts.is_empty() {
        bail!("--prompts FILE is needed to generate data (ShareGPT JSON, GSM8K JSONL, ...)");
    }
    let codec = TextCodec::load(&args.engine_dir, &engine.config)?;
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
            seed: args.seed,
        },
    };
    let prompts = encode_prompts(&codec, &texts, &opts, engine.plan.limits.max_input_len)?;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    eprintln!(
        "spec-train: {} prompts ({prompt_tokens} tokens) from {} ({} read); answering up to {} tokens each",
        prompts.len(),
        prompts_file,
        texts.len(),
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
        args.feature_batch_tokens,
        &mut |done, total| {
            eprintln!(
                "spec-train: features {done}/{total} [{:.0}s]",
                t1.elapsed().as_secs_f64()
            )
        },
    )?;
    data.source = kestrel_train::dataset::DatasetSource {
        engine_dir: args.engine_dir.display().to_string(),
        prompts_file,
        chat_template: !args.no_chat,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
        generate_s,
        features_s: t1.elapsed().as_secs_f64(),
    };
    data.save(
        &args.data_dir,
        kestrel_model::candle_dtype(args.feature_dtype),
    )?;
    eprintln!(
        "spec-train: wrote {} sequences ({} tokens, {} answer tokens) to {}",
        data.len(),
        data.tokens.len(),
        data.answer_tokens(),
        args.data_dir.display()
    );
    Ok(())
}

fn train_head(args: &EagleArgs, engine: &Engine, output_dir: &Path) -> Result<()> {
    let data = FeatureDataset::load(&args.data_dir)?;
    let cfg = &engine.config;
    if data.hidden_size != cfg.hidden_size || data.vocab_size != cfg.vocab_size {
        bail!(
            "{}: the features were made for hidden_size {} / vocab {}, but {} has {} / {}: regenerate the data for this engine",
            args.data_dir.display(),
            data.hidden_size,
            data.vocab_size,
            args.engine_dir.display(),
            cfg.hidden_size,
            cfg.vocab_size
        );
    }
    let rank_files: Vec<PathBuf> = engine
        .plan
        .weights
        .iter()
        .map(|w| args.engine_dir.join(&w.file))
        .collect();
    let base = FrozenBase::from_rank_files(&engine.model, engine.plan.mapping, &rank_files)?;
    let (head_cfg, init, init_name) = match &args.resume {
        Some(dir) => {
            let (hc, tensors) = load_head(dir)?;
            (
                hc,
                HeadInit::Tensors(tensors),
                format!("resume {}", dir.display()),
            )
        }
        None => {
            let hc = head_config(cfg, !args.no_bias);
            match args.init {
                Init::Copy => (
                    hc,
                    HeadInit::CopyLastLayer {
                        out_scale: args.out_scale,
                    },
                    format!("copy-last-layer (out_scale {})", args.out_scale),
                ),
                Init::Random => (
                    hc,
                    HeadInit::Random { seed: args.seed },
                    "random".to_string(),
                ),
            }
        }
    };
    let tcfg = TrainConfig {
        epochs: args.epochs,
        lr: args.lr,
        warmup_steps: args.warmup_steps,
        min_lr_ratio: args.min_lr_ratio,
        weight_decay: args.weight_decay,
        grad_clip: args.grad_clip,
        batch_size: args.batch_size,
        max_len: args.max_len,
        noise: args.noise,
        ce_weight: args.ce_weight,
        logits_chunk: args.logits_chunk,
        seed: args.seed,
        ..TrainConfig::default()
    };
    let (train_idx, val_idx) = split(data.len(), args.val_fraction, args.seed);
    eprintln!(
        "spec-train: {} train / {} held-out sequences ({} answer tokens in all), {} epochs of {} steps, init {init_name}",
        train_idx.len(),
        val_idx.len(),
        data.answer_tokens(),
        tcfg.epochs,
        train_idx.len().div_ceil(tcfg.batch_size)
    );
    let mut trainer = EagleTrainer::new(&base, head_cfg, init, tcfg)?;
    let save = SaveOptions {
        output_dir,
        dtype: kestrel_model::candle_dtype(args.save_dtype),
        extra: Vec::new(),
    };
    let log = train(
        &mut trainer,
        &data,
        &train_idx,
        &val_idx,
        &init_name,
        Some(&save),
        &mut |line| eprintln!("spec-train: {line}"),
    )?;
    if let Some(path) = &args.log_json {
        std::fs::write(path, serde_json::to_string_pretty(&log)?)
            .with_context(|| format!("--log_json {}: cannot write it", path.display()))?;
    }
    Ok(())
}

fn run_eagle(args: &EagleArgs) -> Result<()> {
    let output_dir = match (args.stage, &args.output_dir) {
        (Stage::Data, _) => None,
        (_, Some(dir)) => Some(dir.clone()),
        (_, None) => bail!("--output_dir is needed to train (or pass --stage data)"),
    };
    let device = kestrel_runtime::device::parse(&args.device)?;
    let engine = Engine::load(&args.engine_dir, &device)?;
    let have_data = FeatureDataset::exists(&args.data_dir);
    let make_data = match args.stage {
        Stage::Data => true,
        Stage::Train => false,
        Stage::All => args.regenerate || !have_data,
    };
    if make_data {
        generate_data(args, &engine)?;
    } else if args.stage == Stage::All {
        eprintln!(
            "spec-train: reusing the features in {} (--regenerate to make new ones)",
            args.data_dir.display()
        );
    }
    if let Some(dir) = output_dir {
        train_head(args, &engine, &dir)?;
    }
    Ok(())
}

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
struct CalibrateArgs {
    /// EAGLE engine directory (spec-build --speculative_decoding_mode eagle).
    #[arg(long)]
    engine_dir: PathBuf,
    /// Prompts: ShareGPT JSON, GSM8K JSONL, MT-bench JSONL, or a list of strings.
    #[arg(long)]
    prompts: PathBuf,
    #[arg(long, default_value_t = 80)]
    num_prompts: usize,
    /// Longest prompt kept (tokens after the chat template); longer ones are skipped.
    #[arg(long, default_value_t = 256)]
    max_prompt_len: usize,
    /// Greedy answer tokens per prompt: the positions measured.
    #[arg(long, default_value_t = 128)]
    max_output_len: usize,
    /// Do not wrap prompts in the engine's chat template.
    #[arg(long)]
    no_chat: bool,
    /// Head candidates ranked per node (at most 10, spec-run's top-k).
    #[arg(long, default_value_t = calibrate::DEFAULT_TOP_K)]
    top_k: usize,
    /// Depths measured and deepest tree [default: 6, or the engine's num_eagle_layers if smaller].
    #[arg(long)]
    max_depth: Option<usize>,
    /// Draft nodes of the tree [default: 63, or the engine's max_draft_len if smaller].
    #[arg(long)]
    num_nodes: Option<usize>,
    /// The eagle_choices JSON to write (a .json file, replaced atomically).
    #[arg(long)]
    output: PathBuf,
    /// The measured statistics and expected lengths [default: <output>.stats.json].
    #[arg(long)]
    stats_output: Option<PathBuf>,
    /// cpu, or cuda:N (needs a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
}

fn run_calibrate(args: &CalibrateArgs) -> Result<()> {
    // spec-run reads a bare name as a preset name, so the tree file must look like a file.
    if args.output.extension().and_then(|e| e.to_str()) != Some("json") {
        bail!(
            "--output {}: must end in .json (spec-run --eagle_choices reads other names as preset names)",
            args.output.display()
        );
    }
    let stats = args
        .stats_output
        .clone()
        .unwrap_or_else(|| calibrate::default_stats_path(&args.output));
    if stats == args.output {
        bail!(
            "--stats_output {} is the --output file: give the statistics another name",
            stats.display()
        );
    }
    let engine = Engine::load(
        &args.engine_dir,
        &kestrel_runtime::device::parse(&args.device)?,
    )?;
    let Some(head) = engine.eagle.as_ref() else {
        bail!(
            "{} has no EAGLE head: calibrate an engine built with spec-build --speculative_decoding_mode eagle",
            args.engine_dir.display()
        );
    };
    let limits = calibrate::engine_tree_limits(&engine.plan.limits);
    let flags = calibrate::BudgetFlags {
        top_k: Some(args.top_k),
        max_depth: args.max_depth,
        num_nodes: args.num_nodes,
    };
    let budget = calibrate::TreeBudget::resolve(&flags, &limits)?;
    let codec = TextCodec::load(&args.engine_dir, &engine.config)?;
    let texts = read_prompts(&args.prompts)?;
    let opts = DistillOptions {
        num_prompts: args.num_prompts,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_output_len,
        chat: !args.no_chat,
        sampling: SamplingParams::greedy(),
    };
    let prompts = encode_prompts(&codec, &texts, &opts, engine.plan.limits.max_input_len)?;
    eprintln!(
        "spec-train: calibrating on {} prompts from {}: top {} per node, depth {}, {} nodes",
        prompts.len(),
        args.prompts.display(),
        budget.top_k,
        budget.max_depth,
        budget.num_nodes
    );
    let t0 = Instant::now();
    let seqs = distill(&engine, &prompts, &opts, &mut |done, total| {
        eprintln!(
            "spec-train: answered {done}/{total} [{:.0}s]",
            t0.elapsed().as_secs_f64()
        )
    })?;
    let table = calibrate::measure(
        &engine.model,
        head,
        &seqs,
        budget.top_k,
        budget.max_depth,
        engine.plan.limits.max_batch_size,
        &mut |done, total| {
            eprintln!(
                "spec-train: measured {done}/{total} [{:.0}s]",
                t0.elapsed().as_secs_f64()
            )
        },
    )?;
    let source = calibrate::CalibrationSource {
        engine_dir: args.engine_dir.display().to_string(),
        prompts_file: args.prompts.display().to_string(),
        chat_template: !args.no_chat,
        num_prompts: prompts.len(),
        max_output_len: args.max_output_len,
    };
    let name = args.output.display().to_string();
    let (choices, report) = calibrate::derive(&table, &budget, &limits, source, &name)?;
    calibrate::save(&args.output, &stats, &choices, &report)?;
    println!(
        "spec-train: {} positions in {} sequences; p(rank 0) per depth: {}",
        report.positions,
        report.sequences,
        report
            .p
            .iter()
            .map(|row| format!("{:.3}", row[0]))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for s in std::iter::once(&report.tree).chain(&report.presets) {
        let expected = s
            .expected_length
            .map_or_else(|| "n/a".to_string(), |e| format!("{e:.3}"));
        let mut notes: Vec<String> = s.note.iter().cloned().collect();
        if !s.fits_engine {
            notes.push("does not fit this engine".into());
        }
        println!(
            "spec-train: expected tokens per step {expected:>6} with {} ({} nodes, depth {}){}",
            s.name,
            s.nodes,
            s.depth,
            if notes.is_empty() {
                String::new()
            } else {
                format!(" [{}]", notes.join("; "))
            }
        );
    }
    println!(
        "spec-train: wrote {} ({} nodes; run it with spec-run --eagle_choices {}) and {}",
        args.output.display(),
        choices.len(),
        args.output.display(),
        stats.display()
    );
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Eagle(args) => run_eagle(args),
        Command::Calibrate(args) => run_calibrate(args),
    };
    exit_on_error("spec-train", result);
}

//! `spec-train`: trains drafts for Kestrel engines.
//!
//! `spec-train eagle` self-distils an EAGLE-1 head: the base engine answers prompts through
//! Kestrel's runtime (`--stage data`, cached in `--data_dir`), then a one-layer head learns to
//! predict the base model's next final-normed hidden state (`--stage train`, written to
//! `--output_dir` in the published EAGLE layout for `convert-checkpoint --eagle_model_dir`).
//!
//! `spec-train draft` distils a small draft model (the target's config with `--num_layers`
//! layers, started from a subset of the target's) on the same self-distillation data, with
//! KL to the target's distributions, into an HF model folder for
//! `convert-checkpoint --model_dir`.

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use kestrel::cli::exit_on_error;
use kestrel_core::checkpoint::{CHAT_TEMPLATE_FILE, TOKENIZER_FILE};
use kestrel_core::{DType, EnginePlan};
use kestrel_runtime::{Engine, TextCodec};
use kestrel_spec::SamplingParams;
use kestrel_train::common::{RankFiles, TRAIN_LOG_FILE};
use kestrel_train::dataset::FeatureDataset;
use kestrel_train::distill::{distill, encode_prompts, DistillOptions};
use kestrel_train::draft::{
    check_features, draft_config, initial_student, load_draft, resolve_init_layers, train_draft,
    DraftInit, DraftSaveOptions, DraftTrainConfig, DraftTrainer, DRAFT_WEIGHTS_FILE,
};
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
    /// Distil a small draft model (fewer layers of the target's shape) for draft-target
    /// decoding.
    Draft(Box<DraftArgs>),
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

    #[command(flatten)]
    data: DataArgs,

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

/// How the self-distillation data is made (shared by `eagle` and `draft`).
#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
struct DataArgs {
    /// Prompts: ShareGPT JSON, GSM8K JSONL, MT-bench JSONL, or a list of strings.
    #[arg(long)]
    prompts: Option<PathBuf>,
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
    /// Generate the data even if --data_dir already holds some (--stage all; draft).
    #[arg(long)]
    regenerate: bool,
}

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
struct DraftArgs {
    /// Target engine directory (spec-build output): gives the draft's config, its first
    /// weights, the tokenizer files, and answers the prompts if data must be made.
    #[arg(long)]
    engine_dir: PathBuf,
    /// Self-distillation data (as `spec-train eagle --stage data` writes it); made here with
    /// the data flags when the directory holds none.
    #[arg(long)]
    data_dir: PathBuf,
    /// Where the draft goes as an HF model folder (config.json, model.safetensors, tokenizer
    /// files, train_log.json), replaced atomically after every epoch.
    #[arg(long)]
    output_dir: PathBuf,
    #[command(flatten)]
    data: DataArgs,

    // --- the draft ---
    /// Decoder layers of the draft.
    #[arg(long, default_value_t = 4)]
    num_layers: usize,
    /// Target layers the draft's layers start from, comma-separated (default: evenly
    /// spaced, first and last included; 30 layers and 4 give 0,10,20,29).
    #[arg(long, value_delimiter = ',')]
    init_layers: Option<Vec<usize>>,
    /// Train the embedding (and an untied LM head) too; by default they stay the target's.
    #[arg(long)]
    train_embeddings: bool,

    // --- training ---
    /// Temperature of the KL term (the loss is T² · KL(p_T || q_T)).
    #[arg(long, default_value_t = 1.0)]
    kd_temperature: f64,
    /// Weight of the cross-entropy on the target's greedy tokens.
    #[arg(long, default_value_t = 0.0)]
    ce_weight: f64,
    /// Total epochs (with --resume, the run continues up to this many).
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    /// Peak AdamW learning rate (SmolLM2, 4 layers: 1e-3 beat 3e-4 on held-out agreement).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 10)]
    warmup_steps: usize,
    #[arg(long, default_value_t = 0.1)]
    min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.0)]
    weight_decay: f64,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch_size: usize,
    /// Longest training window in tokens; longer sequences keep their start.
    #[arg(long, default_value_t = 512)]
    max_len: usize,
    /// Held-out fraction of the sequences (validation: KL and greedy agreement).
    #[arg(long, default_value_t = 0.1)]
    val_fraction: f64,
    /// Rows per chunk of vocabulary-sized logits.
    #[arg(long, default_value_t = 256)]
    logits_chunk: usize,
    /// Dtype of the written weights.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    dtype: DType,
    /// cpu, or cuda:N (needs a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Continue the draft in --output_dir (its weights and train_log.json).
    #[arg(long)]
    resume: bool,
    /// Also write the training log here (it is always written into --output_dir).
    #[arg(long)]
    log_json: Option<PathBuf>,
    /// Seed of prompt sampling, shuffling and the split.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

/// Self-distillation data into `data_dir`: `engine` answers the prompts, then gives the
/// features.
fn generate_data(
    args: &DataArgs,
    engine_dir: &Path,
    data_dir: &Path,
    seed: u64,
    engine: &Engine,
) -> Result<()> {
    let prompts_file = args
        .prompts
        .as_ref()
        .context("--prompts FILE is needed to generate data (ShareGPT JSON, GSM8K JSONL, ...)")?;
    let codec = TextCodec::load(engine_dir, &engine.config)?;
    let texts = read_prompts(prompts_file)?;
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
    let prompts = encode_prompts(&codec, &texts, &opts, engine.plan.limits.max_input_len)?;
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    eprintln!(
        "spec-train: {} prompts ({prompt_tokens} tokens) from {} ({} read); answering up to {} tokens each",
        prompts.len(),
        prompts_file.display(),
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
        engine_dir: engine_dir.display().to_string(),
        prompts_file: prompts_file.display().to_string(),
        chat_template: !args.no_chat,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed,
        generate_s,
        features_s: t1.elapsed().as_secs_f64(),
    };
    data.save(data_dir, kestrel_model::candle_dtype(args.feature_dtype))?;
    eprintln!(
        "spec-train: wrote {} sequences ({} tokens, {} answer tokens) to {}",
        data.len(),
        data.tokens.len(),
        data.answer_tokens(),
        data_dir.display()
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
    let engine = Engine::load(&args.engine_dir, &kestrel_runtime::device::Device::Cpu)?;
    let have_data = FeatureDataset::exists(&args.data_dir);
    let make_data = match args.stage {
        Stage::Data => true,
        Stage::Train => false,
        Stage::All => args.data.regenerate || !have_data,
    };
    if make_data {
        generate_data(
            &args.data,
            &args.engine_dir,
            &args.data_dir,
            args.seed,
            &engine,
        )?;
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

fn run_draft(args: &DraftArgs) -> Result<()> {
    let device = kestrel_runtime::device::parse(&args.device)?;
    // The engine runs where it was built for (data generation, the feature check); the
    // draft trains on --device.
    let plan = EnginePlan::load(&args.engine_dir)?;
    let engine_device = if plan.target_device.starts_with("cuda") {
        device.clone()
    } else {
        kestrel_runtime::device::Device::Cpu
    };
    let engine = Engine::load(&args.engine_dir, &engine_device)?;
    let cfg = &engine.config;
    let init_layers = resolve_init_layers(
        cfg.num_hidden_layers,
        args.num_layers,
        args.init_layers.as_deref(),
    )?;
    let tcfg = DraftTrainConfig {
        epochs: args.epochs,
        lr: args.lr,
        warmup_steps: args.warmup_steps,
        min_lr_ratio: args.min_lr_ratio,
        weight_decay: args.weight_decay,
        grad_clip: args.grad_clip,
        batch_size: args.batch_size,
        max_len: args.max_len,
        kd_temperature: args.kd_temperature,
        ce_weight: args.ce_weight,
        train_embeddings: args.train_embeddings,
        logits_chunk: args.logits_chunk,
        seed: args.seed,
        ..DraftTrainConfig::default()
    };
    tcfg.validate()?;
    let resume = if args.resume {
        let dir = &args.output_dir;
        if !dir.join(DRAFT_WEIGHTS_FILE).is_file() {
            bail!(
                "--resume: {} holds no draft (config.json, model.safetensors): drop --resume to start one",
                dir.display()
            );
        }
        let (rcfg, tensors, log) = load_draft(dir)?;
        let want = draft_config(cfg, args.num_layers);
        if rcfg != want {
            bail!(
                "--resume: the draft in {} is not a {}-layer draft of {}: pass its --num_layers or another --output_dir",
                dir.display(),
                args.num_layers,
                args.engine_dir.display()
            );
        }
        let log = log.with_context(|| {
            format!(
                "--resume: {} has no {TRAIN_LOG_FILE}: cannot tell where training stopped",
                dir.display()
            )
        })?;
        Some((tensors, log))
    } else {
        None
    };

    if args.data.regenerate || !FeatureDataset::exists(&args.data_dir) {
        generate_data(
            &args.data,
            &args.engine_dir,
            &args.data_dir,
            args.seed,
            &engine,
        )?;
    } else {
        eprintln!(
            "spec-train: reusing the data in {} (--regenerate to make new)",
            args.data_dir.display()
        );
    }
    let data = FeatureDataset::load(&args.data_dir)?;
    if data.hidden_size != cfg.hidden_size || data.vocab_size != cfg.vocab_size {
        bail!(
            "{}: the data was made for hidden_size {} / vocab {}, but {} has {} / {}: regenerate the data for this engine",
            args.data_dir.display(),
            data.hidden_size,
            data.vocab_size,
            args.engine_dir.display(),
            cfg.hidden_size,
            cfg.vocab_size
        );
    }
    // The targets are the cached features through the LM head: they must be this engine's.
    let rel = check_features(&engine.model, &data)?;
    if rel > 0.05 {
        bail!(
            "{}: the cached features differ from what {} computes (largest difference {:.1}% of the largest feature): the data was made by another model; regenerate it with --regenerate",
            args.data_dir.display(),
            args.engine_dir.display(),
            rel * 100.0
        );
    }

    let (initial, init_name, prior) = match resume {
        Some((tensors, log)) => (
            DraftInit::Tensors(tensors),
            format!("resume {}", args.output_dir.display()),
            Some(log),
        ),
        None => (
            DraftInit::TargetLayers(init_layers.clone()),
            format!("target layers {init_layers:?}"),
            None,
        ),
    };
    let rank_files: Vec<PathBuf> = engine
        .plan
        .weights
        .iter()
        .map(|w| args.engine_dir.join(&w.file))
        .collect();
    let target = RankFiles::open(cfg, engine.plan.mapping, &rank_files)?;
    let student = initial_student(cfg, &target, args.num_layers, initial)?;
    let draft_cfg = draft_config(cfg, args.num_layers);
    let mut trainer = DraftTrainer::new(draft_cfg, student, tcfg.clone(), &device)?;
    let (train_idx, val_idx) = split(data.len(), args.val_fraction, args.seed);
    eprintln!(
        "spec-train: {}-layer draft ({} trained parameters, init {init_name}); {} train / {} held-out sequences ({} answer tokens in all), {} epochs of {} steps",
        args.num_layers,
        trainer.num_trainable(),
        train_idx.len(),
        val_idx.len(),
        data.answer_tokens(),
        tcfg.epochs,
        train_idx.len().div_ceil(tcfg.batch_size)
    );
    let copy_files: Vec<PathBuf> = [TOKENIZER_FILE, CHAT_TEMPLATE_FILE]
        .iter()
        .map(|f| args.engine_dir.join(f))
        .filter(|p| p.is_file())
        .collect();
    let save = DraftSaveOptions {
        output_dir: &args.output_dir,
        dtype: kestrel_model::candle_dtype(args.dtype),
        copy_files,
    };
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let log = train_draft(
        &mut trainer,
        &data,
        &train_idx,
        &val_idx,
        &init_name,
        Some(command),
        prior,
        Some(&save),
        &mut |line| eprintln!("spec-train: {line}"),
    )?;
    if let Some(path) = &args.log_json {
        std::fs::write(path, serde_json::to_string_pretty(&log)?)
            .with_context(|| format!("--log_json {}: cannot write it", path.display()))?;
    }
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Eagle(args) => run_eagle(args),
        Command::Draft(args) => run_draft(args),
    };
    exit_on_error("spec-train", result);
}

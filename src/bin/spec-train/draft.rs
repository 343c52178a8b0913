//! `spec-train draft`: a few-layer draft model distilled from the target's distributions.

use crate::data::{generate_data, DataArgs};
use crate::parse_dtype;
use crate::train_args::{check_data_shapes, TrainArgs};
use anyhow::{bail, Context, Result};
use kestrel_core::checkpoint::{CHAT_TEMPLATE_FILE, TOKENIZER_FILE};
use kestrel_core::{DType, EnginePlan};
use kestrel_runtime::Engine;
use kestrel_train::common::{RankFiles, TRAIN_LOG_FILE};
use kestrel_train::dataset::FeatureDataset;
use kestrel_train::draft::{
    check_features, draft_config, initial_student, load_draft, resolve_init_layers, train_draft,
    DraftInit, DraftSaveOptions, DraftTrainConfig, DraftTrainer, DRAFT_WEIGHTS_FILE,
};
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct DraftArgs {
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
    /// Peak AdamW learning rate (SmolLM2, 4 layers: 1e-3 beat 3e-4 on held-out agreement).
    #[arg(long, default_value_t = 1e-3)]
    lr: f64,
    #[arg(long, default_value_t = 10)]
    warmup_steps: usize,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 1.0)]
    grad_clip: f64,
    /// Dtype of the written weights.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    dtype: DType,
    /// cpu, or cuda:N (needs a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Continue the draft in --output_dir (its weights and train_log.json).
    #[arg(long)]
    resume: bool,
    #[command(flatten)]
    train: TrainArgs,
}

pub fn run_draft(args: &DraftArgs) -> Result<()> {
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
        recipe: args
            .train
            .recipe(args.lr, args.warmup_steps, args.grad_clip),
        max_len: args.train.max_len,
        kd_temperature: args.kd_temperature,
        ce_weight: args.ce_weight,
        train_embeddings: args.train_embeddings,
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
            args.train.seed,
            &engine,
        )?;
    } else {
        eprintln!(
            "spec-train: reusing the data in {} (--regenerate to make new)",
            args.data_dir.display()
        );
    }
    let data = FeatureDataset::load(&args.data_dir)?;
    check_data_shapes(&data, cfg, &args.data_dir, &args.engine_dir, "data was")?;
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
    let (train_idx, val_idx) = args.train.split(data.len());
    args.train.check_held_out(&val_idx, data.len())?;
    eprintln!(
        "spec-train: {}-layer draft ({} trained parameters, init {init_name}); {} train / {} held-out sequences ({} answer tokens in all), {} epochs of {} steps",
        args.num_layers,
        trainer.num_trainable(),
        train_idx.len(),
        val_idx.len(),
        data.answer_tokens(),
        tcfg.recipe.epochs,
        train_idx.len().div_ceil(tcfg.recipe.batch_size)
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
    args.train.write_log(&log)
}

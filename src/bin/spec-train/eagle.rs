//! `spec-train eagle`: data, then an EAGLE-1 head (optionally reading several base layers)
//! trained on the frozen base's features.

use crate::data::{generate_data, DataArgs};
use crate::parse_dtype;
use crate::train_args::{check_data_shapes, TrainArgs};
use anyhow::{bail, Result};
use clap::ValueEnum;
use kestrel_core::DType;
use kestrel_runtime::Engine;
use kestrel_train::dataset::FeatureDataset;
use kestrel_train::eagle::{
    deepen_head, head_config, load_head, train, EagleTrainer, FrozenBase, HeadInit, SaveOptions,
    TrainConfig,
};
use std::path::{Path, PathBuf};

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
    /// The base model's last decoder layers (one per head layer), fc = [0 | I] (feature
    /// passthrough).
    Copy,
    /// Random weights.
    Random,
}

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct EagleArgs {
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

    #[command(flatten)]
    data: DataArgs,

    // --- training ---
    #[arg(long, default_value_t = 5e-4)]
    lr: f64,
    #[arg(long, default_value_t = 20)]
    warmup_steps: usize,
    /// Global gradient-norm clip (0 = off).
    #[arg(long, default_value_t = 0.5)]
    grad_clip: f64,
    /// Input features get uniform noise in [-noise, noise].
    #[arg(long, default_value_t = 0.1)]
    noise: f32,
    /// Weight of the distribution (cross-entropy) term.
    #[arg(long, default_value_t = 0.1)]
    ce_weight: f64,
    /// Weight of the feature-regression (SmoothL1) term; 0 with --ce_weight 1 is EAGLE-3's
    /// token-only loss.
    #[arg(long, default_value_t = 1.0)]
    feature_weight: f64,
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
    /// Decoder layers of the head (EAGLE's is 1; not convert-checkpoint's --num_eagle_layers,
    /// the draft tree's depth). With --resume, a shallower head grows to this many: each new
    /// layer starts as a copy of a base layer whose outputs are zeroed, so training starts
    /// exactly where the resumed head stopped. Default: 1, or the resumed head's own.
    #[arg(long)]
    head_layers: Option<usize>,
    /// Dtype of the written head.
    #[arg(long, default_value = "float16", value_parser = parse_dtype)]
    save_dtype: DType,
    /// Training-time test (HASS): passes of the unroll in which the head is fed its own
    /// predicted features, as draft depths 2..K are at inference (1 = real features only).
    #[arg(long, default_value_t = 1)]
    ttt_steps: usize,
    /// Loss weight of unroll pass k is ttt_decay^(k-1).
    #[arg(long, default_value_t = 1.0)]
    ttt_decay: f64,
    /// Base layers the head reads besides the final feature (EAGLE-3's multi-layer
    /// features): a subset of the cache's --feature_layers, comma-separated; the flag alone
    /// means none (the final feature only). Default: a resumed head's layers, else every
    /// layer the cache holds.
    #[arg(long, value_delimiter = ',', num_args = 0..)]
    head_feature_layers: Option<Vec<usize>>,
    /// Draft depths whose held-out top-1 is logged (at least --ttt_steps).
    #[arg(long, default_value_t = 3)]
    eval_steps: usize,
    #[command(flatten)]
    train: TrainArgs,
}

/// The training recipe the flags ask for.
fn train_config(args: &EagleArgs) -> TrainConfig {
    TrainConfig {
        recipe: args
            .train
            .recipe(args.lr, args.warmup_steps, args.grad_clip),
        max_len: args.train.max_len,
        noise: args.noise,
        ce_weight: args.ce_weight,
        feature_weight: args.feature_weight,
        ttt_steps: args.ttt_steps,
        ttt_decay: args.ttt_decay,
        eval_steps: args.eval_steps,
    }
}

fn train_head(args: &EagleArgs, engine: &Engine, output_dir: &Path) -> Result<()> {
    let data = FeatureDataset::load(&args.data_dir)?;
    let cfg = &engine.config;
    check_data_shapes(
        &data,
        cfg,
        &args.data_dir,
        &args.engine_dir,
        "features were",
    )?;
    let rank_files: Vec<PathBuf> = engine
        .plan
        .weights
        .iter()
        .map(|w| args.engine_dir.join(&w.file))
        .collect();
    if !args.data.feature_layers.is_empty() && args.data.feature_layers != data.feature_layers {
        bail!(
            "{}: the feature cache holds base layers {:?} but --feature_layers asks for {:?}: regenerate the data (--regenerate)",
            args.data_dir.display(),
            data.feature_layers,
            args.data.feature_layers
        );
    }
    let resumed = match &args.resume {
        Some(dir) => Some((dir, load_head(dir)?)),
        None => None,
    };
    let resumed_layers = resumed
        .as_ref()
        .map(|(_, (hc, _))| hc.llama.num_hidden_layers);
    let head_layers = args.head_layers.or(resumed_layers).unwrap_or(1);
    if head_layers == 0 || head_layers > cfg.num_hidden_layers {
        bail!(
            "--head_layers {head_layers}: a head has 1 to {} layers (the base's)",
            cfg.num_hidden_layers
        );
    }
    if let Some((dir, (hc, _))) = &resumed {
        let from = hc.llama.num_hidden_layers;
        if head_layers < from {
            bail!(
                "{}: the head has {from} layers, --head_layers {head_layers} would drop some",
                dir.display()
            );
        }
    }
    let base =
        FrozenBase::from_rank_files(&engine.model, engine.plan.mapping, &rank_files, head_layers)?;
    let (mut head_cfg, init, init_name) = match resumed {
        Some((dir, (mut hc, mut tensors))) => {
            if let Some(asked) = args
                .head_feature_layers
                .as_ref()
                .filter(|l| !hc.feature_layers.is_empty() && **l != hc.feature_layers)
            {
                bail!(
                    "{}: the head reads base layers {:?}, --head_feature_layers asks for {asked:?}",
                    dir.display(),
                    hc.feature_layers,
                );
            }
            let from = hc.llama.num_hidden_layers;
            hc.llama.num_hidden_layers = head_layers;
            deepen_head(&mut tensors, from, &hc, &base)?;
            let grown = if from < head_layers {
                format!(", grown from {from} to {head_layers} layers")
            } else {
                String::new()
            };
            (
                hc,
                HeadInit::Tensors(tensors),
                format!("resume {}{grown}", dir.display()),
            )
        }
        None => {
            let hc = head_config(cfg, !args.no_bias, head_layers);
            match args.init {
                Init::Copy => (
                    hc,
                    HeadInit::CopyTopLayers {
                        out_scale: args.out_scale,
                    },
                    format!(
                        "copy of the base's top {head_layers} layer(s) (out_scale {})",
                        args.out_scale
                    ),
                ),
                Init::Random => (
                    hc,
                    HeadInit::Random {
                        seed: args.train.seed,
                    },
                    "random".to_string(),
                ),
            }
        }
    };
    // The layers the head reads: as asked, else a resumed head's own, else all the cache
    // holds. A head without them before (EAGLE-1, or copied) gains a `fuse` that starts on
    // the final feature alone.
    let layers = match &args.head_feature_layers {
        Some(asked) => asked.clone(),
        None if !head_cfg.feature_layers.is_empty() => head_cfg.feature_layers.clone(),
        None => data.feature_layers.clone(),
    };
    let data = if layers == data.feature_layers {
        data
    } else {
        data.select_layers(&layers)
            .map_err(|e| anyhow::anyhow!("{}: {e}", args.data_dir.display()))?
    };
    head_cfg.feature_layers = layers;
    let tcfg = train_config(args);
    let (train_idx, val_idx) = args.train.split(data.len());
    args.train.check_held_out(&val_idx, data.len())?;
    eprintln!(
        "spec-train: {} train / {} held-out sequences ({} answer tokens in all), {} epochs of {} steps, init {init_name}",
        train_idx.len(),
        val_idx.len(),
        data.answer_tokens(),
        tcfg.recipe.epochs,
        train_idx.len().div_ceil(tcfg.recipe.batch_size)
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
    args.train.write_log(&log)
}

pub fn run_eagle(args: &EagleArgs) -> Result<()> {
    let output_dir = match (args.stage, &args.output_dir) {
        (Stage::Data, _) => None,
        (_, Some(dir)) => Some(dir.clone()),
        (_, None) => bail!("--output_dir is needed to train (or pass --stage data)"),
    };
    if output_dir.is_some() {
        // Before the data stage, which can take hours: a recipe that cannot train fails now.
        train_config(args).validate()?;
    }
    let device = kestrel_runtime::device::parse(&args.device)?;
    let engine = Engine::load(&args.engine_dir, &device)?;
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
            args.train.seed,
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

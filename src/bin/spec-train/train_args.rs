//! Training flags that `spec-train eagle` and `spec-train draft` share (the ones whose
//! defaults differ, --lr, --warmup_steps, --grad_clip and --ce_weight, stay with each
//! subcommand), and what both do with the data and the training log.

use anyhow::{bail, Context, Result};
use kestrel_core::ModelConfig;
use kestrel_train::common::{split, Recipe};
use kestrel_train::dataset::FeatureDataset;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct TrainArgs {
    /// Total epochs (draft: with --resume, the run continues up to this many).
    #[arg(long, default_value_t = 4)]
    pub epochs: usize,
    #[arg(long, default_value_t = 0.1)]
    pub min_lr_ratio: f64,
    #[arg(long, default_value_t = 0.0)]
    pub weight_decay: f64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Longest training window: in tokens for a draft (longer sequences keep their start),
    /// in head positions for an EAGLE head (longer sequences keep their end).
    #[arg(long, default_value_t = 512)]
    pub max_len: usize,
    /// Held-out fraction of the sequences (validation: a draft's KL and greedy agreement, an
    /// EAGLE head's loss and top-1 proxy).
    #[arg(long, default_value_t = 0.1)]
    pub val_fraction: f64,
    /// Rows per chunk of vocabulary-sized logits.
    #[arg(long, default_value_t = 256)]
    pub logits_chunk: usize,
    /// Also write the training log here (it is always written into --output_dir).
    #[arg(long)]
    pub log_json: Option<PathBuf>,
    /// Seed of prompt sampling, shuffling, the split (and an EAGLE head's feature noise).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the epoch with the best held-out score instead of the last one, the starting
    /// weights counting as epoch 0 (a resumed draft's: the epoch they are), so a fine-tune
    /// that drifts cannot leave worse weights than it started from. The score: an EAGLE
    /// head's chain score p1 + p1·p2 + … over the --eval_steps depths' top-1; a draft's
    /// greedy agreement.
    #[arg(long)]
    pub keep_best: bool,
    /// With --keep_best: stop once this many epochs in a row have not beaten the best.
    #[arg(long)]
    pub early_stop: Option<usize>,
}

impl TrainArgs {
    /// The shared part of a trainer's recipe from these flags and the subcommand's own
    /// (`lr`, `warmup_steps`, `grad_clip`); AdamW's betas as [`Recipe::new`] sets them.
    pub fn recipe(&self, lr: f64, warmup_steps: usize, grad_clip: f64) -> Recipe {
        Recipe {
            epochs: self.epochs,
            min_lr_ratio: self.min_lr_ratio,
            weight_decay: self.weight_decay,
            batch_size: self.batch_size,
            logits_chunk: self.logits_chunk,
            seed: self.seed,
            keep_best: self.keep_best,
            early_stop: self.early_stop,
            ..Recipe::new(lr, warmup_steps, grad_clip)
        }
    }

    /// Refuses --keep_best when the split of `n` sequences held out none (`val`).
    pub fn check_held_out(&self, val: &[usize], n: usize) -> Result<()> {
        if self.keep_best && val.is_empty() {
            bail!(
                "--keep_best compares epochs on held-out sequences, but --val_fraction {} holds out none of the {n} sequences",
                self.val_fraction
            );
        }
        Ok(())
    }

    /// The (train, held-out) split of `n` sequences.
    pub fn split(&self, n: usize) -> (Vec<usize>, Vec<usize>) {
        split(n, self.val_fraction, self.seed)
    }

    /// Writes the training log to --log_json, when given.
    pub fn write_log(&self, log: &impl Serialize) -> Result<()> {
        if let Some(path) = &self.log_json {
            std::fs::write(path, serde_json::to_string_pretty(log)?)
                .with_context(|| format!("--log_json {}: cannot write it", path.display()))?;
        }
        Ok(())
    }
}

/// Refuses data made for another model's shapes; `made` names it in the message ("data
/// was", "features were").
pub fn check_data_shapes(
    data: &FeatureDataset,
    cfg: &ModelConfig,
    data_dir: &Path,
    engine_dir: &Path,
    made: &str,
) -> Result<()> {
    if data.hidden_size != cfg.hidden_size || data.vocab_size != cfg.vocab_size {
        bail!(
            "{}: the {made} made for hidden_size {} / vocab {}, but {} has {} / {}: regenerate the data for this engine",
            data_dir.display(),
            data.hidden_size,
            data.vocab_size,
            engine_dir.display(),
            cfg.hidden_size,
            cfg.vocab_size
        );
    }
    Ok(())
}

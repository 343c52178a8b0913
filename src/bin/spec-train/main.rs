//! `spec-train`: trains drafts for Kestrel engines.
//!
//! `spec-train eagle` self-distils an EAGLE-1 head: the base engine answers prompts through
//! Kestrel's runtime (`--stage data`, cached in `--data_dir`), then a head (one decoder layer
//! by default, `--head_layers`) learns to predict the base model's next final-normed hidden
//! state (`--stage train`, written to `--output_dir` in the published EAGLE layout for
//! `convert-checkpoint --eagle_model_dir`).
//!
//! `spec-train draft` distils a small draft model (the target's config with `--num_layers`
//! layers, started from a subset of the target's) on the same self-distillation data, with
//! KL to the target's distributions, into an HF model folder for
//! `convert-checkpoint --model_dir`.
//!
//! `spec-train calibrate` measures an EAGLE engine's head per tree depth and rank on a prompt
//! set and writes the static eagle_choices tree with the best expected accepted length for a
//! node budget, a file that `spec-run --eagle_choices` takes.
//!
//! `spec-train draft-vocab` ranks the vocabulary by the self-distillation answers into a
//! head folder's `draft_vocab.json`, for `--eagle_draft_vocab N`.
//!
//! `spec-train ngram-corpus` gathers the model's answers into the n-gram corpus that backs
//! prompt lookup (`spec-run --prompt_lookup_corpus`).

mod calibrate;
mod data;
mod draft;
mod draft_vocab;
mod eagle;
mod ngram_corpus;
mod train_args;

use clap::{Parser, Subcommand};
use kestrel::cli::exit_on_error;
use kestrel_core::DType;

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
    Eagle(Box<eagle::EagleArgs>),
    /// Distil a small draft model (fewer layers of the target's shape) for draft-target
    /// decoding.
    Draft(Box<draft::DraftArgs>),
    /// Derive the best static eagle_choices tree for an EAGLE engine from measured acceptance.
    Calibrate(Box<calibrate::CalibrateArgs>),
    /// Rank the vocabulary by the self-distillation answers, for --eagle_draft_vocab N.
    DraftVocab(Box<draft_vocab::DraftVocabArgs>),
    /// Gather the model's answers into the n-gram corpus of --prompt_lookup_corpus.
    NgramCorpus(Box<ngram_corpus::NgramCorpusArgs>),
}

fn parse_dtype(s: &str) -> Result<DType, String> {
    s.parse()
}

fn main() {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Eagle(args) => eagle::run_eagle(args),
        Command::Draft(args) => draft::run_draft(args),
        Command::Calibrate(args) => calibrate::run_calibrate(args),
        Command::DraftVocab(args) => draft_vocab::run_draft_vocab(args),
        Command::NgramCorpus(args) => ngram_corpus::run_ngram_corpus(args),
    };
    exit_on_error("spec-train", result);
}

//! `spec-train draft-vocab`: ranks the vocabulary by how often the base model says each token
//! in the self-distillation answers, into `<output_dir>/draft_vocab.json` (a head folder), so
//! that `--eagle_draft_vocab N` drafts from the N most frequent tokens.

use anyhow::{Context, Result};
use kestrel_core::draft_vocab::{DraftVocabRanking, DRAFT_VOCAB_FILE};
use kestrel_train::FeatureDataset;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct DraftVocabArgs {
    /// Self-distillation data (`spec-train eagle --stage data`): its answer tokens are counted.
    #[arg(long)]
    data_dir: PathBuf,
    /// Where draft_vocab.json goes: the EAGLE head's folder, which convert-checkpoint
    /// --eagle_model_dir reads it from.
    #[arg(long)]
    output_dir: PathBuf,
}

pub fn run_draft_vocab(args: &DraftVocabArgs) -> Result<()> {
    if !args.output_dir.is_dir() {
        anyhow::bail!(
            "--output_dir {}: no such folder (give the EAGLE head's folder)",
            args.output_dir.display()
        );
    }
    let data = FeatureDataset::load(&args.data_dir)?;
    let ranking = DraftVocabRanking::from_counts(&data.answer_token_counts()?);
    if ranking.counted_tokens == 0 {
        anyhow::bail!(
            "{}: the data holds no answer tokens to count",
            args.data_dir.display()
        );
    }
    let path = args.output_dir.join(DRAFT_VOCAB_FILE);
    ranking
        .save(&path)
        .with_context(|| format!("cannot write {}", path.display()))?;
    let said = ranking.counts.iter().filter(|&&c| c > 0).count();
    let coverage: Vec<String> = [1024, 2048, 4096, 8192, 16384]
        .iter()
        .filter(|&&n| n < ranking.ids.len())
        .map(|&n| {
            let covered: u64 = ranking.counts[..n].iter().sum();
            format!(
                "{n}: {:.1}%",
                100.0 * covered as f64 / ranking.counted_tokens as f64
            )
        })
        .collect();
    eprintln!(
        "spec-train: ranked {} tokens by {} answer tokens ({said} distinct) into {}; the N most frequent cover {}",
        ranking.ids.len(),
        ranking.counted_tokens,
        path.display(),
        coverage.join(", ")
    );
    Ok(())
}

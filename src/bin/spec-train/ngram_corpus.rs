//! `spec-train ngram-corpus`: the model's own answers as the n-gram corpus of prompt lookup
//! (`spec-run --prompt_lookup_corpus`), from spec-run reports (`--output_json`: each prompt's
//! ids and the answer's) or from self-distillation data (`spec-train eagle --stage data`).

use anyhow::{bail, Context, Result};
use kestrel_runtime::ngram_corpus::{load_ngram_corpus, write_ngram_corpus};
use kestrel_train::FeatureDataset;
use std::path::PathBuf;

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct NgramCorpusArgs {
    /// spec-run reports (`--output_json`) of the target answering prompts (repeatable).
    #[arg(long)]
    from_outputs: Vec<PathBuf>,
    /// Self-distillation data (`spec-train eagle --stage data`, `--data_dir`).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// The corpus file to write (safetensors).
    #[arg(long)]
    output: PathBuf,
}

pub fn run_ngram_corpus(args: &NgramCorpusArgs) -> Result<()> {
    if args.from_outputs.is_empty() && args.data_dir.is_none() {
        bail!("no answers to read: give --from_outputs REPORT.json (repeatable) or --data_dir DIR");
    }
    let mut sequences: Vec<Vec<u32>> = Vec::new();
    for path in &args.from_outputs {
        sequences.extend(report_sequences(path)?);
    }
    if let Some(dir) = &args.data_dir {
        let data = FeatureDataset::load(dir)?;
        sequences.extend((0..data.len()).map(|i| data.seq_tokens(i).to_vec()));
    }
    let tokens: usize = sequences.iter().map(Vec::len).sum();
    if tokens == 0 {
        bail!("the inputs hold no tokens");
    }
    write_ngram_corpus(&args.output, &sequences)?;
    // Read back through the loader, as spec-run will: the file is known to load.
    let vocab = sequences
        .iter()
        .flatten()
        .max()
        .map_or(0, |&m| m as usize + 1);
    load_ngram_corpus(&args.output, vocab)?;
    eprintln!(
        "spec-train: wrote {} sequences, {tokens} tokens, to {}",
        sequences.len(),
        args.output.display()
    );
    Ok(())
}

/// Each output's prompt ids followed by its answer ids.
fn report_sequences(path: &PathBuf) -> Result<Vec<Vec<u32>>> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("{shown}: cannot read it"))?;
    let doc: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{shown}: not JSON"))?;
    let outputs = doc["outputs"].as_array().with_context(|| {
        format!("{shown}: no \"outputs\" list: not a spec-run --output_json report")
    })?;
    outputs
        .iter()
        .enumerate()
        .map(|(i, o)| {
            let ids = |key: &str| -> Result<Vec<u32>> {
                serde_json::from_value(o[key].clone())
                    .with_context(|| format!("{shown}: output {i} has no list of ids \"{key}\""))
            };
            Ok([ids("input_ids")?, ids("output_ids")?].concat())
        })
        .collect()
}

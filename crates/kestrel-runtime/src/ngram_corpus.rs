//! The n-gram corpus file of prompt lookup (`--prompt_lookup_corpus`): token ids of the
//! target's answers (with their prompts) to other requests, from which the n-gram model
//! ([`kestrel_spec::NgramCorpus`]) is built when the file is loaded.
//!
//! A safetensors file with two u32 tensors: `tokens`, every sequence's ids back to back, and
//! `lengths`, each sequence's length. Written by `spec-train ngram-corpus` from spec-run
//! reports.

use crate::error::{Result, RuntimeError};
use candle_core::{Device, Tensor};
use kestrel_spec::NgramCorpus;
use std::collections::HashMap;
use std::path::Path;

const TOKENS: &str = "tokens";
const LENGTHS: &str = "lengths";

/// The n-gram model of the corpus file at `path`, whose ids must be below `vocab_size`.
pub fn load_ngram_corpus(path: &Path, vocab_size: usize) -> Result<NgramCorpus> {
    let shown = path.display();
    let bad = |what: String| RuntimeError::InvalidRequest(format!("{shown}: {what}"));
    let tensors = candle_core::safetensors::load(path, &Device::Cpu)
        .map_err(|e| bad(format!("not an n-gram corpus file ({})", first_line(&e))))?;
    let ids = |name: &str| -> Result<Vec<u32>> {
        let t = tensors
            .get(name)
            .ok_or_else(|| bad(format!("no `{name}` tensor: not an n-gram corpus file")))?;
        t.to_vec1::<u32>()
            .map_err(|_| bad(format!("`{name}` must be a vector of u32")))
    };
    let (tokens, lengths) = (ids(TOKENS)?, ids(LENGTHS)?);
    let total: u64 = lengths.iter().map(|&l| u64::from(l)).sum();
    if total != tokens.len() as u64 {
        return Err(bad(format!(
            "the sequence lengths add up to {total}, but it holds {} tokens",
            tokens.len()
        )));
    }
    if let Some(&id) = tokens.iter().find(|&&t| t as usize >= vocab_size) {
        return Err(bad(format!(
            "token id {id} is outside the engine's vocabulary of {vocab_size}: the corpus was made with another model"
        )));
    }
    let mut sequences = Vec::with_capacity(lengths.len());
    let mut at = 0;
    for &l in &lengths {
        sequences.push(&tokens[at..at + l as usize]);
        at += l as usize;
    }
    Ok(NgramCorpus::build(sequences.iter().copied()))
}

/// Writes `sequences` as a corpus file at `path`, atomically (a temporary file renamed).
pub fn write_ngram_corpus(path: &Path, sequences: &[Vec<u32>]) -> Result<()> {
    let tokens: Vec<u32> = sequences.concat();
    let lengths: Vec<u32> = sequences.iter().map(|s| s.len() as u32).collect();
    let tensors: HashMap<String, Tensor> = [
        (TOKENS.to_string(), Tensor::new(tokens, &Device::Cpu)?),
        (LENGTHS.to_string(), Tensor::new(lengths, &Device::Cpu)?),
    ]
    .into_iter()
    .collect();
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    let written = candle_core::safetensors::save(&tensors, &tmp)
        .map_err(RuntimeError::from)
        .and_then(|()| {
            std::fs::rename(&tmp, path).map_err(|e| {
                RuntimeError::InvalidRequest(format!("{}: cannot write it ({e})", path.display()))
            })
        });
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

fn first_line(e: &candle_core::Error) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_written_corpus_loads_into_its_ngram_model() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.safetensors");
        write_ngram_corpus(&path, &[vec![1, 2, 3], vec![4, 2, 5, 2, 5]]).unwrap();
        assert!(!dir.path().join("corpus.safetensors.tmp").exists());
        let corpus = load_ngram_corpus(&path, 6).unwrap();
        assert_eq!(corpus.tokens(), 8);
        assert_eq!(corpus.next(&[2]), Some(5));
        assert_eq!(corpus.next(&[1, 2]), Some(3));
        // 3 ends the first sequence: 3 → 4 is not an n-gram of the corpus.
        assert_eq!(corpus.next(&[3]), None);
    }

    #[test]
    fn a_bad_corpus_is_refused_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("corpus.safetensors");
        write_ngram_corpus(&path, &[vec![1, 2, 9]]).unwrap();
        assert_eq!(
            load_ngram_corpus(&path, 6).unwrap_err().to_string(),
            format!(
                "{}: token id 9 is outside the engine's vocabulary of 6: the corpus was made with another model",
                path.display()
            )
        );
        std::fs::write(&path, b"not safetensors").unwrap();
        let err = load_ngram_corpus(&path, 6).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("{}: not an n-gram corpus file (", path.display())),
            "{err}"
        );
        let missing = dir.path().join("weights.safetensors");
        let t: HashMap<String, Tensor> =
            [("w".to_string(), Tensor::new(&[1u32], &Device::Cpu).unwrap())].into();
        candle_core::safetensors::save(&t, &missing).unwrap();
        assert_eq!(
            load_ngram_corpus(&missing, 6).unwrap_err().to_string(),
            format!(
                "{}: no `tokens` tensor: not an n-gram corpus file",
                missing.display()
            )
        );
    }
}

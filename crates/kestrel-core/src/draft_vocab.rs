//! A draft vocabulary ranking (`draft_vocab.json`): every token id of a model, most frequent
//! first in the answers a head was trained on. `spec-train draft-vocab` writes it into a head
//! folder, `convert-checkpoint` and `spec-build` carry it along, and `--eagle_draft_vocab N`
//! then drafts from its first N ids (as FR-Spec and EAGLE-3's reduced draft vocabulary do)
//! instead of the first N ids of the tokenizer.

use crate::error::{CoreError, Result};
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const DRAFT_VOCAB_FILE: &str = "draft_vocab.json";
pub const DRAFT_VOCAB_FORMAT: &str = "kestrel-draft-vocab";
pub const DRAFT_VOCAB_VERSION: u32 = 1;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DraftVocabRanking {
    pub format: String,
    pub version: u32,
    /// Tokens counted (answer tokens of the data set).
    pub counted_tokens: u64,
    /// Every id of the vocabulary once: by count, highest first, then by id.
    pub ids: Vec<u32>,
    /// The count of each id in `ids`, in the same order.
    pub counts: Vec<u64>,
}

impl DraftVocabRanking {
    /// The ranking of token counts indexed by id (`counts.len()` is the vocabulary size).
    pub fn from_counts(counts: &[u64]) -> Self {
        let mut ids: Vec<u32> = (0..counts.len() as u32).collect();
        ids.sort_by(|&a, &b| counts[b as usize].cmp(&counts[a as usize]).then(a.cmp(&b)));
        DraftVocabRanking {
            format: DRAFT_VOCAB_FORMAT.into(),
            version: DRAFT_VOCAB_VERSION,
            counted_tokens: counts.iter().sum(),
            counts: ids.iter().map(|&i| counts[i as usize]).collect(),
            ids,
        }
    }

    /// Reads `path` and checks it ranks exactly the ids of a `vocab_size`-token vocabulary.
    pub fn load(path: &Path, vocab_size: usize) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| CoreError::Io {
            path: path.display().to_string(),
            source,
        })?;
        let ranking: DraftVocabRanking =
            serde_json::from_str(&text).map_err(|source| CoreError::Json {
                path: path.display().to_string(),
                source,
            })?;
        ranking
            .validate(vocab_size)
            .map_err(|message| CoreError::InvalidPlan {
                path: path.display().to_string(),
                message,
            })?;
        Ok(ranking)
    }

    fn validate(&self, vocab_size: usize) -> std::result::Result<(), String> {
        if self.format != DRAFT_VOCAB_FORMAT || self.version != DRAFT_VOCAB_VERSION {
            return Err(format!(
                "not a draft vocabulary ranking (format {:?} version {}; expected {DRAFT_VOCAB_FORMAT:?} version {DRAFT_VOCAB_VERSION}): write it with spec-train draft-vocab",
                self.format, self.version
            ));
        }
        if self.ids.len() != vocab_size || self.counts.len() != vocab_size {
            return Err(format!(
                "ranks {} ids with {} counts, but the model's vocabulary has {vocab_size} tokens: it was made for another model",
                self.ids.len(),
                self.counts.len()
            ));
        }
        let mut seen = vec![false; vocab_size];
        for &id in &self.ids {
            match seen.get_mut(id as usize) {
                None => {
                    return Err(format!(
                        "ranks token id {id}, outside the model's vocabulary of {vocab_size}"
                    ))
                }
                Some(true) => return Err(format!("ranks token id {id} twice")),
                Some(s) => *s = true,
            }
        }
        Ok(())
    }

    /// Writes the ranking as JSON to `path`.
    pub fn save(&self, path: &Path) -> Result<()> {
        let json = serde_json::to_string(self).expect("a ranking serialises");
        std::fs::write(path, json).map_err(|source| CoreError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_go_by_count_then_by_id() {
        let r = DraftVocabRanking::from_counts(&[3, 0, 7, 3, 0]);
        assert_eq!(r.ids, vec![2, 0, 3, 1, 4]);
        assert_eq!(r.counts, vec![7, 3, 3, 0, 0]);
        assert_eq!(r.counted_tokens, 13);
    }

    #[test]
    fn a_ranking_must_cover_this_vocabulary_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(DRAFT_VOCAB_FILE);
        let err = |r: &DraftVocabRanking, vocab: usize| {
            r.save(&path).unwrap();
            let e = DraftVocabRanking::load(&path, vocab)
                .unwrap_err()
                .to_string();
            e.strip_prefix(&format!("{}: ", path.display()))
                .unwrap()
                .to_string()
        };
        let good = DraftVocabRanking::from_counts(&[1, 2, 3]);
        good.save(&path).unwrap();
        assert_eq!(DraftVocabRanking::load(&path, 3).unwrap(), good);
        assert_eq!(
            err(&good, 4),
            "ranks 3 ids with 3 counts, but the model's vocabulary has 4 tokens: it was made for another model"
        );
        let mut twice = good.clone();
        twice.ids[0] = twice.ids[1];
        assert_eq!(
            err(&twice, 3),
            format!("ranks token id {} twice", good.ids[1])
        );
        let mut outside = good.clone();
        outside.ids[2] = 9;
        assert_eq!(
            err(&outside, 3),
            "ranks token id 9, outside the model's vocabulary of 3"
        );
        let mut other = good.clone();
        other.format = "eagle".into();
        assert_eq!(
            err(&other, 3),
            "not a draft vocabulary ranking (format \"eagle\" version 1; expected \"kestrel-draft-vocab\" version 1): write it with spec-train draft-vocab"
        );
    }
}

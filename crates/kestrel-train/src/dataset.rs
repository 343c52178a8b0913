//! Self-distillation data for draft training: token sequences (prompt + the base model's own
//! answer) with the base model's final-normed hidden state at every position, cached on disk
//! so that generating the data and training on it can run as separate calls.
//!
//! On disk (`--data_dir`): `meta.json` ([`DatasetMeta`]) and `data.safetensors` holding
//! `tokens` (u32 `[total]`, all sequences concatenated), `offsets` (u32 `[n + 1]`: sequence `i`
//! is `offsets[i]..offsets[i + 1]`), `prompt_lens` (u32 `[n]`) and `features`
//! (`[total, (1 + feature_layers) · hidden]`, f16 or f32: the final feature, then the tapped
//! layer states of [`kestrel_model::Llama::forward_tapped`] when `feature_layers` is set).

use crate::error::{file_err, invalid, Result, TrainError};
use candle_core::{DType, Device, Tensor};
use kestrel_core::AtomicDir;
use kestrel_model::{Llama, OutputRows, SeqInput};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::Path;

pub const DATASET_FORMAT: &str = "kestrel-eagle-features";
pub const DATASET_VERSION: u32 = 1;
pub const DATASET_META_FILE: &str = "meta.json";
pub const DATASET_DATA_FILE: &str = "data.safetensors";

/// How the sequences were produced (recorded for the head's README; not used in training).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DatasetSource {
    /// The engine whose model answered the prompts and produced the features.
    pub engine_dir: String,
    pub prompts_file: String,
    /// User prompts the engine wrote itself (`--synthetic_prompts`), answered after the file's.
    #[serde(default)]
    pub synthetic_prompts: usize,
    pub chat_template: bool,
    pub max_prompt_len: usize,
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    pub generate_s: f64,
    pub features_s: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DatasetMeta {
    pub format: String,
    pub version: u32,
    pub hidden_size: usize,
    pub vocab_size: usize,
    pub num_sequences: usize,
    pub num_tokens: usize,
    /// Tokens after the prompts (the answers), summed over sequences.
    pub answer_tokens: usize,
    pub feature_dtype: String,
    /// Base layers whose states follow the final feature in `features` (empty: none).
    #[serde(default)]
    pub feature_layers: Vec<usize>,
    pub source: DatasetSource,
}

/// Sequences with their base-model features, all on the CPU.
#[derive(Debug, Clone)]
pub struct FeatureDataset {
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// All sequences' tokens, concatenated.
    pub tokens: Vec<u32>,
    /// `[tokens.len(), feature_width()]` f32: the final-normed hidden state at every
    /// position, then the states of `feature_layers` (see [`Llama::forward_tapped`]).
    pub features: Tensor,
    pub feature_layers: Vec<usize>,
    /// Sequence `i` is `offsets[i]..offsets[i + 1]`.
    pub offsets: Vec<usize>,
    pub prompt_lens: Vec<usize>,
    pub source: DatasetSource,
}

impl FeatureDataset {
    pub fn len(&self) -> usize {
        self.prompt_lens.len()
    }
    pub fn is_empty(&self) -> bool {
        self.prompt_lens.is_empty()
    }
    /// Tokens of sequence `i`.
    pub fn seq_tokens(&self, i: usize) -> &[u32] {
        &self.tokens[self.offsets[i]..self.offsets[i + 1]]
    }
    pub fn seq_len(&self, i: usize) -> usize {
        self.offsets[i + 1] - self.offsets[i]
    }
    /// The same sequences with only the states of `layers` (a subset of `feature_layers`, in
    /// order) after the final feature: one cache serves heads that read fewer layers.
    pub fn select_layers(&self, layers: &[usize]) -> Result<Self> {
        let h = self.hidden_size;
        let mut columns = vec![self.features.narrow(1, 0, h)?];
        for &l in layers {
            let Some(i) = self.feature_layers.iter().position(|&x| x == l) else {
                return Err(invalid(format!(
                    "the feature cache holds base layers {:?}, not layer {l}: regenerate it with --feature_layers",
                    self.feature_layers
                )));
            };
            columns.push(self.features.narrow(1, (1 + i) * h, h)?);
        }
        if let Some(w) = layers.windows(2).find(|w| w[0] >= w[1]) {
            return Err(invalid(format!(
                "feature layers must be strictly increasing, found {} then {}",
                w[0], w[1]
            )));
        }
        Ok(FeatureDataset {
            // Batches gather rows with index_select, which wants contiguous storage.
            features: Tensor::cat(&columns, 1)?.contiguous()?,
            feature_layers: layers.to_vec(),
            ..self.clone()
        })
    }

    /// Feature columns per token: the final feature and one state per feature layer.
    pub fn feature_width(&self) -> usize {
        (1 + self.feature_layers.len()) * self.hidden_size
    }
    pub fn answer_tokens(&self) -> usize {
        (0..self.len())
            .map(|i| self.seq_len(i).saturating_sub(self.prompt_lens[i]))
            .sum()
    }

    /// How often each token id occurs among the answer tokens (`vocab_size` counts).
    pub fn answer_token_counts(&self) -> Result<Vec<u64>> {
        let mut counts = vec![0u64; self.vocab_size];
        for i in 0..self.len() {
            let answer = &self.tokens[self.offsets[i] + self.prompt_lens[i]..self.offsets[i + 1]];
            for &t in answer {
                *counts.get_mut(t as usize).ok_or_else(|| {
                    invalid(format!(
                        "sequence {i} holds token id {t}, outside the vocabulary of {}",
                        self.vocab_size
                    ))
                })? += 1;
            }
        }
        Ok(counts)
    }

    pub fn meta(&self, feature_dtype: DType) -> DatasetMeta {
        DatasetMeta {
            format: DATASET_FORMAT.into(),
            version: DATASET_VERSION,
            hidden_size: self.hidden_size,
            vocab_size: self.vocab_size,
            num_sequences: self.len(),
            num_tokens: self.tokens.len(),
            answer_tokens: self.answer_tokens(),
            feature_dtype: format!("{feature_dtype:?}").to_lowercase(),
            feature_layers: self.feature_layers.clone(),
            source: self.source.clone(),
        }
    }

    /// Writes `meta.json` and `data.safetensors` into `dir`, replacing it atomically.
    /// `feature_dtype`: F16 halves the file; the training noise dwarfs its rounding.
    pub fn save(&self, dir: &Path, feature_dtype: DType) -> Result<()> {
        self.save_with(dir, feature_dtype, &[])
    }

    /// [`FeatureDataset::save`], with `extra` (file name, contents) written into the same
    /// atomic replacement.
    pub fn save_with(
        &self,
        dir: &Path,
        feature_dtype: DType,
        extra: &[(&str, &[u8])],
    ) -> Result<()> {
        if !matches!(feature_dtype, DType::F16 | DType::F32 | DType::BF16) {
            return Err(invalid(format!(
                "feature dtype {feature_dtype:?}: use float16, bfloat16 or float32"
            )));
        }
        let out = AtomicDir::new(dir).map_err(|e| file_err(dir, e))?;
        let n = self.len();
        let to_u32 = |v: &[usize]| -> Result<Vec<u32>> {
            v.iter()
                .map(|&x| {
                    u32::try_from(x).map_err(|_| invalid("dataset too large for u32 offsets"))
                })
                .collect()
        };
        let mut map = HashMap::new();
        map.insert(
            "tokens".to_string(),
            Tensor::from_slice(&self.tokens, self.tokens.len(), &Device::Cpu)?,
        );
        map.insert(
            "offsets".to_string(),
            Tensor::from_vec(to_u32(&self.offsets)?, n + 1, &Device::Cpu)?,
        );
        map.insert(
            "prompt_lens".to_string(),
            Tensor::from_vec(to_u32(&self.prompt_lens)?, n, &Device::Cpu)?,
        );
        map.insert(
            "features".to_string(),
            self.features.to_dtype(feature_dtype)?,
        );
        let data_path = out.path().join(DATASET_DATA_FILE);
        candle_core::safetensors::save(&map, &data_path).map_err(|e| file_err(&data_path, e))?;
        let meta =
            serde_json::to_string_pretty(&self.meta(feature_dtype)).expect("meta serialises");
        let meta_path = out.path().join(DATASET_META_FILE);
        std::fs::write(&meta_path, meta).map_err(|e| file_err(&meta_path, e))?;
        for (name, contents) in extra {
            let path = out.path().join(name);
            std::fs::write(&path, contents).map_err(|e| file_err(&path, e))?;
        }
        out.commit().map_err(|e| file_err(dir, e))?;
        Ok(())
    }

    /// Whether `dir` holds a saved dataset.
    pub fn exists(dir: &Path) -> bool {
        dir.join(DATASET_META_FILE).is_file() && dir.join(DATASET_DATA_FILE).is_file()
    }

    /// Reads a dataset written by [`FeatureDataset::save`], checking its structure.
    pub fn load(dir: &Path) -> Result<Self> {
        let meta_path = dir.join(DATASET_META_FILE);
        let text = std::fs::read_to_string(&meta_path).map_err(|e| {
            file_err(
                &meta_path,
                format!("{e}: not a feature cache; create one with spec-train eagle --stage data"),
            )
        })?;
        let meta: DatasetMeta = serde_json::from_str(&text).map_err(|source| TrainError::Json {
            path: meta_path.display().to_string(),
            source,
        })?;
        if meta.format != DATASET_FORMAT || meta.version != DATASET_VERSION {
            return Err(file_err(
                &meta_path,
                format!(
                    "format {} v{} is not {DATASET_FORMAT} v{DATASET_VERSION}: regenerate the data with --stage data",
                    meta.format, meta.version
                ),
            ));
        }
        let data_path = dir.join(DATASET_DATA_FILE);
        let mut map = candle_core::safetensors::load(&data_path, &Device::Cpu)
            .map_err(|e| file_err(&data_path, e))?;
        let mut take = |name: &str| {
            map.remove(name)
                .ok_or_else(|| file_err(&data_path, format!("tensor '{name}' is missing")))
        };
        let tokens: Vec<u32> = take("tokens")?.to_dtype(DType::U32)?.to_vec1()?;
        let offsets: Vec<usize> = take("offsets")?
            .to_dtype(DType::U32)?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        let prompt_lens: Vec<usize> = take("prompt_lens")?
            .to_dtype(DType::U32)?
            .to_vec1::<u32>()?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        let features = take("features")?.to_dtype(DType::F32)?;
        let bad = |what: String| file_err(&data_path, format!("{what}: regenerate the data"));
        let width = (1 + meta.feature_layers.len()) * meta.hidden_size;
        if features.dims() != [tokens.len(), width] {
            return Err(bad(format!(
                "features have shape {:?}, expected [{}, {width}]",
                features.dims(),
                tokens.len(),
            )));
        }
        if offsets.len() != prompt_lens.len() + 1
            || offsets.first() != Some(&0)
            || offsets.last() != Some(&tokens.len())
            || offsets.windows(2).any(|w| w[0] > w[1])
        {
            return Err(bad("offsets do not partition the tokens".into()));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= meta.vocab_size) {
            return Err(bad(format!(
                "token id {t} is outside the vocabulary of {}",
                meta.vocab_size
            )));
        }
        Ok(FeatureDataset {
            hidden_size: meta.hidden_size,
            vocab_size: meta.vocab_size,
            tokens,
            features,
            feature_layers: meta.feature_layers,
            offsets,
            prompt_lens,
            source: meta.source,
        })
    }

    /// Features of `seqs` = `(tokens, prompt_len)`: the frozen base model runs over each
    /// whole sequence (varlen batches of about `batch_tokens` tokens, a fresh KV cache per
    /// batch) and keeps the final-normed hidden state of every position, followed by the
    /// states of `feature_layers`.
    pub fn extract(
        model: &Llama,
        seqs: Vec<(Vec<u32>, usize)>,
        feature_layers: &[usize],
        batch_tokens: usize,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let cfg = model.config();
        let h = cfg.hidden_size;
        let mut tokens = Vec::new();
        let mut offsets = vec![0];
        let mut prompt_lens = Vec::with_capacity(seqs.len());
        for (i, (t, p)) in seqs.iter().enumerate() {
            if t.is_empty() {
                return Err(invalid(format!("sequence {i} is empty")));
            }
            if *p > t.len() {
                return Err(invalid(format!(
                    "sequence {i}: prompt length {p} exceeds its {} tokens",
                    t.len()
                )));
            }
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= cfg.vocab_size) {
                return Err(invalid(format!(
                    "sequence {i}: token id {bad} is outside the vocabulary of {}",
                    cfg.vocab_size
                )));
            }
            tokens.extend_from_slice(t);
            offsets.push(tokens.len());
            prompt_lens.push(*p);
        }
        let block = 16;
        let mut parts = Vec::new();
        let mut start = 0;
        while start < seqs.len() {
            let mut end = start + 1;
            let mut n = seqs[start].0.len();
            while end < seqs.len() && n + seqs[end].0.len() <= batch_tokens.max(1) {
                n += seqs[end].0.len();
                end += 1;
            }
            let blocks: usize = seqs[start..end]
                .iter()
                .map(|(t, _)| t.len().div_ceil(block))
                .sum();
            let mut cache = model.new_cache(blocks + 1, block)?;
            let positions: Vec<Vec<u32>> = seqs[start..end]
                .iter()
                .map(|(t, _)| (0..t.len() as u32).collect())
                .collect();
            let ids: Vec<_> = (start..end).map(|_| cache.add_sequence()).collect();
            let batch: Vec<SeqInput> = seqs[start..end]
                .iter()
                .zip(&positions)
                .zip(&ids)
                .map(|(((t, _), pos), &seq)| SeqInput {
                    seq,
                    tokens: t,
                    positions: pos,
                    mask: None,
                    output_rows: OutputRows::All,
                })
                .collect();
            let hidden = model.forward_tapped(&batch, &mut cache, feature_layers, false)?;
            parts.push(hidden.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
            start = end;
            progress(end, seqs.len());
        }
        let width = (1 + feature_layers.len()) * h;
        let features = if parts.is_empty() {
            Tensor::zeros((0, width), DType::F32, &Device::Cpu)?
        } else {
            Tensor::cat(&parts, 0)?
        };
        Ok(FeatureDataset {
            hidden_size: h,
            vocab_size: cfg.vocab_size,
            tokens,
            features,
            feature_layers: feature_layers.to_vec(),
            offsets,
            prompt_lens,
            source: DatasetSource::default(),
        })
    }
}

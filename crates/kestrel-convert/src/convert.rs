//! The conversion itself: read, validate, shard, cast, write atomically.

use crate::error::ConvertError;
use crate::meta::{
    checkpoint_config_json, rank_file_name, CheckpointMeta, EagleMeta, SourceFile,
    CHAT_TEMPLATE_FILE, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CONFIG_FILE, EAGLE_PREFIX,
    TOKENIZER_FILE,
};
use candle_core::Tensor;
use kestrel_core::draft_vocab::{DraftVocabRanking, DRAFT_VOCAB_FILE};
use kestrel_core::{AtomicDir, DType, Mapping, ModelConfig, ShardDim};
use kestrel_formats::{
    eagle_head_files, load_eagle_head, load_gguf, load_hf_dir, LoadedCheckpoint,
};
use rayon::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The longest draft an EAGLE tree may hold (`--max_draft_len`).
pub const MAX_DRAFT_LEN: usize = 256;

/// Where the base model comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// A Hugging Face model directory (`--model_dir`).
    HfDir(PathBuf),
    /// A llama.cpp GGUF file (`--gguf`).
    Gguf(PathBuf),
}

/// The EAGLE head to bundle (`--eagle_model_dir` and its tree flags).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EagleOptions {
    pub dir: PathBuf,
    pub max_draft_len: usize,
    pub num_eagle_layers: usize,
    pub max_non_leaves_per_layer: usize,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertOptions {
    pub source: Source,
    pub output_dir: PathBuf,
    pub dtype: DType,
    pub tp_size: usize,
    /// Threads used to slice and cast tensors.
    pub workers: usize,
    pub eagle: Option<EagleOptions>,
    /// Draw a progress bar on stderr.
    pub progress: bool,
}

/// What a conversion wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct ConvertSummary {
    pub output_dir: PathBuf,
    pub dtype: DType,
    pub tp_size: usize,
    /// Tensors in each rank file (the same for every rank).
    pub tensors_per_rank: usize,
    /// Bytes of all rank files together.
    pub weight_bytes: u64,
    pub num_parameters: usize,
    pub eagle: bool,
    pub elapsed: Duration,
}

impl std::fmt::Display for ConvertSummary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "wrote {} ({} parameters{}, {}, tp_size {}: {} tensors per rank, {:.1} MiB) in {:.1}s",
            self.output_dir.display(),
            self.num_parameters,
            if self.eagle { " + EAGLE head" } else { "" },
            self.dtype,
            self.tp_size,
            self.tensors_per_rank,
            self.weight_bytes as f64 / (1024.0 * 1024.0),
            self.elapsed.as_secs_f64()
        )
    }
}

fn candle_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::F32 => candle_core::DType::F32,
        DType::F16 => candle_core::DType::F16,
        DType::BF16 => candle_core::DType::BF16,
    }
}

/// The part of tensor `name` (an HF name without any `eagle.` prefix) that `rank` holds.
///
/// Column-parallel weights and biases are split along dim 0, row-parallel weights along dim 1,
/// per [`Mapping::shard_range`]; a row-parallel bias (1-D) and every other tensor are replicated.
pub fn shard_tensor(
    cfg: &ModelConfig,
    mapping: &Mapping,
    name: &str,
    tensor: &Tensor,
    rank: usize,
) -> candle_core::Result<Tensor> {
    let dim = match Mapping::shard_dim(name) {
        ShardDim::Replicated => return Ok(tensor.clone()),
        ShardDim::Rows => 0,
        ShardDim::Cols if tensor.rank() >= 2 => 1,
        ShardDim::Cols => return Ok(tensor.clone()),
    };
    let len = tensor.dim(dim)?;
    match mapping.shard_range(cfg, name, len, rank) {
        Some(range) => tensor.narrow(dim, range.start, range.len()),
        None => Ok(tensor.clone()),
    }
}

fn sha256_file(path: &Path) -> Result<String, ConvertError> {
    let mut file = std::fs::File::open(path).map_err(|e| ConvertError::Io {
        path: path.display().to_string(),
        message: format!("cannot read to record its digest: {e}"),
    })?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| ConvertError::Io {
            path: path.display().to_string(),
            message: format!("cannot read to record its digest: {e}"),
        })?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

fn source_entries(
    files: &[PathBuf],
    base: &Path,
    prefix: &str,
) -> Result<Vec<SourceFile>, ConvertError> {
    files
        .iter()
        .map(|f| {
            let rel = f.strip_prefix(base).unwrap_or(f);
            let name = rel
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| rel.display().to_string());
            Ok(SourceFile {
                file: format!("{prefix}{name}"),
                sha256: sha256_file(f)?,
            })
        })
        .collect()
}

fn check_options(opts: &ConvertOptions) -> Result<(), ConvertError> {
    let invalid = |m: String| Err(ConvertError::Invalid(m));
    if opts.tp_size == 0 {
        return invalid("--tp_size must be at least 1".into());
    }
    if opts.workers == 0 {
        return invalid("--workers must be at least 1".into());
    }
    if let Some(e) = &opts.eagle {
        if e.max_draft_len == 0 || e.max_draft_len > MAX_DRAFT_LEN {
            return invalid(format!(
                "--max_draft_len {} is out of range: it must be between 1 and {MAX_DRAFT_LEN}",
                e.max_draft_len
            ));
        }
        if e.num_eagle_layers == 0 {
            return invalid("--num_eagle_layers must be at least 1".into());
        }
        if e.max_non_leaves_per_layer == 0 {
            return invalid("--max_non_leaves_per_layer must be at least 1".into());
        }
    }
    let out = &opts.output_dir;
    if out.file_name().is_none() {
        return invalid(format!(
            "--output_dir {}: needs a final folder name",
            out.display()
        ));
    }
    if out.exists() {
        if !out.is_dir() {
            return invalid(format!(
                "--output_dir {}: exists and is not a directory; choose another path",
                out.display()
            ));
        }
        if !is_replaceable(out) {
            return invalid(format!(
                "--output_dir {}: exists and is not a Kestrel checkpoint, so it is not replaced; choose another path or remove it",
                out.display()
            ));
        }
    }
    Ok(())
}

/// An existing output is replaced only when it is empty or an earlier checkpoint.
fn is_replaceable(dir: &Path) -> bool {
    let empty = std::fs::read_dir(dir)
        .map(|mut entries| entries.next().is_none())
        .unwrap_or(false);
    if empty {
        return true;
    }
    std::fs::read_to_string(dir.join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| {
            v.get("kestrel")
                .and_then(|m| m.get("format"))
                .and_then(|f| f.as_str().map(|s| s == CHECKPOINT_FORMAT))
        })
        .unwrap_or(false)
}

fn write_err(path: &Path, e: impl std::fmt::Display) -> ConvertError {
    ConvertError::Io {
        path: path.display().to_string(),
        message: format!("cannot write: {e}"),
    }
}

/// Converts a checkpoint (see the crate docs); on failure nothing is left at `output_dir`
/// and an existing output there is kept as it was.
pub fn convert(opts: &ConvertOptions) -> Result<ConvertSummary, ConvertError> {
    let start = Instant::now();
    check_options(opts)?;
    let (base, base_root) = match &opts.source {
        Source::HfDir(dir) => (load_hf_dir(dir)?, dir.clone()),
        Source::Gguf(file) => (
            load_gguf(file)?,
            file.parent().map(Path::to_path_buf).unwrap_or_default(),
        ),
    };
    let mapping = Mapping::new(opts.tp_size);
    mapping
        .validate(&base.config)
        .map_err(ConvertError::Invalid)?;

    let mut source_files = source_entries(&base.source_files, &base_root, "")?;
    let eagle = match &opts.eagle {
        None => None,
        Some(e) => {
            let (head_cfg, tensors) = load_eagle_head(&e.dir)?;
            head_cfg.check_compatible(&base.config).map_err(|m| {
                ConvertError::Invalid(format!("--eagle_model_dir {}: {m}", e.dir.display()))
            })?;
            mapping.validate(&head_cfg.llama).map_err(|m| {
                ConvertError::Invalid(format!("--eagle_model_dir {}: {m}", e.dir.display()))
            })?;
            let mut files = eagle_head_files(&e.dir);
            let ranking_path = e.dir.join(DRAFT_VOCAB_FILE);
            if ranking_path.is_file() {
                DraftVocabRanking::load(&ranking_path, base.config.vocab_size).map_err(|m| {
                    ConvertError::Invalid(format!("--eagle_model_dir {}: {m}", e.dir.display()))
                })?;
                files.push(ranking_path);
            }
            source_files.extend(source_entries(&files, &e.dir, "eagle/")?);
            let meta = EagleMeta {
                max_draft_len: e.max_draft_len,
                num_eagle_layers: e.num_eagle_layers,
                max_non_leaves_per_layer: e.max_non_leaves_per_layer,
                head_config: head_cfg,
            };
            Some((meta, tensors))
        }
    };
    let meta = CheckpointMeta {
        format: CHECKPOINT_FORMAT.into(),
        version: CHECKPOINT_VERSION,
        dtype: opts.dtype,
        mapping,
        source_files,
        eagle: eagle.as_ref().map(|(m, _)| m.clone()),
    };
    let mut config_json = checkpoint_config_json(&base.config, &meta);
    config_json.push('\n');

    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(opts.workers)
        .build()
        .map_err(|e| ConvertError::Invalid(format!("--workers {}: {e}", opts.workers)))?;

    // Every tensor to write, with the configuration that shards it.
    let mut jobs: Vec<(String, &str, &Tensor, &ModelConfig)> = base
        .tensors
        .iter()
        .map(|(n, t)| (n.clone(), n.as_str(), t, &base.config))
        .collect();
    if let Some((m, tensors)) = &eagle {
        jobs.extend(tensors.iter().map(|(n, t)| {
            (
                format!("{EAGLE_PREFIX}{n}"),
                n.as_str(),
                t,
                &m.head_config.llama,
            )
        }));
    }

    let out = AtomicDir::new(&opts.output_dir).map_err(|e| ConvertError::Io {
        path: opts.output_dir.display().to_string(),
        message: format!("cannot create a temporary folder beside it: {e}"),
    })?;

    let progress = if opts.progress {
        let bar = indicatif::ProgressBar::new((jobs.len() * opts.tp_size) as u64);
        if let Ok(style) =
            indicatif::ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} tensors ({eta})")
        {
            bar.set_style(style.progress_chars("=> "));
        }
        bar
    } else {
        indicatif::ProgressBar::hidden()
    };

    let target = candle_dtype(opts.dtype);
    let mut weight_bytes = 0u64;
    for rank in 0..opts.tp_size {
        progress.set_message(format!("rank {rank}"));
        let shards: Vec<(String, Tensor)> = pool.install(|| {
            jobs.par_iter()
                .map(|(out_name, name, tensor, cfg)| {
                    let t = shard_tensor(cfg, &mapping, name, tensor, rank)
                        .and_then(|t| t.to_dtype(target))
                        .and_then(|t| t.contiguous())
                        .map_err(|e| {
                            ConvertError::Invalid(format!(
                            "tensor '{out_name}': cannot slice for rank {rank} or cast to {}: {e}",
                            opts.dtype
                        ))
                        })?;
                    progress.inc(1);
                    Ok((out_name.clone(), t))
                })
                .collect::<Result<Vec<_>, ConvertError>>()
        })?;
        let sorted: BTreeMap<String, Tensor> = shards.into_iter().collect();
        let path = out.path().join(rank_file_name(rank));
        let bytes = safetensors::serialize(sorted.iter(), None).map_err(|e| write_err(&path, e))?;
        weight_bytes += bytes.len() as u64;
        std::fs::write(&path, &bytes).map_err(|e| write_err(&path, e))?;
    }
    progress.finish_and_clear();

    let config_path = out.path().join(CONFIG_FILE);
    std::fs::write(&config_path, config_json).map_err(|e| write_err(&config_path, e))?;
    write_tokenizer_files(&base, out.path())?;
    if let Some(e) = &opts.eagle {
        // Checked above: the head's draft vocabulary ranking travels with it.
        let ranking = e.dir.join(DRAFT_VOCAB_FILE);
        if ranking.is_file() {
            let dest = out.path().join(DRAFT_VOCAB_FILE);
            std::fs::copy(&ranking, &dest).map_err(|err| write_err(&dest, err))?;
        }
    }

    out.commit().map_err(|e| ConvertError::Io {
        path: opts.output_dir.display().to_string(),
        message: format!("cannot move the finished checkpoint into place: {e}"),
    })?;
    Ok(ConvertSummary {
        output_dir: opts.output_dir.clone(),
        dtype: opts.dtype,
        tp_size: opts.tp_size,
        tensors_per_rank: jobs.len(),
        weight_bytes,
        num_parameters: base.config.num_parameters(),
        eagle: eagle.is_some(),
        elapsed: start.elapsed(),
    })
}

fn write_tokenizer_files(base: &LoadedCheckpoint, dir: &Path) -> Result<(), ConvertError> {
    if let Some(tokenizer) = &base.tokenizer {
        let path = dir.join(TOKENIZER_FILE);
        tokenizer
            .save(&path, false)
            .map_err(|e| write_err(&path, e))?;
    }
    if let Some(template) = &base.chat_template {
        let path = dir.join(CHAT_TEMPLATE_FILE);
        std::fs::write(&path, template).map_err(|e| write_err(&path, e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn cfg(heads: usize, kv: usize) -> ModelConfig {
        serde_json::from_str(&format!(
            r#"{{"vocab_size": 8, "hidden_size": {}, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": {heads},
                "num_key_value_heads": {kv}, "attention_bias": true}}"#,
            heads * 2
        ))
        .unwrap()
    }

    fn rows(t: &Tensor) -> Vec<Vec<f32>> {
        t.to_vec2().unwrap()
    }

    #[test]
    fn shards_rows_cols_and_replicates() {
        let c = cfg(4, 2);
        let m = Mapping::new(2);
        let w = Tensor::arange(0f32, 32., &Device::Cpu)
            .unwrap()
            .reshape((4, 8))
            .unwrap();
        let q = shard_tensor(&c, &m, "model.layers.0.self_attn.q_proj.weight", &w, 1).unwrap();
        assert_eq!(rows(&q), rows(&w.narrow(0, 2, 2).unwrap()));
        let o = shard_tensor(&c, &m, "model.layers.0.self_attn.o_proj.weight", &w, 1).unwrap();
        assert_eq!(rows(&o), rows(&w.narrow(1, 4, 4).unwrap()));
        let n = shard_tensor(&c, &m, "model.norm.weight", &w, 1).unwrap();
        assert_eq!(rows(&n), rows(&w));
        // A row-parallel bias is added once after the all-reduce: every rank keeps it whole.
        let b = Tensor::arange(0f32, 8., &Device::Cpu).unwrap();
        let ob = shard_tensor(&c, &m, "model.layers.0.self_attn.o_proj.bias", &b, 1).unwrap();
        assert_eq!(ob.to_vec1::<f32>().unwrap(), b.to_vec1::<f32>().unwrap());
        let qb = shard_tensor(&c, &m, "model.layers.0.self_attn.q_proj.bias", &b, 1).unwrap();
        assert_eq!(qb.to_vec1::<f32>().unwrap(), vec![4., 5., 6., 7.]);
    }

    #[test]
    fn kv_heads_replicate_over_ranks() {
        // 4 query heads, 1 KV head of dim 2, 4 ranks: every rank holds the KV head.
        let c = cfg(4, 1);
        let m = Mapping::new(4);
        let k = Tensor::arange(0f32, 16., &Device::Cpu)
            .unwrap()
            .reshape((2, 8))
            .unwrap();
        for rank in 0..4 {
            let s =
                shard_tensor(&c, &m, "model.layers.0.self_attn.k_proj.weight", &k, rank).unwrap();
            assert_eq!(rows(&s), rows(&k));
        }
    }

    fn opts(out: PathBuf) -> ConvertOptions {
        ConvertOptions {
            source: Source::HfDir(PathBuf::from("/nonexistent")),
            output_dir: out,
            dtype: DType::F32,
            tp_size: 1,
            workers: 1,
            eagle: None,
            progress: false,
        }
    }

    #[test]
    fn flags_are_checked_before_reading() {
        let tmp = tempfile::tempdir().unwrap();
        let mut o = opts(tmp.path().join("out"));
        o.eagle = Some(EagleOptions {
            dir: PathBuf::from("/nonexistent"),
            max_draft_len: 300,
            num_eagle_layers: 4,
            max_non_leaves_per_layer: 10,
        });
        assert_eq!(
            convert(&o).unwrap_err().to_string(),
            "--max_draft_len 300 is out of range: it must be between 1 and 256"
        );
        let mut o = opts(tmp.path().join("out"));
        o.workers = 0;
        assert_eq!(
            convert(&o).unwrap_err().to_string(),
            "--workers must be at least 1"
        );
        // A non-empty folder that is not a checkpoint is never replaced.
        std::fs::write(tmp.path().join("keep.txt"), "x").unwrap();
        let o = opts(tmp.path().to_path_buf());
        assert_eq!(
            convert(&o).unwrap_err().to_string(),
            format!(
                "--output_dir {}: exists and is not a Kestrel checkpoint, so it is not replaced; choose another path or remove it",
                tmp.path().display()
            )
        );
        assert!(tmp.path().join("keep.txt").exists());
    }
}

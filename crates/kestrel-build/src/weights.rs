//! Checks every rank file against the config and copies it into the engine.

use crate::error::BuildError;
use crate::hex;
use kestrel_core::checkpoint::{rank_file_name, CheckpointMeta, EAGLE_PREFIX};
use kestrel_core::layout::{eagle_head_tensors, llama_tensors};
use kestrel_core::plan::WeightFile;
use kestrel_core::{DType, ModelConfig};
use safetensors::{Dtype, SafeTensors};
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::io::Read;
use std::path::Path;

fn st_dtype(d: DType) -> Dtype {
    match d {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
    }
}

/// Validates each `rank{N}.safetensors` and copies it to `out`, returning the plan entries.
pub fn copy_rank_files(
    checkpoint: &Path,
    out: &Path,
    model: &ModelConfig,
    meta: &CheckpointMeta,
) -> Result<Vec<WeightFile>, BuildError> {
    let mut expected: BTreeMap<String, Vec<usize>> = llama_tensors(model, meta.mapping)
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect();
    if let Some(eagle) = &meta.eagle {
        expected.extend(
            eagle_head_tensors(&eagle.head_config, meta.mapping, EAGLE_PREFIX)
                .into_iter()
                .map(|t| (t.name, t.shape)),
        );
    }
    let optional = format!("{EAGLE_PREFIX}embed_tokens.weight");
    let mut files = Vec::new();
    for rank in 0..meta.mapping.tp_size {
        let name = rank_file_name(rank);
        let src = checkpoint.join(&name);
        check_rank_file(&src, &expected, &optional, model, meta.dtype)?;
        let dst = out.join(&name);
        std::fs::copy(&src, &dst).map_err(|e| BuildError::io(&src, e))?;
        files.push(WeightFile {
            rank,
            file: name,
            sha256: sha256_file(&dst)?,
        });
    }
    Ok(files)
}

fn check_rank_file(
    path: &Path,
    expected: &BTreeMap<String, Vec<usize>>,
    optional: &str,
    model: &ModelConfig,
    dtype: DType,
) -> Result<(), BuildError> {
    let shown = path.display().to_string();
    let invalid = |message: String| BuildError::InvalidWeights {
        file: shown.clone(),
        message,
    };
    let file = std::fs::File::open(path).map_err(|_| {
        invalid("weight file is missing: the checkpoint is incomplete; reconvert it".into())
    })?;
    // SAFETY: the file is opened read-only and not modified while mapped.
    let mmap = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| BuildError::io(path, e))?;
    let tensors = SafeTensors::deserialize(&mmap).map_err(|e| {
        invalid(format!(
            "not a valid safetensors file ({e}): reconvert the checkpoint"
        ))
    })?;
    for (name, shape) in expected {
        let view = tensors
            .tensor(name)
            .map_err(|_| invalid(format!("tensor {name} is missing")))?;
        if view.shape() != shape.as_slice() {
            return Err(invalid(format!(
                "tensor {name} has shape {:?}, expected {:?}",
                view.shape(),
                shape
            )));
        }
        if view.dtype() != st_dtype(dtype) {
            return Err(invalid(format!(
                "tensor {name} is {:?}, but the checkpoint dtype is {dtype}",
                view.dtype()
            )));
        }
    }
    for name in tensors.names() {
        if !expected.contains_key(name) {
            if name == optional {
                let view = tensors.tensor(name).expect("listed");
                let want = [model.vocab_size, model.hidden_size];
                if view.shape() != want {
                    return Err(invalid(format!(
                        "tensor {name} has shape {:?}, expected {want:?}",
                        view.shape()
                    )));
                }
                continue;
            }
            return Err(invalid(format!(
                "unexpected tensor {name}: the file does not match config.json"
            )));
        }
    }
    Ok(())
}

fn sha256_file(path: &Path) -> Result<String, BuildError> {
    let mut file = std::fs::File::open(path).map_err(|e| BuildError::io(path, e))?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| BuildError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

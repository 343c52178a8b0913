use crate::checkpoint::{check_tensors, expected_shapes, is_ignored_buffer, LoadedCheckpoint};
use crate::error::{one_line, FormatError};
use candle_core::{Device, Tensor};
use kestrel_core::ModelConfig;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Reads a Hugging Face model directory (see the crate docs for the layouts understood).
pub fn load_hf_dir(dir: &Path) -> Result<LoadedCheckpoint, FormatError> {
    require_dir(
        dir,
        "a Hugging Face model folder with config.json and the weights",
    )?;
    let config_path = dir.join("config.json");
    if !config_path.is_file() {
        return Err(FormatError::file(
            dir,
            "no config.json: not a Hugging Face model folder (expected config.json and *.safetensors or pytorch_model.bin)",
        ));
    }
    let config = ModelConfig::from_json_file(&config_path)?;
    let weight_files = weight_files(dir)?;
    let mut tensors = read_weight_files(&weight_files)?;
    tensors.retain(|name, _| !is_ignored_buffer(name));
    if config.tie_word_embeddings {
        // Tied checkpoints sometimes also save the head; it is the embedding by definition.
        tensors.remove("lm_head.weight");
    }
    check_tensors(dir, &expected_shapes(&config), &BTreeMap::new(), &tensors)?;

    let mut source_files = vec![config_path];
    source_files.extend(weight_files);
    let tokenizer_path = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_path.is_file() {
        source_files.push(tokenizer_path.clone());
        Some(read_tokenizer(&tokenizer_path)?)
    } else {
        None
    };
    let chat_template = match read_chat_template(dir)? {
        Some((template, file)) => {
            source_files.push(file);
            Some(template)
        }
        None => None,
    };
    source_files.sort();
    source_files.dedup();
    Ok(LoadedCheckpoint {
        config,
        tensors,
        tokenizer,
        chat_template,
        source_files,
    })
}

pub(crate) fn require_dir(dir: &Path, what: &str) -> Result<(), FormatError> {
    if dir.is_dir() {
        Ok(())
    } else if dir.exists() {
        Err(FormatError::file(
            dir,
            format!("not a directory: expected {what}"),
        ))
    } else {
        Err(FormatError::file(
            dir,
            format!("directory does not exist: expected {what}"),
        ))
    }
}

pub(crate) fn read_tokenizer(path: &Path) -> Result<tokenizers::Tokenizer, FormatError> {
    tokenizers::Tokenizer::from_file(path).map_err(|e| {
        FormatError::file(
            path,
            format!(
                "cannot read the tokenizer ({}): expected HF tokenizers' tokenizer.json format",
                one_line(e)
            ),
        )
    })
}

/// The chat template and the file it came from: `chat_template.jinja`, else the
/// `chat_template` key of `tokenizer_config.json` (a string, or a list of named templates of
/// which "default" or else the first is taken).
pub(crate) fn read_chat_template(dir: &Path) -> Result<Option<(String, PathBuf)>, FormatError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        let text = std::fs::read_to_string(&jinja)
            .map_err(|e| FormatError::file(&jinja, format!("cannot read: {e}")))?;
        return Ok(Some((text, jinja)));
    }
    let config = dir.join("tokenizer_config.json");
    if !config.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(&config)
        .map_err(|e| FormatError::file(&config, format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| FormatError::file(&config, format!("invalid JSON: {e}")))?;
    let template = match value.get("chat_template") {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(list)) => {
            let named = |want: Option<&str>| {
                list.iter().find_map(|entry| {
                    let name = entry.get("name").and_then(|n| n.as_str());
                    let template = entry.get("template").and_then(|t| t.as_str())?;
                    (want.is_none() || name == want).then(|| template.to_string())
                })
            };
            named(Some("default")).or_else(|| named(None))
        }
        _ => None,
    };
    Ok(template.map(|t| (t, config)))
}

fn read_index(index: &Path) -> Result<Vec<PathBuf>, FormatError> {
    let text = std::fs::read_to_string(index)
        .map_err(|e| FormatError::file(index, format!("cannot read: {e}")))?;
    let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
        FormatError::file(
            index,
            format!("invalid JSON ({e}): download the index again"),
        )
    })?;
    let Some(map) = value.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(FormatError::file(
            index,
            "no \"weight_map\" object: not a sharded-checkpoint index",
        ));
    };
    let dir = index.parent().unwrap_or(Path::new("."));
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let Some(file) = file.as_str() else {
            return Err(FormatError::file(
                index,
                format!("weight_map entry for '{tensor}' is not a file name"),
            ));
        };
        files.insert(file.to_string());
    }
    let mut out = Vec::new();
    for file in files {
        let path = dir.join(&file);
        if !path.is_file() {
            return Err(FormatError::file(
                index,
                format!(
                    "shard '{file}' listed in the index is missing: download it into {}",
                    dir.display()
                ),
            ));
        }
        out.push(path);
    }
    Ok(out)
}

/// The weight files of an HF directory, in the order they are read.
fn weight_files(dir: &Path) -> Result<Vec<PathBuf>, FormatError> {
    let st_index = dir.join("model.safetensors.index.json");
    if st_index.is_file() {
        return read_index(&st_index);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| FormatError::file(dir, format!("cannot list: {e}")))?
        .filter_map(|entry| entry.ok().map(|e| e.path()))
        .filter(|p| p.is_file() && p.extension().is_some_and(|e| e == "safetensors"))
        .collect();
    if !shards.is_empty() {
        shards.sort();
        return Ok(shards);
    }
    let bin_index = dir.join("pytorch_model.bin.index.json");
    if bin_index.is_file() {
        return read_index(&bin_index);
    }
    let bin = dir.join("pytorch_model.bin");
    if bin.is_file() {
        return Ok(vec![bin]);
    }
    Err(FormatError::file(
        dir,
        "no weights found: expected model.safetensors, sharded *.safetensors with model.safetensors.index.json, or pytorch_model.bin",
    ))
}

/// Reads one safetensors file or zip-format PyTorch checkpoint into CPU tensors.
pub(crate) fn read_weight_file(path: &Path) -> Result<Vec<(String, Tensor)>, FormatError> {
    let is_safetensors = path.extension().is_some_and(|e| e == "safetensors");
    if is_safetensors {
        let map = candle_core::safetensors::load(path, &Device::Cpu).map_err(|e| {
            FormatError::file(
                path,
                format!(
                    "not a valid safetensors file ({}): it may be truncated; download it again",
                    one_line(e)
                ),
            )
        })?;
        Ok(map.into_iter().collect())
    } else {
        // candle's unpickler only builds tensors and dicts: no code from the file is run.
        candle_core::pickle::read_all(path).map_err(|e| {
            FormatError::file(
                path,
                format!(
                    "cannot read the PyTorch checkpoint ({}): expected a zip-format file saved by torch.save; it may be truncated",
                    one_line(e)
                ),
            )
        })
    }
}

pub(crate) fn read_weight_files(
    files: &[PathBuf],
) -> Result<BTreeMap<String, Tensor>, FormatError> {
    let mut tensors = BTreeMap::new();
    for file in files {
        for (name, tensor) in read_weight_file(file)? {
            if tensors.insert(name.clone(), tensor).is_some() {
                return Err(FormatError::tensor(
                    file,
                    &name,
                    "appears in more than one weight file: remove the stray file",
                ));
            }
        }
    }
    Ok(tensors)
}

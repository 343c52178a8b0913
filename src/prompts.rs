//! Reading prompts from `--input_file`.

use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// A JSON list of strings (or of `{"prompt": …}` / `{"text": …}` objects), or JSONL with one
/// string or object per line.
pub fn read_prompt_file(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("--input_file {}: cannot read it", path.display()))?;
    let shown = path.display();
    if let Ok(Value::Array(items)) = serde_json::from_str::<Value>(&text) {
        return items
            .iter()
            .enumerate()
            .map(|(i, v)| prompt_of(v).with_context(|| format!("--input_file {shown}: item {i}")))
            .collect();
    }
    let mut prompts = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line)
            .with_context(|| format!("--input_file {shown}: line {} is not JSON", n + 1))?;
        prompts.push(
            prompt_of(&value).with_context(|| format!("--input_file {shown}: line {}", n + 1))?,
        );
    }
    if prompts.is_empty() {
        bail!("--input_file {shown}: holds no prompts");
    }
    Ok(prompts)
}

fn prompt_of(value: &Value) -> Result<String> {
    match value {
        Value::String(s) => Ok(s.clone()),
        Value::Object(o) => {
            for key in ["prompt", "text", "input_text"] {
                if let Some(Value::String(s)) = o.get(key) {
                    return Ok(s.clone());
                }
            }
            // MT-bench records carry their turns in a list.
            if let Some(Value::Array(turns)) = o.get("turns") {
                if let Some(Value::String(s)) = turns.first() {
                    return Ok(s.clone());
                }
            }
            bail!("expected a string or an object with \"prompt\", \"text\" or \"turns\"")
        }
        _ => bail!("expected a string or an object with \"prompt\""),
    }
}

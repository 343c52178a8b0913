//! Prompt sets for self-distillation: ShareGPT conversations (the first human turn), GSM8K
//! JSONL (`question`), MT-bench (`turns[0]`), or plain lists of strings / `{"prompt": …}`.

use crate::error::{file_err, invalid, Result};
use serde_json::Value;
use std::path::Path;

/// The text of one prompt record, whatever the data set's spelling.
fn prompt_of(value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => {
            for key in ["prompt", "question", "text", "input_text", "instruction"] {
                if let Some(Value::String(s)) = o.get(key) {
                    return Some(s.clone());
                }
            }
            if let Some(Value::Array(turns)) = o.get("conversations") {
                // ShareGPT: [{"from": "human", "value": …}, {"from": "gpt", …}, …]
                return turns.iter().find_map(|t| {
                    let from = t.get("from").and_then(Value::as_str)?;
                    if from == "human" || from == "user" {
                        t.get("value").and_then(Value::as_str).map(str::to_string)
                    } else {
                        None
                    }
                });
            }
            if let Some(Value::Array(turns)) = o.get("turns") {
                return turns.first().and_then(Value::as_str).map(str::to_string);
            }
            None
        }
        _ => None,
    }
}

/// Reads every prompt of `path` (a JSON list or JSONL), skipping records without one and
/// blank prompts. Errors name the file and, for JSONL, the line.
pub fn read_prompts(path: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(path).map_err(|e| file_err(path, e))?;
    let mut out = Vec::new();
    if let Ok(Value::Array(items)) = serde_json::from_str::<Value>(&text) {
        out.extend(items.iter().filter_map(prompt_of));
    } else {
        for (n, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let value: Value = serde_json::from_str(line).map_err(|e| {
                file_err(
                    path,
                    format!(
                        "line {} is not JSON ({e}): expected a JSON list or JSONL",
                        n + 1
                    ),
                )
            })?;
            out.extend(prompt_of(&value));
        }
    }
    out.retain(|p| !p.trim().is_empty());
    if out.is_empty() {
        return Err(invalid(format!(
            "{}: holds no prompts (expected ShareGPT conversations, GSM8K questions, or strings / {{\"prompt\": …}} records)",
            path.display()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_sharegpt_gsm8k_and_plain_lists() {
        let dir = tempfile::tempdir().unwrap();
        let sg = dir.path().join("sg.json");
        std::fs::write(
            &sg,
            r#"[{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
                {"id": "b", "conversations": [{"from": "gpt", "value": "only gpt"}]},
                "plain", {"prompt": "p"}]"#,
        )
        .unwrap();
        assert_eq!(read_prompts(&sg).unwrap(), vec!["hi", "plain", "p"]);
        let gsm = dir.path().join("g.jsonl");
        std::fs::write(
            &gsm,
            "{\"question\": \"1+1?\", \"answer\": \"2\"}\n\n{\"question\": \"2+2?\"}\n",
        )
        .unwrap();
        assert_eq!(read_prompts(&gsm).unwrap(), vec!["1+1?", "2+2?"]);
        let bad = dir.path().join("bad.jsonl");
        std::fs::write(&bad, "{\"question\": \"x\"}\nnot json\n").unwrap();
        let err = read_prompts(&bad).unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }
}

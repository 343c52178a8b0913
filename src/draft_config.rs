//! `--draft_target_model_config "[draft_len,[draft devices],[target devices],use_logits]"`,
//! TensorRT-LLM's spelling: a Python-like list such as `[4,[0],[1],False]`. Device entries are
//! CUDA ordinals (`0` → `cuda:0`), `cpu` or `cuda:N`; `use_logits` is `True`/`False` (any case
//! of `true`/`false`). Also `--prompt_lookup_config "[num_tokens,max_ngram(,[target devices])]"`,
//! the other draft TensorRT-LLM feeds through external draft tokens.

use kestrel_spec::PromptLookupConfig;

/// The parsed `--draft_target_model_config`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftTargetModelConfig {
    /// Draft tokens proposed per step (≥ 1).
    pub draft_len: usize,
    /// One device per tensor-parallel rank of the draft engine: "cpu" or "cuda:N".
    pub draft_devices: Vec<String>,
    /// One device per tensor-parallel rank of the target engine: "cpu" or "cuda:N".
    pub target_devices: Vec<String>,
    /// true: rejection sampling on both models' distributions; false: token matching.
    pub use_logits: bool,
}

const FLAG: &str = "--draft_target_model_config";
const SHAPE: &str = "expected [draft_len,[draft devices],[target devices],use_logits]";

impl DraftTargetModelConfig {
    /// Parses the flag's value; errors quote the value and say what was expected.
    pub fn parse(s: &str) -> Result<Self, String> {
        let fail = |what: String| format!("{FLAG} \"{s}\": {what}");
        let malformed = || fail(SHAPE.to_string());
        let parts = list_entries(s).ok_or_else(malformed)?;
        let [len, draft, target, logits] = parts.as_slice() else {
            return Err(malformed());
        };
        if len.contains('[') || logits.contains('[') {
            return Err(malformed());
        }
        let draft_len: usize = len
            .parse()
            .map_err(|_| fail(format!("draft_len must be a positive integer, got '{len}'")))?;
        if draft_len == 0 {
            return Err(fail("draft_len must be at least 1".into()));
        }
        let draft_devices =
            device_list(draft, "draft").map_err(|e| fail(e.unwrap_or(SHAPE.into())))?;
        let target_devices =
            device_list(target, "target").map_err(|e| fail(e.unwrap_or(SHAPE.into())))?;
        let use_logits = match logits.to_ascii_lowercase().as_str() {
            "true" => true,
            "false" => false,
            _ => {
                return Err(fail(format!(
                    "use_logits must be True or False, got '{logits}'"
                )))
            }
        };
        Ok(DraftTargetModelConfig {
            draft_len,
            draft_devices,
            target_devices,
            use_logits,
        })
    }

    /// Checks that each device list has one entry per tensor-parallel rank of its engine.
    pub fn validate_against(&self, tp_draft: usize, tp_target: usize) -> Result<(), String> {
        for (who, devices, tp) in [
            ("draft", &self.draft_devices, tp_draft),
            ("target", &self.target_devices, tp_target),
        ] {
            if devices.len() != tp {
                return Err(format!(
                    "{FLAG} lists {} {who} device(s) but the {who} engine has tp_size {tp}: list one device per tensor-parallel rank",
                    devices.len()
                ));
            }
        }
        Ok(())
    }
}

/// The parsed `--prompt_lookup_config "[prompt_lookup_num_tokens,max_matching_ngram_size]"`,
/// TensorRT-LLM's spelling, optionally with its third entry, the target's devices
/// (`[10,2,[0]]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptLookupFlag {
    pub lookup: PromptLookupConfig,
    /// One device per tensor-parallel rank of the engine, when given ("cpu" or "cuda:N").
    pub target_devices: Option<Vec<String>>,
}

const LOOKUP_FLAG: &str = "--prompt_lookup_config";
const LOOKUP_SHAPE: &str =
    "expected [prompt_lookup_num_tokens,max_matching_ngram_size] or [num_tokens,ngram_size,[target devices]]";

impl PromptLookupFlag {
    /// Parses the flag's value; errors quote the value and say what was expected.
    pub fn parse(s: &str) -> Result<Self, String> {
        let fail = |what: String| format!("{LOOKUP_FLAG} \"{s}\": {what}");
        let malformed = || fail(LOOKUP_SHAPE.to_string());
        let parts = list_entries(s).ok_or_else(malformed)?;
        let (tokens, ngram, devices) = match parts.as_slice() {
            [t, n] => (t.as_str(), n.as_str(), None),
            [t, n, d] => (t.as_str(), n.as_str(), Some(d.as_str())),
            _ => return Err(malformed()),
        };
        let count = |name: &str, v: &str| -> Result<usize, String> {
            v.parse()
                .map_err(|_| fail(format!("{name} must be a positive integer, got '{v}'")))
        };
        let lookup = PromptLookupConfig::new(
            count("prompt_lookup_num_tokens", tokens)?,
            count("max_matching_ngram_size", ngram)?,
        )
        .map_err(|e| fail(e.to_string()))?;
        let target_devices = devices
            .map(|d| device_list(d, "target").map_err(|e| fail(e.unwrap_or(LOOKUP_SHAPE.into()))))
            .transpose()?;
        Ok(PromptLookupFlag {
            lookup,
            target_devices,
        })
    }
}

/// The top-level entries of a bracketed list such as `[4, [0], [1], False]`, whitespace
/// removed; `None` when it is not one.
fn list_entries(s: &str) -> Option<Vec<String>> {
    let compact: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let inner = compact.strip_prefix('[')?.strip_suffix(']')?;
    Some(
        split_top_level(inner)?
            .into_iter()
            .map(String::from)
            .collect(),
    )
}

/// Splits at the commas outside brackets; `None` when brackets do not balance, nest deeper
/// than one level or an entry is empty.
fn split_top_level(s: &str) -> Option<Vec<&str>> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => {
                depth += 1;
                if depth > 1 {
                    return None;
                }
            }
            ']' => depth = depth.checked_sub(1)?,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return None;
    }
    parts.push(&s[start..]);
    if parts.iter().any(|p| p.is_empty()) {
        return None;
    }
    Some(parts)
}

/// `[0,1]` / `[cpu]` / `['cuda:0']` → device names. `Err(None)` = not a bracketed list.
fn device_list(s: &str, who: &str) -> Result<Vec<String>, Option<String>> {
    let inner = s
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .ok_or(None)?;
    if inner.is_empty() {
        return Err(Some(format!(
            "the {who} device list is empty: list one device per tensor-parallel rank"
        )));
    }
    inner
        .split(',')
        .map(|entry| device(entry).ok_or_else(|| {
            Some(format!(
                "unknown device '{entry}' in the {who} device list: expected a CUDA ordinal (0, 1, ...), cpu or cuda:N"
            ))
        }))
        .collect()
}

fn device(entry: &str) -> Option<String> {
    let unquoted = ['\'', '"']
        .iter()
        .find_map(|&q| entry.strip_prefix(q).and_then(|r| r.strip_suffix(q)))
        .unwrap_or(entry);
    let lower = unquoted.to_ascii_lowercase();
    let ordinal = |d: &str| -> Option<String> {
        (!d.is_empty() && d.chars().all(|c| c.is_ascii_digit()))
            .then(|| d.parse::<usize>().ok().map(|n| format!("cuda:{n}")))
            .flatten()
    };
    if lower == "cpu" {
        Some("cpu".into())
    } else if let Some(d) = lower.strip_prefix("cuda:") {
        ordinal(d)
    } else {
        ordinal(&lower)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompt_lookup_takes_trt_llm_spellings_and_names_what_is_wrong() {
        let f = PromptLookupFlag::parse("[10,2]").unwrap();
        assert_eq!(f.lookup, PromptLookupConfig::new(10, 2).unwrap());
        assert_eq!(f.target_devices, None);
        let f = PromptLookupFlag::parse(" [4, 3, [0]] ").unwrap();
        assert_eq!(f.lookup, PromptLookupConfig::new(4, 3).unwrap());
        assert_eq!(f.target_devices, Some(vec!["cuda:0".to_string()]));
        let err = |s: &str| PromptLookupFlag::parse(s).unwrap_err();
        assert_eq!(
            err("[4]"),
            "--prompt_lookup_config \"[4]\": expected [prompt_lookup_num_tokens,max_matching_ngram_size] or [num_tokens,ngram_size,[target devices]]"
        );
        assert_eq!(
            err("[x,2]"),
            "--prompt_lookup_config \"[x,2]\": prompt_lookup_num_tokens must be a positive integer, got 'x'"
        );
        assert_eq!(
            err("[4,0]"),
            "--prompt_lookup_config \"[4,0]\": max_matching_ngram_size must be at least 1"
        );
        assert_eq!(
            err("[4,2,[gpu]]"),
            "--prompt_lookup_config \"[4,2,[gpu]]\": unknown device 'gpu' in the target device list: expected a CUDA ordinal (0, 1, ...), cpu or cuda:N"
        );
    }

    fn err(s: &str) -> String {
        DraftTargetModelConfig::parse(s).unwrap_err()
    }

    #[test]
    fn parses_trt_llm_spellings() {
        let c = DraftTargetModelConfig::parse("[4,[0],[1],False]").unwrap();
        assert_eq!(
            c,
            DraftTargetModelConfig {
                draft_len: 4,
                draft_devices: vec!["cuda:0".into()],
                target_devices: vec!["cuda:1".into()],
                use_logits: false,
            }
        );
        let c = DraftTargetModelConfig::parse(" [ 4, [cpu], [cuda:0, 3], True ] ").unwrap();
        assert_eq!(c.draft_len, 4);
        assert_eq!(c.draft_devices, vec!["cpu"]);
        assert_eq!(c.target_devices, vec!["cuda:0", "cuda:3"]);
        assert!(c.use_logits);
        let c = DraftTargetModelConfig::parse("[10,['cpu'],[\"CPU\"],true]").unwrap();
        assert_eq!(c.draft_len, 10);
        assert_eq!(c.draft_devices, vec!["cpu"]);
        assert_eq!(c.target_devices, vec!["cpu"]);
        assert!(c.use_logits);
        assert!(
            !DraftTargetModelConfig::parse("[1,[4,5,6,7],[0],false]")
                .unwrap()
                .use_logits
        );
    }

    #[test]
    fn malformed_strings_name_the_expected_shape() {
        for s in [
            "[4,[0]]",
            "4,[0],[0],False",
            "[4,[0],[0],False",
            "[4,[0],[0],False,True]",
            "[4,[[0]],[0],False]",
            "[4,0,[0],False]",
            "[4,[0],[0],[False]]",
            "[[4],[0],[0],False]",
            "[4,[0],,False]",
            "",
            "[]",
        ] {
            assert_eq!(
                err(s),
                format!(
                    "--draft_target_model_config \"{s}\": expected [draft_len,[draft devices],[target devices],use_logits]"
                ),
                "{s}"
            );
        }
    }

    #[test]
    fn bad_fields_are_named() {
        assert_eq!(
            err("[0,[0],[0],False]"),
            "--draft_target_model_config \"[0,[0],[0],False]\": draft_len must be at least 1"
        );
        assert_eq!(
            err("[-1,[0],[0],False]"),
            "--draft_target_model_config \"[-1,[0],[0],False]\": draft_len must be a positive integer, got '-1'"
        );
        assert_eq!(
            err("[four,[0],[0],False]"),
            "--draft_target_model_config \"[four,[0],[0],False]\": draft_len must be a positive integer, got 'four'"
        );
        assert_eq!(
            err("[4,[0],[0],yes]"),
            "--draft_target_model_config \"[4,[0],[0],yes]\": use_logits must be True or False, got 'yes'"
        );
        assert_eq!(
            err("[4,[],[0],False]"),
            "--draft_target_model_config \"[4,[],[0],False]\": the draft device list is empty: list one device per tensor-parallel rank"
        );
        assert_eq!(
            err("[4,[0],[gpu1],False]"),
            "--draft_target_model_config \"[4,[0],[gpu1],False]\": unknown device 'gpu1' in the target device list: expected a CUDA ordinal (0, 1, ...), cpu or cuda:N"
        );
        assert_eq!(
            err("[4,[cuda:x],[0],False]"),
            "--draft_target_model_config \"[4,[cuda:x],[0],False]\": unknown device 'cuda:x' in the draft device list: expected a CUDA ordinal (0, 1, ...), cpu or cuda:N"
        );
        assert_eq!(
            err("[4,[0,],[0],False]"),
            "--draft_target_model_config \"[4,[0,],[0],False]\": unknown device '' in the draft device list: expected a CUDA ordinal (0, 1, ...), cpu or cuda:N"
        );
    }

    #[test]
    fn device_counts_must_match_tp_sizes() {
        let c = DraftTargetModelConfig::parse("[4,[0],[1,2],False]").unwrap();
        assert!(c.validate_against(1, 2).is_ok());
        assert_eq!(
            c.validate_against(2, 2).unwrap_err(),
            "--draft_target_model_config lists 1 draft device(s) but the draft engine has tp_size 2: list one device per tensor-parallel rank"
        );
        assert_eq!(
            c.validate_against(1, 1).unwrap_err(),
            "--draft_target_model_config lists 2 target device(s) but the target engine has tp_size 1: list one device per tensor-parallel rank"
        );
    }
}

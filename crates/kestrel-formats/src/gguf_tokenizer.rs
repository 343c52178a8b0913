//! A `tokenizers::Tokenizer` rebuilt from GGUF tokenizer metadata (byte-level BPE only).

use crate::error::{one_line, FormatError};
use crate::gguf::Metadata;
use serde_json::{json, Map, Value};
use std::str::FromStr;

/// GGUF `token_type` of control tokens (`<|im_start|>`, ...), added as special tokens.
const TOKEN_TYPE_CONTROL: i64 = 3;
/// GGUF `token_type` of user-defined tokens, added as plain (non-special) added tokens.
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// Llama-3's pre-tokenizer split, as llama.cpp and HF write it.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// GPT-2's byte-to-character table: the alphabet byte-level BPE tokens are spelled in.
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = (b'!'..=b'~').contains(&(b as u8))
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or('\u{FFFD}');
    }
    table
}

fn pre_tokenizer(pre: &str, path: &std::path::Path) -> Result<Value, FormatError> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    Ok(match pre {
        // SmolLM's tokenizer.json: single digits, then GPT-2's byte-level split.
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true},
            byte_level(true),
        ]}),
        "gpt2" | "default" => byte_level(true),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" => {
            json!({"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": LLAMA3_SPLIT}, "behavior": "Isolated", "invert": false},
                byte_level(false),
            ]})
        }
        other => {
            return Err(FormatError::file(
                path,
                format!("tokenizer pre-tokenizer '{other}' (tokenizer.ggml.pre) is not supported: Kestrel knows smollm, gpt2, default and llama-bpe; convert the HF checkpoint (with its tokenizer.json) instead"),
            ))
        }
    })
}

/// Builds the tokenizer a GGUF file describes, or `None` when it carries no vocabulary.
pub(crate) fn build_tokenizer(md: &Metadata) -> Result<Option<tokenizers::Tokenizer>, FormatError> {
    let path = md.path;
    let Some(tokens) = md.opt_strings("tokenizer.ggml.tokens")? else {
        return Ok(None);
    };
    let model = md.opt_str("tokenizer.ggml.model")?.unwrap_or("");
    if model != "gpt2" {
        return Err(FormatError::file(
            path,
            format!("tokenizer model '{model}' (tokenizer.ggml.model) is not supported: only byte-level BPE ('gpt2') tokenizers are read from GGUF; convert the HF checkpoint instead"),
        ));
    }
    let merges = md.opt_strings("tokenizer.ggml.merges")?.ok_or_else(|| {
        FormatError::file(
            path,
            "GGUF metadata key 'tokenizer.ggml.merges' is missing: a BPE tokenizer needs its merges",
        )
    })?;
    let types = md
        .opt_ints("tokenizer.ggml.token_type")?
        .unwrap_or_default();
    let pre = md.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");

    // Tokens outside the byte alphabet are respelled in it, as HF's GGUF reader does.
    let alphabet = byte_alphabet();
    let in_alphabet = |c: char| alphabet.contains(&c);
    let mut vocab = Map::new();
    for (id, token) in tokens.iter().enumerate() {
        let spelled = if token.chars().all(in_alphabet) {
            token.to_string()
        } else {
            token.bytes().map(|b| alphabet[b as usize]).collect()
        };
        vocab.insert(spelled, json!(id));
    }
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for merge in &merges {
        let Some((a, b)) = merge.split_once(' ') else {
            return Err(FormatError::file(
                path,
                format!("BPE merge '{merge}' (tokenizer.ggml.merges) is not two tokens separated by a space: the file is corrupt"),
            ));
        };
        merge_pairs.push(json!([a, b]));
    }

    let mut added = Vec::new();
    for (id, token) in tokens.iter().enumerate() {
        let kind = types.get(id).copied().unwrap_or(1);
        let special = match kind {
            TOKEN_TYPE_CONTROL if token.chars().all(in_alphabet) => true,
            TOKEN_TYPE_USER_DEFINED => false,
            _ => continue,
        };
        added.push(
            json!({"id": id, "content": token, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": special}),
        );
    }

    let add_bos = md
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let bos = md.opt_u32("tokenizer.ggml.bos_token_id")?;
    let post_processor = match (add_bos, bos.and_then(|b| tokens.get(b as usize))) {
        (true, Some(bos_token)) => {
            let bos_id = bos.unwrap_or(0);
            json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": bos_token, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": bos_token, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {*bos_token: {"id": bos_token, "ids": [bos_id], "tokens": [bos_token]}}})
        }
        _ => {
            json!({"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true})
        }
    };

    let spec = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(pre, path)?,
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merge_pairs},
    });
    let tokenizer = tokenizers::Tokenizer::from_str(&spec.to_string()).map_err(|e| {
        FormatError::file(
            path,
            format!(
                "cannot build a tokenizer from the GGUF metadata ({}): the tokenizer.ggml.* keys are inconsistent",
                one_line(e)
            ),
        )
    })?;
    Ok(Some(tokenizer))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_alphabet_matches_gpt2() {
        let a = byte_alphabet();
        assert_eq!(a[b' ' as usize], 'Ġ');
        assert_eq!(a[b'\n' as usize], 'Ċ');
        assert_eq!(a[b'A' as usize], 'A');
        assert_eq!(a[0], 'Ā');
    }
}

//! The real SmolLM2-135M-Instruct Q4_1 GGUF against what HF transformers 5.24 reads from the
//! same file (`tests/fixtures/smollm2/expected.json` at the repository root, written by
//! `tools/smollm2_reference.py`): config, dequantised tensor probes (after undoing llama.cpp's
//! Q/K permutation), tokenizer ids and the chat template.

mod common;

use common::*;
use kestrel_formats::load_gguf;
use serde_json::Value;

fn expected() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/smollm2/expected.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let want = expected();
    let ckpt = load_gguf(&smollm2_gguf()).unwrap();
    let c = &ckpt.config;
    let wc = &want["config"];
    assert_eq!(c.hidden_size as u64, wc["hidden_size"].as_u64().unwrap());
    assert_eq!(c.num_hidden_layers, 30);
    assert_eq!(c.intermediate_size, 1536);
    assert_eq!(
        (c.num_attention_heads, c.num_kv_heads(), c.head_dim()),
        (9, 3, 64)
    );
    assert_eq!(c.vocab_size, 49152);
    assert!(c.tie_word_embeddings);
    assert_eq!(c.rope_theta, 100000.0);
    assert_eq!(c.rms_norm_eps, wc["rms_norm_eps"].as_f64().unwrap());
    assert_eq!(c.max_position_embeddings, 8192);
    assert_eq!(
        (c.bos_token_id, c.eos_token_ids(), c.pad_token_id),
        (Some(1), vec![2], Some(2))
    );
    assert_eq!(ckpt.tensors.len(), 2 + 30 * 9);
    assert!(!ckpt.tensors.contains_key("lm_head.weight"));

    let probes = want["loader"]["probes"].as_object().unwrap();
    assert!(probes.len() >= 8);
    for (name, probe) in probes {
        let t = &ckpt.tensors[name];
        let shape: Vec<usize> = probe["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        assert_eq!(t.dims(), shape.as_slice(), "{name}");
        let v = values(t);
        for (i, w) in probe["row0_first8"].as_array().unwrap().iter().enumerate() {
            let w = w.as_f64().unwrap() as f32;
            assert_eq!(v[i], w, "{name}[{i}]");
        }
        let sum: f64 = v.iter().map(|&x| x as f64).sum();
        let want_sum = probe["sum_f64"].as_f64().unwrap();
        assert!(
            (sum - want_sum).abs() <= 1e-6 * want_sum.abs().max(1.0),
            "{name}: {sum} vs {want_sum}"
        );
    }

    let tok = ckpt.tokenizer.as_ref().unwrap();
    let wt = &want["tokenizer"];
    assert_eq!(tok.get_vocab_size(true), 49152);
    for case in wt["strings"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let ids: Vec<u32> = case["ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|i| i.as_u64().unwrap() as u32)
            .collect();
        let enc = tok.encode(text, true).unwrap();
        assert_eq!(enc.get_ids(), ids.as_slice(), "{text:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case["decoded"].as_str().unwrap()
        );
    }
    for prompt in want["prompts"].as_array().unwrap() {
        for (text_key, ids_key) in [("text", "raw_ids"), ("templated_text", "templated_ids")] {
            let text = prompt[text_key].as_str().unwrap();
            let ids: Vec<u32> = prompt[ids_key]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| i.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(
                tok.encode(text, true).unwrap().get_ids(),
                ids.as_slice(),
                "{text:?}"
            );
        }
    }
    // Digits are split one by one (SmolLM's tokenizer.json), unicode and specials round-trip.
    let extra: &[(&str, &[u32])] = &[
        ("Hello, world!", &[19556, 28, 905, 17]),
        (
            "héllo wörld 日本語 🙂",
            &[
                88, 2756, 31394, 267, 29989, 400, 17097, 241, 115, 40993, 179, 120, 248, 47526,
            ],
        ),
        (
            "<|im_start|>user\nHi there<|im_end|>\n",
            &[1, 4093, 198, 26843, 665, 2, 198],
        ),
    ];
    for (text, ids) in extra {
        assert_eq!(tok.encode(*text, true).unwrap().get_ids(), *ids, "{text:?}");
    }
    assert_eq!(
        ckpt.chat_template.as_deref(),
        Some(wt["chat_template"].as_str().unwrap())
    );
}

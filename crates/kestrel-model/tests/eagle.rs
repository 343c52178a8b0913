//! The EAGLE head: paged forward vs the naive reference, training forward vs paged forward,
//! and gradients reaching its `Var`s.

mod common;

use candle_core::{Device, Tensor};
use candle_nn::{VarBuilder, VarMap};
use common::*;
use kestrel_core::DType;
use kestrel_model::llama::random_tensors;
use kestrel_model::{EagleHead, EagleSeqInput, Llama, OutputRows};

fn feats(n: usize, h: usize, salt: f32) -> Vec<Vec<f32>> {
    (0..n)
        .map(|i| {
            (0..h)
                .map(|j| ((i * 31 + j * 7) as f32 * 0.37 + salt).sin())
                .collect()
        })
        .collect()
}

fn tensor(rows: &[Vec<f32>]) -> Tensor {
    let h = rows[0].len();
    Tensor::from_vec(rows.concat(), (rows.len(), h), &Device::Cpu).unwrap()
}

#[test]
fn head_forward_matches_reference_with_own_or_base_embedding_and_stacked_layers() {
    let cfg = tiny_cfg(4, 2, true, false);
    let base = Llama::random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let base_w = Weights::new(&random_tensors(&cfg, 3).unwrap());
    let h = cfg.hidden_size;
    for (own, layers) in [(false, 1), (true, 1), (false, 3)] {
        let mut hc = head_cfg(&cfg);
        hc.llama.num_hidden_layers = layers;
        let ht = random_head_tensors(&hc, 8, own);
        let w = Weights::new(&ht);
        let head =
            EagleHead::from_tensors(&hc, ht.clone(), &base, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(head.has_own_embedding(), own);
        assert_eq!(head.num_layers(), layers);
        let embed = if own {
            &w.0["embed_tokens.weight"].1
        } else {
            &base_w.0["model.embed_tokens.weight"].1
        };
        let mut cache = head.new_cache(16, 2).unwrap();
        let s = cache.add_sequence();
        let t = [4u32, 8, 15, 16, 23, 42];
        let f = feats(6, h, 0.5);
        // Prefill 4 causally, then a 2-token chunk with a mask where token 5 does not see 4.
        let p1 = [0u32, 1, 2, 3];
        let out1 = head
            .forward(
                &base,
                &[EagleSeqInput {
                    seq: s,
                    tokens: &t[..4],
                    features: tensor(&f[..4]),
                    positions: &p1,
                    mask: None,
                    output_rows: OutputRows::All,
                }],
                &mut cache,
            )
            .unwrap();
        let p2 = [4u32, 4];
        let mask = [true, false, false, true];
        let out2 = head
            .forward(
                &base,
                &[EagleSeqInput {
                    seq: s,
                    tokens: &t[4..],
                    features: tensor(&f[4..]),
                    positions: &p2,
                    mask: Some(&mask),
                    output_rows: OutputRows::All,
                }],
                &mut cache,
            )
            .unwrap();
        let pos = [0u32, 1, 2, 3, 4, 4];
        let want = eagle(&hc, &w, embed, &t, &f, &pos, &|i, j| {
            j <= i && !(i == 5 && j == 4)
        });
        let got: Vec<Vec<f32>> = rows(&out1).into_iter().chain(rows(&out2)).collect();
        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
            let d = max_abs_diff(a, b);
            assert!(d < 1e-4, "own {own}, {layers} layers, row {i}: {d}");
        }
        // Logits through the base LM head.
        assert_eq!(base.logits(&out2).unwrap().dims(), &[2, cfg.vocab_size]);
    }
}

#[test]
fn train_forward_equals_paged_forward_and_backprops() {
    let cfg = tiny_cfg(4, 2, false, false);
    let base = Llama::random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let mut hc = head_cfg(&cfg);
    hc.llama.num_hidden_layers = 2;
    let h = cfg.hidden_size;
    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, candle_core::DType::F32, &Device::Cpu);
    let head = EagleHead::from_var_builder(&hc, vb, &base).unwrap();
    assert!(!head.has_own_embedding());
    assert!(varmap.data().lock().unwrap().contains_key("fc.weight"));

    let (b, t) = (2, 5);
    let tokens: Vec<u32> = (0..(b * t) as u32).map(|i| (i * 13 + 1) % 61).collect();
    let f: Vec<Vec<f32>> = feats(b * t, h, 1.0);
    let tok_t = Tensor::from_vec(tokens.clone(), (b, t), &Device::Cpu).unwrap();
    let feat_t = tensor(&f).reshape((b, t, h)).unwrap();
    let out = head.forward_train(&tok_t, &feat_t).unwrap();
    assert_eq!(out.dims(), &[b, t, h]);

    // Same numbers as the paged inference forward of each row of the batch.
    let mut cache = head.new_cache(16, 4).unwrap();
    for r in 0..b {
        let s = cache.add_sequence();
        let pos: Vec<u32> = (0..t as u32).collect();
        let got = head
            .forward(
                &base,
                &[EagleSeqInput {
                    seq: s,
                    tokens: &tokens[r * t..(r + 1) * t],
                    features: tensor(&f[r * t..(r + 1) * t]),
                    positions: &pos,
                    mask: None,
                    output_rows: OutputRows::All,
                }],
                &mut cache,
            )
            .unwrap();
        let want = out.get(r).unwrap();
        assert!(max_abs_diff(&to_vec(&got), &to_vec(&want)) < 1e-5);
    }

    // Gradients reach the variables.
    let loss = out.sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let data = varmap.data().lock().unwrap();
    for name in [
        "fc.weight",
        "fc.bias",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.down_proj.weight",
        "layers.0.post_attention_layernorm.weight",
        "layers.1.input_layernorm.weight",
        "layers.1.self_attn.k_proj.weight",
        "layers.1.mlp.down_proj.weight",
    ] {
        let g = grads
            .get(data[name].as_tensor())
            .unwrap_or_else(|| panic!("no grad for {name}"));
        let norm: f32 = g.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 0.0, "{name}");
    }
}

#[test]
fn missing_head_tensor_is_named() {
    let cfg = tiny_cfg(4, 2, true, false);
    let base = Llama::random(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let hc = head_cfg(&cfg);
    let mut ht = random_head_tensors(&hc, 8, false);
    ht.remove("fc.bias");
    let err = EagleHead::from_tensors(&hc, ht, &base, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(err.contains("fc.bias"), "{err}");
}

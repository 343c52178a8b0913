//! A naive, cache-free f32 reference of the Llama decoder and the EAGLE head, written
//! directly from the HF definitions over plain vectors.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use kestrel_core::{EagleHeadConfig, ModelConfig};
use kestrel_model::{Llama, OutputRows, PagedKvCache, SeqId, SeqInput};
use std::collections::BTreeMap;

pub fn tiny_cfg(heads: usize, kv: usize, tied: bool, llama3: bool) -> ModelConfig {
    let scaling = if llama3 {
        r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32}, "rope_theta": 500000.0"#
    } else {
        ""
    };
    serde_json::from_str(&format!(
        r#"{{"vocab_size": 61, "hidden_size": {}, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": {heads}, "num_key_value_heads": {kv},
            "head_dim": 8, "rms_norm_eps": 1e-5, "tie_word_embeddings": {tied}{scaling}}}"#,
        heads * 8 - 4
    ))
    .unwrap()
}

/// MHA, GQA, MQA, tied and untied, with and without llama3 scaling.
pub fn all_cfgs() -> Vec<(&'static str, ModelConfig)> {
    vec![
        ("mha-untied", tiny_cfg(4, 4, false, false)),
        ("gqa-tied", tiny_cfg(4, 2, true, false)),
        ("mqa-llama3", tiny_cfg(4, 1, false, true)),
        ("gqa-llama3-tied", tiny_cfg(6, 2, true, true)),
    ]
}

pub fn head_cfg(base: &ModelConfig) -> EagleHeadConfig {
    let mut llama = base.clone();
    llama.num_hidden_layers = 1;
    llama.num_attention_heads = 4;
    llama.num_key_value_heads = Some(2);
    llama.head_dim = Some(6);
    llama.intermediate_size = 24;
    llama.rope_theta = 10000.0;
    llama.rope_scaling = None;
    EagleHeadConfig {
        llama,
        bias: true,
        feature_layers: Vec::new(),
    }
}

pub fn to_vec(t: &Tensor) -> Vec<f32> {
    t.to_dtype(candle_core::DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

pub fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    let t = t.to_dtype(candle_core::DType::F32).unwrap();
    t.to_vec2().unwrap()
}

pub struct Weights(pub BTreeMap<String, (Vec<usize>, Vec<f32>)>);

impl Weights {
    pub fn new(tensors: &BTreeMap<String, Tensor>) -> Self {
        Weights(
            tensors
                .iter()
                .map(|(k, t)| (k.clone(), (t.dims().to_vec(), to_vec(t))))
                .collect(),
        )
    }
    fn get(&self, name: &str) -> &(Vec<usize>, Vec<f32>) {
        self.0
            .get(name)
            .unwrap_or_else(|| panic!("reference: no tensor {name}"))
    }
    /// `W x` for `W: [out, in]`.
    fn lin(&self, name: &str, x: &[f32]) -> Vec<f32> {
        let (shape, w) = self.get(name);
        let (o, i) = (shape[0], shape[1]);
        assert_eq!(x.len(), i, "{name}");
        (0..o)
            .map(|r| (0..i).map(|c| w[r * i + c] * x[c]).sum())
            .collect()
    }
    fn norm(&self, name: &str, x: &[f32], eps: f64) -> Vec<f32> {
        let (_, w) = self.get(name);
        let var = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
        let r = 1.0 / (var + eps as f32).sqrt();
        x.iter().zip(w).map(|(v, g)| g * (v * r)).collect()
    }
}

pub struct LayerShape {
    pub heads: usize,
    pub kv: usize,
    pub hd: usize,
    pub eps: f64,
    pub inv_freq: Vec<f32>,
}

impl LayerShape {
    pub fn of(c: &ModelConfig) -> Self {
        LayerShape {
            heads: c.num_attention_heads,
            kv: c.num_kv_heads(),
            hd: c.head_dim(),
            eps: c.rms_norm_eps,
            inv_freq: kestrel_model::inv_freq(c.head_dim(), c.rope_theta, c.rope_scaling.as_ref()),
        }
    }
}

fn rope(v: &mut [f32], pos: u32, inv_freq: &[f32]) {
    let half = v.len() / 2;
    let orig = v.to_vec();
    for i in 0..half {
        let a = pos as f32 * inv_freq[i];
        let (c, s) = (a.cos(), a.sin());
        v[i] = orig[i] * c - orig[i + half] * s;
        v[i + half] = orig[i + half] * c + orig[i] * s;
    }
}

/// One decoder layer over all tokens at once; `allowed(i, j)`: token i sees token j.
pub fn layer(
    w: &Weights,
    p: &str,
    s: &LayerShape,
    xs: &[Vec<f32>],
    positions: &[u32],
    allowed: &dyn Fn(usize, usize) -> bool,
    input_norm: bool,
) -> Vec<Vec<f32>> {
    let n = xs.len();
    let hs: Vec<Vec<f32>> = xs
        .iter()
        .map(|x| {
            if input_norm {
                w.norm(&format!("{p}.input_layernorm.weight"), x, s.eps)
            } else {
                x.clone()
            }
        })
        .collect();
    let mut q: Vec<Vec<f32>> = hs
        .iter()
        .map(|h| w.lin(&format!("{p}.self_attn.q_proj.weight"), h))
        .collect();
    let mut k: Vec<Vec<f32>> = hs
        .iter()
        .map(|h| w.lin(&format!("{p}.self_attn.k_proj.weight"), h))
        .collect();
    let v: Vec<Vec<f32>> = hs
        .iter()
        .map(|h| w.lin(&format!("{p}.self_attn.v_proj.weight"), h))
        .collect();
    for t in 0..n {
        for h in 0..s.heads {
            rope(
                &mut q[t][h * s.hd..(h + 1) * s.hd],
                positions[t],
                &s.inv_freq,
            );
        }
        for h in 0..s.kv {
            rope(
                &mut k[t][h * s.hd..(h + 1) * s.hd],
                positions[t],
                &s.inv_freq,
            );
        }
    }
    let g = s.heads / s.kv;
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut attn = vec![0f32; s.heads * s.hd];
        for h in 0..s.heads {
            let kvh = h / g;
            let qh = &q[i][h * s.hd..(h + 1) * s.hd];
            let js: Vec<usize> = (0..n).filter(|&j| allowed(i, j)).collect();
            let scores: Vec<f32> = js
                .iter()
                .map(|&j| {
                    let kh = &k[j][kvh * s.hd..(kvh + 1) * s.hd];
                    qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() / (s.hd as f32).sqrt()
                })
                .collect();
            let m = scores.iter().cloned().fold(f32::MIN, f32::max);
            let e: Vec<f32> = scores.iter().map(|x| (x - m).exp()).collect();
            let z: f32 = e.iter().sum();
            for (idx, &j) in js.iter().enumerate() {
                for d in 0..s.hd {
                    attn[h * s.hd + d] += e[idx] / z * v[j][kvh * s.hd + d];
                }
            }
        }
        let o = w.lin(&format!("{p}.self_attn.o_proj.weight"), &attn);
        let x: Vec<f32> = xs[i].iter().zip(&o).map(|(a, b)| a + b).collect();
        let h2 = w.norm(&format!("{p}.post_attention_layernorm.weight"), &x, s.eps);
        let gate = w.lin(&format!("{p}.mlp.gate_proj.weight"), &h2);
        let up = w.lin(&format!("{p}.mlp.up_proj.weight"), &h2);
        let act: Vec<f32> = gate
            .iter()
            .zip(&up)
            .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
            .collect();
        let d = w.lin(&format!("{p}.mlp.down_proj.weight"), &act);
        out.push(x.iter().zip(&d).map(|(a, b)| a + b).collect());
    }
    out
}

/// Final-normed hidden states of every token.
pub fn llama_hidden(
    cfg: &ModelConfig,
    w: &Weights,
    tokens: &[u32],
    positions: &[u32],
    allowed: &dyn Fn(usize, usize) -> bool,
) -> Vec<Vec<f32>> {
    let (shape, emb) = w.get("model.embed_tokens.weight");
    let h = shape[1];
    let mut xs: Vec<Vec<f32>> = tokens
        .iter()
        .map(|&t| emb[t as usize * h..(t as usize + 1) * h].to_vec())
        .collect();
    let s = LayerShape::of(cfg);
    for l in 0..cfg.num_hidden_layers {
        xs = layer(
            w,
            &format!("model.layers.{l}"),
            &s,
            &xs,
            positions,
            allowed,
            true,
        );
    }
    xs.iter()
        .map(|x| w.norm("model.norm.weight", x, cfg.rms_norm_eps))
        .collect()
}

pub fn llama_logits(cfg: &ModelConfig, w: &Weights, hidden: &[f32]) -> Vec<f32> {
    let name = if cfg.tie_word_embeddings {
        "model.embed_tokens.weight"
    } else {
        "lm_head.weight"
    };
    w.lin(name, hidden)
}

/// Causal hidden states of a plain sequence at positions 0..n.
pub fn causal(cfg: &ModelConfig, w: &Weights, tokens: &[u32]) -> Vec<Vec<f32>> {
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    llama_hidden(cfg, w, tokens, &pos, &|i, j| j <= i)
}

/// EAGLE head outputs; `embed` is the head's own or the base's embedding.
pub fn eagle(
    head: &EagleHeadConfig,
    w: &Weights,
    embed: &[f32],
    tokens: &[u32],
    feats: &[Vec<f32>],
    positions: &[u32],
    allowed: &dyn Fn(usize, usize) -> bool,
) -> Vec<Vec<f32>> {
    let h = head.llama.hidden_size;
    let (_, bias) = w.get("fc.bias");
    let xs: Vec<Vec<f32>> = tokens
        .iter()
        .zip(feats)
        .map(|(&t, f)| {
            let mut inp = embed[t as usize * h..(t as usize + 1) * h].to_vec();
            inp.extend_from_slice(f);
            w.lin("fc.weight", &inp)
                .iter()
                .zip(bias)
                .map(|(a, b)| a + b)
                .collect()
        })
        .collect();
    // EAGLE's layer 0 has no input norm; the layers stacked after it do.
    (0..head.llama.num_hidden_layers).fold(xs, |xs, l| {
        layer(
            w,
            &format!("layers.{l}"),
            &LayerShape::of(&head.llama),
            &xs,
            positions,
            allowed,
            l > 0,
        )
    })
}

pub fn random_head_tensors(
    head: &EagleHeadConfig,
    seed: u64,
    own_embed: bool,
) -> BTreeMap<String, Tensor> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut out = BTreeMap::new();
    let mut names = kestrel_model::EagleHead::expected_tensors(head);
    if own_embed {
        names.push((
            "embed_tokens.weight".into(),
            vec![head.llama.vocab_size, head.llama.hidden_size],
        ));
    }
    for (name, shape) in names {
        let n: usize = shape.iter().product();
        let scale = if shape.len() == 2 {
            1.0 / (shape[1] as f32).sqrt()
        } else {
            0.3
        };
        let center = if name.contains("layernorm") { 1.0 } else { 0.0 };
        let data: Vec<f32> = (0..n)
            .map(|_| center + scale * rng.random_range(-1.0f32..1.0))
            .collect();
        out.insert(name, Tensor::from_vec(data, shape, &Device::Cpu).unwrap());
    }
    out
}

/// One sequence's forward over `tokens` at positions `start..` (causal without a `mask`),
/// every row out.
pub fn forward_rows(
    m: &Llama,
    cache: &mut PagedKvCache,
    seq: SeqId,
    tokens: &[u32],
    start: usize,
    mask: Option<&[bool]>,
) -> Tensor {
    let pos: Vec<u32> = (start as u32..(start + tokens.len()) as u32).collect();
    m.forward(
        &[SeqInput {
            seq,
            tokens,
            positions: &pos,
            mask,
            output_rows: OutputRows::All,
        }],
        cache,
    )
    .unwrap()
}

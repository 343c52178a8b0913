//! Tiny engines for runtime tests, built through the real checkpoint → spec-build path.

#![allow(dead_code)]

use candle_core::{DType, Device, Tensor};
use kestrel_build::{build_engine, AttentionKernel, BuildOptions, GemmPlugin, TargetDevice};
use kestrel_core::checkpoint::{
    checkpoint_config_json, rank_file_name, CheckpointMeta, EagleMeta, CHECKPOINT_FORMAT,
    CHECKPOINT_VERSION, CONFIG_FILE, EAGLE_PREFIX,
};
use kestrel_core::{DType as KDType, EagleHeadConfig, Mapping, ModelConfig, SpeculativeMode};
use kestrel_model::{OutputRows, SeqInput};
use kestrel_runtime::{generate, DecodeMode, Engine, GenerationParams, NoSink};
use kestrel_spec::SamplingParams;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

pub fn tiny_config(layers: usize) -> ModelConfig {
    serde_json::from_str(&format!(
        r#"{{"vocab_size": 48, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": {layers}, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "eos_token_id": 47, "bos_token_id": 0,
            "max_position_embeddings": 512}}"#
    ))
    .unwrap()
}

pub fn head_config(cfg: &ModelConfig) -> EagleHeadConfig {
    stacked_head_config(cfg, 1)
}

/// A head of `layers` decoder layers shaped like `cfg`'s.
pub fn stacked_head_config(cfg: &ModelConfig, layers: usize) -> EagleHeadConfig {
    let mut llama = cfg.clone();
    llama.num_hidden_layers = layers;
    EagleHeadConfig {
        llama,
        bias: true,
        feature_layers: Vec::new(),
    }
}

/// A head that predicts the base model well: fc passes the token embedding through, and its
/// layer is the base's first layer with attention switched off (the base's attention is made
/// weak and its final norm uniform, so the head's greedy choice mostly equals the target's).
pub fn agreeing_pair(
    seed: u64,
) -> (
    ModelConfig,
    BTreeMap<String, Tensor>,
    BTreeMap<String, Tensor>,
) {
    let cfg = tiny_config(1);
    let mut base = kestrel_model::llama::random_tensors(&cfg, seed).unwrap();
    let h = cfg.hidden_size;
    let o = "model.layers.0.self_attn.o_proj.weight".to_string();
    base.insert(o.clone(), (base[&o].clone() * 0.05).unwrap());
    base.insert(
        "model.norm.weight".into(),
        Tensor::ones(h, DType::F32, &Device::Cpu).unwrap(),
    );
    let mut head = BTreeMap::new();
    let eye = Tensor::eye(h, DType::F32, &Device::Cpu).unwrap();
    let zeros = Tensor::zeros((h, h), DType::F32, &Device::Cpu).unwrap();
    head.insert("fc.weight".into(), Tensor::cat(&[&eye, &zeros], 1).unwrap());
    head.insert(
        "fc.bias".into(),
        Tensor::zeros(h, DType::F32, &Device::Cpu).unwrap(),
    );
    for name in [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ] {
        head.insert(
            format!("layers.0.{name}.weight"),
            base[&format!("model.layers.0.{name}.weight")].clone(),
        );
    }
    head.insert(
        "layers.0.self_attn.o_proj.weight".into(),
        base[&o].zeros_like().unwrap(),
    );
    head.insert(
        "layers.0.post_attention_layernorm.weight".into(),
        base["model.layers.0.post_attention_layernorm.weight"].clone(),
    );
    (cfg, base, head)
}

/// A random head: it rarely agrees with the base.
pub fn random_head(cfg: &ModelConfig, seed: u64) -> BTreeMap<String, Tensor> {
    random_stacked_head(cfg, seed, 1)
}

/// A random head of `layers` decoder layers (layer 0 without an input norm, as EAGLE's).
pub fn random_stacked_head(
    cfg: &ModelConfig,
    seed: u64,
    layers: usize,
) -> BTreeMap<String, Tensor> {
    let mut stack = stacked_head_config(cfg, layers).llama;
    stack.tie_word_embeddings = true;
    let tensors = kestrel_model::llama::random_tensors(&stack, seed).unwrap();
    let mut head: BTreeMap<String, Tensor> = tensors
        .into_iter()
        .filter_map(|(k, v)| {
            k.strip_prefix("model.")
                .filter(|n| n.starts_with("layers."))
                .filter(|n| !n.starts_with("layers.0.input_layernorm"))
                .map(|n| (n.to_string(), v))
        })
        .collect();
    let h = cfg.hidden_size;
    head.insert("fc.weight".into(), seeded_uniform(seed, (h, 2 * h), 0.2));
    head.insert(
        "fc.bias".into(),
        Tensor::zeros(h, DType::F32, &Device::Cpu).unwrap(),
    );
    head
}

/// `shape` values uniform in ±std·√3 (standard deviation `std`) from a xorshift stream seeded
/// by `seed`: tests that compare heads need the same head in every run (`Tensor::randn` draws
/// from an unseeded generator, which made calibrate.rs's random-head test flaky).
pub fn seeded_uniform(seed: u64, shape: (usize, usize), std: f32) -> Tensor {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let half_width = std * 3f32.sqrt();
    let values: Vec<f32> = (0..shape.0 * shape.1)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * half_width
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap()
}

pub struct EngineSpec {
    pub mode: SpeculativeMode,
    pub max_batch_size: usize,
    pub max_draft_len: usize,
    pub num_eagle_layers: usize,
    pub max_non_leaves_per_layer: usize,
    pub max_input_len: usize,
    pub max_seq_len: usize,
    /// The head's `feature_layers` (its tensors must then include `fuse.weight`).
    pub feature_layers: Vec<usize>,
    /// The head's decoder layers.
    pub head_layers: usize,
}

impl Default for EngineSpec {
    fn default() -> Self {
        EngineSpec {
            mode: SpeculativeMode::Eagle,
            max_batch_size: 4,
            max_draft_len: 63,
            num_eagle_layers: 4,
            max_non_leaves_per_layer: 10,
            max_input_len: 64,
            max_seq_len: 256,
            feature_layers: Vec::new(),
            head_layers: 1,
        }
    }
}

/// Writes a one-rank f32 checkpoint and builds an engine from it under `dir`.
pub fn build(
    dir: &Path,
    cfg: &ModelConfig,
    base: &BTreeMap<String, Tensor>,
    head: Option<&BTreeMap<String, Tensor>>,
    spec: &EngineSpec,
) -> PathBuf {
    let ckpt = dir.join("checkpoint");
    std::fs::create_dir_all(&ckpt).unwrap();
    let mut all: HashMap<String, Tensor> = base.clone().into_iter().collect();
    let eagle = head.map(|h| {
        for (k, v) in h {
            all.insert(format!("{EAGLE_PREFIX}{k}"), v.clone());
        }
        EagleMeta {
            max_draft_len: spec.max_draft_len,
            num_eagle_layers: spec.num_eagle_layers,
            max_non_leaves_per_layer: spec.max_non_leaves_per_layer,
            head_config: EagleHeadConfig {
                feature_layers: spec.feature_layers.clone(),
                ..stacked_head_config(cfg, spec.head_layers)
            },
        }
    });
    candle_core::safetensors::save(&all, ckpt.join(rank_file_name(0))).unwrap();
    let meta = CheckpointMeta {
        format: CHECKPOINT_FORMAT.into(),
        version: CHECKPOINT_VERSION,
        dtype: KDType::F32,
        mapping: Mapping::new(1),
        source_files: vec![],
        eagle,
    };
    std::fs::write(ckpt.join(CONFIG_FILE), checkpoint_config_json(cfg, &meta)).unwrap();
    let engine = dir.join("engine");
    build_engine(&BuildOptions {
        checkpoint_dir: ckpt,
        output_dir: engine.clone(),
        max_batch_size: spec.max_batch_size,
        max_input_len: spec.max_input_len,
        max_seq_len: spec.max_seq_len,
        max_beam_width: 1,
        speculative_mode: spec.mode,
        max_draft_len: (spec.mode != SpeculativeMode::None).then_some(spec.max_draft_len),
        tokens_per_block: 8,
        use_paged_context_fmha: true,
        gemm_plugin: GemmPlugin::Auto,
        attention_kernel: AttentionKernel::Scalar,
        target_device: TargetDevice::Cpu,
        eagle_choices: None,
    })
    .unwrap();
    engine
}

/// Deterministic prompts of different lengths over the tiny vocabulary (no end id).
pub fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![3, 17, 9],
        vec![5, 1, 44, 20, 20, 8, 31],
        vec![12; 1],
        vec![7, 30, 2, 19, 40, 11, 6, 25, 13, 38, 4],
    ]
}

/// The target's warped next-token distribution after `tokens` (a fresh cache, one forward).
pub fn next_probs(engine: &Engine, tokens: &[u32], sampling: &SamplingParams) -> Vec<f64> {
    let mut cache = engine.model.new_cache(16, 8).unwrap();
    let seq = cache.add_sequence();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    let hidden = engine
        .model
        .forward(
            &[SeqInput {
                seq,
                tokens,
                positions: &pos,
                mask: None,
                output_rows: OutputRows::Last,
            }],
            &mut cache,
        )
        .unwrap();
    let logits = engine
        .model
        .logits(&hidden)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    kestrel_spec::sampling::probs(&logits[0], sampling)
        .into_iter()
        .map(f64::from)
        .collect()
}

/// The exact target distribution of the second generated token, marginalised over the first.
pub fn second_token_distribution(engine: &Engine, prompt: &[u32], temperature: f32) -> Vec<f64> {
    let sampling = SamplingParams {
        temperature,
        top_k: 0,
        top_p: 1.0,
        seed: 0,
    };
    let first = next_probs(engine, prompt, &sampling);
    let mut second = vec![0f64; first.len()];
    for (t0, &p0) in first.iter().enumerate() {
        if p0 < 1e-9 {
            continue;
        }
        let mut ctx = prompt.to_vec();
        ctx.push(t0 as u32);
        for (t1, p1) in next_probs(engine, &ctx, &sampling).iter().enumerate() {
            second[t1] += p0 * p1;
        }
    }
    second
}

/// An engine whose head agrees with its base often, with batches of 16: for the sampled
/// distribution tests.
pub fn distribution_engine(dir: &Path) -> (ModelConfig, Engine) {
    let (cfg, base, head) = agreeing_pair(8);
    let spec = EngineSpec {
        max_batch_size: 16,
        ..EngineSpec::default()
    };
    let engine_dir = build(dir, &cfg, &base, Some(&head), &spec);
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    (cfg, engine)
}

/// Over 250 × 16 sampled runs of `mode` from `prompt`, the second token's counts pass a
/// chi-square test (p = 0.001) against `expected`.
pub fn assert_second_token_follows(
    engine: &Engine,
    mode: &DecodeMode,
    prompt: &[u32],
    temperature: f32,
    expected: &[f64],
) {
    let batch = vec![prompt.to_vec(); 16];
    let mut counts = vec![0u64; expected.len()];
    let rounds = 250;
    for seed in 0..rounds {
        for out in run(engine, mode, &batch, &sampled(2, temperature, seed)) {
            counts[out.output_ids[1] as usize] += 1;
        }
    }
    let n = (rounds * 16) as f64;
    // Pool bins with small expectations, then a chi-square test at p = 0.001.
    let (mut stat, mut df, mut pool_obs, mut pool_exp) = (0.0, 0usize, 0.0, 0.0);
    for (c, p) in counts.iter().zip(expected) {
        let e = p * n;
        if e < 5.0 {
            pool_obs += *c as f64;
            pool_exp += e;
            continue;
        }
        stat += (*c as f64 - e).powi(2) / e;
        df += 1;
    }
    if pool_exp > 0.0 {
        stat += (pool_obs - pool_exp).powi(2) / pool_exp.max(1e-9);
        df += 1;
    }
    let df = df - 1;
    // Wilson–Hilferty approximation of the 0.999 quantile.
    let k = df as f64;
    let z = 3.090_232;
    let critical = k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3);
    assert!(
        stat < critical,
        "chi-square {stat:.1} ≥ {critical:.1} with {df} degrees of freedom"
    );
}

/// Generates for `prompts` with `mode`, without streaming.
pub fn run(
    engine: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
) -> Vec<kestrel_runtime::SequenceOutput> {
    generate(engine, mode, prompts, params, &mut NoSink)
        .unwrap()
        .0
}

/// The tree limits of [`EngineSpec::default`]'s engines.
pub fn tree_limits() -> kestrel_spec::TreeLimits {
    kestrel_spec::TreeLimits {
        num_eagle_layers: 4,
        max_non_leaves_per_layer: 10,
        max_draft_len: 63,
        max_top_k: 10,
    }
}

/// A preset EAGLE-1 tree within [`tree_limits`].
pub fn static_tree(preset: &str) -> kestrel_runtime::EagleTreeKind {
    kestrel_runtime::EagleTreeKind::Static(
        kestrel_spec::EagleTree::from_preset(preset, &tree_limits()).unwrap(),
    )
}

/// EAGLE-2 at the engine's limits.
pub fn dynamic_tree(top_k: usize) -> kestrel_runtime::EagleTreeKind {
    kestrel_runtime::EagleTreeKind::Dynamic {
        top_k,
        max_draft_len: None,
        num_layers: None,
        min_prob: 0.0,
    }
}

/// A two-layer engine with a random head, which rarely agrees with its base.
pub fn random_head_engine(dir: &Path) -> Engine {
    let cfg = tiny_config(2);
    let base = kestrel_model::llama::random_tensors(&cfg, 5).unwrap();
    let head = random_head(&cfg, 6);
    let engine_dir = build(dir, &cfg, &base, Some(&head), &EngineSpec::default());
    Engine::load(&engine_dir, &Device::Cpu).unwrap()
}

/// Sampling at `temperature` alone (no top-k or top-p), no end ids.
pub fn sampled(max_output_len: usize, temperature: f32, seed: u64) -> GenerationParams {
    GenerationParams {
        max_output_len,
        sampling: SamplingParams {
            temperature,
            top_k: 0,
            top_p: 1.0,
            seed,
        },
        end_ids: vec![],
    }
}

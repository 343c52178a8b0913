//! EAGLE head training on a tiny random Llama (CPU, seconds).

mod common;

use candle_core::{DType, Device, Tensor};
use common::{greedy_sequences, max_diff, Tiny};
use kestrel_core::ModelConfig;
use kestrel_model::{EagleHead, EagleSeqInput, Llama, OutputRows};
use kestrel_train::common::Recipe;
use kestrel_train::eagle::{
    deepen_head, head_config, load_head, make_batch, split, train, EagleTrainer, FrozenBase,
    HeadInit, LossSums, LossWeights, SaveOptions, TrainConfig,
};
use kestrel_train::FeatureDataset;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use std::collections::BTreeMap;

/// The default loss mix, which the tests below train with.
const EAGLE1: LossWeights = LossWeights::EAGLE1;

fn tiny_config(tied: bool) -> ModelConfig {
    common::tiny_config(2, 50000.0, tied, "")
}

fn tiny(tied: bool) -> Tiny {
    Tiny::new(&tiny_config(tied), 7)
}

/// Greedy continuations of random prompts: the distribution a self-distilled head sees.
fn greedy_data(
    model: &Llama,
    n: usize,
    prompt_len: usize,
    answer_len: usize,
) -> Vec<(Vec<u32>, usize)> {
    greedy_sequences(model, n, prompt_len, answer_len, 3)
}

fn dataset(t: &Tiny, n: usize) -> FeatureDataset {
    FeatureDataset::extract(
        &t.model,
        greedy_data(&t.model, n, 6, 20),
        &[],
        64,
        &mut |_, _| {},
    )
    .unwrap()
}

fn train_cfg(epochs: usize) -> TrainConfig {
    let defaults = TrainConfig::default();
    TrainConfig {
        recipe: Recipe {
            epochs,
            lr: 3e-3,
            warmup_steps: 2,
            batch_size: 4,
            grad_clip: 1.0,
            ..defaults.recipe.clone()
        },
        noise: 0.02,
        ..defaults
    }
}

#[test]
fn training_lowers_the_loss_and_beats_the_untrained_head() {
    let t = tiny(true);
    let data = dataset(&t, 24);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let hc = head_config(t.model.config(), true, 1);
    let mut trainer =
        EagleTrainer::new(&base, hc, HeadInit::Random { seed: 1 }, train_cfg(12)).unwrap();
    let before = trainer.evaluate(&data, &all).unwrap().mean(EAGLE1);

    // A few steps on one batch already lower that batch's loss.
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let batch = make_batch(&data, &all[..4], 512, 0.0, &mut rng)
        .unwrap()
        .unwrap();
    let (first, _) = trainer.train_step(&batch, 3e-3).unwrap();
    let mut last = first;
    for _ in 0..5 {
        last = trainer.train_step(&batch, 3e-3).unwrap().0;
    }
    let (f, l) = (first.mean(EAGLE1).loss, last.mean(EAGLE1).loss);
    assert!(l < 0.9 * f, "loss {f} -> {l} over 6 steps");

    let log = train(&mut trainer, &data, &all, &[], "random", None, &mut |_| {}).unwrap();
    let after = trainer.evaluate(&data, &all).unwrap().mean(EAGLE1);
    assert!(
        after.loss < 0.6 * before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.top1 > before.top1 + 0.2,
        "top-1 proxy {} -> {}",
        before.top1,
        after.top1
    );
    // The epoch log records a falling training loss.
    let train_losses: Vec<f64> = log
        .epochs
        .iter()
        .filter_map(|e| e.train.map(|m| m.loss))
        .collect();
    assert_eq!(train_losses.len(), 12);
    assert!(train_losses[11] < train_losses[0], "{train_losses:?}");
}

#[test]
fn a_token_only_loss_trains_the_distribution_and_frees_the_feature() {
    let t = tiny(true);
    let data = dataset(&t, 24);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let token_only = LossWeights {
        feature: 0.0,
        ce: 1.0,
    };
    let trained = |cfg: TrainConfig| {
        let hc = head_config(t.model.config(), true, 1);
        let mut trainer = EagleTrainer::new(&base, hc, HeadInit::Random { seed: 1 }, cfg).unwrap();
        let before = trainer.evaluate(&data, &all).unwrap();
        train(&mut trainer, &data, &all, &[], "random", None, &mut |_| {}).unwrap();
        (before, trainer.evaluate(&data, &all).unwrap())
    };
    let (start, eagle1) = trained(train_cfg(8));
    let (_, eagle3) = trained(TrainConfig {
        feature_weight: 0.0,
        ce_weight: 1.0,
        ..train_cfg(8)
    });
    let (start, eagle1, eagle3) = (
        start.mean(token_only),
        eagle1.mean(EAGLE1),
        eagle3.mean(token_only),
    );
    // The loss is the cross-entropy alone, and it falls further than under EAGLE-1's mix.
    assert_eq!(eagle3.loss, eagle3.ce);
    assert!(
        eagle3.ce < 0.7 * start.ce,
        "ce {} -> {}",
        start.ce,
        eagle3.ce
    );
    assert!(
        eagle3.ce < eagle1.ce,
        "ce {} (EAGLE-1) vs {}",
        eagle1.ce,
        eagle3.ce
    );
    assert!(
        eagle3.top1 > start.top1 + 0.2,
        "top-1 {} -> {}",
        start.top1,
        eagle3.top1
    );
    // Nothing pulls the prediction onto the next feature any more.
    assert!(
        eagle3.smooth_l1 > eagle1.smooth_l1,
        "smooth_l1 {} (EAGLE-1) vs {} (token-only)",
        eagle1.smooth_l1,
        eagle3.smooth_l1
    );
    let err = TrainConfig {
        feature_weight: 0.0,
        ce_weight: 0.0,
        ..train_cfg(1)
    }
    .validate()
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "--feature_weight and --ce_weight are both 0: the head would learn nothing"
    );
}

#[test]
fn copy_init_starts_from_the_last_layer_and_improves() {
    let t = tiny(false);
    let data = dataset(&t, 16);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let (train_idx, val_idx) = split(data.len(), 0.25, 0);
    assert_eq!((train_idx.len(), val_idx.len()), (12, 4));
    let hc = head_config(t.model.config(), false, 1);
    let mut trainer = EagleTrainer::new(
        &base,
        hc,
        HeadInit::CopyTopLayers { out_scale: 0.0 },
        train_cfg(8),
    )
    .unwrap();
    let w = trainer.tensors().unwrap();
    // Residual-branch outputs start at zero: the head starts as the identity on features.
    for name in [
        "layers.0.self_attn.o_proj.weight",
        "layers.0.mlp.down_proj.weight",
    ] {
        let m = w[name].abs().unwrap().max_all().unwrap();
        assert_eq!(m.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
    let q = &w["layers.0.self_attn.q_proj.weight"];
    let diff = (q - &t.tensors["model.layers.1.self_attn.q_proj.weight"])
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert_eq!(diff, 0.0);
    assert!(!w.contains_key("fc.bias"));
    let all: Vec<usize> = (0..data.len()).collect();
    let before = trainer.evaluate(&data, &all).unwrap().mean(EAGLE1);
    let log = train(
        &mut trainer,
        &data,
        &train_idx,
        &val_idx,
        "copy",
        None,
        &mut |_| {},
    )
    .unwrap();
    let after = trainer.evaluate(&data, &all).unwrap().mean(EAGLE1);
    assert!(
        after.loss < before.loss,
        "loss {} -> {}",
        before.loss,
        after.loss
    );
    assert!(
        after.top1 >= before.top1,
        "top-1 {} -> {}",
        before.top1,
        after.top1
    );
    assert_eq!(log.epochs.len(), 9);
    assert!(log.epochs[0].val.is_some() && log.epochs[0].train.is_none());
}

#[test]
fn written_heads_reload_with_the_published_keys() {
    let t = tiny(true);
    let data = dataset(&t, 8);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let tmp = tempfile::tempdir().unwrap();
    for bias in [true, false] {
        let hc = head_config(t.model.config(), bias, 1);
        let mut trainer = EagleTrainer::new(
            &base,
            hc,
            HeadInit::CopyTopLayers { out_scale: 1.0 },
            train_cfg(1),
        )
        .unwrap();
        let dir = tmp.path().join(format!("head-bias-{bias}"));
        let save = SaveOptions {
            output_dir: &dir,
            dtype: DType::F16,
            extra: vec![],
        };
        train(
            &mut trainer,
            &data,
            &all,
            &[],
            "copy",
            Some(&save),
            &mut |_| {},
        )
        .unwrap();
        assert!(dir.join("train_log.json").is_file());

        // The published layout, as convert-checkpoint's reader sees it.
        let (cfg, tensors) = kestrel_formats::load_eagle_head(&dir).unwrap();
        assert_eq!(cfg.bias, bias);
        assert_eq!(cfg.llama.num_hidden_layers, 1);
        assert_eq!(cfg.llama.rope_theta, 50000.0);
        let mut want: Vec<String> = [
            "fc.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.v_proj.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.mlp.gate_proj.weight",
            "layers.0.mlp.up_proj.weight",
            "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        if bias {
            want.push("fc.bias".into());
        }
        want.sort();
        let got: Vec<String> = tensors.keys().cloned().collect();
        assert_eq!(got, want);
        for (name, shape) in EagleHead::expected_tensors(&cfg) {
            assert_eq!(tensors[&name].dims(), shape.as_slice(), "{name}");
            assert_eq!(tensors[&name].dtype(), DType::F16, "{name}");
        }
        assert_eq!(tensors["fc.weight"].dims(), &[32, 64]);
        assert_eq!(
            tensors["layers.0.self_attn.k_proj.weight"].dims(),
            &[16, 32]
        );

        // config.json spells out what the published heads carry.
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap())
                .unwrap();
        assert_eq!(json["bias"], serde_json::json!(bias));
        assert_eq!(json["rope_theta"], serde_json::json!(50000.0));
        assert_eq!(
            json["architectures"],
            serde_json::json!(["LlamaForCausalLM"])
        );
        assert_eq!(json["torch_dtype"], serde_json::json!("float16"));
        assert_eq!(json["num_key_value_heads"], serde_json::json!(2));

        // The reloaded head predicts what the trained one does (to f16 rounding), through
        // the inference loader, and resuming continues from the same weights.
        let trained = EagleHead::from_tensors(
            &cfg,
            trainer.tensors().unwrap(),
            &t.model,
            kestrel_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let reloaded = EagleHead::from_tensors(
            &cfg,
            tensors,
            &t.model,
            kestrel_core::DType::F32,
            &Device::Cpu,
        )
        .unwrap();
        let mut rng = ChaCha8Rng::seed_from_u64(0);
        let batch = make_batch(&data, &all[..2], 512, 0.0, &mut rng)
            .unwrap()
            .unwrap();
        let a = trained
            .forward_train(&batch.tokens, &batch.features)
            .unwrap();
        let b = reloaded
            .forward_train(&batch.tokens, &batch.features)
            .unwrap();
        assert!(max_diff(&a, &b) < 2e-2, "{}", max_diff(&a, &b));

        let (rc, rt) = load_head(&dir).unwrap();
        assert_eq!(rc.bias, bias);
        let resumed = EagleTrainer::new(&base, rc, HeadInit::Tensors(rt), train_cfg(1)).unwrap();
        let e1 = trainer.evaluate(&data, &all).unwrap().mean(EAGLE1).loss;
        let e2 = resumed.evaluate(&data, &all).unwrap().mean(EAGLE1).loss;
        assert!((e1 - e2).abs() < 1e-2 * e1.max(1e-3), "{e1} vs {e2}");
    }
}

#[test]
fn feature_cache_round_trips_and_batching_does_not_change_features() {
    let t = tiny(true);
    let seqs = greedy_data(&t.model, 5, 4, 9);
    let one = FeatureDataset::extract(&t.model, seqs.clone(), &[], 1, &mut |_, _| {}).unwrap();
    let mut calls = 0;
    let many = FeatureDataset::extract(&t.model, seqs, &[], 1000, &mut |_, _| calls += 1).unwrap();
    assert_eq!(calls, 1);
    assert_eq!(one.tokens, many.tokens);
    assert_eq!(one.offsets, vec![0, 13, 26, 39, 52, 65]);
    assert!(max_diff(&one.features, &many.features) < 1e-4);

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    many.save(&dir, DType::F32).unwrap();
    assert!(FeatureDataset::exists(&dir));
    let back = FeatureDataset::load(&dir).unwrap();
    assert_eq!(
        (back.tokens.clone(), back.offsets.clone()),
        (many.tokens.clone(), many.offsets.clone())
    );
    assert_eq!(back.prompt_lens, vec![4; 5]);
    assert_eq!(back.answer_tokens(), 45);
    assert_eq!(max_diff(&back.features, &many.features), 0.0);
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let t = tiny(true);
    let tmp = tempfile::tempdir().unwrap();
    let err = FeatureDataset::load(&tmp.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("meta.json") && err.contains("--stage data"),
        "{err}"
    );

    let err = FeatureDataset::extract(&t.model, vec![(vec![1, 999], 1)], &[], 64, &mut |_, _| {})
        .unwrap_err()
        .to_string();
    assert!(err.contains("999"), "{err}");

    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let hc = head_config(t.model.config(), true, 1);
    let mut wrong = BTreeMap::new();
    wrong.insert(
        "fc.weight".to_string(),
        Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let err = EagleTrainer::new(&base, hc.clone(), HeadInit::Tensors(wrong), train_cfg(1))
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("fc.weight"), "{err}");
    let mut bad_cfg = train_cfg(1);
    bad_cfg.recipe.batch_size = 0;
    assert!(EagleTrainer::new(
        &base,
        hc,
        HeadInit::CopyTopLayers { out_scale: 1.0 },
        bad_cfg
    )
    .is_err());
    assert!(load_head(tmp.path()).is_err());
}

/// Training-time test: pass k of the trainer's unroll at head position i is exactly what the
/// inference head (paged KV cache, one node at a time) computes for the depth-(k-1) node of
/// a draft chain along the true continuation, as `calibrate.rs` replays it: the committed
/// pairs (t[j+1], f[j]) for j <= i - k + 1 in the cache, then chain nodes fed their
/// parent's output. This is what checks the per-query mixture of K/V from different passes.
#[test]
fn unrolled_passes_are_the_inference_draft_chain() {
    let t = tiny(true);
    let data = dataset(&t, 3);
    for layers in [1, 2] {
        unrolled_passes_match_inference(&t, &data, layers);
    }
}

fn unrolled_passes_match_inference(t: &Tiny, data: &FeatureDataset, layers: usize) {
    const PASSES: usize = 4;
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, layers).unwrap();
    let hc = head_config(t.model.config(), true, layers);
    let cfg = TrainConfig {
        ttt_steps: PASSES,
        ..train_cfg(1)
    };
    let trainer = EagleTrainer::new(&base, hc.clone(), HeadInit::Random { seed: 5 }, cfg).unwrap();
    let seqs = [0usize, 1, 2];
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let batch = make_batch(data, &seqs, 512, 0.0, &mut rng)
        .unwrap()
        .unwrap();
    let preds = trainer.unrolled_predictions(&batch, PASSES).unwrap();
    // Pass 1 is the plain training forward, bit for bit.
    let plain = trainer.unrolled_predictions(&batch, 1).unwrap();
    assert_eq!(max_diff(&plain[0], &preds[0]), 0.0);

    let head = EagleHead::from_tensors(
        &hc,
        trainer.tensors().unwrap(),
        &t.model,
        kestrel_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let tokens = batch.tokens.to_vec2::<u32>().unwrap();
    let mut worst = vec![0f32; PASSES];
    let mut compared = vec![0usize; PASSES];
    for (row, &s) in seqs.iter().enumerate() {
        let len = data.seq_len(s) - 1; // head positions
        let feats = batch.features.get(row).unwrap();
        let mut cache = head.new_cache(8, 16).unwrap();
        let seq = cache.add_sequence();
        let mut fed = 0;
        // Root pair at head position r = n - 1: the cache holds positions < r, as spec-run's
        // head cache does before its step over the newly committed pairs.
        for r in 0..len {
            let pos: Vec<u32> = (fed as u32..=r as u32).collect();
            let mut out = head
                .forward(
                    &t.model,
                    &[EagleSeqInput {
                        seq,
                        tokens: &tokens[row][fed..=r],
                        features: feats.narrow(0, fed, r + 1 - fed).unwrap(),
                        positions: &pos,
                        mask: None,
                        output_rows: OutputRows::Last,
                    }],
                    &mut cache,
                )
                .unwrap();
            fed = r + 1;
            for k in 1..=PASSES.min(len - r) {
                let i = r + k - 1;
                if k > 1 {
                    out = head
                        .forward(
                            &t.model,
                            &[EagleSeqInput {
                                seq,
                                tokens: &tokens[row][i..=i],
                                features: out,
                                positions: &[i as u32],
                                mask: None,
                                output_rows: OutputRows::Last,
                            }],
                            &mut cache,
                        )
                        .unwrap();
                }
                let trained = preds[k - 1].get(row).unwrap().narrow(0, i, 1).unwrap();
                worst[k - 1] = worst[k - 1].max(max_diff(&trained, &out));
                compared[k - 1] += 1;
            }
            cache.truncate(seq, fed).unwrap();
        }
    }
    eprintln!(
        "{layers} layers: max |train - inference| per pass: {worst:?} over {compared:?} positions"
    );
    assert!(compared[PASSES - 1] >= 3 * 20, "{compared:?}");
    assert!(
        worst.iter().all(|&w| w < 2e-5),
        "{layers} layers: max |train - inference| per pass: {worst:?}"
    );
}

/// Heads `a` and `b`, each over its data, score the same losses and top-1 at draft depths 1
/// and 2, bit for bit (one starts exactly where the other is); returns `a`'s scores.
fn assert_same_predictions(
    (a, a_data): (&EagleTrainer, &FeatureDataset),
    (b, b_data): (&EagleTrainer, &FeatureDataset),
    seqs: &[usize],
) -> Vec<LossSums> {
    let scores = a.evaluate_unrolled(a_data, seqs, 2).unwrap();
    let reference = b.evaluate_unrolled(b_data, seqs, 2).unwrap();
    for (k, (x, y)) in scores.iter().zip(&reference).enumerate() {
        let (x, y) = (x.mean(EAGLE1), y.mean(EAGLE1));
        assert_eq!((x.loss, x.top1), (y.loss, y.top1), "pass {}", k + 1);
    }
    scores
}

/// With the deeper passes weighted 0, an unrolled trainer takes exactly the steps of the
/// plain one: pass 1 of the unroll is the plain forward and the extra terms add nothing.
#[test]
fn unroll_with_zero_weight_trains_exactly_like_no_unroll() {
    let t = tiny(true);
    let data = dataset(&t, 8);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let hc = head_config(t.model.config(), true, 1);
    let make = |ttt_steps| {
        let cfg = TrainConfig {
            ttt_steps,
            ttt_decay: 0.0,
            noise: 0.05,
            ..train_cfg(2)
        };
        EagleTrainer::new(&base, hc.clone(), HeadInit::Random { seed: 2 }, cfg).unwrap()
    };
    let (mut plain, mut unrolled) = (make(1), make(3));
    let a = train(&mut plain, &data, &all, &all, "random", None, &mut |_| {}).unwrap();
    let b = train(
        &mut unrolled,
        &data,
        &all,
        &all,
        "random",
        None,
        &mut |_| {},
    )
    .unwrap();
    for (x, y) in a.epochs.iter().zip(&b.epochs) {
        assert_eq!(
            x.train.map(|m| m.loss.to_bits()),
            y.train.map(|m| m.loss.to_bits())
        );
        assert_eq!(x.val.unwrap().loss.to_bits(), y.val.unwrap().loss.to_bits());
        assert_eq!(x.grad_norm.to_bits(), y.grad_norm.to_bits());
        // Held-out depths 2 and 3 are measured either way; only the unrolled run trains them.
        assert_eq!(x.val_deeper.len(), 2);
        assert!(x.train_deeper.is_empty());
        assert_eq!(y.train_deeper.len(), if y.epoch == 0 { 0 } else { 2 });
    }
    let (wa, wb) = (plain.tensors().unwrap(), unrolled.tensors().unwrap());
    for (name, w) in &wa {
        assert_eq!(max_diff(w, &wb[name]), 0.0, "{name}");
    }
}

/// A head that also reads base layer 0 (EAGLE-3's multi-layer features): the cache keeps the
/// final feature first, a plain head's weights plus `fuse = [I | 0]` start exactly where the
/// plain head is, training lowers the loss and puts weight on layer 0, and the written head
/// and cache read back with their layers.
#[test]
fn a_head_reading_several_layers_starts_as_the_plain_head_and_trains() {
    let t = tiny(true);
    let h = t.model.config().hidden_size;
    let seqs = greedy_data(&t.model, 16, 6, 20);
    let plain_data =
        FeatureDataset::extract(&t.model, seqs.clone(), &[], 64, &mut |_, _| {}).unwrap();
    let data = FeatureDataset::extract(&t.model, seqs, &[0], 64, &mut |_, _| {}).unwrap();
    assert_eq!(data.feature_width(), 2 * h);
    assert_eq!(
        max_diff(
            &data.features.narrow(1, 0, h).unwrap(),
            &plain_data.features
        ),
        0.0
    );
    let dir = tempfile::tempdir().unwrap();
    data.save(&dir.path().join("data"), DType::F32).unwrap();
    let back = FeatureDataset::load(&dir.path().join("data")).unwrap();
    assert_eq!(back.feature_layers, vec![0]);
    assert_eq!(max_diff(&back.features, &data.features), 0.0);

    // One cache serves a head that reads fewer layers.
    let fewer = data.select_layers(&[]).unwrap();
    assert!(fewer.feature_layers.is_empty());
    assert_eq!(max_diff(&fewer.features, &plain_data.features), 0.0);
    assert_eq!(
        plain_data.select_layers(&[0]).unwrap_err().to_string(),
        "the feature cache holds base layers [], not layer 0: regenerate it with --feature_layers"
    );

    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let plain = EagleTrainer::new(
        &base,
        head_config(t.model.config(), true, 1),
        HeadInit::Random { seed: 3 },
        train_cfg(6),
    )
    .unwrap();
    let mut hc = head_config(t.model.config(), true, 1);
    hc.feature_layers = vec![0];
    let mut fused = EagleTrainer::new(
        &base,
        hc,
        HeadInit::Tensors(plain.tensors().unwrap()),
        train_cfg(6),
    )
    .unwrap();
    let before = assert_same_predictions((&fused, &data), (&plain, &fewer), &all);
    train(&mut fused, &data, &all, &[], "resume", None, &mut |_| {}).unwrap();
    let after = fused.evaluate(&data, &all).unwrap().mean(EAGLE1);
    assert!(
        after.loss < 0.8 * before[0].mean(EAGLE1).loss,
        "loss {} -> {}",
        before[0].mean(EAGLE1).loss,
        after.loss
    );
    let w = fused.tensors().unwrap();
    let on_layer0 = w["fuse.weight"].narrow(1, h, h).unwrap().abs().unwrap();
    assert!(on_layer0.max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);

    fused
        .save(&dir.path().join("head"), DType::F32, &[])
        .unwrap();
    let (cfg, tensors) = load_head(&dir.path().join("head")).unwrap();
    assert_eq!(cfg.feature_layers, vec![0]);
    assert_eq!(max_diff(&tensors["fuse.weight"], &w["fuse.weight"]), 0.0);
}

/// `--head_layers`: a copied head of n layers starts from the base's top n layers, and a
/// trained head grown by a layer (`deepen_head`, the new layer's outputs zeroed) predicts
/// exactly what it did, then trains the new layer and lowers the loss; the grown head is
/// written and read back with its layers.
#[test]
fn a_head_grown_by_a_layer_starts_where_it_stopped_and_trains() {
    let t = tiny(true);
    let data = dataset(&t, 16);
    let all: Vec<usize> = (0..data.len()).collect();
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 2).unwrap();
    let copied = EagleTrainer::new(
        &base,
        head_config(t.model.config(), true, 2),
        HeadInit::CopyTopLayers { out_scale: 1.0 },
        train_cfg(1),
    )
    .unwrap();
    let w = copied.tensors().unwrap();
    for l in 0..2 {
        let name = "self_attn.q_proj.weight";
        let want = &t.tensors[&format!("model.layers.{l}.{name}")];
        assert_eq!(
            max_diff(&w[&format!("layers.{l}.{name}")], want),
            0.0,
            "layer {l}"
        );
    }
    assert!(w.contains_key("layers.1.input_layernorm.weight"));
    assert!(!w.contains_key("layers.0.input_layernorm.weight"));

    let mut shallow = EagleTrainer::new(
        &base,
        head_config(t.model.config(), true, 1),
        HeadInit::Random { seed: 3 },
        train_cfg(3),
    )
    .unwrap();
    train(&mut shallow, &data, &all, &[], "random", None, &mut |_| {}).unwrap();
    let hc = head_config(t.model.config(), true, 2);
    let mut tensors = shallow.tensors().unwrap();
    deepen_head(&mut tensors, 1, &hc, &base).unwrap();
    let mut deep =
        EagleTrainer::new(&base, hc.clone(), HeadInit::Tensors(tensors), train_cfg(6)).unwrap();
    let before = assert_same_predictions((&deep, &data), (&shallow, &data), &all);
    train(&mut deep, &data, &all, &[], "grown", None, &mut |_| {}).unwrap();
    let after = deep.evaluate(&data, &all).unwrap().mean(EAGLE1);
    assert!(
        after.loss < before[0].mean(EAGLE1).loss,
        "loss {} -> {}",
        before[0].mean(EAGLE1).loss,
        after.loss
    );
    let w = deep.tensors().unwrap();
    let o = w["layers.1.self_attn.o_proj.weight"].abs().unwrap();
    assert!(o.max_all().unwrap().to_scalar::<f32>().unwrap() > 0.0);

    let dir = tempfile::tempdir().unwrap();
    deep.save(&dir.path().join("head"), DType::F32, &[])
        .unwrap();
    let (cfg, back) = load_head(&dir.path().join("head")).unwrap();
    assert_eq!(cfg.llama.num_hidden_layers, 2);
    assert_eq!(
        max_diff(
            &back["layers.1.input_layernorm.weight"],
            &w["layers.1.input_layernorm.weight"]
        ),
        0.0
    );
    assert_eq!(
        deepen_head(&mut back.clone(), 3, &hc, &base)
            .unwrap_err()
            .to_string(),
        "a head of 3 layers cannot grow to 2"
    );
}

/// `cfg` keeping its best epoch or not, and stopping early or not.
fn kept(mut cfg: TrainConfig, keep_best: bool, early_stop: Option<usize>) -> TrainConfig {
    cfg.recipe.keep_best = keep_best;
    cfg.recipe.early_stop = early_stop;
    cfg
}

/// The held-out chain score `keep_best` ranks epochs by, recomputed from the log:
/// `p1 + p1·p2 + …` over the logged depths' top-1.
fn logged_chain_score(e: &kestrel_train::eagle::EpochLog) -> f64 {
    let mut reach = 1.0;
    std::iter::once(e.val.as_ref().unwrap())
        .chain(&e.val_deeper)
        .map(|m| {
            reach *= m.top1;
            reach
        })
        .sum()
}

/// The epoch `keep_best` must keep: the highest logged chain score, the earlier on a tie.
fn best_logged_epoch(log: &kestrel_train::eagle::TrainLog) -> usize {
    let mut best = &log.epochs[0];
    for e in &log.epochs[1..] {
        if logged_chain_score(e) > logged_chain_score(best) {
            best = e;
        }
    }
    best.epoch
}

/// The held-out top-1 per depth of `trainer` as it now stands, and as epoch `epoch` logged it.
fn top1_now_and_logged(
    trainer: &EagleTrainer,
    data: &FeatureDataset,
    val: &[usize],
    log: &kestrel_train::eagle::TrainLog,
    epoch: usize,
) -> (Vec<f64>, Vec<f64>) {
    let now: Vec<f64> = trainer
        .evaluate_unrolled(data, val, trainer.cfg.eval_steps)
        .unwrap()
        .iter()
        .map(|s| s.mean(EAGLE1).top1)
        .collect();
    let e = &log.epochs[epoch];
    let logged = std::iter::once(e.val.as_ref().unwrap())
        .chain(&e.val_deeper)
        .map(|m| m.top1)
        .collect();
    (now, logged)
}

#[test]
fn keeping_the_best_epoch_gives_back_a_head_that_training_made_worse() {
    let t = tiny(true);
    let data = dataset(&t, 24);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let all: Vec<usize> = (0..data.len()).collect();
    let (train_idx, val) = split(data.len(), 0.25, 0);
    let hc = head_config(t.model.config(), true, 1);
    let mut trained = EagleTrainer::new(
        &base,
        hc.clone(),
        HeadInit::Random { seed: 1 },
        train_cfg(8),
    )
    .unwrap();
    train(&mut trained, &data, &all, &[], "random", None, &mut |_| {}).unwrap();
    let good = trained.tensors().unwrap();

    // A learning rate far past what this head tolerates: every epoch ends worse than the
    // head it resumed, so the saved head and the trainer's own weights are that head's.
    let mut cfg = train_cfg(3);
    cfg.recipe.lr = 0.5;
    cfg.recipe.grad_clip = 0.0;
    cfg.recipe.keep_best = true;
    let mut wrecked = EagleTrainer::new(
        &base,
        hc.clone(),
        HeadInit::Tensors(good.clone()),
        cfg.clone(),
    )
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("head");
    let save = SaveOptions {
        output_dir: &dir,
        dtype: DType::F32,
        extra: vec![],
    };
    let mut lines = Vec::new();
    let log = train(
        &mut wrecked,
        &data,
        &train_idx,
        &val,
        "resume",
        Some(&save),
        &mut |l| lines.push(l.to_string()),
    )
    .unwrap();
    let scores: Vec<f64> = log.epochs.iter().map(logged_chain_score).collect();
    assert!(
        scores[1..].iter().all(|&s| s < scores[0]),
        "the learning rate did not make every epoch worse: {scores:?}"
    );
    assert_eq!(log.kept_epoch, Some(0));
    assert_eq!(
        lines.last().unwrap(),
        &format!(
            "kept epoch 0's weights: held-out chain score {:.3}, the best of epochs 0-3",
            scores[0]
        )
    );
    let now = wrecked.tensors().unwrap();
    let (_, saved) = load_head(&dir).unwrap();
    for (name, want) in &good {
        assert_eq!(max_diff(&now[name], want), 0.0, "trainer's {name}");
        assert_eq!(max_diff(&saved[name], want), 0.0, "saved {name}");
    }
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("train_log.json")).unwrap())
            .unwrap();
    assert_eq!(written["kept_epoch"], 0);
    assert_eq!(written["config"]["keep_best"], true);

    // Stopping early: the first epoch that fails to beat the head ends the run.
    let mut stopped = EagleTrainer::new(
        &base,
        hc.clone(),
        HeadInit::Tensors(good.clone()),
        kept(cfg.clone(), true, Some(1)),
    )
    .unwrap();
    let mut lines = Vec::new();
    let log = train(
        &mut stopped,
        &data,
        &train_idx,
        &val,
        "resume",
        None,
        &mut |l| lines.push(l.to_string()),
    )
    .unwrap();
    assert_eq!(log.epochs.len(), 2, "epochs 0 and 1 only");
    assert_eq!(
        lines[lines.len() - 2..],
        [
            "stopping early: 1 epoch(s) without a better held-out chain score than epoch 0's"
                .to_string(),
            format!(
                "kept epoch 0's weights: held-out chain score {:.3}, the best of epochs 0-1",
                scores[0]
            )
        ]
    );
    for (name, want) in &good {
        assert_eq!(
            max_diff(&stopped.tensors().unwrap()[name], want),
            0.0,
            "{name}"
        );
    }
}

#[test]
fn keeping_the_best_epoch_ends_on_the_epoch_the_log_ranks_first() {
    let t = tiny(true);
    let data = dataset(&t, 24);
    let base = FrozenBase::from_tensors(&t.model, &t.tensors, 1).unwrap();
    let (train_idx, val) = split(data.len(), 0.25, 0);
    let hc = head_config(t.model.config(), true, 1);
    // At this learning rate the held-out score peaks before the last epoch.
    let mut cfg = train_cfg(6);
    cfg.recipe.lr = 1e-2;
    let run = |keep_best: bool| {
        let mut trainer = EagleTrainer::new(
            &base,
            hc.clone(),
            HeadInit::Random { seed: 2 },
            kept(cfg.clone(), keep_best, None),
        )
        .unwrap();
        let log = train(
            &mut trainer,
            &data,
            &train_idx,
            &val,
            "random",
            None,
            &mut |_| {},
        )
        .unwrap();
        (trainer, log)
    };
    let (trainer, log) = run(true);
    let kept = best_logged_epoch(&log);
    assert!(
        kept > 0 && kept < 6,
        "not a run whose best epoch is inside it: {:?}",
        log.epochs
            .iter()
            .map(logged_chain_score)
            .collect::<Vec<_>>()
    );
    assert_eq!(log.kept_epoch, Some(kept));
    let (now, logged) = top1_now_and_logged(&trainer, &data, &val, &log, kept);
    assert_eq!(now, logged, "the trainer's weights are not epoch {kept}'s");

    // Without it, the same run keeps no epoch and ends on the last.
    let (last, log) = run(false);
    assert_eq!(log.kept_epoch, None);
    let (now, logged) = top1_now_and_logged(&last, &data, &val, &log, 6);
    assert_eq!(now, logged);

    let mut cfg = train_cfg(1);
    cfg.recipe.keep_best = true;
    let mut blind = EagleTrainer::new(
        &base,
        head_config(t.model.config(), true, 1),
        HeadInit::Random { seed: 2 },
        cfg,
    )
    .unwrap();
    let err = train(
        &mut blind,
        &data,
        &train_idx,
        &[],
        "random",
        None,
        &mut |_| {},
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "keeping the best epoch needs held-out sequences to compare epochs on"
    );
}

//! Draft-model distillation on a tiny random 4-layer Llama (CPU, seconds): the KL to the
//! target falls on held-out sequences, the distilled draft agrees with the target's greedy
//! tokens more often than an untrained one, the written folder is what convert-checkpoint
//! reads, resuming continues the run, and bad layer choices are refused with exact messages.

mod common;

use candle_core::{DType, Device};
use common::{greedy_sequences, max_diff, Tiny};
use kestrel_core::ModelConfig;
use kestrel_model::{Llama, OutputRows, SeqInput};
use kestrel_train::common::{split, Recipe};
use kestrel_train::draft::{
    default_init_layers, draft_config, initial_student, load_draft, make_draft_batch,
    resolve_init_layers, train_draft, DraftInit, DraftSaveOptions, DraftTrainConfig, DraftTrainer,
};
use kestrel_train::FeatureDataset;

fn tiny_config(tied: bool) -> ModelConfig {
    common::tiny_config(
        4,
        10000.0,
        tied,
        r#", "bos_token_id": 1, "eos_token_id": 2"#,
    )
}

/// A random target. Tied, its greedy token is nearly always the current one (the logits are
/// the embedding's dot products with a hidden state dominated by that token's embedding), so
/// the learning tests use an untied one, whose next token depends on the context.
fn tiny(tied: bool) -> Tiny {
    Tiny::new(&tiny_config(tied), 11)
}

/// Greedy continuations of random prompts (what self-distillation produces at temperature 0).
fn greedy_data(model: &Llama, n: usize, prompt_len: usize, answer_len: usize) -> FeatureDataset {
    let seqs = greedy_sequences(model, n, prompt_len, answer_len, 5);
    FeatureDataset::extract(model, seqs, &[], 256, &mut |_, _| {}).unwrap()
}

fn cfg(epochs: usize) -> DraftTrainConfig {
    let defaults = DraftTrainConfig::default();
    DraftTrainConfig {
        recipe: Recipe {
            epochs,
            lr: 3e-3,
            warmup_steps: 2,
            batch_size: 4,
            ..defaults.recipe.clone()
        },
        ..defaults
    }
}

fn trainer(t: &Tiny, layers: usize, init: DraftInit, c: DraftTrainConfig) -> DraftTrainer {
    let target_cfg = t.model.config();
    let student = initial_student(target_cfg, &t.tensors, layers, init).unwrap();
    DraftTrainer::new(draft_config(target_cfg, layers), student, c, &Device::Cpu).unwrap()
}

#[test]
fn distillation_lowers_the_held_out_kl() {
    let t = tiny(false);
    let data = greedy_data(&t.model, 40, 6, 24);
    let (train_idx, val_idx) = split(data.len(), 0.25, 0);
    let layers = default_init_layers(4, 2);
    assert_eq!(layers, vec![0, 3]);
    let mut tr = trainer(&t, 2, DraftInit::TargetLayers(layers), cfg(6));
    let before = tr.evaluate(&data, &val_idx).unwrap().mean(&tr.cfg);
    assert!(before.rows > 100, "{before:?}");

    // A few steps on one batch already lower that batch's loss.
    let batch = make_draft_batch(&data, &train_idx[..4], 512, &Device::Cpu)
        .unwrap()
        .unwrap();
    let (first, _) = tr.train_step(&batch, 3e-3).unwrap();
    let mut last = first;
    for _ in 0..5 {
        last = tr.train_step(&batch, 3e-3).unwrap().0;
    }
    let (f, l) = (first.mean(&tr.cfg).loss, last.mean(&tr.cfg).loss);
    assert!(l < 0.8 * f, "batch loss {f} -> {l} over 6 steps");

    let log = train_draft(
        &mut tr,
        &data,
        &train_idx,
        &val_idx,
        "layers",
        None,
        None,
        None,
        &mut |_| {},
    )
    .unwrap();
    let after = tr.evaluate(&data, &val_idx).unwrap().mean(&tr.cfg);
    assert!(
        after.kl < 0.7 * before.kl,
        "held-out KL {} -> {}",
        before.kl,
        after.kl
    );
    assert_eq!(log.epochs.len(), 7);
    let val = |e: usize| log.epochs[e].val.unwrap().kl;
    assert!(val(6) < val(0), "{:?}", log.epochs);
    // T² · KL with T = 1 and no CE term: the loss is the KL.
    assert!((after.loss - after.kl).abs() < 1e-9);
}

#[test]
fn a_distilled_draft_agrees_with_the_target_more_than_an_untrained_one() {
    let t = tiny(false);
    let data = greedy_data(&t.model, 48, 6, 24);
    let (train_idx, val_idx) = split(data.len(), 0.25, 1);
    let untrained = trainer(&t, 2, DraftInit::Random { seed: 3 }, cfg(8));
    let base = untrained
        .evaluate(&data, &val_idx)
        .unwrap()
        .mean(&untrained.cfg);
    let copied = trainer(&t, 2, DraftInit::TargetLayers(vec![0, 3]), cfg(8));
    let copied0 = copied.evaluate(&data, &val_idx).unwrap().mean(&copied.cfg);
    // The random start also tries the tempered KL with a greedy-token CE term.
    let tempered = DraftTrainConfig {
        ce_weight: 0.5,
        kd_temperature: 2.0,
        ..cfg(8)
    };
    for (name, mut tr) in [
        (
            "random init",
            trainer(&t, 2, DraftInit::Random { seed: 3 }, tempered),
        ),
        ("layer init", copied),
    ] {
        train_draft(
            &mut tr,
            &data,
            &train_idx,
            &val_idx,
            name,
            None,
            None,
            None,
            &mut |_| {},
        )
        .unwrap();
        let after = tr.evaluate(&data, &val_idx).unwrap().mean(&tr.cfg);
        assert!(
            after.top1 > base.top1 + 0.15,
            "{name}: held-out greedy agreement {} (untrained random draft {}, untrained layer copy {})",
            after.top1,
            base.top1,
            copied0.top1
        );
        assert!(after.kl < base.kl, "{name}: KL {} vs {}", after.kl, base.kl);
        if name == "layer init" {
            // Training also beats the layer copy it started from.
            assert!(
                after.top1 > copied0.top1 + 0.1,
                "{} vs {}",
                after.top1,
                copied0.top1
            );
            assert!(
                after.kl < 0.5 * copied0.kl,
                "{} vs {}",
                after.kl,
                copied0.kl
            );
        }
    }
}

#[test]
fn the_embedding_stays_frozen_unless_asked_and_a_tied_head_stays_tied() {
    for tied in [true, false] {
        let t = tiny(tied);
        let data = greedy_data(&t.model, 8, 5, 10);
        let all: Vec<usize> = (0..data.len()).collect();
        let batch = make_draft_batch(&data, &all, 512, &Device::Cpu)
            .unwrap()
            .unwrap();
        for train_embeddings in [false, true] {
            let c = DraftTrainConfig {
                train_embeddings,
                ..cfg(1)
            };
            let mut tr = trainer(&t, 2, DraftInit::TargetLayers(vec![1, 2]), c);
            let w0 = tr.tensors().unwrap();
            // The copies are the target's layers 1 and 2, bit for bit.
            for (s, l) in [(0, 1), (1, 2)] {
                let name = |i| format!("model.layers.{i}.mlp.down_proj.weight");
                assert_eq!(max_diff(&w0[&name(s)], &t.tensors[&name(l)]), 0.0);
            }
            let (first, _) = tr.train_step(&batch, 1e-3).unwrap();
            let (second, _) = tr.train_step(&batch, 1e-3).unwrap();
            assert!(
                second.kl < first.kl,
                "tied {tied} train_embeddings {train_embeddings}"
            );
            let w = tr.tensors().unwrap();
            let moved = |n: &str| max_diff(&w[n], &w0[n]) > 0.0;
            assert!(moved("model.layers.1.self_attn.q_proj.weight"));
            assert!(moved("model.norm.weight"));
            assert_eq!(moved("model.embed_tokens.weight"), train_embeddings);
            assert_eq!(w.contains_key("lm_head.weight"), !tied);
            if !tied {
                assert_eq!(moved("lm_head.weight"), train_embeddings);
            }
        }
    }
}

#[test]
fn written_drafts_are_hf_folders_and_resume_where_they_stopped() {
    let t = tiny(true);
    let data = greedy_data(&t.model, 12, 5, 12);
    let (train_idx, val_idx) = split(data.len(), 0.25, 0);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("draft");
    let template = tmp.path().join("chat_template.jinja");
    std::fs::write(&template, "{{ messages }}").unwrap();
    let save = DraftSaveOptions {
        output_dir: &dir,
        dtype: DType::F16,
        copy_files: vec![template],
    };
    let mut tr = trainer(&t, 2, DraftInit::TargetLayers(vec![0, 3]), cfg(1));
    let log1 = train_draft(
        &mut tr,
        &data,
        &train_idx,
        &val_idx,
        "layers",
        Some("spec-train draft ...".into()),
        None,
        Some(&save),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(log1.epochs.len(), 2);
    for f in [
        "config.json",
        "model.safetensors",
        "chat_template.jinja",
        "train_log.json",
    ] {
        assert!(dir.join(f).is_file(), "{f}");
    }

    // What convert-checkpoint reads: an HF folder of a 2-layer Llama with the target's
    // shapes, tied (no lm_head), f16.
    let ckpt = kestrel_formats::load_hf_dir(&dir).unwrap();
    assert_eq!(ckpt.config, draft_config(t.model.config(), 2));
    assert_eq!(ckpt.config.num_hidden_layers, 2);
    assert_eq!(ckpt.config.eos_token_id, t.model.config().eos_token_id);
    assert!(!ckpt.tensors.contains_key("lm_head.weight"));
    assert_eq!(ckpt.tensors.len(), 1 + 2 * 9 + 1);
    assert!(ckpt.tensors.values().all(|t| t.dtype() == DType::F16));
    assert_eq!(ckpt.chat_template.as_deref(), Some("{{ messages }}"));
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(json["torch_dtype"], "float16");
    assert_eq!(json["num_hidden_layers"], 2);

    // The written draft as an inference model predicts what the trainer does.
    let reloaded = Llama::from_tensors(
        &ckpt.config,
        ckpt.tensors.clone(),
        kestrel_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let s = train_idx[0];
    let toks = data.seq_tokens(s);
    let mut cache = reloaded.new_cache(8, 8).unwrap();
    let seq = cache.add_sequence();
    let positions: Vec<u32> = (0..toks.len() as u32).collect();
    let h = reloaded
        .forward(
            &[SeqInput {
                seq,
                tokens: toks,
                positions: &positions,
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache,
        )
        .unwrap();
    let trained = Llama::from_tensors(
        &ckpt.config,
        tr.tensors().unwrap(),
        kestrel_core::DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let mut cache2 = trained.new_cache(8, 8).unwrap();
    let seq2 = cache2.add_sequence();
    let h2 = trained
        .forward(
            &[SeqInput {
                seq: seq2,
                tokens: toks,
                positions: &positions,
                mask: None,
                output_rows: OutputRows::All,
            }],
            &mut cache2,
        )
        .unwrap();
    assert!(max_diff(&h, &h2) < 2e-2, "{}", max_diff(&h, &h2));

    // Resuming from the folder continues at epoch 2 and step count of epoch 1.
    let (rcfg, tensors, rlog) = load_draft(&dir).unwrap();
    let rlog = rlog.unwrap();
    assert_eq!(rlog.command.as_deref(), Some("spec-train draft ..."));
    let student =
        initial_student(t.model.config(), &t.tensors, 2, DraftInit::Tensors(tensors)).unwrap();
    let mut resumed = DraftTrainer::new(rcfg, student, cfg(2), &Device::Cpu).unwrap();
    let e1 = tr.evaluate(&data, &val_idx).unwrap().mean(&tr.cfg).kl;
    let e2 = resumed.evaluate(&data, &val_idx).unwrap().mean(&tr.cfg).kl;
    assert!((e1 - e2).abs() < 2e-2 * e1.max(1e-3), "{e1} vs {e2}");
    let log2 = train_draft(
        &mut resumed,
        &data,
        &train_idx,
        &val_idx,
        "resume",
        None,
        Some(rlog),
        Some(&save),
        &mut |_| {},
    )
    .unwrap();
    let epochs: Vec<usize> = log2.epochs.iter().map(|e| e.epoch).collect();
    assert_eq!(epochs, vec![0, 1, 2]);
    assert_eq!(log2.epochs[2].steps, 2 * log2.epochs[1].steps);
    assert_eq!(log2.init, "layers");
}

#[test]
fn layer_choices_are_checked_with_exact_messages() {
    assert_eq!(default_init_layers(30, 4), vec![0, 10, 20, 29]);
    assert_eq!(default_init_layers(30, 2), vec![0, 29]);
    assert_eq!(default_init_layers(4, 4), vec![0, 1, 2, 3]);
    assert_eq!(default_init_layers(4, 3), vec![0, 2, 3]);
    assert_eq!(default_init_layers(4, 1), vec![0]);
    assert_eq!(
        resolve_init_layers(4, 2, Some(&[3, 1])).unwrap(),
        vec![3, 1]
    );
    let err = |l, n, i: Option<&[usize]>| resolve_init_layers(l, n, i).unwrap_err().to_string();
    assert_eq!(err(4, 0, None), "--num_layers must be at least 1");
    assert_eq!(
        err(4, 5, None),
        "--num_layers 5 exceeds the target's 4 decoder layers: a draft has at most as many layers as its target"
    );
    assert_eq!(
        err(4, 2, Some(&[0, 4])),
        "--init_layers: layer 4 is out of range: the target's decoder layers are 0..=3"
    );
    assert_eq!(
        err(4, 2, Some(&[0])),
        "--init_layers lists 1 layers but --num_layers is 2: give one target layer per draft layer"
    );

    let t = tiny(true);
    let bad = initial_student(
        t.model.config(),
        &t.tensors,
        2,
        DraftInit::TargetLayers(vec![0, 7]),
    )
    .unwrap_err()
    .to_string();
    assert!(bad.contains("layer 7 is out of range"), "{bad}");
    let mut missing = t.tensors.clone();
    missing.remove("model.norm.weight");
    let bad = initial_student(
        t.model.config(),
        &missing,
        2,
        DraftInit::TargetLayers(vec![0, 1]),
    )
    .unwrap_err()
    .to_string();
    assert_eq!(bad, "target tensor 'model.norm.weight' is missing");
    let bad_cfg = DraftTrainConfig {
        kd_temperature: 0.0,
        ..cfg(1)
    };
    let student = initial_student(
        t.model.config(),
        &t.tensors,
        2,
        DraftInit::TargetLayers(vec![0, 1]),
    )
    .unwrap();
    let e = DraftTrainer::new(
        draft_config(t.model.config(), 2),
        student,
        bad_cfg,
        &Device::Cpu,
    )
    .err()
    .unwrap()
    .to_string();
    assert_eq!(e, "--kd_temperature 0 must be positive");
}

#[test]
fn keep_best_gives_back_a_draft_training_made_worse_and_resumes_from_it() {
    let t = tiny(false);
    let data = greedy_data(&t.model, 40, 6, 24);
    let (train_idx, val_idx) = split(data.len(), 0.25, 0);
    let mut good = trainer(&t, 2, DraftInit::TargetLayers(vec![0, 3]), cfg(6));
    let run = |tr: &mut DraftTrainer,
               resume: Option<kestrel_train::draft::DraftTrainLog>,
               save: Option<&DraftSaveOptions>| {
        let mut lines = Vec::new();
        let log = train_draft(
            tr,
            &data,
            &train_idx,
            &val_idx,
            "layers",
            None,
            resume,
            save,
            &mut |l| lines.push(l.to_string()),
        )
        .unwrap();
        (log, lines)
    };
    run(&mut good, None, None);
    let good = good.tensors().unwrap();

    // A step size that wrecks it: the first epoch that fails to beat it ends the run, and
    // the folder and the trainer hold the draft it started from.
    let mut wreck_cfg = cfg(3);
    wreck_cfg.recipe.lr = 0.5;
    wreck_cfg.recipe.grad_clip = 0.0;
    wreck_cfg.recipe.keep_best = true;
    wreck_cfg.recipe.early_stop = Some(1);
    let start = |c: DraftTrainConfig| {
        let student = initial_student(
            t.model.config(),
            &t.tensors,
            2,
            DraftInit::Tensors(good.clone()),
        )
        .unwrap();
        DraftTrainer::new(draft_config(t.model.config(), 2), student, c, &Device::Cpu).unwrap()
    };
    let mut wrecked = start(wreck_cfg);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("draft");
    let save = DraftSaveOptions {
        output_dir: &dir,
        dtype: DType::F32,
        copy_files: vec![],
    };
    let (log, lines) = run(&mut wrecked, None, Some(&save));
    let agreement = |e: usize| log.epochs[e].val.unwrap().top1;
    assert_eq!(log.epochs.len(), 2, "epochs 0 and 1 only");
    assert!(agreement(1) < agreement(0), "{:?}", log.epochs);
    assert_eq!(log.kept_epoch, Some(0));
    assert_eq!(
        lines[lines.len() - 2..],
        [
            "stopping early: 1 epoch(s) without a better held-out agreement than epoch 0's"
                .to_string(),
            format!(
                "kept epoch 0's weights: held-out agreement {:.3}, the best of epochs 0-1",
                agreement(0)
            )
        ]
    );
    let (_, saved, rlog) = load_draft(&dir).unwrap();
    let now = wrecked.tensors().unwrap();
    for (name, want) in &good {
        assert_eq!(max_diff(&now[name], want), 0.0, "trainer's {name}");
        assert_eq!(max_diff(&saved[name], want), 0.0, "saved {name}");
    }

    // Resumed, the run goes on after epoch 1 from the weights the folder kept, epoch 0's.
    let mut sane = cfg(2);
    sane.recipe.keep_best = true;
    let mut resumed = start(sane);
    let (log2, lines2) = run(&mut resumed, rlog, Some(&save));
    assert!(
        lines2[0].starts_with("resuming after epoch 1 (step ")
            && lines2[0].ends_with(") from epoch 0's weights, the ones it kept: 1 epochs to go"),
        "{lines2:?}"
    );
    let epochs: Vec<usize> = log2.epochs.iter().map(|e| e.epoch).collect();
    assert_eq!(epochs, vec![0, 1, 2]);
}

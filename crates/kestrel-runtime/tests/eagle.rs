//! EAGLE-1/EAGLE-2 decoding is lossless: greedy output equals plain greedy output token for
//! token (with heads that agree often and rarely, static and dynamic trees, batches), and
//! exact sampling follows the target distribution.

mod support;

use candle_core::{DType, Device, Tensor};
use kestrel_core::draft_vocab::{DraftVocabRanking, DRAFT_VOCAB_FILE};
use kestrel_runtime::{
    generate, Acceptance, DecodeMode, EagleOptions, EagleTreeKind, Engine, GenerationParams,
    NoSink, SequenceOutput,
};
use kestrel_spec::{EagleTree, SamplingParams};
use std::collections::BTreeMap;
use support::{
    agreeing_pair, build, prompts, random_head, run, seeded_uniform, static_tree, tree_limits,
    EngineSpec,
};

fn greedy(max_output_len: usize) -> GenerationParams {
    GenerationParams {
        max_output_len,
        sampling: SamplingParams::greedy(),
        end_ids: vec![],
    }
}

/// An engine (default spec) of [`agreeing_pair`]`(seed)`, built in a temporary folder that
/// lives as long as the returned guard.
fn agreeing_engine(seed: u64) -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(seed);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    (dir, engine)
}

fn ids(outputs: &[SequenceOutput]) -> Vec<Vec<u32>> {
    outputs.iter().map(|o| o.output_ids.clone()).collect()
}

fn static_mode(preset: &str) -> DecodeMode<'static> {
    DecodeMode::Eagle(EagleOptions {
        tree: static_tree(preset),
        acceptance: Acceptance::TokenMatch,
        draft_vocab: None,
        lookup: None,
        disable_by_batch_size: None,
    })
}

fn dynamic_mode(top_k: usize) -> DecodeMode<'static> {
    capped_dynamic_mode(top_k, None, None)
}

/// EAGLE-2 with run-time caps on its draft nodes and layers.
fn capped_dynamic_mode(
    top_k: usize,
    max_draft_len: Option<usize>,
    num_layers: Option<usize>,
) -> DecodeMode<'static> {
    gated_dynamic_mode(top_k, max_draft_len, num_layers, 0.0)
}

/// EAGLE-2 with run-time caps and a confidence gate on its nodes' draft probability.
fn gated_dynamic_mode(
    top_k: usize,
    max_draft_len: Option<usize>,
    num_layers: Option<usize>,
    min_prob: f32,
) -> DecodeMode<'static> {
    DecodeMode::Eagle(EagleOptions {
        tree: EagleTreeKind::Dynamic {
            top_k,
            max_draft_len,
            num_layers,
            min_prob,
        },
        acceptance: Acceptance::TokenMatch,
        draft_vocab: None,
        lookup: None,
        disable_by_batch_size: None,
    })
}

fn mean_tokens_per_step(outputs: &[SequenceOutput]) -> f64 {
    outputs.iter().map(|o| o.stats.tokens_per_step).sum::<f64>() / outputs.len() as f64
}

/// Plain greedy output of `engine` and each EAGLE mode's output must be identical.
fn assert_lossless(engine: &Engine, modes: &[(&str, DecodeMode)], len: usize) -> Vec<f64> {
    let prompts = prompts();
    let plain = ids(&run(engine, &DecodeMode::Plain, &prompts, &greedy(len)));
    assert!(plain.iter().all(|o| o.len() == len));
    modes
        .iter()
        .map(|(name, mode)| {
            let out = run(engine, mode, &prompts, &greedy(len));
            assert_eq!(
                ids(&out),
                plain,
                "{name} differs from plain greedy decoding"
            );
            mean_tokens_per_step(&out)
        })
        .collect()
}

#[test]
fn greedy_eagle_equals_plain_with_an_agreeing_head() {
    let (_dir, engine) = agreeing_engine(11);
    let modes = [
        ("mc_sim_7b_63", static_mode("mc_sim_7b_63")),
        ("chain_4", static_mode("chain_4")),
        ("small_8", static_mode("small_8")),
        ("eagle2 top 4", dynamic_mode(4)),
        ("eagle2 top 10", dynamic_mode(10)),
    ];
    let tau = assert_lossless(&engine, &modes, 48);
    // The head agrees often, so every tree commits several tokens per target call.
    for (t, (name, _)) in tau.iter().zip(&modes) {
        assert!(
            *t > 2.0,
            "{name}: only {t:.2} tokens per step with an agreeing head"
        );
    }
}

/// `mode` drafting from the first `n` token ids only.
fn with_draft_vocab(mode: DecodeMode<'static>, n: usize) -> DecodeMode<'static> {
    match mode {
        DecodeMode::Eagle(o) => DecodeMode::Eagle(EagleOptions {
            draft_vocab: Some(n),
            ..o
        }),
        other => other,
    }
}

#[test]
fn a_draft_vocabulary_keeps_greedy_output_and_is_checked() {
    let (_dir, engine) = agreeing_engine(11);
    // Half of the 48-token vocabulary: the target's tokens outside it are never drafted and
    // still come out, from the target's own choice.
    let modes = [
        (
            "small_8, 24 tokens",
            with_draft_vocab(static_mode("small_8"), 24),
        ),
        (
            "mc_sim_7b_63, 10 tokens",
            with_draft_vocab(static_mode("mc_sim_7b_63"), 10),
        ),
        (
            "eagle2 top 4, 24 tokens",
            with_draft_vocab(dynamic_mode(4), 24),
        ),
    ];
    assert_lossless(&engine, &modes, 48);
    let refused = |mode: DecodeMode| {
        generate(&engine, &mode, &prompts(), &greedy(4), &mut NoSink)
            .unwrap_err()
            .to_string()
    };
    assert_eq!(
        refused(with_draft_vocab(static_mode("small_8"), 49)),
        "a draft vocabulary of 49 tokens: it must hold the tree's 3 candidates per node and at most the model's 48 tokens"
    );
    assert_eq!(
        refused(with_draft_vocab(static_mode("mc_sim_7b_63"), 9)),
        "a draft vocabulary of 9 tokens: it must hold the tree's 10 candidates per node and at most the model's 48 tokens"
    );
}

/// Writes a ranking into `engine_dir` that puts the tokens `first` says yes to first, then
/// loads the engine.
fn with_ranking(engine_dir: &std::path::Path, vocab: usize, first: impl Fn(u32) -> bool) -> Engine {
    let counts: Vec<u64> = (0..vocab as u32).map(|t| u64::from(first(t))).collect();
    DraftVocabRanking::from_counts(&counts)
        .save(&engine_dir.join(DRAFT_VOCAB_FILE))
        .unwrap();
    Engine::load(engine_dir, &Device::Cpu).unwrap()
}

#[test]
fn a_ranked_draft_vocabulary_drafts_its_first_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(11);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    assert!(engine.draft_vocab.is_none());
    let plain = ids(&run(&engine, &DecodeMode::Plain, &prompts(), &greedy(48)));
    let said: std::collections::BTreeSet<u32> = plain.iter().flatten().copied().collect();
    let vocab = cfg.vocab_size;
    assert!(
        said.len() + 1 < vocab,
        "the target says {} tokens",
        said.len()
    );

    // Ranked first, the tokens the target says are all the head can draft: they are enough.
    let engine = with_ranking(&engine_dir, vocab, |t| said.contains(&t));
    assert_eq!(engine.draft_vocab.as_ref().unwrap().len(), vocab);
    let mode = with_draft_vocab(static_mode("chain_4"), said.len());
    let tau = assert_lossless(&engine, &[("said first", mode)], 48);
    assert!(tau[0] > 2.0, "{:.2} tokens per step", tau[0]);

    // Ranked last, they are out of reach: no drafted token is ever accepted, and the output
    // is still the target's.
    let engine = with_ranking(&engine_dir, vocab, |t| !said.contains(&t));
    let mode = with_draft_vocab(static_mode("chain_4"), vocab - said.len());
    let tau = assert_lossless(&engine, &[("said last", mode)], 48);
    assert_eq!(tau[0], 1.0);
}

#[test]
fn greedy_eagle_equals_plain_with_a_random_head() {
    let dir = tempfile::tempdir().unwrap();
    let engine = support::random_head_engine(dir.path());
    let modes = [
        ("mc_sim_7b_63", static_mode("mc_sim_7b_63")),
        ("small_8", static_mode("small_8")),
        ("eagle2 top 3", dynamic_mode(3)),
    ];
    assert_lossless(&engine, &modes, 40);
}

/// A head reading several base layers (EAGLE-3's features) is lossless; with
/// `fuse = [I | 0]` it drafts exactly what the same head without `fuse` drafts (same outputs,
/// same accepted drafts), so the runtime feeds it the final feature where an EAGLE-1 head
/// reads it and the fused feature comes from the base's tapped rows.
#[test]
fn a_head_reading_several_base_layers_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::tiny_config(3);
    let h = cfg.hidden_size;
    let base = kestrel_model::llama::random_tensors(&cfg, 5).unwrap();
    let head = random_head(&cfg, 6);
    let modes = [
        ("mc_sim_7b_63", static_mode("mc_sim_7b_63")),
        ("small_8", static_mode("small_8")),
        ("eagle2 top 3", dynamic_mode(3)),
    ];
    let fused_spec = EngineSpec {
        feature_layers: vec![0, 1],
        ..EngineSpec::default()
    };
    let engine_at = |name: &str, head: &BTreeMap<String, Tensor>, spec: &EngineSpec| {
        let engine_dir = build(&dir.path().join(name), &cfg, &base, Some(head), spec);
        Engine::load(&engine_dir, &Device::Cpu).unwrap()
    };
    let mut fused = head.clone();
    fused.insert("fuse.weight".into(), seeded_uniform(7, (h, 3 * h), 0.2));
    assert_lossless(&engine_at("fused", &fused, &fused_spec), &modes, 40);

    let eye = Tensor::eye(h, DType::F32, &Device::Cpu).unwrap();
    let rest = Tensor::zeros((h, 2 * h), DType::F32, &Device::Cpu).unwrap();
    let mut passthrough = head.clone();
    passthrough.insert(
        "fuse.weight".into(),
        Tensor::cat(&[&eye, &rest], 1).unwrap(),
    );
    let passthrough = engine_at("passthrough", &passthrough, &fused_spec);
    let unfused = engine_at("unfused", &head, &EngineSpec::default());
    let prompts = prompts();
    let mut accepted = 0;
    for (name, mode) in &modes {
        let a = run(&passthrough, mode, &prompts, &greedy(40));
        let b = run(&unfused, mode, &prompts, &greedy(40));
        assert_eq!(ids(&a), ids(&b), "{name}: outputs differ");
        let drafts = |o: &[SequenceOutput]| -> Vec<(usize, usize)> {
            o.iter()
                .map(|o| (o.stats.draft_tokens, o.stats.accepted_draft_tokens))
                .collect()
        };
        assert_eq!(drafts(&a), drafts(&b), "{name}: drafts differ");
        accepted += drafts(&a).iter().map(|d| d.1).sum::<usize>();
    }
    assert!(accepted > 0, "the random head never drafted a right token");
}

/// A head of several stacked decoder layers (its KV cache one layer per head layer) is
/// lossless in static and dynamic trees, and drafts differently from its first layer alone.
#[test]
fn a_head_of_stacked_layers_is_lossless() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::tiny_config(2);
    let base = kestrel_model::llama::random_tensors(&cfg, 5).unwrap();
    let modes = [
        ("mc_sim_7b_63", static_mode("mc_sim_7b_63")),
        ("small_8", static_mode("small_8")),
        ("eagle2 top 3", dynamic_mode(3)),
    ];
    let stacked = support::random_stacked_head(&cfg, 6, 3);
    let spec = EngineSpec {
        head_layers: 3,
        ..EngineSpec::default()
    };
    let engine_dir = build(
        &dir.path().join("stacked"),
        &cfg,
        &base,
        Some(&stacked),
        &spec,
    );
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    assert_eq!(engine.eagle.as_ref().unwrap().num_layers(), 3);
    assert_lossless(&engine, &modes, 40);

    // Its first layer alone is another head: the stacked layers are used, not ignored.
    let first: BTreeMap<String, Tensor> = stacked
        .iter()
        .filter(|(k, _)| !k.starts_with("layers.1.") && !k.starts_with("layers.2."))
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let engine_dir = build(
        &dir.path().join("first"),
        &cfg,
        &base,
        Some(&first),
        &EngineSpec::default(),
    );
    let first = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let prompts = prompts();
    let drafts = |e: &Engine| -> Vec<usize> {
        run(e, &modes[1].1, &prompts, &greedy(40))
            .iter()
            .map(|o| o.stats.accepted_draft_tokens)
            .collect()
    };
    let accepted = drafts(&engine);
    assert_ne!(
        accepted,
        drafts(&first),
        "the stacked layers changed nothing"
    );
}

/// Random valid trees: every prefix present, ranks below 4, depth ≤ 4, ≤ 24 nodes.
fn random_tree(seed: u64) -> Vec<Vec<usize>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tree: Vec<Vec<usize>> = vec![vec![0]];
    let target = rng.random_range(1..24);
    while tree.len() < target {
        let parent = tree[rng.random_range(0..tree.len())].clone();
        if parent.len() >= 4 {
            continue;
        }
        let mut child = parent;
        child.push(rng.random_range(0..4));
        // Ranks must be contiguous prefixes of the head's top-k for EAGLE drafting to be
        // meaningful, but any rank below top-k is valid; add the missing lower siblings.
        let last = *child.last().unwrap();
        for r in 0..=last {
            let mut sibling = child.clone();
            *sibling.last_mut().unwrap() = r;
            if !tree.contains(&sibling) {
                tree.push(sibling);
            }
        }
    }
    tree
}

#[test]
fn greedy_eagle_equals_plain_on_random_trees() {
    let (_dir, engine) = agreeing_engine(21);
    let modes: Vec<(String, DecodeMode)> = (0..6)
        .map(|seed| {
            let choices = random_tree(seed);
            let tree = EagleTree::new(&choices, &tree_limits())
                .unwrap_or_else(|e| panic!("{choices:?}: {e}"));
            (
                format!("{choices:?}"),
                DecodeMode::Eagle(EagleOptions {
                    tree: EagleTreeKind::Static(tree),
                    acceptance: Acceptance::TokenMatch,
                    draft_vocab: None,
                    lookup: None,
                    disable_by_batch_size: None,
                }),
            )
        })
        .collect();
    let named: Vec<(&str, DecodeMode)> = modes
        .into_iter()
        .map(|(n, m)| (Box::leak(n.into_boxed_str()) as &str, m))
        .collect();
    assert_lossless(&engine, &named, 32);
}

#[test]
fn typical_acceptance_at_temperature_zero_is_greedy() {
    let (_dir, engine) = agreeing_engine(3);
    let typical = DecodeMode::Eagle(EagleOptions {
        tree: EagleTreeKind::Static(
            EagleTree::from_preset("mc_sim_7b_63", &tree_limits()).unwrap(),
        ),
        acceptance: Acceptance::Typical {
            posterior_threshold: 0.09,
        },
        draft_vocab: None,
        lookup: None,
        disable_by_batch_size: None,
    });
    assert_lossless(&engine, &[("typical", typical)], 24);
}

#[test]
fn exact_sampling_follows_the_target_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, engine) = support::distribution_engine(dir.path());
    let engine_dir = engine.dir.clone();
    let prompt = vec![3u32, 17, 9];
    let temperature = 1.5;
    let expected = support::second_token_distribution(&engine, &prompt, temperature);
    // The whole vocabulary, and a draft vocabulary of its first 20 tokens: the proposal
    // then gives the other 28 probability 0, and the residual must restore them.
    let mode = |draft_vocab| {
        DecodeMode::Eagle(EagleOptions {
            tree: EagleTreeKind::Static(EagleTree::from_preset("small_8", &tree_limits()).unwrap()),
            acceptance: Acceptance::Exact,
            draft_vocab,
            lookup: None,
            disable_by_batch_size: None,
        })
    };
    for draft_vocab in [None, Some(20)] {
        support::assert_second_token_follows(
            &engine,
            &mode(draft_vocab),
            &prompt,
            temperature,
            &expected,
        );
    }
    // 20 tokens of a ranking (odd ids first): the proposal's columns are scattered back to
    // their token ids.
    let ranked = with_ranking(&engine_dir, cfg.vocab_size, |t| t % 2 == 1);
    support::assert_second_token_follows(&ranked, &mode(Some(20)), &prompt, temperature, &expected);
}

#[test]
fn eagle2_refuses_top_k_beyond_the_engine_limits() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(1);
    let spec = EngineSpec {
        max_non_leaves_per_layer: 4,
        ..EngineSpec::default()
    };
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &spec);
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let err = generate(
        &engine,
        &dynamic_mode(5),
        &prompts(),
        &greedy(4),
        &mut NoSink,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        kestrel_spec::DynamicTreeConfig {
            top_k: 5,
            num_layers: 4,
            max_draft_len: 63,
            max_non_leaves_per_layer: 4,
            min_prob: 0.0,
        }
        .validate()
        .unwrap_err()
        .to_string()
    );
}

#[test]
fn eagle2_caps_its_draft_nodes_and_layers_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(11);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let prompts = prompts();
    let longest_step = |outputs: &[SequenceOutput]| {
        outputs
            .iter()
            .map(|o| o.stats.accepted_len_histogram.len())
            .max()
            .unwrap()
    };
    // Uncapped, the agreeing head commits more than 3 tokens in some step (4 layers + bonus).
    let full = run(&engine, &dynamic_mode(4), &prompts, &greedy(48));
    assert!(longest_step(&full) > 3);
    let plain = run(&engine, &DecodeMode::Plain, &prompts, &greedy(48));
    let out = run(
        &engine,
        &capped_dynamic_mode(3, Some(3), Some(2)),
        &prompts,
        &greedy(48),
    );
    assert_eq!(ids(&out), ids(&plain), "capped EAGLE-2 differs from plain");
    // 2 layers: at most 2 drafts and the bonus token a step; at most 3 nodes drafted a step.
    assert!(longest_step(&out) <= 3);
    for o in &out {
        assert!(o.stats.draft_tokens <= 3 * o.stats.steps, "{:?}", o.stats);
    }
    let dir_text = engine_dir.display();
    for (mode, want) in [
        (
            capped_dynamic_mode(4, Some(64), None),
            format!("--eagle_dynamic_tree_max_draft_len 64 exceeds 63, the limit {dir_text} was built with; more needs spec-build --max_draft_len 64"),
        ),
        (
            capped_dynamic_mode(4, None, Some(5)),
            format!("--eagle_dynamic_tree_num_layers 5 exceeds 4, the limit {dir_text} was built with; more needs convert-checkpoint --num_eagle_layers 5"),
        ),
        (
            capped_dynamic_mode(4, None, Some(0)),
            "--eagle_dynamic_tree_num_layers 0: EAGLE-2 needs at least 1".to_string(),
        ),
        (
            capped_dynamic_mode(4, Some(3), None),
            "--eagle_dynamic_tree_max_top_k 4 exceeds --eagle_dynamic_tree_max_draft_len 3: the first layer alone drafts 4 nodes".to_string(),
        ),
    ] {
        let err = generate(&engine, &mode, &prompts, &greedy(4), &mut NoSink).unwrap_err();
        assert_eq!(err.to_string(), want);
    }
}

#[test]
fn eagle2_gated_by_draft_confidence_drafts_less_and_keeps_plain_output() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, mut base, head) = agreeing_pair(11);
    // The agreeing head guesses right but with flat probabilities; a sharper LM head (the
    // same argmax) spreads its confidence across the gates tried below.
    let lm_head = "lm_head.weight".to_string();
    base.insert(lm_head.clone(), (base[&lm_head].clone() * 8.0).unwrap());
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let prompts = prompts();
    let plain = run(&engine, &DecodeMode::Plain, &prompts, &greedy(48));
    // (top-k, layers, gate) → (drafted nodes, steps), summed over the batch's sequences.
    let drafted = |top_k, layers, gate| {
        let out = run(
            &engine,
            &gated_dynamic_mode(top_k, None, Some(layers), gate),
            &prompts,
            &greedy(48),
        );
        assert_eq!(ids(&out), ids(&plain), "gate {gate} changed the output");
        let sum = |f: fn(&SequenceOutput) -> usize| out.iter().map(f).sum::<usize>();
        (sum(|o| o.stats.draft_tokens), sum(|o| o.stats.steps))
    };
    // Ungated, a one-node tree drafts every step.
    let (drafts, steps) = drafted(1, 1, 0.0);
    assert_eq!(drafts, steps);
    // Gated, some steps draft and some (in the same batch) run as plain decode steps.
    for layers in [1, 3] {
        let (drafts, steps) = drafted(1, layers, 0.5);
        assert!(
            drafts > 0 && drafts < steps,
            "{drafts} drafts in {steps} steps"
        );
    }
    for (top_k, layers, gate) in [(3, 4, 0.3), (4, 4, 0.9)] {
        drafted(top_k, layers, gate);
    }
    // Nothing is sure enough for a gate of 1: every step is a plain one.
    assert_eq!(
        drafted(2, 2, 1.0),
        (0, 4 * 47),
        "4 prompts, 47 steps after the prefill"
    );
}

#[test]
fn eagle_needs_an_engine_with_a_head() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::tiny_config(1);
    let base = kestrel_model::llama::random_tensors(&cfg, 2).unwrap();
    let spec = EngineSpec {
        mode: kestrel_core::SpeculativeMode::None,
        ..EngineSpec::default()
    };
    let engine_dir = build(dir.path(), &cfg, &base, None, &spec);
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let err = generate(
        &engine,
        &static_mode("chain_4"),
        &prompts(),
        &greedy(4),
        &mut NoSink,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "{} has no EAGLE head: build it with spec-build --speculative_decoding_mode eagle from a checkpoint converted with --eagle_model_dir",
            engine_dir.display()
        )
    );
}

/// Static trees keep their top-k drafted tokens where the head runs, unless
/// `set_draft_on_device(false)` fetches them after every level: either way the same drafts
/// are proposed and accepted (greedy output alone would hide wrong drafts, so the acceptance
/// counts are compared too), greedy and sampled, token matching and typical acceptance, with
/// and without a draft vocabulary. (Other tests of this binary may run while the switch is
/// off; both paths are lossless, so they pass either way.)
#[test]
fn drafted_tokens_on_the_device_or_fetched_per_level_are_the_same_drafts() {
    use kestrel_runtime::device::set_draft_on_device;
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(11);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let mode = |acceptance: Acceptance, draft_vocab: Option<usize>| {
        DecodeMode::Eagle(EagleOptions {
            tree: EagleTreeKind::Static(
                EagleTree::from_preset("mc_sim_7b_63", &tree_limits()).unwrap(),
            ),
            acceptance,
            draft_vocab,
            lookup: None,
            disable_by_batch_size: None,
        })
    };
    let typical = Acceptance::Typical {
        posterior_threshold: 0.09,
    };
    let sampled = GenerationParams {
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 0,
            top_p: 1.0,
            seed: 9,
        },
        ..greedy(32)
    };
    let prompts = prompts();
    for (name, mode, params) in [
        ("greedy", mode(Acceptance::TokenMatch, None), greedy(32)),
        (
            "greedy, draft vocabulary",
            mode(Acceptance::TokenMatch, Some(cfg.vocab_size / 2)),
            greedy(32),
        ),
        (
            "token match",
            mode(Acceptance::TokenMatch, None),
            sampled.clone(),
        ),
        ("typical", mode(typical, None), sampled.clone()),
    ] {
        let outcome = |on: bool| {
            set_draft_on_device(on);
            let out = run(&engine, &mode, &prompts, &params);
            set_draft_on_device(true);
            out.iter()
                .map(|o| {
                    (
                        o.output_ids.clone(),
                        o.stats.steps,
                        o.stats.accepted_draft_tokens,
                    )
                })
                .collect::<Vec<_>>()
        };
        let on = outcome(true);
        assert_eq!(outcome(false), on, "{name}");
        let accepted: usize = on.iter().map(|o| o.2).sum();
        let steps: usize = on.iter().map(|o| o.1).sum();
        // Drafts that often agree, so that wrong ones would show.
        assert!(
            2 * accepted > steps,
            "{name}: {accepted} drafts accepted in {steps} steps"
        );
    }
}

//! In-flight batching: a sequence that finishes gives its place in the batch to the next
//! prompt at once, in every decoding mode, and no sequence's output depends on which others
//! shared its steps.

mod support;

use candle_core::Device;
use kestrel_core::SpeculativeMode;
use kestrel_runtime::{
    generate, Acceptance, DecodeMode, DraftTargetOptions, EagleOptions, Engine, GenerationParams,
    PromptLookup, SequenceOutput, TokenSink,
};
use kestrel_spec::{PromptLookupConfig, SamplingParams};
use support::{agreeing_pair, build, dynamic_tree, run, sampled, static_tree, EngineSpec};

/// Records which sequence each streamed token belongs to, in order.
#[derive(Default)]
struct Order(Vec<usize>);

impl TokenSink for Order {
    fn on_tokens(&mut self, index: usize, tokens: &[u32]) {
        self.0.extend(tokens.iter().map(|_| index));
    }
}

fn prompts() -> Vec<Vec<u32>> {
    vec![
        vec![3, 17, 9],
        vec![5, 1, 44, 20, 20, 8, 31],
        vec![12],
        vec![7, 30, 2, 19, 40, 11],
        vec![21, 22],
    ]
}

fn modes() -> Vec<(&'static str, DecodeMode<'static>)> {
    let eagle = |tree, lookup| {
        DecodeMode::Eagle(EagleOptions {
            tree,
            acceptance: Acceptance::TokenMatch,
            draft_vocab: None,
            lookup,
            disable_by_batch_size: None,
        })
    };
    let lookup = || PromptLookup {
        config: PromptLookupConfig::new(3, 2).unwrap(),
        corpus: None,
    };
    vec![
        ("plain", DecodeMode::Plain),
        ("eagle small_8", eagle(static_tree("small_8"), None)),
        ("eagle2 top 3", eagle(dynamic_tree(3), None)),
        (
            "eagle small_8 + lookup",
            eagle(static_tree("small_8"), Some(lookup())),
        ),
        (
            "prompt lookup",
            DecodeMode::PromptLookup {
                lookup: lookup(),
                disable_by_batch_size: None,
            },
        ),
    ]
}

/// `engine` decoding `prompts` with at most `batch` sequences at once.
fn with_batch(engine: &mut Engine, batch: usize, f: impl FnOnce(&Engine)) {
    let built = engine.plan.limits.max_batch_size;
    engine.plan.limits.max_batch_size = batch;
    f(engine);
    engine.plan.limits.max_batch_size = built;
}

#[test]
fn a_finished_sequence_gives_its_place_to_the_next_prompt_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(11);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let mut engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let prompts = prompts();
    // Sequence 0 stops at its second token (an end id), the others run 24 tokens.
    let free = GenerationParams {
        max_output_len: 24,
        sampling: SamplingParams::greedy(),
        end_ids: vec![],
    };
    let alone = run(&engine, &DecodeMode::Plain, &prompts[..1], &free);
    let end = alone[0].output_ids[1];
    let params = GenerationParams {
        end_ids: vec![end],
        ..free
    };
    for (name, mode) in modes() {
        with_batch(&mut engine, 2, |engine| {
            let mut order = Order::default();
            let (outputs, _) = generate(engine, &mode, &prompts, &params, &mut order).unwrap();
            let lengths: Vec<usize> = outputs.iter().map(|o| o.output_ids.len()).collect();
            assert_eq!(lengths, vec![2, 24, 24, 24, 24], "{name}");
            // Sequence 2 streamed its first token while sequence 1 was still decoding: it
            // took sequence 0's place, not a place in the next batch of two.
            let first_of_2 = order.0.iter().position(|&i| i == 2).unwrap();
            let last_of_1 = order.0.iter().rposition(|&i| i == 1).unwrap();
            assert!(first_of_2 < last_of_1, "{name}: {:?}", order.0);
        });
    }
}

/// The agreeing pair's EAGLE engine, built in `dir` for batches of up to 5.
fn engine_of_five(dir: &std::path::Path) -> Engine {
    let (cfg, base, head) = agreeing_pair(11);
    let spec = EngineSpec {
        max_batch_size: 5,
        ..EngineSpec::default()
    };
    let engine_dir = build(dir, &cfg, &base, Some(&head), &spec);
    Engine::load(&engine_dir, &Device::Cpu).unwrap()
}

/// Batches of 1, 2 and 5 give every sequence the same tokens, greedy and sampled: a sequence's
/// stream and the batch-invariant CPU kernels do not depend on its neighbours.
#[test]
fn outputs_do_not_depend_on_the_batch_limit() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = engine_of_five(dir.path());
    let prompts = prompts();
    for params in [
        GenerationParams {
            max_output_len: 20,
            sampling: SamplingParams::greedy(),
            end_ids: vec![7, 30],
        },
        GenerationParams {
            end_ids: vec![7, 30],
            ..sampled(20, 0.9, 4)
        },
    ] {
        for (name, mode) in modes() {
            let mut by_batch = Vec::new();
            for batch in [1, 2, 5] {
                with_batch(&mut engine, batch, |engine| {
                    let out = run(engine, &mode, &prompts, &params);
                    by_batch.push(out.iter().map(|o| o.output_ids.clone()).collect::<Vec<_>>());
                });
            }
            assert_eq!(by_batch[1], by_batch[0], "{name}, batches of 2");
            assert_eq!(by_batch[2], by_batch[0], "{name}, batches of 5");
        }
    }
}

/// With speculation off above a batch size, steps of a fuller batch draft nothing and steps
/// of fewer sequences draft again, the head first reading the pairs it missed: greedy, every
/// sequence keeps plain decoding's tokens; sampled, a run that never drafts makes plain
/// decoding's very draws, and a limit at the batch size changes nothing.
#[test]
fn speculation_off_above_a_batch_size_keeps_every_output() {
    let dir = tempfile::tempdir().unwrap();
    let engine = engine_of_five(dir.path());
    let prompts = prompts();
    // Sequence 0 leaves the batch after 6 tokens; the 4 left speculate again under a limit
    // of 4.
    let greedy = ending_the_first_after_six(&engine, &prompts);
    let ids = |out: &[SequenceOutput]| out.iter().map(|o| o.output_ids.clone()).collect::<Vec<_>>();
    let drafts = |out: &[SequenceOutput]| out.iter().map(|o| o.stats.draft_tokens).sum::<usize>();
    let plain = run(&engine, &DecodeMode::Plain, &prompts, &greedy);
    assert_eq!(plain[0].output_ids.len(), 6);
    assert!(plain[1..].iter().all(|o| o.output_ids.len() > 6));
    let sampled_params = GenerationParams {
        end_ids: vec![7, 30],
        ..sampled(20, 0.9, 4)
    };
    let sampled_plain = run(&engine, &DecodeMode::Plain, &prompts, &sampled_params);
    for (name, mode) in modes() {
        if matches!(mode, DecodeMode::Plain) {
            continue;
        }
        let limited = |n| limited(&mode, n);
        let always = run(&engine, &mode, &prompts, &greedy);
        for n in [1, 4, 5] {
            let out = run(&engine, &limited(n), &prompts, &greedy);
            assert_eq!(ids(&out), ids(&plain), "{name}, off above {n}");
            match n {
                1 => assert_eq!(drafts(&out), 0, "{name}: a batch of one never formed"),
                4 => assert!(
                    drafts(&out) > 0 && drafts(&out) < drafts(&always),
                    "{name}: {} drafts, {} always",
                    drafts(&out),
                    drafts(&always)
                ),
                _ => assert_eq!(drafts(&out), drafts(&always), "{name}"),
            }
        }
        let never = run(&engine, &limited(2), &prompts, &sampled_params);
        assert_eq!(drafts(&never), 0, "{name}");
        assert_eq!(ids(&never), ids(&sampled_plain), "{name}, sampled");
        let always = run(&engine, &mode, &prompts, &sampled_params);
        let at_batch = run(&engine, &limited(5), &prompts, &sampled_params);
        assert_eq!(ids(&at_batch), ids(&always), "{name}, sampled, off above 5");
    }
}

/// Greedy decoding of up to 20 tokens that ends where the first prompt's sixth token is
/// made: the first sequence leaves the batch after 6 tokens, the others when they make it.
fn ending_the_first_after_six(engine: &Engine, prompts: &[Vec<u32>]) -> GenerationParams {
    let free = GenerationParams {
        max_output_len: 20,
        sampling: SamplingParams::greedy(),
        end_ids: vec![],
    };
    let end = run(engine, &DecodeMode::Plain, &prompts[..1], &free)[0].output_ids[5];
    GenerationParams {
        end_ids: vec![end],
        ..free
    }
}

/// `mode` with speculation off above `n` sequences.
fn limited<'a>(mode: &DecodeMode<'a>, n: usize) -> DecodeMode<'a> {
    match mode {
        DecodeMode::Eagle(options) => DecodeMode::Eagle(EagleOptions {
            disable_by_batch_size: Some(n),
            ..options.clone()
        }),
        DecodeMode::PromptLookup { lookup, .. } => DecodeMode::PromptLookup {
            lookup: lookup.clone(),
            disable_by_batch_size: Some(n),
        },
        DecodeMode::DraftTarget { draft, options } => DecodeMode::DraftTarget {
            draft,
            options: DraftTargetOptions {
                disable_by_batch_size: Some(n),
                ..options.clone()
            },
        },
        DecodeMode::Plain => unreachable!("plain decoding does not speculate"),
    }
}

/// Draft-target with speculation off above a batch size: steps of the full batch draft
/// nothing, later steps draft again once the draft model has read the tokens it skipped, and
/// the output stays plain decoding's. The draft is the target itself, so its drafts are all
/// accepted but where a sequence ends mid-chain.
#[test]
fn a_draft_model_catches_up_after_steps_off() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = support::tiny_config(1);
    let weights = kestrel_model::llama::random_tensors(&cfg, 5).unwrap();
    // The same weights built as the target (verifying external drafts) and as the draft.
    let engine = |name: &str, mode| {
        let spec = EngineSpec {
            mode,
            max_batch_size: 5,
            max_draft_len: 4,
            ..EngineSpec::default()
        };
        let built = build(&dir.path().join(name), &cfg, &weights, None, &spec);
        Engine::load(&built, &Device::Cpu).unwrap()
    };
    let target = engine("target", SpeculativeMode::DraftTokensExternal);
    let draft = engine("draft", SpeculativeMode::None);
    let prompts = prompts();
    let params = ending_the_first_after_six(&target, &prompts);
    let plain = run(&target, &DecodeMode::Plain, &prompts, &params);
    let mode = DecodeMode::DraftTarget {
        draft: &draft,
        options: DraftTargetOptions {
            draft_len: 3,
            use_logits: false,
            disable_by_batch_size: None,
        },
    };
    let sum =
        |out: &[SequenceOutput], f: fn(&SequenceOutput) -> usize| out.iter().map(f).sum::<usize>();
    let always = sum(&run(&target, &mode, &prompts, &params), |o| {
        o.stats.draft_tokens
    });
    for n in [1, 4, 5] {
        let out = run(&target, &limited(&mode, n), &prompts, &params);
        let ids: Vec<&Vec<u32>> = out.iter().map(|o| &o.output_ids).collect();
        let want: Vec<&Vec<u32>> = plain.iter().map(|o| &o.output_ids).collect();
        assert_eq!(ids, want, "off above {n}");
        let drafted = sum(&out, |o| o.stats.draft_tokens);
        let accepted = sum(&out, |o| o.stats.accepted_draft_tokens);
        // A draft equal to the target loses drafts only where a sequence ends mid-chain.
        assert!(
            drafted - accepted <= prompts.len(),
            "off above {n}: {accepted} of {drafted} drafts accepted: the draft fell behind"
        );
        match n {
            1 => assert_eq!(drafted, 0),
            4 => assert!(drafted > 0 && drafted < always, "{drafted} of {always}"),
            _ => assert_eq!(drafted, always),
        }
    }
}

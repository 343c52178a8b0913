//! Prompt lookup's drafts grafted onto EAGLE's trees (`EagleOptions::lookup`): greedy output
//! stays plain greedy's, the lookup's branch is accepted where the head misses, sampled
//! output follows the target's distribution, and drawn children refuse the graft.

mod support;

use candle_core::Device;
use kestrel_runtime::{
    generate, Acceptance, DecodeMode, EagleOptions, EagleTreeKind, Engine, NoSink, PromptLookup,
    SequenceOutput,
};
use kestrel_spec::{NgramCorpus, PromptLookupConfig};
use std::sync::Arc;
use support::{agreeing_pair, build, dynamic_tree, prompts, run, sampled, static_tree, EngineSpec};

fn eagle(
    tree: EagleTreeKind,
    acceptance: Acceptance,
    lookup: Option<PromptLookup>,
) -> DecodeMode<'static> {
    DecodeMode::Eagle(EagleOptions {
        tree,
        acceptance,
        draft_vocab: None,
        lookup,
        disable_by_batch_size: None,
    })
}

fn lookup(num_tokens: usize, corpus: Option<NgramCorpus>) -> PromptLookup {
    PromptLookup {
        config: PromptLookupConfig::new(num_tokens, 3).unwrap(),
        corpus: corpus.map(Arc::new),
    }
}

fn tokens_per_step(outputs: &[SequenceOutput]) -> f64 {
    let committed: usize = outputs.iter().map(|o| o.output_ids.len()).sum();
    let steps: usize = outputs.iter().map(|o| o.stats.steps).sum();
    committed as f64 / steps as f64
}

/// A head that rarely agrees with the target, and a corpus of the target's own greedy
/// answers: the lookup branch carries the steps, and every output is plain greedy's, alone
/// and batched, static and dynamic trees, with and without the corpus.
#[test]
fn grafted_lookups_keep_greedy_output_and_accept_where_the_head_misses() {
    let dir = tempfile::tempdir().unwrap();
    let engine = support::random_head_engine(dir.path());
    let prompts = prompts();
    let greedy = sampled(40, 0.0, 0);
    let plain = run(&engine, &DecodeMode::Plain, &prompts, &greedy);
    let plain_ids: Vec<Vec<u32>> = plain.iter().map(|o| o.output_ids.clone()).collect();
    let answers: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&plain_ids)
        .map(|(p, o)| [p.as_slice(), o].concat())
        .collect();
    let corpus = || NgramCorpus::build(answers.iter().map(Vec::as_slice));

    // mc_sim_7b_63's 63 drafts fill the engine's max_draft_len: nothing may be grafted.
    for (name, tree, room) in [
        ("small_8", static_tree("small_8"), true),
        ("mc_sim_7b_63", static_tree("mc_sim_7b_63"), false),
        ("eagle2 top 3", dynamic_tree(3), true),
    ] {
        let alone = run(
            &engine,
            &eagle(tree.clone(), Acceptance::TokenMatch, None),
            &prompts,
            &greedy,
        );
        for (with, l) in [
            ("own tokens", lookup(4, None)),
            ("corpus", lookup(6, Some(corpus()))),
        ] {
            let mode = eagle(tree.clone(), Acceptance::TokenMatch, Some(l));
            let batched = run(&engine, &mode, &prompts, &greedy);
            let ids: Vec<Vec<u32>> = batched.iter().map(|o| o.output_ids.clone()).collect();
            assert_eq!(
                ids, plain_ids,
                "{name} + lookup ({with}) differs from plain greedy"
            );
            for (p, want) in prompts.iter().zip(&plain_ids) {
                let one = run(&engine, &mode, std::slice::from_ref(p), &greedy);
                assert_eq!(&one[0].output_ids, want, "{name} + lookup ({with}), alone");
            }
            let (a, g) = (tokens_per_step(&alone), tokens_per_step(&batched));
            if !room {
                assert_eq!(g, a, "{name}: grafted beyond max_draft_len");
            } else if with == "corpus" {
                // The corpus holds these very answers: its chains are right nearly always.
                assert!(
                    g > a + 1.5,
                    "{name}: {g:.2} tokens a step grafted, {a:.2} alone"
                );
            }
        }
    }
}

/// Sampled with token matching (a static tree) and with exact acceptance of a dynamic tree
/// (deterministic children), the second token follows the target's distribution while a
/// corpus chain is grafted at every step.
#[test]
fn grafted_lookups_keep_the_sampled_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, engine) = support::distribution_engine(dir.path());
    // Every token's chain continues with the next ids: a branch of 3 below every root.
    let cycle: Vec<u32> = (0..cfg.vocab_size as u32).chain(0..3).collect();
    let prompt = vec![3u32, 17, 9];
    let temperature = 1.5;
    let expected = support::second_token_distribution(&engine, &prompt, temperature);
    for mode in [
        eagle(
            static_tree("small_8"),
            Acceptance::TokenMatch,
            Some(lookup(3, Some(NgramCorpus::build([cycle.as_slice()])))),
        ),
        eagle(
            dynamic_tree(3),
            Acceptance::Exact,
            Some(lookup(3, Some(NgramCorpus::build([cycle.as_slice()])))),
        ),
    ] {
        support::assert_second_token_follows(&engine, &mode, &prompt, temperature, &expected);
    }
}

#[test]
fn drawn_children_refuse_a_grafted_lookup() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(1);
    let engine_dir = build(dir.path(), &cfg, &base, Some(&head), &EngineSpec::default());
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();
    let mode = eagle(
        static_tree("small_8"),
        Acceptance::Exact,
        Some(lookup(4, None)),
    );
    let err = generate(&engine, &mode, &prompts(), &sampled(8, 0.8, 1), &mut NoSink).unwrap_err();
    assert_eq!(
        err.to_string(),
        "prompt lookup cannot join a static EAGLE tree under exact acceptance with sampling: the tree's children are drawn and the lookup's drafts have no draft law; use --eagle_sampling token_match or typical"
    );
    // Greedy, every rule is argmax matching and the graft is allowed.
    let greedy = sampled(8, 0.0, 0);
    let plain = run(&engine, &DecodeMode::Plain, &prompts(), &greedy);
    let grafted = run(&engine, &mode, &prompts(), &greedy);
    for (g, p) in grafted.iter().zip(&plain) {
        assert_eq!(g.output_ids, p.output_ids);
    }
}

//! KV block reuse across requests (`--kv_cache_enable_block_reuse`): a later request whose
//! prompt starts with an earlier one's full blocks prefills only the rest, and every output
//! equals, token for token, the output without reuse — in plain, draft-target and EAGLE
//! decoding, and when a small pool evicts cached blocks. Also the memory-fraction sizing.

mod support;

use candle_core::Device;
use kestrel_core::SpeculativeMode;
use kestrel_model::llama::random_tensors;
use kestrel_runtime::{
    generate, generate_with, Acceptance, DecodeMode, DraftTargetOptions, EagleOptions,
    EagleTreeKind, Engine, GenerationParams, KvCacheOptions, NoSink, RunTimings, SequenceOutput,
};
use kestrel_spec::SamplingParams;
use support::{agreeing_pair, build, tiny_config, EngineSpec};

const BLOCK: usize = 8; // support::build's tokens_per_block

/// A shared 40-token prefix (5 full blocks) over the tiny vocabulary, never the end id 47.
fn prefix() -> Vec<u32> {
    (0..40u32).map(|i| (i * 7 + 3) % 46 + 1).collect()
}

fn with_suffix(suffix: &[u32]) -> Vec<u32> {
    let mut p = prefix();
    p.extend_from_slice(suffix);
    p
}

/// Requests in the order they are served: a first prompt, another with the same prefix, the
/// first prompt again, the bare prefix (its last block is prefilled, not reused) and an
/// unrelated prompt.
fn requests() -> Vec<Vec<u32>> {
    vec![
        with_suffix(&[5, 9, 12, 30, 2]),
        with_suffix(&[44, 8, 1]),
        with_suffix(&[5, 9, 12, 30, 2]),
        prefix(),
        vec![20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31],
    ]
}

/// What each request of [`requests`] reuses when served one per batch.
const REUSED: [usize; 5] = [0, 40, 40, 32, 0];

fn greedy(max_output_len: usize) -> GenerationParams {
    GenerationParams {
        max_output_len,
        sampling: SamplingParams::greedy(),
        end_ids: vec![],
    }
}

fn reuse() -> KvCacheOptions {
    KvCacheOptions {
        enable_block_reuse: true,
        free_memory_fraction: None,
    }
}

fn run_with(
    engine: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    kv: &KvCacheOptions,
) -> (Vec<SequenceOutput>, RunTimings) {
    generate_with(engine, mode, prompts, params, kv, &mut NoSink).unwrap()
}

fn ids(outs: &[SequenceOutput]) -> Vec<Vec<u32>> {
    outs.iter().map(|o| o.output_ids.clone()).collect()
}

fn reused(outs: &[SequenceOutput]) -> Vec<usize> {
    outs.iter().map(|o| o.stats.reused_prompt_tokens).collect()
}

/// The pool's prompt counters agree with the per-request reuse.
fn check_pool(t: &RunTimings, pool: usize, name: &str, prompts: &[Vec<u32>], reused: &[usize]) {
    let p = &t.kv_pools[pool];
    assert_eq!(p.name, name);
    assert_eq!(p.block_size, BLOCK);
    let total: usize = prompts.iter().map(Vec::len).sum();
    let r: usize = reused.iter().sum();
    assert_eq!(p.reused_prompt_tokens, r, "{name}: {p:?}");
    assert_eq!(p.prefilled_prompt_tokens, total - r, "{name}: {p:?}");
}

fn spec(mode: SpeculativeMode, max_batch_size: usize) -> EngineSpec {
    EngineSpec {
        mode,
        max_batch_size,
        max_draft_len: 4,
        ..EngineSpec::default()
    }
}

fn plain_engine(dir: &std::path::Path, max_batch_size: usize) -> Engine {
    let cfg = tiny_config(2);
    let base = random_tensors(&cfg, 5).unwrap();
    let path = build(
        dir,
        &cfg,
        &base,
        None,
        &spec(SpeculativeMode::None, max_batch_size),
    );
    Engine::load(&path, &Device::Cpu).unwrap()
}

#[test]
fn plain_later_requests_prefill_only_what_is_not_cached() {
    let dir = tempfile::tempdir().unwrap();
    // One request per batch: each batch after the first can reuse what earlier ones cached.
    let engine = plain_engine(dir.path(), 1);
    let prompts = requests();
    let params = greedy(24);
    let (off, t_off) = run_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    );
    let (on, t_on) = run_with(&engine, &DecodeMode::Plain, &prompts, &params, &reuse());
    assert_eq!(ids(&on), ids(&off), "reuse changed the output");
    assert!(on.iter().all(|o| o.output_ids.len() == 24));
    assert_eq!(reused(&on), REUSED);
    assert_eq!(reused(&off), [0; 5]);
    check_pool(&t_on, 0, "target", &prompts, &REUSED);
    check_pool(&t_off, 0, "target", &prompts, &[0; 5]);
    assert_eq!(t_on.kv_pools[0].blocks, engine.kv_blocks());

    // Each prompt alone (its own run, nothing cached) gives the same tokens too.
    for (p, o) in prompts.iter().zip(&on) {
        let alone = generate(
            &engine,
            &DecodeMode::Plain,
            std::slice::from_ref(p),
            &params,
            &mut NoSink,
        )
        .unwrap()
        .0;
        assert_eq!(alone[0].output_ids, o.output_ids);
    }
}

#[test]
fn plain_batches_reuse_what_earlier_batches_cached() {
    let dir = tempfile::tempdir().unwrap();
    let engine = plain_engine(dir.path(), 3);
    // Batch 1: requests 0..3 (nothing cached yet, also not from each other); batch 2: the
    // bare prefix and the unrelated prompt.
    let prompts = requests();
    let params = greedy(16);
    let (off, _) = run_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    );
    let (on, t) = run_with(&engine, &DecodeMode::Plain, &prompts, &params, &reuse());
    assert_eq!(ids(&on), ids(&off));
    let expect = [0, 0, 0, 32, 0];
    assert_eq!(reused(&on), expect);
    check_pool(&t, 0, "target", &prompts, &expect);
}

#[test]
fn draft_target_reuses_both_caches_and_keeps_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(2);
    let target_dir = build(
        &dir.path().join("target"),
        &cfg,
        &random_tensors(&cfg, 5).unwrap(),
        None,
        &spec(SpeculativeMode::DraftTokensExternal, 1),
    );
    let draft_cfg = tiny_config(1);
    let draft_dir = build(
        &dir.path().join("draft"),
        &draft_cfg,
        &random_tensors(&draft_cfg, 77).unwrap(),
        None,
        &spec(SpeculativeMode::None, 1),
    );
    let target = Engine::load(&target_dir, &Device::Cpu).unwrap();
    let draft = Engine::load(&draft_dir, &Device::Cpu).unwrap();
    let prompts = requests();
    let params = greedy(24);
    let plain = ids(&run_with(
        &target,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    )
    .0);
    for use_logits in [false, true] {
        let mode = DecodeMode::DraftTarget {
            draft: &draft,
            options: DraftTargetOptions {
                draft_len: 3,
                use_logits,
                disable_by_batch_size: None,
            },
        };
        let (off, _) = run_with(&target, &mode, &prompts, &params, &Default::default());
        let (on, t) = run_with(&target, &mode, &prompts, &params, &reuse());
        assert_eq!(ids(&off), plain, "use_logits {use_logits}");
        assert_eq!(
            ids(&on),
            plain,
            "use_logits {use_logits}: reuse changed the output"
        );
        assert_eq!(reused(&on), REUSED);
        check_pool(&t, 0, "target", &prompts, &REUSED);
        // The draft caches and reuses the same prompt blocks (every request outlives its
        // first token here, so every draft prefill runs).
        check_pool(&t, 1, "draft", &prompts, &REUSED);
    }
}

#[test]
fn eagle_reuses_base_and_head_caches_and_keeps_the_output() {
    let dir = tempfile::tempdir().unwrap();
    let (cfg, base, head) = agreeing_pair(3);
    let path = build(
        dir.path(),
        &cfg,
        &base,
        Some(&head),
        &EngineSpec {
            max_batch_size: 1,
            ..EngineSpec::default()
        },
    );
    let engine = Engine::load(&path, &Device::Cpu).unwrap();
    let prompts = requests();
    let params = greedy(24);
    let plain = ids(&run_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    )
    .0);
    for tree in [
        EagleTreeKind::Dynamic {
            top_k: 4,
            max_draft_len: None,
            num_layers: None,
            min_prob: 0.0,
        },
        EagleTreeKind::Static(
            kestrel_spec::EagleTree::from_json(
                "[[0], [1], [0, 0], [0, 1], [0, 0, 0]]",
                &kestrel_spec::tree::TreeLimits {
                    num_eagle_layers: 4,
                    max_non_leaves_per_layer: 10,
                    max_draft_len: 63,
                    max_top_k: 10,
                },
            )
            .unwrap(),
        ),
    ] {
        let mode = DecodeMode::Eagle(EagleOptions {
            tree,
            acceptance: Acceptance::TokenMatch,
            draft_vocab: None,
            lookup: None,
            disable_by_batch_size: None,
        });
        let (off, t_off) = run_with(&engine, &mode, &prompts, &params, &Default::default());
        let (on, t) = run_with(&engine, &mode, &prompts, &params, &reuse());
        assert_eq!(ids(&off), plain);
        assert_eq!(ids(&on), plain, "reuse changed the output");
        // The head's slot p pairs token p + 1 with feature p, so its block 4 (slots
        // 32..40) also depends on token 40, where requests 0 and 1 part: request 1 reuses
        // four blocks in both caches, the others as much as plain decoding.
        let expect = [0, 32, 40, 32, 0];
        assert_eq!(reused(&on), expect);
        check_pool(&t, 0, "target", &prompts, &expect);
        check_pool(&t, 1, "eagle_head", &prompts, &expect);
        // The head's reused context leaves its drafts as good as without reuse.
        let accepted = |outs: &[SequenceOutput]| -> usize {
            outs.iter().map(|o| o.stats.accepted_draft_tokens).sum()
        };
        assert_eq!(accepted(&on), accepted(&off));
        assert_eq!(t.kv_pools[1].blocks, t_off.kv_pools[1].blocks);
    }
}

#[test]
fn a_small_pool_evicts_cached_blocks_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = tiny_config(2);
    let base = random_tensors(&cfg, 5).unwrap();
    // max_seq_len 96 at batch 1: ceil(97 / 8) = 13 blocks in all.
    let path = build(
        dir.path(),
        &cfg,
        &base,
        None,
        &EngineSpec {
            mode: SpeculativeMode::None,
            max_batch_size: 1,
            max_seq_len: 96,
            ..EngineSpec::default()
        },
    );
    let engine = Engine::load(&path, &Device::Cpu).unwrap();
    assert_eq!(engine.kv_blocks(), 13);
    let other: Vec<u32> = prefix().iter().map(|t| (t + 11) % 46 + 1).collect();
    let mut other_req = other.clone();
    other_req.extend_from_slice(&[3, 3, 3, 3, 3]);
    // Each request holds 45 + 40 tokens: 11 of the 13 blocks. The second (another prefix)
    // must evict three of the first's five cached blocks, the last ones first; the third
    // then reuses the first two; the fourth finds two of the second's blocks left.
    let prompts = vec![
        with_suffix(&[5, 9, 12, 30, 2]),
        other_req.clone(),
        with_suffix(&[44, 8, 1, 6, 6]),
        other_req,
    ];
    let params = greedy(40);
    let (off, _) = run_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    );
    let (on, t) = run_with(&engine, &DecodeMode::Plain, &prompts, &params, &reuse());
    assert_eq!(ids(&on), ids(&off), "eviction changed the output");
    assert!(on.iter().all(|o| o.output_ids.len() == 40));
    let expect = [0, 0, 16, 16];
    assert_eq!(reused(&on), expect);
    check_pool(&t, 0, "target", &prompts, &expect);
}

#[test]
fn the_memory_fraction_sizes_the_pool_up_to_the_default_and_names_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let engine = plain_engine(dir.path(), 2);
    let prompts = requests();
    let params = greedy(8);
    let (plain, _) = run_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &Default::default(),
    );
    // All free memory is far more than the default pool: the default caps it.
    let all = KvCacheOptions {
        enable_block_reuse: false,
        free_memory_fraction: Some(1.0),
    };
    let (outs, t) = run_with(&engine, &DecodeMode::Plain, &prompts, &params, &all);
    assert_eq!(t.kv_pools[0].blocks, engine.kv_blocks());
    assert_eq!(ids(&outs), ids(&plain));
    // A vanishing share cannot hold one sequence.
    let none = KvCacheOptions {
        enable_block_reuse: false,
        free_memory_fraction: Some(1e-15),
    };
    let err = generate_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &none,
        &mut NoSink,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.starts_with("--kv_cache_free_gpu_memory_fraction 0.000000000000001: the target KV cache gets 0 blocks of 8 tokens"),
        "{err}"
    );
    assert!(
        err.ends_with("but one sequence of max_input_len + max_output_len = 72 tokens needs 10: raise --kv_cache_free_gpu_memory_fraction, lower --max_output_len or free memory"),
        "{err}"
    );
    let bad = KvCacheOptions {
        enable_block_reuse: false,
        free_memory_fraction: Some(0.0),
    };
    let err = generate_with(
        &engine,
        &DecodeMode::Plain,
        &prompts,
        &params,
        &bad,
        &mut NoSink,
    )
    .unwrap_err()
    .to_string();
    assert_eq!(
        err,
        "--kv_cache_free_gpu_memory_fraction 0 must be in (0, 1]: it is the share of free device memory the KV cache may take"
    );
}

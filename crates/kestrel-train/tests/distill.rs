//! Self-distillation with sampling on a tiny engine (CPU): equal prompts get different
//! samples across batches, a seed repeats its run, and runs with neighbouring seeds share no
//! sample (they once did: batch `c + 1` of seed `s` was batch `c` of seed `s + 1`).

#[path = "../../kestrel-runtime/tests/support/mod.rs"]
mod support;

use candle_core::Device;
use kestrel_core::SpeculativeMode;
use kestrel_runtime::Engine;
use kestrel_spec::SamplingParams;
use kestrel_train::distill::{distill, DistillOptions};
use std::collections::HashSet;
use support::{agreeing_pair, build, EngineSpec};

/// Answers of 8 copies of one prompt (4 batches of 2), sampled at temperature 1 with `seed`.
fn sampled_answers(engine: &Engine, seed: u64) -> Vec<Vec<u32>> {
    let opts = DistillOptions {
        num_prompts: usize::MAX,
        max_prompt_len: usize::MAX,
        max_new_tokens: 12,
        chat: false,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed,
        },
    };
    let prompts = vec![vec![3, 17, 9]; 8];
    distill(engine, &prompts, &opts, &mut |_, _| {})
        .unwrap()
        .into_iter()
        .map(|(seq, prompt_len)| seq[prompt_len..].to_vec())
        .collect()
}

#[test]
fn sampled_batches_and_neighbouring_seeds_share_no_answer() {
    let tmp = tempfile::tempdir().unwrap();
    let (mut cfg, base, _) = agreeing_pair(11);
    // No end id: every answer is 12 sampled tokens, so two equal ones would be a repeat.
    cfg.eos_token_id = None;
    let spec = EngineSpec {
        mode: SpeculativeMode::None,
        max_batch_size: 2,
        ..EngineSpec::default()
    };
    let engine_dir = build(tmp.path(), &cfg, &base, None, &spec);
    let engine = Engine::load(&engine_dir, &Device::Cpu).unwrap();

    let first = sampled_answers(&engine, 1);
    let distinct: HashSet<&Vec<u32>> = first.iter().collect();
    assert_eq!(
        distinct.len(),
        8,
        "equal prompts got equal samples: {first:?}"
    );
    assert_eq!(
        sampled_answers(&engine, 1),
        first,
        "a seed did not repeat its run"
    );
    for seed in [0, 2] {
        let other = sampled_answers(&engine, seed);
        let shared: Vec<&Vec<u32>> = other.iter().filter(|a| distinct.contains(a)).collect();
        assert!(shared.is_empty(), "seeds 1 and {seed} share {shared:?}");
    }
}

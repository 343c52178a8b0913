//! Plain decoding that launches each step before the previous step's tokens are read back
//! (`Engine::launch_ahead`, the default on a GPU) gives every sequence the tokens that waiting
//! for them gives. On the CPU the ids it feeds forward are host ids wrapped as a tensor, so
//! the bookkeeping (positions, sequences that end while the next step is out, admissions)
//! runs here as it does on a device.

mod support;

use candle_core::Device;
use kestrel_core::SpeculativeMode;
use kestrel_runtime::{
    generate, DecodeMode, Engine, FinishReason, GenerationParams, RunTimings, SequenceOutput,
    TokenSink,
};
use kestrel_spec::SamplingParams;
use support::{build, prompts, sampled, tiny_config, EngineSpec};

/// Each sequence's streamed tokens, in order.
#[derive(Default)]
struct Streams(Vec<Vec<u32>>);

impl TokenSink for Streams {
    fn on_tokens(&mut self, index: usize, tokens: &[u32]) {
        if self.0.len() <= index {
            self.0.resize(index + 1, Vec::new());
        }
        self.0[index].extend_from_slice(tokens);
    }
}

/// A random two-layer model (full-strength attention, so that a token fed at the wrong
/// position changes what follows) as a plain engine for batches of up to 5, in `dir`.
fn plain_engine(dir: &std::path::Path) -> Engine {
    let cfg = tiny_config(2);
    let base = kestrel_model::llama::random_tensors(&cfg, 11).unwrap();
    let spec = EngineSpec {
        mode: SpeculativeMode::None,
        max_batch_size: 5,
        ..EngineSpec::default()
    };
    Engine::load(&build(dir, &cfg, &base, None, &spec), &Device::Cpu).unwrap()
}

/// Plain decoding of `prompts` at most `batch` sequences at a time, launching ahead or not.
fn decode(
    engine: &mut Engine,
    ahead: bool,
    batch: usize,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
) -> (Vec<SequenceOutput>, RunTimings, Streams) {
    let built = engine.plan.limits.max_batch_size;
    engine.plan.limits.max_batch_size = batch;
    engine.launch_ahead = ahead;
    let mut streams = Streams::default();
    let (outputs, timings) =
        generate(engine, &DecodeMode::Plain, prompts, params, &mut streams).unwrap();
    engine.plan.limits.max_batch_size = built;
    (outputs, timings, streams)
}

#[test]
fn a_cpu_engine_waits_for_each_steps_tokens_by_default() {
    let dir = tempfile::tempdir().unwrap();
    assert!(!plain_engine(dir.path()).launch_ahead);
}

/// Greedy and sampled, batches of 1, 2 and 5, some sequences ending on an end id and the rest
/// at max_output_len: the same tokens, finish reasons, step counts and streams either way.
/// Alone in its batch, a sequence that draws an end id in a decode step, with room for more
/// tokens, has already had its next step launched, whose row is then dropped: one batch step
/// more per such sequence, which also shows the steps were launched ahead.
#[test]
fn launching_ahead_changes_no_token() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = plain_engine(dir.path());
    let prompts = prompts();
    let greedy = GenerationParams {
        max_output_len: 16,
        sampling: SamplingParams::greedy(),
        end_ids: vec![],
    };
    // An end id that some sequences reach before max_output_len and others never do.
    let (free, _, _) = decode(&mut engine, false, 5, &prompts, &greedy);
    let ends = vec![free[0].output_ids[3]];
    for params in [
        GenerationParams {
            end_ids: ends.clone(),
            ..greedy.clone()
        },
        GenerationParams {
            end_ids: ends.clone(),
            ..sampled(16, 0.8, 3)
        },
    ] {
        for batch in [1, 2, 5] {
            let (waited, waited_t, waited_s) = decode(&mut engine, false, batch, &prompts, &params);
            let (ahead, ahead_t, ahead_s) = decode(&mut engine, true, batch, &prompts, &params);
            let what = format!("batch {batch}, {:?}", params.sampling);
            let stopped = waited
                .iter()
                .filter(|o| o.finish_reason == FinishReason::Stop)
                .count();
            assert!(
                stopped > 0 && stopped < prompts.len(),
                "{what}: {stopped} stopped"
            );
            for (i, (w, a)) in waited.iter().zip(&ahead).enumerate() {
                assert_eq!(a.output_ids, w.output_ids, "{what}: sequence {i}");
                assert_eq!(a.finish_reason, w.finish_reason, "{what}: sequence {i}");
                assert_eq!(a.stats.steps, w.stats.steps, "{what}: sequence {i}");
                assert_eq!(ahead_s.0[i], a.output_ids, "{what}: sequence {i} streamed");
                assert_eq!(waited_s.0[i], w.output_ids, "{what}: sequence {i} streamed");
            }
            let generated: usize = waited.iter().map(|o| o.output_ids.len()).sum();
            assert_eq!(ahead_t.generated_tokens, generated, "{what}");
            if batch == 1 {
                // The end ids a decode step drew (not the prompt's step) with room left.
                let cut_short = waited
                    .iter()
                    .filter(|o| o.finish_reason == FinishReason::Stop)
                    .filter(|o| (2..params.max_output_len).contains(&o.output_ids.len()))
                    .count();
                assert!(cut_short > 0, "{what}");
                assert_eq!(
                    ahead_t.batch_steps,
                    waited_t.batch_steps + cut_short,
                    "{what}"
                );
            }
        }
    }
}

/// A sequence whose next token would end it by length gets no step launched after it: with
/// max_output_len 1, 2 and 3 and no end ids, the steps are exactly the waiting run's.
#[test]
fn no_step_is_launched_past_max_output_len() {
    let dir = tempfile::tempdir().unwrap();
    let mut engine = plain_engine(dir.path());
    let prompts = prompts();
    for n in 1..=3 {
        let params = GenerationParams {
            max_output_len: n,
            sampling: SamplingParams::greedy(),
            end_ids: vec![],
        };
        let (waited, waited_t, _) = decode(&mut engine, false, 1, &prompts, &params);
        let (ahead, ahead_t, _) = decode(&mut engine, true, 1, &prompts, &params);
        assert_eq!(
            ahead_t.batch_steps, waited_t.batch_steps,
            "max_output_len {n}"
        );
        assert_eq!(
            ahead_t.batch_steps,
            prompts.len() * (n - 1),
            "max_output_len {n}"
        );
        for (w, a) in waited.iter().zip(&ahead) {
            assert_eq!(a.output_ids, w.output_ids, "max_output_len {n}");
            assert_eq!(a.finish_reason, FinishReason::Length);
        }
    }
}

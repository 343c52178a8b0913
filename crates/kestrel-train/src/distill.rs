//! Self-distillation: the base engine answers prompts through Kestrel's own runtime (plain
//! decoding), so a draft learns the distribution it will be asked to predict.

use crate::error::{invalid, Result};
use kestrel_runtime::{
    generate, ChatMessage, DecodeMode, Engine, GenerationParams, NoSink, SequenceOutput, TextCodec,
};
use kestrel_spec::SamplingParams;

#[derive(Debug, Clone)]
pub struct DistillOptions {
    /// Prompts to answer (the first ones that fit `max_prompt_len`, in file order).
    pub num_prompts: usize,
    /// Longest prompt kept, in tokens after the chat template (also capped by the engine's
    /// max_input_len).
    pub max_prompt_len: usize,
    pub max_new_tokens: usize,
    /// Wrap each prompt as a user turn with the engine's chat template.
    pub chat: bool,
    pub sampling: SamplingParams,
}

/// Tokenises `texts` (through the chat template when asked) and keeps the first
/// `num_prompts` that fit.
pub fn encode_prompts(
    codec: &TextCodec,
    texts: &[String],
    opts: &DistillOptions,
    max_input_len: usize,
) -> Result<Vec<Vec<u32>>> {
    let limit = opts.max_prompt_len.min(max_input_len);
    let mut out = Vec::with_capacity(opts.num_prompts.min(texts.len()));
    for text in texts {
        if out.len() == opts.num_prompts {
            break;
        }
        let rendered = if opts.chat {
            let template = codec.chat_template.as_ref().ok_or_else(|| {
                invalid("chat templating was asked for, but the engine has no chat_template.jinja (pass --no_chat)")
            })?;
            template
                .render(&[ChatMessage::user(text)], true)
                .map_err(invalid)?
        } else {
            text.clone()
        };
        let ids = codec.encode(&rendered)?;
        if !ids.is_empty() && ids.len() <= limit {
            out.push(ids);
        }
    }
    if out.is_empty() {
        return Err(invalid(format!(
            "no prompt fits in {limit} tokens: raise --max_prompt_len or use another prompt file"
        )));
    }
    Ok(out)
}

/// The base engine's answers: `(prompt + answer, prompt_len)` per prompt. Runs in batches of
/// the engine's max_batch_size, calling `progress(done, total)` after each.
pub fn distill(
    engine: &Engine,
    prompts: &[Vec<u32>],
    opts: &DistillOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<(Vec<u32>, usize)>> {
    let outputs = generate_in_batches(
        engine,
        prompts,
        opts.max_new_tokens,
        opts.sampling,
        progress,
    )?;
    Ok(prompts
        .iter()
        .zip(outputs)
        .map(|(p, o)| {
            let mut seq = p.clone();
            seq.extend_from_slice(&o.output_ids);
            (seq, p.len())
        })
        .collect())
}

/// Plain decoding of `prompts` in batches of the engine's max_batch_size, one output per
/// prompt, calling `progress(done, total)` after each batch.
pub(crate) fn generate_in_batches(
    engine: &Engine,
    prompts: &[Vec<u32>],
    max_new_tokens: usize,
    sampling: SamplingParams,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Vec<SequenceOutput>> {
    if max_new_tokens == 0 {
        return Err(invalid("--max_new_tokens must be at least 1"));
    }
    let params = GenerationParams {
        max_output_len: max_new_tokens,
        sampling,
        end_ids: engine.config.eos_token_ids(),
    };
    let chunk = engine.plan.limits.max_batch_size.max(1);
    let mut out = Vec::with_capacity(prompts.len());
    for (c, group) in prompts.chunks(chunk).enumerate() {
        let mut params = params.clone();
        params.sampling.seed = chunk_seed(sampling.seed, c);
        let (outputs, _) = generate(engine, &DecodeMode::Plain, group, &params, &mut NoSink)?;
        out.extend(outputs);
        progress(out.len(), prompts.len());
    }
    Ok(out)
}

/// The seed of batch `chunk` of a run seeded `seed`. Sequence `i` of a batch samples from
/// stream `i` of its batch's seed, so batches need seeds of their own for equal prompts to
/// get different samples; and since a run's seed is often the previous run's plus one, the
/// batches step by 2^64/φ rather than by 1, or run `s + 1` would resample batch `c + 1` of
/// run `s` as its batch `c`.
fn chunk_seed(seed: u64, chunk: usize) -> u64 {
    const STEP: u64 = 0x9E37_79B9_7F4A_7C15;
    seed.wrapping_add(STEP.wrapping_mul(chunk as u64))
}

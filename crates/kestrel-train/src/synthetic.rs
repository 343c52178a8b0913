//! Synthetic user prompts, the Magpie way (Xu et al. 2024, "Magpie: Alignment Data Synthesis
//! from Scratch by Prompting Aligned LLMs with Nothing"): given only its chat template's text
//! up to where a user's message begins, an instruction-tuned model writes a user message.
//! Self-distillation then answers them, so a draft sees far more (and more varied) chat than
//! the prompt files hold: a head trained on ~3.5k ShareGPT prompts drafts their held-out
//! answers well and MT-bench's much worse.

use crate::distill::generate_in_batches;
use crate::error::{invalid, Result};
use kestrel_runtime::{ChatMessage, ChatTemplate, Engine, FinishReason, TextCodec};
use kestrel_spec::SamplingParams;
use std::collections::HashSet;

#[derive(Debug, Clone)]
pub struct SyntheticOptions {
    /// User turns to sample.
    pub count: usize,
    /// Longest user turn, in tokens; turns that have not ended by then are dropped.
    pub max_len: usize,
    pub sampling: SamplingParams,
}

/// What a synthesis produced, and what it dropped.
#[derive(Debug, Clone, PartialEq)]
pub struct Synthesized {
    /// Distinct, non-blank user turns, in sampling order.
    pub prompts: Vec<String>,
    /// Turns that had not ended within `max_len` tokens.
    pub unfinished: usize,
    /// Blank turns and repeats of an earlier one.
    pub repeated_or_blank: usize,
}

/// Marks where the user's message goes; no template adds it on its own.
const USER_MARKER: &str = "\u{1}kestrel-user-turn\u{1}";

/// The template's text before a first user message: the system turn it adds and the
/// user-turn opener.
pub fn pre_query_text(template: &ChatTemplate) -> Result<String> {
    let rendered = template
        .render(&[ChatMessage::user(USER_MARKER)], false)
        .map_err(invalid)?;
    match rendered.find(USER_MARKER) {
        Some(at) => Ok(rendered[..at].to_string()),
        None => Err(invalid(
            "the chat template does not copy a user message verbatim, so it has no text that opens a user turn to sample prompts from",
        )),
    }
}

/// Samples `opts.count` user turns from the engine after the chat template's pre-query
/// text, keeping the distinct ones that ended with an end id (without it).
pub fn synthesize_prompts(
    engine: &Engine,
    codec: &TextCodec,
    opts: &SyntheticOptions,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Synthesized> {
    let template = codec.chat_template.as_ref().ok_or_else(|| {
        invalid(
            "synthetic prompts need the engine's chat template, and it has no chat_template.jinja",
        )
    })?;
    let opener = codec.encode(&pre_query_text(template)?)?;
    let limit = engine.plan.limits.max_input_len;
    if opener.len() >= limit {
        return Err(invalid(format!(
            "the chat template's user-turn opener is {} tokens, which leaves no room in the engine's max_input_len of {limit}",
            opener.len()
        )));
    }
    let prompts = vec![opener; opts.count];
    let outputs = generate_in_batches(engine, &prompts, opts.max_len, opts.sampling, progress)?;
    let end_ids = engine.config.eos_token_ids();
    let mut seen = HashSet::new();
    let mut out = Synthesized {
        prompts: Vec::new(),
        unfinished: 0,
        repeated_or_blank: 0,
    };
    for o in outputs {
        let ids = match (o.finish_reason, o.output_ids.split_last()) {
            (FinishReason::Stop, Some((last, turn))) if end_ids.contains(last) => turn,
            _ => {
                out.unfinished += 1;
                continue;
            }
        };
        let text = codec.decode(ids)?.trim().to_string();
        if text.is_empty() || !seen.insert(text.clone()) {
            out.repeated_or_blank += 1;
        } else {
            out.prompts.push(text);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pre_query_text_is_the_system_turn_and_the_user_opener() {
        // SmolLM2-135M-Instruct's template, as carried in its GGUF metadata.
        let smollm2 = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(smollm2, "<|im_start|>", "<|im_end|>").unwrap();
        assert_eq!(
            pre_query_text(&t).unwrap(),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\n"
        );
    }

    #[test]
    fn a_template_that_rewrites_the_message_has_no_pre_query_text() {
        let t = ChatTemplate::new(
            "{% for m in messages %}[{{ m['content'] | upper }}]{% endfor %}",
            "<s>",
            "</s>",
        )
        .unwrap();
        assert_eq!(
            pre_query_text(&t).unwrap_err().to_string(),
            "the chat template does not copy a user message verbatim, so it has no text that opens a user turn to sample prompts from"
        );
    }
}

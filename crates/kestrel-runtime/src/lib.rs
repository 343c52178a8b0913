//! Runs engines: loads the plan and weights, batches requests and generates text with plain
//! decoding or a speculative mode. Greedy speculative output equals plain greedy output
//! token for token; sampled speculative output follows the target model's distribution.

pub mod chat;
pub mod device;
mod draft_target;
mod eagle;
pub mod engine;
pub mod error;
mod generate;
pub mod kv_budget;
mod logit_rows;
pub mod ngram_corpus;
mod plain;
mod prefix;
pub mod request;
mod sequence;

pub use chat::{ChatMessage, ChatTemplate};
pub use engine::{Engine, TextCodec};
pub use error::{Result, RuntimeError};
pub use generate::set_in_flight_batching;
pub use kv_budget::KvCacheOptions;
pub use request::{
    FinishReason, GenerationParams, KvPoolStats, NoSink, RunTimings, SeqStats, SequenceOutput,
    TokenSink,
};

/// Every row's greedy token (argmax, ties to the lowest id) of f32 logits `[rows, vocab]`,
/// picked as the runtime's greedy steps pick them: Kestrel's kernel where the rows are on a
/// GPU, the host's scan on the CPU.
pub fn greedy_tokens(logits: &candle_core::Tensor) -> Result<Vec<u32>> {
    logit_rows::argmax_row_ids(logits)?.fetch()
}

/// How to decode.
// Built once per request and passed by reference: its size costs nothing.
#[allow(clippy::large_enum_variant)]
pub enum DecodeMode<'a> {
    Plain,
    /// EAGLE-1 (static tree) or EAGLE-2 (dynamic tree) with the engine's own draft head.
    Eagle(EagleOptions),
    /// A separate draft engine proposes `draft_len` tokens that the target verifies.
    DraftTarget {
        draft: &'a Engine,
        options: DraftTargetOptions,
    },
    /// Prompt lookup: drafts are the tokens that followed the latest earlier occurrence of
    /// the sequence's final n-gram in its own prompt and output, or, where it has nothing
    /// longer than one token to copy, the chain of an n-gram model of other answers.
    PromptLookup {
        lookup: PromptLookup,
        /// As [`DraftTargetOptions::disable_by_batch_size`].
        disable_by_batch_size: Option<usize>,
    },
}

/// Prompt lookup's drafter: no model and no cache, only the sequence's own tokens and,
/// optionally, an n-gram model of other answers.
#[derive(Debug, Clone)]
pub struct PromptLookup {
    pub config: kestrel_spec::PromptLookupConfig,
    pub corpus: Option<std::sync::Arc<kestrel_spec::NgramCorpus>>,
}

impl PromptLookup {
    /// Up to `limit` drafts to follow `tokens` ([`kestrel_spec::PromptLookupConfig::propose`]).
    pub(crate) fn propose(&self, tokens: &[u32], limit: usize) -> Vec<u32> {
        self.config.propose(tokens, limit, self.corpus.as_deref())
    }
}

/// The tree EAGLE drafts, and how drafts are accepted.
#[derive(Debug, Clone)]
pub struct EagleOptions {
    pub tree: EagleTreeKind,
    pub acceptance: Acceptance,
    /// Draft from `n` tokens only (the head's LM head reads `n` of its rows): the engine's
    /// `n` most frequent when it carries a ranking ([`Engine::draft_vocab`]), else the first
    /// `n` ids. Verification still scores the whole vocabulary, so output is unchanged: a
    /// token outside the draft vocabulary is never proposed, and the target's own choice
    /// covers it.
    pub draft_vocab: Option<usize>,
    /// Prompt lookup's drafts grafted onto every tree as one more branch
    /// ([`kestrel_spec::graft_chain`]), within the engine's `max_draft_len`: the head and the
    /// lookup guess differently, and one verification checks both. Not with children sampled
    /// for exact acceptance (a static tree under sampling), whose laws the lookup lacks.
    pub lookup: Option<PromptLookup>,
    /// With more sequences than this in a step, the step drafts nothing and runs as a plain
    /// decode step (vLLM's `speculative_disable_by_batch_size`): where a batch already fills
    /// the device, verified rows cost more than they return. The head catches up on the
    /// pairs it missed once the batch is small again. `None`: always speculate.
    pub disable_by_batch_size: Option<usize>,
}

#[derive(Debug, Clone)]
pub enum EagleTreeKind {
    /// EAGLE-1: a validated `eagle_choices` tree.
    Static(kestrel_spec::EagleTree),
    /// EAGLE-2: expand the best `top_k` nodes per layer for `num_layers` layers, keep the
    /// best `max_draft_len` nodes. `None` takes the engine's limit (`num_eagle_layers`,
    /// `max_draft_len`); a smaller value trades acceptance for cheaper steps (fewer head
    /// steps, fewer rows to verify), as TensorRT-LLM's EagleDecodingConfig allows at run time.
    Dynamic {
        top_k: usize,
        max_draft_len: Option<usize>,
        num_layers: Option<usize>,
        /// Nodes whose cumulative draft probability is below this are neither expanded nor
        /// verified (0: none dropped); where the head is unsure a step drafts less, or
        /// nothing and runs as a plain decode step.
        min_prob: f32,
    },
}

/// How drafted tokens are accepted. Under greedy sampling every rule is argmax matching.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Acceptance {
    /// Accept while the draft equals the target's own choice (greedy: its argmax).
    TokenMatch,
    /// TensorRT-LLM's typical acceptance with `--eagle_posterior_threshold ε` (lossy).
    Typical { posterior_threshold: f32 },
    /// Rejection sampling that keeps the target distribution exactly.
    Exact,
}

/// `--draft_target_model_config "[draft_len,[draft devices],[target devices],use_logits]"`.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftTargetOptions {
    pub draft_len: usize,
    /// true: speculative (rejection) sampling on both models' distributions; false: accept
    /// while the draft token equals the target's own sampled token.
    pub use_logits: bool,
    /// With more sequences than this in a step, nothing is drafted and the step is a plain
    /// one, as [`EagleOptions::disable_by_batch_size`]; the draft model reads the tokens it
    /// missed in its next step. `None`: always speculate.
    pub disable_by_batch_size: Option<usize>,
}

/// Generates for every prompt (token ids) with `mode`, streaming committed tokens to `sink`;
/// KV caches of the default size, without prefix reuse.
pub fn generate(
    engine: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    sink: &mut dyn TokenSink,
) -> Result<(Vec<SequenceOutput>, RunTimings)> {
    generate_with(
        engine,
        mode,
        prompts,
        params,
        &KvCacheOptions::default(),
        sink,
    )
}

/// [`generate`] with the KV caches sized and shared as `kv` says. Prefix reuse lasts for
/// this call: prompts admitted later reuse the prompt blocks of finished sequences.
pub fn generate_with(
    engine: &Engine,
    mode: &DecodeMode,
    prompts: &[Vec<u32>],
    params: &GenerationParams,
    kv: &KvCacheOptions,
    sink: &mut dyn TokenSink,
) -> Result<(Vec<SequenceOutput>, RunTimings)> {
    let out = params.max_output_len;
    match mode {
        DecodeMode::Plain => {
            let mut decoder = plain::PlainDecoder::new(engine, kv, out)?;
            generate::drive(engine, &mut decoder, prompts, params, sink)
        }
        DecodeMode::Eagle(options) => {
            let mut decoder = eagle::EagleDecoder::new(engine, options.clone(), kv, out)?;
            generate::drive(engine, &mut decoder, prompts, params, sink)
        }
        DecodeMode::DraftTarget { draft, options } => {
            let mut decoder =
                draft_target::DraftTargetDecoder::new(engine, draft, options.clone(), kv, out)?;
            generate::drive(engine, &mut decoder, prompts, params, sink)
        }
        DecodeMode::PromptLookup {
            lookup,
            disable_by_batch_size,
        } => {
            let mut decoder = draft_target::DraftTargetDecoder::prompt_lookup(
                engine,
                lookup.clone(),
                *disable_by_batch_size,
                kv,
                out,
            )?;
            generate::drive(engine, &mut decoder, prompts, params, sink)
        }
    }
}

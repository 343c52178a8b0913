//! The benchmark behind `spec-bench`: plain decoding against EAGLE-1, EAGLE-2 and
//! draft-target decoding over a prompt set (MT-bench first turns by default), greedy or sampled, at
//! several batch sizes, each mode run on the same prompts in the same process. Per (mode,
//! batch size): tokens/s, step latency, time to first token, τ, peak memory and the roofline
//! fraction against a copy bandwidth measured in the same process.
//!
//! `--random_weights SHAPE` times a model of a real checkpoint's shape built in memory with
//! random weights (random token ids as prompts): plain decoding, and `verify:T`, the cost of
//! verifying a T-token draft next to a one-token step.

pub mod measure;
pub mod shapes;
pub mod verify;

use crate::decoding::{disable_by_batch_size, eagle_mode, EagleFlags, SamplingFlags};
use crate::draft_engine::{load_draft, DraftDerivation};
use crate::prompts::read_prompt_file;
use anyhow::{bail, Context, Result};
use clap::Parser;
use kestrel_core::plan::{BuildLimits, EnginePlan};
use kestrel_core::{DType, Mapping, SpeculativeMode};
use kestrel_model::GraphActivity;
use kestrel_runtime::ngram_corpus::load_ngram_corpus;
use kestrel_runtime::{
    generate, ChatMessage, DecodeMode, DraftTargetOptions, Engine, GenerationParams, NoSink,
    PromptLookup, SequenceOutput, TextCodec,
};
use kestrel_spec::{NgramCorpus, PromptLookupConfig, SamplingParams};
use measure::{MemProbe, ProbeSink};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(
    name = "spec-bench",
    rename_all = "snake_case",
    version,
    about = "Benchmark plain and speculative decoding on one engine, or a model shape with random weights"
)]
pub struct BenchArgs {
    /// Engine directory written by spec-build (or use --random_weights).
    #[arg(long)]
    pub engine_dir: Option<PathBuf>,
    /// Build a model of this shape with random weights in memory instead of loading an
    /// engine: llama2-7b, llama3-8b, smollm2-135m or tiny. Prompts are random token ids.
    #[arg(long)]
    pub random_weights: Option<String>,
    /// dtype of the random weights: float32, float16 or bfloat16 (default bfloat16).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Prompt length in tokens with --random_weights.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Seed of the random weights and prompts.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Prompt file (JSON/JSONL; MT-bench records use their first turn).
    #[arg(long, default_value = "../shared/data/mt_bench/question.jsonl")]
    pub prompts: PathBuf,
    /// Prompts per run; cycled up to a multiple of each batch size so every batch is full.
    #[arg(long, default_value_t = 16)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    pub max_output_len: usize,
    /// Comma-separated batch sizes; every mode runs at each. Default 1,4,16, less those
    /// above the engine's max_batch_size.
    #[arg(long, visible_alias = "batch_size")]
    pub batch_sizes: Option<String>,
    /// Comma-separated: plain, eagle1[:TREE] (TREE = preset or JSON file),
    /// eagle2:N[:T[:L[:P]]] (top-k N, at most T draft nodes and L layers, nodes of draft
    /// probability P or more: spec-run's --eagle_dynamic_tree_max_draft_len,
    /// --eagle_dynamic_tree_num_layers and --eagle_dynamic_tree_min_prob),
    /// draft_target:K[:logits] (needs --draft_engine_dir, or with --random_weights
    /// --draft_quantization q4 or --draft_skip_layers; `logits`: speculative sampling,
    /// else token matching), prompt_lookup:K[:N[:corpus]] (up to K drafts after the latest
    /// earlier occurrence of the last N-gram, N = 3 by default; `corpus`: backed by
    /// --prompt_lookup_corpus; any engine), verify:T (a T-token chain's verification step vs a
    /// one-token step), verify:TREE (the same for a static tree's root and nodes; TREE as
    /// eagle1 takes it). Default: plain,eagle1,eagle2:8 for EAGLE engines (+ draft_target:4
    /// with a draft engine) and prompt_lookup:4, plain,verify:64 with --random_weights,
    /// plain,prompt_lookup:4 otherwise.
    #[arg(long)]
    pub modes: Option<String>,
    /// Draft engine for draft_target:K modes (the target is --engine_dir).
    #[arg(long)]
    pub draft_engine_dir: Option<PathBuf>,
    /// How the draft derives from its engine (spec-run's flags); with --random_weights the
    /// random model's derived copy drafts.
    #[command(flatten)]
    pub draft_derivation: DraftDerivation,
    /// The n-gram corpus of prompt_lookup:K:N:corpus modes (`spec-train ngram-corpus`).
    #[arg(long)]
    pub prompt_lookup_corpus: Option<PathBuf>,
    /// Apply the chat template to each prompt.
    #[arg(long, default_value_t = true)]
    pub chat: bool,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Buffer size of the copy-bandwidth measurement.
    #[arg(long, default_value_t = 1 << 30)]
    pub copy_bytes: usize,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
    /// Kestrel's CUDA kernels: `plan` (an engine's recorded choice; all of them with
    /// --random_weights), `all` or `none` (candle ops only), to compare the two on one GPU.
    #[arg(long, default_value = "plan")]
    pub cuda_kernels: String,
    /// Run every step eagerly instead of replaying CUDA graphs, to measure what they save.
    #[arg(long)]
    pub no_cuda_graphs: bool,
    /// Programmatic dependent launch of Kestrel's kernels on Hopper GPUs (`on`: each kernel
    /// may start while the one before it finishes), or `off`, to measure what it saves.
    #[arg(long, default_value = "on")]
    pub dependent_launch: String,
    /// Where a replayed CUDA graph's activations live: `arena` (one buffer per model, sized
    /// to its steps) or `driver` (CUDA's graph memory pool, 32 MiB at a time), to compare.
    #[arg(long, default_value = "arena")]
    pub graph_memory: String,
    /// EAGLE modes draft from N tokens only (spec-run --eagle_draft_vocab).
    #[arg(long)]
    pub eagle_draft_vocab: Option<usize>,
    /// Speculative modes run steps of more than N sequences as plain decode steps (spec-run's
    /// --speculative_disable_by_batch_size).
    #[arg(long, value_name = "N")]
    pub speculative_disable_by_batch_size: Option<usize>,
    /// spec-run's sampling flags (greedy by default). Sampled speculative modes keep the
    /// target's distribution but not plain decoding's tokens, so their outputs are compared
    /// by digest only.
    #[command(flatten)]
    pub sampling: SamplingFlags,
    /// How sampled EAGLE modes accept drafts (spec-run's flag): token_match (default),
    /// typical (with --eagle_posterior_threshold) or exact.
    #[arg(long)]
    pub eagle_sampling: Option<String>,
    /// Typical acceptance's threshold ε (spec-run's flag).
    #[arg(long)]
    pub eagle_posterior_threshold: Option<f32>,
    /// Where sampled steps on a GPU draw tokens and accept drafts: `on` (the device; only
    /// tokens cross) or `off` (the rows go to the host), to measure what the kernels save.
    #[arg(long, default_value = "on")]
    pub device_sampling: String,
    /// Where EAGLE's static trees keep their top-k drafted tokens: `on` (where the head runs;
    /// no draft level waits for the device) or `off` (fetched to the host after every level),
    /// to measure what the round trips cost. The output is the same.
    #[arg(long, default_value = "on")]
    pub draft_on_device: String,
    /// Whether plain decoding on a GPU launches each step before the previous step's tokens
    /// reach the host: `on` (the host's work between steps overlaps the device's) or `off`
    /// (each step waits for its tokens), to measure what the overlap saves. The output is
    /// the same.
    #[arg(long, default_value = "on")]
    pub launch_ahead: String,
    /// In-flight batching: `on` (a finished sequence's place goes to the next prompt at once)
    /// or `off` (static batches: the next prompts wait for the whole batch), to measure what
    /// it saves. The output is the same.
    #[arg(long, default_value = "on")]
    pub in_flight: String,
    /// Before timing a mode at a batch size, run it once on the first batch for this many
    /// tokens, so that one-time costs (a GPU driver compiling kernels on first use) stay out
    /// of its figures; 0 times the first run cold.
    #[arg(long, default_value_t = 8)]
    pub warmup_tokens: usize,
}

/// One `--modes` entry, checked for syntax before anything is loaded.
#[derive(Debug, Clone, PartialEq)]
enum ModeSpec {
    Plain,
    /// EAGLE-1 with a tree, and prompt lookup's drafts grafted onto it (`+prompt_lookup:…`).
    Eagle1(Option<String>, Option<LookupSpec>),
    Eagle2 {
        top_k: usize,
        max_draft_len: Option<usize>,
        num_layers: Option<usize>,
        /// spec-run's --eagle_dynamic_tree_min_prob.
        min_prob: Option<f32>,
        lookup: Option<LookupSpec>,
    },
    DraftTarget {
        k: usize,
        use_logits: bool,
    },
    PromptLookup(LookupSpec),
    Verify(verify::DraftShape),
}

/// `prompt_lookup:K[:N[:corpus]]`.
#[derive(Debug, Clone, Copy, PartialEq)]
struct LookupSpec {
    k: usize,
    max_ngram: usize,
    corpus: bool,
}

impl ModeSpec {
    fn lookup(&self) -> Option<&LookupSpec> {
        match self {
            ModeSpec::PromptLookup(l)
            | ModeSpec::Eagle1(_, Some(l))
            | ModeSpec::Eagle2 {
                lookup: Some(l), ..
            } => Some(l),
            _ => None,
        }
    }
}

const MODES_HELP: &str =
    "expected plain, eagle1[:TREE], eagle2:N[:T[:L[:P]]], draft_target:K[:logits], prompt_lookup:K[:N[:corpus]] or verify:T|TREE, comma-separated; an eagle mode may end in +prompt_lookup:K[:N[:corpus]]";

fn parse_modes(list: &str) -> Result<Vec<(String, ModeSpec)>> {
    let count = |name: &str, arg: &str, spec: &str| -> Result<usize> {
        match arg.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("--modes {spec}: {name} needs a positive integer after ':'"),
        }
    };
    let mut out = Vec::new();
    for spec in split_top_level(list)
        .iter()
        .map(|s| s.trim())
        .filter(|s| !s.is_empty())
    {
        // An EAGLE mode's grafted lookup: `eagle…+prompt_lookup:…`.
        let (base, graft) = match spec.split_once('+') {
            Some((base, graft)) => (base, Some(graft)),
            None => (spec, None),
        };
        let lookup = |arg: &str| -> Result<LookupSpec> {
            let shape = "prompt_lookup takes K, K:N or K:N:corpus";
            let mut parts = arg.split(':');
            let k = count("prompt_lookup", parts.next().unwrap_or(""), spec)?;
            let max_ngram = parts
                .next()
                .map_or(Ok(3), |n| count("prompt_lookup", n, spec))?;
            let corpus = match parts.next() {
                None => false,
                Some("corpus") => true,
                Some(_) => bail!("--modes {spec}: {shape}"),
            };
            if parts.next().is_some() {
                bail!("--modes {spec}: {shape}");
            }
            Ok(LookupSpec {
                k,
                max_ngram,
                corpus,
            })
        };
        let grafted = match graft.map(|g| g.split_once(':').unwrap_or((g, ""))) {
            None => None,
            Some(("prompt_lookup", arg)) => Some(lookup(arg)?),
            Some(_) => bail!("--modes {spec}: only prompt_lookup:K[:N[:corpus]] may follow '+'"),
        };
        let (name, arg) = base.split_once(':').unwrap_or((base, ""));
        if grafted.is_some() && !matches!(name, "eagle1" | "eagle2") {
            bail!("--modes {spec}: '+prompt_lookup' grafts onto eagle1 and eagle2 trees only");
        }
        let mode = match name {
            "plain" if arg.is_empty() => ModeSpec::Plain,
            "eagle1" => ModeSpec::Eagle1((!arg.is_empty()).then(|| arg.to_string()), grafted),
            "eagle2" => {
                let mut parts = arg.split(':');
                let top_k = count(name, parts.next().unwrap_or(""), spec)?;
                let max_draft_len = parts.next().map(|a| count(name, a, spec)).transpose()?;
                let num_layers = parts.next().map(|a| count(name, a, spec)).transpose()?;
                let min_prob = match parts.next().map(str::parse::<f32>) {
                    None => None,
                    Some(Ok(p)) if (0.0..=1.0).contains(&p) => Some(p),
                    Some(_) => bail!(
                        "--modes {spec}: eagle2's P (after N:T:L) is the least draft probability a node needs, in [0, 1]"
                    ),
                };
                if parts.next().is_some() {
                    bail!("--modes {spec}: eagle2 takes at most N:T:L:P");
                }
                ModeSpec::Eagle2 {
                    top_k,
                    max_draft_len,
                    num_layers,
                    min_prob,
                    lookup: grafted,
                }
            }
            "draft_target" => {
                let (k, rule) = arg.split_once(':').unwrap_or((arg, ""));
                if !matches!(rule, "" | "logits") {
                    bail!("--modes {spec}: draft_target takes K or K:logits");
                }
                ModeSpec::DraftTarget {
                    k: count(name, k, spec)?,
                    use_logits: rule == "logits",
                }
            }
            "prompt_lookup" => ModeSpec::PromptLookup(lookup(arg)?),
            "verify" if arg.is_empty() || arg.bytes().all(|b| b.is_ascii_digit()) => {
                ModeSpec::Verify(verify::DraftShape::Chain(count(name, arg, spec)?))
            }
            "verify" => {
                ModeSpec::Verify(verify::DraftShape::tree(&format!("--modes {name}:"), arg)?)
            }
            _ => bail!("unknown mode '{spec}' in --modes: {MODES_HELP}"),
        };
        out.push((spec.to_string(), mode));
    }
    if out.is_empty() {
        bail!("--modes is empty: {MODES_HELP}");
    }
    Ok(out)
}

/// The drafter of a `prompt_lookup:K[:N[:corpus]]` mode (or graft), with the loaded corpus.
fn prompt_lookup(
    spec: &str,
    l: &LookupSpec,
    corpus: &Option<Arc<NgramCorpus>>,
) -> Result<PromptLookup> {
    let config = PromptLookupConfig::new(l.k, l.max_ngram)
        .map_err(|e| anyhow::anyhow!("--modes {spec}: {e}"))?;
    let corpus = match l.corpus {
        true => Some(
            corpus
                .clone()
                .with_context(|| format!("--modes {spec} needs --prompt_lookup_corpus"))?,
        ),
        false => None,
    };
    Ok(PromptLookup { config, corpus })
}

/// Splits at commas outside brackets, so an inline eagle1 tree (`eagle1:[[0],[0,0]]`) stays
/// one entry.
fn split_top_level(list: &str) -> Vec<&str> {
    let (mut parts, mut depth, mut start) = (Vec::new(), 0i32, 0);
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    parts
}

const DEFAULT_BATCH_SIZES: &str = "1,4,16";

/// `--batch_sizes 1,4,16`.
pub fn parse_batch_sizes(list: &str) -> Result<Vec<usize>> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim) {
        match item.parse::<usize>() {
            Ok(n) if n > 0 => {
                if !out.contains(&n) {
                    out.push(n);
                }
            }
            _ => bail!(
                "--batch_sizes '{list}': '{item}' is not a positive integer (expected a comma-separated list such as 1,4,16)"
            ),
        }
    }
    Ok(out)
}

/// Only for verify:T and verify:TREE rows.
#[derive(Debug, Serialize)]
pub struct VerifyResult {
    pub tree_tokens: usize,
    pub one_token_step_ms: f64,
    pub tree_step_ms: f64,
    /// tree_step_ms ÷ one_token_step_ms (issue 6's target on llama2-7b: ≤ 1.25 at T = 64).
    pub ratio: f64,
    pub one_token_roofline_fraction: f64,
}

#[derive(Debug, Serialize)]
pub struct ModeResult {
    pub mode: String,
    pub batch_size: usize,
    /// Requests run (the prompt set cycled up to a multiple of the batch size).
    pub requests: usize,
    pub generated_tokens: usize,
    pub seconds: f64,
    /// Tokens after each sequence's first, per second of decoding (prefill excluded).
    pub tokens_per_s: Option<f64>,
    /// Prompt tokens per second of prefill.
    pub prefill_tokens_per_s: Option<f64>,
    /// Target forwards after the prompt (one per batch and step), and decode (or verify)
    /// wall time ÷ that count. For verify:T (:TREE), the verification step's latency.
    pub steps: usize,
    pub step_latency_ms: f64,
    /// Mean over requests of the time from the start of its batch to its first token.
    pub time_to_first_token_ms: Option<f64>,
    /// Tokens committed per target forward (τ; 1 for plain decoding).
    pub mean_accepted_len: Option<f64>,
    /// Draft tokens verified per target forward of a sequence (tree nodes, chain length).
    pub draft_tokens_per_step: Option<f64>,
    /// Of the draft tokens verified, the share accepted; none when nothing was drafted.
    pub draft_acceptance_rate: Option<f64>,
    /// tokens/s ÷ plain's at the same batch size.
    pub speedup_vs_plain: Option<f64>,
    pub draft_s: f64,
    pub verify_s: f64,
    /// Of verify_s, EAGLE's acceptance (waiting for the verification's tokens included).
    pub accept_s: f64,
    /// Of draft_s, EAGLE's head reading the committed pairs.
    pub head_s: f64,
    /// Of verify_s, EAGLE's compaction, kept features and commits after acceptance.
    pub update_s: f64,
    pub prefill_s: f64,
    /// Mean cached context a sequence's step attends to.
    pub mean_context_len: f64,
    /// Target weights (all, once) + KV bytes read by a step at the mean context over the batch.
    pub bytes_per_step: f64,
    /// bytes_per_step ÷ step latency ÷ copy bandwidth.
    pub roofline_fraction: f64,
    /// See `memory_probe` in the report; null where it cannot be read.
    pub peak_memory_bytes: Option<u64>,
    /// KV cache the run allocated (target model) and the most it held at once.
    pub kv_allocated_bytes: u64,
    pub kv_in_use_bytes: u64,
    /// peak_memory_bytes ÷ (weights + kv_in_use_bytes) − 1: the memory a run took beyond
    /// what it needs (issue 6's bound is 0.15). Includes the preallocated KV blocks left
    /// unused, cuBLAS workspaces, CUDA graphs and the kernels' module images.
    pub memory_overhead_fraction: Option<f64>,
    /// What the CUDA step graphs of the models in use did during this run.
    pub cuda_graph_activity: GraphActivityReport,
    /// Whether greedy output equalled plain decoding's at the same batch size.
    pub same_output_as_plain: Option<bool>,
    /// Whether greedy output equalled this mode's at the first batch size (same prompts).
    pub same_output_as_first_batch_size: Option<bool>,
    /// FNV-1a (64-bit, hex) of every request's output ids in order, to compare outputs
    /// across runs and machines (`--dependent_launch on` against `off`, bf16 on two GPUs);
    /// null for verify:T (:TREE).
    pub output_digest: Option<String>,
    pub verify: Option<VerifyResult>,
    /// Seconds of the untimed warm-up run (`--warmup_tokens`) before this one.
    pub warmup_s: f64,
}

/// [`kestrel_model::GraphActivity`] over one run.
#[derive(Debug, Default, Serialize)]
pub struct GraphActivityReport {
    pub captures: u64,
    /// Seconds spent capturing (each capture repeats an eager step).
    pub capture_s: f64,
    pub replays: u64,
    /// Times a model dropped all its graphs for another KV cache.
    pub cache_changes: u64,
}

impl GraphActivityReport {
    fn between(before: GraphActivity, after: GraphActivity) -> Self {
        GraphActivityReport {
            captures: after.captures - before.captures,
            capture_s: after.capture_s - before.capture_s,
            replays: after.replays - before.replays,
            cache_changes: after.cache_changes - before.cache_changes,
        }
    }
}

/// FNV-1a over the output ids of every request, each sequence closed by its length, as 16
/// hex digits.
fn output_digest(outputs: &[SequenceOutput]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |word: u32| {
        for b in word.to_le_bytes() {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    for o in outputs {
        o.output_ids.iter().for_each(|&t| eat(t));
        eat(o.output_ids.len() as u32);
    }
    format!("{h:016x}")
}

/// Peak memory beyond the weights and the KV actually in use, as a fraction of them.
fn memory_overhead(peak: Option<u64>, weight_bytes: u64, kv_in_use: u64) -> Option<f64> {
    let needed = (weight_bytes + kv_in_use) as f64;
    peak.filter(|_| needed > 0.0)
        .map(|p| p as f64 / needed - 1.0)
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    /// The engine directory, or `random:<shape>`.
    pub source: String,
    /// The draft engine of draft_target modes (its directory, marked when it was quantized
    /// as it loaded).
    pub draft_source: Option<String>,
    pub shape: Option<String>,
    pub device: String,
    pub device_name: String,
    pub dtype: String,
    pub num_parameters: usize,
    pub weight_bytes: u64,
    pub kv_bytes_per_token: u64,
    /// Read + write bytes per second of a large device copy, measured in this process.
    pub copy_bandwidth_bytes_per_s: f64,
    pub copy_bytes: usize,
    pub memory_probe: String,
    pub memory_baseline_bytes: u64,
    /// Use above the baseline once the engines are loaded, before any step (CUDA: the level
    /// then; CPU: the peak so far): weights and what loading them left, against what the
    /// runs add (KV pools, kernels loaded on first use, library workspaces, graphs).
    pub memory_after_load_bytes: Option<u64>,
    /// The CUDA context's per-thread stack limit after every run: Kestrel sets 256 bytes, and
    /// the driver raises it (keeping limit × resident threads of memory) for a kernel with a
    /// larger frame. `None` on the CPU.
    pub cuda_thread_stack_bytes: Option<usize>,
    pub load_s: f64,
    pub num_prompts: usize,
    pub batch_sizes: Vec<usize>,
    pub max_output_len: usize,
    /// Steps on CUDA replayed captured graphs (not `--no_cuda_graphs`).
    pub cuda_graphs: bool,
    /// Whether Kestrel's kernels were launched with programmatic dependent launch
    /// (`--dependent_launch on` and a GPU of compute capability 9.0 or later).
    pub dependent_launch: bool,
    /// `--graph_memory`: where replayed graphs kept their activations (`arena` or `driver`).
    pub graph_memory: String,
    /// Device bytes of the step graphs' arenas at the end (target, head and draft).
    pub cuda_graph_arena_bytes: usize,
    /// Why a graph capture failed and graphs were turned off, if one did.
    pub cuda_graph_failure: Option<String>,
    /// `--eagle_draft_vocab N`: EAGLE modes drafted from N tokens, described.
    pub eagle_draft_vocab: Option<String>,
    /// `--speculative_disable_by_batch_size N`: speculative steps of more than N sequences
    /// were plain steps.
    pub speculative_disable_by_batch_size: Option<usize>,
    /// How every mode picked its tokens (greedy: temperature 0).
    pub sampling: SamplingParams,
    /// Whether sampled steps drew their tokens and accepted drafts on the device
    /// (`--device_sampling`; false on the CPU).
    pub device_sampling: bool,
    /// Whether EAGLE's static trees kept their top-k drafted tokens on the device
    /// (`--draft_on_device`).
    pub draft_on_device: bool,
    /// Whether plain decoding launched each step before the previous step's tokens reached
    /// the host (`--launch_ahead`; false on the CPU).
    pub launch_ahead: bool,
    /// Whether finished sequences gave their places to the next prompts at once
    /// (`--in_flight`).
    pub in_flight: bool,
    /// `--eagle_sampling` and `--eagle_posterior_threshold`: how sampled EAGLE modes accepted.
    pub eagle_sampling: Option<String>,
    pub eagle_posterior_threshold: Option<f32>,
    pub results: Vec<ModeResult>,
}

/// A switch flag's value: `on` or `off`.
fn on_off(flag: &str, value: &str) -> Result<bool> {
    match value {
        "on" => Ok(true),
        "off" => Ok(false),
        other => bail!("{flag} {other}: expected on or off"),
    }
}

/// Random token ids in `[0, vocab)`: the prompts of a random-weights run.
fn random_prompts(n: usize, len: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut state = seed ^ 0x5EED_0FB0_B5B5;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    (0..n)
        .map(|_| (0..len).map(|_| (next() % vocab as u64) as u32).collect())
        .collect()
}

/// The engine a random-weights run decodes with: the shape's config, limits just large
/// enough for the run (so the KV cache allocated is the KV cache used).
fn random_engine(
    args: &BenchArgs,
    shape: &str,
    dtype: DType,
    max_batch: usize,
    max_draft: usize,
    device: &kestrel_runtime::device::Device,
) -> Result<Engine> {
    let cfg = shapes::shape_config(shape)?;
    if args.prompt_len == 0 {
        bail!("--prompt_len must be at least 1");
    }
    let max_seq_len = args.prompt_len + args.max_output_len;
    if max_seq_len > cfg.max_position_embeddings {
        bail!(
            "--prompt_len {} + --max_output_len {} exceeds {shape}'s max_position_embeddings {}",
            args.prompt_len,
            args.max_output_len,
            cfg.max_position_embeddings
        );
    }
    let plan = EnginePlan {
        model_config_json: serde_json::to_string(&cfg).expect("config serialises"),
        eagle_head_config_json: None,
        dtype,
        mapping: Mapping::new(1),
        limits: BuildLimits {
            max_batch_size: max_batch,
            max_input_len: args.prompt_len,
            max_seq_len,
            max_beam_width: 1,
            max_draft_len: max_draft,
            num_eagle_layers: 0,
            max_non_leaves_per_layer: 0,
            tokens_per_block: 32,
        },
        speculative_mode: SpeculativeMode::None,
        target_device: if device.is_cpu() { "cpu" } else { "cuda" }.into(),
        kernels: vec![],
        weights: vec![],
        source_checkpoint_sha256: String::new(),
    };
    let model = kestrel_model::Llama::random(&cfg, args.seed, dtype, device)?;
    Ok(Engine::from_model(&format!("random:{shape}"), plan, model)?)
}

/// The engine's prompts as token ids: the prompt file's first `num_prompts`, chat-templated.
fn engine_prompts(args: &BenchArgs, dir: &Path, engine: &Engine) -> Result<Vec<Vec<u32>>> {
    let codec = TextCodec::load(dir, &engine.config)?;
    let texts: Vec<String> = read_prompt_file(&args.prompts)?
        .into_iter()
        .take(args.num_prompts)
        .collect();
    let mut prompts = Vec::with_capacity(texts.len());
    for t in &texts {
        let text = match (&codec.chat_template, args.chat) {
            (Some(tpl), true) => tpl
                .render(&[ChatMessage::user(t)], true)
                .map_err(anyhow::Error::msg)?,
            _ => t.clone(),
        };
        prompts.push(codec.encode(&text)?);
    }
    Ok(prompts)
}

/// The target engine as one built for external drafts of up to `k` tokens, sharing its
/// weights: draft-target decoding needs such a plan, and the weights are the same.
fn draft_target_view(engine: &Engine, k: usize) -> Engine {
    let mut plan = engine.plan.clone();
    plan.speculative_mode = SpeculativeMode::DraftTokensExternal;
    plan.limits.max_draft_len = plan.limits.max_draft_len.max(k);
    Engine {
        dir: engine.dir.clone(),
        plan,
        config: engine.config.clone(),
        model: engine.model.clone(),
        eagle: None,
        draft_vocab: None,
        eagle_choices: None,
        device: engine.device.clone(),
        derived_from: engine.derived_from.clone(),
        launch_ahead: engine.launch_ahead,
    }
}

/// What the roofline and the memory check need to know of the model.
struct Sizes {
    weight_bytes: u64,
    kv_bytes_per_token: u64,
}

impl Sizes {
    fn of(engine: &Engine) -> Self {
        let c = &engine.config;
        let elem = engine.plan.dtype.size_in_bytes() as u64;
        Sizes {
            weight_bytes: c.num_parameters() as u64 * elem,
            kv_bytes_per_token: 2
                * c.num_hidden_layers as u64
                * c.num_kv_heads() as u64
                * c.head_dim() as u64
                * elem,
        }
    }
}

/// Context and KV figures of a generation run.
struct RunShape {
    mean_context_len: f64,
    kv_read_bytes: f64,
    kv_in_use_bytes: u64,
}

/// `kv_in_use_bytes` is the most any `batch` consecutive sequences held at their ends: the
/// live set of static batches, and about that of in-flight ones, whose sequences are
/// admitted in order.
fn run_shape(
    prompts: &[Vec<u32>],
    outputs: &[SequenceOutput],
    batch: usize,
    kv_tok: u64,
) -> RunShape {
    let (mut seq_steps, mut ctx_steps) = (0f64, 0f64);
    let mut kv_in_use = 0u64;
    for (ps, os) in prompts.chunks(batch).zip(outputs.chunks(batch)) {
        let mut held = 0u64;
        for (p, o) in ps.iter().zip(os) {
            let n = o.stats.steps as f64;
            // A sequence's context grows about linearly from its prompt to prompt + output.
            ctx_steps += n * (p.len() as f64 + o.output_ids.len() as f64 / 2.0);
            seq_steps += n;
            held += ((p.len() + o.output_ids.len()) as u64) * kv_tok;
        }
        kv_in_use = kv_in_use.max(held);
    }
    RunShape {
        mean_context_len: ctx_steps / seq_steps.max(1.0),
        kv_read_bytes: ctx_steps * kv_tok as f64,
        kv_in_use_bytes: kv_in_use,
    }
}

pub fn run_bench(args: &BenchArgs) -> Result<BenchReport> {
    let mut batch_sizes =
        parse_batch_sizes(args.batch_sizes.as_deref().unwrap_or(DEFAULT_BATCH_SIZES))?;
    let shape = args.random_weights.as_deref();
    match (&args.engine_dir, shape) {
        (Some(_), Some(_)) => bail!("give either --engine_dir or --random_weights, not both"),
        (None, None) => bail!("give --engine_dir DIR or --random_weights SHAPE"),
        _ => {}
    }
    if let Some(shape) = shape {
        shapes::shape_config(shape)?;
    }
    let dtype = match (&args.dtype, shape) {
        (Some(_), None) => bail!(
            "--dtype applies to --random_weights only: an engine's dtype is fixed when spec-build builds it"
        ),
        (Some(d), Some(_)) => d.parse::<DType>().map_err(|e| anyhow::anyhow!("--dtype: {e}"))?,
        (None, _) => DType::BF16,
    };
    if args.num_prompts == 0 {
        bail!("--num_prompts must be at least 1");
    }
    let explicit_modes = args.modes.as_deref().map(parse_modes).transpose()?;
    if let Some(modes) = &explicit_modes {
        // Random weights draft only as their own derived copy.
        let self_draft = shape.is_some() && args.draft_derivation.derives();
        if shape.is_some() {
            if let Some((spec, _)) = modes.iter().find(|(_, m)| match m {
                ModeSpec::Plain | ModeSpec::Verify(_) => false,
                ModeSpec::DraftTarget { .. } => !self_draft,
                _ => true,
            }) {
                bail!("--modes {spec}: random weights have no draft head or draft model; with --random_weights run plain and verify:T, and draft_target:K with --draft_quantization q4 or --draft_skip_layers (the model's own derived copy drafts)");
            }
        }
        if let Some((spec, _)) = modes
            .iter()
            .find(|(_, m)| matches!(m, ModeSpec::DraftTarget { .. }))
        {
            if args.draft_engine_dir.is_none() && !self_draft {
                bail!("--modes {spec} needs --draft_engine_dir");
            }
        }
        if let Some((spec, _)) = modes
            .iter()
            .find(|(_, m)| m.lookup().is_some_and(|l| l.corpus))
        {
            if args.prompt_lookup_corpus.is_none() {
                bail!("--modes {spec} needs --prompt_lookup_corpus");
            }
        }
    }

    let kernel_override = match args.cuda_kernels.as_str() {
        "plan" => None,
        "all" => Some(kestrel_model::CudaKernels::all()),
        "none" => Some(kestrel_model::CudaKernels::none()),
        other => bail!("--cuda_kernels {other}: expected plan, all or none"),
    };
    kestrel_runtime::device::set_dependent_launch(on_off(
        "--dependent_launch",
        &args.dependent_launch,
    )?);
    kestrel_runtime::device::set_graph_arena(match args.graph_memory.as_str() {
        "arena" => true,
        "driver" => false,
        other => bail!("--graph_memory {other}: expected arena or driver"),
    });
    let device_sampling = on_off("--device_sampling", &args.device_sampling)?;
    kestrel_runtime::device::set_device_sampling(device_sampling);
    let draft_on_device = on_off("--draft_on_device", &args.draft_on_device)?;
    kestrel_runtime::device::set_draft_on_device(draft_on_device);
    let launch_ahead = on_off("--launch_ahead", &args.launch_ahead)?;
    let in_flight = on_off("--in_flight", &args.in_flight)?;
    kestrel_runtime::set_in_flight_batching(in_flight);
    let sampling = args.sampling.params();
    sampling.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let device = kestrel_runtime::device::parse(&args.device)?;
    let device_name = measure::device_name(&device);
    let mut probe = MemProbe::new(&device)?;
    let load_start = Instant::now();
    let max_batch = *batch_sizes
        .iter()
        .max()
        .expect("parse_batch_sizes gives one");
    let (mut engine, prompts, source) = match (shape, &args.engine_dir) {
        (Some(shape), _) => {
            let max_draft = explicit_modes
                .iter()
                .flatten()
                .filter_map(|(_, m)| match m {
                    ModeSpec::Verify(draft) => Some(draft.tokens()),
                    ModeSpec::DraftTarget { k, .. } => Some(*k),
                    _ => None,
                })
                .max()
                .unwrap_or(64);
            let engine = random_engine(args, shape, dtype, max_batch, max_draft, &device)?;
            let prompts = random_prompts(
                args.num_prompts,
                args.prompt_len,
                engine.config.vocab_size,
                args.seed,
            );
            (engine, prompts, format!("random:{shape}"))
        }
        (None, Some(dir)) => {
            let engine = Engine::load(dir, &device)?;
            let prompts = engine_prompts(args, dir, &engine)?;
            (engine, prompts, dir.display().to_string())
        }
        (None, None) => unreachable!("checked above"),
    };
    if let Some(k) = kernel_override {
        engine.model.set_cuda_kernels(k);
        if let Some(head) = &mut engine.eagle {
            head.set_cuda_kernels(k);
        }
    }
    engine.set_cuda_graphs(!args.no_cuda_graphs);
    engine.launch_ahead = device.is_cuda() && launch_ahead;
    let draft = match &args.draft_engine_dir {
        Some(dir) => {
            let mut draft = load_draft(&engine, dir, &device, &args.draft_derivation)?;
            draft.set_cuda_graphs(!args.no_cuda_graphs);
            Some(draft)
        }
        None if args.draft_derivation.derives() && shape.is_some() => {
            let mut draft = args.draft_derivation.self_draft(&engine)?;
            draft.set_cuda_graphs(!args.no_cuda_graphs);
            Some(draft)
        }
        None if args.draft_derivation.derives() => {
            bail!("{} needs --draft_engine_dir (the target's own engine for a self-draft) or --random_weights", args.draft_derivation.flag())
        }
        None => None,
    };
    let ngram_corpus = args
        .prompt_lookup_corpus
        .as_deref()
        .map(|p| load_ngram_corpus(p, engine.config.vocab_size).map(Arc::new))
        .transpose()?;
    let load_s = load_start.elapsed().as_secs_f64();
    let memory_after_load = probe.peak_above_baseline();
    let modes = match explicit_modes {
        Some(m) => m,
        None => parse_modes(match (shape, engine.eagle.is_some(), draft.is_some()) {
            (Some(_), _, _) => "plain,verify:64",
            (None, true, true) => "plain,eagle1,eagle2:8,draft_target:4,prompt_lookup:4",
            (None, true, false) => "plain,eagle1,eagle2:8,prompt_lookup:4",
            (None, false, true) => "plain,draft_target:4,prompt_lookup:4",
            (None, false, false) => "plain,prompt_lookup:4",
        })?,
    };
    let built_max_batch = engine.plan.limits.max_batch_size;
    if args.batch_sizes.is_none() {
        // The default sweep fits itself to the engine; sizes asked for explicitly do not.
        batch_sizes.retain(|&b| b <= built_max_batch);
        if batch_sizes.is_empty() {
            batch_sizes.push(built_max_batch.max(1));
        }
    }
    if let Some(&b) = batch_sizes.iter().find(|&&b| b > built_max_batch) {
        bail!(
            "--batch_sizes {b}: {} was built with max_batch_size {built_max_batch}; rebuild it with spec-build --max_batch_size {b} or leave that batch size out",
            engine.dir.display()
        );
    }
    if let Some(d) = &draft {
        if let Some(&b) = batch_sizes
            .iter()
            .find(|&&b| b > d.plan.limits.max_batch_size)
        {
            bail!(
                "--batch_sizes {b}: the draft engine {} was built with max_batch_size {}; rebuild it with spec-build --max_batch_size {b}",
                d.dir.display(),
                d.plan.limits.max_batch_size
            );
        }
    }
    let sizes = Sizes::of(&engine);
    // After the checks, so that bad flags fail fast. The copy's buffers are freed and the
    // device synchronised (which trims CUDA's stream-ordered pool) before any run starts
    // its peak.
    let bandwidth = measure::copy_bandwidth(&device, args.copy_bytes)?;
    device.synchronize()?;

    let params = GenerationParams {
        max_output_len: args.max_output_len,
        sampling,
        end_ids: engine.config.eos_token_ids(),
    };
    let mut results: Vec<ModeResult> = Vec::new();
    // Per mode, the first batch size's outputs (for the batch-invariance check).
    let mut first_outputs: Vec<(String, Vec<Vec<u32>>)> = Vec::new();
    for &batch in &batch_sizes {
        // The runtime sizes its KV cache for max_batch_size sequences; running batch B with
        // the limit set to B allocates what the batch needs, as an engine built for B would.
        engine.plan.limits.max_batch_size = batch;
        let requests = prompts.len().div_ceil(batch) * batch;
        let batch_prompts: Vec<Vec<u32>> = prompts.iter().cycle().take(requests).cloned().collect();
        let mut plain: Option<(f64, Vec<Vec<u32>>)> = None;
        for (spec, mode) in &modes {
            let kv_allocated = |e: &Engine| {
                (e.kv_blocks() * e.plan.limits.tokens_per_block) as u64 * sizes.kv_bytes_per_token
            };
            let activity = |target: &Engine| {
                let draft = draft.as_ref().map(Engine::cuda_graph_activity);
                target.cuda_graph_activity() + draft.unwrap_or_default()
            };
            if let ModeSpec::Verify(draft) = mode {
                let t = draft.tokens();
                let graphs_before = activity(&engine);
                probe.start_run();
                let v = verify::time_verify(
                    &engine.model,
                    &batch_prompts[..batch],
                    draft,
                    args.max_output_len,
                    engine.plan.limits.tokens_per_block,
                    &mut probe,
                )?;
                let kv_read = batch as f64 * v.mean_context_len * sizes.kv_bytes_per_token as f64;
                let bytes = sizes.weight_bytes as f64 + kv_read;
                let roof = |s: f64| bytes / s.max(f64::EPSILON) / bandwidth;
                let max_prompt = batch_prompts[..batch]
                    .iter()
                    .map(Vec::len)
                    .max()
                    .unwrap_or(0);
                let kv_in_use =
                    (batch * (max_prompt + v.steps + t)) as u64 * sizes.kv_bytes_per_token;
                let peak = probe.peak_above_baseline();
                results.push(ModeResult {
                    mode: spec.clone(),
                    batch_size: batch,
                    requests: batch,
                    generated_tokens: 0,
                    seconds: (v.one_token_step_s + v.tree_step_s) * v.steps as f64,
                    tokens_per_s: None,
                    prefill_tokens_per_s: None,
                    steps: v.steps,
                    step_latency_ms: v.tree_step_s * 1e3,
                    time_to_first_token_ms: None,
                    mean_accepted_len: None,
                    draft_tokens_per_step: None,
                    draft_acceptance_rate: None,
                    speedup_vs_plain: None,
                    draft_s: 0.0,
                    verify_s: v.tree_step_s * v.steps as f64,
                    accept_s: 0.0,
                    head_s: 0.0,
                    update_s: 0.0,
                    prefill_s: 0.0,
                    mean_context_len: v.mean_context_len,
                    bytes_per_step: bytes,
                    roofline_fraction: roof(v.tree_step_s),
                    peak_memory_bytes: peak,
                    kv_allocated_bytes: (batch
                        * (max_prompt + v.steps + t + 1)
                            .div_ceil(engine.plan.limits.tokens_per_block)
                        * engine.plan.limits.tokens_per_block)
                        as u64
                        * sizes.kv_bytes_per_token,
                    kv_in_use_bytes: kv_in_use,
                    memory_overhead_fraction: memory_overhead(peak, sizes.weight_bytes, kv_in_use),
                    cuda_graph_activity: GraphActivityReport::between(
                        graphs_before,
                        activity(&engine),
                    ),
                    same_output_as_plain: None,
                    same_output_as_first_batch_size: None,
                    output_digest: None,
                    verify: Some(VerifyResult {
                        tree_tokens: t,
                        one_token_step_ms: v.one_token_step_s * 1e3,
                        tree_step_ms: v.tree_step_s * 1e3,
                        ratio: v.tree_step_s / v.one_token_step_s.max(f64::EPSILON),
                        one_token_roofline_fraction: roof(v.one_token_step_s),
                    }),
                    // time_verify warms both step shapes up itself.
                    warmup_s: 0.0,
                });
                continue;
            }
            let dt_view;
            let (target, decode_mode): (&Engine, DecodeMode) = match mode {
                ModeSpec::Plain => (&engine, DecodeMode::Plain),
                ModeSpec::Eagle1(..) | ModeSpec::Eagle2 { .. } => {
                    if engine.eagle.is_none() {
                        bail!(
                            "--modes {spec}: {} has no EAGLE head: build it with spec-build --speculative_decoding_mode eagle",
                            engine.dir.display()
                        );
                    }
                    let flags = match mode {
                        ModeSpec::Eagle1(tree, _) => EagleFlags {
                            eagle_choices: tree.clone(),
                            eagle_draft_vocab: args.eagle_draft_vocab,
                            eagle_sampling: args.eagle_sampling.clone(),
                            eagle_posterior_threshold: args.eagle_posterior_threshold,
                            ..EagleFlags::default()
                        },
                        ModeSpec::Eagle2 {
                            top_k,
                            max_draft_len,
                            num_layers,
                            min_prob,
                            ..
                        } => EagleFlags {
                            eagle_use_dynamic_tree: true,
                            eagle_dynamic_tree_max_top_k: Some(*top_k),
                            eagle_dynamic_tree_max_draft_len: *max_draft_len,
                            eagle_dynamic_tree_num_layers: *num_layers,
                            eagle_dynamic_tree_min_prob: *min_prob,
                            eagle_draft_vocab: args.eagle_draft_vocab,
                            eagle_sampling: args.eagle_sampling.clone(),
                            eagle_posterior_threshold: args.eagle_posterior_threshold,
                            ..EagleFlags::default()
                        },
                        _ => unreachable!(),
                    };
                    let mut eagle = eagle_mode(&engine, &flags, false)?;
                    if let (DecodeMode::Eagle(options), Some(l)) = (&mut eagle, mode.lookup()) {
                        options.lookup = Some(prompt_lookup(spec, l, &ngram_corpus)?);
                    }
                    disable_by_batch_size(&mut eagle, args.speculative_disable_by_batch_size)?;
                    (&engine, eagle)
                }
                ModeSpec::DraftTarget { k, use_logits } => {
                    let draft = draft
                        .as_ref()
                        .context("draft_target needs --draft_engine_dir")?;
                    dt_view = draft_target_view(&engine, *k);
                    (
                        &dt_view,
                        DecodeMode::DraftTarget {
                            draft,
                            options: DraftTargetOptions {
                                draft_len: *k,
                                use_logits: *use_logits,
                                disable_by_batch_size: args.speculative_disable_by_batch_size,
                            },
                        },
                    )
                }
                ModeSpec::PromptLookup(l) => {
                    // Any engine verifies drafts here: the view lifts max_draft_len to k.
                    dt_view = draft_target_view(&engine, l.k);
                    let lookup = prompt_lookup(spec, l, &ngram_corpus)?;
                    (
                        &dt_view,
                        DecodeMode::PromptLookup {
                            lookup,
                            disable_by_batch_size: args.speculative_disable_by_batch_size,
                        },
                    )
                }
                ModeSpec::Verify(_) => unreachable!("handled above"),
            };
            let warmup_s = if args.warmup_tokens > 0 {
                let start = Instant::now();
                let warm = GenerationParams {
                    max_output_len: args.warmup_tokens.min(args.max_output_len),
                    ..params.clone()
                };
                generate(
                    target,
                    &decode_mode,
                    &batch_prompts[..batch],
                    &warm,
                    &mut NoSink,
                )?;
                start.elapsed().as_secs_f64()
            } else {
                0.0
            };
            let graphs_before = activity(target);
            probe.start_run();
            // One call, as spec-run makes: the runtime keeps up to `batch` sequences (the
            // limit set above) in flight over one set of KV pools, so CUDA graphs captured for
            // the first steps' layouts serve the later ones. A call per batch gave every batch new
            // pools, and so new graphs: EAGLE-2's dozens of layouts were run eagerly twice and
            // captured again for every prompt.
            let (outputs, timings) = generate(
                target,
                &decode_mode,
                &batch_prompts,
                &params,
                &mut ProbeSink(&mut probe),
            )?;
            let peak = probe.peak_above_baseline();
            let shape_of = run_shape(&batch_prompts, &outputs, batch, sizes.kv_bytes_per_token);
            let ids: Vec<Vec<u32>> = outputs.iter().map(|o| o.output_ids.clone()).collect();
            let decode_s = (timings.total_s - timings.prefill_s).max(f64::EPSILON);
            let decoded = timings.generated_tokens.saturating_sub(outputs.len());
            let tokens_per_s = decoded as f64 / decode_s;
            let steps: usize = outputs.iter().map(|o| o.stats.steps).sum();
            let committed: f64 = outputs
                .iter()
                .map(|o| o.stats.tokens_per_step * o.stats.steps as f64)
                .sum();
            let drafted: usize = outputs.iter().map(|o| o.stats.draft_tokens).sum();
            let accepted: usize = outputs.iter().map(|o| o.stats.accepted_draft_tokens).sum();
            let prompt_tokens: usize = batch_prompts.iter().map(Vec::len).sum();
            let bytes_total =
                timings.batch_steps as f64 * sizes.weight_bytes as f64 + shape_of.kv_read_bytes;
            // Sampled speculation keeps the target's distribution, not plain decoding's draws.
            let (speedup, same) = match &plain {
                Some((base, plain_ids)) => (
                    Some(tokens_per_s / base),
                    sampling.is_greedy().then(|| &ids == plain_ids),
                ),
                None => (None, None),
            };
            if *mode == ModeSpec::Plain {
                plain = Some((tokens_per_s, ids.clone()));
            }
            let shared = prompts.len().min(ids.len());
            let same_across = match first_outputs.iter().find(|(s, _)| s == spec) {
                Some((_, first)) => Some(first[..shared] == ids[..shared]),
                None => {
                    first_outputs.push((spec.clone(), ids));
                    None
                }
            };
            let batch_steps = timings.batch_steps.max(1) as f64;
            results.push(ModeResult {
                mode: spec.clone(),
                batch_size: batch,
                requests,
                generated_tokens: timings.generated_tokens,
                seconds: timings.total_s,
                tokens_per_s: Some(tokens_per_s),
                prefill_tokens_per_s: Some(
                    prompt_tokens as f64 / timings.prefill_s.max(f64::EPSILON),
                ),
                steps: timings.batch_steps,
                step_latency_ms: decode_s / batch_steps * 1e3,
                time_to_first_token_ms: Some(
                    outputs
                        .iter()
                        .map(|o| o.stats.time_to_first_token_s)
                        .sum::<f64>()
                        / outputs.len().max(1) as f64
                        * 1e3,
                ),
                mean_accepted_len: Some(if steps == 0 {
                    0.0
                } else {
                    committed / steps as f64
                }),
                draft_tokens_per_step: (steps > 0).then(|| drafted as f64 / steps as f64),
                draft_acceptance_rate: (drafted > 0).then(|| accepted as f64 / drafted as f64),
                speedup_vs_plain: speedup,
                draft_s: timings.draft_s,
                verify_s: timings.verify_s,
                accept_s: timings.accept_s,
                head_s: timings.head_s,
                update_s: timings.update_s,
                prefill_s: timings.prefill_s,
                mean_context_len: shape_of.mean_context_len,
                bytes_per_step: bytes_total / batch_steps,
                roofline_fraction: bytes_total / decode_s / bandwidth,
                peak_memory_bytes: peak,
                kv_allocated_bytes: kv_allocated(target),
                kv_in_use_bytes: shape_of.kv_in_use_bytes,
                memory_overhead_fraction: memory_overhead(
                    peak,
                    sizes.weight_bytes,
                    shape_of.kv_in_use_bytes,
                ),
                cuda_graph_activity: GraphActivityReport::between(graphs_before, activity(target)),
                same_output_as_plain: same,
                same_output_as_first_batch_size: same_across,
                output_digest: Some(output_digest(&outputs)),
                verify: None,
                warmup_s,
            });
        }
    }
    Ok(BenchReport {
        source,
        draft_source: draft.as_ref().map(|d| d.dir.display().to_string()),
        shape: shape.map(str::to_string),
        device: args.device.clone(),
        device_name,
        dtype: engine.plan.dtype.as_str().to_string(),
        num_parameters: engine.config.num_parameters(),
        weight_bytes: sizes.weight_bytes,
        kv_bytes_per_token: sizes.kv_bytes_per_token,
        copy_bandwidth_bytes_per_s: bandwidth,
        copy_bytes: args.copy_bytes,
        memory_probe: probe.kind.to_string(),
        memory_baseline_bytes: probe.baseline,
        memory_after_load_bytes: memory_after_load,
        cuda_thread_stack_bytes: kestrel_runtime::device::thread_stack_limit(&device)?,
        load_s,
        num_prompts: prompts.len(),
        batch_sizes,
        max_output_len: args.max_output_len,
        cuda_graphs: device.is_cuda() && !args.no_cuda_graphs,
        dependent_launch: kestrel_runtime::device::dependent_launch_on(&device)?,
        graph_memory: args.graph_memory.clone(),
        cuda_graph_arena_bytes: engine.cuda_graph_arena_bytes()
            + draft.as_ref().map_or(0, Engine::cuda_graph_arena_bytes),
        sampling,
        device_sampling: device.is_cuda() && device_sampling,
        draft_on_device,
        launch_ahead: device.is_cuda() && launch_ahead,
        in_flight,
        eagle_sampling: args.eagle_sampling.clone(),
        eagle_posterior_threshold: args.eagle_posterior_threshold,
        cuda_graph_failure: engine
            .cuda_graph_failure()
            .or_else(|| draft.as_ref().and_then(Engine::cuda_graph_failure)),
        eagle_draft_vocab: args.eagle_draft_vocab.map(|n| {
            if engine.draft_vocab.is_some() {
                format!("the {n} most frequent tokens of the engine's draft_vocab.json")
            } else {
                format!("the first {n} token ids")
            }
        }),
        speculative_disable_by_batch_size: args.speculative_disable_by_batch_size,
        results,
    })
}

impl BenchReport {
    /// `greedy`, or the sampling flags and where the draws were made.
    fn sampling_label(&self) -> String {
        let s = &self.sampling;
        if s.is_greedy() {
            return "greedy".into();
        }
        format!(
            "sampled (temperature {}, top_k {}, top_p {}, seed {}; drawn on the {})",
            s.temperature,
            s.top_k,
            s.top_p,
            s.seed,
            if self.device_sampling {
                "device"
            } else {
                "host"
            }
        )
    }
}

fn opt(v: Option<f64>, f: impl Fn(f64) -> String) -> String {
    v.map_or("-".into(), f)
}

impl BenchReport {
    pub fn print(&self) {
        const MIB: f64 = 1024.0 * 1024.0;
        println!(
            "spec-bench: {} on {} ({}), {}, {} prompts, batch sizes {:?}, up to {} new tokens, {}",
            self.source,
            self.device,
            self.device_name,
            self.dtype,
            self.num_prompts,
            self.batch_sizes,
            self.max_output_len,
            self.sampling_label()
        );
        println!(
            "weights {:.1} MiB, KV {:.1} KiB/token, copy bandwidth {:.1} GB/s (read + write), load {:.2} s",
            self.weight_bytes as f64 / MIB,
            self.kv_bytes_per_token as f64 / 1024.0,
            self.copy_bandwidth_bytes_per_s / 1e9,
            self.load_s
        );
        if let Some(why) = &self.cuda_graph_failure {
            println!("CUDA graphs were turned off, steps ran eagerly: {why}");
        }
        if let Some(vocab) = &self.eagle_draft_vocab {
            println!("EAGLE modes draft from {vocab}");
        }
        println!(
            "{:<20} {:>5} {:>7} {:>10} {:>9} {:>9} {:>6} {:>8} {:>8} {:>9} {:>7} {:>5}",
            "mode",
            "batch",
            "tokens",
            "decode t/s",
            "step ms",
            "ttft ms",
            "tau",
            "speedup",
            "roofline",
            "peak MiB",
            "mem +%",
            "same"
        );
        for r in &self.results {
            let same = match (r.same_output_as_plain, r.same_output_as_first_batch_size) {
                (None, None) => "-".to_string(),
                (a, b) => {
                    if a.unwrap_or(true) && b.unwrap_or(true) {
                        "yes".into()
                    } else {
                        "NO".into()
                    }
                }
            };
            println!(
                "{:<20} {:>5} {:>7} {:>10} {:>9.2} {:>9} {:>6} {:>8} {:>7.1}% {:>9} {:>7} {:>5}",
                r.mode,
                r.batch_size,
                r.generated_tokens,
                opt(r.tokens_per_s, |v| format!("{v:.1}")),
                r.step_latency_ms,
                opt(r.time_to_first_token_ms, |v| format!("{v:.1}")),
                opt(r.mean_accepted_len, |v| format!("{v:.2}")),
                opt(r.speedup_vs_plain, |v| format!("{v:.2}x")),
                r.roofline_fraction * 100.0,
                r.peak_memory_bytes
                    .map_or("-".into(), |b| format!("{:.1}", b as f64 / MIB)),
                opt(r.memory_overhead_fraction, |f| format!("{:.0}%", f * 100.0)),
                same
            );
        }
        for r in &self.results {
            let g = &r.cuda_graph_activity;
            if g.captures + g.replays > 0 {
                println!(
                    "cuda graphs, {} at batch {}: {} replays, {} captures ({:.3} s), {} cache changes",
                    r.mode, r.batch_size, g.replays, g.captures, g.capture_s, g.cache_changes
                );
            }
        }
        for r in &self.results {
            if let Some(v) = &r.verify {
                println!(
                    "{} at batch {}: {}-token step {:.2} ms vs 1-token step {:.2} ms = {:.2}x (roofline {:.1}% vs {:.1}%)",
                    r.mode,
                    r.batch_size,
                    v.tree_tokens,
                    v.tree_step_ms,
                    v.one_token_step_ms,
                    v.ratio,
                    r.roofline_fraction * 100.0,
                    v.one_token_roofline_fraction * 100.0
                );
            }
        }
        println!("same: greedy output equal to plain's at that batch size and to the mode's at the first batch size");
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        let body = serde_json::to_string_pretty(self).expect("report serialises");
        std::fs::write(path, body)
            .with_context(|| format!("--output_json {}: cannot write it", path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lists_parse_and_refuse_junk() {
        assert_eq!(parse_batch_sizes("1,4,16").unwrap(), vec![1, 4, 16]);
        assert_eq!(parse_batch_sizes(" 2 ").unwrap(), vec![2]);
        assert_eq!(parse_batch_sizes("4,4").unwrap(), vec![4]);
        for bad in ["", "1,,2", "0", "1,x", "-1"] {
            assert!(parse_batch_sizes(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn modes_parse() {
        let m = parse_modes(
            "plain, eagle1:[[0],[0,0]],eagle2:8,eagle2:10:16:3,eagle2:1:1:1:0.4,draft_target:3,draft_target:2:logits,prompt_lookup:4,prompt_lookup:8:2:corpus,verify:64,eagle1:small_8+prompt_lookup:4:3:corpus,eagle2:4:4:1+prompt_lookup:2",
        )
        .unwrap();
        let kinds: Vec<ModeSpec> = m.into_iter().map(|(_, k)| k).collect();
        let lookup = |k, max_ngram, corpus| LookupSpec {
            k,
            max_ngram,
            corpus,
        };
        assert_eq!(
            kinds,
            vec![
                ModeSpec::Plain,
                ModeSpec::Eagle1(Some("[[0],[0,0]]".into()), None),
                ModeSpec::Eagle2 {
                    top_k: 8,
                    max_draft_len: None,
                    num_layers: None,
                    min_prob: None,
                    lookup: None,
                },
                ModeSpec::Eagle2 {
                    top_k: 10,
                    max_draft_len: Some(16),
                    num_layers: Some(3),
                    min_prob: None,
                    lookup: None,
                },
                ModeSpec::Eagle2 {
                    top_k: 1,
                    max_draft_len: Some(1),
                    num_layers: Some(1),
                    min_prob: Some(0.4),
                    lookup: None,
                },
                ModeSpec::DraftTarget {
                    k: 3,
                    use_logits: false
                },
                ModeSpec::DraftTarget {
                    k: 2,
                    use_logits: true
                },
                ModeSpec::PromptLookup(lookup(4, 3, false)),
                ModeSpec::PromptLookup(lookup(8, 2, true)),
                ModeSpec::Verify(verify::DraftShape::Chain(64)),
                ModeSpec::Eagle1(Some("small_8".into()), Some(lookup(4, 3, true))),
                ModeSpec::Eagle2 {
                    top_k: 4,
                    max_draft_len: Some(4),
                    num_layers: Some(1),
                    min_prob: None,
                    lookup: Some(lookup(2, 3, false)),
                },
            ]
        );
        for (bad, why) in [
            (
                "plain+prompt_lookup:4",
                "--modes plain+prompt_lookup:4: '+prompt_lookup' grafts onto eagle1 and eagle2 trees only",
            ),
            (
                "eagle1+draft_target:4",
                "--modes eagle1+draft_target:4: only prompt_lookup:K[:N[:corpus]] may follow '+'",
            ),
            (
                "eagle1+prompt_lookup:4:3:all",
                "--modes eagle1+prompt_lookup:4:3:all: prompt_lookup takes K, K:N or K:N:corpus",
            ),
            (
                "eagle1+prompt_lookup:0",
                "--modes eagle1+prompt_lookup:0: prompt_lookup needs a positive integer after ':'",
            ),
        ] {
            assert_eq!(parse_modes(bad).unwrap_err().to_string(), why);
        }
        assert_eq!(
            parse_modes("verify:0").unwrap_err().to_string(),
            "--modes verify:0: verify needs a positive integer after ':'"
        );
        assert_eq!(
            format!("{:#}", parse_modes("verify:[[1,0]]").unwrap_err()),
            "--modes verify:[[1,0]]: eagle_choices path [1, 0] has no parent [1]: every prefix of a path must be in the tree"
        );
        assert_eq!(
            parse_modes("eagle2:8:0").unwrap_err().to_string(),
            "--modes eagle2:8:0: eagle2 needs a positive integer after ':'"
        );
        assert_eq!(
            parse_modes("eagle2:8:16:3:2").unwrap_err().to_string(),
            "--modes eagle2:8:16:3:2: eagle2's P (after N:T:L) is the least draft probability a node needs, in [0, 1]"
        );
        assert_eq!(
            parse_modes("eagle2:8:16:3:0.2:1").unwrap_err().to_string(),
            "--modes eagle2:8:16:3:0.2:1: eagle2 takes at most N:T:L:P"
        );
        assert_eq!(
            parse_modes("draft_target:4:exact").unwrap_err().to_string(),
            "--modes draft_target:4:exact: draft_target takes K or K:logits"
        );
        assert!(parse_modes("beam").is_err());
    }

    /// `verify:TREE` carries the tree's root and nodes: their ancestor mask and depths, in
    /// the tree's node order (by depth, then path).
    #[test]
    fn verify_takes_a_tree_as_its_mask_and_depths() {
        let modes = parse_modes("verify:[[0],[1],[0,0]],verify:mc_sim_7b_63").unwrap();
        let (t, f) = (true, false);
        assert_eq!(
            modes[0],
            (
                "verify:[[0],[1],[0,0]]".to_string(),
                ModeSpec::Verify(verify::DraftShape::Tree {
                    mask: vec![t, f, f, f, t, t, f, f, t, f, t, f, t, t, f, t],
                    depths: vec![0, 1, 1, 2],
                })
            )
        );
        match &modes[1].1 {
            ModeSpec::Verify(draft) => assert_eq!(draft.tokens(), 64),
            other => panic!("verify:mc_sim_7b_63 parsed as {other:?}"),
        }
    }
}

//! `spec-run`: generate with an engine (TensorRT-LLM's `run.py`).

use anyhow::{bail, Context, Result};
use clap::Parser;
use kestrel::cli::exit_on_error;
use kestrel::decoding::{disable_by_batch_size, eagle_mode, EagleFlags, SamplingFlags};
use kestrel::draft_config::{DraftTargetModelConfig, PromptLookupFlag};
use kestrel::draft_engine::{load_draft, DraftDerivation};
use kestrel::kv_cache::kv_cache_options;
use kestrel::prompts::read_prompt_file;
use kestrel::report::{print_outputs, write_output_json, Profile, StreamPrinter};
use kestrel_core::SpeculativeMode;
use kestrel_runtime::ngram_corpus::load_ngram_corpus;
use kestrel_runtime::{
    generate_with, ChatMessage, DecodeMode, DraftTargetOptions, EagleOptions, EagleTreeKind,
    Engine, FinishReason, GenerationParams, NoSink, PromptLookup, SequenceOutput, TextCodec,
    TokenSink,
};
use kestrel_spec::tree::DEFAULT_PRESET;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser, Debug)]
#[command(
    name = "spec-run",
    rename_all = "snake_case",
    version,
    about = "Generate text with a Kestrel engine"
)]
struct Args {
    /// Engine directory written by spec-build.
    #[arg(long)]
    engine_dir: PathBuf,
    /// Directory with tokenizer.json (and chat_template.jinja); defaults to the engine's.
    #[arg(long)]
    tokenizer_dir: Option<PathBuf>,
    /// A prompt; repeat the flag for a batch.
    #[arg(long)]
    input_text: Vec<String>,
    /// Prompts from a file: a JSON list of strings, or JSONL with one string or {"prompt": …} per line.
    #[arg(long)]
    input_file: Option<PathBuf>,
    /// Wrap each prompt as a user turn with the chat template.
    #[arg(long)]
    chat: bool,
    #[arg(long, default_value_t = 64)]
    max_output_len: usize,
    #[command(flatten)]
    sampling: SamplingFlags,
    /// Stop id; defaults to the model's eos ids.
    #[arg(long)]
    end_id: Option<u32>,
    /// Accepted for compatibility: outputs are not padded.
    #[arg(long)]
    pad_id: Option<u32>,
    /// Only 1: speculative decoding has no beam search.
    #[arg(long, default_value_t = 1)]
    num_beams: usize,
    /// Print tokens as they are committed.
    #[arg(long)]
    streaming: bool,
    /// Report tokens/s and time to first token.
    #[arg(long)]
    run_profiling: bool,
    /// Write inputs, outputs and stats as JSON.
    #[arg(long)]
    output_json: Option<PathBuf>,
    /// cpu, or cuda:N (needs a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Run every step eagerly instead of replaying CUDA graphs (ignored on CPU).
    #[arg(long)]
    no_cuda_graphs: bool,
    /// Decode without speculation even with an EAGLE engine (the baseline).
    #[arg(long)]
    no_speculation: bool,
    /// EAGLE-1 tree: a JSON list of paths, a preset name or a JSON file (default mc_sim_7b_63).
    #[arg(long)]
    eagle_choices: Option<String>,
    /// Typical acceptance with this ε (lossy, as TensorRT-LLM; alpha = sqrt ε).
    #[arg(long)]
    eagle_posterior_threshold: Option<f32>,
    /// EAGLE-2: build the tree while decoding.
    #[arg(long)]
    eagle_use_dynamic_tree: bool,
    /// EAGLE-2: nodes expanded per layer and children per node.
    #[arg(long)]
    eagle_dynamic_tree_max_top_k: Option<usize>,
    /// EAGLE-2: draft nodes kept per step (default and most: the engine's max_draft_len).
    /// Fewer cost less to verify and accept less.
    #[arg(long)]
    eagle_dynamic_tree_max_draft_len: Option<usize>,
    /// EAGLE-2: layers drafted per step (default and most: the engine's num_eagle_layers).
    /// Each is a head step.
    #[arg(long)]
    eagle_dynamic_tree_num_layers: Option<usize>,
    /// EAGLE-2: nodes whose cumulative draft probability (the product of the head's
    /// probabilities down their path) is below P are neither expanded nor verified; a step
    /// whose best guess is below P drafts nothing and runs as a plain decode step. Where
    /// verified rows are dear (a CPU, a small model), a gate spends them where the head is
    /// sure. Default 0: every node counts.
    #[arg(long, value_name = "P")]
    eagle_dynamic_tree_min_prob: Option<f32>,
    /// A step of more than N sequences drafts nothing and runs as a plain decode step (vLLM's
    /// flag of that name; EAGLE, draft-target and prompt lookup); the draft (EAGLE's head or
    /// the draft model) catches up once the batch is N or fewer. Where
    /// a full batch already keeps the device busy, verified rows cost more than they return
    /// (SmolLM2 at batch 4: EAGLE ran 0.83x plain decoding on 2 CPU cores). Default: always
    /// speculate.
    #[arg(long, value_name = "N")]
    speculative_disable_by_batch_size: Option<usize>,
    /// Acceptance under sampling: token_match (default), typical or exact.
    #[arg(long)]
    eagle_sampling: Option<String>,
    /// Draft from N tokens only: the head's LM head reads N of its rows. They are the N most
    /// frequent when the engine carries a draft_vocab.json (spec-train draft-vocab), else the
    /// first N ids (BPE ids rise roughly with rarity). Verification still scores every token:
    /// output unchanged.
    #[arg(long)]
    eagle_draft_vocab: Option<usize>,
    /// Graft prompt lookup's drafts (--prompt_lookup_config, --prompt_lookup_corpus) onto
    /// every EAGLE tree as one more branch, within the engine's max_draft_len: one
    /// verification checks both drafters' guesses.
    #[arg(long)]
    eagle_prompt_lookup: bool,
    /// Draft engine for draft-target decoding (the target is --engine_dir; with
    /// --draft_quantization or --draft_skip_layers it may be the target's own).
    #[arg(long)]
    draft_engine_dir: Option<PathBuf>,
    #[command(flatten)]
    draft_derivation: DraftDerivation,
    /// "[draft_len,[draft devices],[target devices],use_logits]", e.g. "[4,[cpu],[cpu],False]".
    #[arg(long)]
    draft_target_model_config: Option<String>,
    /// Prompt lookup decoding: "[prompt_lookup_num_tokens,max_matching_ngram_size]", e.g.
    /// "[4,3]" (optionally a third entry, the target's devices: "[4,3,[0]]"). Drafts are the
    /// tokens after the latest earlier occurrence of the sequence's last n-gram; the engine
    /// must verify drafts (built for draft_tokens_external or EAGLE).
    #[arg(long)]
    prompt_lookup_config: Option<String>,
    /// Prompt lookup backed by an n-gram model of this corpus of the model's answers
    /// (`spec-train ngram-corpus`), which drafts where a sequence has nothing longer than one
    /// token to copy from itself.
    #[arg(long)]
    prompt_lookup_corpus: Option<PathBuf>,
    /// Keep each prompt's full KV blocks after its request finishes, so that later requests
    /// (later batches of --input_file) starting with the same tokens skip prefilling them.
    #[arg(long)]
    kv_cache_enable_block_reuse: bool,
    /// Size the KV cache from this share (0 < F ≤ 1) of the device's free memory once the
    /// weights are loaded, split between target and draft on one device; default: room for
    /// a full batch at max_seq_len.
    // Hyphen values are let through so that a negative F gets this flag's own error.
    #[arg(long, value_name = "F", allow_hyphen_values = true)]
    kv_cache_free_gpu_memory_fraction: Option<String>,
}

fn run(args: Args) -> Result<()> {
    if args.num_beams != 1 {
        bail!(
            "--num_beams {} is not supported: speculative decoding decodes with one beam",
            args.num_beams
        );
    }
    let kv_cache = kv_cache_options(
        args.kv_cache_enable_block_reuse,
        args.kv_cache_free_gpu_memory_fraction.as_deref(),
    )
    .map_err(anyhow::Error::msg)?;
    let mut texts = args.input_text.clone();
    if let Some(file) = &args.input_file {
        texts.extend(read_prompt_file(file)?);
    }
    if texts.is_empty() {
        bail!("no input: give --input_text TEXT (repeatable) or --input_file FILE");
    }
    let dtm = match (&args.draft_engine_dir, &args.draft_target_model_config) {
        (Some(_), Some(cfg)) => Some(DraftTargetModelConfig::parse(cfg).map_err(anyhow::Error::msg)?),
        (Some(_), None) => bail!("--draft_engine_dir needs --draft_target_model_config \"[draft_len,[draft devices],[target devices],use_logits]\""),
        (None, Some(_)) => bail!("--draft_target_model_config needs --draft_engine_dir"),
        (None, None) if args.draft_derivation.derives() => {
            bail!("{} needs --draft_engine_dir (the target's own engine for a self-draft)", args.draft_derivation.flag())
        }
        (None, None) => None,
    };
    let lookup = args
        .prompt_lookup_config
        .as_deref()
        .map(PromptLookupFlag::parse)
        .transpose()
        .map_err(anyhow::Error::msg)?;
    if args.prompt_lookup_corpus.is_some() && lookup.is_none() {
        bail!("--prompt_lookup_corpus needs --prompt_lookup_config \"[num_tokens,max_ngram]\"");
    }
    if lookup.is_some() && dtm.is_some() {
        bail!("--prompt_lookup_config cannot be combined with --draft_engine_dir: choose one source of drafts");
    }
    let target_device = match (
        &dtm,
        lookup.as_ref().and_then(|l| l.target_devices.as_ref()),
    ) {
        (Some(c), _) => c.target_devices[0].clone(),
        (None, Some(devices)) => devices[0].clone(),
        (None, None) => args.device.clone(),
    };
    let device = kestrel_runtime::device::parse(&target_device)?;
    let mut engine = Engine::load(&args.engine_dir, &device)?;
    engine.set_cuda_graphs(!args.no_cuda_graphs);
    let draft = match (&dtm, &args.draft_engine_dir) {
        (Some(c), Some(dir)) => {
            let device = kestrel_runtime::device::parse(&c.draft_devices[0])?;
            let mut draft = load_draft(&engine, dir, &device, &args.draft_derivation)?;
            draft.set_cuda_graphs(!args.no_cuda_graphs);
            c.validate_against(draft.plan.mapping.tp_size, engine.plan.mapping.tp_size)
                .map_err(anyhow::Error::msg)?;
            Some(draft)
        }
        _ => None,
    };
    let tokenizer_dir = args
        .tokenizer_dir
        .clone()
        .unwrap_or_else(|| args.engine_dir.clone());
    let codec = TextCodec::load(&tokenizer_dir, &engine.config)?;

    let mut prompts = Vec::with_capacity(texts.len());
    for text in &texts {
        let rendered = if args.chat {
            let template = codec.chat_template.as_ref().with_context(|| {
                format!(
                    "--chat needs a chat template, but {} has no chat_template.jinja",
                    tokenizer_dir.display()
                )
            })?;
            template
                .render(&[ChatMessage::user(text)], true)
                .map_err(anyhow::Error::msg)?
        } else {
            text.clone()
        };
        prompts.push(codec.encode(&rendered)?);
    }
    let end_ids = match args.end_id {
        Some(id) => vec![id],
        None => engine.config.eos_token_ids(),
    };
    let params = GenerationParams {
        max_output_len: args.max_output_len,
        sampling: args.sampling.params(),
        end_ids,
    };
    let eagle_flags = EagleFlags {
        eagle_choices: args.eagle_choices.clone(),
        eagle_posterior_threshold: args.eagle_posterior_threshold,
        eagle_use_dynamic_tree: args.eagle_use_dynamic_tree,
        eagle_dynamic_tree_max_top_k: args.eagle_dynamic_tree_max_top_k,
        eagle_dynamic_tree_max_draft_len: args.eagle_dynamic_tree_max_draft_len,
        eagle_dynamic_tree_num_layers: args.eagle_dynamic_tree_num_layers,
        eagle_dynamic_tree_min_prob: args.eagle_dynamic_tree_min_prob,
        eagle_sampling: args.eagle_sampling.clone(),
        eagle_draft_vocab: args.eagle_draft_vocab,
    };
    if let Some(devices) = lookup.as_ref().and_then(|l| l.target_devices.as_ref()) {
        let tp = engine.plan.mapping.tp_size;
        if devices.len() != tp {
            bail!(
                "--prompt_lookup_config lists {} target device(s) but the engine has tp_size {tp}: list one device per tensor-parallel rank",
                devices.len()
            );
        }
    }
    let prompt_lookup = match &lookup {
        Some(flag) => Some(PromptLookup {
            config: flag.lookup,
            corpus: args
                .prompt_lookup_corpus
                .as_deref()
                .map(|p| load_ngram_corpus(p, engine.config.vocab_size).map(Arc::new))
                .transpose()?,
        }),
        None if args.eagle_prompt_lookup => {
            bail!("--eagle_prompt_lookup needs --prompt_lookup_config \"[num_tokens,max_ngram]\"")
        }
        None => None,
    };
    let mut mode = match (&draft, &dtm) {
        _ if args.eagle_prompt_lookup => {
            if args.no_speculation {
                bail!("--eagle_prompt_lookup cannot be combined with --no_speculation");
            }
            if engine.plan.speculative_mode != SpeculativeMode::Eagle {
                bail!(
                    "--eagle_prompt_lookup grafts onto EAGLE trees, but {} was built with --speculative_decoding_mode {}",
                    engine.dir.display(),
                    engine.plan.speculative_mode.as_str()
                );
            }
            let mut mode = eagle_mode(&engine, &eagle_flags, false)?;
            if let DecodeMode::Eagle(options) = &mut mode {
                options.lookup = prompt_lookup;
            }
            mode
        }
        _ if prompt_lookup.is_some() => {
            if eagle_flags.any() || args.no_speculation {
                bail!("--prompt_lookup_config cannot be combined with --eagle_* flags or --no_speculation (--eagle_prompt_lookup grafts its drafts onto EAGLE's tree)");
            }
            DecodeMode::PromptLookup {
                lookup: prompt_lookup.expect("checked"),
                disable_by_batch_size: None,
            }
        }
        (Some(draft), Some(c)) => {
            if eagle_flags.any() || args.no_speculation {
                bail!("--draft_engine_dir cannot be combined with --eagle_* flags or --no_speculation");
            }
            DecodeMode::DraftTarget {
                draft,
                options: DraftTargetOptions {
                    draft_len: c.draft_len,
                    use_logits: c.use_logits,
                    disable_by_batch_size: None,
                },
            }
        }
        _ => eagle_mode(&engine, &eagle_flags, args.no_speculation)?,
    };
    disable_by_batch_size(&mut mode, args.speculative_disable_by_batch_size)?;
    if let DecodeMode::Eagle(options) = &mode {
        if options.disable_by_batch_size.is_none()
            && engine.plan.target_device == "cpu"
            && prompts.len() > 1
            && engine.plan.limits.max_batch_size > 1
        {
            eprintln!(
                "note: on a CPU, speculative steps of several sequences at once tend to cost more than they return (SmolLM2 with its head ran 0.83-0.88x plain decoding at batch 4 on 2 cores); --speculative_disable_by_batch_size 1 speculates only while one sequence decodes"
            );
        }
    }
    if let DecodeMode::Eagle(EagleOptions {
        tree: EagleTreeKind::Static(tree),
        ..
    }) = &mode
    {
        if eagle_flags.eagle_choices.is_none()
            && engine.eagle_choices.is_none()
            && engine.plan.target_device == "cpu"
            && tree.choices().len() > 8
        {
            eprintln!(
                "note: drafting TensorRT-LLM's default tree {DEFAULT_PRESET} ({} nodes): on a CPU every verified node costs about a decode step's multiply-adds, so this can run several times slower than --no_speculation; pass --eagle_choices, or build the engine with one (a tree `spec-train calibrate --step_costs` derives for this CPU)",
                tree.choices().len()
            );
        }
    }
    let mut printer = StreamPrinter::new(&codec, prompts.len());
    let sink: &mut dyn TokenSink = if args.streaming {
        &mut printer
    } else {
        &mut NoSink
    };
    let (outputs, timings) = generate_with(&engine, &mode, &prompts, &params, &kv_cache, sink)?;
    if args.streaming {
        printer.finish();
    }
    if let Some(why) = engine.cuda_graph_failure() {
        eprintln!("warning: CUDA graphs were turned off, steps ran eagerly: {why}");
    }
    print_outputs(&codec, &texts, &outputs)?;
    if let Some(note) =
        max_seq_len_note(&prompts, &outputs, &params, engine.plan.limits.max_seq_len)
    {
        eprintln!("{note}");
    }
    if args.run_profiling {
        Profile::new(&timings, &outputs).print();
    }
    if let Some(path) = &args.output_json {
        write_output_json(path, &codec, &texts, &prompts, &outputs, &timings)?;
    }
    Ok(())
}

/// A note when the engine's max_seq_len, not --max_output_len, ended answers (the runtime
/// stops a sequence at max_seq_len, as TensorRT-LLM does): how many, and the first. Told after
/// the run, so that it names only answers that were cut, not ones an end id ended sooner.
fn max_seq_len_note(
    prompts: &[Vec<u32>],
    outputs: &[SequenceOutput],
    params: &GenerationParams,
    max_seq_len: usize,
) -> Option<String> {
    let cut: Vec<usize> = (0..outputs.len())
        .filter(|&i| {
            outputs[i].finish_reason == FinishReason::Length
                && outputs[i].output_ids.len() < params.max_output_len
        })
        .collect();
    let &first = cut.first()?;
    let others = match cut.len() - 1 {
        0 => String::new(),
        1 => " (and 1 other input)".to_string(),
        n => format!(" (and {n} other inputs)"),
    };
    Some(format!(
        "note: input {first}{others} stopped at the engine's max_seq_len {max_seq_len} before --max_output_len {}: its {} prompt tokens left room for {} new tokens (rebuild with a larger --max_seq_len for more)",
        params.max_output_len,
        prompts[first].len(),
        outputs[first].output_ids.len()
    ))
}

fn main() {
    exit_on_error("spec-run", run(Args::parse()));
}

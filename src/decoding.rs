//! Turning spec-run's decoding flags into a [`DecodeMode`], with the conflicts named, and its
//! sampling flags into [`SamplingParams`] (spec-bench takes the same ones).

use anyhow::{bail, Context, Result};
use kestrel_core::plan::EAGLE_CHOICES_FILE;
use kestrel_core::SpeculativeMode;
use kestrel_runtime::{Acceptance, DecodeMode, EagleOptions, EagleTreeKind, Engine};
use kestrel_spec::tree::{TreeLimits, DEFAULT_MAX_TOP_K, DEFAULT_PRESET};
use kestrel_spec::{EagleTree, SamplingParams};
use std::path::Path;

/// How tokens are picked, as spec-run and spec-bench spell it.
#[derive(clap::Args, Debug, Clone)]
#[command(rename_all = "snake_case")]
pub struct SamplingFlags {
    /// 0 means greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus mass kept (1 disables top-p).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Seed of the sequences' random streams (sequence i of a request takes stream i).
    #[arg(long, default_value_t = 0)]
    pub random_seed: u64,
}

impl SamplingFlags {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.random_seed,
        }
    }
}

/// spec-run's EAGLE flags, as TensorRT-LLM's run.py spells them.
#[derive(Debug, Clone, Default)]
pub struct EagleFlags {
    /// A JSON list of paths, a preset name (configs/eagle_choices) or a JSON file.
    pub eagle_choices: Option<String>,
    pub eagle_posterior_threshold: Option<f32>,
    pub eagle_use_dynamic_tree: bool,
    pub eagle_dynamic_tree_max_top_k: Option<usize>,
    /// EAGLE-2 at run time: draft nodes kept and layers drafted, at most the engine's
    /// max_draft_len and num_eagle_layers (the default).
    pub eagle_dynamic_tree_max_draft_len: Option<usize>,
    pub eagle_dynamic_tree_num_layers: Option<usize>,
    /// EAGLE-2: nodes whose cumulative draft probability is below this are not drafted.
    pub eagle_dynamic_tree_min_prob: Option<f32>,
    /// token_match, typical or exact.
    pub eagle_sampling: Option<String>,
    /// Draft from the first N token ids only.
    pub eagle_draft_vocab: Option<usize>,
}

impl EagleFlags {
    /// Whether any EAGLE flag was given.
    pub fn any(&self) -> bool {
        self.eagle_choices.is_some()
            || self.eagle_posterior_threshold.is_some()
            || self.eagle_use_dynamic_tree
            || self.eagle_dynamic_tree_max_top_k.is_some()
            || self.eagle_dynamic_tree_max_draft_len.is_some()
            || self.eagle_dynamic_tree_num_layers.is_some()
            || self.eagle_dynamic_tree_min_prob.is_some()
            || self.eagle_sampling.is_some()
            || self.eagle_draft_vocab.is_some()
    }
}

/// The mode an engine runs in unless told otherwise: EAGLE engines speculate.
pub fn eagle_mode(engine: &Engine, flags: &EagleFlags, plain: bool) -> Result<DecodeMode<'static>> {
    let any_eagle_flag = flags.any();
    if plain {
        if any_eagle_flag {
            bail!("--no_speculation cannot be combined with --eagle_* flags");
        }
        return Ok(DecodeMode::Plain);
    }
    if engine.plan.speculative_mode != SpeculativeMode::Eagle {
        if any_eagle_flag {
            bail!(
                "--eagle_* flags need an EAGLE engine, but {} was built with --speculative_decoding_mode {}",
                engine.dir.display(),
                engine.plan.speculative_mode.as_str()
            );
        }
        return Ok(DecodeMode::Plain);
    }
    let acceptance = acceptance(flags)?;
    let limits = &engine.plan.limits;
    let tree = if flags.eagle_use_dynamic_tree {
        if flags.eagle_choices.is_some() {
            bail!("--eagle_choices cannot be combined with --eagle_use_dynamic_tree: EAGLE-2 builds its tree while decoding");
        }
        let top_k = flags
            .eagle_dynamic_tree_max_top_k
            .context("--eagle_use_dynamic_tree needs --eagle_dynamic_tree_max_top_k N")?;
        EagleTreeKind::Dynamic {
            top_k,
            max_draft_len: flags.eagle_dynamic_tree_max_draft_len,
            num_layers: flags.eagle_dynamic_tree_num_layers,
            min_prob: flags.eagle_dynamic_tree_min_prob.unwrap_or(0.0),
        }
    } else {
        for (flag, given) in [
            (
                "--eagle_dynamic_tree_max_top_k",
                flags.eagle_dynamic_tree_max_top_k,
            ),
            (
                "--eagle_dynamic_tree_max_draft_len",
                flags.eagle_dynamic_tree_max_draft_len,
            ),
            (
                "--eagle_dynamic_tree_num_layers",
                flags.eagle_dynamic_tree_num_layers,
            ),
        ] {
            if given.is_some() {
                bail!("{flag} needs --eagle_use_dynamic_tree");
            }
        }
        if flags.eagle_dynamic_tree_min_prob.is_some() {
            bail!("--eagle_dynamic_tree_min_prob needs --eagle_use_dynamic_tree");
        }
        let tree_limits = TreeLimits {
            num_eagle_layers: limits.num_eagle_layers,
            max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
            max_draft_len: limits.max_draft_len,
            max_top_k: DEFAULT_MAX_TOP_K,
        };
        let tree = match (&flags.eagle_choices, &engine.eagle_choices) {
            (Some(spec), _) => static_tree(spec, &tree_limits)?,
            (None, Some(json)) => EagleTree::from_json(json, &tree_limits).with_context(|| {
                format!(
                    "{}: the engine's default tree ({EAGLE_CHOICES_FILE}) does not fit its limits; rebuild the engine",
                    engine.dir.display()
                )
            })?,
            (None, None) => static_tree(DEFAULT_PRESET, &tree_limits)?,
        };
        EagleTreeKind::Static(tree)
    };
    Ok(DecodeMode::Eagle(EagleOptions {
        tree,
        acceptance,
        draft_vocab: flags.eagle_draft_vocab,
        lookup: None,
        disable_by_batch_size: None,
    }))
}

/// `--speculative_disable_by_batch_size N`: speculative steps of more than `n` sequences
/// draft nothing (vLLM's flag of that name), in every speculative mode.
pub fn disable_by_batch_size(mode: &mut DecodeMode, n: Option<usize>) -> Result<()> {
    let Some(n) = n else {
        return Ok(());
    };
    if n == 0 {
        bail!("--speculative_disable_by_batch_size 0 would never speculate: pass --no_speculation instead");
    }
    let limit = match mode {
        DecodeMode::Eagle(options) => &mut options.disable_by_batch_size,
        DecodeMode::DraftTarget { options, .. } => &mut options.disable_by_batch_size,
        DecodeMode::PromptLookup {
            disable_by_batch_size,
            ..
        } => disable_by_batch_size,
        DecodeMode::Plain => bail!(
            "--speculative_disable_by_batch_size applies to speculative decoding, which this run does not use"
        ),
    };
    *limit = Some(n);
    Ok(())
}

fn acceptance(flags: &EagleFlags) -> Result<Acceptance> {
    let named = flags.eagle_sampling.as_deref();
    match (named, flags.eagle_posterior_threshold) {
        (None | Some("typical"), Some(eps)) => {
            if !(eps > 0.0 && eps < 1.0) {
                bail!("--eagle_posterior_threshold {eps} must be in (0, 1) (TensorRT-LLM's default is 0.09)");
            }
            Ok(Acceptance::Typical { posterior_threshold: eps })
        }
        (Some("typical"), None) => bail!("--eagle_sampling typical needs --eagle_posterior_threshold ε"),
        (Some(other), Some(_)) => bail!(
            "--eagle_posterior_threshold selects typical acceptance and cannot be combined with --eagle_sampling {other}"
        ),
        (None | Some("token_match"), None) => Ok(Acceptance::TokenMatch),
        (Some("exact"), None) => Ok(Acceptance::Exact),
        (Some(other), None) => bail!("unknown --eagle_sampling '{other}': expected token_match, typical or exact"),
    }
}

/// A tree given as JSON paths, a preset name or a JSON file (`flag` names where it was given,
/// for the errors): the file's contents, anything else as given (trimmed).
pub fn tree_json(flag: &str, spec: &str) -> Result<String> {
    let trimmed = spec.trim();
    if trimmed.starts_with('[') || !(trimmed.ends_with(".json") || trimmed.contains('/')) {
        return Ok(trimmed.to_string());
    }
    if !Path::new(trimmed).is_file() {
        bail!("{flag}{trimmed}: no such file (give JSON paths, a preset name or an existing JSON file)");
    }
    std::fs::read_to_string(trimmed).with_context(|| format!("{flag}{trimmed}: cannot read it"))
}

/// `--eagle_choices`: JSON (`[[0], [1], …]`), a JSON file, or a preset name.
fn static_tree(spec: &str, limits: &TreeLimits) -> Result<EagleTree> {
    EagleTree::from_spec(&tree_json("--eagle_choices ", spec)?, limits).map_err(anyhow::Error::from)
}

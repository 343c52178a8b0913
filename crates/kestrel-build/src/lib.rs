//! `spec-build`: turns a converted checkpoint into an engine.
//!
//! An engine is a directory with the versioned plan (`plan.bin`, and `plan.json` for people),
//! the weights of every rank in the layout the runtime memory-maps, and the tokenizer files.
//! Building validates the limits against the model and the speculative mode, checks every
//! weight's name, dtype and shape, and records the kernel chosen for each op on the target
//! device. The same inputs give a byte-identical engine.

mod error;
mod kernels;
mod options;
mod weights;

pub use error::BuildError;
pub use kernels::{choose_kernels, TargetDevice};
pub use options::{AttentionKernel, BuildOptions, GemmPlugin, TENSOR_CORE_MAX_TREE};

use kestrel_core::checkpoint::{self, read_checkpoint_config};
use kestrel_core::plan::{BuildLimits, EnginePlan, PLAN_FILE, PLAN_JSON_FILE};
use kestrel_core::{AtomicDir, SpeculativeMode};
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// What a successful build produced.
#[derive(Debug)]
pub struct BuildSummary {
    pub output_dir: PathBuf,
    pub plan: EnginePlan,
}

pub fn build_engine(opts: &BuildOptions) -> Result<BuildSummary, BuildError> {
    let (model, meta) = read_checkpoint_config(&opts.checkpoint_dir)?;
    let limits = opts.limits(&model, &meta)?;
    let default_tree = opts
        .eagle_choices
        .as_deref()
        .map(|spec| default_tree(spec, opts.speculative_mode, &limits))
        .transpose()?;
    let kernels = choose_kernels(opts.target_device, meta.dtype, opts)?;

    let out = AtomicDir::new(&opts.output_dir).map_err(|e| BuildError::io(&opts.output_dir, e))?;
    let weights = weights::copy_rank_files(&opts.checkpoint_dir, out.path(), &model, &meta)?;
    // The tokenizer files, and an EAGLE head's draft vocabulary ranking.
    for name in [
        checkpoint::TOKENIZER_FILE,
        checkpoint::CHAT_TEMPLATE_FILE,
        kestrel_core::draft_vocab::DRAFT_VOCAB_FILE,
    ] {
        let src = opts.checkpoint_dir.join(name);
        if src.exists() {
            std::fs::copy(&src, out.path().join(name)).map_err(|e| BuildError::io(&src, e))?;
        }
    }

    let config_path = opts.checkpoint_dir.join(checkpoint::CONFIG_FILE);
    let config_bytes = std::fs::read(&config_path).map_err(|e| BuildError::io(&config_path, e))?;
    let plan = EnginePlan {
        model_config_json: serde_json::to_string(&model).expect("config serialises"),
        eagle_head_config_json: match (&meta.eagle, opts.speculative_mode) {
            (Some(eagle), SpeculativeMode::Eagle) => {
                Some(serde_json::to_string(&eagle.head_config).expect("head config serialises"))
            }
            _ => None,
        },
        dtype: meta.dtype,
        mapping: meta.mapping,
        limits,
        speculative_mode: opts.speculative_mode,
        target_device: opts.target_device.to_string(),
        kernels,
        weights,
        source_checkpoint_sha256: hex(&Sha256::digest(&config_bytes)),
    };
    if let Some(json) = &default_tree {
        write(
            &out,
            kestrel_core::plan::EAGLE_CHOICES_FILE,
            json.as_bytes(),
        )?;
    }
    write(&out, PLAN_FILE, &plan.to_bytes())?;
    write(&out, PLAN_JSON_FILE, plan.to_pretty_json().as_bytes())?;
    out.commit()
        .map_err(|e| BuildError::io(&opts.output_dir, e))?;
    Ok(BuildSummary {
        output_dir: opts.output_dir.clone(),
        plan,
    })
}

/// `--eagle_choices` (JSON paths or a preset name) validated against the engine's limits, as
/// the JSON paths `eagle_choices.json` holds.
fn default_tree(
    spec: &str,
    mode: SpeculativeMode,
    limits: &kestrel_core::plan::BuildLimits,
) -> Result<String, BuildError> {
    use kestrel_spec::tree::{TreeLimits, DEFAULT_MAX_TOP_K};
    use kestrel_spec::EagleTree;
    if mode != SpeculativeMode::Eagle {
        return Err(BuildError::option(format!(
            "--eagle_choices needs --speculative_decoding_mode eagle (this build is {}): only EAGLE engines draft trees",
            mode.as_str()
        )));
    }
    let tree_limits = TreeLimits {
        num_eagle_layers: limits.num_eagle_layers,
        max_non_leaves_per_layer: limits.max_non_leaves_per_layer,
        max_draft_len: limits.max_draft_len,
        max_top_k: DEFAULT_MAX_TOP_K,
    };
    let tree = EagleTree::from_spec(spec, &tree_limits)
        .map_err(|e| BuildError::option(format!("--eagle_choices: {e}")))?;
    Ok(serde_json::to_string(tree.choices()).expect("paths serialise"))
}

fn write(out: &AtomicDir, name: &str, bytes: &[u8]) -> Result<(), BuildError> {
    let path = out.path().join(name);
    std::fs::write(&path, bytes).map_err(|e| BuildError::io(&path, e))
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Re-exported so callers can name the limits type without depending on core directly.
pub type Limits = BuildLimits;

//! Loading an engine directory: plan, weights (on the chosen device), tokenizer, chat template.

use crate::chat::ChatTemplate;
use crate::error::{Result, RuntimeError};
use candle_core::Device;
use kestrel_core::checkpoint::{CHAT_TEMPLATE_FILE, EAGLE_PREFIX, TOKENIZER_FILE};
use kestrel_core::draft_vocab::{DraftVocabRanking, DRAFT_VOCAB_FILE};
use kestrel_core::plan::EAGLE_CHOICES_FILE;
use kestrel_core::{EagleHeadConfig, EnginePlan, ModelConfig, SpeculativeMode};
use kestrel_model::{CudaKernels, EagleHead, Llama};
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

pub struct Engine {
    pub dir: PathBuf,
    pub plan: EnginePlan,
    pub config: ModelConfig,
    pub model: Llama,
    pub eagle: Option<EagleHead>,
    /// Every token id, most frequent first in the head's training answers, when the engine
    /// carries a `draft_vocab.json` (`spec-train draft-vocab`): `--eagle_draft_vocab N`
    /// drafts from the first N of these rather than the first N ids.
    pub draft_vocab: Option<Vec<u32>>,
    /// The EAGLE-1 tree drafted when none is given, as JSON paths, when the engine was built
    /// with one (`spec-build --eagle_choices`, [`EAGLE_CHOICES_FILE`]).
    pub eagle_choices: Option<String>,
    pub device: Device,
    /// For [`Engine::self_draft`]'s copy, the directory of the engine whose weights it
    /// reads (at 4 bits, or skipping layers): on the same device the two share the KV cache
    /// in draft-target decoding (the copy's layers, heads and dtype are the engine's).
    pub derived_from: Option<PathBuf>,
    /// Whether plain decoding launches each step before the previous step's tokens reach
    /// the host, feeding it those tokens where they were picked (`plain.rs`): on by default
    /// on a GPU, where the host's work between steps then overlaps the device's; off on the
    /// CPU, where a step is finished when it returns and going ahead would only send each
    /// token to the caller one step later. The tokens are the same either way.
    pub launch_ahead: bool,
}

/// The tokenizer and chat template an engine (or `--tokenizer_dir`) carries.
pub struct TextCodec {
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
}

impl Engine {
    pub fn load(dir: &Path, device: &Device) -> Result<Self> {
        let plan = EnginePlan::load(dir)?;
        check_device(&plan, device)?;
        let config = plan.model_config()?;
        let rank_files: Vec<PathBuf> = plan.weights.iter().map(|w| dir.join(&w.file)).collect();
        for file in &rank_files {
            if !file.is_file() {
                return Err(RuntimeError::Engine(format!(
                    "{}: weight file is missing: the engine is incomplete; rebuild it with spec-build",
                    file.display()
                )));
            }
        }
        let mut model = Llama::load(&config, plan.mapping, &rank_files, plan.dtype, device)?;
        // The plan says which ops run Kestrel's CUDA kernels (ignored on CPU).
        let kernels = CudaKernels::from_choices(&plan.kernels);
        model.set_cuda_kernels(kernels);
        let eagle = match (&plan.eagle_head_config_json, plan.speculative_mode) {
            (Some(json), SpeculativeMode::Eagle) => {
                let head_cfg: EagleHeadConfig = serde_json::from_str(json).map_err(|e| {
                    RuntimeError::Engine(format!(
                        "{}: bad EAGLE head config in the plan: {e}",
                        dir.display()
                    ))
                })?;
                let mut head = load_eagle_head(&head_cfg, &plan, &rank_files, &model, device)?;
                head.set_cuda_kernels(kernels);
                Some(head)
            }
            _ => None,
        };
        let ranking = dir.join(DRAFT_VOCAB_FILE);
        let draft_vocab = if ranking.is_file() {
            let r = DraftVocabRanking::load(&ranking, config.vocab_size)
                .map_err(|e| RuntimeError::Engine(e.to_string()))?;
            Some(r.ids)
        } else {
            None
        };
        let tree_file = dir.join(EAGLE_CHOICES_FILE);
        let eagle_choices = if tree_file.is_file() {
            Some(std::fs::read_to_string(&tree_file).map_err(|e| {
                RuntimeError::Engine(format!("{}: cannot read it: {e}", tree_file.display()))
            })?)
        } else {
            None
        };
        let mut engine = Engine {
            dir: dir.to_path_buf(),
            plan,
            config,
            model,
            eagle,
            draft_vocab,
            eagle_choices,
            device: device.clone(),
            derived_from: None,
            launch_ahead: device.is_cuda(),
        };
        engine.set_cuda_graphs(true);
        Ok(engine)
    }

    /// Whether decode and tree steps replay CUDA graphs (on by default for a loaded engine;
    /// see [`Llama::set_cuda_graphs`]). Ignored off CUDA.
    pub fn set_cuda_graphs(&mut self, enabled: bool) {
        self.model.set_cuda_graphs(enabled);
        if let Some(head) = &mut self.eagle {
            head.set_cuda_graphs(enabled);
        }
    }

    /// What the step graphs of the model and the head have done since loading.
    pub fn cuda_graph_activity(&self) -> kestrel_model::GraphActivity {
        let model = self.model.cuda_graph_activity();
        match &self.eagle {
            Some(head) => model + head.cuda_graph_activity(),
            None => model,
        }
    }

    /// Device bytes the step graphs of the model and the head keep their activations in.
    pub fn cuda_graph_arena_bytes(&self) -> usize {
        self.model.cuda_graph_arena_bytes()
            + self
                .eagle
                .as_ref()
                .map_or(0, |h| h.cuda_graph_arena_bytes())
    }

    /// Why CUDA graphs were turned off after a failed capture (model or head), if they were.
    pub fn cuda_graph_failure(&self) -> Option<String> {
        self.model
            .cuda_graph_failure()
            .or_else(|| self.eagle.as_ref().and_then(|h| h.cuda_graph_failure()))
    }

    /// An engine over a model already in memory (benchmarks over random weights of a real
    /// model's shape, which would be tens of GB on disk). `plan` supplies the limits and must
    /// describe `model`'s configuration; `label` stands in for the directory in messages.
    /// Such an engine has no tokenizer and no draft head: it decodes token ids, plainly.
    pub fn from_model(label: &str, plan: EnginePlan, mut model: Llama) -> Result<Self> {
        let config = plan.model_config()?;
        if &config != model.config() {
            return Err(RuntimeError::Engine(format!(
                "{label}: the plan's model configuration does not match the model's"
            )));
        }
        model.set_cuda_graphs(true);
        Ok(Engine {
            dir: PathBuf::from(label),
            plan,
            config,
            device: model.device().clone(),
            launch_ahead: model.device().is_cuda(),
            model,
            eagle: None,
            draft_vocab: None,
            eagle_choices: None,
            derived_from: None,
        })
    }

    /// This engine's model as a draft for itself, sharing every weight with `self` but those
    /// `quantize` copies: with `quantize`, its decoder projections read at 4 bits and its LM
    /// head at 8 ([`Llama::with_quantized_draft_weights`]; CPU or CUDA); with `skip_layers`,
    /// the decoder layers it passes over ([`Llama::skipping_layers`]). The draft of
    /// draft-target decoding with no second model to train or load. Returns the draft and the
    /// bytes its quantized weights add.
    pub fn self_draft(&self, quantize: bool, skip_layers: &[usize]) -> Result<(Engine, usize)> {
        let mut model = self.model.skipping_layers(skip_layers)?;
        let mut bytes = 0;
        if quantize {
            (model, bytes) = model.with_quantized_draft_weights()?;
        }
        let what = match (quantize, skip_layers.len()) {
            (false, 0) => "itself as its draft".to_string(),
            (true, 0) => "4-bit draft".to_string(),
            (false, n) => format!("draft skipping {n} layers"),
            (true, n) => format!("4-bit draft skipping {n} layers"),
        };
        let label = format!("{} ({what})", self.dir.display());
        // A draft drafts nothing itself, whatever mode its target was built for.
        let mut plan = self.plan.clone();
        plan.speculative_mode = SpeculativeMode::None;
        plan.eagle_head_config_json = None;
        let mut draft = Engine::from_model(&label, plan, model)?;
        draft.derived_from = Some(self.dir.clone());
        Ok((draft, bytes))
    }

    /// Total KV-cache blocks for the engine's limits: every sequence of a full batch at
    /// max_seq_len plus one verification step of max_draft_len + 1 tokens.
    pub fn kv_blocks(&self) -> usize {
        let l = &self.plan.limits;
        let per_seq = (l.max_seq_len + l.max_draft_len + 1).div_ceil(l.tokens_per_block);
        l.max_batch_size * per_seq
    }
}

/// The head's tensors live in the rank files under "eagle."; a single-device run takes rank
/// 0's copy when the engine is not sharded.
fn load_eagle_head(
    head_cfg: &EagleHeadConfig,
    plan: &EnginePlan,
    rank_files: &[PathBuf],
    base: &Llama,
    device: &Device,
) -> Result<EagleHead> {
    if plan.mapping.tp_size != 1 {
        return Err(RuntimeError::Engine(
            "EAGLE engines with tp_size > 1 cannot run on a single device yet: build the EAGLE engine with --tp_size 1".into(),
        ));
    }
    let tensors = kestrel_model::unshard::load_prefixed(&rank_files[0], EAGLE_PREFIX)?;
    Ok(EagleHead::from_tensors(
        head_cfg, tensors, base, plan.dtype, device,
    )?)
}

fn check_device(plan: &EnginePlan, device: &Device) -> Result<()> {
    let on_cuda = device.is_cuda();
    let built_for_cuda = plan.target_device.starts_with("cuda");
    if on_cuda != built_for_cuda {
        let running = if on_cuda { "a CUDA device" } else { "the CPU" };
        return Err(RuntimeError::Engine(format!(
            "the engine was built for {} but is running on {running}: rebuild it with spec-build --target_device {}",
            plan.target_device,
            if on_cuda { "cuda:sm_XY" } else { "cpu" }
        )));
    }
    Ok(())
}

impl TextCodec {
    /// Reads `tokenizer.json` and `chat_template.jinja` from `dir`.
    pub fn load(dir: &Path, config: &ModelConfig) -> Result<Self> {
        let path = dir.join(TOKENIZER_FILE);
        let tokenizer = Tokenizer::from_file(&path).map_err(|e| {
            RuntimeError::Tokenizer(format!(
                "{}: cannot load the tokenizer ({e}): pass --tokenizer_dir with a tokenizer.json",
                path.display()
            ))
        })?;
        let template_path = dir.join(CHAT_TEMPLATE_FILE);
        let chat_template = if template_path.is_file() {
            let source = std::fs::read_to_string(&template_path).map_err(|e| {
                RuntimeError::Tokenizer(format!("{}: {e}", template_path.display()))
            })?;
            let token = |id: Option<u32>| {
                id.and_then(|id| tokenizer.id_to_token(id))
                    .unwrap_or_default()
            };
            let bos = token(config.bos_token_id);
            let eos = token(config.eos_token_ids().first().copied());
            Some(ChatTemplate::new(&source, &bos, &eos).map_err(|e| {
                RuntimeError::Tokenizer(format!("{}: {e}", template_path.display()))
            })?)
        } else {
            None
        };
        Ok(TextCodec {
            tokenizer,
            chat_template,
        })
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        // The chat template (or the user) supplies special tokens; HF's default for Llama
        // tokenizers converted from GGUF adds none either.
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| RuntimeError::Tokenizer(format!("cannot tokenize input: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.tokenizer
            .decode(ids, true)
            .map_err(|e| RuntimeError::Tokenizer(format!("cannot decode output: {e}")))
    }
}

#[cfg(test)]
mod tests {
    /// spec-build refuses trees the tensor-core attention cannot take by the kernel's own limit.
    #[test]
    fn tensor_core_tree_limit_is_the_kernels() {
        assert_eq!(
            kestrel_build::TENSOR_CORE_MAX_TREE,
            kestrel_kernels::TC_MAX_MASKED_NEW
        );
    }
}

//! The benchmark behind `spec-bench`: plain decoding against EAGLE-1 and EAGLE-2 on one
//! engine over a prompt set (MT-bench first turns by default), greedy, each mode run on the
//! same prompts in the same process.

use crate::decoding::{eagle_mode, EagleFlags};
use crate::prompts::read_prompt_file;
use anyhow::{bail, Context, Result};
use clap::Parser;
use kestrel_runtime::{
    generate, ChatMessage, DecodeMode, Engine, GenerationParams, NoSink, TextCodec,
};
use kestrel_spec::SamplingParams;
use serde::Serialize;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    name = "spec-bench",
    rename_all = "snake_case",
    version,
    about = "Benchmark plain and speculative decoding on one engine"
)]
pub struct BenchArgs {
    #[arg(long)]
    pub engine_dir: PathBuf,
    /// Prompt file (JSON/JSONL; MT-bench records use their first turn).
    #[arg(long, default_value = "../shared/data/mt_bench/question.jsonl")]
    pub prompts: PathBuf,
    #[arg(long, default_value_t = 8)]
    pub num_prompts: usize,
    #[arg(long, default_value_t = 128)]
    pub max_output_len: usize,
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Comma-separated: plain, eagle1[:TREE] (TREE = preset, JSON file), eagle2:N.
    #[arg(long, default_value = "plain,eagle1,eagle2:8")]
    pub modes: String,
    /// Apply the chat template to each prompt.
    #[arg(long, default_value_t = true)]
    pub chat: bool,
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long)]
    pub output_json: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
pub struct ModeResult {
    pub mode: String,
    pub generated_tokens: usize,
    pub seconds: f64,
    /// Tokens after each sequence's first, per second of decoding (prefill excluded).
    pub tokens_per_s: f64,
    /// Prompt tokens per second of prefill.
    pub prefill_tokens_per_s: f64,
    /// Tokens committed per target forward (τ; 1 for plain decoding).
    pub mean_accepted_len: f64,
    pub speedup_vs_plain: Option<f64>,
    pub draft_s: f64,
    pub verify_s: f64,
    pub prefill_s: f64,
    /// Whether the mode's greedy output equalled plain decoding's, when plain ran too.
    pub same_output_as_plain: Option<bool>,
}

#[derive(Debug, Serialize)]
pub struct BenchReport {
    pub engine_dir: PathBuf,
    pub device: String,
    pub num_prompts: usize,
    pub batch_size: usize,
    pub max_output_len: usize,
    pub results: Vec<ModeResult>,
}

fn mode_for(engine: &Engine, spec: &str) -> Result<DecodeMode<'static>> {
    let (name, arg) = spec.split_once(':').unwrap_or((spec, ""));
    let flags = match name {
        "plain" => return Ok(DecodeMode::Plain),
        "eagle1" => EagleFlags {
            eagle_choices: (!arg.is_empty()).then(|| arg.to_string()),
            ..EagleFlags::default()
        },
        "eagle2" => EagleFlags {
            eagle_use_dynamic_tree: true,
            eagle_dynamic_tree_max_top_k: Some(
                arg.parse()
                    .with_context(|| format!("--modes {spec}: eagle2 needs :N"))?,
            ),
            ..EagleFlags::default()
        },
        other => {
            bail!("unknown mode '{other}' in --modes: expected plain, eagle1[:TREE] or eagle2:N")
        }
    };
    eagle_mode(engine, &flags, false)
}

pub fn run_bench(args: &BenchArgs) -> Result<BenchReport> {
    let device = kestrel_runtime::device::parse(&args.device)?;
    let engine = Engine::load(&args.engine_dir, &device)?;
    let codec = TextCodec::load(&args.engine_dir, &engine.config)?;
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
    let params = GenerationParams {
        max_output_len: args.max_output_len,
        sampling: SamplingParams::greedy(),
        end_ids: engine.config.eos_token_ids(),
    };
    let mut results: Vec<ModeResult> = Vec::new();
    let mut plain: Option<(f64, Vec<Vec<u32>>)> = None;
    for spec in args
        .modes
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let mode = mode_for(&engine, spec)?;
        let (mut generated, mut seconds, mut steps_weighted) = (0usize, 0f64, 0f64);
        let (mut draft_s, mut verify_s, mut prefill_s) = (0f64, 0f64, 0f64);
        let mut outputs = Vec::new();
        for chunk in prompts.chunks(args.batch_size.max(1)) {
            let (outs, t) = generate(&engine, &mode, chunk, &params, &mut NoSink)?;
            generated += t.generated_tokens;
            seconds += t.total_s;
            draft_s += t.draft_s;
            verify_s += t.verify_s;
            prefill_s += t.prefill_s;
            for o in outs {
                steps_weighted += o.stats.tokens_per_step * o.stats.steps as f64;
                outputs.push(o);
            }
        }
        let steps: usize = outputs.iter().map(|o| o.stats.steps).sum();
        let ids: Vec<Vec<u32>> = outputs.iter().map(|o| o.output_ids.clone()).collect();
        let decoded = generated.saturating_sub(outputs.len());
        let tokens_per_s = decoded as f64 / (seconds - prefill_s).max(f64::EPSILON);
        let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
        let (speedup, same) = match &plain {
            Some((base, plain_ids)) => (Some(tokens_per_s / base), Some(&ids == plain_ids)),
            None => (None, None),
        };
        if spec == "plain" {
            plain = Some((tokens_per_s, ids));
        }
        results.push(ModeResult {
            mode: spec.to_string(),
            generated_tokens: generated,
            seconds,
            tokens_per_s,
            prefill_tokens_per_s: prompt_tokens as f64 / prefill_s.max(f64::EPSILON),
            mean_accepted_len: if steps == 0 {
                0.0
            } else {
                steps_weighted / steps as f64
            },
            speedup_vs_plain: speedup,
            draft_s,
            verify_s,
            prefill_s,
            same_output_as_plain: same,
        });
    }
    Ok(BenchReport {
        engine_dir: args.engine_dir.clone(),
        device: args.device.clone(),
        num_prompts: prompts.len(),
        batch_size: args.batch_size,
        max_output_len: args.max_output_len,
        results,
    })
}

impl BenchReport {
    pub fn print(&self) {
        println!(
            "spec-bench: {} prompts, batch {}, up to {} new tokens, greedy, device {}",
            self.num_prompts, self.batch_size, self.max_output_len, self.device
        );
        println!(
            "{:<22} {:>8} {:>9} {:>10} {:>10} {:>6} {:>9} {:>9} {:>6}",
            "mode",
            "tokens",
            "seconds",
            "decode t/s",
            "prefill t/s",
            "tau",
            "speedup",
            "draft s",
            "same"
        );
        for r in &self.results {
            println!(
                "{:<22} {:>8} {:>9.2} {:>10.2} {:>10.1} {:>6.2} {:>9} {:>9.2} {:>6}",
                r.mode,
                r.generated_tokens,
                r.seconds,
                r.tokens_per_s,
                r.prefill_tokens_per_s,
                r.mean_accepted_len,
                r.speedup_vs_plain
                    .map_or("-".into(), |s| format!("{s:.2}x")),
                r.draft_s,
                r.same_output_as_plain.map_or("-".into(), |s| s.to_string())
            );
        }
    }

    pub fn write_json(&self, path: &Path) -> Result<()> {
        let body = serde_json::to_string_pretty(self).expect("report serialises");
        std::fs::write(path, body)
            .with_context(|| format!("--output_json {}: cannot write it", path.display()))
    }
}

//! How spec-run shows results: console lines in run.py's style, streaming, profiling and the
//! `--output_json` file.

use anyhow::{Context, Result};
use kestrel_runtime::{RunTimings, SequenceOutput, TextCodec, TokenSink};
use serde_json::json;
use std::io::Write;
use std::path::Path;

/// Prints `Input [Text i]` / `Output [Text i Beam 0]` lines.
pub fn print_outputs(
    codec: &TextCodec,
    texts: &[String],
    outputs: &[SequenceOutput],
) -> Result<()> {
    for (i, (text, out)) in texts.iter().zip(outputs).enumerate() {
        println!("Input [Text {i}]: {:?}", text);
        println!(
            "Output [Text {i} Beam 0]: {:?}",
            codec.decode(&out.output_ids)?
        );
    }
    Ok(())
}

/// Streams decoded text as tokens are committed: the text of a single sequence inline, and
/// `[Text i] …` deltas for a batch.
pub struct StreamPrinter<'a> {
    codec: &'a TextCodec,
    ids: Vec<Vec<u32>>,
    printed: Vec<usize>,
}

impl<'a> StreamPrinter<'a> {
    pub fn new(codec: &'a TextCodec, n: usize) -> Self {
        StreamPrinter {
            codec,
            ids: vec![Vec::new(); n],
            printed: vec![0; n],
        }
    }

    pub fn finish(&mut self) {
        if self.ids.len() == 1 {
            println!();
        }
    }
}

impl TokenSink for StreamPrinter<'_> {
    fn on_tokens(&mut self, seq: usize, tokens: &[u32]) {
        if tokens.is_empty() {
            return;
        }
        self.ids[seq].extend_from_slice(tokens);
        let Ok(text) = self.codec.decode(&self.ids[seq]) else {
            return;
        };
        // Hold back an incomplete UTF-8 sequence (shown as U+FFFD) until the next token.
        if text.ends_with('\u{FFFD}') || text.len() < self.printed[seq] {
            return;
        }
        let delta = &text[self.printed[seq]..];
        self.printed[seq] = text.len();
        let mut out = std::io::stdout().lock();
        if self.ids.len() == 1 {
            let _ = write!(out, "{delta}");
        } else {
            let _ = writeln!(out, "[Text {seq}] {delta:?}");
        }
        let _ = out.flush();
    }
}

/// `--run_profiling` figures for a whole run.
pub struct Profile {
    pub tokens_per_s: f64,
    pub mean_ttft_s: f64,
    pub mean_tokens_per_step: f64,
    /// Draft tokens verified and accepted, over all sequences (0 without speculation).
    pub drafted: usize,
    pub accepted: usize,
    pub timings: RunTimings,
}

impl Profile {
    pub fn new(timings: &RunTimings, outputs: &[SequenceOutput]) -> Self {
        let n = outputs.len().max(1) as f64;
        let decode_s = (timings.total_s - timings.prefill_s).max(f64::EPSILON);
        let decode_tokens = timings.generated_tokens.saturating_sub(outputs.len());
        Profile {
            tokens_per_s: decode_tokens as f64 / decode_s,
            mean_ttft_s: outputs
                .iter()
                .map(|o| o.stats.time_to_first_token_s)
                .sum::<f64>()
                / n,
            mean_tokens_per_step: outputs.iter().map(|o| o.stats.tokens_per_step).sum::<f64>() / n,
            drafted: outputs.iter().map(|o| o.stats.draft_tokens).sum(),
            accepted: outputs.iter().map(|o| o.stats.accepted_draft_tokens).sum(),
            timings: timings.clone(),
        }
    }

    pub fn print(&self) {
        let t = &self.timings;
        let acceptance = match self.drafted {
            0 => String::new(),
            d => format!(
                " ({} of {d} draft tokens accepted, {:.0}%)",
                self.accepted,
                100.0 * self.accepted as f64 / d as f64
            ),
        };
        println!(
            "[profile] generated {} tokens in {:.3} s: {:.1} tokens/s after the first token; time to first token {:.1} ms; {:.2} tokens per step{acceptance}; draft {:.3} s, verify/decode {:.3} s, prefill {:.3} s",
            t.generated_tokens,
            t.total_s,
            self.tokens_per_s,
            self.mean_ttft_s * 1e3,
            self.mean_tokens_per_step,
            t.draft_s,
            t.verify_s,
            t.prefill_s
        );
        for pool in &t.kv_pools {
            println!(
                "[profile] KV cache {}: {} blocks of {} tokens; prompt tokens: {} prefilled, {} reused from cached blocks",
                pool.name,
                pool.blocks,
                pool.block_size,
                pool.prefilled_prompt_tokens,
                pool.reused_prompt_tokens
            );
        }
    }
}

/// Writes one record per input: texts, ids, finish reason and stats, plus the run's timings.
pub fn write_output_json(
    path: &Path,
    codec: &TextCodec,
    texts: &[String],
    prompts: &[Vec<u32>],
    outputs: &[SequenceOutput],
    timings: &RunTimings,
) -> Result<()> {
    let mut records = Vec::with_capacity(outputs.len());
    for ((text, ids), out) in texts.iter().zip(prompts).zip(outputs) {
        records.push(json!({
            "input_text": text,
            "input_ids": ids,
            "output_ids": out.output_ids,
            "output_text": codec.decode(&out.output_ids)?,
            "finish_reason": out.finish_reason,
            "stats": out.stats,
        }));
    }
    let profile = Profile::new(timings, outputs);
    let doc = json!({
        "outputs": records,
        "timings": timings,
        "tokens_per_s": profile.tokens_per_s,
    });
    let body = serde_json::to_string_pretty(&doc).expect("JSON prints");
    std::fs::write(path, body)
        .with_context(|| format!("--output_json {}: cannot write it", path.display()))
}

//! `spec-train calibrate`: a head's measured acceptance per tree depth and rank, and the best
//! static tree for a node budget: the longest, or with `--step_costs` the fastest.

use anyhow::{bail, Result};
use kestrel_runtime::{Engine, TextCodec};
use kestrel_spec::SamplingParams;
use kestrel_train::calibrate::{self, CalibrationSource, RankTable, TreeBudget};
use kestrel_train::distill::{distill, encode_prompts, DistillOptions};
use kestrel_train::prompts::read_prompts;
use kestrel_train::step_cost::StepCosts;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args, Debug)]
#[command(rename_all = "snake_case")]
pub struct CalibrateArgs {
    /// EAGLE engine directory (spec-build --speculative_decoding_mode eagle).
    #[arg(long)]
    engine_dir: PathBuf,
    /// Prompts: ShareGPT JSON, GSM8K JSONL, MT-bench JSONL, or a list of strings.
    #[arg(long, required_unless_present = "from_stats")]
    prompts: Option<PathBuf>,
    /// Derive the tree from the statistics an earlier calibration wrote (its .stats.json)
    /// instead of measuring again.
    #[arg(long, conflicts_with = "prompts")]
    from_stats: Option<PathBuf>,
    /// FIXED,LEVEL,NODE: what a speculative step costs beyond a plain decode step, in plain
    /// decode steps (whatever the tree; each draft level after the first; each draft node).
    /// The tree is then the one with the largest expected speedup, not the longest. Measure
    /// them with spec-bench (step_latency_ms of a few trees against plain decoding).
    #[arg(long)]
    step_costs: Option<String>,
    #[arg(long, default_value_t = 80)]
    num_prompts: usize,
    /// Longest prompt kept (tokens after the chat template); longer ones are skipped.
    #[arg(long, default_value_t = 256)]
    max_prompt_len: usize,
    /// Greedy answer tokens per prompt: the positions measured.
    #[arg(long, default_value_t = 128)]
    max_output_len: usize,
    /// Do not wrap prompts in the engine's chat template.
    #[arg(long)]
    no_chat: bool,
    /// Head candidates ranked per node (at most 10, spec-run's top-k).
    #[arg(long, default_value_t = calibrate::DEFAULT_TOP_K)]
    top_k: usize,
    /// Depths measured and deepest tree [default: 6, or the engine's num_eagle_layers if smaller].
    #[arg(long)]
    max_depth: Option<usize>,
    /// Draft nodes of the tree [default: 63, or the engine's max_draft_len if smaller].
    #[arg(long)]
    num_nodes: Option<usize>,
    /// The eagle_choices JSON to write (a .json file, replaced atomically).
    #[arg(long)]
    output: PathBuf,
    /// The measured statistics and expected lengths [default: <output>.stats.json].
    #[arg(long)]
    stats_output: Option<PathBuf>,
    /// cpu, or cuda:N (needs a build with the cuda feature).
    #[arg(long, default_value = "cpu")]
    device: String,
}

pub fn run_calibrate(args: &CalibrateArgs) -> Result<()> {
    // spec-run reads a bare name as a preset name, so the tree file must look like a file.
    if args.output.extension().and_then(|e| e.to_str()) != Some("json") {
        bail!(
            "--output {}: must end in .json (spec-run --eagle_choices reads other names as preset names)",
            args.output.display()
        );
    }
    let stats = args
        .stats_output
        .clone()
        .unwrap_or_else(|| calibrate::default_stats_path(&args.output));
    if stats == args.output {
        bail!(
            "--stats_output {} is the --output file: give the statistics another name",
            stats.display()
        );
    }
    let costs = args
        .step_costs
        .as_deref()
        .map(|t| StepCosts::parse("--step_costs", t))
        .transpose()?;
    let engine = Engine::load(
        &args.engine_dir,
        &kestrel_runtime::device::parse(&args.device)?,
    )?;
    if engine.eagle.is_none() {
        bail!(
            "{} has no EAGLE head: calibrate an engine built with spec-build --speculative_decoding_mode eagle",
            args.engine_dir.display()
        );
    }
    let limits = calibrate::engine_tree_limits(&engine.plan.limits);
    let (table, source, budget) = match &args.from_stats {
        Some(path) => {
            let report = calibrate::load_report(path)?;
            let table = RankTable::from_report(&report)?;
            if args.max_depth.is_some_and(|d| d > table.max_depth) {
                bail!(
                    "--max_depth {}: {} measured {} depths",
                    args.max_depth.unwrap_or(0),
                    path.display(),
                    table.max_depth
                );
            }
            let flags = calibrate::BudgetFlags {
                top_k: Some(table.top_k),
                max_depth: Some(args.max_depth.unwrap_or(table.max_depth)),
                num_nodes: args.num_nodes,
            };
            let budget = TreeBudget::resolve(&flags, &limits)?;
            (table, report.source, budget)
        }
        None => measure(args, &engine, &limits)?,
    };
    let name = args.output.display().to_string();
    let (choices, report) =
        calibrate::derive(&table, &budget, &limits, source, &name, costs.as_ref())?;
    calibrate::save(&args.output, &stats, &choices, &report)?;
    println!(
        "spec-train: {} positions in {} sequences; p(rank 0) per depth: {}",
        report.positions,
        report.sequences,
        report
            .p
            .iter()
            .map(|row| format!("{:.3}", row[0]))
            .collect::<Vec<_>>()
            .join(" ")
    );
    for s in std::iter::once(&report.tree).chain(&report.presets) {
        let expected = s
            .expected_length
            .map_or_else(|| "n/a".to_string(), |e| format!("{e:.3}"));
        let speedup = s
            .expected_speedup
            .map_or_else(String::new, |x| format!(", expected speedup {x:.3}"));
        let mut notes: Vec<String> = s.note.iter().cloned().collect();
        if !s.fits_engine {
            notes.push("does not fit this engine".into());
        }
        println!(
            "spec-train: expected tokens per step {expected:>6}{speedup} with {} ({} nodes, depth {}){}",
            s.name,
            s.nodes,
            s.depth,
            if notes.is_empty() {
                String::new()
            } else {
                format!(" [{}]", notes.join("; "))
            }
        );
    }
    println!(
        "spec-train: wrote {} ({} nodes; run it with spec-run --eagle_choices {}) and {}",
        args.output.display(),
        choices.len(),
        args.output.display(),
        stats.display()
    );
    Ok(())
}

/// Answers the prompts greedily and measures the head's ranks along the answers.
fn measure(
    args: &CalibrateArgs,
    engine: &Engine,
    limits: &kestrel_spec::tree::TreeLimits,
) -> Result<(RankTable, CalibrationSource, TreeBudget)> {
    let head = engine.eagle.as_ref().expect("checked by the caller");
    let prompts_file = args
        .prompts
        .as_ref()
        .expect("clap requires --prompts without --from_stats");
    let flags = calibrate::BudgetFlags {
        top_k: Some(args.top_k),
        max_depth: args.max_depth,
        num_nodes: args.num_nodes,
    };
    let budget = TreeBudget::resolve(&flags, limits)?;
    let codec = TextCodec::load(&args.engine_dir, &engine.config)?;
    let texts = read_prompts(prompts_file)?;
    let opts = DistillOptions {
        num_prompts: args.num_prompts,
        max_prompt_len: args.max_prompt_len,
        max_new_tokens: args.max_output_len,
        chat: !args.no_chat,
        sampling: SamplingParams::greedy(),
    };
    let prompts = encode_prompts(&codec, &texts, &opts, engine.plan.limits.max_input_len)?;
    eprintln!(
        "spec-train: calibrating on {} prompts from {}: top {} per node, depth {}, {} nodes",
        prompts.len(),
        prompts_file.display(),
        budget.top_k,
        budget.max_depth,
        budget.num_nodes
    );
    let t0 = Instant::now();
    let seqs = distill(engine, &prompts, &opts, &mut |done, total| {
        eprintln!(
            "spec-train: answered {done}/{total} [{:.0}s]",
            t0.elapsed().as_secs_f64()
        )
    })?;
    let table = calibrate::measure(
        &engine.model,
        head,
        &seqs,
        budget.top_k,
        budget.max_depth,
        engine.plan.limits.max_batch_size,
        &mut |done, total| {
            eprintln!(
                "spec-train: measured {done}/{total} [{:.0}s]",
                t0.elapsed().as_secs_f64()
            )
        },
    )?;
    let source = CalibrationSource {
        engine_dir: args.engine_dir.display().to_string(),
        prompts_file: prompts_file.display().to_string(),
        chat_template: !args.no_chat,
        num_prompts: prompts.len(),
        max_output_len: args.max_output_len,
    };
    Ok((table, source, budget))
}

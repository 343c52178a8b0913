//! `spec-bench`: decoding speed of an engine in each mode, measured in one run so the
//! ratios compare like with like.

use anyhow::Result;
use clap::Parser;
use kestrel::bench::{run_bench, BenchArgs};
use kestrel::cli::exit_on_error;

fn main() {
    exit_on_error("spec-bench", run(BenchArgs::parse()));
}

fn run(args: BenchArgs) -> Result<()> {
    let report = run_bench(&args)?;
    report.print();
    if let Some(path) = &args.output_json {
        report.write_json(path)?;
    }
    Ok(())
}

//! The `kestrel` package holds the thin command-line binaries; this library holds the little
//! they share (error reporting, prompt files, console and JSON reports), so that each binary
//! stays a flag parser over library calls.

pub mod bench;
pub mod cli;
pub mod decoding;
pub mod draft_config;
pub mod draft_engine;
pub mod kv_cache;
pub mod prompts;
pub mod report;

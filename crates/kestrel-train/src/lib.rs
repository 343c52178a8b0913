//! Training drafts for Kestrel engines.
//!
//! * [`distill`]: the base engine answers prompts through Kestrel's runtime (self-distillation).
//! * [`synthetic`]: user prompts the base model writes itself (Magpie), to answer in turn.
//! * [`dataset`]: the base model's final-normed hidden states over prompt + answer, cached on
//!   disk so that data generation and training can run as separate calls.
//! * [`eagle`]: trains an EAGLE-1 head (one decoder layer over `fc(cat(embed, feature))`) on
//!   that cache and writes it in the published EAGLE layout that
//!   `convert-checkpoint --eagle_model_dir` reads.
//! * [`calibrate`]: measures a head's acceptance per tree depth and rank on a prompt set and
//!   derives the static `eagle_choices` tree with the best expected accepted length for a
//!   node budget (`spec-train calibrate`).
//! * [`draft`]: distils a small draft model (the target's config with fewer layers, started
//!   from a subset of its layers) on the same data with KL to the target's distributions,
//!   and writes it as an HF model folder that `convert-checkpoint --model_dir` reads.
//! * [`common`]: what both trainers share (engine tensors, split, batches, schedule, clipping);
//!   `train_loop`: their shared epoch loop (step lines, epoch summaries, saving).

pub mod calibrate;
pub mod common;
pub mod dataset;
pub mod distill;
pub mod draft;
pub mod eagle;
pub mod error;
pub mod prompts;
pub mod step_cost;
pub mod synthetic;
mod train_loop;

pub use dataset::FeatureDataset;
pub use error::{Result, TrainError};

//! Training drafts for Kestrel engines.
//!
//! * [`distill`]: the base engine answers prompts through Kestrel's runtime (self-distillation).
//! * [`dataset`]: the base model's final-normed hidden states over prompt + answer, cached on
//!   disk so that data generation and training can run as separate calls.
//! * [`eagle`]: trains an EAGLE-1 head (one decoder layer over `fc(cat(embed, feature))`) on
//!   that cache and writes it in the published EAGLE layout that
//!   `convert-checkpoint --eagle_model_dir` reads.

pub mod dataset;
pub mod distill;
pub mod eagle;
pub mod error;
pub mod prompts;

pub use dataset::FeatureDataset;
pub use error::{Result, TrainError};

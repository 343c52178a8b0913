//! Kestrel's shared vocabulary.
//!
//! This crate knows nothing about tensors, devices or files of any checkpoint format: it
//! holds the plain data types that every other crate agrees on (the model configuration,
//! dtypes, the tensor-parallel mapping, the engine plan) and the rules that validate them.

pub mod atomic_dir;
pub mod checkpoint;
pub mod config;
pub mod draft_vocab;
pub mod dtype;
pub mod error;
pub mod layout;
pub mod mapping;
pub mod plan;

pub use atomic_dir::AtomicDir;
pub use config::{EagleHeadConfig, ModelConfig, RopeScaling};
pub use dtype::DType;
pub use error::{CoreError, Result};
pub use mapping::{Mapping, ShardDim};
pub use plan::{EnginePlan, KernelChoice, SpeculativeMode};

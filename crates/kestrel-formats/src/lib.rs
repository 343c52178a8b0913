//! Checkpoint readers: everything Kestrel reads that it did not write itself.
//!
//! Each reader yields the same in-memory form, [`LoadedCheckpoint`]: a validated
//! [`ModelConfig`], tensors on the CPU under Hugging Face names, and the tokenizer and chat
//! template when the source has them.
//!
//! * [`load_hf_dir`]: an HF directory with `config.json` and `model.safetensors`, sharded
//!   `*.safetensors` (with `model.safetensors.index.json`), or `pytorch_model.bin` (read by
//!   candle's safe unpickler, which executes no code).
//! * [`load_gguf`]: a llama.cpp GGUF file of the `llama` architecture; tensors are dequantised to
//!   f32, renamed to HF names, and llama.cpp's Q/K row permutation is undone. The configuration,
//!   tokenizer and chat template come from the GGUF metadata.
//! * [`load_eagle_head`]: an EAGLE-1/2 draft head directory.
//!
//! Every tensor's shape is checked against the configuration ([`expected_shapes`]), so a
//! mismatched or incomplete checkpoint is refused with a message naming the tensor.

mod checkpoint;
mod eagle;
mod error;
mod gguf;
mod gguf_tokenizer;
mod hf;

pub use checkpoint::{check_tensors, expected_shapes, LoadedCheckpoint};
pub use eagle::{eagle_expected_shapes, eagle_head_files, load_eagle_head};
pub use error::FormatError;
pub use gguf::load_gguf;
pub use hf::load_hf_dir;

/// Loads a tokenizer saved in HF's `tokenizer.json` format.
pub fn load_tokenizer(path: &std::path::Path) -> Result<tokenizers::Tokenizer, FormatError> {
    hf::read_tokenizer(path)
}

/// The tensor library the loaded tensors belong to, re-exported so that users need not pin it.
pub use candle_core;
/// The tokenizer library of [`LoadedCheckpoint::tokenizer`], re-exported likewise.
pub use tokenizers;

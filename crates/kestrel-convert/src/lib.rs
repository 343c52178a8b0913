//! convert-checkpoint: an HF or GGUF Llama checkpoint (plus, optionally, an EAGLE head) to
//! Kestrel's checkpoint directory.
//!
//! The output holds `config.json` (the HF config fields plus a `"kestrel"` object, see
//! [`meta::CheckpointMeta`]), one `rank{N}.safetensors` per tensor-parallel rank with HF
//! tensor names sliced per [`kestrel_core::Mapping`] and cast to the requested dtype (the EAGLE
//! head's tensors stored under `eagle.`), and `tokenizer.json` / `chat_template.jinja` when the
//! source has them. The directory is written next to its destination and renamed into place,
//! so a failed run leaves nothing behind, and the same inputs give byte-identical files.

pub mod convert;
pub mod error;
pub mod meta;

pub use convert::{
    convert, shard_tensor, ConvertOptions, ConvertSummary, EagleOptions, Source, MAX_DRAFT_LEN,
};
pub use error::ConvertError;
pub use meta::{read_checkpoint_config, CheckpointMeta, EagleMeta, SourceFile, EAGLE_PREFIX};

//! The checkpoint directory's contract, which lives in kestrel-core so that spec-build reads
//! exactly what convert-checkpoint writes; re-exported here for convenience.

pub use kestrel_core::checkpoint::{
    checkpoint_config_json, rank_file_name, read_checkpoint_config, CheckpointMeta, EagleMeta,
    SourceFile, CHAT_TEMPLATE_FILE, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, CONFIG_FILE,
    EAGLE_PREFIX, TOKENIZER_FILE,
};

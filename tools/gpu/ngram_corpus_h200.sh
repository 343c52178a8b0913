#!/usr/bin/env bash
# Makes heads/smollm2-ngram/corpus.safetensors on the H200: SmolLM2 (bf16, a plain engine for
# batches of 64) answers the 3,500 prompts of tools/corpus_prompts.py greedily, 256 tokens
# at most, with the chat template; spec-train ngram-corpus turns the report into the corpus.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with BINS="spec-run convert-checkpoint spec-build spec-train",
# then python3 tools/corpus_prompts.py ../shared/data .device/gpu/c/corpus_prompts.jsonl):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/ngram_corpus_h200.sh
# Result: $OUT/corpus.safetensors (copy it to heads/smollm2-ngram/).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/corpus; mkdir -p $E
$B/convert-checkpoint --gguf $S/smol.gguf --output_dir $E/ckpt --dtype bfloat16 --workers 16 > /dev/null
$B/spec-build --checkpoint_dir $E/ckpt --output_dir $E/eng --target_device cuda:sm_90 \
  --max_batch_size 64 --max_input_len 2048 --max_seq_len 2560 > /dev/null
$B/spec-run --engine_dir $E/eng --device cuda:0 --input_file $S/corpus_prompts.jsonl --chat \
  --max_output_len 256 --output_json $E/answers.json > /dev/null
$B/spec-train ngram-corpus --from_outputs $E/answers.json --output "$OUT/corpus.safetensors"

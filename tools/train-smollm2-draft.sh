#!/usr/bin/env bash
# Reproduces the SmolLM2-135M-Instruct draft model measured in the kestrel-train notes: a
# 4-layer draft (target layers 0, 10, 20, 29 to start) distilled with KL on 128 self-distilled
# ShareGPT answers, then draft-target decoding against plain decoding on 8 MT-bench prompts.
# The draft (42 M parameters, 85 MB in float16) is not shipped: this script is the recipe.
# CPU times on a 2-core machine: data about 25 min (skipped when $WORK/data holds some),
# training about 12 min, the two spec-run calls about 5 min.
# Usage: bash tools/train-smollm2-draft.sh   (KESTREL_WORK_DIR, KESTREL_SHARED override paths)
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${KESTREL_WORK_DIR:-work}
SHARED=${KESTREL_SHARED:-../shared}
bash tools/fetch-smollm2.sh
cargo build --release --bin convert-checkpoint --bin spec-build --bin spec-run --bin spec-train
B=target/release
"$B/convert-checkpoint" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --output_dir "$WORK/smollm2-ckpt" --dtype float32
# One target engine serves both: plain decoding makes the data, draft-target verifies drafts.
"$B/spec-build" --checkpoint_dir "$WORK/smollm2-ckpt" --output_dir "$WORK/smollm2-target" \
  --speculative_decoding_mode draft_tokens_external --max_draft_len 5 \
  --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048
"$B/spec-train" draft --engine_dir "$WORK/smollm2-target" --data_dir "$WORK/data" \
  --prompts "$SHARED/data/sharegpt/ShareGPT_V3_filtered_1000.json" \
  --num_prompts 128 --max_prompt_len 192 --max_new_tokens 64 \
  --num_layers 4 --epochs 4 --lr 1e-3 --dtype float32 --output_dir "$WORK/smollm2-draft-hf"
"$B/convert-checkpoint" --model_dir "$WORK/smollm2-draft-hf" \
  --output_dir "$WORK/smollm2-draft-ckpt" --dtype float32
"$B/spec-build" --checkpoint_dir "$WORK/smollm2-draft-ckpt" --output_dir "$WORK/smollm2-draft" \
  --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048
head -8 "$SHARED/data/mt_bench/question.jsonl" > "$WORK/mt8.jsonl"
echo "== plain decoding"
"$B/spec-run" --engine_dir "$WORK/smollm2-target" --input_file "$WORK/mt8.jsonl" --chat \
  --max_output_len 64 --run_profiling --output_json "$WORK/plain.json" | grep profile
echo "== draft-target, 2 draft tokens per step (greedy: the same tokens as plain)"
"$B/spec-run" --engine_dir "$WORK/smollm2-target" --draft_engine_dir "$WORK/smollm2-draft" \
  --draft_target_model_config "[2,[cpu],[cpu],False]" --input_file "$WORK/mt8.jsonl" --chat \
  --max_output_len 64 --run_profiling --output_json "$WORK/draft-target.json" | grep profile

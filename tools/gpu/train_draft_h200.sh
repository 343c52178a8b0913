#!/usr/bin/env bash
# Distils SmolLM2's draft model on the H200 from the self-distillation data that
# `train_eagle_h200.sh data` left in /tmp/data, then measures draft-target decoding; calls made
# back to back after staging (see train_eagle_h200.sh):
#   bash tools/gpu/train_draft_h200.sh train   # /tmp/draft-hf (resumed if present) -> $OUT/draft_log.json
#   bash tools/gpu/train_draft_h200.sh eval    # draft-target at DRAFT_LENS vs plain: tau and tok/s -> $OUT
# Knobs (environment): LAYERS (4), EPOCHS, LR, TRAIN_S (time limit of a train call), EVAL_N,
# DRAFT_LENS ("2 4 6").
set -euo pipefail
B=/tmp/bin; S=/tmp/stage
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=$1

case $stage in
train)
  resume=(); [ -f /tmp/draft-hf/train_log.json ] && resume=(--resume)
  timeout "${TRAIN_S:-540}" $B/spec-train draft --engine_dir /tmp/eng --device cuda:0 \
    --data_dir /tmp/data --output_dir /tmp/draft-hf "${resume[@]}" --num_layers "${LAYERS:-4}" \
    --epochs "${EPOCHS:-6}" --lr "${LR:-1e-3}" --batch_size 32 --max_len 768 --logits_chunk 4096 \
    --dtype float32 2>&1 | grep -E "epoch|held-out|saved|layer draft" || true
  cp /tmp/draft-hf/train_log.json "$OUT/draft_log.json"
  ;;
eval)
  [ -d /tmp/ckpt ] || $B/convert-checkpoint --gguf $S/smol.gguf --output_dir /tmp/ckpt --dtype float32 --workers 16
  $B/spec-build --checkpoint_dir /tmp/ckpt --output_dir /tmp/eng_t --target_device cuda:sm_90 \
    --speculative_decoding_mode draft_tokens_external --max_draft_len 8 \
    --max_batch_size 1 --max_input_len 1024 --max_seq_len 2048
  $B/convert-checkpoint --model_dir /tmp/draft-hf --output_dir /tmp/ckpt_d --dtype float32
  $B/spec-build --checkpoint_dir /tmp/ckpt_d --output_dir /tmp/eng_d --target_device cuda:sm_90 \
    --max_batch_size 1 --max_input_len 1024 --max_seq_len 2048
  P=/tmp/eval_prompts.jsonl; head -"${EVAL_N:-10}" tools/gpu/mt_bench_first20.jsonl > $P
  $B/spec-run --engine_dir /tmp/eng_t --device cuda:0 --input_text hi --max_output_len 4 >/dev/null
  run() { local name=$1; shift; echo "== $name"
    $B/spec-run --engine_dir /tmp/eng_t --device cuda:0 --chat --input_file $P --max_output_len 128 \
      --run_profiling --output_json "$OUT/$name.json" "$@" | grep profile || true; }
  run plain
  for k in ${DRAFT_LENS:-2 4 6}; do
    run "draft_target_k$k" --draft_engine_dir /tmp/eng_d --draft_target_model_config "[$k,[0],[0],False]"
  done
  python3 tools/gpu/compare_modes.py "$OUT"
  ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac

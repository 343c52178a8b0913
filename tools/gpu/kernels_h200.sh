#!/usr/bin/env bash
# Kestrel's CUDA kernels on the H200 (issue 6): their GPU tests, then spec-bench with the
# kernels against candle ops in one process each, on the SmolLM2 EAGLE engine that
# `train_eagle_h200.sh eval` built (/tmp/eng_e) and on the random-weight Llama-2-7B shape.
#   bash tools/gpu/kernels_h200.sh test    # /tmp/bin/{gpu,cuda}-test (staged like the binaries)
#   bash tools/gpu/kernels_h200.sh bench   # -> $OUT/kernels_{none,all}.json, $OUT/llama2_{none,all}.json
# Build the test binaries here with
#   cargo test --release --features cuda --no-run -p kestrel -p kestrel-kernels -p kestrel-model --test gpu --test cuda
# (-p kestrel keeps candle's feature set, so its compiled kernels are reused) and xz them
# into a carry folder as gpu-test.xz / cuda-test.xz.
set -euo pipefail
B=/tmp/bin
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
case $1 in
test)
  $B/gpu-test --test-threads 1 2>&1 | tail -25
  $B/cuda-test --test-threads 1 2>&1 | tail -12
  ;;
bench)
  for k in none all; do
    echo "== SmolLM2 f32, kernels: $k"
    $B/spec-bench --engine_dir /tmp/eng_e --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
      --num_prompts "${EVAL_N:-10}" --max_output_len 128 --batch_sizes 1 \
      --modes plain,eagle1:small_8,eagle2:10 --cuda_kernels $k --output_json "$OUT/kernels_$k.json" 2>&1 | tail -6
  done
  for k in none all; do
    echo "== random Llama-2-7B bf16, kernels: $k"
    $B/spec-bench --random_weights llama2-7b --dtype bfloat16 --device cuda:0 --prompt_len 128 \
      --max_output_len 64 --num_prompts 4 --batch_sizes 1,4 --modes plain,verify:64 \
      --cuda_kernels $k --output_json "$OUT/llama2_$k.json" 2>&1 | tail -6
  done
  ;;
*) echo "usage: kernels_h200.sh test|bench" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Nsight Compute detail (speed of light, memory, warp stalls, occupancy) of one launch of a
# few hot kernels, eager, random weights, bf16: decode attention on SmolLM2 and Llama-2-7B,
# the tiled gemv on a Llama-2-7B verification of 4 x 64 rows, the one-row gemv in a decode.
#   bash tools/gpu/ncu_detail.sh   # -> $OUT/ncu_<name>.txt, key lines printed
set -u
source "$(dirname "$0")/session-env.sh"
run() { # name kernel-regex launches-to-skip command...
  local name=$1 k=$2 skip=$3; shift 3
  timeout 100 env "$@" > /dev/null 2>&1 # warm the JIT cache
  ncu_detail "$name" "$k" "$skip" "$@"
}
SB="$B/spec-bench --device cuda:0 --dtype bfloat16 --prompt_len 128 --max_output_len 32 --num_prompts 1 --no_cuda_graphs --copy_bytes 1048576 --warmup_tokens 0"
run smol_attn paged_attention 300 $SB --random_weights smollm2-135m --modes plain --batch_sizes 1
run llama_attn paged_attention 300 $SB --random_weights llama2-7b --modes plain --batch_sizes 1
run llama_tiled gemv_tiled 40 $SB --random_weights llama2-7b --modes verify:64 --batch_sizes 4
run llama_gemv_decode "kestrel_gemv_bf16" 300 $SB --random_weights llama2-7b --modes plain --batch_sizes 1

#!/usr/bin/env bash
# Nsight Compute detail (speed of light, memory, warp stalls, occupancy) of one launch of a
# few hot kernels, eager, random weights, bf16: decode attention on SmolLM2 and Llama-2-7B,
# the tiled gemv on a Llama-2-7B verification of 4 x 64 rows, the one-row gemv in a decode.
#   bash tools/gpu/ncu_detail.sh   # -> $OUT/ncu_<name>.txt, key lines printed
set -u
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
B=/tmp/bin; OUT=${OUT:-/tmp/out}; mkdir -p $OUT
NCU=/usr/local/cuda/bin/ncu
SEC="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats"
run() { # name kernel-regex launches-to-skip command...
  local name=$1 k=$2 skip=$3; shift 3
  timeout 100 env "$@" > /dev/null 2>&1 # warm the JIT cache
  timeout 120 $NCU $SEC --kernel-name regex:$k --launch-skip $skip --launch-count 1 env "$@" > $OUT/ncu_$name.txt 2>&1
  echo "=== $name"; grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Issued Warp|No Eligible|One or More|Theoretical Occ|Dynamic Shared|Waves Per SM|Grid Size|Block Size" $OUT/ncu_$name.txt | head -40
}
SB="$B/spec-bench --device cuda:0 --dtype bfloat16 --prompt_len 128 --max_output_len 32 --num_prompts 1 --no_cuda_graphs --copy_bytes 1048576 --warmup_tokens 0"
run smol_attn paged_attention 300 $SB --random_weights smollm2-135m --modes plain --batch_sizes 1
run llama_attn paged_attention 300 $SB --random_weights llama2-7b --modes plain --batch_sizes 1
run llama_tiled gemv_tiled 40 $SB --random_weights llama2-7b --modes verify:64 --batch_sizes 4
run llama_gemv_decode "kestrel_gemv_bf16" 300 $SB --random_weights llama2-7b --modes plain --batch_sizes 1

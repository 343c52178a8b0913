# Sourced by tools/gpu scripts on the GPU machine: B and S (the binaries and files
# tools/gpu/stage.sh put in /tmp), the CUDA 13 libraries (device-env.sh), the driver's JIT
# cache, OUT (the device tool's folder, or /tmp/out), and run_gpu_tests.
B=/tmp/bin; S=/tmp/stage
source "$(dirname "${BASH_SOURCE[0]}")/device-env.sh"
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# The staged GPU test binaries (kestrel-kernels' tests/gpu.rs, kestrel-model's tests/cuda.rs),
# one test at a time; each test's line and the totals.
run_gpu_tests() {
  for t in kernels-gpu model-cuda; do
    echo "== $t"; $B/$t --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED" | tail -40
  done
}

# smollm2_engine DTYPE MODE DIR [HEAD]: SmolLM2 from the staged GGUF (+ the EAGLE head at
# HEAD) built for the H200, batches up to $MAX_BATCH (default 4); the checkpoint goes to DIR.ckpt.
smollm2_engine() {
  local head=(); [ -n "${4:-}" ] && head=(--eagle_model_dir "$4" --max_draft_len 63 --num_eagle_layers 6 --max_non_leaves_per_layer 10)
  $B/convert-checkpoint --gguf $S/smol.gguf "${head[@]}" --output_dir "$3.ckpt" --dtype "$1" --workers 16 > /dev/null &&
    $B/spec-build --checkpoint_dir "$3.ckpt" --output_dir "$3" --target_device cuda:sm_90 \
      --speculative_decoding_mode "$2" --max_batch_size "${MAX_BATCH:-4}" --max_input_len 1024 --max_seq_len 2048 > /dev/null ||
    { echo "engine $3 failed"; exit 1; }
}

# ncu_detail NAME KERNEL_REGEX SKIP COMMAND...: Nsight Compute's detail sections (speed of
# light, memory, warp states, occupancy, launch, scheduler) of the first launch of a kernel
# matching KERNEL_REGEX after SKIP such launches, into $OUT/ncu_NAME.txt; its key lines printed.
NCU=/usr/local/cuda/bin/ncu
ncu_detail() {
  local name=$1 k=$2 skip=$3; shift 3
  timeout 200 $NCU --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    --kernel-name regex:$k --launch-skip $skip --launch-count 1 env "$@" > $OUT/ncu_$name.txt 2>&1
  echo "=== $name"
  grep -E "Duration|Memory Throughput|DRAM Throughput|L2 Cache Throughput|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Issued Warp|No Eligible|One or More|Theoretical Occ|Dynamic Shared|Waves Per SM|Grid Size|Block Size" \
    $OUT/ncu_$name.txt | head -40
}

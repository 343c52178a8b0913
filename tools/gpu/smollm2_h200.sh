#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the H200: convert the Q4_1 GGUF (f32 and bf16), build CUDA
# engines, time plain greedy decoding at batch 1 and save output ids for the CPU comparison.
#
# The GGUF (98 MB) and the binaries do not fit in one device call (64 MiB, the working tree
# included): pack them here with tools/gpu/pack.sh, then make four back-to-back calls (the
# machine keeps /tmp for 30 s after a call):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/smollm2_h200.sh
# Results land in $OUT.
set -uo pipefail
STAGE=/tmp/stage
B=/tmp/bin
here=$(cd "$(dirname "$0")" && pwd)
timed() { # label cmd...: runs cmd, prints "label N.NN s"
  local label=$1; shift; local t0; t0=$(date +%s.%N)
  "$@"; local rc=$?
  echo "$label $(python3 -c "print(round($(date +%s.%N)-$t0,2))") s (rc $rc)"
  return $rc
}
[ -x $B/spec-run ] && [ -f $STAGE/smol.gguf ] || { echo "stage the binaries and the GGUF first (see the header)" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
source "$here/device-env.sh"
export CUDA_CACHE_PATH=/tmp/cuda-cache
ldd $B/spec-run | grep -E 'cuda|cublas|curand|not found'

P=tools/gpu
R=/tmp/res   # only 8 files come back from $OUT: results are tarred there at the end
mkdir -p $R
for dt in float32 bfloat16; do
  timed "convert $dt" $B/convert-checkpoint --gguf "$STAGE/smol.gguf" \
    --output_dir /tmp/ckpt_$dt --dtype $dt --workers 16 || exit 1
  timed "build $dt" $B/spec-build --checkpoint_dir /tmp/ckpt_$dt \
    --output_dir /tmp/eng_$dt --target_device cuda:sm_90 --max_batch_size 1 || exit 1
done
timed "build bf16 b16" $B/spec-build --checkpoint_dir /tmp/ckpt_bfloat16 \
  --output_dir /tmp/eng_bf16_b16 --target_device cuda:sm_90 --max_batch_size 16 || exit 1

# JIT warm-up (candle's PTX is compiled by the driver on first use; cached in CUDA_CACHE_PATH).
timed warmup $B/spec-run --engine_dir /tmp/eng_float32 --device cuda:0 \
  --input_text "Hello" --max_output_len 4 --run_profiling | tail -2

run() { # name engine extra-args...
  local name=$1 eng=$2; shift 2
  echo "=== $name"
  $B/spec-run --engine_dir "$eng" --device cuda:0 --chat --run_profiling \
    --output_json "$R/$name.json" "$@" > "$R/$name.log" 2>&1
  echo "rc=$?"; grep '\[profile\]' "$R/$name.log"; tail -c 600 "$R/$name.log" | grep -v '^\[profile\]' | tail -3
}
nvidia-smi dmon -s uc -d 1 > "$R/dmon.txt" 2>&1 &
DMON=$!
run gpu_f32_q81 /tmp/eng_float32 --input_file $P/mt_bench_q81.jsonl --max_output_len 256
run gpu_bf16_q81 /tmp/eng_bfloat16 --input_file $P/mt_bench_q81.jsonl --max_output_len 256
run gpu_f32_first20 /tmp/eng_float32 --input_file $P/mt_bench_first20.jsonl --max_output_len 256
run gpu_bf16_first20 /tmp/eng_bfloat16 --input_file $P/mt_bench_first20.jsonl --max_output_len 256
run gpu_bf16_first20_b16 /tmp/eng_bf16_b16 --input_file $P/mt_bench_first20.jsonl --max_output_len 256
run gpu_f32_q120_32 /tmp/eng_float32 --input_file $P/mt_bench_q120.jsonl --max_output_len 32
kill $DMON 2>/dev/null

# Per-kernel GPU time of a few decode steps (ncu, kernel durations only), to split a step's
# wall time into GPU work and host/launch overhead.
NCUBIN=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
if [ -n "$NCUBIN" ] && [ "${NCU:-1}" = 1 ]; then
  echo "=== ncu ($NCUBIN)"
  timeout 200 "$NCUBIN" --clock-control none --metrics gpu__time_duration.sum --csv \
    --launch-skip ${NCU_SKIP:-6000} --launch-count ${NCU_COUNT:-1500} \
    $B/spec-run --engine_dir /tmp/eng_float32 --device cuda:0 --chat \
    --input_file $P/mt_bench_q81.jsonl --max_output_len 40 > "$R/ncu_f32.csv" 2> "$R/ncu_f32.err"
  echo "ncu rc=$? lines=$(wc -l < "$R/ncu_f32.csv")"
  tail -3 "$R/ncu_f32.err"
fi
tar czf "$OUT/results.tar.gz" -C /tmp res && echo "done: $OUT/results.tar.gz"

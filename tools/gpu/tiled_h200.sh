#!/usr/bin/env bash
# The tiled tensor-core gemv (many-row steps: tree verification, batched prefill) on the H200:
# the GPU tests, then plain decoding and T-token verification of random SmolLM2 and
# Llama-2-7B shapes with this build's spec-bench and a baseline build's (BASE=, default
# spec-bench-base), and this build again with the chain split forced to each of 1, 2, 4 and
# 8 (KESTREL_GEMV_TILED_GROUPS, GROUPS_TRIED) and the tiled engine's row threshold set to
# each of MIN_ROWS_TRIED (KESTREL_GEMV_TILED_MIN_ROWS), so every ratio is read from one call.
# Staging: one carry folder .device/gpu/t holding spec-bench.xz, spec-bench-base.xz and the
# test binaries kernels-gpu.xz, model-cuda.xz (`cargo test --release --features cuda
# --no-run -p kestrel-kernels -p kestrel-model --test gpu --test cuda`, renamed); no GGUF:
#   carry [".device/gpu/t"]: bash tools/gpu/stage.sh t && bash tools/gpu/tiled_h200.sh tests bench
#   bash tools/gpu/tiled_h200.sh profile   # Nsight Compute kernel times (SHAPE, SKIP, COUNT)
# Results: $OUT/*.json and summary.txt (tools/gpu/tiled_summary.py).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
BASE=${BASE-spec-bench-base}
SHAPES=${SHAPES:-llama2-7b smollm2-135m}
MODES=${MODES:-plain,verify:16,verify:32,verify:64}
GROUPS_TRIED=${GROUPS_TRIED-1 2 8}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

bench() { # tag binary args...
  local tag=$1 bin=$2; shift 2
  $B/$bin --device cuda:0 "$@" --output_json "$OUT/$tag.json" > "/tmp/$tag.log" 2>&1 \
    || { echo "$tag failed:"; tail -5 "/tmp/$tag.log"; }
}

for what in "$@"; do
  case $what in
  tests)
    run_gpu_tests
    ;;
  bench)
    for shape in $SHAPES; do
      args=(--random_weights "$shape" --dtype bfloat16 --prompt_len 128 --max_output_len 64
        --num_prompts 2 --batch_sizes "${BATCHES:-1}" --modes "$MODES")
      bench "${shape}_new" spec-bench "${args[@]}"
      [ -z "$BASE" ] || bench "${shape}_base" "$BASE" "${args[@]}"
      for g in $GROUPS_TRIED; do
        KESTREL_GEMV_TILED_GROUPS=$g bench "${shape}_groups$g" spec-bench "${args[@]}"
      done
      for r in ${MIN_ROWS_TRIED:-}; do
        KESTREL_GEMV_TILED_MIN_ROWS=$r bench "${shape}_minrows$r" spec-bench "${args[@]}"
      done
    done
    ;;
  profile)
    # Nsight Compute kernel times of the graphed steps of one run (graph nodes one by one):
    # SKIP and COUNT launches, verify:64 of llama2-7b by default (its tree steps come last).
    /usr/local/cuda/bin/ncu --csv --metrics gpu__time_duration.sum --clock-control none \
      --cache-control none --graph-profiling node --launch-skip "${SKIP:-9000}" \
      --launch-count "${COUNT:-2500}" $B/spec-bench --random_weights "${SHAPE:-llama2-7b}" \
      --dtype bfloat16 --device cuda:0 --prompt_len 128 --max_output_len 16 --num_prompts 1 \
      --batch_sizes 1 --modes "${PROFILE_MODES:-verify:64}" --copy_bytes 1048576 \
      > /tmp/ncu.csv 2>/tmp/ncu.err || tail -3 /tmp/ncu.err
    python3 "$here/ncu_summary.py" /tmp/ncu.csv | tee "$OUT/profile.txt"
    ;;
  esac
done
python3 "$here/tiled_summary.py" "$OUT"/*.json | tee "$OUT/summary.txt"

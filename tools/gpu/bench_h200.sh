#!/usr/bin/env bash
# spec-bench --random_weights and the HF transformers baselines on the H200 (issue 6, item 4).
# Needs only the cuda spec-bench binary, xz-compressed, carried in .device/gpu/bench:
#   here:  mkdir -p .device/gpu/bench && xz -9 -T2 -c /work/target-cuda/release/spec-bench > .device/gpu/bench/spec-bench.xz
#   there: run(carry [".device/gpu/bench"], "bash tools/gpu/bench_h200.sh kestrel")
#          run("bash tools/gpu/bench_h200.sh hf llama2-7b")      # one call per shape: compile
#          run("bash tools/gpu/bench_h200.sh hf llama3-8b")      # takes ~40 s per batch size
#          run("bash tools/gpu/bench_h200.sh hf smollm2-135m")
# JSON files land in $OUT (at most 8 come back, so each call writes few).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
what=${1:?usage: bench_h200.sh kestrel | hf SHAPE}
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
case "$what" in
kestrel)
  python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
    .device/gpu/bench/spec-bench.xz /tmp/spec-bench
  chmod +x /tmp/spec-bench
  source "$here/device-env.sh"
  export CUDA_CACHE_PATH=/tmp/cuda-cache
  for shape in llama2-7b llama3-8b smollm2-135m; do
    /tmp/spec-bench --random_weights $shape --dtype bfloat16 --device cuda:0 \
      --prompt_len 128 --max_output_len 128 --num_prompts 16 --batch_sizes 1,4,16 \
      --modes plain,verify:16,verify:64,verify:mc_sim_7b_63 --output_json "$OUT/kestrel_$shape.json" 2>&1
  done
  ;;
hf)
  shape=${2:?usage: bench_h200.sh hf SHAPE}
  python3 "$here/hf_baseline.py" --shape "$shape" --device cuda --dtype bfloat16 \
    --batch_sizes 1,16 --modes eager,compiled --prompt_len 128 --max_new_tokens 128 \
    --output_json "$OUT/hf_$shape.json" 2>&1 | grep -v Warning
  ;;
*) echo "usage: bench_h200.sh kestrel | hf SHAPE" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Where SmolLM2's device memory beyond weights + KV goes: spec-bench on random SmolLM2 weights
# (bf16, plain, batch 1, one 128-token prompt, 64 tokens) with graphs and without, with
# Kestrel's kernels and with candle's ops only, and under the driver's and cuBLAS's knobs
# (every kernel module loaded at start; no cuBLAS workspace). Prints, per run, the level
# after loading and the run's peak above the pre-load level. Needs only spec-bench staged
# (tools/gpu/stage.sh with it in the slot). Results: $OUT/memory.txt, the JSON reports in
# $OUT/memory.tar.gz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
M=/tmp/memory; mkdir -p $M
bench() { # name, env assignments (space-separated, may be empty), then flags
  local name=$1 vars=$2; shift 2
  env $vars $B/spec-bench --random_weights smollm2-135m --dtype bfloat16 --device cuda:0 \
    --prompt_len 128 --max_output_len 64 --num_prompts 1 --batch_sizes 1 --modes plain \
    --copy_bytes 268435456 --output_json "$M/memory_$name.json" "$@" > /dev/null || echo "$name failed"
}
bench graphs ""
bench eager "" --no_cuda_graphs
bench candle_ops "" --no_cuda_graphs --cuda_kernels none
bench eager_modules CUDA_MODULE_LOADING=EAGER --no_cuda_graphs
bench no_cublas_workspace CUBLAS_WORKSPACE_CONFIG=:0:0 --no_cuda_graphs
python3 - $M <<'PY' | tee "$OUT/memory.txt"
import json, os, sys
mib = 1 << 20
print(f"{'run':22s} {'weights':>8s} {'KV used':>8s} {'after load':>10s} {'peak':>8s} {'overhead':>8s} {'stack B':>7s}  (MiB above the pre-load level)")
for name in ["graphs", "eager", "candle_ops", "eager_modules", "no_cublas_workspace"]:
    path = os.path.join(sys.argv[1], f"memory_{name}.json")
    if not os.path.exists(path):
        continue
    d = json.load(open(path))
    r = d["results"][0]
    print(f"{name:22s} {d['weight_bytes'] / mib:8.1f} {r['kv_in_use_bytes'] / mib:8.1f}"
          f" {(d['memory_after_load_bytes'] or 0) / mib:10.1f} {(r['peak_memory_bytes'] or 0) / mib:8.1f}"
          f" {r['memory_overhead_fraction'] or 0:8.2f} {d.get('cuda_thread_stack_bytes') or 0:7d}")
PY
tar -C $M -czf "$OUT/memory.tar.gz" $(cd $M && ls *.json)

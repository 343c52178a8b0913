#!/usr/bin/env bash
# Where SmolLM2's device memory beyond weights + KV goes: spec-bench on random SmolLM2 weights
# (bf16, plain, batch 1, one 128-token prompt, 64 tokens) with graphs and without, with
# Kestrel's kernels and with candle's ops only, and under the driver's and cuBLAS's knobs
# (every kernel module loaded at start; no cuBLAS workspace), and with graphs whose
# activations come from the driver's graph pool instead of the model's arena. Prints, per
# run, the level after loading and the run's peak above the pre-load level; then, if
# model-cuda is staged, its memory test's level after each first use. Needs only spec-bench staged
# (tools/gpu/stage.sh with it in the slot). Results: $OUT/memory.txt, the JSON reports in
# $OUT/memory.tar.gz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
M=/tmp/memory; mkdir -p $M
bench() { # name, env assignments (space-separated, may be empty), prompt and output length, flags
  local name=$1 vars=$2 prompt=$3 output=$4; shift 4
  env $vars $B/spec-bench --random_weights smollm2-135m --dtype bfloat16 --device cuda:0 \
    --prompt_len $prompt --max_output_len $output --num_prompts 1 --batch_sizes 1 --modes plain \
    --copy_bytes 268435456 --output_json "$M/memory_$name.json" "$@" > /dev/null || echo "$name failed"
}
bench graphs "" 128 64
bench graphs_driver "" 128 64 --graph_memory driver
bench eager "" 128 64 --no_cuda_graphs
bench candle_ops "" 128 64 --no_cuda_graphs --cuda_kernels none
bench eager_modules CUDA_MODULE_LOADING=EAGER 128 64 --no_cuda_graphs
bench no_cublas_workspace CUBLAS_WORKSPACE_CONFIG=:0:0 128 64 --no_cuda_graphs
bench small_cublas_workspace CUBLAS_WORKSPACE_CONFIG=:16:1 128 64 --no_cuda_graphs
# What the prompt's prefill alone leaves (one output token, no warm-up run), and a short prompt.
bench prefill_only "" 128 1 --no_cuda_graphs --warmup_tokens 0
bench short_prompt "" 8 64 --no_cuda_graphs
bench short_prefill_only "" 8 1 --no_cuda_graphs --warmup_tokens 0
python3 - $M <<'PY' | tee "$OUT/memory.txt"
import json, os, sys
mib = 1 << 20
print(f"{'run':22s} {'weights':>8s} {'KV used':>8s} {'after load':>10s} {'peak':>8s} {'overhead':>8s} {'stack B':>7s}  (MiB above the pre-load level)")
for name in ["graphs", "graphs_driver", "eager", "candle_ops", "eager_modules", "no_cublas_workspace",
             "small_cublas_workspace", "prefill_only", "short_prompt", "short_prefill_only"]:
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
# The level after each first use (loading, the KV cache, candle's modules, Kestrel's kernels,
# a step), in a fresh process, when the model's GPU test binary is staged too.
if [ -x $B/model-cuda ]; then
  $B/model-cuda smollm2_loads_into_its_weights_chunks_and_steps_within_one_more --nocapture 2>&1 |
    grep -E "MiB|panicked|test result" | tee -a "$OUT/memory.txt"
fi

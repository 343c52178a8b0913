#!/usr/bin/env bash
# How busy the GPU is during plain decoding at batch 1 (random SmolLM2 bf16, CUDA graphs,
# 16 prompts of 128 tokens, 1,024 tokens each): nvidia-smi samples utilization.gpu (the
# share of time a kernel was running) every 200 ms while spec-bench runs. Near 100% means a
# step is bound by its kernels, not by the host's work between steps, so overlapping the
# host with the GPU (launching step N+1 before step N's token reaches the host) could gain
# at most the remainder. Staging: .device/gpu/t holding spec-bench.xz:
#   carry [".device/gpu/t"]: bash tools/gpu/stage.sh t && bash tools/gpu/utilization_h200.sh
# Prints the run's tok/s and step latency, then the samples counted by (utilization, clock).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
nvidia-smi --query-gpu=timestamp,utilization.gpu,clocks.sm --format=csv,noheader -lms 200 > /tmp/util.csv &
smi=$!
$B/spec-bench --random_weights smollm2-135m --dtype bfloat16 --device cuda:0 --prompt_len 128 \
  --max_output_len 1024 --num_prompts 16 --batch_sizes 1 --modes plain --copy_bytes 1048576 \
  --output_json "$OUT/plain.json" > /tmp/plain.log 2>&1 || tail -5 /tmp/plain.log
kill $smi
python3 -c "
import json; r = json.load(open('$OUT/plain.json'))['results'][0]
print('plain', round(r['tokens_per_s'], 1), 'tok/s', round(r['step_latency_ms'], 3), 'ms a step')"
awk -F', ' '{print $2, $3}' /tmp/util.csv | sort | uniq -c | sort -rn | head -12 | tee "$OUT/utilization.txt"

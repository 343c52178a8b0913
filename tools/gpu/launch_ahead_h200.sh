#!/usr/bin/env bash
# Plain decoding launched ahead (branch launch-ahead) against waiting, in one call: the
# IdsReadback GPU test, then spec-bench on random weights (bf16, graphs, 128-token prompts,
# 64 tokens, plain) with --launch_ahead on and off from one binary and main's binary
# (spec-bench-base), alternated ROUNDS times (default 2): Llama-2-7B at batch 1, SmolLM2 at
# batches 1 and 4. Output digests must be equal across the three.
# Staging: slot b = spec-bench.xz (the branch), spec-bench-base.xz (main), kernels-gpu.xz
# (target-cuda/release/deps/gpu-* of the branch); carry .device/gpu/b, then:
#   bash tools/gpu/stage.sh b >/dev/null; bash tools/gpu/launch_ahead_h200.sh
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
nvidia-smi --query-gpu=name --format=csv,noheader
$B/kernels-gpu --test-threads 1 ids_read_back 2>&1 | grep -E "^test |test result|panicked"
R=$OUT/ahead; mkdir -p $R
for r in $(seq 1 ${ROUNDS:-2}); do
  for s in llama2-7b smollm2-135m; do
    bs=1; [ $s = smollm2-135m ] && bs=1,4
    for v in base on off; do
      sb=$B/spec-bench; flag=(--launch_ahead $v)
      [ $v = base ] && sb=$B/spec-bench-base && flag=()
      $sb --random_weights $s --dtype bfloat16 --device cuda:0 --prompt_len 128 \
        --max_output_len 64 --num_prompts 4 --batch_sizes $bs --modes plain "${flag[@]}" \
        --output_json $R/${s}_${v}_$r.json > $R/${s}_${v}_$r.log 2>&1 || tail -3 $R/${s}_${v}_$r.log
    done
  done
done
python3 "$here/bench_table.py" --columns "run,mode,batch,tok/s,step ms,roofline,digest" $R

#!/usr/bin/env bash
# One-row gemvs asking L2 for more of their weights before they wait on the kernel ahead
# (`KESTREL_GEMV_L2_LINES`: 128-byte lines a weight row past the warps' rings; 0 = off; by the
# first wave's blocks, or by all with an `all` suffix: `KESTREL_GEMV_L2_ALL=1`), now that
# dependent launch reaches inside graphs: LINES alternated (ROUNDS, default 2) in one
# binary on random weights, bf16, graphs, batch 1, 128-token prompts, 64 tokens: Llama-2-7B
# and SmolLM2 plain (SHAPES). Needs spec-bench staged (tools/gpu/stage.sh).
#   bash tools/gpu/l2_lines_h200.sh
# Results: $OUT/l2_lines/*.json and the table in $OUT/l2_lines.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
R=$OUT/l2_lines; mkdir -p $R
for r in $(seq 1 ${ROUNDS:-2}); do
  for lines in ${LINES:-0 16 64 16all 64all}; do
    for shape in ${SHAPES:-llama2-7b:plain smollm2-135m:plain}; do
      name=${shape%%:*}_l${lines}_$r
      all=0; [ "${lines%all}" != "$lines" ] && all=1
      KESTREL_GEMV_L2_LINES=${lines%all} KESTREL_GEMV_L2_ALL=$all $B/spec-bench --random_weights ${shape%%:*} --dtype bfloat16 \
        --device cuda:0 --prompt_len 128 --max_output_len 64 --num_prompts 4 --batch_sizes 1 \
        --modes ${shape#*:} --output_json $R/$name.json > $R/$name.log 2>&1 || tail -3 $R/$name.log
    done
  done
done
python3 "$here/bench_table.py" --columns "run,mode,tok/s,step ms,roofline,digest" $R | tee $OUT/l2_lines.txt

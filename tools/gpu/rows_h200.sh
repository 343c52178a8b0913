#!/usr/bin/env bash
# Kestrel's row gather and scatter (kestrel_kernels::gather_rows / scatter_rows) in place of
# candle's index_select and scatter_set, in one call: the memory runs of memory_h200.sh (with
# the model's memory test alone, whose steps must no longer load candle's indexing module),
# then SmolLM2 + the shipped head, bf16, CUDA graphs, greedy, MT-bench 1-20, 128 tokens, batch
# 1 and 4: plain, static and dynamic trees (every EAGLE step gathers and scatters rows), with
# tokens/s, tau, peak memory and whether each output equals plain decoding's.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with
# BINS="kernels-gpu model-cuda spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b && source tools/gpu/session-env.sh && run_gpu_tests
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/rows_h200.sh
# Results: $OUT/memory.txt, $OUT/rows.txt, the JSON reports in $OUT/{memory,rows}.tar.gz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
bash "$here/memory_h200.sh"
source "$here/session-env.sh"
E=/tmp/rows; mkdir -p $E
HEAD=heads/smollm2-eagle
smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
$B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 \
  --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
  --modes "plain,eagle1:$HEAD/tree_h200.json,eagle1:small_8,eagle1:mc_sim_7b_63,eagle2:4:4:1,eagle2:10" \
  --eagle_draft_vocab 4096 --output_json "$E/rows.json" > /dev/null || echo "spec-bench failed"
python3 "$here/bench_table.py" --columns "mode,batch,tok/s,tau,peak MiB,overhead,same" $E/rows.json |
  tee "$OUT/rows.txt"
tar -C $E -czf "$OUT/rows.tar.gz" rows.json

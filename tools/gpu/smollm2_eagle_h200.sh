#!/usr/bin/env bash
# EAGLE on the H200: SmolLM2 + heads/smollm2-eagle, f32, batch 1, greedy; plain vs EAGLE-1
# vs EAGLE-2 on MT-bench first turns, each mode's output compared with plain's.
# Stage first as tools/gpu/smollm2_h200.sh says (pack.sh here, stage.sh a, b, c there), then
# in the same warm machine: bash tools/gpu/smollm2_eagle_h200.sh
set -uo pipefail
STAGE=/tmp/stage
B=/tmp/bin
[ -x $B/spec-run ] && [ -f $STAGE/smol.gguf ] || { echo "stage the binaries and the GGUF first" >&2; exit 1; }
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
$B/convert-checkpoint --gguf "$STAGE/smol.gguf" --eagle_model_dir heads/smollm2-eagle \
  --output_dir /tmp/ckpt_eagle --dtype float32 --workers 16 || exit 1
$B/spec-build --checkpoint_dir /tmp/ckpt_eagle --output_dir /tmp/eng_eagle \
  --speculative_decoding_mode eagle --target_device cuda:sm_90 --max_batch_size 1 || exit 1
P=tools/gpu/mt_bench_first20.jsonl
head -10 $P > /tmp/p10.jsonl
run() { # name, flags...
  local name=$1; shift
  echo "== $name"
  $B/spec-run --engine_dir /tmp/eng_eagle --device cuda:0 --chat --input_file /tmp/p10.jsonl \
    --max_output_len 128 --run_profiling --output_json $OUT/$name.json "$@" | grep profile
}
# JIT warm-up: candle's PTX is compiled by the driver on first use.
$B/spec-run --engine_dir /tmp/eng_eagle --device cuda:0 --input_text hi --max_output_len 4 --no_speculation >/dev/null
run plain --no_speculation
run eagle1_mc_sim_7b_63
run eagle1_small_8 --eagle_choices small_8
run eagle1_chain_4 --eagle_choices chain_4
run eagle2_top4 --eagle_use_dynamic_tree --eagle_dynamic_tree_max_top_k 4
python3 tools/gpu/compare_modes.py "$OUT"

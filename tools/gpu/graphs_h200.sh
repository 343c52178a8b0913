#!/usr/bin/env bash
# CUDA graphs on the H200 (issue 6, launch overhead): the GPU tests, then spec-bench with the
# graphs on and off in one process each.
#   bash tools/gpu/graphs_h200.sh test     # /tmp/bin/{gpu,cuda}-test
#   bash tools/gpu/graphs_h200.sh random   # random-weight shapes -> $OUT/{smol,llama2}_{graphs,eager}.json
#   bash tools/gpu/graphs_h200.sh profile  # after `real`: Nsight Compute kernel times of 3 eager
#                                          # plain decode steps (tools/gpu/ncu_summary.py)
#   bash tools/gpu/graphs_h200.sh tiled    # verify:8-64 at batch 1 and 4 -> $OUT/tiled_{shape}.json
#   bash tools/gpu/graphs_h200.sh profile-random  # Nsight Compute kernel times of graphed steps
#                                          # (MODES=plain, SHAPE=smollm2-135m by default), bf16
#   bash tools/gpu/graphs_h200.sh real     # SmolLM2 + the shipped head (staged GGUF); with
#                                          # REAL_BF16=1 also a bf16 engine (graphs only)
#                                          # -> $OUT/real_{graphs,eager}.json, spec-run outputs compared
# Binaries come from tools/gpu/stage.sh (or a folder of *.xz given as BIN_XZ).
set -euo pipefail
B=/tmp/bin
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" $B
if [ -n "${BIN_XZ:-}" ]; then
  for x in "$BIN_XZ"/*.xz; do
    python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$x" "$B/$(basename "$x" .xz)"
    chmod +x "$B/$(basename "$x" .xz)"
  done
fi
bench_pair() { # name, spec-bench args...
  local name=$1; shift
  for g in graphs eager; do
    local flag=""; [ $g = eager ] && flag=--no_cuda_graphs
    echo "== $name, $g"
    $B/spec-bench --device cuda:0 "$@" $flag --output_json "$OUT/${name}_$g.json" 2>&1 | tail -8
  done
}
case $1 in
test)
  # Both binaries run whatever the first gives; a failure's message is kept.
  for t in gpu-test cuda-test; do
    $B/$t --test-threads 1 > /tmp/$t.log 2>&1 || true
    grep -E "^test result|panicked|FAILED|failures:" -A4 /tmp/$t.log | head -40
  done
  ;;
random)
  bench_pair smol --random_weights smollm2-135m --dtype bfloat16 --prompt_len 128 \
    --max_output_len 64 --num_prompts 16 --batch_sizes 1,16 --modes plain,verify:64
  bench_pair llama2 --random_weights llama2-7b --dtype bfloat16 --prompt_len 128 \
    --max_output_len 64 --num_prompts 4 --batch_sizes 1,4 --modes plain,verify:64
  ;;
real)
  S=/tmp/stage
  $B/convert-checkpoint --gguf $S/smol.gguf --eagle_model_dir heads/smollm2-eagle --output_dir /tmp/ckpt_e \
    --dtype float32 --workers 16 --max_draft_len 63 --num_eagle_layers 6 --max_non_leaves_per_layer 10
  $B/spec-build --checkpoint_dir /tmp/ckpt_e --output_dir /tmp/eng_e --target_device cuda:sm_90 \
    --speculative_decoding_mode eagle --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048
  bench_pair real --engine_dir /tmp/eng_e --prompts tools/gpu/mt_bench_first20.jsonl \
    --num_prompts "${EVAL_N:-10}" --max_output_len 128 --batch_sizes 1,4 \
    --modes plain,eagle1:small_8,eagle1,eagle2:10
  if [ "${REAL_BF16:-0}" = 1 ]; then
    # The same model in bf16 (the dtype of the HF baselines), graphs only.
    $B/convert-checkpoint --gguf $S/smol.gguf --eagle_model_dir heads/smollm2-eagle --output_dir /tmp/ckpt_b \
      --dtype bfloat16 --workers 16 --max_draft_len 63 --num_eagle_layers 6 --max_non_leaves_per_layer 10
    $B/spec-build --checkpoint_dir /tmp/ckpt_b --output_dir /tmp/eng_b --target_device cuda:sm_90 \
      --speculative_decoding_mode eagle --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048
    echo "== real bf16, graphs"
    $B/spec-bench --engine_dir /tmp/eng_b --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
      --num_prompts "${EVAL_N:-10}" --max_output_len 128 --batch_sizes 1,4 \
      --modes plain,eagle1:small_8,eagle1,eagle2:10 --output_json "$OUT/real_bf16_graphs.json" 2>&1 | tail -12
  fi
  P=/tmp/eval_prompts.jsonl; head -"${EVAL_N:-10}" tools/gpu/mt_bench_first20.jsonl > $P
  for g in graphs eager; do
    flag=""; [ $g = eager ] && flag=--no_cuda_graphs
    mkdir -p /tmp/runs_$g
    for m in plain eagle1 eagle2; do
      case $m in
        plain) args=--no_speculation ;;
        eagle1) args="" ;;
        eagle2) args="--eagle_use_dynamic_tree --eagle_dynamic_tree_max_top_k 10" ;;
      esac
      echo "-- spec-run $m, $g (batches of up to 4)"
      $B/spec-run --engine_dir /tmp/eng_e --device cuda:0 --chat --input_file $P --max_output_len 128 \
        $args $flag --run_profiling --output_json /tmp/runs_$g/$m.json | grep profile || true
    done
  done
  python3 - <<'PY'
import json
ids = lambda p: [o["output_ids"] for o in json.load(open(p))["outputs"]]
for m in ["plain", "eagle1", "eagle2"]:
    a, b = f"/tmp/runs_graphs/{m}.json", f"/tmp/runs_eager/{m}.json"
    ta, tb = json.load(open(a))["tokens_per_s"], json.load(open(b))["tokens_per_s"]
    print(f"spec-run {m}: graphs {ta:.1f} tok/s, eager {tb:.1f} tok/s, same ids: {ids(a) == ids(b)}, "
          f"same as plain: {ids(a) == ids('/tmp/runs_eager/plain.json')}")
PY
  ;;
tiled)
  # Verification cost by row count (the tiled gemv engine takes steps of 65 rows and more).
  for shape in smollm2-135m llama2-7b; do
    echo "== $shape"
    $B/spec-bench --random_weights $shape --dtype bfloat16 --device cuda:0 --prompt_len 128 \
      --max_output_len 64 --num_prompts 4 --batch_sizes 1,4 \
      --modes plain,verify:8,verify:16,verify:32,verify:64 \
      --output_json "$OUT/tiled_${shape}.json" 2>&1 | grep -E "^verify|x \(roofline|^plain|same"
  done
  ;;
profile-random)
  # Graph nodes profiled one by one at the clocks and caches they run with.
  /usr/local/cuda/bin/ncu --csv --metrics gpu__time_duration.sum --clock-control none \
    --cache-control none --graph-profiling node --launch-skip "${SKIP:-2500}" --launch-count "${COUNT:-700}" \
    $B/spec-bench --random_weights "${SHAPE:-smollm2-135m}" --dtype bfloat16 --device cuda:0 --prompt_len 128 \
    --max_output_len 64 --num_prompts 1 --batch_sizes 1 --modes "${MODES:-plain}" \
    --copy_bytes 1048576 > /tmp/ncu.csv 2>/tmp/ncu.err || tail -3 /tmp/ncu.err
  python3 tools/gpu/ncu_summary.py /tmp/ncu.csv
  ;;
profile)
  /usr/local/cuda/bin/ncu --csv --metrics gpu__time_duration.sum --launch-skip 3000 --launch-count 900 \
    $B/spec-bench --engine_dir /tmp/eng_e --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
    --num_prompts 1 --max_output_len 40 --batch_sizes 1 --modes plain --no_cuda_graphs \
    --copy_bytes 1048576 > /tmp/ncu.csv 2>/tmp/ncu.err || tail -3 /tmp/ncu.err
  python3 tools/gpu/ncu_summary.py /tmp/ncu.csv
  ;;
*) echo "usage: graphs_h200.sh test|random|tiled|real|profile|profile-random" >&2; exit 2 ;;
esac

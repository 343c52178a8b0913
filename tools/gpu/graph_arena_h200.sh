#!/usr/bin/env bash
# Captured steps' activations in their model's arena (the default; kernels joined across a
# removed allocation keep dependent launch) against the driver's graph memory pool
# (`--graph_memory driver`), in one call: the GPU tests (graphs equal eager steps, bit for
# bit, through the arena), SmolLM2's memory runs (tools/gpu/memory_h200.sh, which has a
# graphs_driver run too), then spec-bench with each of SETTINGS (arena, driver, serial: the
# arena without dependent launch, `--dependent_launch off`) alternated (ROUNDS, default 2)
# on random weights, bf16, graphs, batch 1, 128-token prompts, 64 tokens: Llama-2-7B plain and
# verify:8/16/64 (issue 6's roofline fraction and verification ratios), SmolLM2 plain and
# verify:8. Needs spec-bench and the test binaries (kernels-gpu, model-cuda) staged.
#   bash tools/gpu/graph_arena_h200.sh [test memory bench]
# Results: $OUT/graph_arena/*.json and the summary in $OUT/graph_arena.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
R=$OUT/graph_arena; mkdir -p $R
for what in ${@:-test memory bench}; do
  case $what in
  test) run_gpu_tests | grep -v " ok$" | tee -a $OUT/graph_arena.txt ;;
  memory) bash "$here/memory_h200.sh" | tee -a $OUT/graph_arena.txt ;;
  bench)
    for r in $(seq 1 ${ROUNDS:-2}); do
      for setting in ${SETTINGS:-arena driver serial}; do
        memory=arena; dependent=on
        [ $setting = driver ] && memory=driver
        [ $setting = serial ] && dependent=off
        for shape in ${SHAPES:-llama2-7b:verify:8,verify:16,verify:64 smollm2-135m:verify:8}; do
          name=${shape%%:*}_${setting}_$r
          $B/spec-bench --random_weights ${shape%%:*} \
            --dtype bfloat16 --device cuda:0 --prompt_len 128 --max_output_len 64 --num_prompts 4 \
            --batch_sizes 1 --modes plain,${shape#*:} --graph_memory $memory --dependent_launch $dependent \
            --output_json $R/$name.json > $R/$name.log 2>&1 || tail -3 $R/$name.log
        done
      done
    done
    python3 "$here/bench_table.py" --columns "run,mode,tok/s,step ms,roofline,verify,peak MiB,arena MiB,digest" \
      $R | tee -a $OUT/graph_arena.txt
    ;;
  esac
done

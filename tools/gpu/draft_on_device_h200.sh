#!/usr/bin/env bash
# EAGLE's static trees with their drafted tokens kept on the device (no host round trip per
# draft level; the tokens cross once, with the target's, after verification) against the
# same binary fetching them after every level (`spec-bench --draft_on_device off`), in one
# call: SmolLM2 + the shipped head, bf16, CUDA graphs, greedy, MT-bench 1-20, 128 tokens.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with
# BINS="kernels-gpu model-cuda spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a && bash tools/gpu/draft_on_device_h200.sh tests
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/draft_on_device_h200.sh run
# Results: $OUT/draft_on_device.txt, the JSON reports in $OUT/draft_on_device.tar.gz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/draft_on_device; mkdir -p $E
HEAD=heads/smollm2-eagle

case ${1:?usage: draft_on_device_h200.sh tests|run} in
tests)
  run_gpu_tests
  ;;
run)
  smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
  MODES="plain,eagle1:$HEAD/tree_h200.json,eagle1:small_8,eagle1:mc_sim_7b_63"
  # Greedy, batch 1 then 4, on and off alternating three times (machines drift by up to ~10%
  # between runs, more than the effect measured).
  for run in on1 off1 on2 off2 on3 off3; do
    $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
      --modes "$MODES" --eagle_draft_vocab 4096 --draft_on_device "${run%[123]}" \
      --output_json "$E/greedy_$run.json" > /dev/null || echo "greedy $run failed"
  done
  # Sampled token matching, on and off: the same seed must give the same tokens.
  for run in on off; do
    $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 10 --max_output_len 128 --batch_sizes 1 \
      --modes "eagle1:$HEAD/tree_h200.json,eagle1:small_8" --eagle_draft_vocab 4096 \
      --temperature 0.8 --top_p 0.9 --random_seed 3 --draft_on_device $run \
      --output_json "$E/sampled_$run.json" > /dev/null || echo "sampled $run failed"
  done
  python3 "$here/draft_on_device_summary.py" $E | tee "$OUT/draft_on_device.txt"
  tar -C $E -czf "$OUT/draft_on_device.tar.gz" $(cd $E && ls *.json)
  ;;
esac

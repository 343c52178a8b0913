#!/usr/bin/env bash
# Sampled speculative decoding on the H200 with the target's tokens drawn and draft-target's
# speculative sampling run on the device, against the same process flags with the rows sent
# to the host (`spec-bench --device_sampling off`), and the f32 outputs against the CPU's.
#
# Staging as in tools/gpu/sampling_h200.sh (TRAIN_DATA=1 tools/gpu/pack.sh with
# BINS="kernels-gpu model-cuda spec-bench spec-train convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a && bash tools/gpu/spec_sampling_h200.sh tests
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/spec_sampling_h200.sh run
#   ... && bash tools/gpu/spec_sampling_h200.sh tree   # EAGLE's exact and typical acceptance
# Slot c also carries cpu_sampled.json (and for `tree`, cpu_exact.json and cpu_typical.json):
# `spec-bench` on the CPU with the f32 commands below (the engines built here from the same
# GGUF and head). Results: $OUT/*.json, $OUT/summary.txt (summary_tree.txt).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/spec_sampling; mkdir -p $E
HEAD=heads/smollm2-eagle
SAMPLING=(--temperature 0.8 --random_seed 3 --top_p 0.9)

case ${1:?usage: spec_sampling_h200.sh tests|run|tree} in
tests)
  run_gpu_tests
  ;;
run)
  smollm2_engine float32 eagle $E/eng_e32 $HEAD
  smollm2_engine float32 none $E/eng_p32
  smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
  smollm2_engine bfloat16 none $E/eng_p16
  # f32 against the CPU: the same spec-bench command as cpu_sampled.json (the plain engine
  # drafts for itself, so speculative sampling meets p = q exactly and accepts every draft).
  head -3 tools/gpu/mt_bench_first20.jsonl > $E/first3.jsonl
  $B/spec-bench --engine_dir $E/eng_e32 --draft_engine_dir $E/eng_p32 --device cuda:0 \
    --prompts $E/first3.jsonl --num_prompts 3 --max_output_len 32 --batch_sizes 1 \
    --modes plain,eagle1:$HEAD/tree_h200.json,draft_target:3,draft_target:3:logits \
    --eagle_draft_vocab 4096 "${SAMPLING[@]}" --warmup_tokens 0 --output_json "$OUT/gpu_f32.json" > /dev/null ||
    echo "f32 bench failed"
  # A 4-layer draft (the target's layers 0, 10, 20, 29 to start) distilled briefly on 256
  # self-distilled ShareGPT answers: a draft of the kind draft-target runs with.
  timeout 240 $B/spec-train draft --engine_dir $E/eng_p16 --device cuda:0 --data_dir $E/data \
    --prompts $S/ShareGPT_V3_filtered_1000.json --num_prompts 256 --max_new_tokens 128 \
    --num_layers 4 --epochs 2 --lr 1e-3 --batch_size 32 --dtype float32 --output_dir $E/draft-hf 2>&1 |
    grep -E "epoch|held-out|saved" | tail -4
  $B/convert-checkpoint --model_dir $E/draft-hf --output_dir $E/draft.ckpt --dtype bfloat16 > /dev/null &&
    $B/spec-build --checkpoint_dir $E/draft.ckpt --output_dir $E/eng_d16 --target_device cuda:sm_90 \
      --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048 > /dev/null || echo "draft engine failed"
  # bf16 speed: on / off / on, MT-bench 1-20, 128 tokens, batch 1 then 4.
  MODES="plain,eagle1:$HEAD/tree_h200.json,eagle1:small_8,draft_target:4,draft_target:4:logits"
  for run in on1 off on2; do
    $B/spec-bench --engine_dir $E/eng_e16 --draft_engine_dir $E/eng_d16 --device cuda:0 \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
      --modes "$MODES" --eagle_draft_vocab 4096 "${SAMPLING[@]}" --device_sampling "${run%[12]}" \
      --output_json "$OUT/bf16_$run.json" > /dev/null || echo "bf16 $run failed"
  done
  # Greedy, as a check that nothing else moved: every mode's output equals plain decoding's.
  $B/spec-bench --engine_dir $E/eng_e16 --draft_engine_dir $E/eng_d16 --device cuda:0 \
    --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1 \
    --modes "$MODES" --eagle_draft_vocab 4096 --output_json "$OUT/bf16_greedy.json" > /dev/null || echo "greedy failed"
  python3 "$here/spec_sampling_summary.py" "$OUT" "$S" run | tee "$OUT/summary.txt"
  ;;
tree)
  # EAGLE's exact rejection sampling (children drawn without replacement on static trees; the
  # head's top-k on EAGLE-2's) and typical acceptance, on the device against the host; then
  # f32 against the CPU's cpu_exact.json / cpu_typical.json (carried in slot c).
  [ -d $E/eng_e16 ] || smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
  [ -d $E/eng_e32 ] || smollm2_engine float32 eagle $E/eng_e32 $HEAD
  head -3 tools/gpu/mt_bench_first20.jsonl > $E/first3.jsonl
  head -10 tools/gpu/mt_bench_first20.jsonl > $E/first10.jsonl
  TREE_MODES="plain,eagle1:$HEAD/tree_h200.json,eagle1:small_8,eagle2:4:4:1"
  for rule in exact typical; do
    flags=(--eagle_sampling exact); [ $rule = typical ] && flags=(--eagle_posterior_threshold 0.09)
    $B/spec-bench --engine_dir $E/eng_e32 --device cuda:0 --prompts $E/first3.jsonl --num_prompts 3 \
      --max_output_len 32 --batch_sizes 1 --modes "$TREE_MODES" --eagle_draft_vocab 4096 "${SAMPLING[@]}" \
      "${flags[@]}" --warmup_tokens 0 --output_json "$OUT/gpu_f32_$rule.json" > /dev/null || echo "f32 $rule failed"
    for run in on off; do
      $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 --prompts $E/first10.jsonl --num_prompts 10 \
        --max_output_len 128 --batch_sizes 1 --modes "$TREE_MODES" --eagle_draft_vocab 4096 "${SAMPLING[@]}" \
        "${flags[@]}" --device_sampling $run --output_json "$OUT/bf16_${rule}_$run.json" > /dev/null || echo "bf16 $rule $run failed"
    done
  done
  python3 "$here/spec_sampling_summary.py" "$OUT" "$S" tree | tee "$OUT/summary_tree.txt"
  ;;
*) echo "unknown stage $1" >&2; exit 2 ;;
esac

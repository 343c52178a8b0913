#!/usr/bin/env bash
# Self-distils and trains SmolLM2's EAGLE head on the H200, then measures it, in calls made
# back to back after staging (tools/gpu/pack.sh here; then `bash tools/gpu/stage.sh a`,
# `... b`, `... c` with carry [".device/gpu/<x>"]):
#   bash tools/gpu/train_eagle_h200.sh data    # base engine + answers + features -> /tmp/data
#   bash tools/gpu/train_eagle_h200.sh train   # trains /tmp/head (resumes it if present) -> $OUT/head
#   bash tools/gpu/train_eagle_h200.sh eval    # EAGLE engine with /tmp/head: tau and tok/s -> $OUT
#   bash tools/gpu/train_eagle_h200.sh bench   # bf16, graphs: calibrated trees + spec-bench -> $OUT
#   bash tools/gpu/train_eagle_h200.sh categories  # HEAD on all 80 MT-bench first turns, per category -> $OUT
#   bash tools/gpu/train_eagle_h200.sh vocab   # draft_vocab.json from /tmp/data; spec-bench with/without
# Knobs (environment): SYNTHETIC=1 (the model writes its prompts; SEED), PROMPT_FILES (names in
# the stage folder), NUM_PROMPTS (else sized to DATA_S seconds), MAX_NEW, BATCH, EPOCHS, LR, TRAIN_S (time limit of a train call),
# TTT_STEPS (training-time-test unroll passes, default 1), TTT_DECAY (default 1) and
# FEATURE_LAYERS (e.g. 2,15: the data keeps those base layers' states and the head reads them),
# HEAD (the head folder `train` resumes and writes, `bench` measures; default /tmp/head),
# KEEP_BEST (default 1: `train` writes its best held-out epoch, the resumed head counting as
# epoch 0, so a call that makes the head worse leaves it as it was; 0 writes the last) and
# TRAIN_ARGS (more spec-train flags, e.g. "--head_feature_layers", "--early_stop 2" or
# "--feature_weight 0 --ce_weight 1").
set -euo pipefail
B=/tmp/bin; S=/tmp/stage
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=$1

# eagle_engine HEAD DTYPE ENGINE_DIR: SmolLM2 + the EAGLE head in HEAD, converted to DTYPE and
# built for batch 1 with room for 63-node trees (the checkpoint goes to ENGINE_DIR.ckpt).
eagle_engine() {
  $B/convert-checkpoint --gguf $S/smol.gguf --eagle_model_dir "$1" --output_dir "$3.ckpt" \
    --dtype "$2" --workers 16 --max_draft_len 63 --num_eagle_layers 6 --max_non_leaves_per_layer 10
  $B/spec-build --checkpoint_dir "$3.ckpt" --output_dir "$3" --target_device cuda:sm_90 \
    --speculative_decoding_mode eagle --max_batch_size 1 --max_input_len 1024 --max_seq_len 2048
}

case $stage in
data)
  $B/convert-checkpoint --gguf $S/smol.gguf --output_dir /tmp/ckpt --dtype float32 --workers 16
  $B/spec-build --checkpoint_dir /tmp/ckpt --output_dir /tmp/eng --target_device cuda:sm_90 \
    --max_batch_size "${BATCH:-128}" --max_input_len 512 --max_seq_len $((512 + ${MAX_NEW:-256}))
  # Prompts for n answers: with SYNTHETIC=1 the model writes them itself (Magpie,
  # --synthetic_prompts); otherwise ShareGPT conversations (first human turns) by default:
  # GSM8K's 7.5k formulaic math answers would be most of a sample of the three files, and a
  # head trained on them drafts chat badly.
  prompt_args() {
    if [ "${SYNTHETIC:-0}" = 1 ]; then
      echo --synthetic_prompts "$1" --seed "${SEED:-1}"
    else
      for f in ${PROMPT_FILES:-ShareGPT_V3_filtered_1000.json sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json}; do
        echo --prompts "$S/$f"
      done
      echo --num_prompts "$1"
    fi
  }
  if [ -z "${NUM_PROMPTS:-}" ]; then
    # Size the run to DATA_S seconds from a probe of one batch.
    $B/spec-run --engine_dir /tmp/eng --device cuda:0 --input_text hi --max_output_len 2 >/dev/null  # JIT warm-up
    t0=$(date +%s.%N)
    # shellcheck disable=SC2046
    $B/spec-train eagle --engine_dir /tmp/eng --device cuda:0 --stage data --data_dir /tmp/probe \
      $(prompt_args "${BATCH:-128}") --max_prompt_len 512 --max_new_tokens "${MAX_NEW:-256}" 2>&1 | tail -3
    NUM_PROMPTS=$(python3 -c "import sys; t=$(date +%s.%N)-$t0; print(int(${BATCH:-128}*${DATA_S:-300}/t))")
    echo "probe: one batch in $(python3 -c "print(round($(date +%s.%N)-$t0,1))") s -> $NUM_PROMPTS prompts"
  fi
  # shellcheck disable=SC2046
  $B/spec-train eagle --engine_dir /tmp/eng --device cuda:0 --stage data --data_dir /tmp/data \
    $(prompt_args "$NUM_PROMPTS") --max_prompt_len 512 --max_new_tokens "${MAX_NEW:-256}" \
    ${FEATURE_LAYERS:+--feature_layers "$FEATURE_LAYERS"} \
    --feature_batch_tokens 8192 2>&1 | grep -v "answered\|features [0-9]\|sampled [0-9]" | tail -6
  cp /tmp/data/*.json "$OUT/" 2>/dev/null || true
  ;;
train)
  H=${HEAD:-/tmp/head}
  resume=(); [ -f "$H/config.json" ] && resume=(--resume "$H")
  # shellcheck disable=SC2086
  timeout "${TRAIN_S:-540}" $B/spec-train eagle --engine_dir /tmp/eng --device cuda:0 --stage train \
    --data_dir /tmp/data --output_dir "$H" "${resume[@]}" --epochs "${EPOCHS:-8}" \
    --lr "${LR:-1e-3}" --batch_size 32 --max_len 768 --logits_chunk 4096 --warmup_steps 50 \
    --ttt_steps "${TTT_STEPS:-1}" --ttt_decay "${TTT_DECAY:-1}" ${TRAIN_ARGS:-} \
    $([ "${KEEP_BEST:-1}" = 1 ] && echo --keep_best) \
    2>&1 | grep -E "epoch [0-9]+/|held-out|saved|kept|stopping" || true
  cp -r "$H" "$OUT/head"
  ;;
eval)
  eagle_engine /tmp/head float32 /tmp/eng_e
  P=/tmp/eval_prompts.jsonl; head -"${EVAL_N:-20}" tools/gpu/mt_bench_first20.jsonl > $P
  $B/spec-run --engine_dir /tmp/eng_e --device cuda:0 --input_text hi --max_output_len 4 --no_speculation >/dev/null
  run() { local name=$1; shift; echo "== $name"
    $B/spec-run --engine_dir /tmp/eng_e --device cuda:0 --chat --input_file $P --max_output_len 128 \
      --run_profiling --output_json "$OUT/$name.json" "$@" | grep profile || true; }
  run plain --no_speculation
  run eagle1_mc_sim_7b_63
  run eagle1_small_8 --eagle_choices small_8
  run eagle2_n10 --eagle_use_dynamic_tree --eagle_dynamic_tree_max_top_k 10
  python3 tools/gpu/compare_modes.py "$OUT"
  ;;
bench)
  # The head in /tmp/head (or HEAD) in bf16 with CUDA graphs: calibrated on MT-bench 41-80
  # (tree_12 + statistics, then the step-cost tree for the H200), then spec-bench on
  # MT-bench 1-EVAL_N against plain decoding in one process (MODES: spec-bench's --modes).
  H=${HEAD:-/tmp/head}
  E=$(mktemp -d /tmp/bench.XXXX)   # several heads may be measured at once
  eagle_engine "$H" bfloat16 $E/eng
  $B/spec-train calibrate --engine_dir $E/eng --device cuda:0 --prompts tools/gpu/mt_bench_41_80.jsonl \
    --num_prompts 20 --max_output_len 96 --num_nodes 12 --output "$OUT/tree_12.json" 2>&1 | tail -4
  $B/spec-train calibrate --engine_dir $E/eng --device cuda:0 --from_stats "$OUT/tree_12.stats.json" --num_nodes 12 \
    --step_costs "${STEP_COSTS:-0.30,0.35,0.03}" --output "$OUT/tree_h200.json" 2>&1 | tail -2
  $B/spec-bench --engine_dir $E/eng --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
    --num_prompts "${EVAL_N:-20}" --max_output_len 128 --batch_sizes 1 \
    --modes "${MODES:-plain,eagle1:$OUT/tree_h200.json,eagle1:[[0],[1],[2],[3]],eagle1:small_8,eagle1,eagle2:10}" \
    --output_json "$OUT/bench_bf16.json" 2>&1 | tail -10
  ;;
categories)
  # The head in HEAD (default heads/smollm2-eagle) in bf16 with CUDA graphs on all 80 MT-bench
  # first turns, one spec-bench run per category (10 prompts each) against plain decoding;
  # MODES default: its tree_h200.json, small_8, mc_sim_7b_63, EAGLE-2 top-10.
  H=${HEAD:-heads/smollm2-eagle}
  E=$(mktemp -d /tmp/bench.XXXX)
  eagle_engine "$H" bfloat16 $E/eng
  python3 - "$E" <<'PY'
import json, sys
qs = [json.loads(l) for l in open("tools/gpu/mt_bench_80.jsonl")]
for c in dict.fromkeys(q["category"] for q in qs):
    with open(f"{sys.argv[1]}/{c}.jsonl", "w") as f:
        f.writelines(json.dumps(q) + "\n" for q in qs if q["category"] == c)
PY
  for f in "$E"/*.jsonl; do
    c=$(basename "$f" .jsonl); echo "== $c"
    $B/spec-bench --engine_dir $E/eng --device cuda:0 --prompts "$f" --num_prompts 10 \
      --max_output_len 128 --batch_sizes 1 ${DRAFT_VOCAB:+--eagle_draft_vocab $DRAFT_VOCAB} \
      --modes "${MODES:-plain,eagle1:$H/tree_h200.json,eagle1:small_8,eagle1,eagle2:10}" \
      --output_json "$OUT/mt_$c.json" 2>&1 | grep -E "^(plain|eagle)" || true
  done
  python3 tools/gpu/mt_bench_categories.py "$OUT"/mt_*.json
  ;;
vocab)
  # A draft vocabulary ranking for HEAD (default heads/smollm2-eagle) from the answers in
  # /tmp/data (made by `data`), then spec-bench in bf16 with and without
  # --eagle_draft_vocab DRAFT_VOCAB (default 8192), each against plain decoding.
  H=/tmp/head_dv; rm -rf $H; cp -r "${HEAD:-heads/smollm2-eagle}" $H
  $B/spec-train draft-vocab --data_dir /tmp/data --output_dir $H
  cp $H/draft_vocab.json "$OUT/"
  eagle_engine $H bfloat16 /tmp/eng_v
  for v in full "${DRAFT_VOCAB:-8192}"; do
    flag=(); [ "$v" = full ] || flag=(--eagle_draft_vocab "$v")
    echo "== draft vocabulary: $v"
    $B/spec-bench --engine_dir /tmp/eng_v --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
      --num_prompts "${EVAL_N:-20}" --max_output_len 128 --batch_sizes 1 "${flag[@]}" \
      --modes "plain,eagle1:$H/tree_h200.json,eagle1:small_8,eagle2:10" \
      --output_json "$OUT/bench_vocab_$v.json" 2>&1 | grep -E "^(plain|eagle|mode)"
  done
  ;;
*) echo "unknown stage $stage" >&2; exit 2 ;;
esac

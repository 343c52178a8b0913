#!/usr/bin/env bash
# Where an EAGLE step's time goes on the H200: SmolLM2 + the shipped head, bf16, CUDA graphs,
# greedy, batch 1, MT-bench 1-20, 128 tokens. One spec-bench call a mode, each with
# nvidia-smi sampling utilization.gpu every 100 ms, so a mode's samples are its own. Per
# step, host times: the head reading the committed pairs, the tree's draft levels, queueing
# the verification, acceptance (mostly waiting for the verification to finish and its tokens
# to arrive), and the update after it (KV compaction, kept features, commits). With drafted
# tokens on the device nothing but acceptance waits for the device, so the other four are
# the host's time to queue work, which the GPU waits through when its kernels are shorter.
# Staging (TRAIN_DATA=0 BINS="spec-bench convert-checkpoint spec-build" tools/gpu/pack.sh):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/eagle_phases_h200.sh
# Results: $OUT/eagle_phases.txt and the JSON reports in $OUT/eagle_phases.tar.gz.
# A/B: SPEC_BENCH=/tmp/bin/other TAG=new runs another build into its own folder of results.
# BATCH=4 (default 1) runs that batch size instead (in-flight batching, as spec-bench runs it).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/eagle_phases; R=$E/${TAG:-run}; mkdir -p $R
BATCH=${BATCH:-1}
SB=${SPEC_BENCH:-$B/spec-bench}
HEAD=heads/smollm2-eagle
[ -d $E/eng ] || smollm2_engine bfloat16 eagle $E/eng $HEAD
MODES=${MODES:-"plain eagle1:$HEAD/tree_h200.json eagle1:small_8 eagle2:4:4:1 eagle2:10 plain"}
i=0
for mode in $MODES; do
  i=$((i + 1))
  nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 100 > $R/util_$i.txt &
  smi=$!
  $SB --engine_dir $E/eng --device cuda:0 --prompts tools/gpu/mt_bench_first20.jsonl \
    --num_prompts 20 --max_output_len 128 --batch_sizes $BATCH --modes "$mode" --eagle_draft_vocab 4096 \
    --output_json $R/mode_$i.json > $R/mode_$i.log 2>&1 || { echo "$mode failed"; tail -3 $R/mode_$i.log; }
  kill $smi
done
echo "== ${TAG:-run}: $SB, batch $BATCH" | tee -a "$OUT/eagle_phases.txt"
python3 "$here/eagle_phases_summary.py" $R | tee -a "$OUT/eagle_phases.txt"
tar -C $E -czf "$OUT/eagle_phases.tar.gz" $(cd $E && ls -d */ | grep -v eng)

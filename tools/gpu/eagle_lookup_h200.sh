#!/usr/bin/env bash
# Prompt lookup's drafts grafted onto EAGLE's trees (spec-bench eagle…+prompt_lookup:K:N:corpus,
# spec-run --eagle_prompt_lookup) on the H200, against plain decoding, the lookup alone and
# EAGLE alone, in one call: real SmolLM2 + heads/smollm2-eagle (draft vocabulary 4,096) +
# heads/smollm2-ngram, bf16, CUDA graphs, greedy, MT-bench 1-20 (chat template), 128 tokens,
# batch 1 and 4; the whole set twice (runs 1 and 2), for the drift between runs.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with BINS="spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/eagle_lookup_h200.sh
# Results: $OUT/eagle_lookup.txt, the JSON reports in $OUT/eagle_lookup.tar.gz.
# `eagle_lookup_h200.sh sampled` instead samples (temperature 0.8, top_p 0.9, seed 3, EAGLE's
# token matching) the same modes at batch 1 and 4, twice ($OUT/eagle_lookup_sampled.txt);
# `eagle_lookup_h200.sh deep` runs the deep trees (EAGLE-2 top-10 with 60 nodes, mc_sim_7b_63)
# with and without a lookup grafted on, batch 1, twice ($OUT/eagle_lookup_deep.txt);
# `eagle_lookup_h200.sh long` runs answers of up to 512 tokens (they end at their own end
# token), batch 1, the lookup, EAGLE and their unions up to EAGLE-2 ($OUT/eagle_lookup_long.txt).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/el; mkdir -p $E
HEAD=heads/smollm2-eagle
CORPUS=heads/smollm2-ngram/corpus.safetensors
[ -f $E/eng_e16/plan.bin ] || smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
L=prompt_lookup:4:3:corpus
MODES="plain,$L,eagle1:$HEAD/tree_h200.json,eagle1:$HEAD/tree_h200.json+$L,eagle1:[[0],[1]]+$L,eagle1:[[0]]+$L,eagle2:4:4:1+$L,eagle1:[[0]]+prompt_lookup:6:3:corpus,eagle1:small_8+$L,plain"
SAMPLING=()
BATCHES=1,4
MAX_LEN=128
NAME=eagle_lookup
if [ "${1:-}" = sampled ]; then
  SAMPLING=(--temperature 0.8 --top_p 0.9 --random_seed 3)
  MODES="plain,$L,eagle1:$HEAD/tree_h200.json,eagle1:$HEAD/tree_h200.json+$L,eagle1:[[0]]+$L,plain"
  NAME=eagle_lookup_sampled
elif [ "${1:-}" = long ]; then
  MODES="plain,$L,prompt_lookup:8:3:corpus,eagle1:$HEAD/tree_h200.json,eagle1:$HEAD/tree_h200.json+$L,eagle1:[[0],[1]]+$L,eagle1:[[0],[1]]+prompt_lookup:8:3:corpus,eagle1:[[0],[1]]+prompt_lookup:12:3:corpus,eagle2:10:50+prompt_lookup:12:3:corpus,eagle1:$HEAD/tree_12.json+prompt_lookup:8:3:corpus,plain"
  BATCHES=1
  MAX_LEN=512
  NAME=eagle_lookup_long
elif [ "${1:-}" = deep ]; then
  MODES="plain,eagle2:10:60,eagle2:10:57+prompt_lookup:6:3:corpus,eagle1:mc_sim_7b_63,eagle1:$HEAD/tree_12.json,eagle1:$HEAD/tree_12.json+prompt_lookup:6:3:corpus"
  BATCHES=1
  NAME=eagle_lookup_deep
fi
for run in 1 2; do
  $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 "${SAMPLING[@]}" \
    --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len $MAX_LEN --batch_sizes $BATCHES \
    --modes "$MODES" --eagle_draft_vocab 4096 --prompt_lookup_corpus $CORPUS --output_json "$E/$run.json" > /dev/null || echo "spec-bench $run failed"
done
python3 "$here/bench_table.py" --columns "run,mode,batch,tok/s,step ms,draft ms,tau,vs plain,same" \
  $E/1.json $E/2.json | tee "$OUT/$NAME.txt"
tar -C $E -czf "$OUT/$NAME.tar.gz" 1.json 2.json

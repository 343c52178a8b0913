#!/usr/bin/env bash
# Prompt lookup decoding (spec-bench prompt_lookup:K[:N], alone and backed by the n-gram corpus
# heads/smollm2-ngram) on the H200 against plain decoding and the shipped head's best EAGLE
# settings, in one call: real SmolLM2 + heads/smollm2-eagle,
# bf16, CUDA graphs, greedy, MT-bench 1-20 (chat template, spec-bench's default), 128 tokens,
# batch 1 and 4; the whole set twice (runs 1 and 2), for the drift between runs.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with BINS="spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/prompt_lookup_h200.sh
# Results: $OUT/prompt_lookup.txt, the JSON reports in $OUT/prompt_lookup.tar.gz.
# `prompt_lookup_h200.sh sampled` instead samples (temperature 0.8, top_p 0.9, seed 3) plain
# decoding and prompt lookup with and without the corpus, twice, and prints each run's output
# digest: the lookup's must equal plain's ($OUT/prompt_lookup_sampled.txt).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/pl; mkdir -p $E
HEAD=heads/smollm2-eagle
smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
if [ "${1:-}" = sampled ]; then
  for run in 1 2; do
    $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
      --temperature 0.8 --top_p 0.9 --random_seed 3 --prompt_lookup_corpus heads/smollm2-ngram/corpus.safetensors \
      --modes "plain,prompt_lookup:4,prompt_lookup:4:3:corpus" --output_json "$E/sampled_$run.json" > /dev/null || echo "spec-bench failed"
  done
  python3 "$here/bench_table.py" --columns "run,mode,batch,tok/s,tau,digest" $E/sampled_1.json \
    $E/sampled_2.json | tee "$OUT/prompt_lookup_sampled.txt"
  exit 0
fi
CORPUS=heads/smollm2-ngram/corpus.safetensors
MODES="plain,prompt_lookup:2,prompt_lookup:4,prompt_lookup:8,prompt_lookup:4:3:corpus,prompt_lookup:6:3:corpus,prompt_lookup:8:3:corpus,eagle1:$HEAD/tree_h200.json,eagle2:4:4:1,plain"
for run in 1 2; do
  $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 \
    --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
    --modes "$MODES" --eagle_draft_vocab 4096 --prompt_lookup_corpus $CORPUS --output_json "$E/$run.json" > /dev/null || echo "spec-bench $run failed"
done
python3 "$here/bench_table.py" --columns "run,mode,batch,tok/s,step ms,tau,same" $E/1.json $E/2.json |
  tee "$OUT/prompt_lookup.txt"
tar -C $E -czf "$OUT/prompt_lookup.tar.gz" 1.json 2.json

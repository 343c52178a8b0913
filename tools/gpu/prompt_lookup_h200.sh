#!/usr/bin/env bash
# Prompt lookup decoding (spec-bench prompt_lookup:K[:N], alone and backed by the n-gram corpus
# heads/smollm2-ngram) on the H200 against plain decoding and the shipped head's best EAGLE
# settings, in one call: real SmolLM2 + heads/smollm2-eagle,
# bf16, CUDA graphs, greedy, MT-bench 1-20 (chat template, spec-bench's default), 128 tokens,
# batch 1 and 4; the whole set twice, with a batch's lookup drafts padded to one length
# (`--lookup_equal_rows on`, spec-run's default on CUDA) and then not (`off`).
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with BINS="spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c && bash tools/gpu/prompt_lookup_h200.sh
# Results: $OUT/prompt_lookup.txt, the JSON reports in $OUT/prompt_lookup.tar.gz.
# `prompt_lookup_h200.sh sampled` instead samples (temperature 0.8, top_p 0.9, seed 3) plain
# decoding and prompt lookup with and without the corpus, padded at batch 4 or not, and prints
# each run's output digest: the lookup's must equal plain's ($OUT/prompt_lookup_sampled.txt).
# `prompt_lookup_h200.sh padding`: batch 4 with drafts padded and not, alternating twice
# ($OUT/prompt_lookup_padding.txt).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/pl; mkdir -p $E
HEAD=heads/smollm2-eagle
smollm2_engine bfloat16 eagle $E/eng_e16 $HEAD
if [ "${1:-}" = padding ]; then
  # Batch 4 only, padded and not alternating twice, so that drift between runs shows.
  for pad in on off on off; do
    $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 --lookup_equal_rows $pad \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 4 \
      --prompt_lookup_corpus heads/smollm2-ngram/corpus.safetensors \
      --modes "plain,prompt_lookup:4,prompt_lookup:4:3:corpus,prompt_lookup:8:3:corpus" > /dev/null \
      --output_json "$E/pad.json" || echo "spec-bench failed"
    python3 - "$E/pad.json" "$pad" <<'PY' | tee -a "$OUT/prompt_lookup_padding.txt"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    print(f"{sys.argv[2]:4s} {r['mode']:28s} {r['tokens_per_s'] or 0:8.1f} {r['step_latency_ms'] or 0:6.3f} {r['same_output_as_plain']}")
PY
  done
  exit 0
fi
if [ "${1:-}" = sampled ]; then
  for pad in on off; do
    $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 --lookup_equal_rows $pad \
      --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
      --temperature 0.8 --top_p 0.9 --random_seed 3 --prompt_lookup_corpus heads/smollm2-ngram/corpus.safetensors \
      --modes "plain,prompt_lookup:4,prompt_lookup:4:3:corpus" --output_json "$E/sampled_$pad.json" > /dev/null || echo "spec-bench failed"
  done
  python3 - "$E" <<'PY' | tee "$OUT/prompt_lookup_sampled.txt"
import json, sys
for pad in ["on", "off"]:
    print(f"== sampled, --lookup_equal_rows {pad}")
    for r in json.load(open(f"{sys.argv[1]}/sampled_{pad}.json"))["results"]:
        print(f"{r['mode']:28s} {r['batch_size']:5d} {r['tokens_per_s'] or 0:8.1f} {r['mean_accepted_len'] or 0:5.2f} {r['output_digest']}")
PY
  exit 0
fi
CORPUS=heads/smollm2-ngram/corpus.safetensors
MODES="plain,prompt_lookup:2,prompt_lookup:4,prompt_lookup:8,prompt_lookup:4:3:corpus,prompt_lookup:6:3:corpus,prompt_lookup:8:3:corpus,eagle1:$HEAD/tree_h200.json,eagle2:4:4:1,plain"
for run in on off; do
  $B/spec-bench --engine_dir $E/eng_e16 --device cuda:0 --lookup_equal_rows $run \
    --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 --max_output_len 128 --batch_sizes 1,4 \
    --modes "$MODES" --eagle_draft_vocab 4096 --prompt_lookup_corpus $CORPUS --output_json "$E/$run.json" > /dev/null || echo "spec-bench $run failed"
done
python3 - "$E" <<'PY' | tee "$OUT/prompt_lookup.txt"
import json, sys
for run in ["on", "off"]:
    print(f"== --lookup_equal_rows {run}")
    print(f"{'mode':44s} {'batch':>5s} {'tok/s':>8s} {'step ms':>8s} {'tau':>5s} same_as_plain")
    for r in json.load(open(f"{sys.argv[1]}/{run}.json"))["results"]:
        print(f"{r['mode']:44s} {r['batch_size']:5d} {r['tokens_per_s'] or 0:8.1f} {r.get('step_latency_ms') or 0:8.3f}"
              f" {r['mean_accepted_len'] or 0:5.2f} {r['same_output_as_plain']}")
PY
tar -C $E -czf "$OUT/prompt_lookup.tar.gz" on.json off.json

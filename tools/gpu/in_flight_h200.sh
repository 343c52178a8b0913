#!/usr/bin/env bash
# In-flight batching against static batches (spec-bench --in_flight on|off, same binary) on
# the H200: real SmolLM2 + heads/smollm2-eagle + heads/smollm2-ngram, bf16, CUDA graphs,
# greedy, all 80 MT-bench first turns, up to 512 tokens (answers end at their own end token,
# so their lengths differ), batch 4 and 16; on and off alternating twice in one call.
#
# Staging (TRAIN_DATA=0 tools/gpu/pack.sh with BINS="spec-bench convert-checkpoint spec-build"):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/in_flight_h200.sh
# Results: $OUT/in_flight.txt, the JSON reports in $OUT/in_flight.tar.gz.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
E=/tmp/inflight; mkdir -p $E
HEAD=heads/smollm2-eagle
MAX_BATCH=16 smollm2_engine bfloat16 eagle $E/eng $HEAD
MODES="plain,prompt_lookup:4:3:corpus,eagle1:$HEAD/tree_h200.json"
for run in on1 off1 on2 off2; do
  $B/spec-bench --engine_dir $E/eng --device cuda:0 --in_flight "${run%?}" \
    --prompts tools/gpu/mt_bench_80.jsonl --num_prompts 80 --max_output_len 512 --batch_sizes 4,16 \
    --modes "$MODES" --eagle_draft_vocab 4096 --prompt_lookup_corpus heads/smollm2-ngram/corpus.safetensors \
    --output_json "$E/$run.json" > /dev/null || echo "spec-bench $run failed"
done
python3 - "$E" <<'PY' | tee "$OUT/in_flight.txt"
import json, sys
rows = {}
for run in ["on1", "off1", "on2", "off2"]:
    for r in json.load(open(f"{sys.argv[1]}/{run}.json"))["results"]:
        mode = r["mode"].replace("heads/smollm2-eagle/", "")
        rows.setdefault((mode, r["batch_size"]), []).append(
            (run, r["tokens_per_s"] or 0, r["generated_tokens"], r["mean_accepted_len"] or 0, r["output_digest"]))
print(f"{'mode':26s} {'batch':>5s}  tok/s per run (on1 off1 on2 off2)   tokens  tau  digests equal")
for (mode, batch), rs in rows.items():
    print(f"{mode:26s} {batch:5d}  " + " ".join(f"{t:8.1f}" for _, t, _, _, _ in rs)
          + f"  {rs[0][2]:7d} {rs[0][3]:4.2f}  {len({d for *_, d in rs}) == 1}")
PY
tar -C $E -czf "$OUT/in_flight.tar.gz" on1.json off1.json on2.json off2.json

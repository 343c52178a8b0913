#!/usr/bin/env bash
# EAGLE on the H200: SmolLM2 + heads/smollm2-eagle, f32, batch 1, greedy; plain vs EAGLE-1
# vs EAGLE-2 on MT-bench first turns, each mode's output compared with plain's.
# Same three-call staging as smollm2_h200.sh (calls a and b first); this is call 3:
#   carry [".device/gpu6/c"] -> bash tools/gpu/smollm2_eagle_h200.sh
set -uo pipefail
STAGE=/tmp/stage
mkdir -p "$STAGE" && cp .device/gpu6/c/* "$STAGE/"
cd "$STAGE" && cat gguf.part.0 gguf.part.1 gguf.part.2 > smol.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  smol.gguf" | sha256sum -c - || exit 1
for b in spec-run convert-checkpoint spec-build; do
  python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$b.xz" "/tmp/$b" && chmod +x "/tmp/$b" || exit 1
done
cd - >/dev/null
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
/tmp/convert-checkpoint --gguf "$STAGE/smol.gguf" --eagle_model_dir heads/smollm2-eagle \
  --output_dir /tmp/ckpt_eagle --dtype float32 --workers 16 || exit 1
/tmp/spec-build --checkpoint_dir /tmp/ckpt_eagle --output_dir /tmp/eng_eagle \
  --speculative_decoding_mode eagle --target_device cuda:sm_90 --max_batch_size 1 || exit 1
P=tools/gpu/mt_bench_first20.jsonl
head -10 $P > /tmp/p10.jsonl
run() { # name, flags...
  local name=$1; shift
  echo "== $name"
  /tmp/spec-run --engine_dir /tmp/eng_eagle --device cuda:0 --chat --input_file /tmp/p10.jsonl \
    --max_output_len 128 --run_profiling --output_json $OUT/$name.json "$@" | grep profile
}
# JIT warm-up: candle's PTX is compiled by the driver on first use.
/tmp/spec-run --engine_dir /tmp/eng_eagle --device cuda:0 --input_text hi --max_output_len 4 --no_speculation >/dev/null
run plain --no_speculation
run eagle1_mc_sim_7b_63
run eagle1_small_8 --eagle_choices small_8
run eagle1_chain_4 --eagle_choices chain_4
run eagle2_top4 --eagle_use_dynamic_tree --eagle_dynamic_tree_max_top_k 4
python3 - "$OUT" <<'PY'
import json, sys, os
out = sys.argv[1]
plain = [o["output_ids"] for o in json.load(open(f"{out}/plain.json"))["outputs"]]
for f in sorted(os.listdir(out)):
    if not f.endswith(".json"):
        continue
    doc = json.load(open(f"{out}/{f}"))
    ids = [o["output_ids"] for o in doc["outputs"]]
    steps = sum(o["stats"]["steps"] for o in doc["outputs"])
    toks = sum(len(o["output_ids"]) - 1 for o in doc["outputs"])
    print(f"{f:28s} tok/s {doc['tokens_per_s']:8.1f}  tau {toks/max(steps,1):.2f}  same_as_plain {ids == plain}")
PY

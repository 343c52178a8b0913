#!/usr/bin/env bash
# Two spec-bench builds against each other on this machine's CPU, alternating (base, new,
# base, new) so that drift shows: real SmolLM2 (ENGINE, default the demo's bf16 EAGLE engine
# work/smollm2-bfloat16-engine from tools/demo.sh), MT-bench 1-5 with the chat template, 64 tokens, batch 1, plain
# decoding, EAGLE-1 with tree_cpu, prompt lookup backed by the shipped corpus, and both grafted.
# Usage: bash tools/cpu_ab.sh BASE_SPEC_BENCH NEW_SPEC_BENCH [OUT_DIR]
# MODES replaces the modes, EXTRA adds flags (e.g. the 4-bit self-draft:
#   ENGINE=E EXTRA="--draft_engine_dir E --draft_quantization q4" MODES=plain,draft_target:2
# with E built --speculative_decoding_mode draft_tokens_external --max_draft_len 8).
# (a BASE or NEW may be a wrapper script, e.g. one that sets KESTREL_CPU_AMX=0 and execs the binary)
# e.g. (base from a worktree of the previous commit; copy each binary out after its build):
#   git worktree add /tmp/base HEAD~1 && (cd /tmp/base && cargo build --release --bin spec-bench)
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=$1; NEW=$2; OUT=${3:-/tmp/cpu_ab}
mkdir -p "$OUT"
ENGINE=${ENGINE:-work/smollm2-bfloat16-engine}
TREE=heads/smollm2-eagle/tree_cpu.json
MODES=${MODES:-"plain,eagle1:$TREE,prompt_lookup:3:3:corpus,eagle1:$TREE+prompt_lookup:3:3:corpus"}
for round in 1 2; do
  for build in base new; do
    bin=$BASE; [ $build = new ] && bin=$NEW
    "$bin" --engine_dir "$ENGINE" --prompts ../shared/data/mt_bench/question.jsonl \
      --num_prompts 5 --chat --max_output_len 64 --batch_sizes 1 --eagle_draft_vocab 4096 \
      --prompt_lookup_corpus heads/smollm2-ngram/corpus.safetensors --modes "$MODES" \
      --output_json "$OUT/${round}_$build.json" ${EXTRA:-} > "$OUT/${round}_$build.log" 2>&1
  done
done
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
for rnd in (1, 2):
    for build in ("base", "new"):
        d = json.load(open(f"{out}/{rnd}_{build}.json"))
        cells = []
        for r in d["results"]:
            mode = r["mode"].replace("eagle1:heads/smollm2-eagle/", "eagle1:")
            vs = r["speedup_vs_plain"]
            cells.append(f"{mode} {r['tokens_per_s']:.1f} tok/s {r['step_latency_ms']:.1f} ms"
                         f" ttft {r['time_to_first_token_ms']:.0f} ms"
                         f" τ {r['mean_accepted_len']:.2f}" + (f" {vs:.2f}x" if vs else "")
                         + f" {r['output_digest']}")
        print(f"{rnd} {build:4s} " + " | ".join(cells))
PY

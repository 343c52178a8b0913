#!/usr/bin/env bash
# Issue 6's HF ratios from one card and one call: compiled (and, for SmolLM2, eager) HF
# transformers beside Kestrel's plain decoding, random weights, bf16, batch 1, 128-token
# prompts, 128 new tokens (~3 minutes). Needs the cuda spec-bench, xz-compressed, in a carried
# folder (default .device/gpu/g; SLOT=x for .device/gpu/x):
#   here:  mkdir -p .device/gpu/g && xz -9 -T2 -c /work/target-cuda/release/spec-bench > .device/gpu/g/spec-bench.xz
#   there: run(carry [".device/gpu/g"], "bash tools/gpu/hf_same_card.sh")
# Writes hf_SHAPE.json (hf_baseline.py's records) and k_SHAPE.json (spec-bench's) to $OUT, and
# leaves the binary in /tmp/spec-bench for the calls after it while the machine stays warm.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
PY=/opt/torch/.venv/bin/python3; [ -x $PY ] || PY=python3
$PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" ".device/gpu/${SLOT:-g}/spec-bench.xz" /tmp/spec-bench; chmod +x /tmp/spec-bench
source tools/gpu/device-env.sh; export CUDA_CACHE_PATH=/tmp/cuda-cache
for shape in smollm2-135m llama2-7b; do
  modes=compiled; [ $shape = smollm2-135m ] && modes=eager,compiled
  timeout 200 $PY tools/gpu/hf_baseline.py --shape $shape --device cuda --dtype bfloat16 --batch_sizes 1 --modes $modes --prompt_len 128 --max_new_tokens 128 --output_json $OUT/hf_$shape.json 2>&1 | grep -v -i warn | tail -5
  /tmp/spec-bench --random_weights $shape --dtype bfloat16 --device cuda:0 --prompt_len 128 --max_output_len 128 --num_prompts 4 --batch_sizes 1 --modes plain,plain --output_json $OUT/k_$shape.json 2>&1 | grep -E "^(plain|weights)"
done

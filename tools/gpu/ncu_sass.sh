#!/usr/bin/env bash
# Nsight Compute's per-instruction warp-stall samples of one launch of a kernel, in a decode
# step of a random-weight model (how the attention's serialized V loads were found):
#   KERNEL=paged_attention SHAPE=llama2-7b bash tools/gpu/ncu_sass.sh
#   -> $OUT/sass_<kernel>_<shape>.csv, the hottest instructions printed
# MODES (default plain) picks spec-bench's steps, SETTINGS environment settings for its run,
# SPEC_BENCH another build; e.g. the tree verification's tensor-core attention (session 64):
#   KERNEL=paged_attention_tc_cluster SHAPE=llama2-7b SKIP=100 MODES=verify:mc_sim_7b_63 \
#     SETTINGS=KESTREL_ATTENTION=tensor_cores bash tools/gpu/ncu_sass.sh
# then `python3 tools/gpu/sass_hotspots.py FILE --span 100` for the time by phase.
# Binaries from tools/gpu/stage.sh (or /tmp/bin/spec-bench however it got there).
set -u
source tools/gpu/device-env.sh
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
K=${KERNEL:-paged_attention}; S=${SHAPE:-smollm2-135m}
NCU=/usr/local/cuda/bin/ncu
SB="env ${SETTINGS:-} ${SPEC_BENCH:-/tmp/bin/spec-bench} --device cuda:0 --dtype bfloat16 --prompt_len 128 --max_output_len 32 \
  --num_prompts 1 --no_cuda_graphs --copy_bytes 1048576 --warmup_tokens 0 --random_weights $S \
  --modes ${MODES:-plain} --batch_sizes 1"
timeout 100 $SB > /dev/null 2>&1 # warm the JIT cache
timeout 150 $NCU --section SourceCounters --section WarpStateStats --warp-sampling-interval 0 \
  --kernel-name regex:$K --launch-skip "${SKIP:-300}" --launch-count 1 -o /tmp/sass_rep -f $SB \
  > /tmp/ncu_sass.log 2>&1 || tail -5 /tmp/ncu_sass.log
$NCU -i /tmp/sass_rep.ncu-rep --page source --csv --print-source sass > "$OUT/sass_${K}_$S.csv"
python3 tools/gpu/sass_hotspots.py "$OUT/sass_${K}_$S.csv"

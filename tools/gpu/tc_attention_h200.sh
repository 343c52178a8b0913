#!/usr/bin/env bash
# The tensor-core attention (`--attention_kernel tensor_cores`, here KESTREL_ATTENTION for
# spec-bench's random weights) against the scalar kernels in one call: the GPU tests, then
# spec-bench for both (bf16, graphs, 64 tokens): Llama-2-7B and SmolLM2 at batch 1 (plain,
# verify:64, the mc_sim_7b_63 tree) and Llama-2-7B at batch 16 (plain, verify:8), at each
# PROMPT_LENS (default "128 1536"). VARIANTS="NAME[:VAR=VALUE,...] ..." (default "scalar
# tensor_cores") runs each with KESTREL_ATTENTION=tensor_cores unless NAME is scalar, and the
# variables given (an experiment's switches: session 62 compared "tc_merged:KESTREL_TC_MERGED=1").
# Staging: spec-bench, kernels-gpu, model-cuda (xz) in one carried slot, then
#   bash tools/gpu/stage.sh SLOT > /dev/null; bash tools/gpu/tc_attention_h200.sh [test bench batch]
# Results: $OUT/tc_attention/*.json and the summary in $OUT/tc_attention.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
R=$OUT/tc_attention; mkdir -p $R
bench() { # NAME VARIANT SHAPE BATCH MODES PROMPT_LEN
  local name=${2%%:*} vars=(); [ "$2" != "$name" ] && IFS=, read -r -a vars <<< "${2#*:}"
  local family=tensor_cores; [ "$name" = scalar ] && family=scalar
  env KESTREL_ATTENTION=$family "${vars[@]}" $B/spec-bench --random_weights $3 --dtype bfloat16 --device cuda:0 \
    --prompt_len $6 --max_output_len 64 --num_prompts $4 --batch_sizes $4 --modes $5 \
    --output_json $R/$1.json > $R/$1.log 2>&1 || tail -3 $R/$1.log
}
for what in ${@:-test bench batch}; do
  case $what in
  test) run_gpu_tests | grep -v " ok$" | tee -a $OUT/tc_attention.txt ;;
  bench | batch)
    for p in ${PROMPT_LENS:-128 1536}; do
      for family in ${VARIANTS:-scalar tensor_cores}; do
        if [ $what = bench ]; then
          for shape in llama2-7b smollm2-135m; do
            bench ${shape}_${p}_${family%%:*} $family $shape 1 plain,verify:64,verify:mc_sim_7b_63 $p
          done
        else
          bench llama2-7b_b16_${p}_${family%%:*} $family llama2-7b 16 plain,verify:8 $p
        fi
      done
    done ;;
  esac
done
python3 "$here/bench_table.py" --columns "run,mode,batch,tok/s,step ms,verify,digest" $R | tee -a $OUT/tc_attention.txt

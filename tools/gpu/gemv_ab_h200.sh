#!/usr/bin/env bash
# A gemv change measured on the H200 against the previous build in one call: the kernel probe
# (tools/gpu/gemv_probe.cu), the GPU tests, then spec-bench from both builds, alternated twice,
# on random weights (bf16, graphs, batch 1, 128-token prompts, 64 tokens): Llama-2-7B plain,
# verify:64 (a 64-token chain) and verify:mc_sim_7b_63 (a 64-token tree), SmolLM2 plain and
# verify:8.
# Staging: BINS="spec-bench convert-checkpoint spec-build kernels-gpu model-cuda" tools/gpu/pack.sh
# (the test binaries copied from target-cuda/release/deps/{gpu,cuda}-* under those names), with
# the previous build's spec-bench as spec-bench-base.xz and gemv_probe.xz (nvcc -O3 -std=c++17
# -arch=sm_90 -o gemv_probe tools/gpu/gemv_probe.cu) added to c; carry a, b, c with
# tools/gpu/stage.sh, then: bash tools/gpu/gemv_ab_h200.sh [probe test bench]
# (SHAPES="llama2-7b:verify:64" benches that shape alone; SHAPES="llama2-7b:verify:16,verify:64"
# several modes; BUILDS="base new new:KESTREL_PA_WARPS=1" one build under a setting too, and
# "new:A=1,B=2" under several; BUILDS="base e1 e2" further variants staged as
# spec-bench-e1.xz, spec-bench-e2.xz).
# Results: $OUT/gemv_ab/*.json and the summary in $OUT/gemv_ab.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
R=$OUT/gemv_ab; mkdir -p $R
for what in ${@:-probe test bench}; do
  case $what in
  probe) $B/gemv_probe | tee -a $OUT/gemv_ab.txt ;;
  test) run_gpu_tests | grep -v " ok$" | tee -a $OUT/gemv_ab.txt ;;
  bench)
    # BUILDS: "new" (spec-bench), any other NAME (spec-bench-NAME: "base" is the previous
    # build), each with environment settings for its runs if given ("new:KESTREL_PA_WARPS=1",
    # comma-separated for several); PROMPT_LEN: the prompts' length.
    for r in $(seq 1 ${ROUNDS:-2}); do
      for build in ${BUILDS:-base new}; do
        name=${build%%:*}; sb=$B/spec-bench-$name; [ $name = new ] && sb=$B/spec-bench
        setting=; [ "$build" != "${build%%:*}" ] && setting=${build#*:} && setting=${setting//,/ }
        label=$(echo "$build" | tr ':=,' '___')
        for shape in ${SHAPES:-llama2-7b:verify:64,verify:mc_sim_7b_63 smollm2-135m:verify:8}; do
          env $setting $sb --random_weights ${shape%%:*} --dtype bfloat16 --device cuda:0 \
            --prompt_len ${PROMPT_LEN:-128} --max_output_len 64 --num_prompts 4 --batch_sizes 1 \
            --modes plain,${shape#*:} --output_json $R/${shape%%:*}_${label}_$r.json \
            > $R/${shape%%:*}_${label}_$r.log 2>&1 || tail -3 $R/${shape%%:*}_${label}_$r.log
        done
      done
    done
    python3 "$here/bench_table.py" --columns "run,mode,tok/s,step ms,roofline,verify,digest" $R |
      tee -a $OUT/gemv_ab.txt
    ;;
  esac
done

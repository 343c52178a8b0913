#!/usr/bin/env bash
# Programmatic dependent launch (PDL) on the H200: the GPU tests, then plain decoding and
# 64-token verification of random SmolLM2 / Llama-2-7B shapes, then real SmolLM2 with the
# shipped EAGLE head, each with --dependent_launch on and off in alternation (on, off, on) so
# that the ratio is read from one call and drift shows.
#
# Staging (the GGUF is 98 MB; one call carries 64 MiB with the working tree): here,
#   D=.device/gpu; mkdir -p $D/a $D/b $D/c; split -n 3 -d -a 1 GGUF /tmp/gguf.part.
#   a: spec-bench.xz kernels-gpu.xz model-cuda.xz (the test binaries of
#      `cargo test --release --features cuda --no-run -p kestrel-kernels -p kestrel-model
#      --test gpu --test cuda`, renamed) + gguf.part.0
#   b: convert-checkpoint.xz spec-build.xz + gguf.part.1
#   c: gguf.part.2 + gguf.sha256
# then four calls back to back (the machine keeps /tmp for 30 s after a call):
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a && bash tools/gpu/dependent_launch_h200.sh tests random
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/dependent_launch_h200.sh real
# Results: $OUT (summary.txt and the spec-bench JSON files).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader

bench() { # tag args...: one spec-bench run per --dependent_launch setting, on/off/on
  local tag=$1; shift
  for i in 1 2 3; do
    local pdl=on; [ $i = 2 ] && pdl=off
    $B/spec-bench --device cuda:0 --dependent_launch $pdl "$@" \
      --output_json "$OUT/${tag}_${i}_$pdl.json" > "/tmp/${tag}_$i.log" 2>&1 \
      || { echo "$tag $pdl failed:"; tail -5 "/tmp/${tag}_$i.log"; }
  done
}

for what in "$@"; do
  case $what in
  tests)
    run_gpu_tests
    ;;
  random)
    for shape in smollm2-135m llama2-7b; do
      bench "random_$shape" --random_weights $shape --dtype bfloat16 --prompt_len 128 \
        --max_output_len 128 --num_prompts 4 --batch_sizes 1 --modes plain,verify:16,verify:64
    done
    ;;
  real)
    E=/tmp/eng_eagle
    [ -d $E ] || {
      $B/convert-checkpoint --gguf $S/smol.gguf --eagle_model_dir heads/smollm2-eagle \
        --output_dir $E.ckpt --dtype bfloat16 --workers 16 --max_draft_len 63 \
        --num_eagle_layers 6 --max_non_leaves_per_layer 10 &&
      $B/spec-build --checkpoint_dir $E.ckpt --output_dir $E --target_device cuda:sm_90 \
        --speculative_decoding_mode eagle --max_batch_size 4 --max_input_len 1024 --max_seq_len 2048
    } > /tmp/build.log 2>&1 || { tail -5 /tmp/build.log; exit 1; }
    bench real_smollm2 --engine_dir $E --prompts tools/gpu/mt_bench_first20.jsonl --num_prompts 20 \
      --max_output_len 128 --batch_sizes 1 --eagle_draft_vocab 4096 \
      --modes "plain,eagle1:heads/smollm2-eagle/tree_h200.json,eagle2:4:4:1,eagle1:small_8,eagle1,eagle2:10"
    ;;
  esac
done
python3 "$here/dependent_launch_summary.py" "$OUT"/*.json | tee "$OUT/summary.txt"

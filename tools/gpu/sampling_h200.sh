#!/usr/bin/env bash
# Sampled decoding on the H200 with top-k / top-p filtered on the device, against the same
# commands through a baseline binary (BASE, default spec-run-host: a spec-run built before
# the device filter, which takes those rows to the host; or any earlier build), in one call;
# then the f32 tokens against the CPU's for the same seeds (spec-run --output_json files made
# here with the same commands, named cpu_<tag>.json, carried in slot c).
#
# Staging as in tools/gpu/dependent_launch_h200.sh, with slot a holding kernels-gpu.xz,
# spec-run.xz and $BASE.xz beside gguf.part.0:
#   carry [".device/gpu/a"]: bash tools/gpu/stage.sh a && bash tools/gpu/sampling_h200.sh tests
#   carry [".device/gpu/b"]: bash tools/gpu/stage.sh b
#   carry [".device/gpu/c"]: bash tools/gpu/stage.sh c
#   carry [".device/gpu/d"]: bash tools/gpu/stage.sh d && bash tools/gpu/sampling_h200.sh run
# (slot c also carries the CPU reference files.) Results: $OUT/summary.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
BASE=${BASE:-spec-run-host}
# tag: spec-run sampling flags (temperature 0.8, seed 3 unless greedy)
CONFIGS=("greedy|" "t|--temperature 0.8 --random_seed 3" "p|--temperature 0.8 --random_seed 3 --top_p 0.9"
  "k|--temperature 0.8 --random_seed 3 --top_k 50" "kp|--temperature 0.8 --random_seed 3 --top_k 50 --top_p 0.8")
case ${1:?usage: sampling_h200.sh tests|run|profile} in
tests)
  $B/kernels-gpu --test-threads 1 2>&1 | grep -E "^test |test result|panicked" | tail -30
  ;;
run)
  for dt in float32 bfloat16; do
    $B/convert-checkpoint --gguf $S/smol.gguf --output_dir /tmp/ckpt_$dt --dtype $dt --workers 16 > /dev/null &&
      $B/spec-build --checkpoint_dir /tmp/ckpt_$dt --output_dir /tmp/eng_$dt --target_device cuda:sm_90 \
        --max_batch_size 1 > /dev/null || { echo "engine $dt failed"; exit 1; }
  done
  head -5 tools/gpu/mt_bench_first20.jsonl > /tmp/first5.jsonl
  R=/tmp/res; mkdir -p $R
  for bin in spec-run $BASE; do
    for c in "${CONFIGS[@]}"; do
      tag=${c%%|*}; read -r -a flags <<< "${c#*|}"
      # f32, MT-bench 1-5, 48 tokens: the CPU comparison; bf16, 1-20, 128 tokens: speed.
      $B/$bin --engine_dir /tmp/eng_float32 --device cuda:0 --chat --no_speculation \
        --input_file /tmp/first5.jsonl --max_output_len 48 "${flags[@]}" \
        --output_json $R/${bin}_f32_$tag.json > /dev/null 2>&1 || echo "$bin f32 $tag failed"
      $B/$bin --engine_dir /tmp/eng_bfloat16 --device cuda:0 --chat --no_speculation \
        --input_file tools/gpu/mt_bench_first20.jsonl --max_output_len 128 "${flags[@]}" \
        --output_json $R/${bin}_bf16_$tag.json > /dev/null 2>&1 || echo "$bin bf16 $tag failed"
    done
  done
  python3 - "$R" "$S" "$BASE" <<'EOF' | tee "$OUT/summary.txt"
import json, os, sys
res, ref, base = sys.argv[1], sys.argv[2], sys.argv[3]
def load(p):
    return json.load(open(p)) if os.path.exists(p) else None
def ids(doc):
    return [o["output_ids"] for o in doc["outputs"]]
for tag in ["greedy", "t", "p", "k", "kp"]:
    line = f"{tag:7s}"
    for dt in ["bf16", "f32"]:
        dev, host = load(f"{res}/spec-run_{dt}_{tag}.json"), load(f"{res}/{base}_{dt}_{tag}.json")
        if dev and host:
            line += f"  {dt}: {dev['tokens_per_s']:7.1f} tok/s, {base} {host['tokens_per_s']:7.1f} ({dev['tokens_per_s'] / host['tokens_per_s']:.2f}x), same ids {ids(dev) == ids(host)}"
    cpu = load(f"{ref}/cpu_{tag}.json")
    dev = load(f"{res}/spec-run_f32_{tag}.json")
    if cpu and dev:
        same = sum(a == b for a, b in zip(ids(cpu), ids(dev)))
        line += f"  f32 vs CPU: {same}/{len(ids(cpu))} prompts identical"
    print(line)
EOF
  tar czf "$OUT/results.tar.gz" -C /tmp res
  ;;
profile)
  # Nsight Compute: one launch of the sampling kernel per filter (a decode step's, bf16).
  [ -d /tmp/eng_bfloat16 ] || {
    $B/convert-checkpoint --gguf $S/smol.gguf --output_dir /tmp/ckpt_bf16 --dtype bfloat16 --workers 16 > /dev/null &&
      $B/spec-build --checkpoint_dir /tmp/ckpt_bf16 --output_dir /tmp/eng_bfloat16 --target_device cuda:sm_90 \
        --max_batch_size 1 > /dev/null; }
  head -1 tools/gpu/mt_bench_first20.jsonl > /tmp/first1.jsonl
  for c in "${CONFIGS[@]:1}"; do
    tag=${c%%|*}; read -r -a flags <<< "${c#*|}"
    timeout 120 /usr/local/cuda/bin/ncu --section SpeedOfLight --section WarpStateStats --section LaunchStats \
      --kernel-name regex:kestrel_sample --launch-skip 20 --launch-count 1 \
      $B/spec-run --engine_dir /tmp/eng_bfloat16 --device cuda:0 --chat --no_speculation \
      --input_file /tmp/first1.jsonl --max_output_len 40 "${flags[@]}" > "$OUT/ncu_$tag.txt" 2>&1
    echo "=== $tag"; grep -E "Duration|Stall|Warp Cycles Per Issued|Registers Per|Shared Memory Config|Static Shared" "$OUT/ncu_$tag.txt" | head -20
  done
  ;;
esac

#!/usr/bin/env bash
# Every sampled speculation rule on the tiny test engines (f32), on the H200 with sampling on
# the device and on the host, against the CPU: output digests of spec-bench's plain, EAGLE-1,
# EAGLE-2 and draft-target modes under token matching, exact and typical acceptance.
#   here:  bash tools/gpu/tiny_sampling.sh prepare   # engines, CPU runs, binaries -> .device/t
#   there: bash tools/gpu/tiny_sampling.sh run       # carry [".device/t"]: GPU tests, the runs
#          on and off, and the summary ($OUT/summary_tiny.txt)
# `prepare` needs the CPU release binaries (target/release) and, under CARGO_TARGET_DIR
# (default /work/target-cuda) release/, the CUDA spec-bench and the kernel GPU test binary
# copied to kernels-gpu (as for tools/gpu/pack.sh). One call, about 35 s on a warm machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
D=.device/t
RULES=(token_match exact typical)

# bench BIN_DIR DEVICE ENGINE_SUFFIX OUT_DIR on|off: every rule, every mode.
bench() {
  for rule in "${RULES[@]}"; do
    local flags=()
    [ "$rule" = exact ] && flags=(--eagle_sampling exact)
    [ "$rule" = typical ] && flags=(--eagle_posterior_threshold 0.09)
    "$1/spec-bench" --engine_dir $D/eng_e_$3 --draft_engine_dir $D/eng_p_$3 --device "$2" \
      --prompts $D/prompts.jsonl --num_prompts 4 --max_output_len 40 --batch_sizes 1,2 \
      --copy_bytes 8388608 --modes "plain,eagle1:[[0],[1],[0,0],[0,1]],eagle2:2,draft_target:2,draft_target:3:logits" \
      --temperature 1.0 --top_p 0.95 --random_seed 7 "${flags[@]}" --device_sampling "$5" \
      --output_json "$4/tiny_${rule}_$5.json" > /dev/null
  done
}

case ${1:?usage: tiny_sampling.sh prepare|run} in
prepare)
  T=${CARGO_TARGET_DIR:-/work/target-cuda}/release
  rm -rf $D && mkdir -p $D/cpu
  # The tiny Llama with its tiny EAGLE head, and the tokenizer the CLI tests give it.
  python3 - "$D/tokenizer.json" <<'EOF'
import re, sys
src = open("tests/common/mod.rs").read()
json = re.search(r'pub const TINY_TOKENIZER_JSON: &str = r#"(.*?)"#;', src, re.S).group(1)
open(sys.argv[1], "w").write(json)
EOF
  data=crates/kestrel-formats/tests/data
  for kind in e p; do
    head=(); [ $kind = e ] && head=(--eagle_model_dir $data/tiny_eagle_bin)
    target/release/convert-checkpoint --model_dir $data/tiny_llama_bin "${head[@]}" --output_dir $D/ckpt_$kind > /dev/null
    cp $D/tokenizer.json $D/ckpt_$kind/
    mode=none; [ $kind = e ] && mode=eagle
    for dev in cpu cuda:sm_90; do
      target/release/spec-build --checkpoint_dir $D/ckpt_$kind --output_dir $D/eng_${kind}_${dev%%:*} \
        --speculative_decoding_mode $mode --max_input_len 16 --max_seq_len 64 --max_batch_size 4 \
        --target_device $dev > /dev/null
    done
    rm -rf $D/ckpt_$kind
  done
  printf '{"turns": ["a b c"]}\n{"turns": ["hello world"]}\n{"turns": ["e d"]}\n{"turns": ["b b a d"]}\n' > $D/prompts.jsonl
  bench target/release cpu cpu $D/cpu on
  xz -6 -T2 -c "$T/spec-bench" > $D/spec-bench.xz
  xz -6 -T2 -c "$T/kernels-gpu" > $D/kernels-gpu.xz
  du -sh $D
  ;;
run)
  source tools/gpu/session-env.sh
  mkdir -p "$B"
  for x in $D/*.xz; do
    python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$x" "$B/$(basename "$x" .xz)"
    chmod +x "$B/$(basename "$x" .xz)"
  done
  $B/kernels-gpu --test-threads 1 2>&1 | grep -E "test result|FAILED|panicked"
  for ds in on off; do bench "$B" cuda:0 cuda "$OUT" $ds; done
  python3 - "$OUT" "$D/cpu" "${RULES[@]}" <<'EOF' | tee "$OUT/summary_tiny.txt"
import json, sys
out, cpu, rules = sys.argv[1], sys.argv[2], sys.argv[3:]
for rule in rules:
    c, on, off = (json.load(open(f"{d}/tiny_{rule}_{s}.json")) for d, s in [(cpu, "on"), (out, "on"), (out, "off")])
    print(f"{rule}: device sampling {on['device_sampling']} / {off['device_sampling']}")
    for rc, ra, rb in zip(c["results"], on["results"], off["results"]):
        print(f"  {rc['mode']:30s} batch {rc['batch_size']}  device = host: {ra['output_digest'] == rb['output_digest']}"
              f"  GPU = CPU: {ra['output_digest'] == rc['output_digest']}  tau {ra['mean_accepted_len']:.2f}")
EOF
  ;;
*) echo "unknown stage $1" >&2; exit 2 ;;
esac

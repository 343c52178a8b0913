#!/usr/bin/env bash
# The target's own weights at 4 bits drafting for it on the H200 (`--draft_quantization q4`:
# the decoder projections at 4 bits, the LM head at 8, through kestrel-kernels'
# gemv_quant.cuh), greedy, batch 1, bf16, graphs:
#   test   the quantized-gemv GPU tests (model-cuda, filtered by "quantized")
#   tests  every GPU test (kernels-gpu and model-cuda)
#   7b     random Llama-2-7B, 128-token prompts: plain, draft_target:K (the random model's
#          own copy drafts: its steps are timed; random weights' τ says little), and the
#          verify:T steps those take, ROUNDS times (default 2)
#   ab     spec-bench against spec-bench-b (and spec-bench-c where staged: other builds, e.g.
#          a branch's commits built from a git worktree, each spec-bench renamed and packed;
#          a worktree shares CARGO_TARGET_DIR's artifacts, so `cargo clean -p kestrel-kernels
#          -p kestrel` before building main again), random Llama-2-7B, ROUNDS times alternated
#   smolr  random SmolLM2 weights, as 7b: what a draft step of SmolLM2's shape costs (its
#          one-row steps are launch-bound, not byte-bound)
#   smol   real SmolLM2 from the staged GGUF, MT-bench 1-20, 128 tokens: plain and
#          draft_target:1-4 with the engine drafting for itself
#   ncu    Nsight Compute on random Llama-2-7B's 4-bit draft gemvs (eager, draft_target:1):
#          every launch's time and DRAM bytes past the prompt, by kernel and grid
#          (ncu_summary.py; PEAK_TBS for the card, default 3.35), then the detail
#          sections of one launch of each column width ($OUT/ncu_q4_c{2,4}.txt); NCU_BENCH names
#          another staged build (spec-bench-b)
# Staging (tools/gpu/pack.sh and stage.sh; model-cuda and kernels-gpu copied from
# target-cuda/release/deps/{cuda,gpu}-* first):
#   BINS="spec-bench kernels-gpu convert-checkpoint spec-build model-cuda" TRAIN_DATA=0 tools/gpu/pack.sh
# puts spec-bench and model-cuda in slot a, kernels-gpu in b. Back-to-back calls: a
# (stage.sh a, then `test 7b`), b (stage.sh b, `tests`), c (stage.sh c), d (stage.sh d, `smol`:
# the GGUF's four parts are joined then).
# Results: $OUT/self_draft/*.json, summary in $OUT/self_draft.txt.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
source "$here/session-env.sh"
R=$OUT/self_draft; mkdir -p $R
T=$OUT/self_draft.txt
# random_self_draft BIN SHAPE MODES NAME: BIN (a staged spec-bench) on SHAPE's random weights,
# each model's own 4-bit copy drafting, 4 prompts of 128 tokens; results in $R/NAME.json.
random_self_draft() {
  $B/$1 --random_weights $2 --dtype bfloat16 --device cuda:0 --prompt_len 128 \
    --max_output_len ${TOKENS:-128} --num_prompts 4 --batch_sizes 1 --draft_quantization q4 \
    --modes $3 --output_json $R/$4.json > $R/$4.log 2>&1 || tail -5 $R/$4.log | tee -a $T
}
for what in ${@:-test 7b}; do
  case $what in
  test) $B/model-cuda --test-threads 1 quantized 2>&1 | grep -E "^test |test result|panicked" | tee -a $T ;;
  tests) run_gpu_tests | grep -v " ok$" | tee -a $T ;;
  7b)
    for r in $(seq 1 ${ROUNDS:-2}); do
      random_self_draft spec-bench llama2-7b \
        ${MODES_7B:-plain,draft_target:1,draft_target:2,draft_target:3,draft_target:4,draft_target:6,verify:2,verify:3,verify:4,verify:5,verify:7,plain} 7b_$r
    done
    ;;
  ab)
    # Builds of spec-bench against each other, alternated (staged as /tmp/bin/spec-bench,
    # spec-bench-b and optionally spec-bench-c): random Llama-2-7B, plain and a few draft lengths.
    for r in $(seq 1 ${ROUNDS:-2}); do
      for b in spec-bench spec-bench-b spec-bench-c; do
        [ -x $B/$b ] || continue
        random_self_draft $b llama2-7b ${MODES_AB:-plain,draft_target:1,draft_target:3,plain} ab_${r}_$b
      done
    done
    ;;
  smolr)
    random_self_draft spec-bench smollm2-135m \
      plain,draft_target:1,draft_target:2,draft_target:3,draft_target:4,verify:2,verify:3,verify:4,verify:5,plain smolr
    ;;
  smol)
    [ -d /tmp/smol_dt ] || { $B/convert-checkpoint --gguf $S/smol.gguf --output_dir /tmp/smol_dt.ckpt \
        --dtype bfloat16 --workers 16 > /dev/null &&
      $B/spec-build --checkpoint_dir /tmp/smol_dt.ckpt --output_dir /tmp/smol_dt --target_device cuda:sm_90 \
        --speculative_decoding_mode draft_tokens_external --max_draft_len 8 --max_batch_size 1 \
        --max_input_len 1024 --max_seq_len 2048 > /dev/null; } || { echo "SmolLM2 engine failed" | tee -a $T; exit 1; }
    $B/spec-bench --engine_dir /tmp/smol_dt --draft_engine_dir /tmp/smol_dt --draft_quantization q4 \
      --device cuda:0 --prompts $here/mt_bench_first20.jsonl --max_output_len 128 --batch_sizes 1 \
      --modes ${MODES_SMOL:-plain,draft_target:1,draft_target:2,draft_target:3,draft_target:4,plain} \
      --output_json $R/smol.json > $R/smol.log 2>&1 || tail -5 $R/smol.log | tee -a $T
    ;;
  ncu)
    SB="$B/${NCU_BENCH:-spec-bench} --random_weights llama2-7b --dtype bfloat16 --device cuda:0 --prompt_len 128
      --max_output_len 16 --num_prompts 1 --batch_sizes 1 --draft_quantization q4 --no_cuda_graphs
      --copy_bytes 1048576 --warmup_tokens 0 --modes draft_target:1"
    timeout 200 $SB > /dev/null 2>&1 # the driver's JIT cache
    # The draft's prompt is its first 129 launches (32 layers of 4 gemvs, then the LM head).
    timeout 300 $NCU --csv --metrics gpu__time_duration.sum,dram__bytes_read.sum \
      --kernel-name regex:gemv_q --launch-skip 129 --launch-count 516 $SB > $R/ncu_q.csv 2>&1
    python3 $here/ncu_summary.py $R/ncu_q.csv ${PEAK_TBS:-3.35} | tee -a $T
    for width in 2 4; do ncu_detail q4_c$width gemv_q4_c$width 200 $SB | tee -a $T; done
    ;;
  esac
done
python3 "$here/bench_table.py" --columns "run,mode,tok/s,vs plain,tau,step ms,draft ms,verify,same,load s" \
  $R | tee -a $T

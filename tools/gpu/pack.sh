#!/usr/bin/env bash
# Packs the CUDA binaries and the SmolLM2 GGUF into carry folders (.device/gpu/{a,b,c,d} by
# default, git-ignored), each well under the device tool's 64 MiB per call with the working
# tree (~20 MB tracked): a share of the GGUF and some of the xz-compressed binaries in each.
# SLOTS="a b c" packs three thirds instead (one staging call fewer; ~33 MB of GGUF a slot).
# tools/gpu/stage.sh unpacks them on the machine.
#   CARGO_TARGET_DIR=/work/target-cuda (default) holds release/{spec-run,spec-train,...}
#   BINS="spec-run spec-bench ..." packs only those (slots a, b, c, d, a, ... in turn)
set -euo pipefail
T=${CARGO_TARGET_DIR:-/work/target-cuda}/release
G=${GGUF:-/work/models/SmolLM2-135M-Instruct.Q4_1.gguf}
D=.device/gpu
read -r -a BINS <<< "${BINS:-spec-run spec-train convert-checkpoint spec-build spec-bench}"
read -r -a slots <<< "${SLOTS:-a b c d}"
last=${slots[-1]}
rm -rf "${slots[@]/#/$D/}"; mkdir -p "${slots[@]/#/$D/}"
split -n ${#slots[@]} -d -a 1 "$G" "$D/gguf.part."
for i in "${!slots[@]}"; do mv "$D/gguf.part.$i" "$D/${slots[$i]}/"; done
sha256sum "$G" | cut -d' ' -f1 > "$D/$last/gguf.sha256"
echo ${#slots[@]} > "$D/$last/gguf.parts"
for i in "${!BINS[@]}"; do
  xz -${XZ_LEVEL:-9} -T2 -c "$T/${BINS[$i]}" > "$D/${slots[$i % ${#slots[@]}]}/${BINS[$i]}.xz" &
done
wait
# Prompt sets for self-distillation (the device machine has no ../shared); TRAIN_DATA=0
# leaves them out when only inference runs.
if [ "${TRAIN_DATA:-1}" != 0 ]; then
  cp "${SHARED:-../shared}"/data/sharegpt/{ShareGPT_V3_filtered_1000.json,sg_90k_part1_html_cleaned_lang_first_sampled_sorted.json} \
    "${SHARED:-../shared}/data/gsm8k/train.jsonl" "$D/${slots[2]:-$last}/"
fi
for s in "${slots[@]}"; do echo "$s: $(du -cb "$D/$s"/* | tail -1)"; done

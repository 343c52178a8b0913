#!/usr/bin/env bash
# Packs the CUDA binaries and the SmolLM2 GGUF into the two carry folders that
# tools/gpu/smollm2_h200.sh expects (three calls) (.device/ is git-ignored).
#   CARGO_TARGET_DIR=/work/target-cuda (default) holds target/release/{spec-run,convert-checkpoint,spec-build}
set -euo pipefail
T=${CARGO_TARGET_DIR:-/work/target-cuda}/release
G=${GGUF:-/work/models/SmolLM2-135M-Instruct.Q4_1.gguf}
D=.device/gpu6
rm -rf "$D/a" "$D/b" "$D/c"; mkdir -p "$D/a" "$D/b" "$D/c"
split -b 40000000 -d -a 1 "$G" "$D/gguf.part."
mv "$D/gguf.part.0" "$D/a/"; mv "$D/gguf.part.1" "$D/b/"; mv "$D/gguf.part.2" "$D/c/"
xz -9e -T2 -c "$T/spec-run" > "$D/a/spec-run.xz" &
xz -9e -T2 -c "$T/convert-checkpoint" > "$D/b/convert-checkpoint.xz" &
xz -9e -T2 -c "$T/spec-build" > "$D/c/spec-build.xz" &
wait
du -b "$D"/a/* "$D"/b/* "$D"/c/*
for s in a b c; do echo "$s: $(du -cb "$D/$s"/* | tail -1)"; done

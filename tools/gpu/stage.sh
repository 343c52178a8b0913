#!/usr/bin/env bash
# On the GPU machine: copies one carried folder (.device/gpu/<a|b|c>, from tools/gpu/pack.sh)
# into /tmp/stage, which survives between back-to-back calls. Once all three are there it
# joins the GGUF into /tmp/stage/smol.gguf (sha256-checked) and unpacks the binaries into
# /tmp/bin. Usage: bash tools/gpu/stage.sh a|b|c
set -euo pipefail
STAGE=/tmp/stage
mkdir -p "$STAGE" /tmp/bin
cp ".device/gpu/$1"/* "$STAGE/"
ls "$STAGE"
if [ -f "$STAGE/gguf.part.0" ] && [ -f "$STAGE/gguf.part.1" ] && [ -f "$STAGE/gguf.part.2" ]; then
  cat "$STAGE"/gguf.part.0 "$STAGE"/gguf.part.1 "$STAGE"/gguf.part.2 > "$STAGE/smol.gguf"
  echo "$(cat "$STAGE/gguf.sha256")  $STAGE/smol.gguf" | sha256sum -c -
  for x in "$STAGE"/*.xz; do
    b=$(basename "$x" .xz)
    python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$x" "/tmp/bin/$b"
    chmod +x "/tmp/bin/$b"
  done
  ls -la /tmp/bin
fi

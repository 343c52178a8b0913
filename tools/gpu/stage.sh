#!/usr/bin/env bash
# On the GPU machine: copies one carried folder (.device/gpu/<a|b|c|d>, from tools/gpu/pack.sh)
# into /tmp/stage, which survives between back-to-back calls, and unpacks the binaries it
# brought (*.xz) into /tmp/bin. Once all four GGUF parts are there it joins them into
# /tmp/stage/smol.gguf (sha256-checked). Usage: bash tools/gpu/stage.sh a|b|c|d
set -euo pipefail
STAGE=/tmp/stage
mkdir -p "$STAGE" /tmp/bin
cp ".device/gpu/$1"/* "$STAGE/"
ls "$STAGE"
for x in ".device/gpu/$1"/*.xz; do
  [ -e "$x" ] || continue
  b=$(basename "$x" .xz)
  python3 -c "import lzma,sys,shutil; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" "$x" "/tmp/bin/$b"
  chmod +x "/tmp/bin/$b"
done
ls -la /tmp/bin
parts=("$STAGE"/gguf.part.{0..3})
if ls "${parts[@]}" > /dev/null 2>&1 && [ -f "$STAGE/gguf.sha256" ]; then
  cat "${parts[@]}" > "$STAGE/smol.gguf"
  echo "$(cat "$STAGE/gguf.sha256")  $STAGE/smol.gguf" | sha256sum -c -
fi

#!/usr/bin/env bash
# On the GPU machine: copies one carried folder (.device/gpu/<slot>, from tools/gpu/pack.sh)
# into /tmp/stage, which survives between back-to-back calls, and unpacks the binaries it
# brought (*.xz) into /tmp/bin. Once every GGUF part is there (the last slot says how many)
# it joins them into /tmp/stage/smol.gguf (sha256-checked). Usage: bash tools/gpu/stage.sh SLOT
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
n=$(cat "$STAGE/gguf.parts" 2>/dev/null || echo 4)
parts=(); for i in $(seq 0 $((n - 1))); do parts+=("$STAGE/gguf.part.$i"); done
if ls "${parts[@]}" > /dev/null 2>&1 && [ -f "$STAGE/gguf.sha256" ]; then
  cat "${parts[@]}" > "$STAGE/smol.gguf"
  echo "$(cat "$STAGE/gguf.sha256")  $STAGE/smol.gguf" | sha256sum -c -
fi

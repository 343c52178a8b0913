#!/usr/bin/env bash
# A kernel's SASS for sm_90 on this machine, no GPU needed: ptxas assembles the PTX that the
# last `cargo build --features cuda` embedded, nvdisasm (PyPI's nvidia-cuda-nvdisasm, fetched
# once into ~/.cache/kestrel-nvdisasm; the CUDA toolchain script has no nvdisasm) lists it.
# Prints the kernel's registers and spills, its instructions by opcode, and where its
# barriers, dependent-launch wait and exits fall; the listing goes to $SASS_OUT (default
# /tmp/sass/<kernel>.sass). How session 37 found the 4-bit gemv's empty staging slots and
# per-load row arithmetic.
#   bash tools/sass.sh kestrel_gemv_q4_c2_bf16
#   CARGO_TARGET_DIR=/work/target-cuda (default) holds the build
set -euo pipefail
KERNEL=${1:?usage: bash tools/sass.sh KERNEL_NAME}
T=${CARGO_TARGET_DIR:-/work/target-cuda}/release
PTX=$(ls -t "$T"/build/kestrel-kernels-*/out/kestrel_kernels_sm90.ptx 2>/dev/null | head -1 || true)
[ -n "$PTX" ] || { echo "no kestrel_kernels_sm90.ptx under $T/build: cargo build --release --features cuda first" >&2; exit 1; }
eval "$(bash "$(dirname "$0")/../../shared/tools/cuda-toolchain.sh" --env)" > /dev/null
TOOLS=${KESTREL_NVDISASM_DIR:-$HOME/.cache/kestrel-nvdisasm}
NVDISASM=$(find "$TOOLS" -name nvdisasm -type f 2>/dev/null | head -1 || true)
if [ -z "$NVDISASM" ]; then
  mkdir -p "$TOOLS"
  pip download --no-deps -q nvidia-cuda-nvdisasm -d "$TOOLS" > /dev/null
  python3 -c "import glob, sys, zipfile; zipfile.ZipFile(glob.glob(sys.argv[1] + '/*.whl')[0]).extractall(sys.argv[1])" "$TOOLS"
  NVDISASM=$(find "$TOOLS" -name nvdisasm -type f | head -1)
  chmod +x "$NVDISASM"
fi
OUTF=${SASS_OUT:-/tmp/sass/$KERNEL.sass}
mkdir -p "$(dirname "$OUTF")"
CUBIN=$(mktemp --suffix .cubin)
trap 'rm -f "$CUBIN"' EXIT
ptxas -arch=sm_90 -v -o "$CUBIN" "$PTX" 2>&1 | grep -A3 "entry function '$KERNEL'" |
  grep -o "[0-9]* bytes stack frame.*\|Used [0-9]* registers[^,]*" || { echo "no kernel $KERNEL in $PTX" >&2; exit 1; }
"$NVDISASM" -c "$CUBIN" | awk -v k="$KERNEL" '
  $0 ~ "^\\.text\\." k ":" { on = 1 }
  on && /^[[:space:]]*\.section/ && $0 !~ k { on = 0; done = 1 }
  on && !done' > "$OUTF"
python3 - "$OUTF" <<'PY'
import collections, re, sys
ops = collections.Counter()
marks = []
n = 0
for line in open(sys.argv[1]):
    m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[A-Z0-9_.]+)?", line)
    if not m:
        continue
    n += 1
    op = m.group(3)
    ops[op] += 1
    if op in ("BAR", "ACQBULK", "EXIT"):
        marks.append(f"  {n:5d}  {line.strip()[:90]}")
print(f"{n} instructions ({sys.argv[1]})")
print("  " + ", ".join(f"{op} {c}" for op, c in ops.most_common(24)))
print("barriers, the dependent-launch wait (ACQBULK) and exits, by instruction number:")
print("\n".join(marks))
PY

# Sourced by tools/gpu scripts on the GPU machine: B and S (the binaries and files
# tools/gpu/stage.sh put in /tmp), the CUDA 13 libraries (device-env.sh), the driver's JIT
# cache, and OUT (the device tool's folder, or /tmp/out).
B=/tmp/bin; S=/tmp/stage
source "$(dirname "${BASH_SOURCE[0]}")/device-env.sh"
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# Sourced by tools/gpu scripts on the GPU machine: B and S (the binaries and files
# tools/gpu/stage.sh put in /tmp), the CUDA 13 libraries (device-env.sh), the driver's JIT
# cache, OUT (the device tool's folder, or /tmp/out), and run_gpu_tests.
B=/tmp/bin; S=/tmp/stage
source "$(dirname "${BASH_SOURCE[0]}")/device-env.sh"
export CUDA_CACHE_PATH=/tmp/cuda-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"

# The staged GPU test binaries (kestrel-kernels' tests/gpu.rs, kestrel-model's tests/cuda.rs),
# one test at a time; each test's line and the totals.
run_gpu_tests() {
  for t in kernels-gpu model-cuda; do
    echo "== $t"; $B/$t --test-threads 1 2>&1 | grep -E "^test |test result|panicked|FAILED" | tail -40
  done
}

#!/usr/bin/env bash
# Nsight Compute on frag_probe's 64-row kernels (Llama-2-7B q/k/v, the probe's first shape):
# the cluster build (8 strips a block) and the one with partials through memory. Carry the
# probe built here (nvcc -O3 -std=c++17 -arch=sm_90 -o .device/gpu/p/frag_probe tools/gpu/frag_probe.cu):
#   run(carry [".device/gpu/p"], "bash tools/gpu/frag_ncu.sh")   # -> $OUT/ncu_frag_*.txt
set -u
source "$(dirname "$0")/session-env.sh"
for k in "tiled_frag<" "tiled_frag_parts<"; do
  timeout 240 $NCU --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    --kernel-name-base demangled --kernel-name "regex:${k}" --launch-skip 5 --launch-count 1 .device/gpu/p/frag_probe > "$OUT/ncu_frag_${k%<}.txt" 2>&1
  echo "=== $k"
  grep -E "tiled_frag|Duration|Memory Throughput|DRAM Throughput|L1/TEX Hit|L2 Cache Throughput|Achieved Occupancy|Registers Per|Block Limit|Warp Cycles Per Issued|Stall|Issued Warp|No Eligible|Theoretical Occ|Waves Per SM|Grid Size|Cluster" \
    "$OUT/ncu_frag_${k%<}.txt" | head -40
done

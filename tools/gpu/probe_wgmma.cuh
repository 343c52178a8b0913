// What the wgmma probes (tiled_probe.cu, wgmma_std_probe.cu) share: the m64n64k16 bf16
// warpgroup MMAs (A from registers or shared memory, B from shared memory), and a warp's
// outputs of the m64n64 accumulator (element e of a lane at gemv_wgmma.cuh's wg_acc_row,
// wg_acc_col). Include after kernels.cu, compiled for sm_90a.
#pragma once
#include <cstdint>

// (WG_ACC32, WG_D32 and wgmma_rs, A from registers, come from kernels.cu's gemv_wgmma.cuh,
// compiled for sm_90a.)
__device__ __forceinline__ void wgmma_rs_n64(float *d, const unsigned *a, uint64_t b) {
    wgmma_rs<__nv_bfloat16>(d, a, b);
}

// d += A · B, both from shared memory (K-major).
__device__ __forceinline__ void wgmma_ss_n64(float *d, uint64_t a, uint64_t b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32
                 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_ACC32(d)
                 : "l"(a), "l"(b));
}

// A shared-memory matrix descriptor, no swizzle: leading (k direction) and stride (the next 8
// rows) byte offsets.
__device__ __forceinline__ uint64_t wg_smem_desc(const void *smem, unsigned lbo, unsigned sbo) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    return (uint64_t)((addr >> 4) & 0x3fff) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32);
}

// A chain's end, as kestrel_gemv_tiled's: with one group its sums add into `total` (in chain
// order), else they go to parts [8, M, N]; the accumulator restarts from zero.
__device__ __forceinline__ void wg_chain_done(float *acc, float *total, float *parts, const int p,
                                              const int groups, const int M, const int N, const int m0,
                                              const int n0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const int m = m0 + wg_acc_row(lane, e), n = n0 + wg_acc_col(lane, e);
        if (groups == 1)
            total[e] += acc[e];
        else if (m < M && n < N)
            parts[((size_t)p * M + m) * N + n] = acc[e];
        acc[e] = 0.f;
    }
}

// y of a warp's outputs from the totals of a launch with one group.
__device__ __forceinline__ void wg_store(const float *total, __nv_bfloat16 *y, const int M, const int N,
                                         const int m0, const int n0) {
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        const int m = m0 + wg_acc_row(lane, e), n = n0 + wg_acc_col(lane, e);
        if (m < M && n < N) y[(size_t)m * N + n] = from_f<__nv_bfloat16>(total[e]);
    }
}

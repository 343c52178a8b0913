// The end of the one-row gemv probes (gemv_probe.cu, korder_probe.cu), as GemvMma's one-row
// path ends: each warp's MMA accumulator (lane g, t holds outputs g and g + 8, row 0 in its
// first and third values) into shared memory, then the block's 16 outputs as the warps'
// partial sums added in warp order. Include after kernels.cu (GEMV_WARPS, from_f).
#pragma once

__device__ __forceinline__ void row_partials_to_y(const float *acc, __nv_bfloat16 *y, const int n0,
                                                  const int N) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    __shared__ float part[GEMV_WARPS][16][8];
    part[warp][g][2 * t] = acc[0];
    part[warp][g][2 * t + 1] = acc[1];
    part[warp][g + 8][2 * t] = acc[2];
    part[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (threadIdx.x < 16 && n0 + threadIdx.x < N) {
        float total = 0.f;
#pragma unroll
        for (int q = 0; q < GEMV_WARPS; ++q) total += part[q][threadIdx.x][0];
        y[n0 + threadIdx.x] = from_f<__nv_bfloat16>(total);
    }
}

// Probe: does Hopper's warpgroup MMA (wgmma.mma_async m64n8k16, f32 accumulation, A in
// registers, B from shared memory) give the same bits as four warps' mma.sync m16n8k16 on the
// same operands? Kestrel's exactness rests on every row of a step getting the bits the one-row
// engine gives it, and that engine chains mma.sync m16n8k16; a tiled engine on wgmma (operands
// read by the tensor cores from shared memory: no fragment loads, no register moves, half the
// issue) could keep those bits only if the two instructions round alike.
// Each block (one warpgroup, 128 threads) runs chains of 64 k16 steps on random bf16 operands
// with random exponents, accumulating from random f32 values, once with each instruction, and
// counts outputs whose bits differ. A reference in double on the host checks the layouts (an
// operand in the wrong place would be far off, not a last-bit difference).
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o wgmma_bits_probe tools/gpu/wgmma_bits_probe.cu
#include "probe_common.cuh"
#include <cmath>
#include <cstdint>

constexpr int STEPS = 64; // k16 steps a chain

// A [64, 16·STEPS] row-major, B [8, 16·STEPS] (8 rows of x, k contiguous), C [64, 8].
__device__ __forceinline__ unsigned pair(const bf16 *p) { return *reinterpret_cast<const unsigned *>(p); }

__device__ __forceinline__ void mma16816(float *d, const unsigned *a, const unsigned *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Shared-memory matrix descriptor, no swizzle: start, leading (K direction: the two 8 × 8
// core matrices of a k16 slice) and stride (the next 8 rows) byte offsets, all >> 4.
__device__ __forceinline__ uint64_t desc(const void *smem, unsigned lbo, unsigned sbo) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    return (uint64_t)((addr >> 4) & 0x3fff) | ((uint64_t)((lbo >> 4) & 0x3fff) << 16) |
           ((uint64_t)((sbo >> 4) & 0x3fff) << 32);
}

__device__ __forceinline__ void wgmma_m64n8k16(float *d, const unsigned *a, uint64_t bdesc) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(bdesc));
}

__global__ void __launch_bounds__(128) compare(const bf16 *A, const bf16 *B, const float *C,
                                               float *D_sync, float *D_wg, unsigned lbo, unsigned sbo) {
    const int K = 16 * STEPS;
    const size_t blk = blockIdx.x;
    A += blk * 64 * K;
    B += blk * 8 * K;
    C += blk * 64 * 8;
    D_sync += blk * 64 * 8;
    D_wg += blk * 64 * 8;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
    const int r0 = 16 * warp + g; // the lane's A rows r0 and r0 + 8; D rows likewise
    float ds[4] = {C[r0 * 8 + 2 * t], C[r0 * 8 + 2 * t + 1], C[(r0 + 8) * 8 + 2 * t],
                   C[(r0 + 8) * 8 + 2 * t + 1]};
    float dw[4] = {ds[0], ds[1], ds[2], ds[3]};
    // B of every step in shared memory, K-major core matrices: step s, half c (k 8c..8c+7),
    // row n at s·256 + c·128 + n·16 bytes.
    __shared__ __align__(128) bf16 sb[STEPS * 128];
    for (int i = threadIdx.x; i < STEPS * 128; i += 128) {
        const int s = i / 128, c = (i / 64) % 2, n = (i / 8) % 8, e = i % 8;
        sb[i] = B[n * K + 16 * s + 8 * c + e];
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    for (int s = 0; s < STEPS; ++s) {
        const int k0 = 16 * s;
        const unsigned a[4] = {pair(A + r0 * K + k0 + 2 * t), pair(A + (r0 + 8) * K + k0 + 2 * t),
                               pair(A + r0 * K + k0 + 2 * t + 8),
                               pair(A + (r0 + 8) * K + k0 + 2 * t + 8)};
        const unsigned b[2] = {pair(B + g * K + k0 + 2 * t), pair(B + g * K + k0 + 2 * t + 8)};
        mma16816(ds, a, b);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
        wgmma_m64n8k16(dw, a, desc(sb + s * 128, lbo, sbo));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    }
    D_sync[r0 * 8 + 2 * t] = ds[0];
    D_sync[r0 * 8 + 2 * t + 1] = ds[1];
    D_sync[(r0 + 8) * 8 + 2 * t] = ds[2];
    D_sync[(r0 + 8) * 8 + 2 * t + 1] = ds[3];
    D_wg[r0 * 8 + 2 * t] = dw[0];
    D_wg[r0 * 8 + 2 * t + 1] = dw[1];
    D_wg[(r0 + 8) * 8 + 2 * t] = dw[2];
    D_wg[(r0 + 8) * 8 + 2 * t + 1] = dw[3];
}

int main(int argc, char **argv) {
    const int blocks = argc > 1 ? atoi(argv[1]) : 2048;
    const unsigned lbo = argc > 2 ? atoi(argv[2]) : 128, sbo = argc > 3 ? atoi(argv[3]) : 256;
    const int K = 16 * STEPS;
    std::vector<bf16> a((size_t)blocks * 64 * K), b((size_t)blocks * 8 * K);
    std::vector<float> c((size_t)blocks * 64 * 8);
    unsigned st = 7;
    auto rnd = [&] {
        st = st * 1664525u + 1013904223u;
        return st;
    };
    // Mantissas uniform, exponents over 2^-8 .. 2^8, signs random: wide enough that a
    // product's alignment and rounding inside the instruction matter.
    auto val = [&] {
        const float m = 1.f + (rnd() >> 9) / 8388608.f;
        const int e = (int)(rnd() % 17) - 8;
        return (rnd() & 1 ? -1.f : 1.f) * ldexpf(m, e);
    };
    for (auto &v : a) v = __float2bfloat16(val());
    for (auto &v : b) v = __float2bfloat16(val());
    for (auto &v : c) v = val();
    bf16 *dA, *dB;
    float *dC, *dS, *dW;
    CK(cudaMalloc(&dA, a.size() * 2));
    CK(cudaMalloc(&dB, b.size() * 2));
    CK(cudaMalloc(&dC, c.size() * 4));
    CK(cudaMalloc(&dS, c.size() * 4));
    CK(cudaMalloc(&dW, c.size() * 4));
    CK(cudaMemcpy(dA, a.data(), a.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dB, b.data(), b.size() * 2, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dC, c.data(), c.size() * 4, cudaMemcpyHostToDevice));
    compare<<<blocks, 128>>>(dA, dB, dC, dS, dW, lbo, sbo);
    CK(cudaGetLastError());
    CK(cudaDeviceSynchronize());
    std::vector<float> s(c.size()), w(c.size());
    CK(cudaMemcpy(s.data(), dS, s.size() * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(w.data(), dW, w.size() * 4, cudaMemcpyDeviceToHost));
    size_t differ = 0, far_sync = 0, far_wg = 0;
    double worst = 0;
    for (int blk = 0; blk < blocks; ++blk)
        for (int m = 0; m < 64; ++m)
            for (int n = 0; n < 8; ++n) {
                const size_t i = ((size_t)blk * 64 + m) * 8 + n;
                double ref = c[i], mag = fabs(c[i]);
                for (int k = 0; k < K; ++k) {
                    const double p = (double)__bfloat162float(a[((size_t)blk * 64 + m) * K + k]) *
                                     (double)__bfloat162float(b[((size_t)blk * 8 + n) * K + k]);
                    ref += p;
                    mag += fabs(p);
                }
                const double tol = 1e-4 * mag;
                far_sync += fabs(s[i] - ref) > tol;
                far_wg += fabs(w[i] - ref) > tol;
                if (*reinterpret_cast<unsigned *>(&s[i]) != *reinterpret_cast<unsigned *>(&w[i])) {
                    ++differ;
                    worst = fmax(worst, fabs((double)s[i] - w[i]) / (mag > 0 ? mag : 1));
                }
            }
    printf("outputs %zu (chains of %d k16 steps), lbo %u sbo %u\n", c.size(), STEPS, lbo, sbo);
    printf("far from the double reference: mma.sync %zu, wgmma %zu\n", far_sync, far_wg);
    printf("bits differ between mma.sync and wgmma: %zu (worst |diff| / sum|terms| %.3g)\n", differ, worst);
    return 0;
}

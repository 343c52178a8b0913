// Probe: how fast could a tiled gemv for steps of many rows be on Hopper's warpgroup MMA with
// both operands in shared memory? This needs each MMA to take 16 consecutive k (the standard
// order, which 16-byte copies into wgmma's core-matrix layout give), not GemvMma's order, so
// it does not give the shipped kernels' bits (korder_probe.cu prices that order for a decode
// row); it is checked against a double reference instead, and timed against the shipped
// kestrel_gemv_tiled_* on Llama-2-7B's projections at 64 and 32 rows, at each split of the
// chains (groups 1, 2, 4, 8; the sum kernel included). The same block shape as the shipped
// kernel (128 weight columns × 64 rows, 256 threads: 2 warpgroups of 64 columns each), the
// same chain order; 4 stages of cp.async copies, one group of wgmmas in flight.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o wgmma_std_probe tools/gpu/wgmma_std_probe.cu
#include <cstdint>
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_wgmma.cuh"
#include <cmath>

#define SW_COLS 128
#define SW_ROWS 64
#define SW_STAGES 4
// A stage holds, for each 16-byte piece q = 2j + c of a block of K (MMA j, k half c), a column
// of the weight rows' pieces, then of the input rows': 16-byte pieces a column apart by one
// more than the rows, so a warp's 8 copies of one row land in distinct banks. wgmma reads
// each column as core matrices of 8 rows (stride 128 bytes), the next k half a column on.
#define SW_WPITCH (SW_COLS + 1)
#define SW_XPITCH (SW_ROWS + 1)
#define SW_STAGE_PIECES (8 * SW_WPITCH + 8 * SW_XPITCH)
#define SW_SMEM (SW_STAGES * SW_STAGE_PIECES * 16)

__device__ __forceinline__ uint64_t sw_desc(const void *smem, unsigned lbo) { return wg_smem_desc(smem, lbo, 128); }

// Grid (groups, row tiles, column tiles), as kestrel_gemv_tiled.
__global__ void __launch_bounds__(256, 2)
    tiled_wg_std(const bf16 *__restrict__ x, const bf16 *__restrict__ w, bf16 *__restrict__ y,
                 float *__restrict__ parts, const int M, const int N, const int K, const int groups) {
    const int warp = threadIdx.x / WARP, wg = warp / 4; // warpgroup wg: columns 64wg …
    const int n0 = blockIdx.z * SW_COLS, m0 = blockIdx.y * SW_ROWS, rows = min(SW_ROWS, M - m0);
    const int nkb = K / MMA_KB;
    const int p0 = blockIdx.x * TILED_CHAINS / groups, p1 = (blockIdx.x + 1) * TILED_CHAINS / groups;
    uint4 *smem = reinterpret_cast<uint4 *>(gemv_stage);
    auto wstage = [&](int s) { return smem + s * SW_STAGE_PIECES; };
    auto xstage = [&](int s) { return smem + s * SW_STAGE_PIECES + 8 * SW_WPITCH; };
    int lp = p0, lkb = p0;
    while (lp < p1 && lkb >= nkb) lkb = ++lp;
    // Copies of a block of K: piece q of weight row r (4 a thread) and of input row r (2).
    auto load = [&](const int i) {
        if (lp < p1) {
            const int s = i % SW_STAGES, k0 = lkb * MMA_KB;
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int p = threadIdx.x + 256 * c, r = p / 8, q = p % 8;
                cp_async16(wstage(s) + q * SW_WPITCH + r, w + (size_t)min(n0 + r, N - 1) * K + k0 + 8 * q);
            }
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int p = threadIdx.x + 256 * c, r = p / 8, q = p % 8;
                cp_async16(xstage(s) + q * SW_XPITCH + r, x + (size_t)(m0 + min(r, rows - 1)) * K + k0 + 8 * q);
            }
            lkb += TILED_CHAINS;
            while (lp < p1 && lkb >= nkb) lkb = ++lp;
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int i = 0; i < SW_STAGES - 1; ++i) load(i);
    float acc[32], total[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = total[e] = 0.f;
    const int ncol = n0 + 16 * warp; // the warp's 16 columns
    int i = 0;
    for (int p = p0; p < p1; ++p) {
        for (int kb = p; kb < nkb; kb += TILED_CHAINS, ++i) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(SW_STAGES - 2));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
            __syncthreads(); // this block of K is in; the last one's MMAs are done in both warpgroups
            load(i + SW_STAGES - 1);
            const int s = i % SW_STAGES;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < 4; ++j)
                wgmma_ss_n64(acc, sw_desc(wstage(s) + 2 * j * SW_WPITCH + 64 * wg, SW_WPITCH * 16),
                             sw_desc(xstage(s) + 2 * j * SW_XPITCH, SW_XPITCH * 16));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_chain_done(acc, total, parts, p, groups, M, N, m0, ncol);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if (groups == 1) wg_store(total, y, M, N, m0, ncol);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int smem = TILED_STAGES * TILED_BLOCK_ELEMS * 2;
    CK(cudaFuncSetAttribute(kestrel_gemv_tiled_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(kestrel_gemv_tiled_bf16, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    CK(cudaFuncSetAttribute(tiled_wg_std, cudaFuncAttributeMaxDynamicSharedMemorySize, SW_SMEM));
    CK(cudaFuncSetAttribute(tiled_wg_std, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    const size_t xmax = 64 * 11008, ymax = 64 * 22016;
    bf16 *x = random_bf16(xmax, 99), *y0, *y1;
    float *parts;
    unsigned *sink;
    CK(cudaMalloc(&y0, ymax * 2));
    CK(cudaMalloc(&y1, ymax * 2));
    CK(cudaMalloc(&parts, 8 * ymax * 4));
    CK(cudaMalloc(&sink, 4));
    std::vector<bf16> hx(xmax);
    CK(cudaMemcpy(hx.data(), x, xmax * 2, cudaMemcpyDeviceToHost));
    LaunchTimer timer;
    printf("us a launch (TB/s of weight bytes) at groups 1 / 2 / 4 / 8; largest |error| / sum |terms| "
           "against double over 512 sampled outputs: shipped, wgmma standard order\n");
    for (const ProbeShape &s : PROJECTIONS) {
        if (s.name[0] == 's') continue; // Llama-2-7B's only
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies);
        for (int i = 0; i < copies; ++i) w[i] = random_bf16(elems, 12345u + i);
        auto time = [&](auto launch) { return timer.us(launch, copies, 40); };
        const float t_st = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        auto tb = [&](float us) { return bytes / (us * 1e-6) / 1e12; };
        std::vector<bf16> hw(elems);
        CK(cudaMemcpy(hw.data(), w[0], bytes, cudaMemcpyDeviceToHost));
        for (int M : {64, 32}) {
            auto launch = [&](int engine, int groups, int i, bf16 *y) {
                dim3 grid(groups, (M + 63) / 64, (s.n + 127) / 128);
                if (engine == 0)
                    kestrel_gemv_tiled_bf16<<<grid, 256, smem>>>(x, w[i], y, parts, M, s.n, s.k, groups);
                else
                    tiled_wg_std<<<grid, 256, SW_SMEM>>>(x, w[i], y, parts, M, s.n, s.k, groups);
                if (groups > 1) kestrel_gemv_tiled_sum_bf16<<<sms * 4, 256>>>(parts, y, (size_t)M * s.n);
            };
            printf("%-8s M=%-3d stream %5.1f (%4.2f)\n", s.name, M, t_st, tb(t_st));
            double err[2] = {0, 0};
            for (int engine : {0, 1}) {
                printf("  %-8s", engine ? "wgmma" : "shipped");
                for (int groups : {1, 2, 4, 8}) {
                    const float us = time([&](int i) { launch(engine, groups, i, y1); });
                    printf(" %6.1f (%4.2f)", us, tb(us));
                }
                launch(engine, 8, 0, y1);
                std::vector<bf16> hy((size_t)M * s.n);
                CK(cudaMemcpy(hy.data(), y1, hy.size() * 2, cudaMemcpyDeviceToHost));
                for (int o = 0; o < 512; ++o) {
                    const int m = (o * 37) % M, n = (int)(((size_t)o * 2654435761u) % s.n);
                    double ref = 0, mag = 0;
                    for (int k = 0; k < s.k; ++k) {
                        const double pr = (double)__bfloat162float(hw[(size_t)n * s.k + k]) *
                                          __bfloat162float(hx[(size_t)m * s.k + k]);
                        ref += pr;
                        mag += fabs(pr);
                    }
                    err[engine] = fmax(err[engine], fabs(__bfloat162float(hy[(size_t)m * s.n + n]) - ref) / mag);
                }
                printf("\n");
            }
            CK(cudaGetLastError());
            printf("  error: %.2e %.2e\n", err[0], err[1]);
        }
        for (int i = 0; i < copies; ++i) CK(cudaFree(w[i]));
    }
    return 0;
}

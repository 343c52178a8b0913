// Probe: the tiled tensor-core gemv (kestrel_gemv_tiled_*, steps of 17+ rows) against the
// streaming read of the same weights, and against a candidate engine on Hopper's warpgroup MMA
// (wgmma), on Llama-2-7B's projections at 64 and 32 rows.
// The candidate: a block of 2 warpgroups × 64 weight columns × 64 rows; each warp's 2 KiB of
// weights per block of K go by cp.async into its own shared stage (GemvMma's lanes and loads:
// its k order) and back into registers as wgmma's A; the rows, permuted beforehand
// (permute_rows, timed apart) into that same k order, are the B operand read from shared
// memory. wgmma m64n64k16 computes each output as mma.sync m16n8k16 does
// (wgmma_bits_probe.cu), and the chains run in kestrel_gemv_tiled's order, so it gives the
// shipped kernel's bits; the probe checks that, and times both at each split of the chains
// (groups 1, 2, 4, 8; the sum kernel included). Weights rotate over copies that exceed L2.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o tiled_probe tools/gpu/tiled_probe.cu
//   ./tiled_probe [shape]
#include <cstdint>
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_wgmma.cuh"
#include <cstring>

#define TP_COLS 128
#define TP_ROWS 64
#define TP_STAGES 4
// A stage of rows: [MMA j (4)][k half c (2)][row n (64)][8 values].
#define TP_STAGE_ELEMS (4 * 2 * TP_ROWS * 8)
// A stage of weights: [warp (8)][vector (4)][lane (32)][8 values].
#define TP_W_STAGE_ELEMS (GEMV_WARPS * 4 * WARP * 8)
#define TP_SMEM (TP_STAGES * (TP_STAGE_ELEMS + TP_W_STAGE_ELEMS) * 2)

// xp[(row tile · nkb + kb) · TP_STAGE_ELEMS + ((j · 2 + c) · 64 + n) · 8 + e] =
// x[row 64 · tile + n][64 kb + 16 (e / 2) + 4j + 2c + e % 2] (rows past M: zeros): MMA j's
// k slots in GemvMma's order, so that a stage is one contiguous 8 KiB copy.
__global__ void permute_rows(const bf16 *__restrict__ x, bf16 *__restrict__ xp, int M, int K) {
    const int nkb = K / MMA_KB, tiles = (M + TP_ROWS - 1) / TP_ROWS;
    const size_t total = (size_t)tiles * nkb * TP_STAGE_ELEMS;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const int within = i % TP_STAGE_ELEMS;
        const size_t block = i / TP_STAGE_ELEMS;
        const int kb = block % nkb, tile = block / nkb;
        const int e = within % 8, n = (within / 8) % TP_ROWS, jc = within / (8 * TP_ROWS);
        const int j = jc / 2, c = jc % 2, m = tile * TP_ROWS + n;
        xp[i] = m < M ? x[(size_t)m * K + kb * MMA_KB + 16 * (e / 2) + 4 * j + 2 * c + e % 2]
                      : __float2bfloat16(0.f);
    }
}

// The rows' stage as wgmma's B: leading (k direction) byte offset 1,024 (a half's 64 rows),
// stride (the next 8 rows) 128.
__device__ __forceinline__ uint64_t wg_desc(const void *smem) { return wg_smem_desc(smem, 1024, 128); }

// x: the permuted rows. Grid (groups, row tiles, column tiles), as kestrel_gemv_tiled.
__global__ void __launch_bounds__(256, 2)
    tiled_wg(const bf16 *__restrict__ x, const bf16 *__restrict__ w, bf16 *__restrict__ y,
             float *__restrict__ parts, const int M, const int N, const int K, const int groups) {
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.z * TP_COLS + warp * 16; // the warp's 16 columns
    const int m0 = blockIdx.y * TP_ROWS;
    const int nkb = K / MMA_KB;
    const int p0 = blockIdx.x * TILED_CHAINS / groups, p1 = (blockIdx.x + 1) * TILED_CHAINS / groups;
    bf16 *rows_stage = reinterpret_cast<bf16 *>(gemv_stage);
    bf16 *w_stage = rows_stage + TP_STAGES * TP_STAGE_ELEMS + (warp * 4 * WARP + lane) * 8;
    const bf16 *w_lo = w + (size_t)min(n0 + g, N - 1) * K + 16 * t;
    const bf16 *w_hi = w + (size_t)min(n0 + g + 8, N - 1) * K + 16 * t;
    // The block's blocks of K in chain order: chain p0's, then p0 + 1's, ...
    int lp = p0, lkb = p0;
    while (lp < p1 && lkb >= nkb) lkb = ++lp;
    auto load = [&](const int i) {
        if (lp < p1) {
            bf16 *s = rows_stage + (i % TP_STAGES) * TP_STAGE_ELEMS;
            const bf16 *src = x + ((size_t)blockIdx.y * nkb + lkb) * TP_STAGE_ELEMS;
            for (int r = threadIdx.x; r < TP_STAGE_ELEMS / 8; r += blockDim.x) cp_async16(s + 8 * r, src + 8 * r);
            bf16 *ws = w_stage + (i % TP_STAGES) * TP_W_STAGE_ELEMS;
            const int k0 = lkb * MMA_KB;
            cp_async16(ws, w_lo + k0);
            cp_async16(ws + WARP * 8, w_lo + k0 + 8);
            cp_async16(ws + 2 * WARP * 8, w_hi + k0);
            cp_async16(ws + 3 * WARP * 8, w_hi + k0 + 8);
            lkb += TILED_CHAINS;
            while (lp < p1 && lkb >= nkb) lkb = ++lp;
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int i = 0; i < TP_STAGES - 1; ++i) load(i);
    float acc[32], total[32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = total[e] = 0.f;
    int i = 0;
    for (int p = p0; p < p1; ++p) {
        for (int kb = p; kb < nkb; kb += TILED_CHAINS, ++i) {
            asm volatile("cp.async.wait_group %0;\n" ::"n"(TP_STAGES - 2));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads(); // this block of K is in; every MMA on the last one is done
            load(i + TP_STAGES - 1);
            const bf16 *s = rows_stage + (i % TP_STAGES) * TP_STAGE_ELEMS;
            const bf16 *ws = w_stage + (i % TP_STAGES) * TP_W_STAGE_ELEMS;
            uint4 v[4];
#pragma unroll
            for (int q = 0; q < 4; ++q) v[q] = *reinterpret_cast<const uint4 *>(ws + q * WARP * 8);
            const unsigned *wl = reinterpret_cast<const unsigned *>(&v[0]);
            const unsigned *wh = reinterpret_cast<const unsigned *>(&v[2]);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned a[4] = {wl[2 * j], wh[2 * j], wl[2 * j + 1], wh[2 * j + 1]};
                wgmma_rs_n64(acc, a, wg_desc(s + j * 2 * TP_ROWS * 8));
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
        wg_chain_done(acc, total, parts, p, groups, M, N, m0, n0);
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if (groups == 1) wg_store(total, y, M, N, m0, n0);
}

int main(int argc, char **argv) {
    struct Shape {
        const char *name;
        int n, k;
    } shapes[] = {{"qkv", 12288, 4096}, {"o_proj", 4096, 4096}, {"gate_up", 22016, 4096}, {"down", 4096, 11008}};
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const int smem = TILED_STAGES * TILED_BLOCK_ELEMS * 2;
    CK(cudaFuncSetAttribute(kestrel_gemv_tiled_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    CK(cudaFuncSetAttribute(kestrel_gemv_tiled_bf16, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    CK(cudaFuncSetAttribute(tiled_wg, cudaFuncAttributeMaxDynamicSharedMemorySize, TP_SMEM));
    const size_t xmax = 64 * 11008, ymax = 64 * 22016;
    bf16 *x = random_bf16(xmax, 99), *xperm, *y0, *y1;
    float *parts;
    unsigned *sink;
    CK(cudaMalloc(&xperm, xmax * 2));
    CK(cudaMalloc(&y0, ymax * 2));
    CK(cudaMalloc(&y1, ymax * 2));
    CK(cudaMalloc(&parts, 8 * ymax * 4));
    CK(cudaMalloc(&sink, 4));
    LaunchTimer timer;
    const int reps = 40;
    printf("us a launch (TB/s of weight bytes) at groups 1 / 2 / 4 / 8\n");
    for (auto s : shapes) {
        if (argc > 1 && strcmp(argv[1], s.name) != 0) continue;
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies);
        for (int i = 0; i < copies; ++i) w[i] = random_bf16(elems, 12345u + i);
        auto time = [&](auto launch) { return timer.us(launch, copies, reps); };
        const float t_st = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        auto tb = [&](float us) { return bytes / (us * 1e-6) / 1e12; };
        for (int M : {64, 32}) {
            // engine 0: shipped; 1: the wgmma candidate (on the permuted rows).
            auto launch = [&](int engine, int groups, int i, bf16 *y) {
                if (engine == 0) {
                    dim3 grid(groups, (M + TILED_ROWS - 1) / TILED_ROWS, (s.n + TILED_COLS - 1) / TILED_COLS);
                    kestrel_gemv_tiled_bf16<<<grid, GEMV_WARPS * WARP, smem>>>(x, w[i], y, parts, M, s.n, s.k, groups);
                } else {
                    dim3 grid(groups, (M + TP_ROWS - 1) / TP_ROWS, (s.n + TP_COLS - 1) / TP_COLS);
                    tiled_wg<<<grid, 256, TP_SMEM>>>(xperm, w[i], y, parts, M, s.n, s.k, groups);
                }
                if (groups > 1) kestrel_gemv_tiled_sum_bf16<<<sms * 4, 256>>>(parts, y, (size_t)M * s.n);
            };
            permute_rows<<<sms * 4, 256>>>(x, xperm, M, s.k);
            const float t_perm = time([&](int) { permute_rows<<<sms * 4, 256>>>(x, xperm, M, s.k); });
            std::vector<unsigned short> want((size_t)M * s.n), got((size_t)M * s.n);
            launch(0, 1, 0, y0);
            CK(cudaMemcpy(want.data(), y0, want.size() * 2, cudaMemcpyDeviceToHost));
            bool same = true;
            printf("%-8s M=%-3d stream %5.1f (%4.2f), permute_rows %4.1f\n", s.name, M, t_st, tb(t_st), t_perm);
            for (int engine : {0, 1}) {
                printf("  %-8s", engine ? "wgmma" : "shipped");
                for (int groups : {1, 2, 4, 8}) {
                    const float us = time([&](int i) { launch(engine, groups, i, y1); });
                    printf(" %6.1f (%4.2f)", us, tb(us));
                    launch(engine, groups, 0, y1);
                    CK(cudaMemcpy(got.data(), y1, got.size() * 2, cudaMemcpyDeviceToHost));
                    same &= got == want;
                }
                printf("\n");
            }
            CK(cudaGetLastError());
            printf("  same bits: %s\n", same ? "yes" : "NO");
        }
        for (int i = 0; i < copies; ++i) CK(cudaFree(w[i]));
    }
    return 0;
}

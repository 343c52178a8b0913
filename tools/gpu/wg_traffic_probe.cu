// Probe: what holds the warpgroup engine (crates/kestrel-kernels/src/gemv_wgmma.cuh) above a
// weight stream at 64 rows.
//
// A block of the engine reads, for every 64-k block, 8 KiB of weights (from DRAM, once) and 8
// KiB of the step's rows (from L2, once per 64-row weight group), so L2 hands the
// multiprocessors twice the bytes DRAM hands L2. On an H100 the engine's 64-row Llama-2-7B
// gemvs take 1.35× a weight stream, on an H200 1.67× (docs/gpu-results.md, sessions 46 and
// 54), and the H200's 5.28 ms are the H100's ~5.9 scaled by the SM clocks (1,755 → 1,980
// MHz): as if the engine were bound by something that runs at the SM clock (L2 → SM
// bandwidth) rather than by DRAM. The suspects, timed apart:
//   - the rows' traffic: `noX` never copies the rows (outputs wrong, timing only); `noMMA`
//     multiplies nothing (what the walk alone costs);
//   - bytes in flight: this file built with -DWG_STAGES=S -DWG_MIN_BLOCKS=B (stages a block,
//     blocks a multiprocessor), and every split (1, 4, 8 blocks a weight group's chains);
//   - the copies' way into shared memory: `tmaT` walks the same addresses, its stages filled
//     by the TMA (probe_tma_walk.cuh).
// Two more were timed and changed nothing on an H100: DRAM locality (c12b534: RUN chains walked
// side by side, each weight row read RUN · 128 contiguous bytes at a time) and the weight rows'
// power-of-two stride (b6fe0af: rows K + 64 values apart).
// Each full configuration's row 0 is checked against the shipped one-row kernel's bits (the
// engine's promise), and every row against the split-1 engine's.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -DWG_STAGES=4 -DWG_MIN_BLOCKS=3 \
//     -o wg_traffic_probe tools/gpu/wg_traffic_probe.cu && ./wg_traffic_probe
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_tma_walk.cuh"

template <int SPLIT, int PROBE>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS)
    probe_wgmma(const bf16 *xp, const bf16 *w, bf16 *y, const int M, const int N, const int K) {
    gemv_wgmma<bf16, SPLIT, true, false, PROBE>(xp, w, y, M, N, K);
}

constexpr int STAGE_BYTES = WG_STAGES * WG_STAGE_ELEMS * 2;

template <int SPLIT, int PROBE>
void launch_engine(const bf16 *xp, const bf16 *w, bf16 *y, int M, int N, int K) {
    static bool sized = false;
    if (!sized) {
        CK(cudaFuncSetAttribute(probe_wgmma<SPLIT, PROBE>, cudaFuncAttributeMaxDynamicSharedMemorySize, STAGE_BYTES));
        sized = true;
    }
    probe_wgmma<SPLIT, PROBE><<<dim3((N + 63) / 64, SPLIT, (M + 63) / 64), WG_THREADS, STAGE_BYTES>>>(xp, w, y, M, N, K);
}

struct Config {
    const char *name;
    void (*launch)(const bf16 *, const bf16 *, bf16 *, int, int, int);
    bool skip;
};
// sS: split S; noX: the rows never copied; noMMA: nothing multiplied; tmaT sS: the same walk
// as noX noMMA, its T stages filled by the TMA (tmawsT: by a producer warp, no block-wide
// barrier); tma sS: the engine in its TMA mode (probe_tma_walk.cuh).
constexpr int X = WG_PROBE_NO_X, MMA = WG_PROBE_NO_MMA;
constexpr Config CONFIGS[] = {
    {"s1", launch_engine<1, 0>, false},
    {"s1 noX", launch_engine<1, X>, true},
    {"s1 noX noMMA", launch_engine<1, X | MMA>, true},
    {"tma s1", tma_walk::launch_engine<1, 0>, false},
    {"tma s1 noX", tma_walk::launch_engine<1, X>, true},
    {"tma s1 noX noMMA", tma_walk::launch_engine<1, X | MMA>, true},
    {"tma4 s1", tma_walk::launch<4, 1>, true},
    {"tma8 s1", tma_walk::launch<8, 1>, true},
    {"tma16 s1", tma_walk::launch<16, 1>, true},
    {"tmaws8 s1", tma_walk::launch<8, 1, true>, true},
    {"tmaws16 s1", tma_walk::launch<16, 1, true>, true},
    {"s4", launch_engine<4, 0>, false},
    {"s4 noX noMMA", launch_engine<4, X | MMA>, true},
    {"tma s4", tma_walk::launch_engine<4, 0>, false},
    {"tma s4 noX noMMA", tma_walk::launch_engine<4, X | MMA>, true},
    {"tma8 s4", tma_walk::launch<8, 4>, true},
    {"tmaws8 s4", tma_walk::launch<8, 4, true>, true},
    {"s8", launch_engine<8, 0>, false},
    {"tma s8", tma_walk::launch_engine<8, 0>, false},
};

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("%s, %d SMs; WG_STAGES %d, WG_MIN_BLOCKS %d (%d bytes of stages a block)\n", prop.name, sms, WG_STAGES,
           WG_MIN_BLOCKS, STAGE_BYTES);
    constexpr int M = 64;
    const int KMAX = 11008, NMAX = 22016;
    bf16 *x = random_bf16((size_t)M * KMAX, 7), *xp, *y, *y1;
    unsigned *sink;
    CK(cudaMalloc(&xp, (size_t)M * KMAX * 2));
    CK(cudaMalloc(&y, (size_t)M * NMAX * 2));
    CK(cudaMalloc(&y1, (size_t)NMAX * 2));
    CK(cudaMalloc(&sink, 4));
    LaunchTimer timer;
    const int reps = 60;
    printf("us a launch | shape | stream | rows layout |");
    for (const auto &c : CONFIGS) printf(" %s |", c.name);
    printf(" bits: row 0 = one row, every row = s1\n");
    for (const ProbeShape s : PROJECTIONS) {
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies);
        for (int i = 0; i < copies; ++i) w[i] = random_bf16(elems, 12345u + i);
        CK(cudaDeviceSynchronize());
        auto time = [&](auto launch) { return timer.us(launch, copies, reps); };
        const float t_stream = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        const float t_rows = time([&](int) { kestrel_gemv_wgmma_rows_bf16<<<dim3(s.k / 64, 1), 512>>>(x, xp, M, s.k); });
        printf("| %s | %.1f | %.1f |", s.name, t_stream, t_rows);
        // The bits every full configuration must give: row 0 the one-row kernel's, every row the
        // split-1 engine's (each row's bits are the one-row kernel's whatever the split).
        kestrel_gemv_row_mma_bf16<<<s.n / 16, GEMV_WARPS * WARP>>>(x, w[0], y1, 1, s.n, s.k, GEMV_MMA);
        std::vector<bf16> one(s.n), all((size_t)M * s.n), many((size_t)M * s.n);
        CK(cudaMemcpy(one.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
        kestrel_gemv_wgmma_rows_bf16<<<dim3(s.k / 64, 1), 512>>>(x, xp, M, s.k);
        launch_engine<1, 0>(xp, w[0], y, M, s.n, s.k);
        CK(cudaMemcpy(all.data(), y, all.size() * 2, cudaMemcpyDeviceToHost));
        bool same = true;
        for (const auto &c : CONFIGS) {
            const float t = time([&](int i) { c.launch(xp, w[i], y, M, s.n, s.k); });
            CK(cudaGetLastError());
            printf(" %.1f (%.2fx) |", t, t / t_stream);
            if (!c.skip) {
                CK(cudaMemset(y, 0xff, many.size() * 2));
                c.launch(xp, w[0], y, M, s.n, s.k);
                CK(cudaMemcpy(many.data(), y, many.size() * 2, cudaMemcpyDeviceToHost));
                for (size_t e = 0; e < many.size(); ++e)
                    same = same && __bfloat16_as_ushort(many[e]) == __bfloat16_as_ushort(e < (size_t)s.n ? one[e] : all[e]);
            }
        }
        printf(" %s\n", same ? "same" : "DIFFERENT");
        for (auto p : w) CK(cudaFree(p));
    }
    return 0;
}

// Probe: where the one-row tensor-core gemv (kestrel_gemv_*, M = 1) loses time against the
// bandwidth on Llama-2-7B's projections. Times, per shape: the shipped kernels (the four-tile
// kestrel_gemv_* that steps of 9 to 32 rows take, kestrel_gemv_one_tile_* that steps of 2 to 8 take);
// a lean M = 1 copy of their engine (GemvMma's loads, MMAs and warp order; one tile of
// partial sums, 16 threads adding them) reading the weight in rows, and the same reading it
// packed so that a warp's 2 KiB block of K is one contiguous run (`pack`); and a plain
// streaming read of the same bytes (the ceiling). A second line per shape times the shipped
// engine alone in a kernel (GemvMma, one tile, no FMA engine) called with the step's M, and
// kestrel_gemv_row_mma_* that decode takes since session 23: the same with M = 1 known to
// the compiler; kestrel_gemv_row_mma_deep_* (a ring of 2 blocks of K a warp, which grids of
// up to 2 blocks a multiprocessor take since session 24); and that engine with rings of 1 to
// 4 (4 at 2 blocks' registers, as it spills at 3). SmolLM2's shapes (s_*) follow Llama-2-7B's.
// Every gemv must give the shipped kernel's bits. Weights
// rotate over enough copies that no launch finds them in L2, as in a decode step.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o gemv_probe tools/gpu/gemv_probe.cu && ./gemv_probe
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_row_sum.cuh"

// Packed: chunk (column group c, block of K kb) = 1,024 values at (c · nkb + kb) · 1024; lane
// L = 4g + t holds values L · 32 .. L · 32 + 32: the four 16-byte vectors GemvMma::load_w
// gives it from the rows (row 16c + g at k = 64kb + 16t, + 8; row 16c + g + 8 likewise).
__global__ void pack(const bf16 *w, bf16 *p, int N, int K) {
    const int nkb = K / MMA_KB;
    const size_t total = (size_t)N * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t chunk = i / 1024;
        const int within = i % 1024, lane = within / 32, j = (within % 32) / 8, e = within % 8;
        const int c = chunk / nkb, kb = chunk % nkb, g = lane >> 2, t = lane & 3;
        const int row = c * 16 + g + (j >= 2 ? 8 : 0);
        const int k = kb * MMA_KB + 16 * t + (j & 1) * 8 + e;
        p[i] = w[(size_t)row * K + k];
    }
}

// GemvMma<bf16, ·, false>'s decode (M = 1, N a multiple of 16), lean: one tile of partial
// sums and 16 threads adding them.
template <bool PACKED>
__global__ void GEMV_BOUNDS lean(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
                                 bf16 *__restrict__ y, const int N, const int K) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int c = blockIdx.x, n0 = c * 16, nkb = K / MMA_KB;
    const bf16 *base = PACKED ? w + (size_t)c * nkb * 1024 + lane * 32 : w + (size_t)(n0 + g) * K;
    auto load_w = [&](int kb, uint4 *v) {
        if constexpr (PACKED) {
            const uint4 *s = reinterpret_cast<const uint4 *>(base + (size_t)kb * 1024);
            v[0] = s[0];
            v[1] = s[1];
            v[2] = s[2];
            v[3] = s[3];
        } else {
            const int k0 = kb * MMA_KB + 16 * t;
            v[0] = *reinterpret_cast<const uint4 *>(base + k0);
            v[1] = *reinterpret_cast<const uint4 *>(base + k0 + 8);
            v[2] = *reinterpret_cast<const uint4 *>(base + (size_t)8 * K + k0);
            v[3] = *reinterpret_cast<const uint4 *>(base + (size_t)8 * K + k0 + 8);
        }
    };
    uint4 ring[4];
    if (warp < nkb) load_w(warp, ring);
    pdl_enter();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int kb = warp; kb < nkb; kb += GEMV_WARPS) {
        const int k0 = kb * MMA_KB + 16 * t;
        const unsigned *wl = reinterpret_cast<const unsigned *>(&ring[0]);
        const unsigned *wh = reinterpret_cast<const unsigned *>(&ring[2]);
        uint4 xr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
        if (g == 0) {
            xr[0] = *reinterpret_cast<const uint4 *>(x + k0);
            xr[1] = *reinterpret_cast<const uint4 *>(x + k0 + 8);
        }
        const unsigned *xw = reinterpret_cast<const unsigned *>(xr);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const unsigned a[4] = {wl[2 * j], wh[2 * j], wl[2 * j + 1], wh[2 * j + 1]};
            const unsigned b[2] = {xw[2 * j], xw[2 * j + 1]};
            mma16816<bf16>(acc, a, b);
        }
        if (kb + GEMV_WARPS < nkb) load_w(kb + GEMV_WARPS, ring);
    }
    row_partials_to_y(acc, y, n0, N);
}

// GemvMma<bf16, 1, false> alone, M as the step gives it (kestrel_gemv_row_mma_* with M
// not known to the compiler).
__global__ void GEMV_BOUNDS engine_alone(const bf16 *x, const bf16 *w, bf16 *y, int M, int N, int K) {
    GemvMma<bf16, 1, false> g{};
    g.prefetch(w, N, K, GEMV_MMA);
    pdl_enter();
    g.finish(x, y, M, N, K, GEMV_MMA);
}

// kestrel_gemv_row_mma_* with a ring DEPTH blocks of K deep (the shipped one: 1).
template <int DEPTH, int MIN_BLOCKS = GEMV_MIN_BLOCKS>
__global__ void __launch_bounds__(GEMV_WARPS * WARP, MIN_BLOCKS) row_depth(const bf16 *x, const bf16 *w, bf16 *y, int N, int K) {
    GemvMma<bf16, 1, false, DEPTH> g{};
    g.prefetch(w, N, K, GEMV_MMA);
    pdl_enter();
    g.finish(x, y, 1, N, K, GEMV_MMA);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    bf16 *x;
    bf16 *y0, *y1, *y2;
    unsigned *sink;
    CK(cudaMalloc(&x, 11008 * 2));
    CK(cudaMalloc(&y0, 22016 * 2));
    CK(cudaMalloc(&y1, 22016 * 2));
    CK(cudaMalloc(&y2, 22016 * 2));
    CK(cudaMalloc(&sink, 4));
    {
        std::vector<bf16> hx(11008);
        for (int i = 0; i < 11008; ++i) hx[i] = __float2bfloat16((rand() % 2001 - 1000) / 1000.f);
        CK(cudaMemcpy(x, hx.data(), 11008 * 2, cudaMemcpyHostToDevice));
    }
    LaunchTimer timer;
    const int reps = 60;
    printf("%-8s %8s %10s %10s %10s %10s %10s %10s  (us a launch, TB/s)\n", "shape", "MB", "4 tiles",
           "one tile", "lean rows", "lean packed", "stream", "same bits");
    for (auto s : PROJECTIONS) {
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies), p(copies);
        for (int i = 0; i < copies; ++i) {
            w[i] = random_bf16(elems, 12345u + i);
            CK(cudaMalloc(&p[i], bytes));
            pack<<<1024, 256>>>(w[i], p[i], s.n, s.k);
        }
        CK(cudaDeviceSynchronize());
        const int blocks = s.n / 16;
        auto time = [&](auto launch) { return timer.us(launch, copies, reps); };
        auto shipped = [&](int i, bf16 *y) {
            kestrel_gemv_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y, 1, s.n, s.k, GEMV_MMA);
        };
        auto lean_rows = [&](int i, bf16 *y) { lean<false><<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y, s.n, s.k); };
        auto lean_packed = [&](int i, bf16 *y) { lean<true><<<blocks, GEMV_WARPS * WARP>>>(x, p[i], y, s.n, s.k); };
        float t_ship = time([&](int i) { shipped(i, y0); });
        float t_one = time([&](int i) {
            kestrel_gemv_one_tile_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y0, 1, s.n, s.k, GEMV_MMA);
        });
        float t_rows = time([&](int i) { lean_rows(i, y1); });
        float t_packed = time([&](int i) { lean_packed(i, y2); });
        float t_alone = time([&](int i) {
            engine_alone<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y1, 1, s.n, s.k);
        });
        float t_m1 = time([&](int i) {
            kestrel_gemv_row_mma_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y2, 1, s.n, s.k, GEMV_MMA);
        });
        // Rings of 1 to 4 blocks of K (4 at 2 blocks' registers: it spills at 3).
        void (*const rings[4])(const bf16 *, const bf16 *, bf16 *, int, int) = {
            row_depth<1>, row_depth<2>, row_depth<3>, row_depth<4, 2>};
        float t_d[4];
        for (int r = 0; r < 4; ++r)
            t_d[r] = time([&](int i) { rings[r]<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y2, s.n, s.k); });
        float t_deep = time([&](int i) {
            kestrel_gemv_row_mma_deep_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y2, 1, s.n, s.k, GEMV_MMA);
        });
        float t_st = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        CK(cudaGetLastError());
        // Each gemv of copy 0 against the shipped kernel's bits.
        std::vector<unsigned short> want(s.n), got(s.n);
        shipped(0, y0);
        CK(cudaMemcpy(want.data(), y0, s.n * 2, cudaMemcpyDeviceToHost));
        bool same = true;
        auto check = [&](auto launch) {
            launch();
            CK(cudaMemcpy(got.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
            same &= got == want;
        };
        check([&] {
            kestrel_gemv_one_tile_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, 1, s.n, s.k, GEMV_MMA);
        });
        check([&] { lean_rows(0, y1); });
        check([&] { lean_packed(0, y1); });
        check([&] { engine_alone<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, 1, s.n, s.k); });
        check([&] {
            kestrel_gemv_row_mma_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, 1, s.n, s.k, GEMV_MMA);
        });
        for (auto ring : rings) check([&] { ring<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, s.n, s.k); });
        check([&] {
            kestrel_gemv_row_mma_deep_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, 1, s.n, s.k, GEMV_MMA);
        });
        auto tb = [&](float us) { return bytes / (us * 1e-6) / 1e12; };
        printf("%-8s %8.1f %5.1f %4.2f %5.1f %4.2f %5.1f %4.2f %5.1f %4.2f %5.1f %4.2f  %s\n", s.name,
               bytes / 1e6, t_ship, tb(t_ship), t_one, tb(t_one), t_rows, tb(t_rows), t_packed,
               tb(t_packed), t_st, tb(t_st), same ? "yes" : "NO");
        printf("%-8s engine alone %5.1f, row_mma (M = 1 known) %5.1f\n", "", t_alone, t_m1);
        printf("%-8s row_mma_deep (ring of 2) %5.1f\n", "", t_deep);
        printf("%-8s row_mma ring depth 1, 2, 3, 4 (2 blocks' registers): %5.1f %5.1f %5.1f %5.1f\n", "", t_d[0], t_d[1], t_d[2], t_d[3]);
        for (int i = 0; i < copies; ++i) {
            CK(cudaFree(w[i]));
            CK(cudaFree(p[i]));
        }
    }
    return 0;
}

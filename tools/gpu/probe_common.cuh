// What the standalone GPU probes (tools/gpu/*_probe.cu, built with nvcc and run alone on the
// GPU machine) share: the error check, a plain streaming read (the bandwidth ceiling a gemv
// is measured against), and weights filled with a hash of their index.
#pragma once
#include <cstdio>
#include <cmath>
#include <cstdlib>
#include <cuda_bf16.h>
#include <vector>

#define CK(x)                                                                                  \
    do {                                                                                       \
        cudaError_t e = (x);                                                                   \
        if (e != cudaSuccess) {                                                                \
            printf("%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e));                  \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

typedef __nv_bfloat16 bf16;

// Every byte read once, 4 vectors in flight a thread, grid-stride.
__global__ void stream_read(const uint4 *w, size_t n16, unsigned *sink) {
    unsigned acc = 0;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 a = w[i], b = w[i + stride], c = w[i + 2 * stride], d = w[i + 3 * stride];
        acc ^= a.x ^ b.y ^ c.z ^ d.w;
    }
    for (; i < n16; i += stride) acc ^= w[i].x;
    if (acc == 0x12345678u) sink[0] = acc;
}

// `elems` bf16 values in [-1, 1) from a linear congruential hash seeded with `seed`, on the
// device.
inline bf16 *random_bf16(size_t elems, unsigned seed) {
    std::vector<bf16> h(elems);
    unsigned st = seed;
    for (size_t j = 0; j < elems; ++j) {
        st = st * 1664525u + 1013904223u;
        // (int): unsigned, values below 1,000 wrapped to ~4.3e6 (every probe before session 60).
        h[j] = __float2bfloat16(((int)((st >> 9) % 2000) - 1000) / 1000.f);
    }
    bf16 *d;
    CK(cudaMalloc(&d, elems * 2));
    CK(cudaMemcpy(d, h.data(), elems * 2, cudaMemcpyHostToDevice));
    return d;
}

// µs a launch of `launch(copy)` over `reps` launches after 5 to warm up, cycling through
// `copies` copies of the weights (enough that none is still in L2 when it comes round again).
struct LaunchTimer {
    cudaEvent_t e0, e1;
    LaunchTimer() {
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
    }
    template <typename F> float us(F launch, int copies, int reps) {
        for (int r = 0; r < 5; ++r) launch(r % copies);
        CK(cudaEventRecord(e0));
        for (int r = 0; r < reps; ++r) launch(r % copies);
        CK(cudaEventRecord(e1));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        return 1e3f * ms / reps;
    }
};

// A projection's weight [n, k]: Llama-2-7B's four, then SmolLM2's (s_*).
struct ProbeShape {
    const char *name;
    int n, k;
};
constexpr ProbeShape PROJECTIONS[] = {{"qkv", 12288, 4096},  {"o_proj", 4096, 4096}, {"gate_up", 22016, 4096},
                                      {"down", 4096, 11008}, {"s_qkv", 960, 576},    {"s_o", 576, 576},
                                      {"s_gu", 3072, 576},   {"s_down", 576, 1536}};

// Largest error of each output `y[n]` of `w [n, k] · x` against a double reference, relative to
// the sum of its terms' magnitudes (the bf16 output's rounding is ~4e-3 of that), over outputs
// `ys` (several kernels' outputs, one error each).
inline std::vector<double> max_rel_errors(const std::vector<bf16> &w, const std::vector<bf16> &x,
                                          const std::vector<const std::vector<bf16> *> &ys, int n, int k) {
    std::vector<double> worst(ys.size(), 0.0);
    for (int r = 0; r < n; ++r) {
        double ref = 0, mag = 0;
        for (int i = 0; i < k; ++i) {
            const double p = (double)__bfloat162float(w[(size_t)r * k + i]) * __bfloat162float(x[i]);
            ref += p;
            mag += fabs(p);
        }
        for (size_t j = 0; j < ys.size(); ++j)
            worst[j] = fmax(worst[j], fabs(__bfloat162float((*ys[j])[r]) - ref) / mag);
    }
    return worst;
}

// Probe: can a decode row's gemv feed the tensor cores in the standard k order (MMA j of a
// block of 64 takes k 16j … 16j + 15, the order ldmatrix and wgmma's shared-memory operands
// give) as fast as in GemvMma's own order (MMA j takes k 16t + 4j … + 3 of each lane group t,
// which makes a lane's loads 32 contiguous bytes but no layout a 16-byte copy produces)? The
// candidate stages each warp's 2 KiB block of K with cp.async into shared memory (rows padded
// to 144 bytes) and takes the A fragments with ldmatrix, DEPTH blocks of K in flight a warp.
// Times it against the shipped one-row kernels on Llama-2-7B's and SmolLM2's projections. Its
// bits differ from the shipped kernel's (other products share an MMA); it must agree with a
// double reference as closely as the shipped kernel does.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o korder_probe tools/gpu/korder_probe.cu && ./korder_probe
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_row_sum.cuh"
#include <cmath>

#define STD_LD 72 // a staged weight row of one block of K: 64 values + 8 of padding

__device__ __forceinline__ void ldmatrix_x4(unsigned *a, const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                 : "r"(s));
}

template <int DEPTH>
__global__ void GEMV_BOUNDS row_std(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
                                    bf16 *__restrict__ y, const int N, const int K) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, nkb = K / MMA_KB;
    __shared__ __align__(16) bf16 st[GEMV_WARPS][DEPTH][16][STD_LD];
    // Lane L copies pieces L + 32q (q < 4) of the 16 rows × 8 pieces of 16 bytes.
    auto issue = [&](const int kb, const int stage) {
        if (kb < nkb) {
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int p = lane + 32 * q, r = p / 8, c = p % 8;
                cp_async16(&st[warp][stage][r][8 * c], w + (size_t)min(n0 + r, N - 1) * K + kb * MMA_KB + 8 * c);
            }
        }
        asm volatile("cp.async.commit_group;\n" ::);
    };
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) issue(warp + s * GEMV_WARPS, s);
    pdl_enter();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int lrow = (lane & 7) + ((lane >> 3) & 1) * 8, lcol = (lane >> 4) * 8;
    const unsigned *xw = reinterpret_cast<const unsigned *>(x);
    int i = 0;
    for (int kb = warp; kb < nkb; kb += GEMV_WARPS, ++i) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(DEPTH - 1));
        __syncwarp(); // every lane's copies of this block are in
        const int stage = i % DEPTH;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned a[4];
            ldmatrix_x4(a, &st[warp][stage][lrow][16 * j + lcol]);
            const int w0 = kb * 32 + 8 * j + t; // x's word (k 2w0, 2w0 + 1)
            const unsigned b[2] = {g == 0 ? xw[w0] : 0u, g == 0 ? xw[w0 + 4] : 0u};
            mma16816<bf16>(acc, a, b);
        }
        __syncwarp(); // every lane is done with the stage before it is refilled
        issue(kb + DEPTH * GEMV_WARPS, stage);
    }
    row_partials_to_y(acc, y, n0, N);
}


// Lane t of a group of 4 holds row t of a 4 × 4 matrix of words m; afterwards it holds column
// t (m[j] = the old m[j] of lane j): the off-diagonal 2 × 2 blocks swap between lanes 2 apart,
// then each block transposes between lanes 1 apart (4 shuffles, 12 selects).
__device__ __forceinline__ void quad_transpose(unsigned *m, const int t) {
    const bool b = t & 2, a = t & 1;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned r = __shfl_xor_sync(0xffffffffu, b ? m[i] : m[2 + i], 2);
        const unsigned lo = b ? r : m[i], hi = b ? m[2 + i] : r;
        m[i] = lo;
        m[2 + i] = hi;
    }
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const unsigned r = __shfl_xor_sync(0xffffffffu, a ? m[2 * j] : m[2 * j + 1], 1);
        const unsigned lo = a ? r : m[2 * j], hi = a ? m[2 * j + 1] : r;
        m[2 * j] = lo;
        m[2 * j + 1] = hi;
    }
}

// The standard order from registers: lane (g, t) loads 32 contiguous bytes of rows g and
// g + 8 (words 8t … 8t + 7 of a block of K, as GemvMma does), which are MMA t's words; two
// quad transposes a row give it words 8j + t and 8j + t + 4 for every MMA j. Ring of DEPTH
// blocks of K a warp in registers.
template <int DEPTH>
__global__ void GEMV_BOUNDS row_std_shfl(const bf16 *__restrict__ x, const bf16 *__restrict__ w,
                                         bf16 *__restrict__ y, const int N, const int K) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int n0 = blockIdx.x * 16, nkb = K / MMA_KB;
    const bf16 *w_lo = w + (size_t)min(n0 + g, N - 1) * K + 16 * t;
    const bf16 *w_hi = w + (size_t)min(n0 + g + 8, N - 1) * K + 16 * t;
    uint4 ring[DEPTH][4];
    auto load = [&](const int kb, uint4 *v) {
        if (kb < nkb) {
            const int k0 = kb * MMA_KB;
            v[0] = *reinterpret_cast<const uint4 *>(w_lo + k0);
            v[1] = *reinterpret_cast<const uint4 *>(w_lo + k0 + 8);
            v[2] = *reinterpret_cast<const uint4 *>(w_hi + k0);
            v[3] = *reinterpret_cast<const uint4 *>(w_hi + k0 + 8);
        }
    };
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) load(warp + s * GEMV_WARPS, ring[s]);
    pdl_enter();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const unsigned *xw = reinterpret_cast<const unsigned *>(x);
    constexpr int AHEAD = DEPTH * GEMV_WARPS;
    for (int kb0 = warp; kb0 < nkb; kb0 += AHEAD) {
#pragma unroll
        for (int s = 0; s < DEPTH; ++s) {
            const int kb = kb0 + s * GEMV_WARPS;
            if (kb >= nkb) break;
            // lo0: row g words 8t … 8t + 3 → after the transpose, words 8j + t (j = 0 … 3).
            unsigned lo0[4] = {ring[s][0].x, ring[s][0].y, ring[s][0].z, ring[s][0].w};
            unsigned lo1[4] = {ring[s][1].x, ring[s][1].y, ring[s][1].z, ring[s][1].w};
            unsigned hi0[4] = {ring[s][2].x, ring[s][2].y, ring[s][2].z, ring[s][2].w};
            unsigned hi1[4] = {ring[s][3].x, ring[s][3].y, ring[s][3].z, ring[s][3].w};
            quad_transpose(lo0, t);
            quad_transpose(lo1, t);
            quad_transpose(hi0, t);
            quad_transpose(hi1, t);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned a[4] = {lo0[j], hi0[j], lo1[j], hi1[j]};
                const int w0 = kb * 32 + 8 * j + t;
                const unsigned b[2] = {g == 0 ? xw[w0] : 0u, g == 0 ? xw[w0 + 4] : 0u};
                mma16816<bf16>(acc, a, b);
            }
            load(kb + AHEAD, ring[s]);
        }
    }
    row_partials_to_y(acc, y, n0, N);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    bf16 *x = random_bf16(11008, 7), *y0, *y1;
    unsigned *sink;
    CK(cudaMalloc(&y0, 22016 * 2));
    CK(cudaMalloc(&y1, 22016 * 2));
    CK(cudaMalloc(&sink, 4));
    std::vector<bf16> hx(11008);
    CK(cudaMemcpy(hx.data(), x, 11008 * 2, cudaMemcpyDeviceToHost));
    LaunchTimer timer;
    const int reps = 60;
    printf("us a launch: stream, shipped row_mma / row_mma_deep, standard order by ldmatrix at depth 1 / 2 (3 do not fit 48 KiB of shared memory), by shuffles at ring 1 / 2; "
           "max |error| / sum |terms| against double: shipped, standard\n");
    for (auto s : PROJECTIONS) {
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies);
        for (int i = 0; i < copies; ++i) w[i] = random_bf16(elems, 12345u + i);
        const int blocks = s.n / 16;
        auto time = [&](auto launch) { return timer.us(launch, copies, reps); };
        const float t_st = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        auto shipped = [&](int i, bf16 *y) {
            kestrel_gemv_row_mma_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y, 1, s.n, s.k, GEMV_MMA);
        };
        void (*const stds[4])(const bf16 *, const bf16 *, bf16 *, int, int) = {row_std<1>, row_std<2>, row_std_shfl<1>, row_std_shfl<2>};
        const float t_ship = time([&](int i) { shipped(i, y0); });
        const float t_deep = time([&](int i) {
            kestrel_gemv_row_mma_deep_bf16<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y0, 1, s.n, s.k, GEMV_MMA);
        });
        float t_std[4];
        for (int d = 0; d < 4; ++d)
            t_std[d] = time([&](int i) { stds[d]<<<blocks, GEMV_WARPS * WARP>>>(x, w[i], y1, s.n, s.k); });
        CK(cudaGetLastError());
        // Accuracy of copy 0 against a double reference.
        shipped(0, y0);
        stds[1]<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, s.n, s.k);
        std::vector<bf16> hw(elems), a(s.n), b(s.n), c(s.n);
        CK(cudaMemcpy(hw.data(), w[0], bytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(a.data(), y0, s.n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(b.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
        // Every standard-order variant gives the same bits.
        bool depths_agree = true;
        for (int d : {0, 2, 3}) {
            stds[d]<<<blocks, GEMV_WARPS * WARP>>>(x, w[0], y1, s.n, s.k);
            CK(cudaMemcpy(c.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
            for (int n = 0; n < s.n; ++n)
                depths_agree &= __bfloat16_as_ushort(c[n]) == __bfloat16_as_ushort(b[n]);
        }
        const std::vector<double> err = max_rel_errors(hw, hx, {&a, &b}, s.n, s.k);
        const double e_ship = err[0], e_std = err[1];
        printf("%-8s %5.1f | %5.1f %5.1f | %5.1f %5.1f | %5.1f %5.1f | %.2e %.2e%s\n", s.name, t_st, t_ship, t_deep,
               t_std[0], t_std[1], t_std[2], t_std[3], e_ship, e_std, depths_agree ? "" : "  VARIANTS DIFFER");
        for (int i = 0; i < copies; ++i) CK(cudaFree(w[i]));
    }
    return 0;
}

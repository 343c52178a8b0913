// Probe: weights stored in the tensor cores' fragment order, for a one-row gemv and a
// 64-row one that give every row the same bits.
//
// The shipped engines agree on GemvMma's k order, which makes a decode lane's loads 32
// contiguous bytes but which no 16-byte copy, ldmatrix or wgmma descriptor produces, so the
// tiled engine rebuilds each A fragment with ~40 register moves a block of K and verifies 64
// rows at ~2× a one-row step (issue 6 asks ≤ 1.25×). Here each 16-row strip × 16 k of the
// weights is stored once, at load, as the 32 lanes' m16n8k16 A fragments (16 bytes a lane,
// 512 a tile), as Marlin stores its 4-bit weights. Then:
//   row_frag   one row: a block a strip, warp c the strip's chain c (CHAINS contiguous runs of
//              k16 tiles), one 16-byte load and one MMA a tile, the chains' partial sums added
//              in chain order (as the shipped one-row path adds its warps').
//   tiled_frag M rows (M/8 MMAs a tile on the same A fragment): a block 8 strips × one chain,
//              a cluster of CHAINS blocks one 128-row slab; the rows' B fragments come from a
//              fragment-ordered copy of x through L1 (the cluster's blocks read one chain's
//              columns each, the block's 8 warps the same ones); the chains' partials meet in
//              distributed shared memory and are added in chain order.
// Same chain, same MMAs, same order: a row's output has the same bits at 1 row as at 64
// (checked, every row), and is as accurate as the shipped kernel (checked against double).
//   nvcc -O3 -std=c++17 -arch=sm_90 -o frag_probe tools/gpu/frag_probe.cu && ./frag_probe
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_row_sum.cuh"
#include <cmath>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;

constexpr int CHAINS = 8;        // = GEMV_WARPS: the one-row kernel's warps are the chains
constexpr int SLAB_STRIPS = 8;   // strips (16 rows) a tiled block takes: its 8 warps
static_assert(CHAINS == GEMV_WARPS, "row_partials_to_y adds one partial a warp");

__host__ __device__ inline int chain_begin(const int kt, const int c) { return kt * c / CHAINS; }

// Chains as the shipped one-row kernel deals K out: blocks of 4 k16 tiles (64 k), block b to
// chain b mod CHAINS, so a block's 8 warps read 8 adjacent blocks at a time (INTERLEAVED), or
// CHAINS contiguous runs of tiles. n-th tile of chain c, and the chain's length.
template <bool INTERLEAVED> __device__ __forceinline__ int chain_tile(const int kt, const int c, const int n) {
    return INTERLEAVED ? 4 * (c + CHAINS * (n / 4)) + n % 4 : chain_begin(kt, c) + n;
}
template <bool INTERLEAVED> __device__ __forceinline__ int chain_len(const int kt, const int c) {
    return INTERLEAVED ? 4 * max(0, (kt / 4 - c + CHAINS - 1) / CHAINS) : chain_begin(kt, c + 1) - chain_begin(kt, c);
}

// w [N, K] row-major → tile (strip s, k16 kc) at uint4 (s·KT + kc)·32 + lane: lane (g, t)'s
// A fragment {rows g, g+8} × {k 2t…2t+1, 2t+8…2t+9} in mma.m16n8k16's register order.
__global__ void to_frag(const bf16 *__restrict__ w, uint4 *__restrict__ wf, const int N, const int K) {
    const int kt = K / 16;
    const size_t idx = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (idx >= (size_t)(N / 16) * kt * 32) return;
    const int lane = idx % 32, g = lane >> 2, t = lane & 3;
    const size_t tile = idx / 32;
    const int kc = tile % kt, s = tile / kt;
    const unsigned *w32 = reinterpret_cast<const unsigned *>(w);
    const size_t r0 = (size_t)(16 * s + g) * K / 2, r1 = (size_t)(16 * s + g + 8) * K / 2;
    const int k0 = 8 * kc + t; // word of k 2t, 2t + 1
    wf[idx] = make_uint4(w32[r0 + k0], w32[r1 + k0], w32[r0 + k0 + 4], w32[r1 + k0 + 4]);
}

// x [M, K] → for k16 kc and 8-row group j, uint2 (kc·(M/8) + j)·32 + lane: lane (g, t)'s B
// fragment (row 8j + g; k 2t…2t+1 and 2t+8…2t+9).
__global__ void x_to_frag(const bf16 *__restrict__ x, uint2 *__restrict__ xf, const int M, const int K) {
    const int kt = K / 16, groups = M / 8;
    const int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= kt * groups * 32) return;
    const int lane = idx % 32, g = lane >> 2, t = lane & 3, j = (idx / 32) % groups, kc = idx / 32 / groups;
    const unsigned *x32 = reinterpret_cast<const unsigned *>(x) + (size_t)(8 * j + g) * K / 2;
    xf[idx] = make_uint2(x32[8 * kc + t], x32[8 * kc + t + 4]);
}

// One row (x [K]); grid N/16, 8 warps. DEPTH tiles a lane has in flight.
template <int DEPTH, bool IL>
__global__ void GEMV_BOUNDS row_frag(const bf16 *__restrict__ x, const uint4 *__restrict__ wf,
                                     bf16 *__restrict__ y, const int N, const int K) {
    const int lane = threadIdx.x % WARP, c = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int kt = K / 16, s = blockIdx.x, len = chain_len<IL>(kt, c);
    const uint4 *src = wf + ((size_t)s * kt) * 32 + lane;
    uint4 ring[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (d < len) ring[d] = __ldg(src + (size_t)chain_tile<IL>(kt, c, d) * 32);
    pdl_enter();
    const unsigned *xw = reinterpret_cast<const unsigned *>(x);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int n0 = 0; n0 < len; n0 += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int n = n0 + d;
            if (n < len) {
                const int kc = chain_tile<IL>(kt, c, n);
                const unsigned a[4] = {ring[d].x, ring[d].y, ring[d].z, ring[d].w};
                const unsigned b[2] = {g == 0 ? xw[8 * kc + t] : 0u, g == 0 ? xw[8 * kc + t + 4] : 0u};
                mma16816<bf16>(acc, a, b);
                if (n + DEPTH < len) ring[d] = __ldg(src + (size_t)chain_tile<IL>(kt, c, n + DEPTH) * 32);
            }
        }
    }
    row_partials_to_y(acc, y, 16 * s, N);
}

// M rows (x in x_to_frag's order); grid (slabs of 128 rows, CHAINS), clusters of CHAINS
// blocks along y, 8 warps. Writes y [M, N].
template <int M, int DEPTH, bool IL>
__global__ void __cluster_dims__(1, CHAINS, 1) __launch_bounds__(SLAB_STRIPS * WARP)
    tiled_frag(const uint2 *__restrict__ xf, const uint4 *__restrict__ wf, bf16 *__restrict__ y,
               const int N, const int K) {
    constexpr int G = M / 8;
    __shared__ float part[SLAB_STRIPS * 16][M];
    cg::cluster_group cluster = cg::this_cluster();
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int kt = K / 16, c = blockIdx.y, s = blockIdx.x * SLAB_STRIPS + warp;
    const int len = chain_len<IL>(kt, c);
    float acc[G][4] = {};
    if (16 * s < N) {
        const uint4 *src = wf + ((size_t)s * kt) * 32 + lane;
        uint4 ring[DEPTH];
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
            if (d < len) ring[d] = __ldg(src + (size_t)chain_tile<IL>(kt, c, d) * 32);
        pdl_enter();
        for (int n0 = 0; n0 < len; n0 += DEPTH) {
#pragma unroll
            for (int d = 0; d < DEPTH; ++d) {
                const int n = n0 + d;
                if (n < len) {
                    const int kc = chain_tile<IL>(kt, c, n);
                    const unsigned a[4] = {ring[d].x, ring[d].y, ring[d].z, ring[d].w};
                    const uint2 *xs = xf + (size_t)kc * G * 32 + lane;
#pragma unroll
                    for (int j = 0; j < G; ++j) {
                        const uint2 bv = __ldg(xs + j * 32);
                        const unsigned b[2] = {bv.x, bv.y};
                        mma16816<bf16>(acc[j], a, b);
                    }
                    if (n + DEPTH < len) ring[d] = __ldg(src + (size_t)chain_tile<IL>(kt, c, n + DEPTH) * 32);
                }
            }
        }
    }
#pragma unroll
    for (int j = 0; j < G; ++j) {
        part[16 * warp + g][8 * j + 2 * t] = acc[j][0];
        part[16 * warp + g][8 * j + 2 * t + 1] = acc[j][1];
        part[16 * warp + g + 8][8 * j + 2 * t] = acc[j][2];
        part[16 * warp + g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    cluster.sync();
    // Block c adds slice c of the slab's outputs over the chains, in chain order.
    constexpr int OUTS = SLAB_STRIPS * 16 * M, SLICE = OUTS / CHAINS;
    const int rank = cluster.block_rank();
    for (int o = rank * SLICE + threadIdx.x; o < (rank + 1) * SLICE; o += blockDim.x) {
        const int r = o / M, m = o % M, n = blockIdx.x * SLAB_STRIPS * 16 + r;
        float total = 0.f;
#pragma unroll
        for (int q = 0; q < CHAINS; ++q) total += cluster.map_shared_rank(&part[0][0], q)[o];
        if (n < N) y[(size_t)m * N + n] = __float2bfloat16(total);
    }
    cluster.sync(); // no block leaves while another reads its partials
}

template <int M, int DEPTH, bool IL = true> void launch_tiled(const uint2 *xf, const uint4 *wf, bf16 *y, int N, int K) {
    const dim3 grid((N + SLAB_STRIPS * 16 - 1) / (SLAB_STRIPS * 16), CHAINS);
    tiled_frag<M, DEPTH, IL><<<grid, SLAB_STRIPS * WARP>>>(xf, wf, y, N, K);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    constexpr int MR = 64;
    const int KMAX = 11008, NMAX = 22016;
    bf16 *x = random_bf16((size_t)MR * KMAX, 7), *y0, *y1, *yt;
    uint2 *xf;
    unsigned *sink;
    CK(cudaMalloc(&y0, NMAX * 2));
    CK(cudaMalloc(&y1, NMAX * 2));
    CK(cudaMalloc(&yt, (size_t)MR * NMAX * 2));
    CK(cudaMalloc(&xf, (size_t)MR * KMAX * 2));
    CK(cudaMalloc(&sink, 4));
    LaunchTimer timer;
    const int reps = 60;
    printf("us a launch: stream | shipped row_mma, row_mma_deep | row_frag contiguous chains depth 8; interleaved depth 4, 8 | "
           "tiled_frag (interleaved) 16, 32, 64 rows (depth 4) | 64 rows: contiguous depth 4; interleaved depth 2, 8 | "
           "tiled 64 ÷ stream | bits 1 row = 64 rows | max err/|terms|: shipped, frag\n");
    for (auto s : PROJECTIONS) {
        const size_t elems = (size_t)s.n * s.k, bytes = elems * 2;
        const int copies = (int)((600ull << 20) / bytes) + 1;
        std::vector<bf16 *> w(copies);
        std::vector<uint4 *> wf(copies);
        for (int i = 0; i < copies; ++i) {
            w[i] = random_bf16(elems, 12345u + i);
            CK(cudaMalloc(&wf[i], bytes));
            to_frag<<<(unsigned)((elems / 8 + 255) / 256), 256>>>(w[i], wf[i], s.n, s.k);
        }
        CK(cudaDeviceSynchronize());
        auto time = [&](auto launch) { return timer.us(launch, copies, reps); };
        const int strips = s.n / 16;
        const float t_st = time([&](int i) {
            stream_read<<<sms * 4, 512>>>(reinterpret_cast<const uint4 *>(w[i]), bytes / 16, sink);
        });
        const float t_ship = time([&](int i) {
            kestrel_gemv_row_mma_bf16<<<strips, GEMV_WARPS * WARP>>>(x, w[i], y0, 1, s.n, s.k, GEMV_MMA);
        });
        const float t_deep = time([&](int i) {
            kestrel_gemv_row_mma_deep_bf16<<<strips, GEMV_WARPS * WARP>>>(x, w[i], y0, 1, s.n, s.k, GEMV_MMA);
        });
        const float t_c8 = time([&](int i) { row_frag<8, false><<<strips, GEMV_WARPS * WARP>>>(x, wf[i], y1, s.n, s.k); });
        const float t_f4 = time([&](int i) { row_frag<4, true><<<strips, GEMV_WARPS * WARP>>>(x, wf[i], y1, s.n, s.k); });
        const float t_f8 = time([&](int i) { row_frag<8, true><<<strips, GEMV_WARPS * WARP>>>(x, wf[i], y1, s.n, s.k); });
        const int xthreads = s.k / 16 * (MR / 8) * 32;
        x_to_frag<<<(xthreads + 255) / 256, 256>>>(x, xf, MR, s.k);
        const float t_16 = time([&](int i) { launch_tiled<16, 4>(xf, wf[i], yt, s.n, s.k); });
        const float t_32 = time([&](int i) { launch_tiled<32, 4>(xf, wf[i], yt, s.n, s.k); });
        const float t_64 = time([&](int i) { launch_tiled<64, 4>(xf, wf[i], yt, s.n, s.k); });
        const float t_64c = time([&](int i) { launch_tiled<64, 4, false>(xf, wf[i], yt, s.n, s.k); });
        const float t_64d2 = time([&](int i) { launch_tiled<64, 2>(xf, wf[i], yt, s.n, s.k); });
        const float t_64d8 = time([&](int i) { launch_tiled<64, 8>(xf, wf[i], yt, s.n, s.k); });
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        // Bits: every one of the 64 rows through row_frag alone against the tiled product.
        x_to_frag<<<(xthreads + 255) / 256, 256>>>(x, xf, MR, s.k);
        launch_tiled<64, 4>(xf, wf[0], yt, s.n, s.k);
        std::vector<bf16> tiled((size_t)MR * s.n), one(s.n), ship(s.n);
        CK(cudaMemcpy(tiled.data(), yt, (size_t)MR * s.n * 2, cudaMemcpyDeviceToHost));
        bool same = true;
        for (int m = 0; m < MR; ++m) {
            row_frag<4, true><<<strips, GEMV_WARPS * WARP>>>(x + (size_t)m * s.k, wf[0], y1, s.n, s.k);
            CK(cudaMemcpy(one.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
            for (int n = 0; n < s.n; ++n)
                same &= __bfloat16_as_ushort(one[n]) == __bfloat16_as_ushort(tiled[(size_t)m * s.n + n]);
        }
        // Accuracy of row 0 (copy 0) against double, shipped and fragment-ordered.
        kestrel_gemv_row_mma_bf16<<<strips, GEMV_WARPS * WARP>>>(x, w[0], y0, 1, s.n, s.k, GEMV_MMA);
        row_frag<4, true><<<strips, GEMV_WARPS * WARP>>>(x, wf[0], y1, s.n, s.k);
        std::vector<bf16> hw(elems), hx(s.k);
        CK(cudaMemcpy(hw.data(), w[0], bytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hx.data(), x, s.k * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ship.data(), y0, s.n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(one.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
        double e_ship = 0, e_frag = 0;
        for (int n = 0; n < s.n; ++n) {
            double ref = 0, mag = 0;
            for (int k = 0; k < s.k; ++k) {
                const double p = (double)__bfloat162float(hw[(size_t)n * s.k + k]) * __bfloat162float(hx[k]);
                ref += p;
                mag += fabs(p);
            }
            e_ship = fmax(e_ship, fabs(__bfloat162float(ship[n]) - ref) / mag);
            e_frag = fmax(e_frag, fabs(__bfloat162float(one[n]) - ref) / mag);
        }
        printf("%-8s %5.1f | %5.1f %5.1f | %5.1f; %5.1f %5.1f | %5.1f %5.1f %5.1f | %5.1f; %5.1f %5.1f | %.2f | %s | %.2e %.2e\n",
               s.name, t_st, t_ship, t_deep, t_c8, t_f4, t_f8, t_16, t_32, t_64, t_64c, t_64d2, t_64d8, t_64 / t_st,
               same ? "same" : "DIFFER", e_ship, e_frag);
        for (int i = 0; i < copies; ++i) {
            CK(cudaFree(w[i]));
            CK(cudaFree(wf[i]));
        }
    }
    return 0;
}

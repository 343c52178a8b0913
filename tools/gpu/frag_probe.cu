// Probe: weights stored in the tensor cores' fragment order, for a one-row gemv and a
// 64-row one that give every row the same bits.
//
// The shipped engines agree on GemvMma's k order, which makes a decode lane's loads 32
// contiguous bytes but which no 16-byte copy, ldmatrix or wgmma descriptor produces, so the
// tiled engine rebuilds each A fragment with ~40 register moves a block of K and verifies 64
// rows at ~2× a one-row step (issue 6 asks ≤ 1.25×). Here each 16-row strip × 16 k of the
// weights is stored once, at load, as the 32 lanes' m16n8k16 A fragments (16 bytes a lane,
// 512 a tile), as Marlin stores its 4-bit weights. Then:
//   row_frag_x one row: a block a strip, its 8 warps the strip's 8 chains (64-k blocks dealt
//              out b mod 8, as the shipped kernel deals its blocks), a lane's 4 fragments of a
//              block in 4 coalesced 16-byte loads, x pre-ordered so that its share of a block is
//              2 16-byte loads; the chains' partial sums added in chain order (as the shipped
//              one-row path adds its warps'). (Session 45's first builds, commit 25a832d, took
//              x a word per MMA and chains of contiguous tiles: 10-40% slower than shipped.)
//   tiled_frag M rows (M/8 MMAs a tile on the same A fragment): a block S strips × one chain,
//              a cluster of CHAINS blocks one slab; the rows' B fragments come from a
//              fragment-ordered copy of x through L1 (the block's warps read the same ones);
//              the chains' partials meet in distributed shared memory, added in chain order.
//   tiled_frag_parts + reduce_parts: the same products, the partials through global memory;
//              B_AHEAD requests the next tile's B fragments before this tile's MMAs.
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
constexpr int SLAB_STRIPS = 8;   // strips (16 rows) a tiled block takes by default: a warp each
static_assert(CHAINS == GEMV_WARPS, "row_partials_to_y adds one partial a warp");

// Chains as the shipped one-row kernel deals K out: blocks of 4 k16 tiles (64 k), block b to
// chain b mod CHAINS, so a block's 8 warps read 8 adjacent blocks at a time (contiguous runs
// of tiles a chain were slower: build 2, commit 2110b72). n-th tile of chain c, and the
// chain's length.
__device__ __forceinline__ int chain_tile(const int c, const int n) { return 4 * (c + CHAINS * (n / 4)) + n % 4; }
__device__ __forceinline__ int chain_len(const int kt, const int c) {
    return 4 * max(0, (kt / 4 - c + CHAINS - 1) / CHAINS);
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

// M rows (x in x_to_frag's order); grid (slabs of 128 rows, CHAINS), clusters of CHAINS
// blocks along y, 8 warps. Writes y [M, N].
// The chains' products of a slab of S strips for M rows, each warp one strip's (in acc).
template <int M, int DEPTH, int S, bool B_AHEAD = false>
__device__ __forceinline__ void slab_chain(const uint2 *__restrict__ xf, const uint4 *__restrict__ wf,
                                           const int N, const int K, float (*acc)[4]) {
    constexpr int G = M / 8;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int kt = K / 16, c = blockIdx.y, s = blockIdx.x * S + warp;
    const int len = chain_len(kt, c);
    if (16 * s >= N) return;
    const uint4 *src = wf + ((size_t)s * kt) * 32 + lane;
    uint4 ring[DEPTH];
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (d < len) ring[d] = __ldg(src + (size_t)chain_tile(c, d) * 32);
    // B_AHEAD: the next tile's B fragments are requested before this tile's MMAs (Nsight
    // Compute put 72% of a warp's cycles in waits on the B loads issued just before them).
    uint2 bnext[G];
    auto load_b = [&](const int n) {
        const uint2 *xs = xf + (size_t)chain_tile(c, n) * G * 32 + lane;
#pragma unroll
        for (int j = 0; j < G; ++j) bnext[j] = __ldg(xs + j * 32);
    };
    if (B_AHEAD && len > 0) load_b(0);
    for (int n0 = 0; n0 < len; n0 += DEPTH) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int n = n0 + d;
            if (n < len) {
                const unsigned a[4] = {ring[d].x, ring[d].y, ring[d].z, ring[d].w};
                if (!B_AHEAD) load_b(n);
                uint2 bcur[G];
#pragma unroll
                for (int j = 0; j < G; ++j) bcur[j] = bnext[j];
                if (B_AHEAD && n + 1 < len) load_b(n + 1);
#pragma unroll
                for (int j = 0; j < G; ++j) {
                    const unsigned b[2] = {bcur[j].x, bcur[j].y};
                    mma16816<bf16>(acc[j], a, b);
                }
                if (n + DEPTH < len) ring[d] = __ldg(src + (size_t)chain_tile(c, n + DEPTH) * 32);
            }
        }
    }
}

// Without a cluster: each block writes its chain's partials to parts [CHAINS][M][N] (f32);
// reduce_parts adds them in chain order.
template <int M, int DEPTH, int S, bool B_AHEAD = false>
__global__ void __launch_bounds__(S * WARP) tiled_frag_parts(const uint2 *__restrict__ xf, const uint4 *__restrict__ wf,
                                                             float *__restrict__ parts, const int N, const int K) {
    float acc[M / 8][4] = {};
    slab_chain<M, DEPTH, S, B_AHEAD>(xf, wf, N, K, acc);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int n = (blockIdx.x * S + warp) * 16 + g;
    float *p = parts + (size_t)blockIdx.y * M * N;
#pragma unroll
    for (int j = 0; j < M / 8; ++j) {
        const int m = 8 * j + 2 * t;
        if (n < N) {
            p[(size_t)m * N + n] = acc[j][0];
            p[(size_t)(m + 1) * N + n] = acc[j][1];
        }
        if (n + 8 < N) {
            p[(size_t)m * N + n + 8] = acc[j][2];
            p[(size_t)(m + 1) * N + n + 8] = acc[j][3];
        }
    }
}

__global__ void reduce_parts(const float *__restrict__ parts, bf16 *__restrict__ y, const int MN) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float total = 0.f;
#pragma unroll
    for (int q = 0; q < CHAINS; ++q) total += parts[(size_t)q * MN + i];
    y[i] = __float2bfloat16(total);
}

template <int M, int DEPTH, int S = SLAB_STRIPS>
__global__ void __cluster_dims__(1, CHAINS, 1) __launch_bounds__(S * WARP)
    tiled_frag(const uint2 *__restrict__ xf, const uint4 *__restrict__ wf, bf16 *__restrict__ y,
               const int N, const int K) {
    constexpr int G = M / 8;
    __shared__ float part[S * 16][M];
    cg::cluster_group cluster = cg::this_cluster();
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    float acc[G][4] = {};
    slab_chain<M, DEPTH, S>(xf, wf, N, K, acc);
#pragma unroll
    for (int j = 0; j < G; ++j) {
        part[16 * warp + g][8 * j + 2 * t] = acc[j][0];
        part[16 * warp + g][8 * j + 2 * t + 1] = acc[j][1];
        part[16 * warp + g + 8][8 * j + 2 * t] = acc[j][2];
        part[16 * warp + g + 8][8 * j + 2 * t + 1] = acc[j][3];
    }
    cluster.sync();
    // Block c adds slice c of the slab's outputs over the chains, in chain order.
    constexpr int OUTS = S * 16 * M, SLICE = OUTS / CHAINS;
    const int rank = cluster.block_rank();
    for (int o = rank * SLICE + threadIdx.x; o < (rank + 1) * SLICE; o += blockDim.x) {
        const int r = o / M, m = o % M, n = blockIdx.x * S * 16 + r;
        float total = 0.f;
#pragma unroll
        for (int q = 0; q < CHAINS; ++q) total += cluster.map_shared_rank(&part[0][0], q)[o];
        if (n < N) y[(size_t)m * N + n] = __float2bfloat16(total);
    }
    cluster.sync(); // no block leaves while another reads its partials
}

template <int M, int DEPTH, int S = SLAB_STRIPS>
void launch_tiled(const uint2 *xf, const uint4 *wf, bf16 *y, int N, int K) {
    const dim3 grid((N + S * 16 - 1) / (S * 16), CHAINS);
    tiled_frag<M, DEPTH, S><<<grid, S * WARP>>>(xf, wf, y, N, K);
}

template <int M, int DEPTH, int S, bool B_AHEAD = false>
void launch_parts(const uint2 *xf, const uint4 *wf, float *parts, bf16 *y, int N, int K) {
    const dim3 grid((N + S * 16 - 1) / (S * 16), CHAINS);
    tiled_frag_parts<M, DEPTH, S, B_AHEAD><<<grid, S * WARP>>>(xf, wf, parts, N, K);
    reduce_parts<<<(M * N + 255) / 256, 256>>>(parts, y, M * N);
}

// x [K] → for 64-k block b and lane quad t, 8 words at (4b + t)·8: words 8(4b + j) + t and
// + 4 for j = 0…3 (tile 4b + j's B fragment), so a lane loads a block's x in two 16-byte loads.
__global__ void x_row_frag(const bf16 *__restrict__ x, unsigned *__restrict__ xr, const int K) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x; // (b, t, j, half)
    if (i >= K / 2) return;
    const int half = i % 2, j = (i / 2) % 4, t = (i / 8) % 4, b = i / 32;
    xr[i] = reinterpret_cast<const unsigned *>(x)[8 * (4 * b + j) + t + 4 * half];
}

// One row, x from x_row_frag, chains of whole 64-k blocks dealt out as the shipped kernel
// does, DEPTH blocks a warp in flight (4 fragments a block), every lane taking x (columns
// replicated, as GemvMma does): 2 x loads and 4 weight loads a block.
template <int DEPTH>
__global__ void GEMV_BOUNDS row_frag_x(const uint4 *__restrict__ xr, const uint4 *__restrict__ wf,
                                       bf16 *__restrict__ y, const int N, const int K) {
    const int lane = threadIdx.x % WARP, c = threadIdx.x / WARP, t = lane & 3;
    const int kt = K / 16, nb = kt / 4, s = blockIdx.x;
    const uint4 *src = wf + ((size_t)s * kt) * 32 + lane;
    uint4 ring[DEPTH][4];
    auto load = [&](const int b, uint4 *v) {
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = __ldg(src + (size_t)(4 * b + j) * 32);
    };
#pragma unroll
    for (int d = 0; d < DEPTH; ++d)
        if (c + d * CHAINS < nb) load(c + d * CHAINS, ring[d]);
    pdl_enter();
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    constexpr int AHEAD = DEPTH * CHAINS;
    for (int b0 = c; b0 < nb; b0 += AHEAD) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            const int b = b0 + d * CHAINS;
            if (b >= nb) break;
            const uint4 x0 = __ldg(xr + (4 * b + t) * 2), x1 = __ldg(xr + (4 * b + t) * 2 + 1);
            const unsigned xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned a[4] = {ring[d][j].x, ring[d][j].y, ring[d][j].z, ring[d][j].w};
                const unsigned bb[2] = {xw[2 * j], xw[2 * j + 1]};
                mma16816<bf16>(acc, a, bb);
            }
            if (b + AHEAD < nb) load(b + AHEAD, ring[d]);
        }
    }
    row_partials_to_y(acc, y, 16 * s, N);
}

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    constexpr int MR = 64;
    const int KMAX = 11008, NMAX = 22016;
    bf16 *x = random_bf16((size_t)MR * KMAX, 7), *y0, *y1, *yt, *yp;
    uint2 *xf;
    uint4 *xr;
    float *parts;
    unsigned *sink;
    CK(cudaMalloc(&y0, NMAX * 2));
    CK(cudaMalloc(&y1, NMAX * 2));
    CK(cudaMalloc(&yt, (size_t)MR * NMAX * 2));
    CK(cudaMalloc(&yp, (size_t)MR * NMAX * 2));
    CK(cudaMalloc(&xf, (size_t)MR * KMAX * 2));
    CK(cudaMalloc(&xr, (size_t)KMAX * 2));
    CK(cudaMalloc(&parts, (size_t)CHAINS * MR * NMAX * 4));
    CK(cudaMalloc(&sink, 4));
    LaunchTimer timer;
    const int reps = 60;
    printf("us a launch: stream | shipped row_mma, row_mma_deep | fragment one row, x in block order, ring 1, "
           "2 blocks | 64 rows: cluster 8 strips a block; partials through memory + add, 8 / "
           "4 strips; the same with B a tile ahead, 8 / 4 strips | best 64 ÷ stream | bits: one row = 64 rows, cluster = through memory | max err/|terms|: shipped, "
           "frag\n");
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
        x_row_frag<<<(s.k / 2 + 255) / 256, 256>>>(x, reinterpret_cast<unsigned *>(xr), s.k);
        const float t_x1 = time([&](int i) { row_frag_x<1><<<strips, GEMV_WARPS * WARP>>>(xr, wf[i], y1, s.n, s.k); });
        const float t_x2 = time([&](int i) { row_frag_x<2><<<strips, GEMV_WARPS * WARP>>>(xr, wf[i], y1, s.n, s.k); });
        const int xthreads = s.k / 16 * (MR / 8) * 32;
        x_to_frag<<<(xthreads + 255) / 256, 256>>>(x, xf, MR, s.k);
        const float t_c8 = time([&](int i) { launch_tiled<64, 4, 8>(xf, wf[i], yt, s.n, s.k); });
        const float t_b8 = time([&](int i) { launch_parts<64, 4, 8, true>(xf, wf[i], parts, yp, s.n, s.k); });
        const float t_b4 = time([&](int i) { launch_parts<64, 4, 4, true>(xf, wf[i], parts, yp, s.n, s.k); });
        const float t_p8 = time([&](int i) { launch_parts<64, 4, 8>(xf, wf[i], parts, yp, s.n, s.k); });
        const float t_p4 = time([&](int i) { launch_parts<64, 4, 4>(xf, wf[i], parts, yp, s.n, s.k); });
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        // Bits: every one of the 64 rows through row_frag_x alone against the tiled product, and
        // the two ways to add the chains.
        launch_tiled<64, 4, 8>(xf, wf[0], yt, s.n, s.k);
        launch_parts<64, 4, 4, true>(xf, wf[0], parts, yp, s.n, s.k);
        std::vector<bf16> tiled((size_t)MR * s.n), viamem((size_t)MR * s.n), one(s.n), ship(s.n);
        CK(cudaMemcpy(tiled.data(), yt, (size_t)MR * s.n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(viamem.data(), yp, (size_t)MR * s.n * 2, cudaMemcpyDeviceToHost));
        bool same = true, same_ways = true;
        for (size_t i = 0; i < tiled.size(); ++i)
            same_ways &= __bfloat16_as_ushort(tiled[i]) == __bfloat16_as_ushort(viamem[i]);
        for (int m = 0; m < MR; ++m) {
            x_row_frag<<<(s.k / 2 + 255) / 256, 256>>>(x + (size_t)m * s.k, reinterpret_cast<unsigned *>(xr), s.k);
            row_frag_x<2><<<strips, GEMV_WARPS * WARP>>>(xr, wf[0], y1, s.n, s.k);
            CK(cudaMemcpy(one.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
            for (int n = 0; n < s.n; ++n)
                same &= __bfloat16_as_ushort(one[n]) == __bfloat16_as_ushort(tiled[(size_t)m * s.n + n]);
        }
        // Accuracy of row 0 (copy 0) against double, shipped and fragment-ordered.
        kestrel_gemv_row_mma_bf16<<<strips, GEMV_WARPS * WARP>>>(x, w[0], y0, 1, s.n, s.k, GEMV_MMA);
        x_row_frag<<<(s.k / 2 + 255) / 256, 256>>>(x, reinterpret_cast<unsigned *>(xr), s.k);
        row_frag_x<1><<<strips, GEMV_WARPS * WARP>>>(xr, wf[0], y1, s.n, s.k);
        std::vector<bf16> hw(elems), hx(s.k);
        CK(cudaMemcpy(hw.data(), w[0], bytes, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hx.data(), x, s.k * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(ship.data(), y0, s.n * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(one.data(), y1, s.n * 2, cudaMemcpyDeviceToHost));
        const std::vector<double> err = max_rel_errors(hw, hx, {&ship, &one}, s.n, s.k);
        const double e_ship = err[0], e_frag = err[1];
        const float best = fminf(fminf(t_c8, fminf(t_b8, t_b4)), fminf(t_p8, t_p4));
        printf("%-8s %5.1f | %5.1f %5.1f | %5.1f %5.1f | %5.1f; %5.1f %5.1f; %5.1f %5.1f | %.2f | %s, %s | %.2e %.2e\n",
               s.name, t_st, t_ship, t_deep, t_x1, t_x2, t_c8, t_p8, t_p4, t_b8, t_b4, best / t_st,
               same ? "same" : "DIFFER", same_ways ? "same" : "DIFFER", e_ship, e_frag);
        for (int i = 0; i < copies; ++i) {
            CK(cudaFree(w[i]));
            CK(cudaFree(wf[i]));
        }
    }
    return 0;
}

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
//   tiled_frag_parts M rows (M/8 MMAs a tile on the same A fragment): a block S strips × one
//              chain; the rows' B fragments from a fragment-ordered copy of x through L1 (the
//              block's warps read the same ones); each chain's partials to global memory and
//              reduce_parts adds them in chain order. B_AHEAD requests the next tile's B
//              fragments before this tile's MMAs. (Session 45 also had the chains meet in a
//              cluster's distributed shared memory: no faster; commit d578880.)
//   wg_frag_staged 64 rows on Hopper's warpgroup MMA (session 46, builds 6-9): a warpgroup
//              takes 4 strips (64 weight rows) and runs its chains one after another; each
//              64-k block of the weights (fragment order, or rows as stored: ROWS, build 9) and
//              of the rows (in wgmma's core-matrix layout) is staged by cp.async, STAGES deep.
//              wgmma's register A of a warp is mma.sync's A fragment, so the fragment order
//              feeds it straight, and rows as stored give GemvMma's registers. SPLIT blocks
//              share a strip group's chains when there are too few groups to fill the GPU;
//              ORDER is how the chains' sums are added: in chain order (the later blocks'
//              through memory and reduce_split), as a tree, or in groups (each block's chains
//              in order, then the blocks' totals), the latter two through a cluster's
//              distributed shared memory, with the one-row kernel summing to match.
//   rt, rx     the runtime's engine (crates/kestrel-kernels/src/gemv_wgmma.cuh) after its
//              rows-layout launch, or laying the rows out itself (X_AS_STORED).
// Same chain, same MMAs, same order: a row's output has the same bits at 1 row as at 64
// (checked, every row, against the matching one-row kernel: the fragment-order one in the
// same order, or the shipped one for the rows builds), and is as accurate as the shipped
// kernel (checked against double).
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o frag_probe tools/gpu/frag_probe.cu && ./frag_probe
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include "probe_row_sum.cuh"
#include "probe_wgmma.cuh"
#include <cmath>
#include <cooperative_groups.h>
#include <string>
#include <utility>
namespace cg = cooperative_groups;

constexpr int CHAINS = 8;        // = GEMV_WARPS: the one-row kernel's warps are the chains
static_assert(CHAINS == GEMV_WARPS, "row_partials_to_y adds one partial a warp");

// How a 64-row build adds the chains of an output: build 6 in chain order (the later blocks'
// chains through parts and reduce_split), build 7 as a tree, build 8 in groups: each block's
// chains in order, then the blocks' totals in order, ((0 + T0) + T1) + …, which the one-row
// kernel reproduces for the same group size (row_partials_grouped_to_y).
enum class Order { InOrder, Tree, Grouped };

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

// Each chain's (warp's) partial sums of a one-row kernel's 16 outputs, in shared memory.
__device__ __forceinline__ float (*stage_row_partials(const float *acc))[16] {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    __shared__ float part[CHAINS][16];
    if (t == 0) {
        part[warp][g] = acc[0];
        part[warp][g + 8] = acc[2];
    }
    __syncthreads();
    return part;
}

// row_partials_to_y with the chains' partials added as build 8 adds them for groups of G
// chains: each group's in order from zero, then the groups' totals in order from zero.
__device__ __forceinline__ void row_partials_grouped_to_y(const float *acc, bf16 *y, const int n0, const int N,
                                                          const int G) {
    float(*part)[16] = stage_row_partials(acc);
    if (threadIdx.x < 16 && n0 + threadIdx.x < N) {
        float total = 0.f;
        for (int q0 = 0; q0 < CHAINS; q0 += G) {
            float group = 0.f;
            for (int q = q0; q < q0 + G; ++q) group += part[q][threadIdx.x];
            total += group;
        }
        y[n0 + threadIdx.x] = __float2bfloat16(total);
    }
}

// row_partials_to_y with the chains' partials added as build 7's tree: ((p0 + p1) + (p2 + p3)) + ….
__device__ __forceinline__ void row_partials_tree_to_y(const float *acc, bf16 *y, const int n0, const int N) {
    float(*part)[16] = stage_row_partials(acc);
    if (threadIdx.x < 16 && n0 + threadIdx.x < N) {
        float v[CHAINS];
#pragma unroll
        for (int q = 0; q < CHAINS; ++q) v[q] = part[q][threadIdx.x];
#pragma unroll
        for (int w = 1; w < CHAINS; w *= 2)
#pragma unroll
            for (int q = 0; q + w < CHAINS; q += 2 * w) v[q] = v[q] + v[q + w];
        y[n0 + threadIdx.x] = __float2bfloat16(v[0]);
    }
}

// One row, x from x_row_frag, chains of whole 64-k blocks dealt out as the shipped kernel
// does, DEPTH blocks a warp in flight (4 fragments a block), every lane taking x (columns
// replicated, as GemvMma does): 2 x loads and 4 weight loads a block.
// ORDER as the 64-row build's: in chain order, a tree, or groups of G chains.
template <int DEPTH, Order ORDER = Order::InOrder>
__global__ void GEMV_BOUNDS row_frag_x(const uint4 *__restrict__ xr, const uint4 *__restrict__ wf,
                                       bf16 *__restrict__ y, const int N, const int K, const int G = CHAINS) {
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
    if (ORDER == Order::Tree)
        row_partials_tree_to_y(acc, y, 16 * s, N);
    else if (ORDER == Order::Grouped)
        row_partials_grouped_to_y(acc, y, 16 * s, N, G);
    else
        row_partials_to_y(acc, y, 16 * s, N);
}

// x [64, K] → wgmma's B, a 64-k block at a time: [block b][tile j (4)][k half c (2)][row n (64)]
// [8 values] = x[n][64b + 16j + 8c + e], so a block is one contiguous 8 KiB copy and tile j's
// descriptor has leading (k half) offset 1,024 and stride (8 rows) 128.
__global__ void x_to_wg(const bf16 *__restrict__ x, bf16 *__restrict__ xw, const int K) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 64 * K) return;
    const int e = i % 8, n = (i / 8) % 64, c = (i / 512) % 2, j = (i / 1024) % 4, b = i / 4096;
    xw[i] = x[(size_t)n * K + 64 * b + 16 * j + 8 * c + e];
}

// The same blocks with each MMA j's k slots in GemvMma's order: [b][j][c][n][e] =
// x[n][64b + 16(e / 2) + 4j + 2c + e % 2] (tiled_probe.cu's permute_rows, one tile of rows).
__global__ void x_to_wg_gemv_order(const bf16 *__restrict__ x, bf16 *__restrict__ xw, const int K) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= 64 * K) return;
    const int e = i % 8, n = (i / 8) % 64, c = (i / 512) % 2, j = (i / 1024) % 4, b = i / 4096;
    xw[i] = x[(size_t)n * K + 64 * b + 16 * (e / 2) + 4 * j + 2 * c + e % 2];
}

constexpr int WG_BLOCK_U4 = 512; // a 64-k block of the 64 rows in uint4

// Chains [c0, c1) of a block's walk, as the one-row kernel deals them: chain c's 64-k blocks
// c, c + CHAINS, …; then chain c + 1's.
struct ChainWalk {
    int c, b;
    __device__ ChainWalk(const int c0, const int c1, const int nb) : c(c0), b(c0) { skip(c1, nb); }
    __device__ void skip(const int c1, const int nb) {
        while (c < c1 && b >= nb) b = ++c;
    }
    __device__ void next(const int c1, const int nb) {
        b += CHAINS;
        skip(c1, nb);
    }
};

// A chain's end in the wg builds: the first block of a strip group adds its chains into the
// running total (in chain order); the others' chains go to their own slots of parts. The
// accumulator restarts from zero.
__device__ __forceinline__ void wg_frag_chain_done(float *acc, float *total, float *parts, const int chain,
                                                   const bool first, const bool active, const int N, const int n0) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        if (first)
            total[e] += acc[e];
        else if (active)
            parts[((size_t)chain * 64 + wg_acc_row(lane, e)) * N + n0 + wg_acc_col(lane, e)] =
                acc[e];
        acc[e] = 0.f;
    }
}

// The first block's total: y itself when it took every chain, else slot 0 of parts.
__device__ __forceinline__ void wg_frag_finish(const float *total, bf16 *y, float *parts, const int split,
                                               const bool writes, const int N, const int n0) {
    if (!writes) return;
    if (split == 1) {
        wg_store(total, y, 64, N, 0, n0);
        return;
    }
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int e = 0; e < 32; ++e)
        parts[(size_t)wg_acc_row(lane, e) * N + n0 + wg_acc_col(lane, e)] = total[e];
}

// Build 7's order: a block's chains added as a binary tree, ((p0 + p1) + (p2 + p3)) + …, by a
// binary counter over the chain's place q among the block's CH chains: a finished chain is a
// left operand kept in buf[l] at the first 0 bit l of q, or is added to the ones waiting
// below it (buf[l] + right). After the last chain acc holds the block's subtree.
template <int CH> __device__ __forceinline__ void tree_chain_done(float *acc, float (*buf)[32], const int q) {
    bool placed = false;
#pragma unroll
    for (int l = 0; (1 << l) < CH; ++l) {
        if (!placed) {
            if (((q >> l) & 1) == 0) {
#pragma unroll
                for (int e = 0; e < 32; ++e) buf[l][e] = acc[e];
                placed = true;
            } else {
#pragma unroll
                for (int e = 0; e < 32; ++e) acc[e] = buf[l][e] + acc[e];
            }
        }
    }
    if (placed)
#pragma unroll
        for (int e = 0; e < 32; ++e) acc[e] = 0.f;
}

// Builds 7 and 8's end: the cluster's SPLIT blocks (chains in equal, aligned ranges) put their
// subtrees (or group totals) in shared memory, and each adds a slice of the outputs over the
// cluster's blocks: as the top of the same tree, or in order from zero.
template <int SPLIT, int WGS, bool TREE>
__device__ __forceinline__ void cluster_store(const float *acc, void *smem, bf16 *y, const int N) {
    float *mine = reinterpret_cast<float *>(smem);
    constexpr int THREADS = WGS * 128, OUTS = THREADS * 32, SLICE = OUTS / SPLIT;
#pragma unroll
    for (int e = 0; e < 32; ++e) mine[e * THREADS + threadIdx.x] = acc[e];
    cg::cluster_group cluster = cg::this_cluster();
    cluster.sync();
    const int rank = cluster.block_rank();
    for (int o = rank * SLICE + threadIdx.x; o < (rank + 1) * SLICE; o += THREADS) {
        float v[SPLIT];
#pragma unroll
        for (int q = 0; q < SPLIT; ++q) v[q] = cluster.map_shared_rank(mine, q)[o];
        if (TREE) {
#pragma unroll
            for (int w = 1; w < SPLIT; w *= 2)
#pragma unroll
                for (int q = 0; q + w < SPLIT; q += 2 * w) v[q] = v[q] + v[q + w];
        } else {
            float total = 0.f;
#pragma unroll
            for (int q = 0; q < SPLIT; ++q) total += v[q];
            v[0] = total;
        }
        const int tid = o % THREADS, e = o / THREADS, warp = tid / WARP, lane = tid % WARP;
        const int group = blockIdx.x * WGS + warp / 4;
        const int n = (group * 4 + warp % 4) * 16 + wg_acc_col(lane, e), m = wg_acc_row(lane, e);
        if (group * 64 < N) y[(size_t)m * N + n] = __float2bfloat16(v[0]);
    }
    cluster.sync(); // no block leaves while another reads its subtree
}

// Builds 6 and 7: 64 rows on warpgroup MMAs, grid (strip groups / WGS, SPLIT), WGS warpgroups
// a block. (Build 5 took the weights into a register ring, commit df3566a: 192 registers, two
// warpgroups a multiprocessor, too few bytes in flight.) Each stage holds a 64-k block of
// the rows (8 KiB) and of each warp's strip (2 KiB a warp, [warp][tile][lane]), copied by
// cp.async STAGES - 1 blocks ahead, and a warp reads its A fragments back with one 16-byte
// shared load a tile just before its MMAs. Build 6 adds the chains in chain order, the
// later blocks' through parts and reduce_split; builds 7 (a tree) and 8 (groups) make the
// SPLIT blocks of a strip group a cluster meeting in distributed shared memory.
// Build 9 (ROWS): the same engine on the weights as the runtime stores them (rows, GemvMma's k
// order): a warp's 16 rows × 64 k staged as rows padded to 144 bytes (conflict-free reads),
// each lane taking 32 bytes at 16t of its rows g and g + 8 as GemvMma does, and x staged in
// that k order (x_to_wg_gemv_order): in order (SPLIT 1) the shipped one-row kernel's bits.
template <bool ROWS> __host__ __device__ constexpr int strip_stage_u4() { return ROWS ? 16 * 9 : 4 * WARP; }
template <int WGS, bool ROWS> __host__ __device__ constexpr int wg_stage_u4() { return WG_BLOCK_U4 + WGS * 4 * strip_stage_u4<ROWS>(); }

template <int STAGES, int WGS, int SPLIT, Order ORDER, bool ROWS = false>
__global__ void __launch_bounds__(WGS * 128) wg_frag_staged(const uint4 *__restrict__ xw, const uint4 *__restrict__ wf,
                                                            bf16 *__restrict__ y, float *__restrict__ parts,
                                                            const int N, const int K) {
    constexpr int STAGE_U4 = wg_stage_u4<WGS, ROWS>(), STRIP_U4 = strip_stage_u4<ROWS>();
    constexpr int CH = CHAINS / SPLIT;
    extern __shared__ uint4 wg_stage[];
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int kt = K / 16, nb = kt / 4;
    const int n0 = ((blockIdx.x * WGS + warp / 4) * 4 + warp % 4) * 16;
    const bool active = (blockIdx.x * WGS + warp / 4) * 64 < N;
    const int c0 = blockIdx.y * CH, c1 = c0 + CH;
    int blocks = 0;
    for (int c = c0; c < c1; ++c) blocks += max(0, (nb - c + CHAINS - 1) / CHAINS);
    const uint4 *wsrc = wf + (size_t)(n0 / 16) * kt * 32 + lane;
    ChainWalk load_walk(c0, c1, nb), walk(c0, c1, nb);
    int staged = 0;
    auto load = [&]() {
        if (load_walk.c < c1) {
            uint4 *s = wg_stage + (staged % STAGES) * STAGE_U4;
            const uint4 *src = xw + (size_t)load_walk.b * WG_BLOCK_U4;
            for (int r = threadIdx.x; r < WG_BLOCK_U4; r += WGS * 128) cp_async16(s + r, src + r);
            uint4 *strip = s + WG_BLOCK_U4 + warp * STRIP_U4;
            if (active && ROWS) {
                const bf16 *w = reinterpret_cast<const bf16 *>(wf) + (size_t)n0 * K + 64 * load_walk.b;
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const int piece = lane + WARP * q, row = piece / 8, col = piece % 8;
                    cp_async16(strip + 9 * row + col, w + (size_t)row * K + 8 * col);
                }
            } else if (active) {
#pragma unroll
                for (int j = 0; j < 4; ++j) cp_async16(strip + j * WARP + lane, wsrc + (size_t)(4 * load_walk.b + j) * 32);
            }
            load_walk.next(c1, nb);
        }
        ++staged;
        asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int s = 0; s < STAGES - 1; ++s) load();
    constexpr bool TREE = ORDER == Order::Tree;
    float acc[32], total[TREE ? 1 : 32], buf[TREE && CH > 1 ? 31 - __builtin_clz(CH) : 1][32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = 0.f;
    if constexpr (!TREE)
#pragma unroll
        for (int e = 0; e < 32; ++e) total[e] = 0.f;
    for (int i = 0; i < blocks; ++i) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2));
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
        __syncthreads(); // block i is in; every warp's MMAs on block i - 1 are done
        load();
        if (active) {
            const uint4 *s = wg_stage + (i % STAGES) * STAGE_U4;
            const uint4 *strip = s + WG_BLOCK_U4 + warp * STRIP_U4;
            uint4 v[4];
            if constexpr (ROWS) {
                const int g = lane >> 2, t = lane & 3;
                v[0] = strip[9 * g + 2 * t];
                v[1] = strip[9 * g + 2 * t + 1];
                v[2] = strip[9 * (g + 8) + 2 * t];
                v[3] = strip[9 * (g + 8) + 2 * t + 1];
            } else {
#pragma unroll
                for (int j = 0; j < 4; ++j) v[j] = strip[j * WARP + lane];
            }
            const unsigned *wl = reinterpret_cast<const unsigned *>(&v[0]), *wh = reinterpret_cast<const unsigned *>(&v[2]);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                // Fragment order: tile j's A fragment is v[j]; rows: GemvMma's k slots.
                const unsigned a[4] = {ROWS ? wl[2 * j] : v[j].x, ROWS ? wh[2 * j] : v[j].y,
                                       ROWS ? wl[2 * j + 1] : v[j].z, ROWS ? wh[2 * j + 1] : v[j].w};
                wgmma_rs_n64(acc, a, wg_smem_desc(s + j * 128, 1024, 128));
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
        const int chain = walk.c;
        walk.next(c1, nb);
        if (walk.c != chain) {
            if constexpr (TREE)
                tree_chain_done<CH>(acc, buf, chain - c0);
            else
                wg_frag_chain_done(acc, total, parts, chain, ORDER == Order::Grouped || c0 == 0, active, N, n0);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if constexpr (ORDER == Order::InOrder || SPLIT == 1) {
        wg_frag_finish(TREE ? acc : total, y, parts, SPLIT, c0 == 0 && active, N, n0);
    } else {
        __syncthreads(); // every warp's MMAs are done with the stages
        cluster_store<SPLIT, WGS, TREE>(TREE ? acc : total, wg_stage, y, N);
    }
}

// y = slot 0 (chains [0, first)) + chain first's sums + …, in chain order.
__global__ void reduce_split(const float *__restrict__ parts, bf16 *__restrict__ y, const int MN, const int first) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= MN) return;
    float total = 0.f + parts[i];
    for (int q = first; q < CHAINS; ++q) total += parts[(size_t)q * MN + i];
    y[i] = __float2bfloat16(total);
}

template <int STAGES, int WGS, int SPLIT, Order ORDER, bool ROWS = false>
void launch_wg_staged(const uint4 *xw, const uint4 *wf, float *parts, bf16 *y, int N, int K) {
    constexpr int bytes = STAGES * wg_stage_u4<WGS, ROWS>() * 16;
    constexpr bool CLUSTER = ORDER != Order::InOrder && SPLIT > 1;
    static_assert(bytes >= WGS * 128 * 32 * 4, "the blocks' sums fit the stages");
    auto kernel = wg_frag_staged<STAGES, WGS, SPLIT, ORDER, ROWS>;
    static bool sized = false;
    if (!sized) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        if (CLUSTER) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        sized = true;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((N / 64 + WGS - 1) / WGS, SPLIT);
    cfg.blockDim = dim3(WGS * 128);
    cfg.dynamicSmemBytes = bytes;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1;
    cluster.val.clusterDim.y = CLUSTER ? SPLIT : 1;
    cluster.val.clusterDim.z = 1;
    cfg.attrs = &cluster;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kernel, xw, wf, y, parts, N, K));
    if (ORDER == Order::InOrder && SPLIT > 1) reduce_split<<<(64 * N + 255) / 256, 256>>>(parts, y, 64 * N, CHAINS / SPLIT);
}

// The runtime's warpgroup engine (gemv_wgmma.cuh: build 9 with its rows laid out by
// kestrel_gemv_wgmma_rows, both launches timed), for comparison; `wf` is the row-major weight
// and `x` the rows as stored.
template <int SPLIT, bool EVICT>
void launch_runtime_wgmma(const uint4 *x, const uint4 *wf, float *, bf16 *y, int N, int K) {
    static bf16 *xp = nullptr;
    if (!xp) CK(cudaMalloc(&xp, (size_t)64 * 11008 * 2));
    auto kernel = EVICT ? (SPLIT == 1   ? kestrel_gemv_wgmma_s1_evict_bf16
                           : SPLIT == 4 ? kestrel_gemv_wgmma_s4_evict_bf16
                                        : kestrel_gemv_wgmma_s8_evict_bf16)
                        : (SPLIT == 1   ? kestrel_gemv_wgmma_s1_bf16
                           : SPLIT == 4 ? kestrel_gemv_wgmma_s4_bf16
                                        : kestrel_gemv_wgmma_s8_bf16);
    constexpr int bytes = WG_STAGES * WG_STAGE_ELEMS * 2;
    static bool sized = false;
    if (!sized) {
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        sized = true;
    }
    kestrel_gemv_wgmma_rows_bf16<<<dim3(K / 64, 1), 512>>>(reinterpret_cast<const bf16 *>(x), xp, 64, K);
    kernel<<<dim3((N + 63) / 64, SPLIT, 1), 128, bytes>>>(xp, reinterpret_cast<const bf16 *>(wf), y, 64, N, K);
}

// The runtime engine reading the rows as stored, laying them out itself (X_AS_STORED): no
// second launch.
template <int SPLIT, bool EVICT>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS)
    wgmma_x_as_stored(const bf16 *x, const bf16 *w, bf16 *y, const int M, const int N, const int K) {
    gemv_wgmma<bf16, SPLIT, EVICT, true>(x, w, y, M, N, K);
}

template <int SPLIT, bool EVICT>
void launch_x_as_stored(const uint4 *x, const uint4 *wf, float *, bf16 *y, int N, int K) {
    constexpr int bytes = WG_STAGES * WG_STAGE_ELEMS * 2;
    static bool sized = false;
    if (!sized) {
        CK(cudaFuncSetAttribute(wgmma_x_as_stored<SPLIT, EVICT>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
        sized = true;
    }
    wgmma_x_as_stored<SPLIT, EVICT><<<dim3((N + 63) / 64, SPLIT, 1), 128, bytes>>>(
        reinterpret_cast<const bf16 *>(x), reinterpret_cast<const bf16 *>(wf), y, 64, N, K);
}

// The 64-row builds timed against each other: build 4's best (mma.sync, B a tile ahead, 4 strips a
// block, partials through memory) and wg_frag_staged's <STAGES, WGS, SPLIT, ORDER>.
struct WgConfig {
    const char *name;
    void (*launch)(const uint4 *, const uint4 *, float *, bf16 *, int, int);
    Order order;
    int group; // chains a group (Grouped)
    bool rows; // build 9: the weights as rows, x in GemvMma's order
};
constexpr auto IN_ORDER = Order::InOrder, AS_TREE = Order::Tree, GROUPED = Order::Grouped;
constexpr WgConfig WG_CONFIGS[] = {
    {"gr3.1/1", launch_wg_staged<3, 1, 1, GROUPED>, GROUPED, 8, false},
    {"gr3.1/2", launch_wg_staged<3, 1, 2, GROUPED>, GROUPED, 4, false},
    {"gr4.1/4", launch_wg_staged<4, 1, 4, GROUPED>, GROUPED, 2, false},
    {"rw3.1/1", launch_wg_staged<3, 1, 1, GROUPED, true>, GROUPED, 8, true},
    {"rw4.1/1", launch_wg_staged<4, 1, 1, GROUPED, true>, GROUPED, 8, true},
    {"rw3.1/2", launch_wg_staged<3, 1, 2, GROUPED, true>, GROUPED, 4, true},
    {"rw3.1/4", launch_wg_staged<3, 1, 4, GROUPED, true>, GROUPED, 2, true},
    {"rw4.1/4", launch_wg_staged<4, 1, 4, GROUPED, true>, GROUPED, 2, true},
    {"rw4.1/8", launch_wg_staged<4, 1, 8, GROUPED, true>, GROUPED, 1, true},
    {"rt/1", launch_runtime_wgmma<1, false>, IN_ORDER, 8, true},
    {"rt/4", launch_runtime_wgmma<4, false>, IN_ORDER, 8, true},
    {"rt/8", launch_runtime_wgmma<8, false>, IN_ORDER, 8, true},
    {"rt/1e", launch_runtime_wgmma<1, true>, IN_ORDER, 8, true},
    {"rt/4e", launch_runtime_wgmma<4, true>, IN_ORDER, 8, true},
    {"rx/1", launch_x_as_stored<1, false>, IN_ORDER, 8, true},
    {"rx/4", launch_x_as_stored<4, false>, IN_ORDER, 8, true},
    {"rx/8", launch_x_as_stored<8, false>, IN_ORDER, 8, true},
    {"rx/1e", launch_x_as_stored<1, true>, IN_ORDER, 8, true},
    {"rx/4e", launch_x_as_stored<4, true>, IN_ORDER, 8, true},
};
constexpr int N_WG = sizeof(WG_CONFIGS) / sizeof(WG_CONFIGS[0]);

int main() {
    int sms;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    constexpr int MR = 64;
    const int KMAX = 11008, NMAX = 22016;
    bf16 *x = random_bf16((size_t)MR * KMAX, 7), *y0, *y1, *yp, *xw, *xg;
    uint2 *xf;
    uint4 *xr;
    float *parts;
    unsigned *sink;
    CK(cudaMalloc(&y0, NMAX * 2));
    CK(cudaMalloc(&y1, NMAX * 2));
    CK(cudaMalloc(&yp, (size_t)MR * NMAX * 2));
    CK(cudaMalloc(&xf, (size_t)MR * KMAX * 2));
    CK(cudaMalloc(&xw, (size_t)MR * KMAX * 2));
    CK(cudaMalloc(&xg, (size_t)MR * KMAX * 2));
    CK(cudaMalloc(&xr, (size_t)KMAX * 2));
    CK(cudaMalloc(&parts, (size_t)CHAINS * MR * NMAX * 4));
    CK(cudaMalloc(&sink, 4));
    LaunchTimer timer;
    const int reps = 60;
    printf("us a launch: stream | one row: shipped row_mma, fragment, fragment with the tree sum | 64 rows: build 4 (mma.sync, 4 strips, B "
           "ahead)");
    for (const auto &c : WG_CONFIGS) printf(", %s", c.name);
    printf(" | best 64 / stream | bits: each config's 64 rows = one row alone (in order or tree as built) | max err/|terms|: shipped, frag\n");
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
        x_row_frag<<<(s.k / 2 + 255) / 256, 256>>>(x, reinterpret_cast<unsigned *>(xr), s.k);
        const float t_x2 = time([&](int i) { row_frag_x<2><<<strips, GEMV_WARPS * WARP>>>(xr, wf[i], y1, s.n, s.k); });
        const float t_x2t =
            time([&](int i) { row_frag_x<2, AS_TREE><<<strips, GEMV_WARPS * WARP>>>(xr, wf[i], y1, s.n, s.k); });
        const int xthreads = s.k / 16 * (MR / 8) * 32;
        x_to_frag<<<(xthreads + 255) / 256, 256>>>(x, xf, MR, s.k);
        x_to_wg<<<(MR * s.k + 255) / 256, 256>>>(x, xw, s.k);
        x_to_wg_gemv_order<<<(MR * s.k + 255) / 256, 256>>>(x, xg, s.k);
        // A config's operands: fragment-ordered weights and x, or the rows and x in GemvMma's order.
        auto operands = [&](const WgConfig &c, int i) {
            const bool runtime = c.name[0] == 'r' && (c.name[1] == 't' || c.name[1] == 'x');
            return std::make_pair(reinterpret_cast<const uint4 *>(runtime ? x : c.rows ? xg : xw),
                                  c.rows ? reinterpret_cast<const uint4 *>(w[i]) : wf[i]);
        };
        const float t_b4 = time([&](int i) { launch_parts<64, 4, 4, true>(xf, wf[i], parts, yp, s.n, s.k); });
        float t_wg[N_WG];
        for (int c = 0; c < N_WG; ++c)
            t_wg[c] = time([&](int i) {
                const auto [xo, wo] = operands(WG_CONFIGS[c], i);
                WG_CONFIGS[c].launch(xo, wo, parts, yp, s.n, s.k);
            });
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        // Bits: every one of the 64 rows through row_frag_x alone (chains added in order, or as
        // a tree) against each 64-row build.
        // alone[0]: in order; [1]: tree; [2 + log2 G]: groups of G; [6]: the shipped kernel.
        std::vector<std::vector<bf16>> alone(7, std::vector<bf16>((size_t)MR * s.n));
        std::vector<bf16> many((size_t)MR * s.n), one(s.n), ship(s.n);
        for (int m = 0; m < MR; ++m) {
            x_row_frag<<<(s.k / 2 + 255) / 256, 256>>>(x + (size_t)m * s.k, reinterpret_cast<unsigned *>(xr), s.k);
            for (int a = 0; a < 6; ++a) {
                if (a == 0) row_frag_x<2><<<strips, GEMV_WARPS * WARP>>>(xr, wf[0], y1, s.n, s.k);
                if (a == 1) row_frag_x<2, AS_TREE><<<strips, GEMV_WARPS * WARP>>>(xr, wf[0], y1, s.n, s.k);
                if (a >= 2) row_frag_x<2, GROUPED><<<strips, GEMV_WARPS * WARP>>>(xr, wf[0], y1, s.n, s.k, 1 << (a - 2));
                CK(cudaMemcpy(alone[a].data() + (size_t)m * s.n, y1, s.n * 2, cudaMemcpyDeviceToHost));
            }
            kestrel_gemv_row_mma_bf16<<<strips, GEMV_WARPS * WARP>>>(x + (size_t)m * s.k, w[0], y0, 1, s.n, s.k,
                                                                     GEMV_MMA);
            CK(cudaMemcpy(alone[6].data() + (size_t)m * s.n, y0, s.n * 2, cudaMemcpyDeviceToHost));
        }
        auto want = [&](const WgConfig &c) -> const std::vector<bf16> & {
            if (c.rows) return alone[6];
            return c.order == IN_ORDER ? alone[0] : c.order == AS_TREE ? alone[1] : alone[2 + __builtin_ctz(c.group)];
        };
        auto same_as = [&](const std::vector<bf16> &want, auto launch) {
            launch();
            CK(cudaMemcpy(many.data(), yp, many.size() * 2, cudaMemcpyDeviceToHost));
            for (size_t i = 0; i < many.size(); ++i)
                if (__bfloat16_as_ushort(many[i]) != __bfloat16_as_ushort(want[i])) return false;
            return true;
        };
        std::string bits =
            same_as(alone[0], [&] { launch_parts<64, 4, 4, true>(xf, wf[0], parts, yp, s.n, s.k); }) ? "same" : "DIFFER";
        for (const auto &c : WG_CONFIGS) {
            // The shipped kernel adds its chains in order: the rows build's groups of fewer
            // chains have no one-row counterpart here.
            if (c.rows && c.group != CHAINS) {
                bits += " -";
                continue;
            }
            const auto ops = operands(c, 0);
            bits += same_as(want(c), [&] { c.launch(ops.first, ops.second, parts, yp, s.n, s.k); }) ? " same" : " DIFFER";
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
        float best = t_b4;
        for (float t : t_wg) best = fminf(best, t);
        printf("%-8s %5.1f | %5.1f %5.1f %5.1f | %5.1f", s.name, t_st, t_ship, t_x2, t_x2t, t_b4);
        for (float t : t_wg) printf(" %5.1f", t);
        printf(" | %.2f | %s | %.2e %.2e\n", best / t_st, bits.c_str(), err[0], err[1]);
        for (int i = 0; i < copies; ++i) {
            CK(cudaFree(w[i]));
            CK(cudaFree(wf[i]));
        }
    }
    return 0;
}

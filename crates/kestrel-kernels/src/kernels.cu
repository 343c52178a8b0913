// Kestrel's CUDA kernels for the decode hot path. Compiled by build.rs to PTX for compute_80
// (JIT-compiled by the driver on sm_80 and newer, including sm_90) and loaded through candle's
// CUDA device. Every kernel exists for f32, f16 and bf16 (extern "C" names end in the dtype);
// arithmetic is in f32, storage in the tensor's dtype.
//
// Kept deliberately simple (one block per row or per (query token, head), warp reductions):
// at decode sizes the step is bound by launches and weight reads, not by these kernels.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#define WARP 32

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch (PDL). On Hopper (the compute_90 PTX) cuda.rs launches every
// kernel of this file with programmatic stream serialization: a kernel's blocks may become
// resident while the kernel before it on the stream is still running. Each kernel therefore
// calls `pdl_enter` before it touches any memory another kernel writes (reads and writes
// alike; only weights, which no kernel writes, may be loaded before it) and before any
// return: `griddepcontrol.wait` returns once the previous grid has completed and its writes
// are visible, so a kernel's own completion still implies its predecessors'. It then lets the
// next kernel launch (`launch_dependents`), which fires once every block has passed here:
// the next kernel's weight loads overlap this one's work and its tail, and a decode step's
// chain of small kernels stops paying a launch latency and a memory ramp per kernel.
// Compiled for compute_80 (Ampere) both are empty and launches carry no attribute.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// Rounds through T and back: reproduces the intermediate rounding of the candle ops the
// kernels replace (e.g. RMSNorm normalised in f32, stored in bf16, then scaled in bf16).
template <typename T> __device__ __forceinline__ float round_t(float x) { return to_f(from_f<T>(x)); }

// silu(g) rounded to T, as candle's `silu` stores it (kestrel_swiglu and gemv_swiglu).
template <typename T> __device__ __forceinline__ float silu_t(const float g) {
    return round_t<T>(g / (1.f + expf(-g)));
}

// 16 bytes (4 f32 or 8 f16/bf16) as floats.
template <typename T> __device__ __forceinline__ void unpack16(const uint4 v, float *o);
template <> __device__ __forceinline__ void unpack16<float>(const uint4 v, float *o) {
    o[0] = __uint_as_float(v.x); o[1] = __uint_as_float(v.y);
    o[2] = __uint_as_float(v.z); o[3] = __uint_as_float(v.w);
}
// The two 16-bit types: four pairs, each converted by `pair`.
template <typename P, typename F>
__device__ __forceinline__ void unpack16_pairs(const uint4 v, float *o, F pair) {
    const P *h = reinterpret_cast<const P *>(&v);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = pair(h[i]);
        o[2 * i] = f.x; o[2 * i + 1] = f.y;
    }
}
template <> __device__ __forceinline__ void unpack16<__half>(const uint4 v, float *o) {
    unpack16_pairs<__half2>(v, o, [](const __half2 h) { return __half22float2(h); });
}
template <> __device__ __forceinline__ void unpack16<__nv_bfloat16>(const uint4 v, float *o) {
    unpack16_pairs<__nv_bfloat162>(v, o, [](const __nv_bfloat162 h) { return __bfloat1622float2(h); });
}

// 16 bytes at `p` (16-byte aligned) as floats.
template <typename T> __device__ __forceinline__ void load16(const T *p, float *o) {
    unpack16<T>(*reinterpret_cast<const uint4 *>(p), o);
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread gets
// the result. `red` is 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float *red) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nwarps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads(); // `red` may still be read by a previous call
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < nwarps ? red[lane] : 0.f;
    return warp_sum(v);
}

// ---------------------------------------------------------------------------------------
// KV append: pool[slots[r]] = rows[r] for r < n_rows; rows are `width` = nkv·d wide.
// One block per row.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ void kv_append(T *__restrict__ pool, const T *__restrict__ rows,
                          const unsigned int *__restrict__ slots, const int width) {
    const int r = blockIdx.x;
    T *dst = pool + (size_t)slots[r] * width;
    const T *src = rows + (size_t)r * width;
    for (int e = threadIdx.x; e < width; e += blockDim.x) dst[e] = src[e];
}

// ---------------------------------------------------------------------------------------
// Matrix-vector products for the rows of a decode, draft or verification step:
// y[m, n] = Σ_k x[m, k] · w[n, k], w row-major [N, K] (a linear layer's weight), x [M, K],
// y [M, N], f32 accumulation, y rounded to T. `split` warps share an output column, each
// over an interleaved part of K; they load their part of w's row once, into registers, and
// apply it to the rows in chunks of GEMV_MAX_ROWS. Row m's sum is taken in an order that
// depends on K and split (the host picks split from K alone), never on M: a row gets the
// same bits in a one-row decode step as in a 64-row verification, which is what keeps
// greedy speculation exact in bf16.
// Needs K a multiple of the vector width (4 f32, 8 f16/bf16) and 16-byte aligned rows.
// ---------------------------------------------------------------------------------------
#define GEMV_MAX_ROWS 8
#define GEMV_WARPS 8
// Largest K (GEMV_MAX_K in lib.rs).
#define GEMV_MAX_K 2048

// Vectors a thread loads at once when staging a chunk of rows.
#define STAGE_BATCH 4

// Blocks of 8 warps a multiprocessor must hold at once, hence each thread's registers.
// The plain gemv keeps 3 (85 registers): Llama-2-7B's projections, grids of 768 and 1,376
// blocks, lost 10% at 2. The fused variants (SmolLM2's grids of 36 to 192 blocks, fewer than
// two a multiprocessor) take 2 (128 registers): at 3 (85) they ran 14-17% slower.
#define GEMV_MIN_BLOCKS 3
#define GEMV_FUSED_MIN_BLOCKS 2
#define GEMV_BOUNDS __launch_bounds__(GEMV_WARPS * WARP, GEMV_MIN_BLOCKS)
#define GEMV_FUSED_BOUNDS __launch_bounds__(GEMV_WARPS * WARP, GEMV_FUSED_MIN_BLOCKS)

// 16 bytes of T values into `p` (16-byte aligned).
template <typename T> __device__ __forceinline__ void store16(T *p, const float *v) {
    constexpr int VEC = 16 / sizeof(T);
    __align__(16) T out[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = from_f<T>(v[i]);
    *reinterpret_cast<uint4 *>(p) = *reinterpret_cast<const uint4 *>(out);
}

// V consecutive values of T, loaded or stored as one access of V · sizeof(T) bytes (the
// address aligned to that).
template <typename T, int V> struct alignas(V * sizeof(T)) Pack {
    T v[V];
};
template <typename T, int V> __device__ __forceinline__ Pack<T, V> load_pack(const T *p) {
    return *reinterpret_cast<const Pack<T, V> *>(p);
}
template <typename T, int V> __device__ __forceinline__ void store_pack(T *p, const Pack<T, V> &v) {
    *reinterpret_cast<Pack<T, V> *>(p) = v;
}

// One warp's share of a gemv: a part of K of output column n. The weights are loaded first
// (`prefetch`), so that the fused variants' staging of their inputs overlaps that memory
// latency, and applied to the rows afterwards (`finish`).
template <typename T> struct GemvWarp {
    static constexpr int VEC = 16 / sizeof(T);
    static constexpr int CHUNK = GEMV_MAX_ROWS; // rows a `finish` takes
    // Vectors per lane that the host's choice of split (cuda.rs, gemv_launch) can give at
    // K ≤ GEMV_MAX_K: 2, or 4 for f32. Any further ones are loaded in `finish`.
    static constexpr int PREFETCH =
        GEMV_MAX_K / (4 * WARP * VEC) > 2 ? GEMV_MAX_K / (4 * WARP * VEC) : 2;
    uint4 wv[PREFETCH]; // raw: 4 registers a vector whatever T
    const T *wr;
    int n, col, part, k_first, stride;

    __device__ __forceinline__ void prefetch(const T *__restrict__ w, const int N, const int K,
                                             const int split) {
        const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
        col = warp / split;
        part = warp % split;
        n = blockIdx.x * (GEMV_WARPS / split) + col;
        wr = w + (size_t)n * K;
        k_first = (part * WARP + lane) * VEC;
        stride = split * WARP * VEC;
#pragma unroll
        for (int it = 0; it < PREFETCH; ++it) {
            const int k0 = k_first + it * stride;
            if (n < N && k0 < K) wv[it] = *reinterpret_cast<const uint4 *>(wr + k0);
        }
    }

    // y[m, n] for m < M from the rows x [M, K] (global or shared memory). The parts of a
    // column are summed in a fixed order: the same result for every M.
    __device__ __forceinline__ void finish(const T *x, T *__restrict__ y, const int M,
                                           const int N, const int K, const int split) {
        __shared__ float sums[GEMV_WARPS][GEMV_MAX_ROWS];
        const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
        float acc[GEMV_MAX_ROWS];
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m) acc[m] = 0.f;
        if (n < N) {
#pragma unroll
            for (int it = 0; it < PREFETCH; ++it) {
                const int k0 = k_first + it * stride;
                if (k0 < K) {
                    float w1[VEC];
                    unpack16<T>(wv[it], w1);
                    add_rows(x, w1, k0, M, K, acc);
                }
            }
            for (int k0 = k_first + PREFETCH * stride; k0 < K; k0 += stride) {
                float w1[VEC];
                load16(wr + k0, w1);
                add_rows(x, w1, k0, M, K, acc);
            }
        }
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
            if (m < M) {
                const float total = warp_sum(acc[m]);
                if (lane == 0) sums[warp][m] = total;
            }
        }
        __syncthreads();
        if (part == 0 && n < N) {
            for (int m = lane; m < M; m += WARP) {
                float total = 0.f;
                for (int q = 0; q < split; ++q) total += sums[col * split + q][m];
                y[(size_t)m * N + n] = from_f<T>(total);
            }
        }
        __syncthreads(); // `sums` and the staged rows are free for the next chunk
    }

    // All rows' loads are issued before any product, so a chunk costs one memory latency
    // rather than one per row (row m ≥ M re-reads row M − 1 and is not used).
    __device__ __forceinline__ static void add_rows(const T *x, const float *w1, const int k0,
                                                    const int M, const int K, float *acc) {
        uint4 raw[GEMV_MAX_ROWS];
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m)
            raw[m] = *reinterpret_cast<const uint4 *>(x + (size_t)min(m, M - 1) * K + k0);
#pragma unroll
        for (int m = 0; m < GEMV_MAX_ROWS; ++m) {
            if (m < M) {
                float xv[VEC];
                unpack16<T>(raw[m], xv);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[m] = fmaf(w1[i], xv[i], acc[m]);
            }
        }
    }
};

// ---------------------------------------------------------------------------------------
// The tensor-core engine (f16/bf16, K a multiple of MMA_KB; the host asks for it with
// split = GEMV_MMA). A block computes 16 output columns; its 8 warps take K's blocks of 64 in
// turn (warp p: blocks p, p + 8, …). For each block of K a warp issues four
// mma.m16n8k16 (f32 accumulation) with the weights as A (16 columns × 16 k) and the rows as B
// (16 k × 8 rows), so up to 8 rows ride along with each weight load. A lane loads 32
// contiguous bytes of each of its two weight rows and of its input row and feeds them to the
// four MMAs in a fixed permutation of k (the same for weights and rows, so the product is
// unchanged). The warps' partial sums are then added in warp order.
// Why it stays row-invariant: an MMA computes each output from its own row and column only,
// and a row's sequence of MMAs and the order of the warps' partials depend on K alone, so a
// row gets the same bits whatever M and whatever the other rows hold. It replaces the FMA
// engine's eight rows a pass and their butterflies: a 64-row SmolLM2 verification went from
// 7.3 to 2.2 one-row steps (H200, bf16).
// ---------------------------------------------------------------------------------------
#define GEMV_MMA 0
#define MMA_KB 64

// The warpgroup engine's layout of a step's rows (gemv_wgmma.cuh): for 64-row tile z and 64-k
// block b, 64 · MMA_KB values at (z · K / MMA_KB + b) · 64 · MMA_KB, [MMA j][k half c][row n]
// [8 slots], slot e of (j, c) holding x[64z + n][64b + 16(e / 2) + 4j + 2c + e % 2] (GemvMma's
// k order, which moves pairs). The offset of x[m][k] there: kestrel_gemv_wgmma_rows_* lays
// rows out through it, and the kernels that produce a product's rows (the many-row RMSNorm,
// SwiGLU) write them there directly when the product takes that engine, which saves the
// layout's launch. (Index arithmetic only: it compiles for every target.)
__device__ __forceinline__ size_t wg_rows_offset(const int m, const int k, const int K) {
    const int r = k % MMA_KB, q = r % 16;
    const int jc = q / 2; // 2j + c, with j = q / 4 and c = q % 4 / 2
    const int e = 2 * (r / 16) + q % 2;
    return ((size_t)(m / 64) * (K / MMA_KB) + k / MMA_KB) * (64 * MMA_KB) + ((size_t)jc * 64 + m % 64) * 8 + e;
}
// N values of row m from column k into the warpgroup engine's layout, rounded to T. The
// layout keeps each even column's pair together (wg_rows_offset(m, k + 1) is one past
// wg_rows_offset(m, k) for even k), so an even N at an even k goes as N / 2 four-byte stores.
template <int N, typename T>
__device__ __forceinline__ void store_laid(T *laid, const int m, const int k, const int K,
                                           const float *v) {
    if constexpr (N % 2 == 0) {
#pragma unroll
        for (int p = 0; p < N / 2; ++p) {
            const Pack<T, 2> pair{{from_f<T>(v[2 * p]), from_f<T>(v[2 * p + 1])}};
            store_pack(laid + wg_rows_offset(m, k + 2 * p, K), pair);
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) laid[wg_rows_offset(m, k + i, K)] = from_f<T>(v[i]);
    }
}
// Tiles of 8 rows a pass of the tensor-core engine takes when the rows come from global
// memory (the fused variants take one tile: GEMV_MAX_ROWS rows).
#define MMA_PASS_TILES 4
// Blocks of K whose weights a warp of the tensor-core engine has in flight: in the plain
// gemv (85 registers, GEMV_MIN_BLOCKS) and in the fused variants (128). Three in the plain
// gemv (at 2 blocks' registers: 2 spill at 3) gained nothing on Llama-2-7B's 256-block
// o_proj and down_proj. The one-row kernel, with registers to spare, takes a ring of two on
// such small grids (kestrel_gemv_row_mma_deep_*; 3 was slower than 2 and 4 no faster,
// tools/gpu/gemv_probe.cu).
#define MMA_DEPTH_PLAIN 1
#define MMA_DEPTH_FUSED 3
#define MMA_DEPTH_DEEP_ROW 2

// The fused variants stage their input rows [M, K] in dynamic shared memory, as T: exact,
// since the kernels they replace store T. Each block computes them once for all of its
// columns (computing them per column and weight vector instead cost ~5 µs a launch), while
// its weights are already on their way.
extern __shared__ __align__(16) unsigned char gemv_stage[];

// An L2 cache policy that evicts what it loads first, for all of a load's lines.
__device__ __forceinline__ unsigned long long evict_first_policy() {
    unsigned long long policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// 16 bytes of read-only global memory under the L2 policy `policy`.
template <typename T>
__device__ __forceinline__ uint4 load_evict_first(const T *p, const unsigned long long policy) {
    uint4 v;
    asm volatile("ld.global.nc.L2::cache_hint.v4.u32 {%0,%1,%2,%3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "l"(policy));
    return v;
}

template <typename T> __device__ __forceinline__ void mma16816(float *d, const unsigned *a,
                                                               const unsigned *b);
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float *d, const unsigned *a,
                                                        const unsigned *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float *d, const unsigned *a, const unsigned *b) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                 "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// MT: tiles of 8 rows per pass (`finish` takes up to 8·MT rows). STAGED: the rows are in
// `gemv_stage`, whose space then also takes the warps' partial sums once every warp is done
// with the rows (the host sizes it for both): a separate array would push the fused variants
// past the 48 KiB a block may use.
// DEPTH: blocks of K a warp has in flight (the ring); it changes no warp's order of blocks,
// so no bits.
// EVICT: the weights are read with an L2 evict-first policy (same bits), so that a step's
// weights, each read once, do not push out of L2 what its kernels read again (the step's input
// rows, read by every block; the gain stays with the attention left out, so it is not the K/V
// rows': docs/gpu-results.md, session 31). The host picks the instance per launch
// (evict_weights in cuda.rs), so the loads carry no branch.
template <typename T, int MT, bool STAGED, int DEPTH = STAGED ? MMA_DEPTH_FUSED : MMA_DEPTH_PLAIN,
          bool EVICT = false>
struct GemvMma {
    static constexpr int CHUNK = 8 * MT; // rows a `finish` takes
    static constexpr int MMA_DEPTH = DEPTH;
    // A lane's 32 bytes of weight row n0 + g ([0], [1]) and n0 + g + 8 ([2], [3]) for the
    // warp's next MMA_DEPTH blocks of K (`prefetch` loads the first ones, so that they travel
    // while a fused variant stages its rows): a warp keeps MMA_DEPTH × 2 KiB in flight.
    uint4 ring[MMA_DEPTH][4];
    const T *w_lo, *w_hi;
    int n0, g, t, warp, nkb;
    bool fresh; // `ring` holds the warp's first blocks (a later chunk of rows reloads them)
    unsigned long long policy; // the L2 evict-first policy (EVICT only)

    __device__ __forceinline__ void load_w(const int kb, uint4 *v) const {
        const int k0 = kb * MMA_KB + 16 * t;
        if constexpr (EVICT) {
            v[0] = load_evict_first(w_lo + k0, policy);
            v[1] = load_evict_first(w_lo + k0 + 8, policy);
            v[2] = load_evict_first(w_hi + k0, policy);
            v[3] = load_evict_first(w_hi + k0 + 8, policy);
        } else {
            v[0] = *reinterpret_cast<const uint4 *>(w_lo + k0);
            v[1] = *reinterpret_cast<const uint4 *>(w_lo + k0 + 8);
            v[2] = *reinterpret_cast<const uint4 *>(w_hi + k0);
            v[3] = *reinterpret_cast<const uint4 *>(w_hi + k0 + 8);
        }
    }

    __device__ __forceinline__ void prefetch(const T *__restrict__ w, const int N, const int K,
                                             const int) {
        const int lane = threadIdx.x % WARP;
        warp = threadIdx.x / WARP;
        g = lane >> 2;
        t = lane & 3;
        n0 = blockIdx.x * 16;
        nkb = K / MMA_KB;
        // Columns past N compute from row N − 1 and are never stored.
        w_lo = w + (size_t)min(n0 + g, N - 1) * K;
        w_hi = w + (size_t)min(n0 + g + 8, N - 1) * K;
        if constexpr (EVICT) policy = evict_first_policy();
        load_ring();
    }

    __device__ __forceinline__ void load_ring() {
#pragma unroll
        for (int s = 0; s < MMA_DEPTH; ++s)
            if (warp + s * GEMV_WARPS < nkb) load_w(warp + s * GEMV_WARPS, ring[s]);
        fresh = true;
    }

    // y[m, n] for m < M ≤ 8·MT from the rows x [M, K] (global or shared memory).
    __device__ __forceinline__ void finish(const T *x, T *__restrict__ y, const int M,
                                           const int N, const int K, const int) {
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[mt][i] = 0.f;
        if (!fresh) load_ring();
        fresh = false;
        constexpr int AHEAD = MMA_DEPTH * GEMV_WARPS;
        for (int kb0 = warp; kb0 < nkb; kb0 += AHEAD) {
#pragma unroll
            for (int s = 0; s < MMA_DEPTH; ++s) {
                const int kb = kb0 + s * GEMV_WARPS;
                if (kb >= nkb) break;
                const int k0 = kb * MMA_KB + 16 * t;
                const unsigned *wl = reinterpret_cast<const unsigned *>(&ring[s][0]);
                const unsigned *wh = reinterpret_cast<const unsigned *>(&ring[s][2]);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (mt * 8 < M) {
                        const int row = mt * 8 + g;
                        uint4 xr[2] = {make_uint4(0, 0, 0, 0), make_uint4(0, 0, 0, 0)};
                        if (row < M) {
                            xr[0] = *reinterpret_cast<const uint4 *>(x + (size_t)row * K + k0);
                            xr[1] =
                                *reinterpret_cast<const uint4 *>(x + (size_t)row * K + k0 + 8);
                        }
                        const unsigned *xw = reinterpret_cast<const unsigned *>(xr);
#pragma unroll
                        for (int j = 0; j < 4; ++j) {
                            // k slots (2t, 2t+1) ↔ k0 + 4j + (0, 1); (2t+8, 2t+9) ↔ k0 + 4j + (2, 3).
                            const unsigned a[4] = {wl[2 * j], wh[2 * j], wl[2 * j + 1],
                                                   wh[2 * j + 1]};
                            const unsigned b[2] = {xw[2 * j], xw[2 * j + 1]};
                            mma16816<T>(acc[mt], a, b);
                        }
                    }
                }
                // The slot's next block goes on its way once its MMAs have read it.
                if (kb + AHEAD < nkb) load_w(kb + AHEAD, ring[s]);
            }
        }
        float(*part)[MT][16][8];
        if constexpr (STAGED) {
            __syncthreads(); // every warp is done with the staged rows
            part = reinterpret_cast<float(*)[MT][16][8]>(gemv_stage);
        } else {
            __shared__ float own[GEMV_WARPS][MT][16][8];
            part = own;
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            part[warp][mt][g][2 * t] = acc[mt][0];
            part[warp][mt][g][2 * t + 1] = acc[mt][1];
            part[warp][mt][g + 8][2 * t] = acc[mt][2];
            part[warp][mt][g + 8][2 * t + 1] = acc[mt][3];
        }
        __syncthreads();
        for (int i = threadIdx.x; i < MT * 128; i += blockDim.x) {
            const int mt = i / 128, c = (i / 8) % 16, m = mt * 8 + i % 8;
            if (m < M && n0 + c < N) {
                float total = 0.f;
#pragma unroll
                for (int q = 0; q < GEMV_WARPS; ++q) total += part[q][mt][c][i % 8];
                y[(size_t)m * N + n0 + c] = from_f<T>(total);
            }
        }
        __syncthreads(); // `part` and the staged rows are free for the next chunk
    }
};

// ---------------------------------------------------------------------------------------
// The tiled tensor-core engine for steps of many rows (kestrel_gemv_tiled_*): GemvMma's
// per-output chains computed GEMM-style, so each weight byte crosses from memory once per
// block of TILED_ROWS rows and each row byte once per TILED_COLS columns.
// GemvMma sums an output as (((0 + P0) + P1) + … + P7), where chain Pp is warp p's MMAs over
// K's blocks p, p + 8, … from zero. Here a block walks K's blocks in chain order (p, p + 8, …,
// then p + 1, …: 128-byte pieces of each row, which stream as well as contiguous ones) with
// one accumulator per output, and adds it into the output's total when a chain ends: the same
// MMAs with the same operands in the same order, then the same additions, with two registers
// an output instead of eight. A row therefore gets the bits GemvMma gives it (GPU test
// `gemv_matches_a_cpu_matmul_and_each_row_ignores_the_others`), whichever engine a step's
// row count picks (`gemv_tiled_applies` in lib.rs).
// The chains may also be split between `groups` blocks (grid.x: the fastest index, so that
// a tile's groups run together and their 128-byte pieces of each weight row reach memory as
// one contiguous run, as the one-row engine's warps' do): each block then stores its chains'
// sums in `parts` [8, M, N] and kestrel_gemv_tiled_sum adds them in chain order, the same
// additions again. Grid: (groups, row tiles, column tiles).
// 8 warps a block: 4 column groups × 2 row groups, each warp 2 tiles of 16 columns × 4 tiles
// of 8 rows. Blocks of K are copied to shared memory with cp.async, TILED_STAGES − 1 ahead.
// ---------------------------------------------------------------------------------------
#define TILED_COLS 128
#define TILED_ROWS 64
#define TILED_A 2 // 16-column tiles a warp
#define TILED_B 4 // 8-row tiles a warp
#define TILED_COL_GROUPS (TILED_COLS / (16 * TILED_A))
#define TILED_CHAINS GEMV_WARPS // GemvMma's partial sums
// A staged row of one K block, padded by 16 bytes so that the fragment loads of a warp's
// 8-lane phases hit distinct banks.
#define TILED_LD (MMA_KB + 8)
#define TILED_BLOCK_ELEMS ((TILED_COLS + TILED_ROWS) * TILED_LD)
#define TILED_STAGES 4
// 16-byte vectors a thread copies per block of K: (TILED_COLS + TILED_ROWS) · 8 over 256.
#define TILED_COPIES ((TILED_COLS + TILED_ROWS) * 8 / (GEMV_WARPS * WARP))

__device__ __forceinline__ void cp_async16(void *smem, const void *gmem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}

// cp_async16 under the L2 policy `policy` (evict_first_policy).
__device__ __forceinline__ void cp_async16_hinted(void *smem, const void *gmem,
                                                  const unsigned long long policy) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(s),
                 "l"(gmem), "l"(policy));
}

template <typename T, bool EVICT = false>
__device__ void gemv_tiled(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y,
                           float *__restrict__ parts, const int M, const int N, const int K,
                           const int groups) {
    if constexpr (sizeof(T) == 2) {
        const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
        const int g = lane >> 2, t = lane & 3;
        const int wc = (warp % TILED_COL_GROUPS) * 16 * TILED_A;     // in the block
        const int wr = (warp / TILED_COL_GROUPS) * 8 * TILED_B;      // in the block
        const int m0 = blockIdx.y * TILED_ROWS, n0 = blockIdx.z * TILED_COLS;
        const int rows = min(TILED_ROWS, M - m0);
        const int nkb = K / MMA_KB;
        const int p0 = blockIdx.x * TILED_CHAINS / groups;
        const int p1 = (blockIdx.x + 1) * TILED_CHAINS / groups;
        T *staged = reinterpret_cast<T *>(gemv_stage);

        // A thread copies the same TILED_COPIES 16-byte vectors of every block of K: vector
        // c8 of staged rows r0 + 32j, the first TILED_W_COPIES of them weight rows, the rest
        // input rows, so its sources are worked out once. Rows past M are not loaded: an MMA
        // output depends on its own row only, and theirs are never stored.
        static_assert(TILED_COLS % 32 == 0 && TILED_ROWS % 32 == 0, "copy rows");
        constexpr int TILED_W_COPIES = TILED_COLS / 32;
        const int r0 = threadIdx.x / 8, c8 = (threadIdx.x % 8) * 8;
        // Element offsets into w or x (the host keeps N·K and M·K below 2³¹: 32-bit offsets
        // leave the registers to the accumulators).
        unsigned src[TILED_COPIES];
#pragma unroll
        for (int j = 0; j < TILED_COPIES; ++j)
            // Columns past N compute from row N − 1 and are never stored.
            src[j] = (unsigned)(j < TILED_W_COPIES
                                    ? min(n0 + r0 + 32 * j, N - 1)
                                    : m0 + min(r0 + 32 * (j - TILED_W_COPIES), rows - 1)) *
                         (unsigned)K +
                     c8;
        T *const dst = staged + r0 * TILED_LD + c8;
        unsigned long long policy = 0;
        if constexpr (EVICT) policy = evict_first_policy();
        // The next block of K to load: kb of chain lp (p0 ≤ lp < p1 while any is left).
        int lp = p0, lkb = p0;
        while (lp < p1 && lkb >= nkb) lkb = ++lp;
        // The block's i-th block of K into its buffer. Every call commits a group (empty past
        // the end), so that waiting for all but TILED_STAGES − 2 groups always means the
        // block in use has arrived. Calls come in order of i.
        auto load = [&](const int i) {
            if (lp < p1) {
                T *s = dst + (i % TILED_STAGES) * TILED_BLOCK_ELEMS;
                const int k = lkb * MMA_KB;
#pragma unroll
                for (int j = 0; j < TILED_COPIES; ++j)
                    if (j < TILED_W_COPIES) {
                        if constexpr (EVICT)
                            cp_async16_hinted(s + 32 * j * TILED_LD, w + src[j] + k, policy);
                        else
                            cp_async16(s + 32 * j * TILED_LD, w + src[j] + k);
                    } else if (r0 + 32 * (j - TILED_W_COPIES) < rows) {
                        cp_async16(s + 32 * j * TILED_LD, x + src[j] + k);
                    }
                lkb += TILED_CHAINS;
                while (lp < p1 && lkb >= nkb) lkb = ++lp;
            }
            asm volatile("cp.async.commit_group;\n" ::);
        };
        for (int i = 0; i < TILED_STAGES - 1; ++i) load(i);

        // f(a, b, e, m, n) for each of the lane's MMA outputs: column tile a, row tile b,
        // element e (e = 0, 1 → column g, row 2t + e; e = 2, 3 → column g + 8, row 2t + e − 2)
        // at output row m and column n.
        auto each_output = [&](auto &&f) {
#pragma unroll
            for (int a = 0; a < TILED_A; ++a)
#pragma unroll
                for (int b = 0; b < TILED_B; ++b)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        f(a, b, e, m0 + wr + b * 8 + 2 * t + (e & 1),
                          n0 + wc + a * 16 + g + (e >> 1) * 8);
        };
        float acc[TILED_A][TILED_B][4], total[TILED_A][TILED_B][4];
        each_output([&](int a, int b, int e, int, int) { acc[a][b][e] = total[a][b][e] = 0.f; });
        int i = 0;
        for (int p = p0; p < p1; ++p) {
            for (int kb = p; kb < nkb; kb += TILED_CHAINS, ++i) {
                asm volatile("cp.async.wait_group %0;\n" ::"n"(TILED_STAGES - 2));
                __syncthreads(); // this block of K is in; every warp is done with the last one
                load(i + TILED_STAGES - 1);
                const T *s = staged + (i % TILED_STAGES) * TILED_BLOCK_ELEMS;
                // GemvMma's lane takes 32 bytes at 16t of each of its rows and feeds MMA j
                // the 4-byte words 2j and 2j + 1 of them; here the two 16-byte halves come in
                // turn (h: MMAs 2h and 2h + 1), which keeps every accumulator's order.
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    uint4 wv[TILED_A][2], xv[TILED_B];
#pragma unroll
                    for (int a = 0; a < TILED_A; ++a) {
                        const T *lo = s + (wc + a * 16 + g) * TILED_LD + 16 * t + 8 * h;
                        wv[a][0] = *reinterpret_cast<const uint4 *>(lo);
                        wv[a][1] = *reinterpret_cast<const uint4 *>(lo + 8 * TILED_LD);
                    }
#pragma unroll
                    for (int b = 0; b < TILED_B; ++b)
                        if (wr + b * 8 < rows)
                            xv[b] = *reinterpret_cast<const uint4 *>(
                                s + (TILED_COLS + wr + b * 8 + g) * TILED_LD + 16 * t + 8 * h);
#pragma unroll
                    for (int jj = 0; jj < 2; ++jj)
#pragma unroll
                        for (int a = 0; a < TILED_A; ++a) {
                            const unsigned *wl = reinterpret_cast<const unsigned *>(&wv[a][0]);
                            const unsigned *wh = reinterpret_cast<const unsigned *>(&wv[a][1]);
                            const unsigned af[4] = {wl[2 * jj], wh[2 * jj], wl[2 * jj + 1],
                                                    wh[2 * jj + 1]};
#pragma unroll
                            for (int b = 0; b < TILED_B; ++b)
                                if (wr + b * 8 < rows) {
                                    const unsigned *xw = reinterpret_cast<const unsigned *>(&xv[b]);
                                    const unsigned bf[2] = {xw[2 * jj], xw[2 * jj + 1]};
                                    mma16816<T>(acc[a][b], af, bf);
                                }
                        }
                }
            }
            // Chain p is done (an empty one, past K's blocks, adds zeros as GemvMma's idle
            // warps do).
            each_output([&](int a, int b, int e, int m, int n) {
                if (groups == 1)
                    total[a][b][e] += acc[a][b][e];
                else if (m < M && n < N)
                    parts[((size_t)p * M + m) * N + n] = acc[a][b][e];
                acc[a][b][e] = 0.f;
            });
        }
        asm volatile("cp.async.wait_group 0;\n" ::);
        if (groups == 1)
            each_output([&](int a, int b, int e, int m, int n) {
                if (m < M && n < N) y[(size_t)m * N + n] = from_f<T>(total[a][b][e]);
            });
    }
}

// y = the chains' sums in `parts` [8, mn] added into zero in chain order (kestrel_gemv_tiled's
// split launches).
template <typename T>
__device__ void gemv_tiled_sum(const float *__restrict__ parts, T *__restrict__ y,
                               const size_t mn) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < mn;
         i += (size_t)gridDim.x * blockDim.x) {
        float total = 0.f;
#pragma unroll
        for (int p = 0; p < TILED_CHAINS; ++p) total += parts[p * mn + i];
        y[i] = from_f<T>(total);
    }
}

// Runs `run(engine)` with the engine the host picked through `split`: the tensor-core one
// (MT tiles of 8 rows a pass; STAGED: the rows are in `gemv_stage`) or the FMA one.
template <typename T, int MT, bool STAGED, bool EVICT, typename F>
__device__ __forceinline__ void with_engine(const int split, F &&run) {
    if constexpr (sizeof(T) == 2) {
        if (split == GEMV_MMA) {
            run(GemvMma<T, MT, STAGED, STAGED ? MMA_DEPTH_FUSED : MMA_DEPTH_PLAIN, EVICT>{});
            return;
        }
    }
    run(GemvWarp<T>{});
}

// MT: tiles of 8 rows the tensor-core engine takes a pass. kestrel_gemv_one_tile_* (MT = 1)
// serves steps of 2 to 8 rows, and single rows where the tensor cores do not apply (a decode
// row on them takes gemv_row_mma): the same MMAs and additions for each row (the bits do not
// change), a quarter of the partial sums' shared memory to store and add. On Llama-2-7B's
// projections at one row (H200, tools/gpu/gemv_probe.cu) it takes 0.4-1.6% less time than
// the four-tile kernel, a decode step 0.8% less. Both instances in one kernel spilled.
template <typename T, int MT, bool EVICT = false>
__device__ void gemv(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y,
                     const int M, const int N, const int K, const int split) {
    with_engine<T, MT, false, EVICT>(split, [&](auto g) {
        constexpr int CHUNK = decltype(g)::CHUNK;
        g.prefetch(w, N, K, split);
        pdl_enter(); // the weights are on their way; x is the previous kernel's
        for (int m0 = 0; m0 < M; m0 += CHUNK)
            g.finish(x + (size_t)m0 * K, y + (size_t)m0 * N, min(CHUNK, M - m0), N, K, split);
    });
}

// A decode step's one row on the tensor-core engine alone, M = 1 known to the compiler: the
// row loops and their guards fold away and the FMA engine's registers are not reserved (the
// same MMAs and additions, so the same bits as kestrel_gemv_one_tile_*). On Llama-2-7B's
// projections (H200, tools/gpu/gemv_probe.cu) 3-4% less time than the one-tile kernel.
// The host takes it only where the tensor-core engine applies (16-bit T, K a multiple of 64);
// it takes kestrel_gemv_*'s arguments and ignores M (1) and split (GEMV_MMA).
// DEPTH: blocks of K a warp has in flight. kestrel_gemv_row_mma_deep_* (MMA_DEPTH_DEEP_ROW)
// serves grids of up to 2 blocks a multiprocessor, where one block of K a warp leaves the
// memory idle between requests (cuda.rs, gemv_row_kernel): on Llama-2-7B's o_proj and
// down_proj 7% and 9% less time, on its bigger q/k/v and gate_up 3% more.
template <typename T, int DEPTH>
__device__ void gemv_row_mma(const T *__restrict__ x, const T *__restrict__ w,
                             T *__restrict__ y, const int N, const int K) {
    if constexpr (sizeof(T) == 2) {
        GemvMma<T, 1, false, DEPTH> g{};
        g.prefetch(w, N, K, GEMV_MMA);
        pdl_enter(); // the weights are on their way; x is the previous kernel's
        g.finish(x, y, 1, N, K, GEMV_MMA);
    } else {
        __trap(); // no tensor-core engine for 4-byte T
    }
}

// SwiGLU fused into the projection after it: x = round_T(silu_T(gate) · up) of the fused
// gate_up rows gu [M, 2K], computed as kestrel_swiglu does.
template <typename T, typename G>
__device__ void gemv_swiglu_with(G g, const T *__restrict__ gu, const T *__restrict__ w,
                                 T *__restrict__ y, const int M, const int N, const int K,
                                 const int split) {
    constexpr int VEC = 16 / sizeof(T);
    g.prefetch(w, N, K, split);
    pdl_enter();
    T *xs = reinterpret_cast<T *>(gemv_stage);
    const int kv = K / VEC;
    for (int m0 = 0; m0 < M; m0 += G::CHUNK) {
        const int mc = min(G::CHUNK, M - m0);
        // Vectors (row, k0) in batches of STAGE_BATCH per thread, all loads first.
        for (int base = threadIdx.x; base < mc * kv; base += STAGE_BATCH * blockDim.x) {
            uint4 g_raw[STAGE_BATCH], u_raw[STAGE_BATCH];
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; ++u) {
                const int i = min(base + u * (int)blockDim.x, mc * kv - 1);
                const T *row = gu + (size_t)(m0 + i / kv) * 2 * K + (i % kv) * VEC;
                g_raw[u] = *reinterpret_cast<const uint4 *>(row);
                u_raw[u] = *reinterpret_cast<const uint4 *>(row + K);
            }
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; ++u) {
                const int i = base + u * blockDim.x;
                if (i < mc * kv) {
                    float gate[VEC], up[VEC];
                    unpack16<T>(g_raw[u], gate);
                    unpack16<T>(u_raw[u], up);
#pragma unroll
                    for (int j = 0; j < VEC; ++j) gate[j] = silu_t<T>(gate[j]) * up[j];
                    store16(xs + (size_t)(i / kv) * K + (i % kv) * VEC, gate);
                }
            }
        }
        __syncthreads();
        g.finish(xs, y + (size_t)m0 * N, mc, N, K, split);
    }
}

// The residual add and RMSNorm fused into the projection after them: sum = x + res (rounded
// to T; res may be null: no add) and y = gemv(round_T(round_T(sum · rsqrt(mean(sum²) + eps))
// · nw)), the values of kestrel_add_rmsnorm. Block 0 also writes the sums to sum_out (with a
// residual). Staging: the block's threads split each row into 16-byte vectors (thread t takes
// vectors t, t + blockDim, …, the same ones in every row), stage the sums and nw in shared
// memory ([M, K] then [K]) and sum their squares; a row's sum of squares is then the warps'
// partial sums added in a fixed order, so it does not depend on M.
// Partial sums of the tensor-core engine over one tile of rows (GemvMma<T, 1, true>), which
// it keeps where the staged rows were (GEMV_PART_BYTES in lib.rs).
#define GEMV_PART_BYTES (GEMV_WARPS * 16 * 8 * 4)

// Where gemv_add_rmsnorm keeps the norm weight in `gemv_stage`: after a chunk's rows and sums
// of squares, and past the engine's partial sums, which overwrite those once they are used
// (gemv_add_rms_norm_stage in lib.rs computes the same).
__device__ __forceinline__ int gemv_add_rmsnorm_norm_offset(const int chunk, const int K,
                                                            const int vec, const int elem) {
    const int used = chunk * K * elem + chunk * (K / vec) * 4;
    return max((used + 15) / 16 * 16, GEMV_PART_BYTES);
}

// One 16-byte vector of a residual sum: s = round_T(x + r) (zero bits for r: no add), and
// Σ s² over the vector. gemv_add_rmsnorm's staging and add_rmsnorm_rows share it (and
// normed_vec), so that the two give the same bits.
template <typename T>
__device__ __forceinline__ float residual_vec(const uint4 x_raw, const uint4 r_raw, float *s) {
    constexpr int VEC = 16 / sizeof(T);
    float r[VEC];
    unpack16<T>(x_raw, s);
    unpack16<T>(r_raw, r); // zero bits are 0.0 in every T
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
        s[j] = round_t<T>(s[j] + r[j]);
        ss += s[j] * s[j];
    }
    return ss;
}

// s ← round_T(scale · s) · w: a normed vector, rounded to T when stored.
template <typename T>
__device__ __forceinline__ void normed_vec(float *s, const float *wn, const float scale) {
#pragma unroll
    for (int j = 0; j < 16 / (int)sizeof(T); ++j) s[j] = round_t<T>(scale * s[j]) * wn[j];
}

template <typename T, typename G>
__device__ void gemv_add_rmsnorm_with(G g, const T *__restrict__ x, const T *__restrict__ res,
                                      const T *__restrict__ nw, const T *__restrict__ w,
                                      T *__restrict__ y, T *__restrict__ sum_out, const int M,
                                      const int N, const int K, const float eps,
                                      const int split) {
    constexpr int VEC = 16 / sizeof(T);
    __shared__ float row_scale[GEMV_MAX_ROWS];
    g.prefetch(w, N, K, split);
    T *xs = reinterpret_cast<T *>(gemv_stage);
    // Dynamic shared memory: a chunk of rows, the chunk's per-vector sums of squares (f32),
    // then the norm weight (gemv_add_rmsnorm_norm_offset).
    const int chunk = min(M, G::CHUNK);
    float *sqv = reinterpret_cast<float *>(xs + (size_t)chunk * K);
    T *nws = reinterpret_cast<T *>(gemv_stage + gemv_add_rmsnorm_norm_offset(chunk, K, VEC, sizeof(T)));
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int kv = K / VEC;
    for (int v = threadIdx.x; v < kv; v += blockDim.x) {
        float t[VEC];
        load16(nw + v * VEC, t);
        store16(nws + v * VEC, t);
    }
    pdl_enter(); // the projection and norm weights were read before waiting
    __syncthreads(); // the staged norm weight
    for (int m0 = 0; m0 < M; m0 += G::CHUNK) {
        const int mc = min(G::CHUNK, M - m0);
        const size_t row0 = (size_t)m0 * K;
        // Vectors (row, v) in batches of STAGE_BATCH per thread, all loads first; each
        // vector's sum of squares goes to sqv, summed per row below in a fixed order.
        for (int base = threadIdx.x; base < mc * kv; base += STAGE_BATCH * blockDim.x) {
            uint4 x_raw[STAGE_BATCH], r_raw[STAGE_BATCH];
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; ++u) {
                const int i = min(base + u * (int)blockDim.x, mc * kv - 1);
                const size_t off = row0 + (size_t)(i / kv) * K + (i % kv) * VEC;
                x_raw[u] = *reinterpret_cast<const uint4 *>(x + off);
                r_raw[u] = res ? *reinterpret_cast<const uint4 *>(res + off) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < STAGE_BATCH; ++u) {
                const int i = base + u * blockDim.x;
                if (i < mc * kv) {
                    const size_t off = (size_t)(i / kv) * K + (i % kv) * VEC;
                    float sv[VEC];
                    sqv[i] = residual_vec<T>(x_raw[u], r_raw[u], sv);
                    store16(xs + off, sv);
                    if (res && blockIdx.x == 0) store16(sum_out + row0 + off, sv);
                }
            }
        }
        __syncthreads();
        // Row m's sum of squares: warp m over its vectors (lane-strided, then the warp's
        // tree), an order fixed by K.
        for (int r = warp; r < mc; r += GEMV_WARPS) {
            float ss = 0.f;
            for (int v = lane; v < kv; v += WARP) ss += sqv[r * kv + v];
            ss = warp_sum(ss);
            if (lane == 0) row_scale[r] = rsqrtf(ss / K + eps);
        }
        __syncthreads();
        for (int i = threadIdx.x; i < mc * kv; i += blockDim.x) {
            const int v = i % kv;
            const size_t off = (size_t)(i / kv) * K + v * VEC;
            const float scale = row_scale[i / kv];
            float sv[VEC], wn[VEC];
            load16(xs + off, sv);
            load16(nws + v * VEC, wn);
            normed_vec<T>(sv, wn, scale);
            store16(xs + off, sv);
        }
        __syncthreads();
        g.finish(xs, y + (size_t)m0 * N, mc, N, K, split);
    }
}

// The staged variants take chunks of GEMV_MAX_ROWS rows with either engine. Every block
// stages all rows, so the host runs steps of more rows unfused (lib.rs), which gives the
// same bits.
template <typename T, bool EVICT = false>
__device__ void gemv_swiglu(const T *__restrict__ gu, const T *__restrict__ w,
                            T *__restrict__ y, const int M, const int N, const int K,
                            const int split) {
    with_engine<T, 1, true, EVICT>(split, [&](auto g) { gemv_swiglu_with<T>(g, gu, w, y, M, N, K, split); });
}

template <typename T, bool EVICT = false>
__device__ void gemv_add_rmsnorm(const T *__restrict__ x, const T *__restrict__ res,
                                 const T *__restrict__ nw, const T *__restrict__ w,
                                 T *__restrict__ y, T *__restrict__ sum_out, const int M,
                                 const int N, const int K, const float eps, const int split) {
    with_engine<T, 1, true, EVICT>(split, [&](auto g) {
        gemv_add_rmsnorm_with<T>(g, x, res, nw, w, y, sum_out, M, N, K, eps, split);
    });
}

// gemv_add_rmsnorm's sums and normed rows written out, for steps with more rows than its
// chunk (lib.rs then runs the plain gemv on them): out [2, n_rows, h] = sums, normed rows;
// with `laid`, the normed rows go there instead, in the warpgroup engine's layout
// (wg_rows_offset; rows past n_rows of the last 64-row tile are not written).
// One warp per row walks the row's vectors in the order of the fused kernel's staging (lane l:
// vectors l, l + 32, …, then the warp's tree), so each value has the fused kernel's bits.
// Needs h a multiple of the vector width and 16-byte aligned rows.
template <typename T>
__device__ void add_rmsnorm_rows(const T *__restrict__ x, const T *__restrict__ res,
                                 const T *__restrict__ w, T *__restrict__ out, T *__restrict__ laid,
                                 const int n_rows, const int h, const float eps) {
    constexpr int VEC = 16 / sizeof(T);
    const int row = blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= n_rows) return; // a whole warp
    const int kv = h / VEC;
    const size_t base = (size_t)row * h;
    T *sum_out = out + base;
    T *norm_out = out + (size_t)n_rows * h + base;
    auto vec = [&](const int v, float *s) {
        const uint4 x_raw = *reinterpret_cast<const uint4 *>(x + base + v * VEC);
        const uint4 r_raw = *reinterpret_cast<const uint4 *>(res + base + v * VEC);
        return residual_vec<T>(x_raw, r_raw, s);
    };
    float ss = 0.f;
    for (int v = lane; v < kv; v += WARP) {
        float s[VEC];
        ss += vec(v, s);
        store16(sum_out + v * VEC, s);
    }
    const float scale = rsqrtf(warp_sum(ss) / h + eps);
    for (int v = lane; v < kv; v += WARP) {
        float s[VEC], wn[VEC];
        vec(v, s); // the same sums again
        load16(w + v * VEC, wn);
        normed_vec<T>(s, wn, scale);
        if (laid) {
            store_laid<VEC>(laid, row, v * VEC, h, s);
        } else {
            store16(norm_out + v * VEC, s);
        }
    }
}

// ---------------------------------------------------------------------------------------
// KV compaction: moves rows between slots in every pool of a cache (all layers' K and V) in
// one launch, after a tree verification kept some of its nodes.
// table (u32): each pool's base address as (low, high) words [2·n_pools], then src[m], dst[m]
// (pool rows). scratch: [n_pools, m, width]. One block per pool reads all of its moved rows
// into scratch before writing any, so a destination that is another move's source still
// gives up its old value.
// ---------------------------------------------------------------------------------------
template <typename T>
__device__ void kv_move(const unsigned int *__restrict__ table, T *__restrict__ scratch,
                        const int n_pools, const int m, const int width) {
    const int p = blockIdx.x;
    T *pool = reinterpret_cast<T *>((static_cast<unsigned long long>(table[2 * p + 1]) << 32) |
                                    table[2 * p]);
    const unsigned int *src = table + 2 * n_pools;
    const unsigned int *dst = src + m;
    T *sc = scratch + (size_t)p * m * width;
    for (int i = threadIdx.x; i < m * width; i += blockDim.x)
        sc[i] = pool[(size_t)src[i / width] * width + i % width];
    __syncthreads();
    for (int i = threadIdx.x; i < m * width; i += blockDim.x)
        pool[(size_t)dst[i / width] * width + i % width] = sc[i];
}

// ---------------------------------------------------------------------------------------
// Fused residual add + RMSNorm. out: [2, n_rows, h]: out[0] = x + res (rounded to T),
// out[1] = round_T(round_T(sum · rsqrt(mean(sum²) + eps)) · w). For f32 this is candle's
// rms_norm; for f16/bf16 it is the model's path (normalise in f32, store, scale in dtype).
// One block per row.
// ---------------------------------------------------------------------------------------
// Vectors a thread of add_rmsnorm holds in registers (ADD_RMS_VECS in cuda.rs).
#define ADD_RMS_VECS 4

template <typename T>
__device__ void add_rmsnorm(const T *__restrict__ x, const T *__restrict__ res,
                            const T *__restrict__ w, T *__restrict__ out, const int n_rows,
                            const int h, const float eps, const int vec) {
    __shared__ float red[32];
    const int row = blockIdx.x;
    const T *xr = x + (size_t)row * h;
    const T *rr = res + (size_t)row * h;
    T *sum_out = out + (size_t)row * h;
    T *norm_out = out + ((size_t)n_rows + row) * h;
    if (vec) {
        // 16-byte vectors, thread t holding vectors t, t + blockDim, … (at most
        // ADD_RMS_VECS): x, res and w are all requested before any arithmetic, so a row
        // costs one memory latency, not one per pass and another to read the sums back.
        constexpr int VEC = 16 / sizeof(T);
        const int nv = h / VEC;
        uint4 xv[ADD_RMS_VECS], rv[ADD_RMS_VECS], wv[ADD_RMS_VECS];
#pragma unroll
        for (int u = 0; u < ADD_RMS_VECS; ++u) {
            const int v = threadIdx.x + u * blockDim.x;
            if (v < nv) {
                xv[u] = *reinterpret_cast<const uint4 *>(xr + v * VEC);
                rv[u] = *reinterpret_cast<const uint4 *>(rr + v * VEC);
                wv[u] = *reinterpret_cast<const uint4 *>(w + v * VEC);
            }
        }
        float sums[ADD_RMS_VECS][VEC];
        float ss = 0.f;
#pragma unroll
        for (int u = 0; u < ADD_RMS_VECS; ++u) {
            const int v = threadIdx.x + u * blockDim.x;
            if (v < nv) {
                float a[VEC], b[VEC];
                unpack16<T>(xv[u], a);
                unpack16<T>(rv[u], b);
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    sums[u][i] = round_t<T>(a[i] + b[i]);
                    ss += sums[u][i] * sums[u][i];
                }
                store16(sum_out + v * VEC, sums[u]);
            }
        }
        const float scale = rsqrtf(block_sum(ss, red) / h + eps);
#pragma unroll
        for (int u = 0; u < ADD_RMS_VECS; ++u) {
            const int v = threadIdx.x + u * blockDim.x;
            if (v < nv) {
                float wf[VEC];
                unpack16<T>(wv[u], wf);
                normed_vec<T>(sums[u], wf, scale);
                store16(norm_out + v * VEC, sums[u]);
            }
        }
        return;
    }
    float ss = 0.f;
    for (int e = threadIdx.x; e < h; e += blockDim.x) {
        const T s = from_f<T>(to_f(xr[e]) + to_f(rr[e]));
        sum_out[e] = s;
        const float sf = to_f(s);
        ss += sf * sf;
    }
    const float total = block_sum(ss, red);
    const float scale = rsqrtf(total / h + eps);
    // Each thread reads back only the elements it wrote itself: no barrier needed.
    for (int e = threadIdx.x; e < h; e += blockDim.x) {
        const float normed = round_t<T>(scale * to_f(sum_out[e]));
        norm_out[e] = from_f<T>(normed * to_f(w[e]));
    }
}

// ---------------------------------------------------------------------------------------
// RMSNorm in column blocks: kestrel_add_rmsnorm's rows (kestrel_add_rmsnorm_cols_*), which
// the host takes for every 16-bit row it can (`column_blocks` in cuda.rs): one block of
// NORM_COL_THREADS a row, each thread holding one or two blocks of 16 columns in registers,
// every load issued before any arithmetic. Block b's partial is its 16 squares added one
// after another, thread t adds the partials of blocks t, t + NORM_COL_THREADS, … in that
// order, and block_sum adds the threads'. For Llama-2-7B's 4,096-wide rows this replaced
// one vector a thread over 512 threads, whose 64-register bound spilled: a decode step
// 1.9-2.6% shorter, a 64-row verification 5-7% (two H100s, docs/gpu-results.md, session 49).
// Needs 16-bit T, h a multiple of 16 and at most 16 · NORM_COL_THREADS · NORM_COL_BLOCKS,
// 16-byte aligned rows and blockDim.x == NORM_COL_THREADS.
// ---------------------------------------------------------------------------------------
#define NORM_COL_THREADS 256
#define NORM_COL_BLOCKS 2

// sum_out[:h] = round_T(x + res), norm_out[:h] = its norm · w.
template <typename T>
__device__ void add_rmsnorm_column_blocks(const T *__restrict__ x, const T *__restrict__ res,
                                          const T *__restrict__ w, T *__restrict__ sum_out,
                                          T *__restrict__ norm_out, const int h,
                                          const float eps) {
    static_assert(sizeof(T) == 2, "16-bit rows: a block of 16 columns is two vectors");
    __shared__ float red[32];
    const int nb = h / 16;
    uint4 xv[NORM_COL_BLOCKS][2], rv[NORM_COL_BLOCKS][2], wv[NORM_COL_BLOCKS][2];
    // Every load first, so that the row costs one memory latency.
#pragma unroll
    for (int u = 0; u < NORM_COL_BLOCKS; ++u) {
        const int b = threadIdx.x + u * NORM_COL_THREADS;
        if (b < nb) {
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int off = 16 * b + 8 * half;
                xv[u][half] = *reinterpret_cast<const uint4 *>(x + off);
                rv[u][half] = *reinterpret_cast<const uint4 *>(res + off);
                wv[u][half] = *reinterpret_cast<const uint4 *>(w + off);
            }
        }
    }
    float s[NORM_COL_BLOCKS][16];
    float acc = 0.f;
#pragma unroll
    for (int u = 0; u < NORM_COL_BLOCKS; ++u) {
        const int b = threadIdx.x + u * NORM_COL_THREADS;
        if (b < nb) {
            residual_vec<T>(xv[u][0], rv[u][0], s[u]);
            residual_vec<T>(xv[u][1], rv[u][1], s[u] + 8);
            float part = 0.f;
#pragma unroll
            for (int j = 0; j < 16; ++j) part = __fmaf_rn(s[u][j], s[u][j], part);
            acc = __fadd_rn(acc, part);
            store16(sum_out + 16 * b, s[u]);
            store16(sum_out + 16 * b + 8, s[u] + 8);
        }
    }
    const float scale = rsqrtf(block_sum(acc, red) / h + eps);
#pragma unroll
    for (int u = 0; u < NORM_COL_BLOCKS; ++u) {
        const int b = threadIdx.x + u * NORM_COL_THREADS;
        if (b < nb) {
            float wn[16];
            unpack16<T>(wv[u][0], wn);
            unpack16<T>(wv[u][1], wn + 8);
            normed_vec<T>(s[u], wn, scale);
            normed_vec<T>(s[u] + 8, wn + 8, scale);
            store16(norm_out + 16 * b, s[u]);
            store16(norm_out + 16 * b + 8, s[u] + 8);
        }
    }
}

// ---------------------------------------------------------------------------------------
// SwiGLU on the fused gate_up projection: gu [n_rows, 2·inter] (gate then up) →
// out [n_rows, inter] = round_T(round_T(silu(gate)) · up), the rounding of candle's
// `silu(gate) * up` in the tensor's dtype; with `laid`, the rows go there instead, in the
// warpgroup engine's layout (wg_rows_offset), for the down projection.
// A thread takes V consecutive columns of a row: 16 bytes where the host found inter a
// multiple of that and the rows aligned to it (one element a thread cost a 64-row Llama-2-7B
// verification ~7 µs a layer in 2-byte accesses, session 46), else one.
// ---------------------------------------------------------------------------------------
template <typename T, int V>
__device__ void swiglu(const T *__restrict__ gu, T *__restrict__ out, T *__restrict__ laid,
                       const size_t total, const int inter) {
    const int per_row = inter / V;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total / V;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / per_row;
        const int c = (int)(i % per_row) * V;
        const Pack<T, V> g = load_pack<T, V>(gu + row * 2 * inter + c);
        const Pack<T, V> u = load_pack<T, V>(gu + row * 2 * inter + inter + c);
        float f[V];
#pragma unroll
        for (int j = 0; j < V; ++j) f[j] = silu_t<T>(to_f(g.v[j])) * to_f(u.v[j]);
        if (laid) {
            store_laid<V>(laid, (int)row, c, inter, f);
        } else {
            Pack<T, V> o;
#pragma unroll
            for (int j = 0; j < V; ++j) o.v[j] = from_f<T>(f[j]);
            store_pack(out + row * inter + c, o);
        }
    }
}

// ---------------------------------------------------------------------------------------
// Split + RoPE + KV append of a fused QKV projection, replacing five launches (two copies of
// strided parts, two RoPEs, the V copy) and the two appends.
// qkv: [n_tok, (nh + 2·nkv)·d] (q heads, then k, then v); cos, sin: [n_tok, d/2] in T;
// slots: [n_tok] pool rows. Writes q_out [n_tok, nh, d] (roped), and the roped K and the V
// rows of every token into the pools at its slot. The rotation is candle's rope_thd written
// the same way in T (x1·c − x2·s, x1·s + x2·c), so results match the ops it replaces.
// Grid (n_tok, ⌈heads · d/2 / V / blockDim⌉): a thread takes V consecutive pairs (element i
// and i + d/2) of one head, 16 bytes of each where the host found d/2 a multiple of that and
// every row aligned to it, else one pair (a thread a pair cost a 64-row Llama-2-7B
// verification ~10 µs a layer in session 46; 16 bytes, ~0.3 µs in session 51).
// ---------------------------------------------------------------------------------------
template <typename T, int V>
__device__ void qkv_rope(const T *__restrict__ qkv, const T *__restrict__ cos,
                         const T *__restrict__ sin, const unsigned int *__restrict__ slots,
                         T *__restrict__ q_out, T *__restrict__ k_pool, T *__restrict__ v_pool,
                         const int nh, const int nkv, const int d) {
    const int t = blockIdx.x, half = d / 2, per_head = half / V, heads = nh + 2 * nkv;
    const int unit = blockIdx.y * blockDim.x + threadIdx.x;
    if (unit >= heads * per_head) return;
    const int hh = unit / per_head, i = (unit % per_head) * V;
    const T *src = qkv + ((size_t)t * heads + hh) * d;
    const size_t slot = slots[t];
    const Pack<T, V> x1 = load_pack<T, V>(src + i), x2 = load_pack<T, V>(src + i + half);
    if (hh >= nh + nkv) {
        T *dst = v_pool + (slot * nkv + (hh - nh - nkv)) * d;
        store_pack(dst + i, x1);
        store_pack(dst + i + half, x2);
        return;
    }
    T *dst = hh < nh ? q_out + ((size_t)t * nh + hh) * d : k_pool + (slot * nkv + (hh - nh)) * d;
    const Pack<T, V> c = load_pack<T, V>(cos + (size_t)t * half + i);
    const Pack<T, V> s = load_pack<T, V>(sin + (size_t)t * half + i);
    Pack<T, V> lo, hi;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        lo.v[j] = x1.v[j] * c.v[j] - x2.v[j] * s.v[j];
        hi.v[j] = x1.v[j] * s.v[j] + x2.v[j] * c.v[j];
    }
    store_pack(dst + i, lo);
    store_pack(dst + i + half, hi);
}

#include "attention.cuh"
#include "attention_tc.cuh"
#include "logit_rows.cuh"
#include "rows.cuh"
#include "gemv_quant.cuh"
#include "gemv_wgmma.cuh"

// The attention kernels' parameters (cuda.rs passes them in this order to all three).
#define PA_PARAMS(T)                                                                            \
    const T *q, const T *k_pool, const T *v_pool, T *out, const unsigned int *meta,             \
        const int n_tok, const int n_seq, const int lmax, const int nh, const int nkv,          \
        const int d, const float scale
#define PA_ARGS q, k_pool, v_pool, out, meta, n_tok, n_seq, lmax, nh, nkv, d, scale

#define KESTREL_OPS(T, SUFFIX)                                                                  \
    extern "C" __global__ void kestrel_paged_attention_##SUFFIX(PA_PARAMS(T)) {                 \
        pdl_enter();                                                                            \
        paged_attention<T, PA_K_BATCH, PA_V_BATCH>(PA_ARGS);                                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(PA_VWARPS * WARP, PA_MANY_MIN_BLOCKS)          \
        kestrel_paged_attention_many_##SUFFIX(PA_PARAMS(T)) {                                   \
        pdl_enter();                                                                            \
        paged_attention<T, PA_MANY_BATCH, PA_MANY_BATCH>(PA_ARGS);                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(PA_VWARPS * WARP, PA_GROUPS_MIN_BLOCKS)        \
        kestrel_paged_attention_groups_##SUFFIX(PA_PARAMS(T)) {                                 \
        pdl_enter();                                                                            \
        paged_attention_groups<T>(PA_ARGS);                                                     \
    }                                                                                           \
    extern "C" __global__ void kestrel_kv_append_##SUFFIX(T *pool, const T *rows,               \
                                                          const unsigned int *slots,            \
                                                          const int width) {                    \
        pdl_enter();                                                                \
        kv_append<T>(pool, rows, slots, width);                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(1024) kestrel_add_rmsnorm_##SUFFIX(            \
        const T *x, const T *res, const T *w, T *out, const int n_rows, const int h,            \
        const float eps, const int vec) {                                                       \
        pdl_enter();                                                                \
        add_rmsnorm<T>(x, res, w, out, n_rows, h, eps, vec);                                    \
    }                                                                                           \
    extern "C" __global__ void kestrel_add_rmsnorm_rows_##SUFFIX(                               \
        const T *x, const T *res, const T *w, T *out, T *laid, const int n_rows, const int h,   \
        const float eps) {                                                                      \
        pdl_enter();                                                                \
        add_rmsnorm_rows<T>(x, res, w, out, laid, n_rows, h, eps);                              \
    }                                                                                           \
    extern "C" __global__ void kestrel_qkv_rope_##SUFFIX(                                       \
        const T *qkv, const T *cos, const T *sin, const unsigned int *slots, T *q_out,          \
        T *k_pool, T *v_pool, const int nh, const int nkv, const int d, const int vec) {        \
        pdl_enter();                                                                            \
        if (vec)                                                                                \
            qkv_rope<T, 16 / sizeof(T)>(qkv, cos, sin, slots, q_out, k_pool, v_pool, nh, nkv, d); \
        else                                                                                    \
            qkv_rope<T, 1>(qkv, cos, sin, slots, q_out, k_pool, v_pool, nh, nkv, d);            \
    }                                                                                           \
    extern "C" __global__ void kestrel_kv_move_##SUFFIX(const unsigned int *table, T *scratch,   \
                                                        const int n_pools, const int m,         \
                                                        const int width) {                      \
        pdl_enter();                                                                \
        kv_move<T>(table, scratch, n_pools, m, width);                                          \
    }                                                                                           \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_##SUFFIX(                               \
        const T *x, const T *w, T *y, const int M, const int N, const int K, const int split) {  \
        gemv<T, MMA_PASS_TILES>(x, w, y, M, N, K, split);                                       \
    }                                                                                           \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_one_tile_##SUFFIX(                      \
        const T *x, const T *w, T *y, const int M, const int N, const int K, const int split) {  \
        gemv<T, 1>(x, w, y, M, N, K, split);                                                    \
    }                                                                                           \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_row_mma_##SUFFIX(                      \
        const T *x, const T *w, T *y, const int, const int N, const int K, const int) {          \
        gemv_row_mma<T, MMA_DEPTH_PLAIN>(x, w, y, N, K);                                        \
    }                                                                                           \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_row_mma_deep_##SUFFIX(                 \
        const T *x, const T *w, T *y, const int, const int N, const int K, const int) {          \
        gemv_row_mma<T, MMA_DEPTH_DEEP_ROW>(x, w, y, N, K);                                     \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP, 2) kestrel_gemv_tiled_##SUFFIX( \
        const T *x, const T *w, T *y, float *parts, const int M, const int N, const int K,      \
        const int groups) {                                                                     \
        pdl_enter();                                                                \
        gemv_tiled<T>(x, w, y, parts, M, N, K, groups);                                         \
    }                                                                                           \
    extern "C" __global__ void kestrel_gemv_tiled_sum_##SUFFIX(const float *parts, T *y,        \
                                                               const size_t mn) {               \
        pdl_enter();                                                                \
        gemv_tiled_sum<T>(parts, y, mn);                                                        \
    }                                                                                           \
    extern "C" __global__ void GEMV_FUSED_BOUNDS kestrel_gemv_swiglu_##SUFFIX(                        \
        const T *gu, const T *w, T *y, const int M, const int N, const int K, const int split) { \
        gemv_swiglu<T>(gu, w, y, M, N, K, split);                                               \
    }                                                                                           \
    extern "C" __global__ void GEMV_FUSED_BOUNDS kestrel_gemv_add_rmsnorm_##SUFFIX(                   \
        const T *x, const T *res, const T *nw, const T *w, T *y, T *sum_out, const int M,       \
        const int N, const int K, const float eps, const int split) {                           \
        gemv_add_rmsnorm<T>(x, res, nw, w, y, sum_out, M, N, K, eps, split);                    \
    }                                                                                           \
    extern "C" __global__ void kestrel_swiglu_##SUFFIX(const T *gu, T *out, T *laid,             \
                                                       const size_t total, const int inter,     \
                                                       const int vec) {                         \
        pdl_enter();                                                                            \
        if (vec)                                                                                \
            swiglu<T, 16 / sizeof(T)>(gu, out, laid, total, inter);                             \
        else                                                                                    \
            swiglu<T, 1>(gu, out, laid, total, inter);                                          \
    }

// kestrel_add_rmsnorm's rows in column blocks (16-bit T), one block of NORM_COL_THREADS a row.
#define KESTREL_HALF_OPS(T, SUFFIX)                                                             \
    extern "C" __global__ void __launch_bounds__(NORM_COL_THREADS) kestrel_add_rmsnorm_cols_##SUFFIX( \
        const T *x, const T *res, const T *w, T *out, const int n_rows, const int h,            \
        const float eps) {                                                                      \
        pdl_enter();                                                                            \
        const size_t row = blockIdx.x;                                                          \
        add_rmsnorm_column_blocks<T>(x + row * h, res + row * h, w, out + row * h,              \
                                     out + (n_rows + row) * h, h, eps);                         \
    }

// The gemv entry points of steps of several rows with the weights read evict-first
// (GemvMma's EVICT); only the tensor-core engines, so 16-bit T only.
#define KESTREL_EVICT_OPS(T, SUFFIX)                                                            \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_evict_##SUFFIX(                         \
        const T *x, const T *w, T *y, const int M, const int N, const int K, const int split) {  \
        gemv<T, MMA_PASS_TILES, true>(x, w, y, M, N, K, split);                                 \
    }                                                                                           \
    extern "C" __global__ void GEMV_BOUNDS kestrel_gemv_one_tile_evict_##SUFFIX(                \
        const T *x, const T *w, T *y, const int M, const int N, const int K, const int split) {  \
        gemv<T, 1, true>(x, w, y, M, N, K, split);                                              \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP, 2)                          \
        kestrel_gemv_tiled_evict_##SUFFIX(const T *x, const T *w, T *y, float *parts,           \
                                          const int M, const int N, const int K,                \
                                          const int groups) {                                   \
        pdl_enter();                                                                            \
        gemv_tiled<T, true>(x, w, y, parts, M, N, K, groups);                                   \
    }                                                                                           \
    extern "C" __global__ void GEMV_FUSED_BOUNDS kestrel_gemv_swiglu_evict_##SUFFIX(            \
        const T *gu, const T *w, T *y, const int M, const int N, const int K, const int split) { \
        gemv_swiglu<T, true>(gu, w, y, M, N, K, split);                                         \
    }                                                                                           \
    extern "C" __global__ void GEMV_FUSED_BOUNDS kestrel_gemv_add_rmsnorm_evict_##SUFFIX(       \
        const T *x, const T *res, const T *nw, const T *w, T *y, T *sum_out, const int M,       \
        const int N, const int K, const float eps, const int split) {                           \
        gemv_add_rmsnorm<T, true>(x, res, nw, w, y, sum_out, M, N, K, eps, split);              \
    }

// The tensor-core attention (attention_tc.cuh) for heads of D, blocks of W warps, S splits
// (cuda.rs picks one by name: kestrel_paged_attention_tc_d{D}_w{W}_s{S}_{dtype}). Every step
// takes TC_SPLITS: a row's bits depend on the split count, so one count serves them all.
#define KESTREL_TC_ATTENTION(T, SUFFIX, D, W, S)                                                \
    extern "C" __global__ void __launch_bounds__(W * WARP)                                      \
        kestrel_paged_attention_tc_d##D##_w##W##_s##S##_##SUFFIX(                               \
            const T *q, const T *k_pool, const T *v_pool, T *out, float *part,                  \
            const unsigned int *meta, const int n_tok, const int n_seq, const int lmax,         \
            const int nh, const int nkv, const float scale) {                                   \
        pdl_enter();                                                                            \
        tc_attention<T, D, W, S>(q, k_pool, v_pool, out, part, meta, n_tok, n_seq, lmax, nh,    \
                                 nkv, scale);                                                   \
    }
// The same with the splits' fold in a cluster (compute capability 9.0 and up; blocks of 4
// warps only, cuda.rs says why): kestrel_paged_attention_tc_cluster_d{D}_w{W}_{dtype}
// (declared in a host pass too, for the probes' launches).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define KESTREL_TC_CLUSTER(T, SUFFIX, D, W)                                                     \
    extern "C" __global__ void __launch_bounds__(W * WARP) __cluster_dims__(1, TC_SPLITS, 1)   \
        kestrel_paged_attention_tc_cluster_d##D##_w##W##_##SUFFIX(                              \
            const T *q, const T *k_pool, const T *v_pool, T *out, float *part,                  \
            const unsigned int *meta, const int n_tok, const int n_seq, const int lmax,         \
            const int nh, const int nkv, const float scale) {                                   \
        pdl_enter();                                                                            \
        tc_attention<T, D, W, TC_SPLITS, true>(q, k_pool, v_pool, out, part, meta, n_tok,       \
                                               n_seq, lmax, nh, nkv, scale);                    \
    }
#else
#define KESTREL_TC_CLUSTER(T, SUFFIX, D, W)
#endif
#define KESTREL_TC_HEAD(T, SUFFIX, D)                                                           \
    KESTREL_TC_ATTENTION(T, SUFFIX, D, 1, 4)                                                    \
    KESTREL_TC_ATTENTION(T, SUFFIX, D, 4, 4)                                                    \
    KESTREL_TC_CLUSTER(T, SUFFIX, D, 4)                                                         \
    extern "C" __global__ void kestrel_paged_attention_tc_merge_d##D##_##SUFFIX(                \
        const float *part, T *out, const int n_tok, const int nh) {                             \
        pdl_enter();                                                                            \
        tc_merge<T, D, TC_SPLITS>(part, out, n_tok, nh);                                        \
    }
#define KESTREL_TC_OPS(T, SUFFIX)                                                               \
    KESTREL_TC_HEAD(T, SUFFIX, 64)                                                              \
    KESTREL_TC_HEAD(T, SUFFIX, 128)

KESTREL_OPS(float, f32)
KESTREL_OPS(__half, f16)
KESTREL_OPS(__nv_bfloat16, bf16)
KESTREL_EVICT_OPS(__half, f16)
KESTREL_EVICT_OPS(__nv_bfloat16, bf16)
KESTREL_HALF_OPS(__half, f16)
KESTREL_HALF_OPS(__nv_bfloat16, bf16)
KESTREL_TC_OPS(__half, f16)
KESTREL_TC_OPS(__nv_bfloat16, bf16)

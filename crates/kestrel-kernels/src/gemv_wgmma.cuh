// ---------------------------------------------------------------------------------------
// The warpgroup engine for steps of many rows (kestrel_gemv_wgmma_s{1,4,8}_*): Hopper's
// wgmma.mma_async in place of the tiled engine's mma.sync, for f16/bf16 on compute capability
// 9.0 only (the instruction needs the arch-specific compute_90a PTX, which launch.rs loads
// there; this file compiles to nothing elsewhere). Every row still gets the bits GemvMma gives
// it alone. On an H100, 64 rows of a Llama-2-7B layer take 188 µs (both launches) against a
// 139 µs read of its weights, and the 64-row verification 1.75 one-token steps instead of the
// tiled engine's 1.92 (tools/gpu/frag_probe.cu, builds 6-9; docs/gpu-results.md, session 46).
//
// Why the bits survive: wgmma.m64nNk16 with A from registers takes, per warp, exactly
// mma.sync.m16n8k16's A fragment, and computes each output as mma.sync does
// (tools/gpu/wgmma_bits_probe.cu). So a warp feeds it the registers GemvMma feeds its MMAs
// (a lane's 32 bytes at 16t of weight rows g and g + 8, MMA j taking words 2j and 2j + 1),
// with the step's rows in the same k slots as B, and walks the chains as kestrel_gemv_tiled
// does: K's 64-k blocks p, p + 8, … from zero for chain p, each chain's sum added into the
// output's total in chain order.
//
// A block is one warpgroup: 64 weight rows (a warp's strip of 16 each) × 64 step rows. Each
// 64-k block of both is staged with cp.async WG_STAGES − 1 ahead: the weight rows padded to
// 144 bytes (conflict-free fragment reads), the step's rows in wgmma's core-matrix layout
// [MMA j][k half c][row][8 slots] with GemvMma's slot order. That order moves pairs of
// values, so kestrel_gemv_wgmma_rows_* lays the rows out so once a launch (8 KiB a block of K
// and 64 rows, rows past M zeros) and every block copies them 16 bytes at a time: copying
// pairs 4 bytes at a time from the rows as stored made the engine 1.2-1.5× slower. Weights
// are read evict-first where the tiled engine's are (`_evict`, cuda.rs `evict_weights`).
// With few 64-row groups (o_proj, down_proj of a 7B; SmolLM2) the chains are split between the SPLIT blocks of a cluster: block 0 keeps the
// running total of its chains, each other block its chains' own sums, and after the loop each
// block adds a slice of the outputs from the cluster's shared memory, in chain order — the
// same additions again. Grid: (64-row weight groups, SPLIT, 64-row tiles of the step).
// ---------------------------------------------------------------------------------------
// (The host pass of a whole-program nvcc build, such as a probe's for sm_90a, sees it too.)
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
#include <cooperative_groups.h>

// Stages a block, and blocks a multiprocessor: 3 × 68 KiB of stages, at most 168 registers a
// thread. A probe build may set others (tools/gpu/wg_traffic_probe.cu): 3 stages × 4 blocks
// took 2% less in the probe but made Llama-2-7B's 64-row step 4% slower; 6 or 8 stages were
// slower in the probe too (docs/gpu-results.md, session 59).
#ifndef WG_STAGES
#define WG_STAGES 4
#endif
#define WG_THREADS 128
#ifndef WG_MIN_BLOCKS
#define WG_MIN_BLOCKS 3
#endif
// A stage: the step's rows (64 × 64 values) then 4 warps' weight strips (16 rows × 72).
#define WG_X_ELEMS (64 * MMA_KB)
#define WG_W_LD (MMA_KB + 8)
#define WG_STAGE_ELEMS (WG_X_ELEMS + 4 * 16 * WG_W_LD)
// PROBE flags (tools/gpu/wg_traffic_probe.cu only; timings, outputs wrong).
#define WG_PROBE_NO_X 1
#define WG_PROBE_NO_MMA 2
// The TMA mode's shared memory: its stages, 1,024 bytes of alignment slack, the mbarriers.
#define WG_TMA_SMEM_BYTES (WG_STAGES * 2 * WG_X_ELEMS * 2 + 1024 + WG_STAGES * 8)

#define WG_ACC32(d)                                                                                \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),     \
        "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),   \
        "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),   \
        "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_D32                                                                                     \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25," \
    "%26,%27,%28,%29,%30,%31}"

// d += A · B: A (64 × 16, each warp's 16 rows) in registers, B (16 × 64) in shared memory.
template <typename T> __device__ __forceinline__ void wgmma_rs(float *d, const unsigned *a, const uint64_t b);
#define WGMMA_RS(T, PTX_TYPE)                                                                         \
    template <> __device__ __forceinline__ void wgmma_rs<T>(float *d, const unsigned *a, const uint64_t b) { \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"                                        \
                     "wgmma.mma_async.sync.aligned.m64n64k16.f32." PTX_TYPE "." PTX_TYPE " " WG_D32         \
                     ", {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"                                       \
                     : WG_ACC32(d)                                                                    \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));                           \
    }
WGMMA_RS(__nv_bfloat16, "bf16")
WGMMA_RS(__half, "f16")

// B of MMA j in a stage: no swizzle, leading (k half) byte offset 1,024, stride (next 8 rows) 128.
__device__ __forceinline__ uint64_t wg_b_desc(const void *smem) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    return (uint64_t)((addr >> 4) & 0x3fff) | ((uint64_t)(1024 >> 4) << 16) | ((uint64_t)(128 >> 4) << 32);
}

// The Tensor Memory Accelerator's side of the engine's TMA mode (instantiated by
// tools/gpu/wg_traffic_probe.cu only, to measure it against the cp.async walk): a stage is
// 8 KiB of the step's rows (one bulk copy of their laid-out block) then the 64 × 64 weight box
// (one tensor copy, 128-byte swizzle), both completing on the stage's mbarrier.
__device__ __forceinline__ unsigned wg_smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }

// Thread 0's arrival on `bar`, expecting `bytes` of copies to complete on it.
__device__ __forceinline__ void wg_expect(uint64_t *bar, const unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(wg_smem(bar)), "r"(bytes) : "memory");
}

// Until `bar`'s phase of parity `parity` completes.
__device__ __forceinline__ void wg_wait(const uint64_t *bar, const unsigned parity) {
    asm volatile("{\n.reg .pred p;\nWG_WAIT%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WG_WAIT%=;\n}\n" ::"r"(wg_smem(bar)),
                 "r"(parity)
                 : "memory");
}

// `bytes` contiguous bytes from global `src` into `dst`, completing on `bar`.
__device__ __forceinline__ void wg_bulk_copy(void *dst, const void *src, const unsigned bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                     wg_smem(dst)),
                 "l"(src), "r"(bytes), "r"(wg_smem(bar))
                 : "memory");
}

// The box of tensor map `map` (a __grid_constant__ CUtensorMap's address) at (k0, n0) into
// `dst`, completing on `bar`; HINTED: under the L2 policy `policy` (evict_first_policy).
template <bool HINTED>
__device__ __forceinline__ void wg_load_box(void *dst, const void *map, const int k0, const int n0, uint64_t *bar,
                                            const unsigned long long policy) {
    if constexpr (HINTED)
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
                     " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(wg_smem(dst)),
                     "l"(reinterpret_cast<unsigned long long>(map)), "r"(k0), "r"(n0), "r"(wg_smem(bar)), "l"(policy)
                     : "memory");
    else
        asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
                     " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(wg_smem(dst)),
                     "l"(reinterpret_cast<unsigned long long>(map)), "r"(k0), "r"(n0), "r"(wg_smem(bar))
                     : "memory");
}

// x [M, K] → the warpgroup engine's rows (wg_rows_offset in kernels.cu), zeros past row M.
// Grid (K / 64, tiles), 512 threads, each one 16-byte piece: slots 0-7 of (j, c) for row n
// (a warp reads 4 rows' 128 bytes).
template <typename T> __device__ __forceinline__ void gemv_wgmma_rows(const T *__restrict__ x, T *__restrict__ xp, const int M, const int K) {
    const int kb = blockIdx.x, z = blockIdx.y, jc = threadIdx.x % 8, n = threadIdx.x / 8;
    const int j = jc / 2, c = jc % 2, m = 64 * z + n;
    const unsigned *src = reinterpret_cast<const unsigned *>(x + (size_t)min(m, M - 1) * K + kb * MMA_KB + 4 * j + 2 * c);
    uint4 v = make_uint4(0, 0, 0, 0);
    if (m < M) v = make_uint4(src[0], src[8], src[16], src[24]);
    *reinterpret_cast<uint4 *>(xp + wg_rows_offset(m, kb * MMA_KB + 4 * j + 2 * c, K)) = v;
}

// Element e (0…31) of a lane's m64n64 accumulator: step row 8(e / 4) + 2t + e % 2 of the tile,
// weight row g + 8((e / 2) % 2) of the warp's strip.
__device__ __forceinline__ int wg_acc_row(const int lane, const int e) { return 8 * (e / 4) + 2 * (lane & 3) + e % 2; }
__device__ __forceinline__ int wg_acc_col(const int lane, const int e) { return (lane >> 2) + 8 * ((e / 2) % 2); }

// X_AS_STORED (instantiated by tools/gpu/frag_probe.cu only, to measure it against the launch
// of kestrel_gemv_wgmma_rows): x is the rows as stored, [M, K]; each thread loads 4 pieces of
// 16 bytes of a block into registers an iteration before they are due, then writes their pairs
// into the stage in the engine's order. PROBE: WG_PROBE_NO_X never copies the rows, so only
// the weights travel; WG_PROBE_NO_MMA stages everything and multiplies nothing. TMA: the
// stages filled by the TMA from `wmap` (w's map in 64 × 64 boxes, 128-byte swizzle) and the
// rows' bulk copies, thread 0 issuing, the block waiting on each stage's mbarrier; the same
// MMAs on the same fragments, so the same bits (WG_TMA_SMEM_BYTES of shared memory).
template <typename T, int SPLIT, bool EVICT, bool X_AS_STORED = false, int PROBE = 0, bool TMA = false>
__device__ __forceinline__ void gemv_wgmma(const T *__restrict__ x, const T *__restrict__ w, T *__restrict__ y,
                                           const int M, const int N, const int K, const void *wmap = nullptr) {
    static_assert(!(TMA && X_AS_STORED), "the TMA copies the rows as laid out");
    constexpr int CH = TILED_CHAINS / SPLIT; // chains a block
    // A stage: the rows' block, then the weights' (padded rows, or TMA's swizzled box).
    constexpr int STAGE_ELEMS = TMA ? 2 * WG_X_ELEMS : WG_STAGE_ELEMS;
    T *stage = reinterpret_cast<T *>(gemv_stage);
    uint64_t *full = nullptr; // TMA: a stage's mbarrier
    if constexpr (TMA) {
        // The swizzled boxes need 1,024-byte alignment.
        stage = reinterpret_cast<T *>((reinterpret_cast<uintptr_t>(gemv_stage) + 1023) & ~(uintptr_t)1023);
        full = reinterpret_cast<uint64_t *>(stage + WG_STAGES * STAGE_ELEMS);
        if (threadIdx.x == 0) {
            for (int st = 0; st < WG_STAGES; ++st)
                asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(wg_smem(&full[st])));
            asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
        }
        __syncthreads();
    }
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, g = lane >> 2, t = lane & 3;
    const int nkb = K / MMA_KB, rank = SPLIT == 1 ? 0 : blockIdx.y, c0 = rank * CH;
    const int n0 = blockIdx.x * 64 + 16 * warp, m0 = blockIdx.z * 64;
    // The step's rows, as kestrel_gemv_wgmma_rows laid them out: 4 pieces of 16 bytes a thread.
    const T *x_tile = x + (size_t)blockIdx.z * nkb * WG_X_ELEMS + 8 * threadIdx.x;
    // The warp's 16 weight rows, 8 pieces of 16 bytes each, 4 a lane (rows lane / 8 + 4q);
    // rows past N copy row N − 1, and their outputs are never stored. (TMA: the map has them.)
    const T *w_row[4] = {};
#pragma unroll
    for (int q = 0; q < 4 && !TMA; ++q) w_row[q] = w + (size_t)min(n0 + lane / 8 + 4 * q, N - 1) * K + 8 * (lane % 8);
    unsigned long long policy = 0;
    if constexpr (EVICT) policy = evict_first_policy();
    // X_AS_STORED: piece qq of a thread is row xn + 16qq's 16 bytes at 8xq of a block; the
    // registers hold block xr_kb's.
    const int xn = threadIdx.x / 8, xq = threadIdx.x % 8;
    uint4 xr[4];
    int xr_kb = -1;
    auto x_to_registers = [&](const int kb) {
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            const int m = m0 + xn + 16 * qq;
            xr[qq] = m < M ? *reinterpret_cast<const uint4 *>(x + (size_t)m * K + kb * MMA_KB + 8 * xq)
                           : make_uint4(0, 0, 0, 0);
        }
        xr_kb = kb;
    };
    // Pair u of piece qq (k 8xq + 2u) is slot pair 2(xq / 2) of MMA j = 2(xq % 2) + u / 2, half u % 2.
    auto registers_to_stage = [&](T *s) {
#pragma unroll
        for (int qq = 0; qq < 4; ++qq) {
            const unsigned words[4] = {xr[qq].x, xr[qq].y, xr[qq].z, xr[qq].w};
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int j = 2 * (xq % 2) + u / 2, c = u % 2;
                *reinterpret_cast<unsigned *>(s + ((j * 2 + c) * 64 + xn + 16 * qq) * 8 + 2 * (xq / 2)) = words[u];
            }
        }
    };

    // The loader's walk over the block's 64-k blocks, chain by chain (empty chains skipped).
    int load_c = c0, load_kb = c0, staged = 0;
    auto skip_empty = [&]() {
        while (load_c < c0 + CH && load_kb >= nkb) load_kb = ++load_c;
    };
    skip_empty();
    auto load = [&]() {
        if (load_c < c0 + CH) {
            T *s = stage + (staged % WG_STAGES) * STAGE_ELEMS;
            const int k0 = load_kb * MMA_KB;
            if constexpr (TMA) {
                if (threadIdx.x == 0) {
                    uint64_t *bar = &full[staged % WG_STAGES];
                    constexpr bool no_x = (PROBE & WG_PROBE_NO_X) != 0;
                    wg_expect(bar, (no_x ? 1 : 2) * WG_X_ELEMS * (unsigned)sizeof(T));
                    if (!no_x)
                        wg_bulk_copy(s, x + ((size_t)blockIdx.z * nkb + load_kb) * WG_X_ELEMS,
                                     WG_X_ELEMS * sizeof(T), bar);
                    wg_load_box<EVICT>(s + WG_X_ELEMS, wmap, k0, blockIdx.x * 64, bar, policy);
                }
            } else if constexpr ((PROBE & WG_PROBE_NO_X) != 0) {
            } else if constexpr (X_AS_STORED) {
                if (xr_kb != load_kb) x_to_registers(load_kb); // the first stages
                registers_to_stage(s);
            } else {
#pragma unroll
                for (int q = 0; q < WG_X_ELEMS / 8 / WG_THREADS; ++q)
                    cp_async16(s + 8 * (threadIdx.x + q * WG_THREADS),
                               x_tile + (size_t)load_kb * WG_X_ELEMS + 8 * q * WG_THREADS);
            }
            T *ws = s + WG_X_ELEMS + warp * 16 * WG_W_LD + (lane / 8) * WG_W_LD + 8 * (lane % 8);
#pragma unroll
            for (int q = 0; q < 4 && !TMA; ++q) {
                if constexpr (EVICT)
                    cp_async16_hinted(ws + 4 * q * WG_W_LD, w_row[q] + k0, policy);
                else
                    cp_async16(ws + 4 * q * WG_W_LD, w_row[q] + k0);
            }
            load_kb += TILED_CHAINS;
            skip_empty();
            if (X_AS_STORED && load_c < c0 + CH) x_to_registers(load_kb); // due next iteration
        }
        ++staged;
        if constexpr (!TMA) asm volatile("cp.async.commit_group;\n" ::);
    };
    for (int s = 0; s < WG_STAGES - 1; ++s) load();

    // keep[0]: rank 0's running total. Another rank's earlier chains' sums, keep[ci] (its last
    // stays in acc).
    constexpr int KEEP = SPLIT > 1 && CH > 1 ? CH - 1 : 1;
    float acc[32], keep[KEEP][32];
#pragma unroll
    for (int e = 0; e < 32; ++e) acc[e] = keep[0][e] = 0.f;
    int i = 0;
#pragma unroll 1
    for (int ci = 0; ci < CH; ++ci) {
#pragma unroll 1
        for (int kb = c0 + ci; kb < nkb; kb += TILED_CHAINS, ++i) {
            if constexpr (TMA)
                wg_wait(&full[i % WG_STAGES], (i / WG_STAGES) & 1);
            else
                asm volatile("cp.async.wait_group %0;\n" ::"n"(WG_STAGES - 2));
            asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
            __syncthreads(); // block i is in; every warp's MMAs on block i − 1 are done
            load();
            const T *s = stage + (i % WG_STAGES) * STAGE_ELEMS;
            uint4 v[4];
            if constexpr (TMA) {
                // Row r's 16-byte piece c of the box sits at piece c ^ (r % 8) of its 128 bytes.
                const T *box = s + WG_X_ELEMS;
                const int r0 = 16 * warp + g, r1 = r0 + 8;
                v[0] = *reinterpret_cast<const uint4 *>(box + r0 * MMA_KB + 8 * ((2 * t) ^ (r0 % 8)));
                v[1] = *reinterpret_cast<const uint4 *>(box + r0 * MMA_KB + 8 * ((2 * t + 1) ^ (r0 % 8)));
                v[2] = *reinterpret_cast<const uint4 *>(box + r1 * MMA_KB + 8 * ((2 * t) ^ (r1 % 8)));
                v[3] = *reinterpret_cast<const uint4 *>(box + r1 * MMA_KB + 8 * ((2 * t + 1) ^ (r1 % 8)));
            } else {
                const T *ws = s + WG_X_ELEMS + warp * 16 * WG_W_LD + 16 * t;
                v[0] = *reinterpret_cast<const uint4 *>(ws + g * WG_W_LD);
                v[1] = *reinterpret_cast<const uint4 *>(ws + g * WG_W_LD + 8);
                v[2] = *reinterpret_cast<const uint4 *>(ws + (g + 8) * WG_W_LD);
                v[3] = *reinterpret_cast<const uint4 *>(ws + (g + 8) * WG_W_LD + 8);
            }
            const unsigned *wl = reinterpret_cast<const unsigned *>(&v[0]);
            const unsigned *wh = reinterpret_cast<const unsigned *>(&v[2]);
            if constexpr ((PROBE & WG_PROBE_NO_MMA) != 0) continue;
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const unsigned a[4] = {wl[2 * j], wh[2 * j], wl[2 * j + 1], wh[2 * j + 1]};
                wgmma_rs<T>(acc, a, wg_b_desc(s + j * 2 * 64 * 8));
            }
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
            asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        }
        // Chain c0 + ci is done (an empty one, past K's blocks, gives zeros as GemvMma's
        // idle warps do).
        if (rank == 0) {
#pragma unroll
            for (int e = 0; e < 32; ++e) {
                keep[0][e] += acc[e];
                acc[e] = 0.f;
            }
        } else if (ci + 1 < CH) {
#pragma unroll
            for (int u = 0; u < KEEP; ++u)
                if (u == ci)
#pragma unroll
                    for (int e = 0; e < 32; ++e) {
                        keep[u][e] = acc[e];
                        acc[e] = 0.f;
                    }
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::);
    if constexpr (SPLIT == 1) {
#pragma unroll
        for (int e = 0; e < 32; ++e) {
            const int m = m0 + wg_acc_row(lane, e), n = n0 + wg_acc_col(lane, e);
            if (m < M && n < N) y[(size_t)m * N + n] = from_f<T>(keep[0][e]);
        }
    } else {
        // Each block's sums in its shared memory (the stages are free: every MMA has waited):
        // item u of a block at [u][e][thread]; rank 0 has one (its total), the others CH.
        __syncthreads();
        float *items = reinterpret_cast<float *>(gemv_stage);
#pragma unroll
        for (int e = 0; e < 32; ++e) {
            if (rank == 0) {
                items[e * WG_THREADS + threadIdx.x] = keep[0][e];
            } else {
#pragma unroll
                for (int u = 0; u + 1 < CH; ++u) items[(u * 32 + e) * WG_THREADS + threadIdx.x] = keep[u][e];
                items[((CH - 1) * 32 + e) * WG_THREADS + threadIdx.x] = acc[e];
            }
        }
        cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
        cluster.sync();
        // Rank r adds outputs [r, r + 1) · 4096 / SPLIT of the block's 128 × 32 (thread, e).
        constexpr int OUTS = WG_THREADS * 32, SLICE = OUTS / SPLIT;
        for (int o = rank * SLICE + threadIdx.x; o < (rank + 1) * SLICE; o += WG_THREADS) {
            float sum = cluster.map_shared_rank(items, 0)[o];
#pragma unroll
            for (int r = 1; r < SPLIT; ++r) {
                const float *theirs = cluster.map_shared_rank(items, r);
#pragma unroll
                for (int u = 0; u < CH; ++u) sum += theirs[u * OUTS + o];
            }
            const int tid = o % WG_THREADS, e = o / WG_THREADS, tw = tid / WARP, tl = tid % WARP;
            const int m = m0 + wg_acc_row(tl, e), n = blockIdx.x * 64 + 16 * tw + wg_acc_col(tl, e);
            if (m < M && n < N) y[(size_t)m * N + n] = from_f<T>(sum);
        }
        cluster.sync(); // no block leaves while another reads its sums
    }
}

// The engine with SPLIT blocks a cluster, EVICT (`_evict`) reading weights evict-first from L2.
#define WGMMA_KERNEL(T, SUFFIX, SPLIT, EVICT, NAME)                                                   \
    extern "C" __global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS) \
        NAME##_##SUFFIX(const T *xp, const T *w, T *y, const int M, const int N, const int K) {       \
        pdl_enter();                                                                                  \
        gemv_wgmma<T, SPLIT, EVICT>(xp, w, y, M, N, K);                                               \
    }
#define WGMMA_KERNELS(T, SUFFIX)                                                                     \
    extern "C" __global__ void __launch_bounds__(512) kestrel_gemv_wgmma_rows_##SUFFIX(                \
        const T *x, T *xp, const int M, const int K) {                                               \
        pdl_enter();                                                                                  \
        gemv_wgmma_rows<T>(x, xp, M, K);                                                              \
    }                                                                                                 \
    WGMMA_KERNEL(T, SUFFIX, 1, false, kestrel_gemv_wgmma_s1)                                          \
    WGMMA_KERNEL(T, SUFFIX, 4, false, kestrel_gemv_wgmma_s4)                                          \
    WGMMA_KERNEL(T, SUFFIX, 8, false, kestrel_gemv_wgmma_s8)                                          \
    WGMMA_KERNEL(T, SUFFIX, 1, true, kestrel_gemv_wgmma_s1_evict)                                     \
    WGMMA_KERNEL(T, SUFFIX, 4, true, kestrel_gemv_wgmma_s4_evict)                                     \
    WGMMA_KERNEL(T, SUFFIX, 8, true, kestrel_gemv_wgmma_s8_evict)

WGMMA_KERNELS(__nv_bfloat16, bf16)
WGMMA_KERNELS(__half, f16)

#endif // __CUDA_ARCH_FEAT_SM90_ALL

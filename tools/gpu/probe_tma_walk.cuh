// The warpgroup engine with its stages filled by the Tensor Memory Accelerator (gemv_wgmma.cuh's
// TMA mode), and first its walk alone.
//
// The walk over its weights (gemv_wgmma.cuh: a block's 64 weight rows, 64-k
// block by 64-k block, chain by chain: blocks c, c + 8, … of chain c), its 8 KiB stages filled
// by the Tensor Memory Accelerator instead of 128 threads' cp.async: one thread issues a
// 64 × 64 box a stage (cp.async.bulk.tensor.2d, evict-first as the engine's loads), the block
// waits on the stage's mbarrier, reads it and hands the stage back to the next box (after a
// block-wide barrier, as the engine, or warp-specialised: a producer warp refilling each stage
// as the consumer warps release it). Nothing is multiplied and the rows are never copied: set
// against the engine's `noX noMMA`, it says whether the copies' way into shared memory, or the
// ring's lockstep, rather than the walk's addresses, holds the engine above a stream
// (tools/gpu/wg_traffic_probe.cu includes it).
#pragma once
#include <cuda.h>
#include <cudaTypedefs.h>
#include <map>
#include <tuple>

namespace tma_walk {

// 64-k blocks of chain c below nkb: c, c + TILED_CHAINS, …
__device__ __forceinline__ int chain_blocks(const int c, const int nkb) {
    return c < nkb ? (nkb - c + TILED_CHAINS - 1) / TILED_CHAINS : 0;
}

// The j-th 64-k block of the engine's walk over chains c0 … c0 + chains − 1, or −1 past its
// end; with j = −1, the walk's length is returned instead.
__device__ __forceinline__ int walk_block(int j, const int c0, const int chains, const int nkb) {
    int length = 0;
    for (int c = c0; c < c0 + chains; ++c) {
        const int blocks = chain_blocks(c, nkb);
        if (j >= 0 && j < blocks) return c + TILED_CHAINS * j;
        if (j >= 0) j -= blocks;
        length += blocks;
    }
    return j < 0 ? length : -1;
}

// WS (warp-specialised): a fifth warp produces, issuing box j as soon as the four consumer
// warps have each released its stage (an `empty` mbarrier a stage, one arrival a warp), so
// no block-wide barrier holds the ring in lockstep; else thread 0 reissues a stage after the
// block's barrier, as the engine does.
template <int STAGES, int SPLIT, bool WS>
__global__ void __launch_bounds__(160) walk(const __grid_constant__ CUtensorMap map, const int K, unsigned *sink) {
    // The swizzled boxes need 1,024-byte alignment (the launch gives 1,024 bytes of slack).
    unsigned char *stage =
        reinterpret_cast<unsigned char *>((reinterpret_cast<uintptr_t>(gemv_stage) + 1023) & ~(uintptr_t)1023);
    uint64_t *full = reinterpret_cast<uint64_t *>(stage + STAGES * 8192), *empty = full + STAGES;
    constexpr int CH = TILED_CHAINS / SPLIT;
    const int nkb = K / 64, c0 = blockIdx.y * CH, n0 = blockIdx.x * 64;
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(wg_smem(&full[s])));
            asm volatile("mbarrier.init.shared::cta.b64 [%0], 4;\n" ::"r"(wg_smem(&empty[s])));
        }
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    const unsigned long long policy = evict_first_policy();
    const int length = walk_block(-1, c0, CH, nkb);
    auto issue = [&](const int j) {
        const int kb = walk_block(j, c0, CH, nkb);
        if (kb >= 0) {
            wg_expect(&full[j % STAGES], 8192);
            wg_load_box<true>(stage + (j % STAGES) * 8192, &map, kb * 64, n0, &full[j % STAGES], policy);
        }
    };
    if (WS && threadIdx.x >= 128) {
        if (threadIdx.x == 128)
            for (int j = 0; j < length; ++j) {
                if (j >= STAGES) wg_wait(&empty[j % STAGES], (j / STAGES - 1) & 1);
                issue(j);
            }
        return;
    }
    if (!WS && threadIdx.x == 0)
        for (int j = 0; j < STAGES; ++j) issue(j);
    unsigned acc = 0;
    for (int i = 0; i < length; ++i) {
        wg_wait(&full[i % STAGES], (i / STAGES) & 1);
        const uint4 *s = reinterpret_cast<const uint4 *>(stage + (i % STAGES) * 8192);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
            const uint4 v = s[threadIdx.x + 128 * q];
            acc ^= v.x ^ v.y ^ v.z ^ v.w;
        }
        if constexpr (WS) {
            __syncwarp();
            if (threadIdx.x % WARP == 0)
                asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wg_smem(&empty[i % STAGES])) : "memory");
        } else {
            __syncthreads(); // every thread is done with stage i % STAGES
            if (threadIdx.x == 0) issue(i + STAGES);
        }
    }
    if (acc == 0x12345678u) sink[0] = acc;
}

// The map of w [n, k] (bf16, row-major) in 64 × 64 boxes with the 128-byte swizzle (the
// engine's TMA mode reads its fragments through it), made once per weight and shape (a freed
// weight's address comes back with the next shape's).
inline const CUtensorMap &map_of(const bf16 *w, const int n, const int k) {
    static std::map<std::tuple<const bf16 *, int, int>, CUtensorMap> maps;
    static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
    if (!encode) {
        cudaDriverEntryPointQueryResult found;
        CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void **>(&encode), 12000,
                                            cudaEnableDefault, &found));
        if (found != cudaDriverEntryPointSuccess) {
            printf("cuTensorMapEncodeTiled not found\n");
            exit(1);
        }
    }
    const auto key = std::make_tuple(w, n, k);
    auto it = maps.find(key);
    if (it != maps.end()) return it->second;
    CUtensorMap map;
    const cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)n}, strides[1] = {(cuuint64_t)k * 2};
    const cuuint32_t box[2] = {64, 64}, element_strides[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<bf16 *>(w), dims, strides, box,
                              element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled: %d\n", (int)r);
        exit(1);
    }
    return maps.emplace(key, map).first->second;
}

// A Config launch (wg_traffic_probe.cu's signature): the walk over w's N / 64 row groups.
template <int STAGES, int SPLIT, bool WS = false> void launch(const bf16 *, const bf16 *w, bf16 *, int, int N, int K) {
    static unsigned *sink = nullptr;
    constexpr int bytes = STAGES * 8192 + 1024 + 2 * STAGES * 8;
    if (!sink) {
        CK(cudaMalloc(&sink, 4));
        CK(cudaFuncSetAttribute(walk<STAGES, SPLIT, WS>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
    }
    walk<STAGES, SPLIT, WS><<<dim3(N / 64, SPLIT), WS ? 160 : 128, bytes>>>(map_of(w, N, K), K, sink);
}

// The engine in its TMA mode (gemv_wgmma.cuh), split SPLIT, PROBE flags as the cp.async one.
template <int SPLIT, int PROBE>
__global__ void __cluster_dims__(1, SPLIT, 1) __launch_bounds__(WG_THREADS, WG_MIN_BLOCKS)
    engine(const __grid_constant__ CUtensorMap map, const bf16 *xp, bf16 *y, const int M, const int N, const int K) {
    gemv_wgmma<bf16, SPLIT, true, false, PROBE, true>(xp, nullptr, y, M, N, K, &map);
}

template <int SPLIT, int PROBE> void launch_engine(const bf16 *xp, const bf16 *w, bf16 *y, int M, int N, int K) {
    static bool sized = false;
    if (!sized) {
        CK(cudaFuncSetAttribute(engine<SPLIT, PROBE>, cudaFuncAttributeMaxDynamicSharedMemorySize, WG_TMA_SMEM_BYTES));
        sized = true;
    }
    engine<SPLIT, PROBE><<<dim3((N + 63) / 64, SPLIT, (M + 63) / 64), WG_THREADS, WG_TMA_SMEM_BYTES>>>(map_of(w, N, K),
                                                                                                  xp, y, M, N, K);
}

} // namespace tma_walk

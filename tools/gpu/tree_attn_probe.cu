// Probe: attention of 64 new tokens (a random tree, or a chain) through
// kestrel_paged_attention_groups (a block per head, sequence and 4 query rows; each warp's
// chunks of the K/V rows all 4 see staged in shared memory once for the group) against
// kestrel_paged_attention (a block per query row and head, which reads every row it sees
// itself), both from kernels.cu: every output's bits compared, at several context lengths and
// two head shapes, then both timed, each launch after the last (K/V hot in L2).
// Session 47 (H100): grouped 1.15x faster at 128 cached slots, 1.4x at 2,048, same bits; but
// in the step, where K/V come from DRAM, slower below ~1,000 slots. Session 48: K then V
// through one stage, two blocks a multiprocessor: 1.7x at 128, 2.1x at 2,048, and faster in
// the step where its blocks fill the GPU (attention_groups_step in lib.rs). Its first form, written here for d = 128 with R rows a block: 8 slower than 4.
// Reading K/V through L1 instead of staging them (session 47, for the record): 1.35x slower at
// 2,048 slots, and slower in the step too.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o tree_attn_probe tools/gpu/tree_attn_probe.cu
// (-DPA_GROUP_ROWS=2: groups of 2 rows, twice the blocks, for grids too small to fill the GPU
// with 4, such as SmolLM2's 9 heads × 16 groups of a 64-row step; not yet run.)
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include <algorithm>
#include <random>
#include <vector>

using T = __nv_bfloat16;

// attention_groups_shared_bytes in cuda.rs.
size_t groups_smem(const int d) {
    return (size_t)PA_VWARPS * WARP * (d + 8) * sizeof(T) + PA_GROUP_ROWS * d * sizeof(float);
}

int main() {
    const int n = 64; // a 64-node tree
    CK(cudaFuncSetAttribute(kestrel_paged_attention_groups_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)groups_smem(128)));
    LaunchTimer timer;
    printf("64 new tokens (a random tree, or a chain), one sequence; us a launch: a block a row and head | a block a head and 4 rows | bits\n");
    struct Shape {
        const char *name;
        int nh, nkv, D;
    };
    for (const Shape shape : {Shape{"llama2-7b", 32, 32, 128}, Shape{"smollm2-135m", 9, 3, 64}})
    for (const bool chain : {false, true})
    for (const int past : {128, 512, 2048}) {
        const int nh = shape.nh, nkv = shape.nkv, D = shape.D;
        const float scale = 1.f / sqrtf((float)D);
        const int L = past + n, pool_rows = 2 * L;
        std::mt19937 rng(past);
        // A random tree: node i's parent is an earlier node (node 0's is the cached context).
        std::vector<int> parent(n, -1);
        for (int i = 1; i < n; ++i) parent[i] = std::uniform_int_distribution<int>(0, i - 1)(rng);
        std::vector<unsigned> mask((size_t)n * n, 0);
        for (int i = 0; i < n; ++i)
            for (int j = i; j >= 0; j = parent[j]) mask[(size_t)i * n + j] = 1;
        // Slots scattered over a pool twice the sequence's size, as pages would be.
        std::vector<unsigned> pool_ids(pool_rows);
        for (int i = 0; i < pool_rows; ++i) pool_ids[i] = i;
        std::shuffle(pool_ids.begin(), pool_ids.end(), rng);
        // meta: tok_seq[n], seq_len, seq_new, q_start, mask_off, slots[L], masks[n·n].
        std::vector<unsigned> meta;
        for (int t = 0; t < n; ++t) meta.push_back(0);
        // A chain (causal, no mask) as spec-bench's verify:T steps and draft-target take.
        meta.insert(meta.end(), {(unsigned)L, (unsigned)n, 0u, chain ? 0xffffffffu : 0u});
        meta.insert(meta.end(), pool_ids.begin(), pool_ids.begin() + L);
        if (!chain) meta.insert(meta.end(), mask.begin(), mask.end());
        unsigned *dmeta;
        CK(cudaMalloc(&dmeta, meta.size() * 4));
        CK(cudaMemcpy(dmeta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
        T *q = random_bf16((size_t)n * nh * D, 1), *kp = random_bf16((size_t)pool_rows * nkv * D, 2),
          *vp = random_bf16((size_t)pool_rows * nkv * D, 3), *o0, *o1;
        CK(cudaMalloc(&o0, (size_t)n * nh * D * 2));
        CK(cudaMalloc(&o1, (size_t)n * nh * D * 2));
        auto rows = [&](int) {
            kestrel_paged_attention_bf16<<<dim3(n, nh), PA_VWARPS * WARP>>>(q, kp, vp, o0, dmeta, n, 1, L, nh, nkv, D,
                                                                            scale);
        };
        auto groups = [&](int) {
            kestrel_paged_attention_groups_bf16<<<dim3(nh, 1, (n + PA_GROUP_ROWS - 1) / PA_GROUP_ROWS),
                                                  PA_VWARPS * WARP, groups_smem(D)>>>(q, kp, vp, o1, dmeta, n, 1, L,
                                                                                      nh, nkv, D, scale);
        };
        std::vector<T> a((size_t)n * nh * D), b(a.size());
        rows(0);
        CK(cudaDeviceSynchronize());
        CK(cudaMemcpy(a.data(), o0, a.size() * 2, cudaMemcpyDeviceToHost));
        // Outputs of the shipped kernel's that differ from a launch's.
        auto differing = [&](auto launch) {
            CK(cudaMemset(o1, 0xff, b.size() * 2));
            launch(0);
            CK(cudaGetLastError());
            CK(cudaDeviceSynchronize());
            CK(cudaMemcpy(b.data(), o1, b.size() * 2, cudaMemcpyDeviceToHost));
            // When some differ: the first differing output's row and head, and the largest
            // difference, to tell a wrong row (tail chunks, merge) from a rounding difference.
            size_t differ = 0, first = a.size();
            float worst = 0.f;
            for (size_t i = 0; i < a.size(); ++i)
                if (__bfloat16_as_ushort(a[i]) != __bfloat16_as_ushort(b[i])) {
                    ++differ;
                    first = std::min(first, i);
                    worst = fmaxf(worst, fabsf(__bfloat162float(a[i]) - __bfloat162float(b[i])));
                }
            if (differ)
                printf("  past %d: first differing output at row %zu head %zu; largest difference %.3g\n", past,
                       first / ((size_t)nh * D), first / D % nh, worst);
            return differ;
        };
        const size_t differ = differing(groups);
        const float t0 = timer.us(rows, 1, 200), t1 = timer.us(groups, 1, 200);
        printf("%-12s %s past %5d | %7.1f | %7.1f | %zu of %zu differ\n", shape.name, chain ? "chain" : "tree ", past,
               t0, t1, differ, a.size());
        CK(cudaFree(dmeta));
        CK(cudaFree(q));
        CK(cudaFree(kp));
        CK(cudaFree(vp));
        CK(cudaFree(o0));
        CK(cudaFree(o1));
    }
    return 0;
}

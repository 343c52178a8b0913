// Probe: the attention of new tokens (a verification's 64 rows, a chain or a tree; a decode
// step's one) on the tensor cores, against the runtime's kernels (kernels.cu: the block-per-row
// `kestrel_paged_attention_many`, the grouped `kestrel_paged_attention_groups`, and for one row
// the decode instance `kestrel_paged_attention`).
//
// Why: a 64-row Llama-2-7B verification spends 1.40 ms of 7.86 in attention on an H100 (44 µs
// a layer against 8 in a decode step; docs/gpu-results.md, session 59): 2,048 (row, head)
// blocks, each a chain of dependent latencies, several rounds of them a multiprocessor. Here a
// block takes 16 · WARPS rows of one head, stages each tile of 64 K and V rows once in shared
// memory for all of them (cp.async, STAGES tiles in flight), and scores and sums them with
// mma.sync.m16n8k16 (bf16 in, f32 accumulators), flash-attention style: S = q·Kᵀ over d in
// order, the row's online softmax a tile at a time, P rounded to bf16, O += P·V.
//
// The order of every sum of row r depends only on its list of slots: tile t is list positions
// [64t, 64t + 64) whatever the launch; positions past the row's length score -inf (P = 0), and
// a tile wholly past them leaves its state untouched (selected, not rescaled by 1). A row's
// bits should then be the same in a 64-row launch and in a launch of its own (a decode step of
// that token): the probe checks it, row by row, since the runtime's losslessness rests on it
// (a verified token is the one plain decoding would have produced).
//
// A tree's rows see different new slots at the same list positions, so for a masked sequence
// only the tiles wholly inside the cached context are shared. The rest, the tail, goes
// another way: the candidates (the cached slots of the first tile not wholly cached, then
// every new node, at most 127 with 64 nodes) are staged once, S = Q·Kᵀ against all of them
// (each score an element of its own, whatever its column), each row gathers its list's scores
// into tile order, and P·V runs once per row of the warp, the V fragments gathered by the
// row's list through ldmatrix's per-lane addresses (16 rows' worth of MMAs of which one row
// is kept). Each of a tree row's sums then has the order a decode step of its token has.
//
// Session 60 (H100, docs/gpu-results.md): Llama-2-7B's 64-row chain at 128 cached slots 13.6 µs
// against the runtime's 57.4 (grouped: 39.7), its decode step 12.0 against 9.8; every row's
// bits equal to its decode step's, chains and trees. Session 61: the split forms measured
// (tc_fold's one-launch forms slower than the split blocks; a transposed tree tail, Vᵀ·Pᵀ,
// exact but no faster, dropped), and the kernel moved into the runtime
// (crates/kestrel-kernels/src/attention_tc.cuh), which this probe now launches.
//
// Session 65: the runtime's cluster kernel once a shape with each block's phases stamped
// (TC_TIMELINE, attention_tc.cuh; thread 0 of every tc_attention block of this probe stores
// its clock a few times, which its other launches pay too): where each split's block spends
// its time, and how long it waits at the cluster's barrier for the slowest.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o tc_attn_probe tools/gpu/tc_attn_probe.cu
#define TC_TIMELINE 4096
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include <algorithm>
#include <random>
#include <string>
#include <vector>

using T = __nv_bfloat16;

namespace tcp {
// The runtime's kernel (attention_tc.cuh) under the probe's launches: W warps a block, S splits.
template <int D, int WARPS, int SPLITS>
__global__ void __launch_bounds__(WARPS * 32) tc_kernel(const T *q, const T *k_pool, const T *v_pool, T *out,
                                                        float *part, const unsigned *meta, const int n_tok,
                                                        const int n_seq, const int lmax, const int nh, const int nkv,
                                                        const float scale) {
    tc_attention<T, D, WARPS, SPLITS>(q, k_pool, v_pool, out, part, meta, n_tok, n_seq, lmax, nh, nkv, scale);
}
template <int D, int SPLITS> __global__ void tc_merge_kernel(const float *part, T *out, const int n_tok, const int nh) {
    tc_merge<T, D, SPLITS>(part, out, n_tok, nh);
}

// The 4-split order (tile t in split t mod 4, states folded in split order) in one launch,
// causal sequences only. SPLIT_WARPS (a decode step's form): WARPS = 4 warps on the block's
// 16 rows, warp w walking split w's tiles through a stage of its own, the states folded in
// shared memory. Else: a warp per 16 rows as tc_attention, the tiles staged for the block in
// split order, each warp folding a split's states into shared memory as it ends. Dynamic
// shared memory fold_smem_bytes<D, WARPS, SPLIT_WARPS>().
constexpr int FOLD_SPLITS = 4;
template <int D, int WARPS, bool SPLIT_WARPS>
__global__ void __launch_bounds__(WARPS * 32) tc_fold(const T *q, const T *k_pool, const T *v_pool, T *out,
                                                      const unsigned *meta, const int n_tok, const int n_seq,
                                                      const int lmax, const int nh, const int nkv, const float scale) {
    static_assert(!SPLIT_WARPS || WARPS == FOLD_SPLITS, "a warp a split");
    constexpr int ROWS = SPLIT_WARPS ? 16 : 16 * WARPS, PITCH = D + 8, CH = D / 8, KS = D / 16, NO = D / 8 * 4;
    constexpr int STAGES = SPLIT_WARPS ? FOLD_SPLITS : 2; // a warp's own, or the block's ring
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *ks = (T *)smem_raw, *vs = ks + STAGES * TC_TILE * PITCH;
    float *fo = (float *)(vs + STAGES * TC_TILE * PITCH); // [WARPS][NO][32]: o values, a lane's
    float *fml = fo + WARPS * NO * 32;                  // [WARPS][4][32]: m, l of each of its rows
    const unsigned *seq_len = meta + n_tok, *seq_new = seq_len + n_seq, *q_start = seq_new + n_seq,
                   *slots = q_start + 2 * n_seq;
    const int h = blockIdx.x, s = blockIdx.y, g0 = blockIdx.z * ROWS;
    const int L = seq_len[s], n = seq_new[s], q0 = q_start[s];
    if (g0 >= n) return;
    const int cached = L - n, kvh = h / (nh / nkv);
    const unsigned *list = slots + (size_t)s * lmax;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane >> 2, tq = lane & 3;
    const int wr = SPLIT_WARPS ? g0 : g0 + warp * 16;
    const int r0 = wr + gq, r1 = r0 + 8;
    const int len0 = r0 < n ? cached + r0 + 1 : 0, len1 = r1 < n ? cached + r1 + 1 : 0;
    const int warp_len = wr < n ? cached + min(wr + 15, n - 1) + 1 : 0;
    const int max_len = cached + min(ROWS, n - g0) + g0, tiles = (max_len + TC_TILE - 1) / TC_TILE;
    // Tile t's K and V rows into stage `buf`, copied by `threads` threads from `first`.
    auto load = [&](const int t, const int buf, const int first, const int threads) {
        for (int i = first; i < TC_TILE * CH; i += threads) {
            const int row = i / CH, c = i % CH, pos = t * TC_TILE + row;
            const bool ok = pos < max_len;
            const size_t src = ((size_t)(ok ? list[pos] : 0) * nkv + kvh) * D + c * 8;
            cp_async16_zfill(ks + (buf * TC_TILE + row) * PITCH + c * 8, k_pool + src, ok);
            cp_async16_zfill(vs + (buf * TC_TILE + row) * PITCH + c * 8, v_pool + src, ok);
        }
        asm volatile("cp.async.commit_group;\n");
    };
    // Split v's j-th tile, and its count of tiles.
    auto split_tiles = [&](const int v) { return tiles > v ? (tiles - v + FOLD_SPLITS - 1) / FOLD_SPLITS : 0; };
    // The tiles in split order: sequence index → tile.
    auto tile_at = [&](int idx) {
        int v = 0;
        while (idx >= split_tiles(v)) idx -= split_tiles(v++);
        return v + FOLD_SPLITS * idx;
    };
    if constexpr (!SPLIT_WARPS) load(tile_at(0), 0, threadIdx.x, WARPS * 32);

    unsigned qa[KS][4];
    tc_load_q<T, D>(qa, q, q0, r0, r1, n, nh, h, tq);
    float o[D / 8][4] = {};
    TcRow st0, st1;
    const float sl2 = scale * 1.4426950408889634f;
    float *my_o = fo + warp * NO * 32 + lane, *my_ml = fml + warp * 4 * 32 + lane;
    float am0 = -INFINITY, al0 = 0.f, am1 = -INFINITY, al1 = 0.f;

    if constexpr (SPLIT_WARPS) {
        for (int t = warp; t < tiles; t += FOLD_SPLITS) {
            load(t, warp, lane, 32);
            asm volatile("cp.async.wait_group 0;\n");
            __syncwarp();
            if (t * TC_TILE < warp_len)
                tc_shared_tile<T, D>(ks + warp * TC_TILE * PITCH, vs + warp * TC_TILE * PITCH, qa, o, t * TC_TILE, lane, len0, len1,
                               sl2, st0, st1);
            __syncwarp();
        }
        // Each warp's split state, then warp 0 folds them in split order.
#pragma unroll
        for (int i = 0; i < NO; ++i) my_o[i * 32] = o[i / 4][i % 4];
        my_ml[0] = st0.m, my_ml[32] = st0.l, my_ml[64] = st1.m, my_ml[96] = st1.l;
        __syncthreads();
        if (warp != 0) return;
#pragma unroll
        for (int i = 0; i < D / 8; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
        for (int v = 0; v < FOLD_SPLITS; ++v) {
            const float *vo = fo + v * NO * 32 + lane, *vml = fml + v * 4 * 32 + lane;
            const TcFold f0 = tc_fold_factors(am0, al0, vml[0], vml[32]), f1 = tc_fold_factors(am1, al1, vml[64], vml[96]);
#pragma unroll
            for (int i = 0; i < NO; ++i) o[i / 4][i % 4] = tc_fold_value(i % 4 < 2 ? f0 : f1, o[i / 4][i % 4], vo[i * 32]);
        }
    } else {
        // The running fold's o values live in shared memory (fo), m and l in registers.
        const int total = tiles;
        for (int idx = 0, v = 0, left = split_tiles(0); idx < total; ++idx) {
            while (left == 0) left = split_tiles(++v); // this tile's split
            const int t = v + FOLD_SPLITS * (split_tiles(v) - left);
            if (idx + 1 < total) load(tile_at(idx + 1), (idx + 1) % 2, threadIdx.x, WARPS * 32);
            else asm volatile("cp.async.commit_group;\n");
            asm volatile("cp.async.wait_group 1;\n");
            __syncthreads();
            if (t * TC_TILE < warp_len)
                tc_shared_tile<T, D>(ks + (idx % 2) * TC_TILE * PITCH, vs + (idx % 2) * TC_TILE * PITCH, qa, o, t * TC_TILE, lane,
                               len0, len1, sl2, st0, st1);
            if (--left == 0) { // split v ends: fold it, start the next from nothing
                const TcFold f0 = tc_fold_factors(am0, al0, st0.m, st0.l), f1 = tc_fold_factors(am1, al1, st1.m, st1.l);
#pragma unroll
                for (int i = 0; i < NO; ++i) {
                    const float acc = v == 0 ? 0.f : my_o[i * 32];
                    my_o[i * 32] = tc_fold_value(i % 4 < 2 ? f0 : f1, acc, o[i / 4][i % 4]);
                    o[i / 4][i % 4] = 0.f;
                }
                st0 = TcRow{}, st1 = TcRow{};
            }
            __syncthreads(); // the stage is refilled next round
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i / 4][i % 4] = my_o[i * 32];
    }
    tc_write_rows<T, D>(out, o, q0, r0, r1, n, nh, h, tq, al0, al1);
}

template <int D, int WARPS, bool SPLIT_WARPS> constexpr size_t fold_smem_bytes() {
    return (size_t)2 * (SPLIT_WARPS ? FOLD_SPLITS : 2) * TC_TILE * (D + 8) * sizeof(T) + WARPS * (D / 8 * 4 + 4) * 32 * 4;
}

} // namespace tcp

// attention_groups_shared_bytes in cuda.rs.
size_t groups_smem(const int d) {
    return (size_t)PA_VWARPS * WARP * (d + 8) * sizeof(T) + PA_GROUP_ROWS * d * sizeof(float);
}

// A sequence of n new tokens after L - n cached slots, its L slots the first L of `pool_ids`
// (scattered over the pool, as pages would be); causal if `mask` is empty, else under the
// n × n mask. meta as attention.cuh's.
std::vector<unsigned> seq_meta(const int n, const int L, const std::vector<unsigned> &pool_ids,
                               const std::vector<unsigned> &mask = {}) {
    std::vector<unsigned> meta(n, 0u);
    meta.insert(meta.end(), {(unsigned)L, (unsigned)n, 0u, mask.empty() ? 0xffffffffu : 0u});
    meta.insert(meta.end(), pool_ids.begin(), pool_ids.begin() + L);
    meta.insert(meta.end(), mask.begin(), mask.end());
    return meta;
}

unsigned *to_device(const std::vector<unsigned> &v) {
    unsigned *d;
    CK(cudaMalloc(&d, v.size() * 4));
    CK(cudaMemcpy(d, v.data(), v.size() * 4, cudaMemcpyHostToDevice));
    return d;
}

std::vector<T> fetch(const T *d, const size_t n) {
    std::vector<T> h(n);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpy(h.data(), d, n * 2, cudaMemcpyDeviceToHost));
    return h;
}

size_t count_differing(const T *a, const T *b, const size_t n) {
    size_t differ = 0;
    for (size_t i = 0; i < n; ++i) differ += __bfloat16_as_ushort(a[i]) != __bfloat16_as_ushort(b[i]);
    return differ;
}

// The splits' states (tc_merge's input), for the largest launch.
float *g_part = nullptr;

template <int D, int WARPS, int SPLITS = 1> struct Tc {
    static void prepare() {
        CK(cudaFuncSetAttribute(tcp::tc_kernel<D, WARPS, SPLITS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)tc_smem_bytes<T, D, WARPS>()));
    }
    // n new tokens in each of n_seq sequences of L slots (the table's rows).
    static void launch(const T *q, const T *kp, const T *vp, T *o, const unsigned *meta, int n, int L, int nh,
                       int nkv, float scale, int n_seq = 1) {
        tcp::tc_kernel<D, WARPS, SPLITS><<<dim3(nh, n_seq * SPLITS, (n + 16 * WARPS - 1) / (16 * WARPS)), WARPS * 32,
                                           tc_smem_bytes<T, D, WARPS>()>>>(q, kp, vp, o, g_part, meta, n * n_seq,
                                                                           n_seq, L, nh, nkv, scale);
        if constexpr (SPLITS > 1) tcp::tc_merge_kernel<D, SPLITS><<<dim3(n * n_seq, nh), D>>>(g_part, o, n * n_seq, nh);
    }
};

// The runtime's cluster kernel (kernels.cu) once, its blocks' phase stamps averaged over the
// heads for each split: µs at the multiprocessors' clock (`mhz`) from the previous stamped
// phase (a block with no tail stamps none of the tail's first two). One table row a split.
std::vector<std::string> g_timeline_lines;
template <int D>
void cluster_timeline(const char *name, const char *kind, const int past, const T *q, const T *kp, const T *vp, T *o,
                      const unsigned *meta, const int n, const int L, const int nh, const int nkv, const float scale,
                      const float mhz) {
    const auto kernel = D == 128 ? kestrel_paged_attention_tc_cluster_d128_w4_bf16 : kestrel_paged_attention_tc_cluster_d64_w4_bf16;
    const size_t smem = tc_smem_bytes<T, D, 4>();
    CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    const dim3 grid(nh, TC_SPLITS, (n + 63) / 64);
    const size_t blocks = (size_t)grid.x * grid.y * grid.z;
    if (blocks > TC_TIMELINE) {
        fprintf(stderr, "%s: %zu blocks, the timeline holds %d\n", name, blocks, TC_TIMELINE);
        return;
    }
    std::vector<long long> t((size_t)TC_TIMELINE * TC_PHASES, 0);
    CK(cudaMemcpyToSymbol(tc_timeline, t.data(), t.size() * sizeof(long long)));
    kernel<<<grid, 4 * WARP, smem>>>(q, kp, vp, o, nullptr, meta, n, 1, L, nh, nkv, scale);
    CK(cudaDeviceSynchronize());
    CK(cudaMemcpyFromSymbol(t.data(), tc_timeline, t.size() * sizeof(long long)));
    for (int split = 0; split < TC_SPLITS; ++split) {
        double us[TC_PHASES] = {}, total = 0.0;
        int heads = 0;
        for (unsigned b = 0; b < blocks; ++b) {
            if ((b / grid.x) % grid.y != (unsigned)split) continue;
            const long long *st = t.data() + (size_t)b * TC_PHASES;
            long long last = st[TC_START];
            for (int p = TC_START + 1; p < TC_PHASES; ++p)
                if (st[p]) us[p] += (st[p] - last) / mhz, last = st[p];
            total += (last - st[TC_START]) / mhz;
            ++heads;
        }
        char line[256];
        snprintf(line, sizeof line, "| %s | %s | %d | %d | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |",
                 name, kind, past, split, us[TC_SETUP] / heads, us[TC_CACHED] / heads, us[TC_TAIL_STAGED] / heads,
                 us[TC_TAIL_SCORED] / heads, us[TC_TAIL] / heads, us[TC_BARRIER] / heads, us[TC_FOLD] / heads,
                 total / heads);
        g_timeline_lines.push_back(line);
    }
}

template <int D, int WARPS, bool SPLIT_WARPS> struct Fold {
    static void prepare() {
        CK(cudaFuncSetAttribute(tcp::tc_fold<D, WARPS, SPLIT_WARPS>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)tcp::fold_smem_bytes<D, WARPS, SPLIT_WARPS>()));
    }
    static void launch(const T *q, const T *kp, const T *vp, T *o, const unsigned *meta, int n, int L, int nh,
                       int nkv, float scale, int n_seq = 1) {
        const int rows = SPLIT_WARPS ? 16 : 16 * WARPS;
        tcp::tc_fold<D, WARPS, SPLIT_WARPS><<<dim3(nh, n_seq, (n + rows - 1) / rows), WARPS * 32,
                                              tcp::fold_smem_bytes<D, WARPS, SPLIT_WARPS>()>>>(
            q, kp, vp, o, meta, n * n_seq, n_seq, L, nh, nkv, scale);
    }
};

// Lines of the batched decode table, printed after the main one.
std::vector<std::string> g_batch_lines;

// A decode step of B sequences (one new token each after `past` cached slots, each its own
// slots in one pool): the runtime's two block-per-row kernels, the split blocks and the
// decode form of tc_fold; bits of the two 4-split forms compared.
template <int D> void batch_decode(const char *name, const int nh, const int nkv, const int past, LaunchTimer &timer) {
    const int B = 16, L = past + 1;
    const float scale = 1.f / sqrtf((float)D);
    std::mt19937 rng(past + 7);
    std::vector<unsigned> perm((size_t)B * L);
    for (size_t i = 0; i < perm.size(); ++i) perm[i] = (unsigned)i;
    std::shuffle(perm.begin(), perm.end(), rng);
    std::vector<unsigned> meta;
    for (int s = 0; s < B; ++s) meta.push_back((unsigned)s); // tok_seq
    for (int s = 0; s < B; ++s) meta.push_back((unsigned)L);
    for (int s = 0; s < B; ++s) meta.push_back(1u);
    for (int s = 0; s < B; ++s) meta.push_back((unsigned)s); // q_start
    for (int s = 0; s < B; ++s) meta.push_back(0xffffffffu);
    meta.insert(meta.end(), perm.begin(), perm.end()); // slots: row s·L + i
    unsigned *dmeta = to_device(meta);
    const size_t pool_elems = (size_t)B * L * nkv * D;
    const int copies = std::max(2, (int)((256u << 20) / (2 * pool_elems * 2)));
    std::vector<T *> kps, vps;
    for (int c = 0; c < copies; ++c) {
        kps.push_back(random_bf16(pool_elems, 40 + 2 * c));
        vps.push_back(random_bf16(pool_elems, 41 + 2 * c));
    }
    T *q = random_bf16((size_t)B * nh * D, 5), *o;
    const size_t out_elems = (size_t)B * nh * D;
    CK(cudaMalloc(&o, out_elems * 2));
    Tc<D, 1, 4>::launch(q, kps[0], vps[0], o, dmeta, 1, L, nh, nkv, scale, B);
    const std::vector<T> split = fetch(o, out_elems);
    Fold<D, 4, true>::launch(q, kps[0], vps[0], o, dmeta, 1, L, nh, nkv, scale, B);
    const size_t differ = count_differing(fetch(o, out_elems).data(), split.data(), out_elems);
    CK(cudaGetLastError());
    const float t_rows = timer.us([&](int c) {
        kestrel_paged_attention_bf16<<<dim3(B, nh), PA_VWARPS * WARP>>>(q, kps[c], vps[c], o, dmeta, B, B, L, nh, nkv,
                                                                      D, scale);
    }, copies, 200);
    const float t_many = timer.us([&](int c) {
        kestrel_paged_attention_many_bf16<<<dim3(B, nh), PA_VWARPS * WARP>>>(q, kps[c], vps[c], o, dmeta, B, B, L, nh,
                                                                           nkv, D, scale);
    }, copies, 200);
    const float t_split = timer.us([&](int c) { Tc<D, 1, 4>::launch(q, kps[c], vps[c], o, dmeta, 1, L, nh, nkv, scale, B); }, copies, 200);
    const float t_fold = timer.us([&](int c) { Fold<D, 4, true>::launch(q, kps[c], vps[c], o, dmeta, 1, L, nh, nkv, scale, B); }, copies, 200);
    CK(cudaGetLastError());
    char line[256];
    snprintf(line, sizeof line, "| %s | %d | %.1f | %.1f | %.1f | %.1f | %zu |", name, past, t_rows, t_many, t_split,
             t_fold, differ);
    g_batch_lines.push_back(line);
    CK(cudaFree(dmeta));
    CK(cudaFree(q));
    CK(cudaFree(o));
    for (int c = 0; c < copies; ++c) {
        CK(cudaFree(kps[c]));
        CK(cudaFree(vps[c]));
    }
}

template <int D> void run_shape(const char *name, const int nh, const int nkv, LaunchTimer &timer, const float mhz) {
    Tc<D, 4>::prepare();
    Tc<D, 1>::prepare();
    Tc<D, 4, 4>::prepare();
    Tc<D, 1, 4>::prepare();
    Fold<D, 4, true>::prepare();
    Fold<D, 4, false>::prepare();
        const int n = 64;
    const float scale = 1.f / sqrtf((float)D);
    for (const bool chain : {true, false})
    for (const int past : {128, 512, 2048}) {
        const int L = past + n, pool_rows = 2 * L;
        std::mt19937 rng(past);
        std::vector<unsigned> pool_ids(pool_rows);
        for (int i = 0; i < pool_rows; ++i) pool_ids[i] = i;
        std::shuffle(pool_ids.begin(), pool_ids.end(), rng);
        // A random tree: node i's parent is an earlier node (node 0's is the cached context).
        std::vector<unsigned> mask;
        std::vector<std::vector<int>> path(n); // each node's visible nodes, in order
        for (int i = 0; i < n; ++i) {
            const int parent = i ? std::uniform_int_distribution<int>(0, i - 1)(rng) : -1;
            if (chain) path[i] = i ? path[i - 1] : std::vector<int>{};
            else path[i] = i ? path[parent] : std::vector<int>{};
            path[i].push_back(i);
        }
        if (!chain) {
            mask.assign((size_t)n * n, 0u);
            for (int i = 0; i < n; ++i)
                for (const int j : path[i]) mask[(size_t)i * n + j] = 1u;
        }
        unsigned *dmeta = to_device(seq_meta(n, L, pool_ids, mask));
        // Enough copies of the pools that K/V come from DRAM, as in a step (each layer's once).
        const size_t pool_elems = (size_t)pool_rows * nkv * D;
        const int copies = std::max(2, (int)((256u << 20) / (2 * pool_elems * 2)));
        std::vector<T *> kps, vps;
        for (int c = 0; c < copies; ++c) {
            kps.push_back(random_bf16(pool_elems, 2 + 2 * c));
            vps.push_back(random_bf16(pool_elems, 3 + 2 * c));
        }
        T *q = random_bf16((size_t)n * nh * D, 1), *o_rows, *o_tc, *o_one;
        const size_t out_elems = (size_t)n * nh * D;
        CK(cudaMalloc(&o_rows, out_elems * 2));
        CK(cudaMalloc(&o_tc, out_elems * 2));
        CK(cudaMalloc(&o_one, (size_t)nh * D * 2));

        // Bits: the 64-row launch (4 warps a block, and 1) against each row launched alone, as
        // the decode step of its token over its list (the cached slots, then its path's); for
        // one split, and for four (another order of sums, so compared with its own).
        kestrel_paged_attention_many_bf16<<<dim3(n, nh), PA_VWARPS * WARP>>>(q, kps[0], vps[0], o_rows, dmeta, n, 1,
                                                                           L, nh, nkv, D, scale);
        const std::vector<T> ref = fetch(o_rows, out_elems);
        Tc<D, 4>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        CK(cudaGetLastError());
        const std::vector<T> tc = fetch(o_tc, out_elems);
        Tc<D, 1>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tc1 = fetch(o_tc, out_elems);
        Tc<D, 4, 4>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tcs = fetch(o_tc, out_elems);
        Tc<D, 1, 4>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tcs1 = fetch(o_tc, out_elems);
        CK(cudaGetLastError());
        // The one-launch 4-split forms (chains only) against the split blocks + tc_merge.
        size_t fold_differ = 0;
        if (chain) {
            Fold<D, 4, false>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
            fold_differ += count_differing(fetch(o_tc, out_elems).data(), tcs.data(), out_elems);
            Fold<D, 4, true>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
            fold_differ += count_differing(fetch(o_tc, out_elems).data(), tcs.data(), out_elems);
            CK(cudaGetLastError());
        }
        const size_t warps_differ = count_differing(tc.data(), tc1.data(), out_elems) +
                                    count_differing(tcs.data(), tcs1.data(), out_elems);
        size_t alone_differ = 0, alone_split_differ = 0;
        for (int r = 0; r < n; ++r) {
            std::vector<unsigned> ids(pool_ids.begin(), pool_ids.begin() + past);
            for (const int j : path[r]) ids.push_back(pool_ids[past + j]);
            const int len = (int)ids.size();
            unsigned *m1 = to_device(seq_meta(1, len, ids));
            const T *qr = q + (size_t)r * nh * D;
            Tc<D, 1>::launch(qr, kps[0], vps[0], o_one, m1, 1, len, nh, nkv, scale);
            std::vector<T> one = fetch(o_one, (size_t)nh * D);
            alone_differ += count_differing(one.data(), tc.data() + (size_t)r * nh * D, (size_t)nh * D);
            Tc<D, 1, 4>::launch(qr, kps[0], vps[0], o_one, m1, 1, len, nh, nkv, scale);
            one = fetch(o_one, (size_t)nh * D);
            alone_split_differ += count_differing(one.data(), tcs.data() + (size_t)r * nh * D, (size_t)nh * D);
            if (chain) {
                Fold<D, 4, true>::launch(qr, kps[0], vps[0], o_one, m1, 1, len, nh, nkv, scale);
                one = fetch(o_one, (size_t)nh * D);
                fold_differ += count_differing(one.data(), tcs.data() + (size_t)r * nh * D, (size_t)nh * D);
            }
            CK(cudaFree(m1));
        }
        // Against the runtime's kernel (f32 P): largest difference, largest output.
        float worst = 0.f, worst_split = 0.f, mag = 0.f;
        for (size_t i = 0; i < out_elems; ++i) {
            worst = fmaxf(worst, fabsf(__bfloat162float(tc[i]) - __bfloat162float(ref[i])));
            worst_split = fmaxf(worst_split, fabsf(__bfloat162float(tcs[i]) - __bfloat162float(ref[i])));
            mag = fmaxf(mag, fabsf(__bfloat162float(ref[i])));
        }

        auto rows = [&](int c) {
            kestrel_paged_attention_many_bf16<<<dim3(n, nh), PA_VWARPS * WARP>>>(q, kps[c], vps[c], o_rows, dmeta, n,
                                                                               1, L, nh, nkv, D, scale);
        };
        auto groups = [&](int c) {
            kestrel_paged_attention_groups_bf16<<<dim3(nh, 1, (n + PA_GROUP_ROWS - 1) / PA_GROUP_ROWS),
                                                  PA_VWARPS * WARP, groups_smem(D)>>>(q, kps[c], vps[c], o_rows,
                                                                                      dmeta, n, 1, L, nh, nkv, D,
                                                                                      scale);
        };
        const float t_rows = timer.us(rows, copies, 200), t_groups = timer.us(groups, copies, 200);
        const float t42 = timer.us([&](int c) { Tc<D, 4>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t12 = timer.us([&](int c) { Tc<D, 1>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t42s = timer.us([&](int c) { Tc<D, 4, 4>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t12s = timer.us([&](int c) { Tc<D, 1, 4>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        float tfb = 0.f, tfa = 0.f;
        if (chain) {
            tfb = timer.us([&](int c) { Fold<D, 4, false>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
            tfa = timer.us([&](int c) { Fold<D, 4, true>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        }

        // A decode step of the token after the context (one row over L slots).
        unsigned *mdec = to_device(seq_meta(1, L, pool_ids));
        float d_rows = 0.f, d42 = 0.f, d12s = 0.f, dfa = 0.f;
        if (chain) {
            d_rows = timer.us([&](int c) {
                kestrel_paged_attention_bf16<<<dim3(1, nh), PA_VWARPS * WARP>>>(q, kps[c], vps[c], o_rows, mdec, 1, 1,
                                                                              L, nh, nkv, D, scale);
            }, copies, 200);
            d42 = timer.us([&](int c) { Tc<D, 4>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
            d12s = timer.us([&](int c) { Tc<D, 1, 4>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
            dfa = timer.us([&](int c) { Fold<D, 4, true>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
        }
        CK(cudaGetLastError());
        printf("| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
               "%zu | %zu | %zu | %zu | %.3g, %.3g of %.3g |\n",
               name, chain ? "chain" : "tree", past, t_rows, t_groups, t42, t12, t42s, t12s, tfb, tfa,
               d_rows, d42, d12s, dfa, warps_differ, alone_differ, alone_split_differ, fold_differ,
               worst, worst_split, mag);
        CK(cudaFree(mdec));
        cluster_timeline<D>(name, chain ? "chain" : "tree", past, q, kps[1], vps[1], o_tc, dmeta, n, L, nh, nkv, scale,
                            mhz);
        if (chain) batch_decode<D>(name, nh, nkv, past, timer);
        CK(cudaFree(dmeta));
        CK(cudaFree(q));
        for (int c = 0; c < copies; ++c) {
            CK(cudaFree(kps[c]));
            CK(cudaFree(vps[c]));
        }
        CK(cudaFree(o_rows));
        CK(cudaFree(o_tc));
        CK(cudaFree(o_one));
    }
}

int main() {
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    CK(cudaFuncSetAttribute(kestrel_paged_attention_groups_bf16, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)groups_smem(128)));
    LaunchTimer timer;
    printf("%s: the attention of 64 new tokens, a chain or a random tree (K/V from DRAM), us a launch; tcW×S: "
           "tensor cores, W warps (16 rows each) a block, S tiles of 64 in flight; s4: the tiles in 4 splits, a "
           "block each, then tc_merge; fold: the 4 splits in one launch, a warp folding its rows' splits one after "
           "another (fold) or 4 warps a split each on 16 rows (fold warps). bits (all must be 0): outputs of tc1×2 unlike tc4×2's (and s4's), of rows "
           "alone (a decode step of their token) unlike the 64-row launch's, one split and four; of the fold forms (the 64 rows, and each row alone in fold warps) unlike s4's; diff: against the "
           "runtime's kernel\n",
           prop.name);
    printf("| shape | new | past | rows | groups | tc4×2 | tc1×2 | tc4×2 s4 | tc1×2 s4 | fold | fold warps | "
           "decode rows | decode tc4×2 | decode tc1×2 s4 | decode fold warps | bits warps | bits alone | bits alone s4 | "
           "bits fold | diff, s4 |\n");
    CK(cudaMalloc(&g_part, (size_t)4 * 64 * 32 * (128 + 2) * sizeof(float)));
    int khz = 0; // the multiprocessors' peak clock (cudaDeviceProp's clockRate left in CUDA 13)
    CK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    const float mhz = khz / 1e3f;
    run_shape<128>("llama2-7b", 32, 32, timer, mhz);
    run_shape<64>("smollm2-135m", 9, 3, timer, mhz);
    printf("\nA decode step of 16 sequences (K/V from DRAM), us a launch; bits: fold warps' outputs unlike the split "
           "blocks' (must be 0)\n| shape | past | rows (runtime) | rows, many (runtime) | tc1×2 s4 | fold warps | bits |\n");
    for (const std::string &line : g_batch_lines) printf("%s\n", line.c_str());
    printf("\nThe runtime's cluster kernel once (one launch, caches as the timings before it left them), each split's block: µs at %.0f MHz in each phase, "
           "averaged over the heads (TC_TIMELINE stamps, thread 0's view; the tail's phases only where the split "
           "holds a tree's tail)\n| shape | new | past | split | setup (lists, masks, q) | cached tiles | tail staged | "
           "tail scores | tail P·V | states kept, at the barrier | fold | total |\n", mhz);
    for (const std::string &line : g_timeline_lines) printf("%s\n", line.c_str());
    return 0;
}

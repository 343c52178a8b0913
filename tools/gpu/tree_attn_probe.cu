// Probe: a token tree's attention with each sequence's cached K/V rows read once for a group of
// query rows, against kestrel_paged_attention, which gives each (query row, head) a block that
// reads every row it sees itself. In a 64-row Llama-2-7B verification that kernel took 1.9 ms
// of 9.0 on an H100 (5× a decode step's attention; docs/gpu-results.md, session 46): 64 rows ×
// 32 heads × ~190 K and V rows of 256 bytes, ~200 MB of L2 reads a layer.
//
// tree_attn_shared<R>: a block per (head, sequence, group of R query rows), its 8 warps the 8
// virtual warps of paged_attention. Each warp stages its cached chunks (32 slots of K and V,
// chunk c ≡ warp mod 8, fully before the new tokens) in shared memory once and runs every row
// of the group over them; a row's chunks past the cached ones (its own tree ancestors) are read
// from global memory as paged_attention reads them. Each row runs paged_attention's
// arithmetic in paged_attention's order (the same chunks, scores, online softmax, V passes and
// merge), only the loads' source differs, so every output should have the shipped kernel's
// bits: checked on every output, at several context lengths, then both are timed.
// Head size 128 only (paged_attention's 16-byte V path: 16 lanes a row, 2 rows a pass).
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o tree_attn_probe tools/gpu/tree_attn_probe.cu
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include <algorithm>
#include <random>
#include <vector>

using T = __nv_bfloat16;
constexpr int D = 128;                 // head size
constexpr int VEC = 16 / sizeof(T);    // values a 16-byte load
constexpr int LPR = D / VEC;           // lanes a V row (16)
constexpr int RPP = WARP / LPR;        // V rows a pass (2)
constexpr int KV_LD = D + 8;           // a staged row: 272 bytes, so lane-strided reads miss no bank
constexpr int STAGE = 2 * WARP * KV_LD; // a warp's K then V rows of one chunk (values)
static_assert(PA_VWARPS == 8 && D % (PA_K_BATCH * VEC) == 0, "the probe's shape");

// One row's online-softmax state within one virtual warp (paged_attention's m, l, acc).
struct RowState {
    float m, l, acc[VEC];
};

// One chunk of one row, as paged_attention's VEC_V walk does it: lane j scores list position
// base + j; k_row(j) / v_row(j) give the K / V row of chunk position j (any j < 32).
template <typename KRow, typename VRow>
__device__ __forceinline__ void row_chunk(RowState &st, const float *qs, const int base, const int seen, KRow k_row,
                                          VRow v_row) {
    const int lane = threadIdx.x % WARP, rsub = lane / LPR, vsub = lane % LPR;
    const int i = base + lane;
    float sc = -INFINITY;
    if (i < seen) {
        const T *kr = k_row(lane);
        float dot = 0.f;
        for (int e0 = 0; e0 < D; e0 += PA_K_BATCH * VEC) {
            uint4 raw[PA_K_BATCH];
#pragma unroll
            for (int u = 0; u < PA_K_BATCH; ++u) raw[u] = *reinterpret_cast<const uint4 *>(kr + e0 + u * VEC);
#pragma unroll
            for (int u = 0; u < PA_K_BATCH; ++u) {
                float kv[VEC];
                unpack16<T>(raw[u], kv);
                const int e = e0 + u * VEC;
#pragma unroll
                for (int v = 0; v < VEC; ++v) dot += qs[e + v] * kv[v];
            }
        }
        sc = dot;
    }
    const float cm = warp_max(sc);
    if (cm == -INFINITY) return;
    const float m_new = fmaxf(st.m, cm);
    const float corr = expf(st.m - m_new);
    const float p = sc == -INFINITY ? 0.f : expf(sc - m_new);
    st.l = st.l * corr + warp_sum(p);
    const int cnt = min(WARP, seen - base);
#pragma unroll
    for (int k = 0; k < VEC; ++k) st.acc[k] *= corr;
    for (int jb = 0; jb < cnt; jb += PA_V_BATCH * RPP) {
        uint4 raw[PA_V_BATCH];
        float pjs[PA_V_BATCH];
#pragma unroll
        for (int u = 0; u < PA_V_BATCH; ++u) {
            const int j = jb + u * RPP + rsub;
            const float pj = __shfl_sync(FULL_MASK, p, j & (WARP - 1));
            raw[u] = *reinterpret_cast<const uint4 *>(v_row(j & (WARP - 1)) + vsub * VEC);
            pjs[u] = j < cnt ? pj : 0.f;
        }
#pragma unroll
        for (int u = 0; u < PA_V_BATCH; ++u) {
            float vv[VEC];
            unpack16<T>(raw[u], vv);
            const bool use = pjs[u] != 0.f;
#pragma unroll
            for (int k = 0; k < VEC; ++k) st.acc[k] = use ? fmaf(pjs[u], vv[k], st.acc[k]) : st.acc[k];
        }
    }
    st.m = m_new;
}

// Grid (heads, sequences, ceil(most new tokens / R)), 256 threads, R query rows a block;
// dynamic shared memory: smem_bytes(R). Arguments as kestrel_paged_attention's (d = D).
constexpr int smem_bytes(const int r) { return 8 * STAGE * (int)sizeof(T) + r * D * (int)sizeof(float); }
template <int R>
__global__ void __launch_bounds__(256) tree_attn_shared(const T *__restrict__ q, const T *__restrict__ k_pool,
                                                        const T *__restrict__ v_pool, T *__restrict__ out,
                                                        const unsigned int *__restrict__ meta, const int n_tok,
                                                        const int n_seq, const int lmax, const int nh, const int nkv,
                                                        const float scale) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int h = blockIdx.x, s = blockIdx.y, r0 = blockIdx.z * R;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const unsigned int *tok_seq = meta;
    const unsigned int *seq_len = tok_seq + n_tok;
    const unsigned int *seq_new = seq_len + n_seq;
    const unsigned int *q_start = seq_new + n_seq;
    const unsigned int *mask_off = q_start + n_seq;
    const unsigned int *slot_tab = mask_off + n_seq;
    const unsigned int *masks = slot_tab + (size_t)n_seq * lmax;
    const int L = seq_len[s], n = seq_new[s], past = L - n;
    if (r0 >= n) return;
    const int rows = min(R, n - r0);
    const unsigned int moff = mask_off[s];
    const bool causal = moff == 0xffffffffu;
    const unsigned int *slots = slot_tab + (size_t)s * lmax;
    const size_t row_stride = (size_t)nkv * D;
    const int kvh = h / (nh / nkv);
    const T *k_base = k_pool + (size_t)kvh * D, *v_base = v_pool + (size_t)kvh * D;

    T *stage = reinterpret_cast<T *>(smem) + warp * STAGE;
    float(*qs)[D] = reinterpret_cast<float(*)[D]>(smem + 8 * STAGE * sizeof(T));
    __shared__ unsigned short vis[R][PA_MAX_MASKED_NEW];
    __shared__ int n_vis[R];
    __shared__ float w_m[R][PA_VWARPS], w_l[R][PA_VWARPS];

    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        const int rr = idx / D, e = idx % D, t = q_start[s] + r0 + rr;
        qs[rr][e] = to_f(q[((size_t)t * nh + h) * D + e]) * scale;
    }
    // Each row's visible new slots, warp rr % 8 building row rr's list as paged_attention does.
    for (int rr = warp; rr < rows && !causal; rr += PA_VWARPS) {
        int count = 0;
        for (int j0 = 0; j0 < n; j0 += WARP) {
            const int j = j0 + lane;
            const bool on = j < n && masks[moff + (size_t)(r0 + rr) * n + j] != 0;
            const unsigned int ballot = __ballot_sync(FULL_MASK, on);
            if (on) vis[rr][count + __popc(ballot & ((1u << lane) - 1u))] = (unsigned short)j;
            count += __popc(ballot);
        }
        if (lane == 0) n_vis[rr] = count;
    }
    __syncthreads();

    const int vw = warp; // 8 warps: warp w is virtual warp w
    RowState st[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        st[rr].m = -INFINITY;
        st[rr].l = 0.f;
#pragma unroll
        for (int k = 0; k < VEC; ++k) st[rr].acc[k] = 0.f;
    }
    auto seen_of = [&](const int rr) { return past + (causal ? r0 + rr + 1 : n_vis[rr]); };
    // The chunks wholly among the cached slots: staged once, run for every row.
    int base = vw * WARP;
    for (; base + WARP <= past; base += PA_VWARPS * WARP) {
        for (int piece = lane; piece < 2 * WARP * (D / VEC); piece += WARP) {
            const int kv = piece / (WARP * (D / VEC)), j = (piece / (D / VEC)) % WARP, c = piece % (D / VEC);
            const T *src = (kv ? v_base : k_base) + (size_t)slots[base + j] * row_stride + c * VEC;
            cp_async16(stage + (kv * WARP + j) * KV_LD + c * VEC, src);
        }
        asm volatile("cp.async.wait_all;\n" ::: "memory");
        __syncwarp();
        const T *ks = stage, *vs = stage + WARP * KV_LD;
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
            if (rr < rows)
                row_chunk(
                    st[rr], qs[rr], base, seen_of(rr), [&](const int j) { return ks + j * KV_LD; },
                    [&](const int j) { return vs + j * KV_LD; });
        __syncwarp(); // the stage is free for the next chunk
    }
    // Each row's remaining chunks (its tree ancestors among them), from global memory.
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        if (rr >= rows) continue;
        const int seen = seen_of(rr);
        for (int b = base; b < seen; b += PA_VWARPS * WARP) {
            auto slot_at = [&](const int i) {
                return i < seen ? slots[causal || i < past ? i : past + vis[rr][i - past]] : 0u;
            };
            const unsigned int my_slot = slot_at(b + lane);
            row_chunk(
                st[rr], qs[rr], b, seen,
                [&](const int) { return k_base + (size_t)my_slot * row_stride; },
                [&](const int j) { return v_base + (size_t)__shfl_sync(FULL_MASK, my_slot, j) * row_stride; });
        }
    }
    // The virtual warp's states, as paged_attention stores them (the stage now holds w_acc).
    __syncwarp();
    float *w_acc = reinterpret_cast<float *>(stage); // [R][D] of this virtual warp
    const int rsub = lane / LPR, vsub = lane % LPR;
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        if (rr >= rows) continue;
        if (lane == 0) {
            w_m[rr][vw] = st[rr].m;
            w_l[rr][vw] = st[rr].l;
        }
#pragma unroll
        for (int k = 0; k < VEC; ++k)
            for (int o = LPR; o < WARP; o <<= 1) st[rr].acc[k] += __shfl_xor_sync(FULL_MASK, st[rr].acc[k], o);
        if (rsub == 0)
#pragma unroll
            for (int k = 0; k < VEC; ++k) w_acc[rr * D + vsub * VEC + k] = st[rr].acc[k];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < rows * D; idx += blockDim.x) {
        const int rr = idx / D, e = idx % D, t = q_start[s] + r0 + rr;
        float mx = -INFINITY;
        for (int w = 0; w < PA_VWARPS; ++w) mx = fmaxf(mx, w_m[rr][w]);
        float denom = 0.f;
        for (int w = 0; w < PA_VWARPS; ++w)
            if (w_m[rr][w] != -INFINITY) denom += w_l[rr][w] * expf(w_m[rr][w] - mx);
        float o = 0.f;
        for (int w = 0; w < PA_VWARPS; ++w)
            if (w_m[rr][w] != -INFINITY)
                o += reinterpret_cast<const float *>(reinterpret_cast<const T *>(smem) + w * STAGE)[rr * D + e] *
                     expf(w_m[rr][w] - mx);
        out[((size_t)t * nh + h) * D + e] = from_f<T>(denom > 0.f ? o / denom : 0.f);
    }
}

int main() {
    const int nh = 32, nkv = 32, n = 64; // Llama-2-7B's heads; a 64-node tree
    const float scale = 1.f / sqrtf((float)D);
    CK(cudaFuncSetAttribute(tree_attn_shared<4>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(4)));
    CK(cudaFuncSetAttribute(tree_attn_shared<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes(8)));
    LaunchTimer timer;
    printf("64-node tree, %d heads, d %d, one sequence; us a launch: shipped (a block a row and head) | shared, "
           "4 / 8 rows a block | bits (4, 8)\n",
           nh, D);
    for (const int past : {128, 512, 2048}) {
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
        meta.insert(meta.end(), {(unsigned)L, (unsigned)n, 0u, 0u});
        meta.insert(meta.end(), pool_ids.begin(), pool_ids.begin() + L);
        meta.insert(meta.end(), mask.begin(), mask.end());
        unsigned *dmeta;
        CK(cudaMalloc(&dmeta, meta.size() * 4));
        CK(cudaMemcpy(dmeta, meta.data(), meta.size() * 4, cudaMemcpyHostToDevice));
        T *q = random_bf16((size_t)n * nh * D, 1), *kp = random_bf16((size_t)pool_rows * nkv * D, 2),
          *vp = random_bf16((size_t)pool_rows * nkv * D, 3), *o0, *o1;
        CK(cudaMalloc(&o0, (size_t)n * nh * D * 2));
        CK(cudaMalloc(&o1, (size_t)n * nh * D * 2));
        auto shipped = [&](int) {
            kestrel_paged_attention_bf16<<<dim3(n, nh), PA_VWARPS * WARP>>>(q, kp, vp, o0, dmeta, n, 1, L, nh, nkv, D,
                                                                            scale);
        };
        auto shared4 = [&](int) {
            tree_attn_shared<4><<<dim3(nh, 1, (n + 3) / 4), 256, smem_bytes(4)>>>(q, kp, vp, o1, dmeta, n, 1, L, nh, nkv,
                                                                                  scale);
        };
        auto shared8 = [&](int) {
            tree_attn_shared<8><<<dim3(nh, 1, (n + 7) / 8), 256, smem_bytes(8)>>>(q, kp, vp, o1, dmeta, n, 1, L, nh, nkv,
                                                                                  scale);
        };
        std::vector<T> a((size_t)n * nh * D), b(a.size());
        shipped(0);
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
        const size_t d4 = differing(shared4), d8 = differing(shared8);
        const float t0 = timer.us(shipped, 1, 200), t4 = timer.us(shared4, 1, 200), t8 = timer.us(shared8, 1, 200);
        printf("past %5d | %7.1f | %7.1f %7.1f | %zu, %zu of %zu differ\n", past, t0, t4, t8, d4, d8, a.size());
        CK(cudaFree(dmeta));
        CK(cudaFree(q));
        CK(cudaFree(kp));
        CK(cudaFree(vp));
        CK(cudaFree(o0));
        CK(cudaFree(o1));
    }
    return 0;
}

// ---------------------------------------------------------------------------------------
// Paged attention (included by kernels.cu).
//
// q: [n_tok, nh, d] (RoPE applied), k_pool / v_pool: [slots, nkv, d], out: [n_tok, nh, d].
// meta (u32), built by kestrel_kernels::PagedAttnMeta:
//   tok_seq[n_tok]                      sequence of each query token
//   seq_len[n_seq]                      L: slots of the sequence (cached then new)
//   seq_new[n_seq]                      n: its new tokens (the last n of its L slots)
//   q_start[n_seq]                      its first query token
//   mask_off[n_seq]                     offset of its n×n mask in `masks`, or 0xffffffff for
//                                       causal over the new tokens
//   slots[n_seq * lmax]                 pool row of slot i of sequence s at s*lmax + i
//   masks[...]                          0/1 per (new row, new column), row-major
// Query row r of a sequence sees every cached slot (i < L - n) and new slot j = i - (L - n)
// when its mask allows (causal: j <= r). It attends over the list of the slots it sees,
// cached then new in order; masked slots are never read, like the additive f32::MIN mask of
// the candle path (exact zeros).
//
// A row's list is cut into chunks of 32, and chunk c belongs to "virtual warp" c mod
// PA_VWARPS: lane j scores slot base + j (a full dot product over d), the virtual warp
// updates its online softmax (running max m, sum l, accumulator over d spread across lanes)
// and adds the chunk's V rows, several rows per pass with 16-byte loads where the head size
// allows. The virtual warps' partial states are merged at the end, in their order. The slots
// a virtual warp walks and every order of summation depend only on the row's list of visible
// slots, never on how a launch spreads the work, the step's other rows or where a tree placed
// the row's ancestors: a decode step and a verification give a row the same bits, whichever
// of the two kernels below ran them and whatever warp counts their launches took. Both run a
// chunk through the same routines (pa_score, pa_rescale, pa_add_v_vec), so that they cannot
// drift apart.
//
// - paged_attention: a block per (query token, head), for any step. The launcher picks how
//   many real warps a block has (a divisor of PA_VWARPS); real warp w runs virtual warps w,
//   w + warps, ... one after the other. Built twice: for decode steps, whose few blocks each
//   walk their chunks side by side (loads in flight count most), and for steps of more blocks
//   than the GPU holds at once (PA_MANY_BATCH: blocks resident count most).
// - paged_attention_groups: a block per (head, sequence, PA_GROUP_ROWS query rows) of steps
//   that bring a few new tokens a sequence over a cached context (a verification, a draft
//   tree). Its 8 warps are the 8 virtual warps; each stages its chunks of cached slots (all
//   of whose slots every row sees) in shared memory once, K rows then V rows through one
//   stage, and runs every row of the group over them, then each row's remaining chunks (its
//   ancestors among the new tokens) from the pool.
//   The block-per-row kernel read those cached K/V rows once per query row: 64 rows of a
//   Llama-2-7B verification read ~200 MB of L2 a layer, and attention took 1.9 ms of 9.0 on
//   an H100 (5× a decode step's; docs/gpu-results.md, sessions 46-47).
// ---------------------------------------------------------------------------------------
#define PA_VWARPS 8
#define PA_MAX_D 256
// Most new tokens of a sequence under an explicit (tree) mask (MAX_MASKED_NEW in lib.rs).
#define PA_MAX_MASKED_NEW 1024
#define PA_PER_LANE (PA_MAX_D / WARP)
// 16-byte loads a lane issues at once: of its slot's K row, and of V rows (one a pass).
#define PA_K_BATCH 8
#define PA_V_BATCH 8
// The block-per-row kernel for steps whose blocks do not all fit the GPU at once
// (kestrel_paged_attention_many_*, attention_rows_kernel in cuda.rs): half the loads at once,
// registers for 3 blocks of 8 warps a multiprocessor (80, against 94 unbounded). The
// batches change which loads are in flight together, not the order of any sum, so a row
// gets the same bits from either kernel. H100, spec-bench verify:64 at 128-token prompts, one
// binary: SmolLM2 1.61 → 1.55 ms, Llama-2-7B unchanged; as the only kernel, plain decoding
// at 1,536-token contexts lost 3-6% (docs/gpu-results.md, session 48).
#define PA_MANY_BATCH 4
#define PA_MANY_MIN_BLOCKS 3
// mask_off of a causal sequence.
#define PA_CAUSAL 0xffffffffu
// Query rows a block of paged_attention_groups (ATTN_GROUP_ROWS in lib.rs; a probe build may
// set another, e.g. tools/gpu/tree_attn_probe.cu with -DPA_GROUP_ROWS=2).
#ifndef PA_GROUP_ROWS
#define PA_GROUP_ROWS 4
#endif
// Most new tokens a sequence of a step the grouped kernel takes (ATTN_GROUPS_MAX_NEW).
#define PA_GROUPS_MAX_NEW 128
// Blocks of paged_attention_groups a multiprocessor holds (ATTN_GROUPS_BLOCKS_PER_SM in
// lib.rs): 128 registers a thread. At 3 (80) each thread spilled ~0.9 KB. A probe build may
// set it (-DPA_GROUPS_MIN_BLOCKS=3).
#ifndef PA_GROUPS_MIN_BLOCKS
#define PA_GROUPS_MIN_BLOCKS 2
#endif

template <bool B> struct BoolConst {
    static constexpr bool value = B;
};

// The metadata's arrays (layout above).
struct PaTable {
    const unsigned int *tok_seq, *seq_len, *seq_new, *q_start, *mask_off, *slots, *masks;
    __device__ __forceinline__ PaTable(const unsigned int *meta, const int n_tok, const int n_seq,
                                       const int lmax) {
        tok_seq = meta;
        seq_len = tok_seq + n_tok;
        seq_new = seq_len + n_seq;
        q_start = seq_new + n_seq;
        mask_off = q_start + n_seq;
        slots = mask_off + n_seq;
        masks = slots + (size_t)n_seq * lmax;
    }
};

// A query row's online-softmax state within one virtual warp: running max, running sum, and
// the lane's share of the accumulator.
template <int ACC> struct PaState {
    float m, l, acc[ACC];
    __device__ __forceinline__ void reset() {
        m = -INFINITY;
        l = 0.f;
#pragma unroll
        for (int k = 0; k < ACC; ++k) acc[k] = 0.f;
    }
};

// One warp lists, in order, the new slots (indices among the n) that a row's mask row
// `mask[0..n)` lets it see, into `vis`, and their count into `*count`. The row attends over
// its visible slots only, cached then new, as one list: the list, and with it every order of
// summation, is the one a decode step of the same token over the same context walks,
// wherever the tree put the row's ancestors among its nodes.
__device__ __forceinline__ void pa_list_visible(unsigned short *vis, int *count,
                                                const unsigned int *mask, const int n) {
    const int lane = threadIdx.x % WARP;
    int found = 0;
    for (int j0 = 0; j0 < n; j0 += WARP) {
        const int j = j0 + lane;
        const bool on = j < n && mask[j] != 0;
        const unsigned int ballot = __ballot_sync(FULL_MASK, on);
        if (on) vis[found + __popc(ballot & ((1u << lane) - 1u))] = (unsigned short)j;
        found += __popc(ballot);
    }
    if (lane == 0) *count = found;
}

// The pool row at position i (< the row's count of seen slots) of a row's list.
__device__ __forceinline__ unsigned int pa_slot(const unsigned int *slots, const unsigned short *vis,
                                                const bool causal, const int past, const int i) {
    return slots[causal || i < past ? i : past + vis[i - past]];
}

// q (scaled, in shared memory) · the K row `kr`. 16-byte loads where d is a multiple of the
// vector width (the row is then 16-byte aligned), KB issued before any product: with
// PA_K_BATCH, a d = 128 row in two rounds of memory latency (one round, 16 at once, took 168
// registers and slowed 64-row verifications by 9-15%).
template <typename T, int KB = PA_K_BATCH>
__device__ __forceinline__ float pa_score(const float *qs, const T *kr, const int d) {
    constexpr int VEC = 16 / sizeof(T);
    float dot = 0.f;
    if (d % VEC == 0) {
        for (int e0 = 0; e0 < d; e0 += KB * VEC) {
            uint4 raw[KB];
#pragma unroll
            for (int u = 0; u < KB; ++u)
                if (e0 + u * VEC < d) raw[u] = *reinterpret_cast<const uint4 *>(kr + e0 + u * VEC);
#pragma unroll
            for (int u = 0; u < KB; ++u) {
                if (e0 + u * VEC < d) {
                    float kv[VEC];
                    unpack16<T>(raw[u], kv);
                    const int e = e0 + u * VEC;
#pragma unroll
                    for (int v = 0; v < VEC; ++v) dot += qs[e + v] * kv[v];
                }
            }
        }
    } else {
        for (int e = 0; e < d; ++e) dot += qs[e] * to_f(kr[e]);
    }
    return dot;
}

// The lane's score for list position i of a row that sees `seen` slots, its K row read from
// the pool (-inf past the list), and its pool row into `slot` (0 past the list, so that V
// loads of unused lanes stay in bounds). The V row's way into L2 starts now, with the K
// row's: V is read after the scores, and its round trip from DRAM was one more link in a
// chain of dependent latencies (H200 bf16 decode: 0.87 → 0.82 ms a SmolLM2 step, 4.27 → 4.18
// ms Llama-2-7B). Prefetching touches no value, so no result changes.
template <typename T, int KB, typename SlotOf>
__device__ __forceinline__ float pa_score_pool(const float *qs, const T *k_base, const T *v_base,
                                               const size_t row_stride, const int d, const int i,
                                               const int seen, SlotOf slot_of, unsigned int &slot) {
    slot = 0;
    if (i >= seen) return -INFINITY;
    slot = slot_of(i);
    const char *vr = reinterpret_cast<const char *>(v_base + (size_t)slot * row_stride);
    for (int b = 0; b < d * (int)sizeof(T); b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + b));
    return pa_score<T, KB>(qs, k_base + (size_t)slot * row_stride, d);
}

// A chunk's softmax step: the chunk's largest score joins the running max, the state is
// rescaled to it, and `p` is the lane's weight against the new max (0 for an unseen slot).
// False, with nothing changed, when no lane has a score (the chunk is all masked or past the
// end).
template <int ACC> __device__ __forceinline__ bool pa_rescale(PaState<ACC> &st, const float sc, float &p) {
    const float cm = warp_max(sc); // warp-uniform
    if (cm == -INFINITY) return false;
    const float m_new = fmaxf(st.m, cm);
    const float corr = expf(st.m - m_new); // 0 on the first chunk (m = -inf)
    p = sc == -INFINITY ? 0.f : expf(sc - m_new);
    st.l = st.l * corr + warp_sum(p);
#pragma unroll
    for (int k = 0; k < ACC; ++k) st.acc[k] *= corr;
    st.m = m_new;
    return true;
}

// The chunk's `cnt` V rows, weighted by the lanes' p, into the accumulator, as 16-byte
// vectors: a V row is lpr (a power of two ≤ 32) vectors, lane = (row of the pass, vector),
// WARP / lpr rows a pass. v_row(j): chunk position j's V row (every lane calls it, j < 32).
// VB passes' loads are issued before any of their products: written as
// load-then-use per pass, each pass waited out its own round trip (Nsight: 16 stalls in a
// row on a Llama-2-7B row of d = 128).
template <typename T, int VB = PA_V_BATCH, typename VRow>
__device__ __forceinline__ void pa_add_v_vec(PaState<16 / sizeof(T)> &st, const float p, const int cnt,
                                             const int lpr, VRow v_row) {
    constexpr int VEC = 16 / sizeof(T);
    const int lane = threadIdx.x % WARP;
    const int rows_per_pass = WARP / lpr, rsub = lane / lpr, vsub = lane % lpr;
    for (int jb = 0; jb < cnt; jb += VB * rows_per_pass) {
        uint4 raw[VB];
        float pjs[VB];
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            const int j = jb + u * rows_per_pass + rsub;
            // Lanes past the chunk read position j mod 32 and are not used (every position's
            // row is a pool row); a masked slot (pj = 0) adds nothing, whatever it holds.
            const float pj = __shfl_sync(FULL_MASK, p, j & (WARP - 1));
            raw[u] = *reinterpret_cast<const uint4 *>(v_row(j & (WARP - 1)) + vsub * VEC);
            pjs[u] = j < cnt ? pj : 0.f;
        }
#pragma unroll
        for (int u = 0; u < VB; ++u) {
            float vv[VEC];
            unpack16<T>(raw[u], vv);
            const bool use = pjs[u] != 0.f;
#pragma unroll
            for (int k = 0; k < VEC; ++k) st.acc[k] = use ? fmaf(pjs[u], vv[k], st.acc[k]) : st.acc[k];
        }
    }
}

// A virtual warp's state for the merge: m and l (lane 0) and the accumulator, the passes'
// rows summed across the lanes holding the same vector of the row, into acc_out[0..d).
template <typename T>
__device__ __forceinline__ void pa_store_vec(PaState<16 / sizeof(T)> &st, const int lpr, float *m_out,
                                             float *l_out, float *acc_out) {
    constexpr int VEC = 16 / sizeof(T);
    const int lane = threadIdx.x % WARP, rsub = lane / lpr, vsub = lane % lpr;
    if (lane == 0) {
        *m_out = st.m;
        *l_out = st.l;
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k)
        for (int o = lpr; o < WARP; o <<= 1) st.acc[k] += __shfl_xor_sync(FULL_MASK, st.acc[k], o);
    if (rsub == 0) {
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc_out[vsub * VEC + k] = st.acc[k];
    }
}

// A row's output from its virtual warps' states (w_m, w_l, acc(w, e)), merged in their
// order; the block's threads share the d values.
template <typename T, typename Acc>
__device__ __forceinline__ void pa_write_row(T *out, const float *w_m, const float *w_l, const int d, Acc acc) {
    float mx = -INFINITY;
    for (int w = 0; w < PA_VWARPS; ++w) mx = fmaxf(mx, w_m[w]);
    float denom = 0.f;
    for (int w = 0; w < PA_VWARPS; ++w)
        if (w_m[w] != -INFINITY) denom += w_l[w] * expf(w_m[w] - mx);
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float o = 0.f;
        for (int w = 0; w < PA_VWARPS; ++w)
            if (w_m[w] != -INFINITY) o += acc(w, e) * expf(w_m[w] - mx);
        out[e] = from_f<T>(denom > 0.f ? o / denom : 0.f);
    }
}

// KB, VB: the loads a lane issues at once (pa_score, pa_add_v_vec).
template <typename T, int KB, int VB>
__device__ void paged_attention(const T *__restrict__ q, const T *__restrict__ k_pool,
                                const T *__restrict__ v_pool, T *__restrict__ out,
                                const unsigned int *__restrict__ meta, const int n_tok,
                                const int n_seq, const int lmax, const int nh, const int nkv,
                                const int d, const float scale) {
    const int t = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const PaTable tab(meta, n_tok, n_seq, lmax);
    const int s = tab.tok_seq[t];
    const int L = tab.seq_len[s];
    const int n = tab.seq_new[s];
    const int r = t - (int)tab.q_start[s];
    const int past = L - n;
    const unsigned int moff = tab.mask_off[s];
    const unsigned int *slots = tab.slots + (size_t)s * lmax;
    const int kvh = h / (nh / nkv);
    const size_t row_stride = (size_t)nkv * d;
    const T *k_base = k_pool + (size_t)kvh * d;
    const T *v_base = v_pool + (size_t)kvh * d;

    __shared__ float qs[PA_MAX_D];
    __shared__ float w_m[PA_VWARPS], w_l[PA_VWARPS];
    __shared__ float w_acc[PA_VWARPS][PA_MAX_D];
    __shared__ unsigned short vis[PA_MAX_MASKED_NEW];
    __shared__ int n_vis;

    for (int e = threadIdx.x; e < d; e += blockDim.x)
        qs[e] = to_f(q[((size_t)t * nh + h) * d + e]) * scale;
    const bool causal = moff == PA_CAUSAL;
    if (!causal && warp == 0) pa_list_visible(vis, &n_vis, tab.masks + moff + (size_t)r * n, n);
    __syncthreads();
    // Slots the row sees: causal rows see the new ones up to themselves.
    const int seen = past + (causal ? r + 1 : n_vis);
    auto slot_of = [&](const int i) { return pa_slot(slots, vis, causal, past, i); };

    // V rows are read as 16-byte vectors when a row is a power-of-two number `lpr` ≤ 32 of
    // them (pa_add_v_vec): reading one element per lane and one row at a time left a chunk's
    // 32 V rows as 8 rounds of memory latency. Otherwise (other head sizes) the scalar loop.
    // The two paths are compiled apart (`VEC_V`) so that neither keeps the other's
    // accumulators live.
    constexpr int VEC = 16 / sizeof(T);
    const int lpr = d / VEC;
    const bool vec_v = d % VEC == 0 && lpr <= WARP && (lpr & (lpr - 1)) == 0;
    const int nwarps = blockDim.x / WARP; // a divisor of PA_VWARPS
    auto walk = [&](auto vec_v_tag) {
        constexpr bool VEC_V = decltype(vec_v_tag)::value;
        PaState<VEC_V ? VEC : PA_PER_LANE> st;
        for (int vw = warp; vw < PA_VWARPS; vw += nwarps) {
            st.reset();
            for (int base = vw * WARP; base < seen; base += PA_VWARPS * WARP) {
                unsigned int slot;
                const float sc = pa_score_pool<T, KB>(qs, k_base, v_base, row_stride, d, base + lane, seen, slot_of, slot);
                float p;
                if (!pa_rescale(st, sc, p)) continue;
                const int cnt = min(WARP, seen - base); // warp-uniform
                if constexpr (VEC_V) {
                    pa_add_v_vec<T, VB>(st, p, cnt, lpr, [&](const int j) {
                        return v_base + (size_t)__shfl_sync(FULL_MASK, slot, j) * row_stride;
                    });
                } else {
#pragma unroll 4
                    for (int j = 0; j < cnt; ++j) {
                        const float pj = __shfl_sync(FULL_MASK, p, j);
                        const unsigned int sj = __shfl_sync(FULL_MASK, slot, j);
                        if (pj != 0.f) { // masked: an exact zero contribution, whatever the slot holds
                            const T *vr = v_base + (size_t)sj * row_stride;
#pragma unroll
                            for (int k = 0; k < PA_PER_LANE; ++k) {
                                const int e = lane + WARP * k;
                                if (e < d) st.acc[k] += pj * to_f(vr[e]);
                            }
                        }
                    }
                }
            }
            if constexpr (VEC_V) {
                pa_store_vec<T>(st, lpr, &w_m[vw], &w_l[vw], w_acc[vw]);
            } else {
                if (lane == 0) {
                    w_m[vw] = st.m;
                    w_l[vw] = st.l;
                }
#pragma unroll
                for (int k = 0; k < PA_PER_LANE; ++k) {
                    const int e = lane + WARP * k;
                    if (e < d) w_acc[vw][e] = st.acc[k];
                }
            }
        }
    };
    if (vec_v)
        walk(BoolConst<true>{});
    else
        walk(BoolConst<false>{});
    __syncthreads();
    pa_write_row(out + ((size_t)t * nh + h) * d, w_m, w_l, d, [&](const int w, const int e) { return w_acc[w][e]; });
}

// Dynamic shared memory of paged_attention_groups (attention_groups_shared_bytes in
// lib.rs): each warp's stage, 32 rows of d + VEC values (16 bytes past the row, so that lanes
// reading their own rows at one offset spread over the banks) that take a chunk's K rows and
// then its V rows, then the group's scaled query rows, [PA_GROUP_ROWS][d] f32.
extern __shared__ __align__(16) unsigned char attn_stage[];

// A group's static shared memory: its rows' visible new slots and the virtual warps' softmax
// states (declared once, by the dispatcher, for both head sizes' code).
struct PaGroupShared {
    unsigned short vis[PA_GROUP_ROWS][PA_GROUPS_MAX_NEW];
    int n_vis[PA_GROUP_ROWS];
    int shared_new; // visible new slots at the head of every row's list, the same in all
    float w_m[PA_GROUP_ROWS][PA_VWARPS], w_l[PA_GROUP_ROWS][PA_VWARPS];
};

// Grid (heads, sequences, ceil(most new tokens of a sequence / PA_GROUP_ROWS)), 8 warps.
// Compiled for head sizes of 64 and 128 values (Llama-family heads; the launcher checks; every
// dtype's V rows are then a power-of-two count ≤ 32 of 16-byte vectors): with d a runtime
// value, its index arithmetic (divisions by the vectors a row) and loops left it 1.4x slower
// than the block-per-row kernel at 128 cached slots, where compiled for d = 128 it was 1.3x
// faster (H100, tools/gpu/tree_attn_probe.cu, session 47).
template <typename T, int D>
__device__ void paged_attention_groups_d(const T *__restrict__ q, const T *__restrict__ k_pool,
                                         const T *__restrict__ v_pool, T *__restrict__ out,
                                         const unsigned int *__restrict__ meta, const int n_tok,
                                         const int n_seq, const int lmax, const int nh, const int nkv,
                                         const float scale, PaGroupShared &sh) {
    constexpr int d = D;
    constexpr int VEC = 16 / sizeof(T), R = PA_GROUP_ROWS;
    static_assert(D % VEC == 0 && D / VEC <= WARP && (D / VEC & (D / VEC - 1)) == 0, "V rows as vectors");
    const int h = blockIdx.x, s = blockIdx.y, r0 = blockIdx.z * R;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const PaTable tab(meta, n_tok, n_seq, lmax);
    const int L = tab.seq_len[s], n = tab.seq_new[s], past = L - n;
    if (r0 >= n) return; // a shorter sequence than the step's longest
    const int rows = min(R, n - r0);
    const int t0 = tab.q_start[s] + r0;
    const unsigned int moff = tab.mask_off[s];
    const bool causal = moff == PA_CAUSAL;
    const unsigned int *slots = tab.slots + (size_t)s * lmax;
    const int kvh = h / (nh / nkv);
    const size_t row_stride = (size_t)nkv * d;
    const T *k_base = k_pool + (size_t)kvh * d;
    const T *v_base = v_pool + (size_t)kvh * d;
    constexpr int ld = d + VEC, lpr = d / VEC;

    constexpr size_t region = WARP * ld * sizeof(T); // a warp's stage
    unsigned char *mine = attn_stage + warp * region;
    T *stage = reinterpret_cast<T *>(mine);
    float *qs = reinterpret_cast<float *>(attn_stage + PA_VWARPS * region);
    auto &vis = sh.vis;
    auto &n_vis = sh.n_vis;
    auto &w_m = sh.w_m;
    auto &w_l = sh.w_l;

    for (int idx = threadIdx.x; idx < rows * d; idx += blockDim.x)
        qs[idx] = to_f(q[((size_t)(t0 + idx / d) * nh + h) * d + idx % d]) * scale;
    for (int rr = warp; rr < rows && !causal; rr += PA_VWARPS)
        pa_list_visible(vis[rr], &n_vis[rr], tab.masks + moff + (size_t)(r0 + rr) * n, n);
    __syncthreads();
    auto seen_of = [&](const int rr) { return past + (causal ? r0 + rr + 1 : n_vis[rr]); };
    // The lists' common prefix: every cached slot, then the new ones all the group's rows see
    // at the same list positions (a causal group's first row's; a tree group's shared
    // ancestors, which a verification's chain of new tokens makes most of its rows' lists).
    if (!causal && warp == 0) {
        int common = n_vis[0];
        for (int rr = 1; rr < rows; ++rr) common = min(common, n_vis[rr]);
        int agreed = 0;
        for (int k0 = 0; k0 < common; k0 += WARP) {
            const int k = k0 + lane;
            bool same = true;
            for (int rr = 1; rr < rows; ++rr) same = same && (k >= common || vis[rr][k] == vis[0][k]);
            const unsigned int differ = __ballot_sync(FULL_MASK, !same);
            if (differ) {
                agreed = k0 + __ffs(differ) - 1;
                break;
            }
            agreed = min(k0 + WARP, common);
        }
        if (lane == 0) sh.shared_new = agreed;
    }
    __syncthreads();
    const int common = past + (causal ? r0 + 1 : sh.shared_new);

    PaState<VEC> st[R];
#pragma unroll
    for (int rr = 0; rr < R; ++rr) st[rr].reset();
    // The chunks wholly within the common prefix, which every row sees at the same positions:
    // staged once, run for every row. The stage takes the chunk's K rows, every row's scores
    // and softmax step, then its V rows (asked of L2 with the K rows'), every row's sum: half
    // the shared memory of staging both at once, so that two blocks share a multiprocessor.
    int base = warp * WARP;
    for (; base + WARP <= common; base += PA_VWARPS * WARP) {
        const unsigned int slot = pa_slot(slots, vis[0], causal, past, base + lane);
        const char *vr = reinterpret_cast<const char *>(v_base + (size_t)slot * row_stride);
#pragma unroll
        for (int b = 0; b < d * (int)sizeof(T); b += 128) asm volatile("prefetch.global.L2 [%0];" ::"l"(vr + b));
        auto stage_rows = [&](const T *pool_base) {
            for (int piece = lane; piece < WARP * lpr; piece += WARP) {
                const int j = piece / lpr, c = piece % lpr;
                const unsigned int sj = __shfl_sync(FULL_MASK, slot, j);
                cp_async16(stage + j * ld + c * VEC, pool_base + (size_t)sj * row_stride + c * VEC);
            }
            asm volatile("cp.async.wait_all;\n" ::: "memory");
            __syncwarp();
        };
        stage_rows(k_base);
        float p[R];
        bool live[R];
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
            live[rr] = rr < rows && pa_rescale(st[rr], pa_score<T>(qs + rr * d, stage + lane * ld, d), p[rr]);
        __syncwarp(); // every lane is done with the K rows
        stage_rows(v_base);
#pragma unroll
        for (int rr = 0; rr < R; ++rr)
            if (live[rr]) pa_add_v_vec<T>(st[rr], p[rr], WARP, lpr, [&](const int j) { return stage + j * ld; });
        __syncwarp(); // the stage is free for the next chunk
    }
    // Each row's remaining chunks (the rest of its ancestors among the new tokens), from the
    // pool.
#pragma unroll
    for (int rr = 0; rr < R; ++rr) {
        if (rr >= rows) continue;
        const int seen = seen_of(rr);
        auto slot_of = [&](const int i) { return pa_slot(slots, vis[rr], causal, past, i); };
        for (int b = base; b < seen; b += PA_VWARPS * WARP) {
            unsigned int slot;
            const float sc = pa_score_pool<T, PA_K_BATCH>(qs + rr * d, k_base, v_base, row_stride, d, b + lane, seen, slot_of, slot);
            float p;
            if (pa_rescale(st[rr], sc, p))
                pa_add_v_vec<T>(st[rr], p, min(WARP, seen - b), lpr, [&](const int j) {
                    return v_base + (size_t)__shfl_sync(FULL_MASK, slot, j) * row_stride;
                });
        }
    }
    // The states, the accumulators in the warp's stage ([R][d] f32, which fits: 32 rows of
    // d + VEC values ≥ 4 · d floats).
    __syncwarp();
    float *w_acc = reinterpret_cast<float *>(mine);
#pragma unroll
    for (int rr = 0; rr < R; ++rr)
        if (rr < rows) pa_store_vec<T>(st[rr], lpr, &w_m[rr][warp], &w_l[rr][warp], w_acc + rr * d);
    __syncthreads();
    for (int rr = 0; rr < rows; ++rr)
        pa_write_row(out + ((size_t)(t0 + rr) * nh + h) * d, w_m[rr], w_l[rr], d, [&](const int w, const int e) {
            return reinterpret_cast<const float *>(attn_stage + w * region)[rr * d + e];
        });
}

template <typename T>
__device__ void paged_attention_groups(const T *__restrict__ q, const T *__restrict__ k_pool,
                                       const T *__restrict__ v_pool, T *__restrict__ out,
                                       const unsigned int *__restrict__ meta, const int n_tok,
                                       const int n_seq, const int lmax, const int nh, const int nkv,
                                       const int d, const float scale) {
    __shared__ PaGroupShared sh;
    if (d == 64)
        paged_attention_groups_d<T, 64>(q, k_pool, v_pool, out, meta, n_tok, n_seq, lmax, nh, nkv, scale, sh);
    else
        paged_attention_groups_d<T, 128>(q, k_pool, v_pool, out, meta, n_tok, n_seq, lmax, nh, nkv, scale, sh);
}

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
// bits equal to its decode step's, chains and trees. The split forms (s4: tile t in split
// t mod 4; tc_fold: those splits in one launch) and the transposed tree tail came after.
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -o tc_attn_probe tools/gpu/tc_attn_probe.cu
#include "../../crates/kestrel-kernels/src/kernels.cu"
#include "probe_common.cuh"
#include <algorithm>
#include <random>
#include <string>
#include <vector>

using T = __nv_bfloat16;

namespace tcp {
constexpr int TILE = 64; // list positions a tile

__device__ __forceinline__ void cp_async16_zfill(void *smem, const void *gmem, const bool ok) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ void ldsm_x4_trans(unsigned (&r)[4], const void *smem) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(s));
}

__device__ __forceinline__ unsigned pack2(const T lo, const T hi) {
    return (unsigned)__bfloat16_as_ushort(lo) | ((unsigned)__bfloat16_as_ushort(hi) << 16);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

// One query row's softmax state: running max (scaled by log2 e), running sum.
struct RowState {
    float m = -INFINITY, l = 0.f;
};

// Scores of one row (its 16 values a lane: 8 column tiles × 2) → P (bf16, as the PV product's A
// fragment halves `pa[k][half]`), the rescale factor of its accumulator, the state updated.
// `sc` holds q·k; positions at or past `len` score -inf.
__device__ __forceinline__ float row_softmax(float (&sc)[8][2], const int base, const int col0, const int len,
                                             const float sl2, RowState &st, unsigned (&pa)[4][2], bool &active) {
    active = base < len;
    float mx = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int pos = base + nt * 8 + col0 + j;
            sc[nt][j] = pos < len ? sc[nt][j] * sl2 : -INFINITY;
            mx = fmaxf(mx, sc[nt][j]);
        }
    mx = quad_max(mx);
    const float mn = fmaxf(st.m, mx);
    const float off = mn == -INFINITY ? 0.f : mn;
    const float alpha = exp2f(st.m - off);
    float sum = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        const T p0 = __float2bfloat16_rn(exp2f(sc[nt][0] - off)), p1 = __float2bfloat16_rn(exp2f(sc[nt][1] - off));
        sum += __bfloat162float(p0);
        sum += __bfloat162float(p1);
        pa[nt / 2][nt % 2] = pack2(p0, p1);
    }
    sum = quad_sum(sum);
    if (active) {
        st.l = fmaf(st.l, alpha, sum);
        st.m = mn;
    }
    return alpha;
}

// Most new nodes of a masked sequence (the probe's trees have 64) and the scores' row pitch.
constexpr int MAX_NODES = 64, SW_LD = 2 * TILE + 4;

// acc (8 slots × this lane's 4 outputs) = q·k over d in order, the 8 K rows at `k8` (pitch
// d + 8) in shared memory.
template <int D>
__device__ __forceinline__ void scores(float (&acc)[4], const unsigned (&qa)[D / 16][4], const T *k8, const int lane) {
    acc[0] = acc[1] = acc[2] = acc[3] = 0.f;
#pragma unroll
    for (int k = 0; k < D / 16; k += 2) {
        unsigned b[4];
        ldsm_x4(b, k8 + (lane & 7) * (D + 8) + k * 16 + 8 * (lane >> 3));
        mma16816<T>(acc, qa[k], b);
        mma16816<T>(acc, qa[k + 1], b + 2);
    }
}

// The softmax step of a tile for both of the lane's rows; P as the A fragments of P·V.
__device__ __forceinline__ void tile_softmax(float (&sc)[8][4], const int base, const int tq, const int len0,
                                             const int len1, const float sl2, RowState &st0, RowState &st1,
                                             unsigned (&pa)[4][4], float &a0, float &a1, bool &act0, bool &act1) {
    float s0[8][2], s1[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s0[nt][0] = sc[nt][0], s0[nt][1] = sc[nt][1], s1[nt][0] = sc[nt][2], s1[nt][1] = sc[nt][3];
    unsigned p0[4][2], p1[4][2];
    a0 = row_softmax(s0, base, 2 * tq, len0, sl2, st0, p0, act0);
    a1 = row_softmax(s1, base, 2 * tq, len1, sl2, st1, p1, act1);
#pragma unroll
    for (int k = 0; k < 4; ++k) pa[k][0] = p0[k][0], pa[k][1] = p1[k][0], pa[k][2] = p0[k][1], pa[k][3] = p1[k][1];
}

// o = o · alpha + P·V for the output pair np of the lane's first (ROW0) and/or second row,
// where the row has positions in the tile; a row past its list keeps its state.
template <bool ROW0, bool ROW1, int N>
__device__ __forceinline__ void accumulate(float (&o)[N][4], const int np, const float (&pv)[2][4], const float a0,
                                           const float a1, const bool act0, const bool act1) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float *oj = o[2 * np + j];
        if (ROW0 && act0) oj[0] = fmaf(oj[0], a0, pv[j][0]), oj[1] = fmaf(oj[1], a0, pv[j][1]);
        if (ROW1 && act1) oj[2] = fmaf(oj[2], a1, pv[j][2]), oj[3] = fmaf(oj[3], a1, pv[j][3]);
    }
}

// The lane's share of Q's A fragments (rows r0 and r1 = r0 + 8 of the sequence whose first
// query token is q0; zeros past its n rows), k-steps of 16 along d.
template <int D>
__device__ __forceinline__ void load_q(unsigned (&qa)[D / 16][4], const T *q, const int q0, const int r0, const int r1,
                                       const int n, const int nh, const int h, const int tq) {
    const T *qr0 = q + ((size_t)(q0 + r0) * nh + h) * D, *qr1 = q + ((size_t)(q0 + r1) * nh + h) * D;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
        const int c = 16 * k + 2 * tq;
        qa[k][0] = r0 < n ? *(const unsigned *)(qr0 + c) : 0u;
        qa[k][1] = r1 < n ? *(const unsigned *)(qr1 + c) : 0u;
        qa[k][2] = r0 < n ? *(const unsigned *)(qr0 + c + 8) : 0u;
        qa[k][3] = r1 < n ? *(const unsigned *)(qr1 + c + 8) : 0u;
    }
}

// out's rows r0 and r1 (those below n): the lane's o values over their sums l0 and l1.
template <int D>
__device__ __forceinline__ void write_rows(T *out, const float (&o)[D / 8][4], const int q0, const int r0, const int r1,
                                           const int n, const int nh, const int h, const int tq, const float l0,
                                           const float l1) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + 2 * tq;
        if (r0 < n)
            *(unsigned *)(out + ((size_t)(q0 + r0) * nh + h) * D + c) =
                pack2(__float2bfloat16_rn(o[nt][0] / l0), __float2bfloat16_rn(o[nt][1] / l0));
        if (r1 < n)
            *(unsigned *)(out + ((size_t)(q0 + r1) * nh + h) * D + c) =
                pack2(__float2bfloat16_rn(o[nt][2] / l1), __float2bfloat16_rn(o[nt][3] / l1));
    }
}

// pv = P · V for the output pairs 2np and 2np + 1: P as A fragments (4 k-steps of 16 list
// positions), V through the lane's row addresses `vrow` (one a k-step).
__device__ __forceinline__ void pv_pair(float (&pv)[2][4], const unsigned (&pa)[4][4], const T *const (&vrow)[4],
                                        const int np) {
#pragma unroll
    for (int j = 0; j < 2; ++j) pv[j][0] = pv[j][1] = pv[j][2] = pv[j][3] = 0.f;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        unsigned b[4];
        ldsm_x4_trans(b, vrow[k] + 16 * np);
        mma16816<T>(pv[0], pa[k], b);
        mma16816<T>(pv[1], pa[k], b + 2);
    }
}

// One tile every row of the warp sees at the same list positions (K rows `kt`, V rows `vt`,
// pitch d + 8): scores, the softmax step, o = o · alpha + P·V.
template <int D>
__device__ __forceinline__ void shared_tile(const T *kt, const T *vt, const unsigned (&qa)[D / 16][4], float (&o)[D / 8][4],
                                            const int base, const int lane, const int len0, const int len1,
                                            const float sl2, RowState &st0, RowState &st1) {
    constexpr int PITCH = D + 8;
    float sc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) scores<D>(sc[nt], qa, kt + nt * 8 * PITCH, lane);
    unsigned pa[4][4];
    float a0, a1;
    bool act0, act1;
    tile_softmax(sc, base, lane & 3, len0, len1, sl2, st0, st1, pa, a0, a1, act0, act1);
    const T *vrow[4]; // the V row this lane addresses for each k-step
#pragma unroll
    for (int k = 0; k < 4; ++k) vrow[k] = vt + (16 * k + 8 * ((lane >> 3) & 1) + (lane & 7)) * PITCH + 8 * (lane >> 4);
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
        float pv[2][4];
        pv_pair(pv, pa, vrow, np);
        accumulate<true, true>(o, np, pv, a0, a1, act0, act1);
    }
}

// The splits' states folded in split order, one after another (every form folds so, and so
// gives a row the same bits): acc ⊕ (o, m, l). fold_factors updates acc's m and l and says
// how its o values change (fold_value).
struct Fold {
    float fa, fv;
    bool skip, take;
};
__device__ __forceinline__ Fold fold_factors(float &am, float &al, const float m, const float l) {
    Fold f{1.f, 1.f, false, false};
    if (m == -INFINITY) { // nothing of the row in this split
        f.skip = true;
    } else if (am == -INFINITY) {
        f.take = true;
        am = m, al = l;
    } else {
        const float mx = fmaxf(am, m);
        f.fa = exp2f(am - mx), f.fv = exp2f(m - mx);
        al = fmaf(al, f.fa, l * f.fv);
        am = mx;
    }
    return f;
}
__device__ __forceinline__ float fold_value(const Fold &f, const float acc, const float v) {
    return f.skip ? acc : f.take ? v : fmaf(acc, f.fa, v * f.fv);
}

// meta as kernels.cu's paged attention (attention.cuh's header); masked sequences of at most
// MAX_NODES new tokens.
// grid (nh, n_seq, ceil(max_new / (16 · WARPS))), WARPS · 32 threads, dynamic shared memory
// smem_bytes<D, WARPS, STAGES>().
// SPLITS > 1: tile t belongs to split t mod SPLITS, a block of its own (grid.y = sequence ·
// SPLITS + split), which leaves its rows' states (o, m, l) in `part` for tc_merge to fold in
// split order; a decode step's row then walks its tiles on SPLITS multiprocessors.
// TRANSPOSED: a tree's tail P·V as (Vᵀ · Pᵀ) per row, d along the MMA's 16 rows and the
// row's P in every one of its 8 columns: 32 MMAs a row for d = 128 instead of 64, if the
// tensor cores sum a product's k the same whichever operand carries it (the bits check says).
template <int D, int WARPS, int STAGES, int SPLITS, bool TRANSPOSED = false>
__global__ void __launch_bounds__(WARPS * 32) tc_attention(const T *q, const T *k_pool, const T *v_pool, T *out,
                                                           float *part, const unsigned *meta, const int n_tok,
                                                           const int n_seq, const int lmax, const int nh,
                                                           const int nkv, const float scale) {
    static_assert(STAGES >= 2, "a tree's tail stages its 128 candidates in the first two stages");
    constexpr int ROWS = 16 * WARPS, PITCH = D + 8, CH = D / 8, KS = D / 16;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *ks = (T *)smem_raw;              // [STAGES][TILE][PITCH]
    T *vs = ks + STAGES * TILE * PITCH; // [STAGES][TILE][PITCH]
    const unsigned *seq_len = meta + n_tok, *seq_new = seq_len + n_seq, *q_start = seq_new + n_seq,
                   *mask_off = q_start + n_seq, *slots = mask_off + n_seq, *masks = slots + (size_t)n_seq * lmax;
    float *sw = (float *)(vs + STAGES * TILE * PITCH);            // [WARPS][16][SW_LD]: a warp's candidate scores
    unsigned char *vis = (unsigned char *)(sw + WARPS * 16 * SW_LD); // [WARPS][16][MAX_NODES]: rows' visible nodes
    int *lens = (int *)(vis + WARPS * 16 * MAX_NODES);              // [WARPS][16]: rows' list lengths
    const int h = blockIdx.x, s = blockIdx.y / SPLITS, split = blockIdx.y % SPLITS, g0 = blockIdx.z * ROWS;
    const int L = seq_len[s], n = seq_new[s], q0 = q_start[s];
    if (g0 >= n) return;
    const bool causal = mask_off[s] == 0xffffffffu;
    const int cached = L - n, kvh = h / (nh / nkv);
    const unsigned *list = slots + (size_t)s * lmax;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gq = lane >> 2, tq = lane & 3;
    const int wr = g0 + warp * 16; // the warp's first row
    const int r0 = wr + gq, r1 = r0 + 8;
    unsigned char *wvis = vis + warp * 16 * MAX_NODES;
    int *wlens = lens + warp * 16;
    // Each row's list length (and a tree row's visible nodes, in order).
    for (int i = 0; i < 16; ++i) {
        const int r = wr + i;
        int count = r < n ? r + 1 : 0;
        if (!causal && r < n) {
            const unsigned *mrow = masks + mask_off[s] + (size_t)r * n;
            count = 0;
            for (int j0 = 0; j0 < n; j0 += 32) {
                const bool on = j0 + lane < n && mrow[j0 + lane] != 0;
                const unsigned ballot = __ballot_sync(0xffffffffu, on);
                if (on) wvis[i * MAX_NODES + count + __popc(ballot & ((1u << lane) - 1u))] = (unsigned char)(j0 + lane);
                count += __popc(ballot);
            }
        }
        if (lane == 0) wlens[i] = r < n ? cached + count : 0;
    }
    __syncwarp();
    const int len0 = wlens[gq], len1 = wlens[gq + 8];
    int warp_len = 0;
    for (int i = 0; i < 16; ++i) warp_len = max(warp_len, wlens[i]);
    // The block's longest list (the rows' lengths grow with r in a chain; a tree's are ≤ L).
    const int max_len = causal ? cached + min(ROWS, n - g0) + g0 : L;
    // Tiles every row of the block has alike: all of a chain's, a tree's wholly cached ones.
    const int cbase = TILE * (cached / TILE);
    const int shared_tiles = causal ? (max_len + TILE - 1) / TILE : cbase / TILE;
    // This block's j-th tile: split + SPLITS · j.
    const int my_tiles = shared_tiles > split ? (shared_tiles - split + SPLITS - 1) / SPLITS : 0;

    auto load_tile = [&](const int j) {
        const int buf = j % STAGES, t = split + SPLITS * j;
        for (int i = threadIdx.x; i < TILE * CH; i += WARPS * 32) {
            const int row = i / CH, c = i % CH, pos = t * TILE + row;
            const bool ok = pos < max_len;
            const size_t src = ((size_t)(ok ? list[pos] : 0) * nkv + kvh) * D + c * 8;
            cp_async16_zfill(ks + (buf * TILE + row) * PITCH + c * 8, k_pool + src, ok);
            cp_async16_zfill(vs + (buf * TILE + row) * PITCH + c * 8, v_pool + src, ok);
        }
    };
#pragma unroll
    for (int t = 0; t < STAGES - 1; ++t) {
        if (t < my_tiles) load_tile(t);
        asm volatile("cp.async.commit_group;\n");
    }

    unsigned qa[KS][4];
    load_q<D>(qa, q, q0, r0, r1, n, nh, h, tq);
    float o[D / 8][4] = {};
    RowState st0, st1;
    const float sl2 = scale * 1.4426950408889634f;

    for (int j = 0; j < my_tiles; ++j) {
        if (j + STAGES - 1 < my_tiles) load_tile(j + STAGES - 1);
        asm volatile("cp.async.commit_group;\n");
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
        __syncthreads();
        const int base = (split + SPLITS * j) * TILE;
        if (base < warp_len) {
            shared_tile<D>(ks + (j % STAGES) * TILE * PITCH, vs + (j % STAGES) * TILE * PITCH, qa, o, base, lane,
                           len0, len1, sl2, st0, st1);
        }
        __syncthreads(); // the stage is refilled next round
    }
    // A tree's tail tiles run from cbase / TILE up to (at most) the sequence's L slots.
    int first_tail = cbase / TILE;
    first_tail += (split - first_tail % SPLITS + SPLITS) % SPLITS; // this split's first
    if (!causal && first_tail * TILE < L) {
        // The tail: candidates (cached slots from cbase, then the n nodes) into the stages.
        const int ntail = cached - cbase, ncand = ntail + n;
        asm volatile("cp.async.wait_group 0;\n");
        __syncthreads();
        for (int i = threadIdx.x; i < 2 * TILE * CH; i += WARPS * 32) {
            const int row = i / CH, c = i % CH;
            const bool ok = row < ncand;
            const unsigned slot = !ok ? 0u : row < ntail ? list[cbase + row] : list[cached + row - ntail];
            const size_t src = ((size_t)slot * nkv + kvh) * D + c * 8;
            cp_async16_zfill(ks + row * PITCH + c * 8, k_pool + src, ok);
            cp_async16_zfill(vs + row * PITCH + c * 8, v_pool + src, ok);
        }
        asm volatile("cp.async.commit_group;\n");
        asm volatile("cp.async.wait_group 0;\n");
        __syncthreads();
        float *wsw = sw + warp * 16 * SW_LD;
        for (int nt = 0; nt < 16 && nt * 8 < ncand; ++nt) {
            float acc[4];
            scores<D>(acc, qa, ks + nt * 8 * PITCH, lane);
            wsw[gq * SW_LD + nt * 8 + 2 * tq] = acc[0], wsw[gq * SW_LD + nt * 8 + 2 * tq + 1] = acc[1];
            wsw[(gq + 8) * SW_LD + nt * 8 + 2 * tq] = acc[2], wsw[(gq + 8) * SW_LD + nt * 8 + 2 * tq + 1] = acc[3];
        }
        __syncwarp();
        // A list position's candidate for row i of the warp (0 past its list: its P is 0).
        auto cand = [&](const int i, const int pos) {
            return pos < cached ? pos - cbase : pos < wlens[i] ? ntail + wvis[i * MAX_NODES + pos - cached] : 0;
        };
        for (int base = first_tail * TILE; base < warp_len; base += SPLITS * TILE) {
            float sc[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int pos = base + nt * 8 + 2 * tq + j;
                    sc[nt][j] = wsw[gq * SW_LD + cand(gq, pos)];
                    sc[nt][2 + j] = wsw[(gq + 8) * SW_LD + cand(gq + 8, pos)];
                }
            unsigned pa[4][4];
            float a0, a1;
            bool act0, act1;
            tile_softmax(sc, base, tq, len0, len1, sl2, st0, st1, pa, a0, a1, act0, act1);
            for (int i = 0; i < 16; ++i) {
                if (base >= wlens[i]) continue;
                const T *vrow[4]; // the V row this lane addresses for each k-step, in row i's list
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    vrow[k] = TRANSPOSED ? vs + cand(i, base + 16 * k + 8 * (lane >> 4) + (lane & 7)) * PITCH + 8 * ((lane >> 3) & 1)
                                         : vs + cand(i, base + 16 * k + 8 * ((lane >> 3) & 1) + (lane & 7)) * PITCH + 8 * (lane >> 4);
                unsigned bp[4][2]; // TRANSPOSED: row i's P as the B fragments, from the lanes that hold it
                if constexpr (TRANSPOSED) {
                    const int src = (i & 7) * 4 + tq;
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        bp[k][0] = __shfl_sync(0xffffffffu, i < 8 ? pa[k][0] : pa[k][1], src);
                        bp[k][1] = __shfl_sync(0xffffffffu, i < 8 ? pa[k][2] : pa[k][3], src);
                    }
                }
#pragma unroll
                for (int np = 0; np < D / 16; ++np) {
                    float pv[2][4];
                    if constexpr (TRANSPOSED) {
                        // Outputs 16np..16np + 15 of row i: lane (g, t) holds g and g + 8.
                        float ot[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (int k = 0; k < 4; ++k) {
                            unsigned a[4];
                            ldsm_x4_trans(a, vrow[k] + 16 * np);
                            mma16816<T>(ot, a, bp[k]);
                        }
                        // Into pv's layout: output 8j + 2tq + e sits in lane (2tq + e) · 4.
#pragma unroll
                        for (int e = 0; e < 2; ++e) {
                            const float lo = __shfl_sync(0xffffffffu, ot[0], (2 * tq + e) * 4);
                            const float hi = __shfl_sync(0xffffffffu, ot[2], (2 * tq + e) * 4);
                            pv[0][e] = pv[0][2 + e] = lo;
                            pv[1][e] = pv[1][2 + e] = hi;
                        }
                    } else {
                        pv_pair(pv, pa, vrow, np);
                    }
                    if (gq == (i & 7)) {
                        if (i < 8) accumulate<true, false>(o, np, pv, a0, a1, act0, act1);
                        else accumulate<false, true>(o, np, pv, a0, a1, act0, act1);
                    }
                }
            }
        }
    }
    if constexpr (SPLITS > 1) {
        // This split's states: o, then m and l, per (split, row, head).
        auto keep = [&](const int r, const RowState &st, const int half) {
            float *p = part + (((size_t)split * n_tok + q0 + r) * nh + h) * (D + 2);
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) p[nt * 8 + 2 * tq] = o[nt][2 * half], p[nt * 8 + 2 * tq + 1] = o[nt][2 * half + 1];
            if (tq == 0) p[D] = st.m, p[D + 1] = st.l;
        };
        if (r0 < n) keep(r0, st0, 0);
        if (r1 < n) keep(r1, st1, 1);
    } else {
        write_rows<D>(out, o, q0, r0, r1, n, nh, h, tq, st0.l, st1.l);
    }
}

// The splits' states of each (row, head) folded in split order (fold_factors), out = o / l.
// Grid (n_tok, nh), D threads.
template <int D, int SPLITS>
__global__ void tc_merge(const float *part, T *out, const int n_tok, const int nh) {
    const int r = blockIdx.x, h = blockIdx.y, e = threadIdx.x;
    auto at = [&](const int v) { return part + (((size_t)v * n_tok + r) * nh + h) * (D + 2); };
    float am = -INFINITY, al = 0.f, ao = 0.f;
#pragma unroll
    for (int v = 0; v < SPLITS; ++v) ao = fold_value(fold_factors(am, al, at(v)[D], at(v)[D + 1]), ao, at(v)[e]);
    out[((size_t)r * nh + h) * D + e] = __float2bfloat16_rn(ao / al);
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
    T *ks = (T *)smem_raw, *vs = ks + STAGES * TILE * PITCH;
    float *fo = (float *)(vs + STAGES * TILE * PITCH); // [WARPS][NO][32]: o values, a lane's
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
    const int max_len = cached + min(ROWS, n - g0) + g0, tiles = (max_len + TILE - 1) / TILE;
    // Tile t's K and V rows into stage `buf`, copied by `threads` threads from `first`.
    auto load = [&](const int t, const int buf, const int first, const int threads) {
        for (int i = first; i < TILE * CH; i += threads) {
            const int row = i / CH, c = i % CH, pos = t * TILE + row;
            const bool ok = pos < max_len;
            const size_t src = ((size_t)(ok ? list[pos] : 0) * nkv + kvh) * D + c * 8;
            cp_async16_zfill(ks + (buf * TILE + row) * PITCH + c * 8, k_pool + src, ok);
            cp_async16_zfill(vs + (buf * TILE + row) * PITCH + c * 8, v_pool + src, ok);
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
    load_q<D>(qa, q, q0, r0, r1, n, nh, h, tq);
    float o[D / 8][4] = {};
    RowState st0, st1;
    const float sl2 = scale * 1.4426950408889634f;
    float *my_o = fo + warp * NO * 32 + lane, *my_ml = fml + warp * 4 * 32 + lane;
    float am0 = -INFINITY, al0 = 0.f, am1 = -INFINITY, al1 = 0.f;

    if constexpr (SPLIT_WARPS) {
        for (int t = warp; t < tiles; t += FOLD_SPLITS) {
            load(t, warp, lane, 32);
            asm volatile("cp.async.wait_group 0;\n");
            __syncwarp();
            if (t * TILE < warp_len)
                shared_tile<D>(ks + warp * TILE * PITCH, vs + warp * TILE * PITCH, qa, o, t * TILE, lane, len0, len1,
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
            const Fold f0 = fold_factors(am0, al0, vml[0], vml[32]), f1 = fold_factors(am1, al1, vml[64], vml[96]);
#pragma unroll
            for (int i = 0; i < NO; ++i) o[i / 4][i % 4] = fold_value(i % 4 < 2 ? f0 : f1, o[i / 4][i % 4], vo[i * 32]);
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
            if (t * TILE < warp_len)
                shared_tile<D>(ks + (idx % 2) * TILE * PITCH, vs + (idx % 2) * TILE * PITCH, qa, o, t * TILE, lane,
                               len0, len1, sl2, st0, st1);
            if (--left == 0) { // split v ends: fold it, start the next from nothing
                const Fold f0 = fold_factors(am0, al0, st0.m, st0.l), f1 = fold_factors(am1, al1, st1.m, st1.l);
#pragma unroll
                for (int i = 0; i < NO; ++i) {
                    const float acc = v == 0 ? 0.f : my_o[i * 32];
                    my_o[i * 32] = fold_value(i % 4 < 2 ? f0 : f1, acc, o[i / 4][i % 4]);
                    o[i / 4][i % 4] = 0.f;
                }
                st0 = RowState{}, st1 = RowState{};
            }
            __syncthreads(); // the stage is refilled next round
        }
#pragma unroll
        for (int i = 0; i < NO; ++i) o[i / 4][i % 4] = my_o[i * 32];
    }
    write_rows<D>(out, o, q0, r0, r1, n, nh, h, tq, al0, al1);
}

template <int D, int WARPS, bool SPLIT_WARPS> constexpr size_t fold_smem_bytes() {
    return (size_t)2 * (SPLIT_WARPS ? FOLD_SPLITS : 2) * TILE * (D + 8) * sizeof(T) + WARPS * (D / 8 * 4 + 4) * 32 * 4;
}

template <int D, int WARPS, int STAGES> constexpr size_t smem_bytes() {
    return (size_t)2 * STAGES * TILE * (D + 8) * sizeof(T) + WARPS * 16 * (SW_LD * 4 + MAX_NODES + 4);
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

template <int D, int WARPS, int STAGES, int SPLITS = 1, bool TRANSPOSED = false> struct Tc {
    static void prepare() {
        CK(cudaFuncSetAttribute(tcp::tc_attention<D, WARPS, STAGES, SPLITS, TRANSPOSED>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, (int)tcp::smem_bytes<D, WARPS, STAGES>()));
    }
    // n new tokens in each of n_seq sequences of L slots (the table's rows).
    static void launch(const T *q, const T *kp, const T *vp, T *o, const unsigned *meta, int n, int L, int nh,
                       int nkv, float scale, int n_seq = 1) {
        tcp::tc_attention<D, WARPS, STAGES, SPLITS, TRANSPOSED>
            <<<dim3(nh, n_seq * SPLITS, (n + 16 * WARPS - 1) / (16 * WARPS)), WARPS * 32,
               tcp::smem_bytes<D, WARPS, STAGES>()>>>(q, kp, vp, o, g_part, meta, n * n_seq, n_seq, L, nh, nkv, scale);
        if constexpr (SPLITS > 1) tcp::tc_merge<D, SPLITS><<<dim3(n * n_seq, nh), D>>>(g_part, o, n * n_seq, nh);
    }
};

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
    Tc<D, 1, 2, 4>::launch(q, kps[0], vps[0], o, dmeta, 1, L, nh, nkv, scale, B);
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
    const float t_split = timer.us([&](int c) { Tc<D, 1, 2, 4>::launch(q, kps[c], vps[c], o, dmeta, 1, L, nh, nkv, scale, B); }, copies, 200);
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

template <int D> void run_shape(const char *name, const int nh, const int nkv, LaunchTimer &timer) {
    Tc<D, 4, 2>::prepare();
    Tc<D, 1, 2>::prepare();
    Tc<D, 4, 2, 4>::prepare();
    Tc<D, 1, 2, 4>::prepare();
    Fold<D, 4, true>::prepare();
    Fold<D, 4, false>::prepare();
    Tc<D, 4, 2, 1, true>::prepare();
    Tc<D, 4, 2, 4, true>::prepare();
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
        Tc<D, 4, 2>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        CK(cudaGetLastError());
        const std::vector<T> tc = fetch(o_tc, out_elems);
        Tc<D, 1, 2>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tc1 = fetch(o_tc, out_elems);
        Tc<D, 4, 2, 4>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tcs = fetch(o_tc, out_elems);
        Tc<D, 1, 2, 4>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
        const std::vector<T> tcs1 = fetch(o_tc, out_elems);
        CK(cudaGetLastError());
        // The one-launch 4-split forms (chains only) against the split blocks + tc_merge; a
        // tree's transposed tail against the plain one.
        size_t fold_differ = 0, transposed_differ = 0;
        if (!chain) {
            Tc<D, 4, 2, 1, true>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
            transposed_differ += count_differing(fetch(o_tc, out_elems).data(), tc.data(), out_elems);
            Tc<D, 4, 2, 4, true>::launch(q, kps[0], vps[0], o_tc, dmeta, n, L, nh, nkv, scale);
            transposed_differ += count_differing(fetch(o_tc, out_elems).data(), tcs.data(), out_elems);
            CK(cudaGetLastError());
        }
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
            Tc<D, 1, 2>::launch(qr, kps[0], vps[0], o_one, m1, 1, len, nh, nkv, scale);
            std::vector<T> one = fetch(o_one, (size_t)nh * D);
            alone_differ += count_differing(one.data(), tc.data() + (size_t)r * nh * D, (size_t)nh * D);
            Tc<D, 1, 2, 4>::launch(qr, kps[0], vps[0], o_one, m1, 1, len, nh, nkv, scale);
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
        const float t42 = timer.us([&](int c) { Tc<D, 4, 2>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t12 = timer.us([&](int c) { Tc<D, 1, 2>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t42s = timer.us([&](int c) { Tc<D, 4, 2, 4>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        const float t12s = timer.us([&](int c) { Tc<D, 1, 2, 4>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        float tfb = 0.f, tfa = 0.f, t42t = 0.f, t42st = 0.f;
        if (!chain) {
            t42t = timer.us([&](int c) { Tc<D, 4, 2, 1, true>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
            t42st = timer.us([&](int c) { Tc<D, 4, 2, 4, true>::launch(q, kps[c], vps[c], o_tc, dmeta, n, L, nh, nkv, scale); }, copies, 200);
        }
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
            d42 = timer.us([&](int c) { Tc<D, 4, 2>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
            d12s = timer.us([&](int c) { Tc<D, 1, 2, 4>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
            dfa = timer.us([&](int c) { Fold<D, 4, true>::launch(q, kps[c], vps[c], o_tc, mdec, 1, L, nh, nkv, scale); }, copies, 200);
        }
        CK(cudaGetLastError());
        printf("| %s | %s | %d | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
               "%.1f | %.1f | %zu | %zu | %zu | %zu | %zu | %.3g, %.3g of %.3g |\n",
               name, chain ? "chain" : "tree", past, t_rows, t_groups, t42, t12, t42s, t12s, tfb, tfa, t42t, t42st,
               d_rows, d42, d12s, dfa, warps_differ, alone_differ, alone_split_differ, fold_differ, transposed_differ,
               worst, worst_split, mag);
        CK(cudaFree(mdec));
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
           "alone (a decode step of their token) unlike the 64-row launch's, one split and four; of the fold forms (the 64 rows, and each row alone in fold warps) unlike s4's; of the transposed tree tails (T) unlike the plain ones; diff: against the "
           "runtime's kernel\n",
           prop.name);
    printf("| shape | new | past | rows | groups | tc4×2 | tc1×2 | tc4×2 s4 | tc1×2 s4 | fold | fold warps | tc4×2 T | tc4×2 s4 T | "
           "decode rows | decode tc4×2 | decode tc1×2 s4 | decode fold warps | bits warps | bits alone | bits alone s4 | "
           "bits fold | bits T | diff, s4 |\n");
    CK(cudaMalloc(&g_part, (size_t)4 * 64 * 32 * (128 + 2) * sizeof(float)));
    run_shape<128>("llama2-7b", 32, 32, timer);
    run_shape<64>("smollm2-135m", 9, 3, timer);
    printf("\nA decode step of 16 sequences (K/V from DRAM), us a launch; bits: fold warps' outputs unlike the split "
           "blocks' (must be 0)\n| shape | past | rows (runtime) | rows, many (runtime) | tc1×2 s4 | fold warps | bits |\n");
    for (const std::string &line : g_batch_lines) printf("%s\n", line.c_str());
    return 0;
}

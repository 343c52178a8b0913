// ---------------------------------------------------------------------------------------
// Paged attention on the tensor cores (included by kernels.cu after attention.cuh, whose
// header describes q, the pools, `meta` and the rows' lists; f16 and bf16, heads of 64 and
// 128).
//
// Why: the scalar kernels (attention.cuh) score and sum with FMAs, a (row, head) at a time or
// four rows sharing staged chunks; a 64-row Llama-2-7B verification spent 1.40 ms of 7.86 in
// them on an H100 (44 µs a layer against a decode step's 8; docs/gpu-results.md, session
// 59). Here a warp takes 16 query rows of one head (a block WARPS warps), stages tiles of 64
// K and V rows once in shared memory for all of them (cp.async, two tiles in flight), and
// scores and sums them on mma.sync.m16n8k16 (16-bit in, f32 accumulators), flash-attention
// style: S = q·Kᵀ over d in order, each row's online softmax a tile at a time (base 2), P
// rounded to T, O = O·alpha + P·V.
//
// The runtime's rule holds: the order of every sum of a row depends only on its list of
// slots, never on the launch (tools/gpu/tc_attn_probe.cu checks it row by row, chains and
// trees, and so do the GPU tests). Tile t is list positions [64t, 64t + 64); positions past
// the row's length score -inf (P = 0, the same bits whether the staged V row there is a later
// token's or zeros), and a tile wholly past them leaves the row's state untouched. A tree's
// rows see different new slots at the same list positions, so only a masked sequence's wholly
// cached tiles are shared; its tail (the cached slots of the first tile not wholly cached,
// then every node: at most 127 candidates with TC_MAX_NODES nodes) is staged once, scored
// against all candidates, each row's scores gathered into its list order, and P·V run once
// per row of the warp with the V fragments gathered by ldmatrix's per-lane row addresses (16
// rows' worth of MMAs, one row kept).
//
// SPLITS > 1: tile t belongs to split t mod SPLITS, a block of its own, which leaves its
// rows' states (o, m, l) in `part`; tc_merge folds them in split order. On compute capability
// 9.0 and later the split blocks of a (head, sequence, 64 rows) can form a cluster instead,
// each folding a quarter of the rows' values from the four blocks' shared memory in the same
// order (one launch, no scratch buffer, the same bits; cuda.rs says when). Every step takes
// TC_SPLITS (long lists then walk on several multiprocessors); a row gets the same bits from
// any warp count and in any step.
// ---------------------------------------------------------------------------------------
#define TC_TILE 64
// Most new tokens of a masked (tree) sequence (TC_MAX_MASKED_NEW in lib.rs).
#define TC_MAX_NODES 64
// The split count of steps that are not prompts (TC_SPLITS in lib.rs).
#define TC_SPLITS 4
// Tiles in flight; a tree's tail holds its up to 127 candidates in the first two stages.
#define TC_STAGES 2
// A warp's candidate scores, row pitch.
#define TC_SW_LD (2 * TC_TILE + 4)

// Diagnostic builds only (tools/gpu/tc_attn_probe.cu defines TC_TIMELINE, the most blocks it
// records; the runtime never does): thread 0 of each block stamps its multiprocessor's clock
// at the end of each phase (TcPhase) into tc_timeline, so a probe can say where a cluster's
// blocks spend their time and which one the others wait for (ncu's samples say what each
// instruction waits on, not which block holds the cluster's barrier).
enum TcPhase { TC_START, TC_SETUP, TC_CACHED, TC_TAIL_STAGED, TC_TAIL_SCORED, TC_TAIL, TC_BARRIER, TC_FOLD, TC_PHASES };
#ifdef TC_TIMELINE
__device__ long long tc_timeline[TC_TIMELINE][TC_PHASES];
__device__ __forceinline__ void tc_mark(const TcPhase phase) {
    const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    if (threadIdx.x == 0 && b < TC_TIMELINE) tc_timeline[b][phase] = clock64();
}
#else
__device__ __forceinline__ void tc_mark(const TcPhase) {}
#endif

__device__ __forceinline__ void cp_async16_zfill(void *smem, const void *gmem, const bool ok) {
    const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
                 "r"(ok ? 16 : 0));
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

template <typename T> __device__ __forceinline__ unsigned pack2(const T lo, const T hi) {
    return (unsigned)*reinterpret_cast<const unsigned short *>(&lo) |
           ((unsigned)*reinterpret_cast<const unsigned short *>(&hi) << 16);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 1));
    return fmaxf(v, __shfl_xor_sync(FULL_MASK, v, 2));
}

__device__ __forceinline__ float quad_sum(float v) {
    v += __shfl_xor_sync(FULL_MASK, v, 1);
    return v + __shfl_xor_sync(FULL_MASK, v, 2);
}

// One query row's softmax state: running max (scaled by log2 e), running sum.
struct TcRow {
    float m = -INFINITY, l = 0.f;
};

// Scores of one row (its 16 values a lane: 8 column tiles × 2) → P (as the P·V product's A
// fragment halves `pa[k][half]`), the rescale factor of its accumulator, the state updated.
// `sc` holds q·k; positions at or past `len` score -inf.
template <typename T>
__device__ __forceinline__ float tc_row_softmax(float (&sc)[8][2], const int base, const int col0,
                                                const int len, const float sl2, TcRow &st,
                                                unsigned (&pa)[4][2], bool &active) {
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
        const T p0 = from_f<T>(exp2f(sc[nt][0] - off)), p1 = from_f<T>(exp2f(sc[nt][1] - off));
        sum += to_f(p0);
        sum += to_f(p1);
        pa[nt / 2][nt % 2] = pack2(p0, p1);
    }
    sum = quad_sum(sum);
    if (active) {
        st.l = fmaf(st.l, alpha, sum);
        st.m = mn;
    }
    return alpha;
}

// acc (8 slots × this lane's 4 outputs) = q·k over d in order, the 8 K rows at `k8` (pitch
// d + 8) in shared memory.
template <typename T, int D>
__device__ __forceinline__ void tc_scores(float (&acc)[4], const unsigned (&qa)[D / 16][4],
                                          const T *k8, const int lane) {
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
template <typename T>
__device__ __forceinline__ void tc_tile_softmax(float (&sc)[8][4], const int base, const int tq,
                                                const int len0, const int len1, const float sl2,
                                                TcRow &st0, TcRow &st1, unsigned (&pa)[4][4],
                                                float &a0, float &a1, bool &act0, bool &act1) {
    float s0[8][2], s1[8][2];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
        s0[nt][0] = sc[nt][0], s0[nt][1] = sc[nt][1];
        s1[nt][0] = sc[nt][2], s1[nt][1] = sc[nt][3];
    }
    unsigned p0[4][2], p1[4][2];
    a0 = tc_row_softmax<T>(s0, base, 2 * tq, len0, sl2, st0, p0, act0);
    a1 = tc_row_softmax<T>(s1, base, 2 * tq, len1, sl2, st1, p1, act1);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        pa[k][0] = p0[k][0], pa[k][1] = p1[k][0];
        pa[k][2] = p0[k][1], pa[k][3] = p1[k][1];
    }
}

// o = o · alpha + P·V for the output pair np of the lane's first row where take0 and of its
// second where take1 (a row with positions in the tile; one past its list keeps its state).
// Selects, not branches: a branch between output pairs made each pair's MMAs wait for the
// pair before it (the tree tail's per-row passes, where lanes disagree on take).
template <int N>
__device__ __forceinline__ void tc_accumulate(float (&o)[N][4], const int np,
                                              const float (&pv)[2][4], const float a0,
                                              const float a1, const bool take0, const bool take1) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        float *oj = o[2 * np + j];
        oj[0] = take0 ? fmaf(oj[0], a0, pv[j][0]) : oj[0];
        oj[1] = take0 ? fmaf(oj[1], a0, pv[j][1]) : oj[1];
        oj[2] = take1 ? fmaf(oj[2], a1, pv[j][2]) : oj[2];
        oj[3] = take1 ? fmaf(oj[3], a1, pv[j][3]) : oj[3];
    }
}

// The lane's share of Q's A fragments (rows r0 and r1 = r0 + 8 of the sequence whose first
// query token is q0; zeros past its n rows), k-steps of 16 along d.
template <typename T, int D>
__device__ __forceinline__ void tc_load_q(unsigned (&qa)[D / 16][4], const T *q, const int q0,
                                          const int r0, const int r1, const int n, const int nh,
                                          const int h, const int tq) {
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
template <typename T, int D>
__device__ __forceinline__ void tc_write_rows(T *out, const float (&o)[D / 8][4], const int q0,
                                              const int r0, const int r1, const int n,
                                              const int nh, const int h, const int tq,
                                              const float l0, const float l1) {
#pragma unroll
    for (int nt = 0; nt < D / 8; ++nt) {
        const int c = nt * 8 + 2 * tq;
        if (r0 < n)
            *(unsigned *)(out + ((size_t)(q0 + r0) * nh + h) * D + c) =
                pack2(from_f<T>(o[nt][0] / l0), from_f<T>(o[nt][1] / l0));
        if (r1 < n)
            *(unsigned *)(out + ((size_t)(q0 + r1) * nh + h) * D + c) =
                pack2(from_f<T>(o[nt][2] / l1), from_f<T>(o[nt][3] / l1));
    }
}

// pv = P · V for the output pairs 2np and 2np + 1: P as A fragments (4 k-steps of 16 list
// positions), V through the lane's row addresses `vrow` (one a k-step).
template <typename T>
__device__ __forceinline__ void tc_pv_pair(float (&pv)[2][4], const unsigned (&pa)[4][4],
                                           const T *const (&vrow)[4], const int np) {
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
template <typename T, int D>
__device__ __forceinline__ void tc_shared_tile(const T *kt, const T *vt,
                                               const unsigned (&qa)[D / 16][4],
                                               float (&o)[D / 8][4], const int base,
                                               const int lane, const int len0, const int len1,
                                               const float sl2, TcRow &st0, TcRow &st1) {
    constexpr int PITCH = D + 8;
    float sc[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) tc_scores<T, D>(sc[nt], qa, kt + nt * 8 * PITCH, lane);
    unsigned pa[4][4];
    float a0, a1;
    bool act0, act1;
    tc_tile_softmax<T>(sc, base, lane & 3, len0, len1, sl2, st0, st1, pa, a0, a1, act0, act1);
    const T *vrow[4]; // the V row this lane addresses for each k-step
#pragma unroll
    for (int k = 0; k < 4; ++k)
        vrow[k] = vt + (16 * k + 8 * ((lane >> 3) & 1) + (lane & 7)) * PITCH + 8 * (lane >> 4);
#pragma unroll
    for (int np = 0; np < D / 16; ++np) {
        float pv[2][4];
        tc_pv_pair<T>(pv, pa, vrow, np);
        tc_accumulate(o, np, pv, a0, a1, act0, act1);
    }
}

// The splits' states folded in split order, one after another (every form folds so, and so
// gives a row the same bits): acc ⊕ (o, m, l). tc_fold_factors updates acc's m and l and
// says how its o values change (tc_fold_value).
struct TcFold {
    float fa, fv;
    bool skip, take;
};
__device__ __forceinline__ TcFold tc_fold_factors(float &am, float &al, const float m,
                                                  const float l) {
    TcFold f{1.f, 1.f, false, false};
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
__device__ __forceinline__ float tc_fold_value(const TcFold &f, const float acc, const float v) {
    return f.skip ? acc : f.take ? v : fmaf(acc, f.fa, v * f.fv);
}

// Dynamic shared memory of tc_attention (tc_attention_shared_bytes in lib.rs): the stages,
// then each warp's candidate scores, its rows' visible nodes and list lengths.
template <typename T, int D, int WARPS> constexpr size_t tc_smem_bytes() {
    return (size_t)2 * TC_STAGES * TC_TILE * (D + 8) * sizeof(T) +
           WARPS * 16 * (TC_SW_LD * 4 + TC_MAX_NODES + 4);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The cluster's barrier (arrive with release, wait with acquire: shared-memory writes before
// it are visible to every block of the cluster after it).
__device__ __forceinline__ void tc_cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// `local`'s offset in the shared memory of the cluster's block of rank `rank`.
template <typename V> __device__ __forceinline__ const V *tc_remote(const V *local, const int rank) {
    unsigned long long remote;
    asm("mapa.u64 %0, %1, %2;" : "=l"(remote) : "l"(local), "r"(rank));
    return reinterpret_cast<const V *>(remote);
}
#endif

// grid (nh, n_seq · SPLITS, ceil(max_new / (16 · WARPS))), WARPS · 32 threads, dynamic shared
// memory tc_smem_bytes<T, D, WARPS>(); masked sequences of at most TC_MAX_NODES new tokens.
// SPLITS > 1: grid.y = sequence · SPLITS + split; the block leaves its rows' states in
// `part` ([SPLITS][n_tok][nh][D + 2]: o, then m and l) for tc_merge, or, CLUSTER (clusters
// of SPLITS blocks along y, so a block's rank is its split), in its shared memory for the
// cluster's blocks to fold together.
template <typename T, int D, int WARPS, int SPLITS, bool CLUSTER = false>
__device__ __forceinline__ void tc_attention(const T *q, const T *k_pool, const T *v_pool, T *out,
                                             float *part, const unsigned *meta, const int n_tok,
                                             const int n_seq, const int lmax, const int nh,
                                             const int nkv, const float scale) {
    constexpr int ROWS = 16 * WARPS, PITCH = D + 8, CH = D / 8, KS = D / 16, TILE = TC_TILE;
    constexpr int STAGES = TC_STAGES;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    T *ks = (T *)smem_raw;              // [STAGES][TILE][PITCH]
    T *vs = ks + STAGES * TILE * PITCH; // [STAGES][TILE][PITCH]
    const PaTable tab(meta, n_tok, n_seq, lmax);
    float *sw = (float *)(vs + STAGES * TILE * PITCH);              // [WARPS][16][TC_SW_LD]
    unsigned char *vis = (unsigned char *)(sw + WARPS * 16 * TC_SW_LD); // [WARPS][16][TC_MAX_NODES]
    int *lens = (int *)(vis + WARPS * 16 * TC_MAX_NODES);              // [WARPS][16]
    const int h = blockIdx.x, s = blockIdx.y / SPLITS, split = blockIdx.y % SPLITS;
    const int g0 = blockIdx.z * ROWS;
    const int L = tab.seq_len[s], n = tab.seq_new[s], q0 = tab.q_start[s];
    if (g0 >= n) return; // a cluster's blocks share s and g0: they return together
    tc_mark(TC_START);
    const bool causal = tab.mask_off[s] == PA_CAUSAL;
    const int cached = L - n, kvh = h / (nh / nkv);
    const unsigned *list = tab.slots + (size_t)s * lmax;
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP, gq = lane >> 2, tq = lane & 3;
    const int wr = g0 + warp * 16; // the warp's first row
    const int r0 = wr + gq, r1 = r0 + 8;
    // The block's longest list (a chain's rows' lengths grow with r; a tree's are ≤ L).
    const int max_len = causal ? cached + min(ROWS, n - g0) + g0 : L;
    // Tiles every row of the block has alike: all of a chain's, a tree's wholly cached ones.
    const int cbase = TILE * (cached / TILE);
    const int shared_tiles = causal ? (max_len + TILE - 1) / TILE : cbase / TILE;
    // This block's j-th tile: split + SPLITS · j.
    const int my_tiles =
        shared_tiles > split ? (shared_tiles - split + SPLITS - 1) / SPLITS : 0;

    auto load_tile = [&](const int j) {
        const int buf = j % STAGES, t = split + SPLITS * j;
        for (int i = threadIdx.x; i < TILE * CH; i += WARPS * WARP) {
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

    unsigned char *wvis = vis + warp * 16 * TC_MAX_NODES;
    int *wlens = lens + warp * 16;
    // Each row's list length (and a tree row's visible nodes, in order), read while the first
    // tiles load. A tree's rows' mask words (n ≤ TC_MAX_NODES: two a lane) are loaded four
    // rows at a time before any of them is counted: the warp waits on memory four times, not
    // sixteen (all sixteen rows at once cost the one-row kernels registers they spill).
    static_assert(TC_MAX_NODES <= 2 * WARP, "a tree row's mask is two words a lane");
    constexpr int MASK_ROWS = 4;
    for (int i0 = 0; i0 < 16; i0 += MASK_ROWS) {
        bool on[MASK_ROWS][2];
#pragma unroll
        for (int ii = 0; ii < MASK_ROWS; ++ii) {
            const int r = wr + i0 + ii;
            const unsigned *mrow = tab.masks + (causal ? 0 : tab.mask_off[s] + (size_t)r * n);
#pragma unroll
            for (int half = 0; half < 2; ++half) {
                const int j = half * WARP + lane;
                on[ii][half] = !causal && r < n && j < n && mrow[j] != 0;
            }
        }
#pragma unroll
        for (int ii = 0; ii < MASK_ROWS; ++ii) {
            const int i = i0 + ii, r = wr + i;
            int count = r + 1;
            if (!causal) {
                count = 0;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    const unsigned ballot = __ballot_sync(FULL_MASK, on[ii][half]);
                    if (on[ii][half])
                        wvis[i * TC_MAX_NODES + count + __popc(ballot & ((1u << lane) - 1u))] =
                            (unsigned char)(half * WARP + lane);
                    count += __popc(ballot);
                }
            }
            if (lane == 0) wlens[i] = r < n ? cached + count : 0;
        }
    }
    __syncwarp();
    const int len0 = wlens[gq], len1 = wlens[gq + 8];
    int warp_len = 0;
    for (int i = 0; i < 16; ++i) warp_len = max(warp_len, wlens[i]);

    unsigned qa[KS][4];
    tc_load_q<T, D>(qa, q, q0, r0, r1, n, nh, h, tq);
    float o[D / 8][4] = {};
    TcRow st0, st1;
    const float sl2 = scale * 1.4426950408889634f;

    tc_mark(TC_SETUP);
    for (int j = 0; j < my_tiles; ++j) {
        if (j + STAGES - 1 < my_tiles) load_tile(j + STAGES - 1);
        asm volatile("cp.async.commit_group;\n");
        asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 1));
        __syncthreads();
        const int base = (split + SPLITS * j) * TILE;
        if (base < warp_len)
            tc_shared_tile<T, D>(ks + (j % STAGES) * TILE * PITCH, vs + (j % STAGES) * TILE * PITCH,
                                 qa, o, base, lane, len0, len1, sl2, st0, st1);
        __syncthreads(); // the stage is refilled next round
    }
    tc_mark(TC_CACHED);
    // A tree's tail tiles run from cbase / TILE up to (at most) the sequence's L slots.
    int first_tail = cbase / TILE;
    first_tail += (split - first_tail % SPLITS + SPLITS) % SPLITS; // this split's first
    if (!causal && first_tail * TILE < L) {
        // The tail: candidates (cached slots from cbase, then the n nodes) into the stages.
        const int ntail = cached - cbase, ncand = ntail + n;
        asm volatile("cp.async.wait_group 0;\n");
        __syncthreads();
        for (int i = threadIdx.x; i < 2 * TILE * CH; i += WARPS * WARP) {
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
        tc_mark(TC_TAIL_STAGED);
        float *wsw = sw + warp * 16 * TC_SW_LD;
        for (int nt = 0; nt < 16 && nt * 8 < ncand; ++nt) {
            float acc[4];
            tc_scores<T, D>(acc, qa, ks + nt * 8 * PITCH, lane);
            wsw[gq * TC_SW_LD + nt * 8 + 2 * tq] = acc[0];
            wsw[gq * TC_SW_LD + nt * 8 + 2 * tq + 1] = acc[1];
            wsw[(gq + 8) * TC_SW_LD + nt * 8 + 2 * tq] = acc[2];
            wsw[(gq + 8) * TC_SW_LD + nt * 8 + 2 * tq + 1] = acc[3];
        }
        __syncwarp();
        tc_mark(TC_TAIL_SCORED);
        // A list position's candidate for row i of the warp (0 past its list: its P is 0).
        auto cand = [&](const int i, const int pos) {
            return pos < cached ? pos - cbase
                   : pos < wlens[i] ? ntail + wvis[i * TC_MAX_NODES + pos - cached]
                                    : 0;
        };
        for (int base = first_tail * TILE; base < warp_len; base += SPLITS * TILE) {
            float sc[8][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int j = 0; j < 2; ++j) {
                    const int pos = base + nt * 8 + 2 * tq + j;
                    sc[nt][j] = wsw[gq * TC_SW_LD + cand(gq, pos)];
                    sc[nt][2 + j] = wsw[(gq + 8) * TC_SW_LD + cand(gq + 8, pos)];
                }
            unsigned pa[4][4];
            float a0, a1;
            bool act0, act1;
            tc_tile_softmax<T>(sc, base, tq, len0, len1, sl2, st0, st1, pa, a0, a1, act0, act1);
            // The list positions of the V rows this lane addresses in each k-step; row i's
            // candidates for them come from its length and visible nodes, read a row ahead with
            // no branch (a node index clamped into the row's slots, unused past its list), so that
            // the next row's shared-memory reads overlap this row's MMAs.
            int kpos[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) kpos[k] = base + 16 * k + 8 * ((lane >> 3) & 1) + (lane & 7);
            auto read_row = [&](int &len, int (&node)[4], const int i) {
                len = wlens[i];
#pragma unroll
                for (int k = 0; k < 4; ++k)
                    node[k] = wvis[i * TC_MAX_NODES + min(max(kpos[k] - cached, 0), TC_MAX_NODES - 1)];
            };
            int len;
            int node[4];
            read_row(len, node, 0);
            for (int i = 0; i < 16; ++i) {
                int next_len;
                int next_node[4];
                read_row(next_len, next_node, min(i + 1, 15));
                if (base < len) {
                    // Row i is the lane's first row (i < 8) or its second, for the lanes of group i mod 8.
                    const bool take0 = act0 && gq == i, take1 = act1 && gq + 8 == i;
                    const T *vrow[4];
#pragma unroll
                    for (int k = 0; k < 4; ++k) {
                        const int c = kpos[k] < cached ? kpos[k] - cbase : kpos[k] < len ? ntail + node[k] : 0;
                        vrow[k] = vs + c * PITCH + 8 * (lane >> 4);
                    }
#pragma unroll
                    for (int np = 0; np < D / 16; ++np) {
                        float pv[2][4];
                        tc_pv_pair<T>(pv, pa, vrow, np);
                        tc_accumulate(o, np, pv, a0, a1, take0, take1);
                    }
                }
                len = next_len;
#pragma unroll
                for (int k = 0; k < 4; ++k) node[k] = next_node[k];
            }
        }
    }
    tc_mark(TC_TAIL);
    if constexpr (SPLITS > 1 && CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // This split's states of the block's rows ([ROWS][D + 4]: o, then m and l; rows 16-byte
        // aligned) over the stages, which every warp is done with.
        constexpr int SP = D + 4;
        asm volatile("cp.async.wait_group 0;\n");
        __syncthreads();
        static_assert(ROWS * SP * 4 <= 2 * STAGES * TILE * PITCH * sizeof(T), "the states fit the stages");
        float *states = (float *)smem_raw;
        auto keep = [&](const int i, const TcRow &st, const int half) {
            float *p = states + (size_t)i * SP;
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                p[nt * 8 + 2 * tq] = o[nt][2 * half];
                p[nt * 8 + 2 * tq + 1] = o[nt][2 * half + 1];
            }
            if (tq == 0) p[D] = st.m, p[D + 1] = st.l;
        };
        if (r0 < n) keep(warp * 16 + gq, st0, 0);
        if (r1 < n) keep(warp * 16 + gq + 8, st1, 1);
        tc_cluster_sync();
        tc_mark(TC_BARRIER);
        // tc_merge's fold, shared by the cluster's blocks: item it (4 values of row it / (D / 4))
        // goes to the block of rank it mod SPLITS, which reads every split's state where it is.
        const int items = min(ROWS, n - g0) * (D / 4);
        for (int it = split + SPLITS * threadIdx.x; it < items; it += SPLITS * WARPS * WARP) {
            const int i = it / (D / 4), c = 4 * (it % (D / 4));
            const float *p = states + (size_t)i * SP;
            float2 ml[SPLITS];
            float4 ov[SPLITS];
#pragma unroll
            for (int v = 0; v < SPLITS; ++v) {
                ml[v] = *tc_remote(reinterpret_cast<const float2 *>(p + D), v);
                ov[v] = *tc_remote(reinterpret_cast<const float4 *>(p + c), v);
            }
            float am = -INFINITY, al = 0.f, ao[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
            for (int v = 0; v < SPLITS; ++v) {
                const TcFold f = tc_fold_factors(am, al, ml[v].x, ml[v].y);
                ao[0] = tc_fold_value(f, ao[0], ov[v].x);
                ao[1] = tc_fold_value(f, ao[1], ov[v].y);
                ao[2] = tc_fold_value(f, ao[2], ov[v].z);
                ao[3] = tc_fold_value(f, ao[3], ov[v].w);
            }
            uint2 packed;
            packed.x = pack2(from_f<T>(ao[0] / al), from_f<T>(ao[1] / al));
            packed.y = pack2(from_f<T>(ao[2] / al), from_f<T>(ao[3] / al));
            *reinterpret_cast<uint2 *>(out + ((size_t)(q0 + g0 + i) * nh + h) * D + c) = packed;
        }
        tc_mark(TC_FOLD);
        tc_cluster_sync(); // the others' shared memory stays until it has been read
#endif
    } else if constexpr (SPLITS > 1) {
        // This split's states: o, then m and l, per (split, row, head).
        auto keep = [&](const int r, const TcRow &st, const int half) {
            float *p = part + (((size_t)split * n_tok + q0 + r) * nh + h) * (D + 2);
#pragma unroll
            for (int nt = 0; nt < D / 8; ++nt) {
                p[nt * 8 + 2 * tq] = o[nt][2 * half];
                p[nt * 8 + 2 * tq + 1] = o[nt][2 * half + 1];
            }
            if (tq == 0) p[D] = st.m, p[D + 1] = st.l;
        };
        if (r0 < n) keep(r0, st0, 0);
        if (r1 < n) keep(r1, st1, 1);
    } else {
        tc_write_rows<T, D>(out, o, q0, r0, r1, n, nh, h, tq, st0.l, st1.l);
    }
}

// The splits' states of each (row, head) folded in split order, out = o / l. Grid (n_tok,
// nh), D threads.
template <typename T, int D, int SPLITS>
__device__ __forceinline__ void tc_merge(const float *part, T *out, const int n_tok, const int nh) {
    const int r = blockIdx.x, h = blockIdx.y, e = threadIdx.x;
    auto at = [&](const int v) { return part + (((size_t)v * n_tok + r) * nh + h) * (D + 2); };
    float am = -INFINITY, al = 0.f, ao = 0.f;
#pragma unroll
    for (int v = 0; v < SPLITS; ++v)
        ao = tc_fold_value(tc_fold_factors(am, al, at(v)[D], at(v)[D + 1]), ao, at(v)[e]);
    out[((size_t)r * nh + h) * D + e] = from_f<T>(ao / al);
}

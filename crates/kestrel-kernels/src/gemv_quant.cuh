// The gemv of a self-draft that reads the target's weights at 4 or 8 bits (kestrel-model's
// matvec_quant.rs has the layout and the why): y [M, N] = x [M, K] · wᵀ, each weight row in
// blocks of 32 along K, a block a scale d and a minimum m (f16, interleaved here: dm[row][b]
// = (d, m)) and 32 codes q, the weight being d·q + m. At 4 bits a pair of blocks is 32 bytes,
// byte i holding element i of the first block in its low nibble and element i of the second
// in its high one; at 8 bits a pair is its 64 codes in order.
//
// As on the CPU, each input row is quantized per block of 32 (dx = max|x| / 127, xq =
// round(x / dx) in -127..127, and the block's sum sx for the minimums), so that a block's
// products are integers `dp4a` takes four at a time: Σ w·x ≈ d·dx·Σ q·xq + m·sx. The draft's
// numbers need not match anything (the target verifies every draft); the same quantized
// inputs keep the CUDA and CPU copies within f32 rounding of each other.
//
// Work: a block's warps first quantize its QG_ROWS input rows into shared memory; then each
// warp takes COLS output columns at a time (1, 2 or 4, a template parameter), its lanes
// reading the weight rows 16 bytes at a time, QG_LOADS loads a pass (QG_LOADS / COLS pieces
// of each column), the next pass requested before the current one's arithmetic. The columns
// of a pass share each piece's staged inputs: a row's shared-memory reads, the largest part
// of a piece's instructions, are paid once for COLS columns (one column a warp at a time
// left the kernel bound by those instructions, not by its bytes: a draft step of two rows
// cost ~1.7 times one of a row). blockIdx.x is the row group and blockIdx.y the column group, so
// the blocks that read the same weights for other rows are scheduled side by side and share
// them through L2: a step of many rows still reads its weights from memory about once.

#define QG_WARPS 8
#define QG_ROWS 2
#define QG_LOADS 4
#define QG_BLOCK 32

extern __shared__ __align__(16) unsigned char qg_stage[];

// Σ of four u8 × s8 products plus c (the 8-bit codes are unsigned, the inputs signed).
__device__ __forceinline__ int dp4a_us(const unsigned a, const int b, const int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// A row group's inputs, quantized per block of 32 into `qg_stage`: xq [QG_ROWS][K] (i8), then
// dx and sx [QG_ROWS][K / 32] (f32). Each thread takes 16-byte vectors of the rows (the rows
// are contiguous, so the group is one run of rows·K inputs), QG_STAGE_LOADS loads in flight
// before any arithmetic: a block of 32 inputs is 32 / VEC consecutive threads, which share its
// maximum and sum by shuffles. (One warp a block, a load at a time, cost the draft step more
// than its weights: a round trip to memory for every 32 inputs.) Only the loads a thread has
// are unrolled into work: every block stages the whole row, so a row of 4,096 bf16 inputs
// (two vectors a thread) run through all QG_STAGE_LOADS slots was three quarters of a
// Llama-2-7B o projection's instructions (Nsight Compute, session 37). The count is the
// same for the whole block, so a warp's lanes never part around the shuffles.
#define QG_STAGE_LOADS 8
template <typename T>
__device__ void gemv_quant_stage_rows(const T *__restrict__ x, const int rows, const int K) {
    constexpr int VEC = 16 / sizeof(T), TPB = QG_BLOCK / VEC;
    const int nvec = rows * K / VEC;
    signed char *xq = reinterpret_cast<signed char *>(qg_stage);
    float *dx = reinterpret_cast<float *>(qg_stage + QG_ROWS * K);
    float *sx = dx + QG_ROWS * (K / QG_BLOCK);
    for (int base = 0; base < nvec; base += QG_STAGE_LOADS * blockDim.x) {
        // The block's loads this round, the same for every thread.
        const int loads = min(QG_STAGE_LOADS, (nvec - base + blockDim.x - 1) / blockDim.x);
        uint4 raw[QG_STAGE_LOADS];
#pragma unroll
        for (int u = 0; u < QG_STAGE_LOADS; ++u) {
            const int v = base + u * blockDim.x + threadIdx.x;
            raw[u] = u < loads && v < nvec ? *reinterpret_cast<const uint4 *>(x + (size_t)v * VEC)
                                           : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < QG_STAGE_LOADS; ++u) {
            if (u >= loads) break;
            const int v = base + u * blockDim.x + threadIdx.x;
            float f[VEC];
            unpack16<T>(raw[u], f);
            float amax = 0.f, sum = 0.f;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                amax = fmaxf(amax, fabsf(f[e]));
                sum += f[e];
            }
#pragma unroll
            for (int o = 1; o < TPB; o <<= 1) {
                amax = fmaxf(amax, __shfl_xor_sync(FULL_MASK, amax, o));
                sum += __shfl_xor_sync(FULL_MASK, sum, o);
            }
            const float d = amax / 127.f;
            const float inv = d > 0.f ? 1.f / d : 0.f;
            if (v < nvec) {
                unsigned packed[VEC / 4];
#pragma unroll
                for (int w = 0; w < VEC / 4; ++w) {
                    unsigned word = 0;
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        word |= (unsigned)(unsigned char)(signed char)__float2int_rn(f[4 * w + e] * inv)
                                << (8 * e);
                    packed[w] = word;
                }
                if (VEC == 8)
                    *reinterpret_cast<uint2 *>(xq + (size_t)v * VEC) = make_uint2(packed[0], packed[VEC / 8]);
                else
                    *reinterpret_cast<unsigned *>(xq + (size_t)v * VEC) = packed[0];
                if (threadIdx.x % TPB == 0) {
                    dx[v / TPB] = d;
                    sx[v / TPB] = sum;
                }
            }
        }
    }
}

// One lane's share of piece `c` (16 bytes of a weight row) of each of COLS columns, their codes
// in `q` and the (d, m) pairs of their blocks in `dm_raw` (both at 4 bits, the one in .x at 8),
// against the staged rows, added to acc[column][row]. A row's inputs for the piece are read
// from shared memory once for all COLS columns.
template <int BITS, int COLS>
__device__ __forceinline__ void gemv_quant_piece(const uint4 (&q)[COLS], const uint2 (&dm_raw)[COLS],
                                                 const int c, const int rows, const int K,
                                                 float (&acc)[COLS][QG_ROWS]) {
    const int nb = K / QG_BLOCK;
    const int4 *xq = reinterpret_cast<const int4 *>(qg_stage);
    const float *dx = reinterpret_cast<const float *>(qg_stage + QG_ROWS * K);
    const float *sx = dx + QG_ROWS * nb;
    if (BITS == 4) {
        // Piece c is half h of pair p: elements 16h … 16h + 15 of blocks 2p (low nibbles)
        // and 2p + 1 (high nibbles). Only the h = 0 lane adds the blocks' minimum terms.
        const int p = c >> 1, h = c & 1, ba = 2 * p, bb = 2 * p + 1;
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (r >= rows) break;
            // Elements 16h… of block ba start at 16-byte vector (r·K + 32·ba + 16h) / 16.
            const int4 xa = xq[(r * K + QG_BLOCK * ba) / 16 + h];
            const int4 xb = xq[(r * K + QG_BLOCK * bb) / 16 + h];
            const int xa_w[4] = {xa.x, xa.y, xa.z, xa.w}, xb_w[4] = {xb.x, xb.y, xb.z, xb.w};
            const float dxa = dx[r * nb + ba], dxb = dx[r * nb + bb];
            const float sxa = h == 0 ? sx[r * nb + ba] : 0.f, sxb = h == 0 ? sx[r * nb + bb] : 0.f;
#pragma unroll
            for (int i = 0; i < COLS; ++i) {
                const unsigned w[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
                int sa = 0, sb = 0;
#pragma unroll
                for (int t = 0; t < 4; ++t) {
                    sa = __dp4a((int)(w[t] & 0x0F0F0F0Fu), xa_w[t], sa);
                    sb = __dp4a((int)((w[t] >> 4) & 0x0F0F0F0Fu), xb_w[t], sb);
                }
                const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw[i].x));
                const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw[i].y));
                acc[i][r] += a.x * dxa * (float)sa + b.x * dxb * (float)sb + a.y * sxa + b.y * sxb;
            }
        }
    } else {
        // Piece c is elements 16c … 16c + 15 of the row: half c % 2 of block c / 2.
        const int blk = c >> 1;
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (r >= rows) break;
            const int4 xv = xq[(r * K) / 16 + c];
            const int xw[4] = {xv.x, xv.y, xv.z, xv.w};
            const float d = dx[r * nb + blk], sm = (c & 1) == 0 ? sx[r * nb + blk] : 0.f;
#pragma unroll
            for (int i = 0; i < COLS; ++i) {
                const unsigned w[4] = {q[i].x, q[i].y, q[i].z, q[i].w};
                int s = 0;
#pragma unroll
                for (int t = 0; t < 4; ++t) s = dp4a_us(w[t], xw[t], s);
                const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw[i].x));
                acc[i][r] += a.x * d * (float)s + a.y * sm;
            }
        }
    }
}

// Where a warp's next pass of weights is: columns j0 … j0 + COLS - 1, pieces base + lane,
// base + lane + 32, …, and column j0's row pointers from this lane's first piece and the
// (d, m) pair of its block, set once a group of columns. A pass's loads are then these
// pointers plus 32-bit offsets (the column, `base`, the load): the 64-bit row arithmetic for
// every load, redone each pass, was about a third of a pass's instructions (SASS, session 37).
// One pointer pair for all COLS columns, not one a column: four pairs pushed the four-column
// kernel past its 128 registers.
template <int BITS, int COLS> struct QuantCursor {
    // Bytes of (d, m) pairs a piece pair takes: at 4 bits a piece pair is two blocks (two
    // half2), at 8 bits one block (one half2).
    static constexpr int DM_BYTES = BITS == 4 ? 8 : 4;
    int j0, base;
    const uint4 *code;
    const unsigned char *dm;

    __device__ __forceinline__ void seek(const unsigned char *__restrict__ codes,
                                         const __half2 *__restrict__ dms, const int K) {
        const int lane = threadIdx.x % WARP;
        code = reinterpret_cast<const uint4 *>(codes + (size_t)j0 * (K * BITS / 8)) + lane;
        dm = reinterpret_cast<const unsigned char *>(dms + (size_t)j0 * (K / QG_BLOCK)) +
             DM_BYTES * (lane >> 1);
    }

    // The pass after this one: the rest of these columns, or the warp's next group (stride
    // columns on), whose pointers are then set.
    __device__ __forceinline__ void advance(const unsigned char *__restrict__ codes,
                                            const __half2 *__restrict__ dms, const int N, const int K,
                                            const int stride) {
        base += QG_LOADS / COLS * WARP;
        if (base >= K * BITS / 8 / 16) {
            base = 0;
            j0 += stride;
            if (j0 < N) seek(codes, dms, K);
        }
    }

    // This pass's codes and (d, m) pairs: load u of column i is piece c = base + u·32 + lane
    // of row j0 + i, its pair of blocks' (d, m) at pair (c >> 1) = base / 2 + 16u + lane / 2
    // (base is even).
    __device__ __forceinline__ void load(const int N, const int K, uint4 (&q)[QG_LOADS / COLS][COLS],
                                         uint2 (&dmv)[QG_LOADS / COLS][COLS]) const {
        const int pieces = K * BITS / 8 / 16, row_dm_bytes = K / QG_BLOCK * 4;
        const int lane = threadIdx.x % WARP;
#pragma unroll
        for (int u = 0; u < QG_LOADS / COLS; ++u) {
            const int c = base + u * WARP + lane;
#pragma unroll
            for (int i = 0; i < COLS; ++i) {
                if (c < pieces && j0 + i < N) {
                    q[u][i] = __ldg(code + (i * pieces + base + u * WARP));
                    const unsigned char *d = dm + (i * row_dm_bytes + DM_BYTES * ((base >> 1) + 16 * u));
                    dmv[u][i] = BITS == 4 ? __ldg(reinterpret_cast<const uint2 *>(d))
                                          : make_uint2(__ldg(reinterpret_cast<const unsigned *>(d)), 0);
                }
            }
        }
    }
};

// One pass of a warp: requests the next pass into (nq, ndm), then adds the pass in (q, dm)
// (columns j0 …, pieces from base) to acc, and writes the columns' sums when the next pass
// moves to other columns. False once the warp has no columns left. Called with the two
// buffers in turn, so a pass's registers are never copied to free them for the next.
template <typename T, int BITS, int COLS>
__device__ __forceinline__ bool gemv_quant_pass(const uint4 (&q)[QG_LOADS / COLS][COLS],
                                                const uint2 (&dm)[QG_LOADS / COLS][COLS],
                                                uint4 (&nq)[QG_LOADS / COLS][COLS],
                                                uint2 (&ndm)[QG_LOADS / COLS][COLS],
                                                QuantCursor<BITS, COLS> &next, int &j0, int &base,
                                                float (&acc)[COLS][QG_ROWS],
                                                const unsigned char *__restrict__ codes,
                                                const __half2 *__restrict__ dms, T *__restrict__ y,
                                                const int r0, const int rows, const int N,
                                                const int K, const int stride) {
    const int pieces = K * BITS / 8 / 16, lane = threadIdx.x % WARP;
    next.advance(codes, dms, N, K, stride);
    if (next.j0 < N) next.load(N, K, nq, ndm);
#pragma unroll
    for (int u = 0; u < QG_LOADS / COLS; ++u) {
        const int c = base + u * WARP + lane;
        if (c < pieces) gemv_quant_piece<BITS, COLS>(q[u], dm[u], c, rows, K, acc);
    }
    if (next.j0 != j0) {
#pragma unroll
        for (int i = 0; i < COLS; ++i)
#pragma unroll
            for (int r = 0; r < QG_ROWS; ++r) {
                if (r >= rows) break;
                const float s = warp_sum(acc[i][r]);
                if (lane == 0 && j0 + i < N) y[(size_t)(r0 + r) * N + j0 + i] = from_f<T>(s);
                acc[i][r] = 0.f;
            }
    }
    j0 = next.j0;
    base = next.base;
    return j0 < N;
}

// y's COLS columns from j0 for the block's rows: a warp's COLS columns are read side by side
// (a piece of each a load), so a row's staged inputs serve all of them.
template <typename T, int BITS, int COLS>
__device__ void gemv_quant(const T *__restrict__ x, const unsigned char *__restrict__ codes,
                           const __half2 *__restrict__ dm, T *__restrict__ y, const int M,
                           const int N, const int K) {
    constexpr int LOADS = QG_LOADS / COLS;
    const int r0 = blockIdx.x * QG_ROWS, rows = min(QG_ROWS, M - r0);
    const int warp = threadIdx.x / WARP, stride = gridDim.y * QG_WARPS * COLS;
    QuantCursor<BITS, COLS> next;
    next.j0 = (blockIdx.y * QG_WARPS + warp) * COLS;
    next.base = 0;
    // Two passes' registers, used in turn. Columns past N load nothing and are never
    // written; zeroed so their sums start defined.
    uint4 qa[LOADS][COLS] = {}, qb[LOADS][COLS] = {};
    uint2 dma[LOADS][COLS] = {}, dmb[LOADS][COLS] = {};
    // The weights do not depend on the kernel that writes x: the first pass is requested
    // before waiting for it, and before the staging, so its round trip overlaps both.
    if (next.j0 < N) {
        next.seek(codes, dm, K);
        next.load(N, K, qa, dma);
    }
    pdl_enter();
    gemv_quant_stage_rows<T>(x + (size_t)r0 * K, rows, K);
    __syncthreads();
    float acc[COLS][QG_ROWS] = {};
    int j0 = next.j0, base = 0;
    while (j0 < N) {
        if (!gemv_quant_pass<T, BITS, COLS>(qa, dma, qb, dmb, next, j0, base, acc, codes, dm, y, r0,
                                            rows, N, K, stride))
            break;
        gemv_quant_pass<T, BITS, COLS>(qb, dmb, qa, dma, next, j0, base, acc, codes, dm, y, r0, rows,
                                       N, K, stride);
    }
}

// kestrel_gemv_q{4,8}_c{1,2,4}_{f32,f16,bf16}: BITS-bit weights, COLS columns a warp at once.
#define KESTREL_QUANT_OP(T, SUFFIX, BITS, COLS)                                                 \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * WARP, 2)                            \
        kestrel_gemv_q##BITS##_c##COLS##_##SUFFIX(const T *x, const unsigned char *codes,       \
                                                  const __half2 *dm, T *y, const int M,         \
                                                  const int N, const int K) {                   \
        gemv_quant<T, BITS, COLS>(x, codes, dm, y, M, N, K);                                    \
    }
#define KESTREL_QUANT_OPS(T, SUFFIX)                                                            \
    KESTREL_QUANT_OP(T, SUFFIX, 4, 1)                                                           \
    KESTREL_QUANT_OP(T, SUFFIX, 4, 2)                                                           \
    KESTREL_QUANT_OP(T, SUFFIX, 4, 4)                                                           \
    KESTREL_QUANT_OP(T, SUFFIX, 8, 1)                                                           \
    KESTREL_QUANT_OP(T, SUFFIX, 8, 2)                                                           \
    KESTREL_QUANT_OP(T, SUFFIX, 8, 4)

KESTREL_QUANT_OPS(float, f32)
KESTREL_QUANT_OPS(__half, f16)
KESTREL_QUANT_OPS(__nv_bfloat16, bf16)

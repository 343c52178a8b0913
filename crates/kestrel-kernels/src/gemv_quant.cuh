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
// warp takes output columns in turn, its lanes reading the weight row 16 bytes at a time,
// QG_LOADS loads a pass, the next pass requested before the current one's arithmetic.
// blockIdx.x is the row group and blockIdx.y the column group, so
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
// than its weights: a round trip to memory for every 32 inputs.)
#define QG_STAGE_LOADS 8
template <typename T>
__device__ void gemv_quant_stage_rows(const T *__restrict__ x, const int rows, const int K) {
    constexpr int VEC = 16 / sizeof(T), TPB = QG_BLOCK / VEC;
    const int nvec = rows * K / VEC;
    signed char *xq = reinterpret_cast<signed char *>(qg_stage);
    float *dx = reinterpret_cast<float *>(qg_stage + QG_ROWS * K);
    float *sx = dx + QG_ROWS * (K / QG_BLOCK);
    for (int base = 0; base < nvec; base += QG_STAGE_LOADS * blockDim.x) {
        uint4 raw[QG_STAGE_LOADS];
#pragma unroll
        for (int u = 0; u < QG_STAGE_LOADS; ++u) {
            const int v = base + u * blockDim.x + threadIdx.x;
            raw[u] = v < nvec ? *reinterpret_cast<const uint4 *>(x + (size_t)v * VEC)
                              : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < QG_STAGE_LOADS; ++u) {
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

// One lane's share of a 16-byte piece `c` of a weight row (its codes `q`, and the (d, m)
// pairs of its blocks in `dm_raw`: both at 4 bits, the one in .x at 8) against the staged
// rows, added to acc[r].
template <int BITS>
__device__ __forceinline__ void gemv_quant_piece(const uint4 q, const uint2 dm_raw, const int c,
                                                 const int rows, const int K, float *acc) {
    const int nb = K / QG_BLOCK;
    const int4 *xq = reinterpret_cast<const int4 *>(qg_stage);
    const float *dx = reinterpret_cast<const float *>(qg_stage + QG_ROWS * K);
    const float *sx = dx + QG_ROWS * nb;
    const unsigned w[4] = {q.x, q.y, q.z, q.w};
    if (BITS == 4) {
        // Piece c is half h of pair p: elements 16h … 16h + 15 of blocks 2p (low nibbles)
        // and 2p + 1 (high nibbles).
        const int p = c >> 1, h = c & 1, ba = 2 * p, bb = 2 * p + 1;
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw.x));
        const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw.y));
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (r >= rows) break;
            // Elements 16h… of block ba start at 16-byte vector (r·K + 32·ba + 16h) / 16.
            const int4 xa = xq[(r * K + QG_BLOCK * ba) / 16 + h];
            const int4 xb = xq[(r * K + QG_BLOCK * bb) / 16 + h];
            const int xa_w[4] = {xa.x, xa.y, xa.z, xa.w}, xb_w[4] = {xb.x, xb.y, xb.z, xb.w};
            int sa = 0, sb = 0;
#pragma unroll
            for (int t = 0; t < 4; ++t) {
                sa = __dp4a((int)(w[t] & 0x0F0F0F0Fu), xa_w[t], sa);
                sb = __dp4a((int)((w[t] >> 4) & 0x0F0F0F0Fu), xb_w[t], sb);
            }
            float part = a.x * dx[r * nb + ba] * (float)sa + b.x * dx[r * nb + bb] * (float)sb;
            if (h == 0) part += a.y * sx[r * nb + ba] + b.y * sx[r * nb + bb];
            acc[r] += part;
        }
    } else {
        // Piece c is elements 16c … 16c + 15 of the row: half c % 2 of block c / 2.
        const int blk = c >> 1;
        const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&dm_raw.x));
#pragma unroll
        for (int r = 0; r < QG_ROWS; ++r) {
            if (r >= rows) break;
            const int4 xv = xq[(r * K) / 16 + c];
            const int xw[4] = {xv.x, xv.y, xv.z, xv.w};
            int s = 0;
#pragma unroll
            for (int t = 0; t < 4; ++t) s = dp4a_us(w[t], xw[t], s);
            float part = a.x * dx[r * nb + blk] * (float)s;
            if ((c & 1) == 0) part += a.y * sx[r * nb + blk];
            acc[r] += part;
        }
    }
}

// A warp's pass over weight row j: its lanes' QG_LOADS 16-byte pieces from piece `base`, and
// their blocks' (d, m) pairs.
template <int BITS>
__device__ __forceinline__ void gemv_quant_load(const unsigned char *__restrict__ codes,
                                                const __half2 *__restrict__ dm, const int j,
                                                const int base, const int K, uint4 (&q)[QG_LOADS],
                                                uint2 (&dmv)[QG_LOADS]) {
    const int row_bytes = K * BITS / 8, pieces = row_bytes / 16, nb = K / QG_BLOCK;
    const uint4 *wrow = reinterpret_cast<const uint4 *>(codes + (size_t)j * row_bytes);
    const __half2 *dm_row = dm + (size_t)j * nb;
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int u = 0; u < QG_LOADS; ++u) {
        const int c = base + u * WARP + lane;
        if (c < pieces) {
            q[u] = __ldg(wrow + c);
            dmv[u] = BITS == 4 ? __ldg(reinterpret_cast<const uint2 *>(dm_row + 2 * (c >> 1)))
                               : make_uint2(__ldg(reinterpret_cast<const unsigned *>(dm_row + (c >> 1))), 0);
        }
    }
}

template <typename T, int BITS>
__device__ void gemv_quant(const T *__restrict__ x, const unsigned char *__restrict__ codes,
                           const __half2 *__restrict__ dm, T *__restrict__ y, const int M,
                           const int N, const int K) {
    const int r0 = blockIdx.x * QG_ROWS, rows = min(QG_ROWS, M - r0);
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int pieces = K * BITS / 8 / 16, stride = gridDim.y * QG_WARPS;
    // The pass in registers: column j, pieces base + lane, base + lane + 32, …
    int j = blockIdx.y * QG_WARPS + warp, base = 0;
    uint4 q[QG_LOADS];
    uint2 dmv[QG_LOADS];
    // The weights do not depend on the kernel that writes x: the first pass is requested
    // before waiting for it, and before the staging, so its round trip overlaps both.
    if (j < N) gemv_quant_load<BITS>(codes, dm, j, base, K, q, dmv);
    pdl_enter();
    gemv_quant_stage_rows<T>(x + (size_t)r0 * K, rows, K);
    __syncthreads();
    float acc[QG_ROWS] = {};
    while (j < N) {
        // The next pass (the rest of this row, or the warp's next column) is requested
        // before this one's arithmetic, so a warp always has loads in flight.
        uint4 cq[QG_LOADS];
        uint2 cdm[QG_LOADS];
#pragma unroll
        for (int u = 0; u < QG_LOADS; ++u) {
            cq[u] = q[u];
            cdm[u] = dmv[u];
        }
        int next_j = j, next_base = base + QG_LOADS * WARP;
        if (next_base >= pieces) {
            next_j = j + stride;
            next_base = 0;
        }
        if (next_j < N) gemv_quant_load<BITS>(codes, dm, next_j, next_base, K, q, dmv);
#pragma unroll
        for (int u = 0; u < QG_LOADS; ++u) {
            const int c = base + u * WARP + lane;
            if (c < pieces) gemv_quant_piece<BITS>(cq[u], cdm[u], c, rows, K, acc);
        }
        if (next_j != j) {
#pragma unroll
            for (int r = 0; r < QG_ROWS; ++r) {
                if (r >= rows) break;
                const float s = warp_sum(acc[r]);
                if (lane == 0) y[(size_t)(r0 + r) * N + j] = from_f<T>(s);
                acc[r] = 0.f;
            }
        }
        j = next_j;
        base = next_base;
    }
}

#define KESTREL_QUANT_OPS(T, SUFFIX)                                                            \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * WARP) kestrel_gemv_q4_##SUFFIX(     \
        const T *x, const unsigned char *codes, const __half2 *dm, T *y, const int M,           \
        const int N, const int K) {                                                             \
        gemv_quant<T, 4>(x, codes, dm, y, M, N, K);                                             \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(QG_WARPS * WARP) kestrel_gemv_q8_##SUFFIX(     \
        const T *x, const unsigned char *codes, const __half2 *dm, T *y, const int M,           \
        const int N, const int K) {                                                             \
        gemv_quant<T, 8>(x, codes, dm, y, M, N, K);                                             \
    }

KESTREL_QUANT_OPS(float, f32)
KESTREL_QUANT_OPS(__half, f16)
KESTREL_QUANT_OPS(__nv_bfloat16, bf16)

// Kernels that reduce f32 logits rows to tokens: argmax, top-k, sampling (temperature, top-k,
// top-p) and speculative acceptance on the device. Included by kernels.cu, after the warp and
// block helpers it uses (WARP, FULL_MASK, pdl_enter, block_sum).
#pragma once

// ---------------------------------------------------------------------------------------
// Row argmax and row top-k of f32 logits. The order is the host's (kestrel_spec::sampling::
// argmax, kestrel-runtime's top_k): larger value first, lower index on equal values; NaNs
// are never chosen. One block per row.
// ---------------------------------------------------------------------------------------
#define NO_INDEX 0xffffffffu

// (value, index) pair `a` beats `b` in that order; NO_INDEX (nothing seen) loses.
__device__ __forceinline__ bool beats(float av, unsigned int ai, float bv, unsigned int bi) {
    return ai != NO_INDEX && (bi == NO_INDEX || av > bv || (av == bv && ai < bi));
}

// The best (value, index) of the warp; every lane gets it.
__device__ __forceinline__ void warp_best(float &best, unsigned int &idx) {
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(FULL_MASK, best, o);
        const unsigned int oi = __shfl_xor_sync(FULL_MASK, idx, o);
        if (beats(ov, oi, best, idx)) {
            best = ov;
            idx = oi;
        }
    }
}

// The best (value, index) of the block; every thread gets it. `sv`, `si`: 32 entries of
// shared memory each.
__device__ __forceinline__ void block_best(float &best, unsigned int &idx, float *sv,
                                           unsigned int *si) {
    warp_best(best, idx);
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    __syncthreads(); // `sv`/`si` may still be read by a previous call
    if (lane == 0) {
        sv[warp] = best;
        si[warp] = idx;
    }
    __syncthreads();
    const int nwarps = blockDim.x / WARP;
    best = lane < nwarps ? sv[lane] : -INFINITY;
    idx = lane < nwarps ? si[lane] : NO_INDEX;
    warp_best(best, idx);
}

// The inclusive prefix sums of a warp's 32 values, in lane order.
__device__ __forceinline__ float tile_inclusive_scan(float s) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int o = 1; o < WARP; o <<= 1) {
        const float n = __shfl_up_sync(FULL_MASK, s, o);
        if (lane >= o) s += n;
    }
    return s;
}

// ---------------------------------------------------------------------------------------
// Top-k and top-p (nucleus) filtering for kestrel_sample_f32, with the host's semantics
// (kestrel_spec::sampling::probs): top-k keeps every token whose logit is at least the k-th
// largest (ties with it kept); top-p then keeps, in order of probability with ties broken by
// the lower id, each token whose mass before it is below top_p of the mass top-k kept.
// Both cuts are found by radix select over an order-preserving u32 key of the logit, 8 bits
// a pass from the top: each pass adds every candidate's count or mass into 256 bins of
// shared memory with integer atomics, exact and so independent of the order threads add in,
// and one warp walks the bins from the top. Masses are w = exp((x − max) / T) in fixed
// point with min(46, 62 − bits(vocab)) fractional bits, so a whole row's sum fits 64 bits
// and a token's share is resolved to ~1e-14. A kept token is then drawn by the inverse CDF below.
// ---------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned int order_key(const float x) {
    const unsigned int u = __float_as_uint(x);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

__device__ __forceinline__ float key_value(const unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

struct MassScale {
    float best, inv_t;
    double scale; // 2^frac
    __device__ __forceinline__ unsigned long long fixed(const float x) const {
        return __double2ull_rn((double)expf((x - best) * inv_t) * scale);
    }
};

// What filtering keeps: key ≥ k_key, and key > p_key or (key == p_key and id ≤ p_cut).
struct Kept {
    unsigned int k_key, p_key, p_cut;
    __device__ __forceinline__ bool operator()(const unsigned int key, const int e) const {
        return key >= k_key && (key > p_key || (key == p_key && (unsigned int)e <= p_cut));
    }
};

// Histogram copies a radix pass spreads its atomics over (warp w adds into copy w mod this):
// a row's logits mostly share their top key bits, so one copy would serialise the warps.
#define SELECT_COPIES 8
// Logits a thread loads at once in a pass over a row.
#define SELECT_LOADS 16

// see(x, e) for every logit e of the row, NaN past its end, each thread the same number of
// times (so a warp stays converged): a thread's SELECT_LOADS loads go out before it sees any,
// since one block streams the whole row and one load at a time left every pass waiting on L2.
template <typename F>
__device__ __forceinline__ void for_row_batched(const float *__restrict__ xr, const int v,
                                                F &&see) {
    for (int base = 0; base < v; base += SELECT_LOADS * blockDim.x) {
        float xs[SELECT_LOADS];
#pragma unroll
        for (int u = 0; u < SELECT_LOADS; ++u) {
            const int e = base + u * blockDim.x + threadIdx.x;
            xs[u] = e < v ? xr[e] : NAN;
        }
#pragma unroll
        for (int u = 0; u < SELECT_LOADS; ++u) see(xs[u], base + u * blockDim.x + threadIdx.x);
    }
}

struct SelectScratch {
    unsigned long long bins[SELECT_COPIES][256];
    double need, left;
    unsigned int digit;
};

// Radix select over the row's non-NaN logits with key ≥ floor: the largest key K whose
// elements with key ≥ K reach `need` (MASS: of fixed-point mass, `need` a fraction of the
// candidates' total; else of count). Returns K; `need_left` gets what K's own elements must
// still supply, `bin_left` their total count or mass.
template <bool MASS>
__device__ unsigned int radix_select(const float *__restrict__ xr, const int v,
                                     const MassScale ms, const unsigned int floor_key,
                                     double need, double &need_left, double &bin_left,
                                     SelectScratch &sc) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    unsigned long long *own = sc.bins[warp % SELECT_COPIES];
    unsigned int prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < SELECT_COPIES * 256; i += blockDim.x) sc.bins[0][i] = 0;
        __syncthreads();
        // The warp's lanes that fall into one bin sum their counts or masses with redux (a
        // mass as two 32-bit halves, which cannot overflow: at most 2^46 a lane) and the lowest
        // of them adds once. A row's logits mostly share their top key bits: one 64-bit atomic
        // a lane cost ~0.2 ms a row.
        for_row_batched(xr, v, [&](const float x, int) {
            const unsigned int key = order_key(x);
            const bool in = !isnan(x) && key >= floor_key && (key & mask) == prefix;
            const unsigned int bin = in ? (key >> shift) & 255u : 256u;
            const unsigned int peers = __match_any_sync(FULL_MASK, bin);
            unsigned long long sum;
            if (MASS) {
                const unsigned long long m = in ? ms.fixed(x) : 0ull;
                const unsigned int lo = __reduce_add_sync(peers, (unsigned int)(m & 0xffffffu));
                const unsigned int hi = __reduce_add_sync(peers, (unsigned int)(m >> 24));
                sum = ((unsigned long long)hi << 24) + lo;
            } else {
                sum = __popc(peers);
            }
            if (in && (peers & ((1u << lane) - 1u)) == 0u) atomicAdd(&own[bin], sum);
        });
        __syncthreads();
        if (warp == 0) {
            // Lane l holds bins 255 − 8l down to 248 − 8l (the copies added in order: integer
            // sums, exact); a scan over the lanes gives each the sum of the bins above its own.
            unsigned long long c[8], local = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int b = 255 - 8 * lane - j;
                c[j] = 0;
#pragma unroll
                for (int q = 0; q < SELECT_COPIES; ++q) c[j] += sc.bins[q][b];
                local += c[j];
            }
            unsigned long long incl = local;
#pragma unroll
            for (int o = 1; o < WARP; o <<= 1) {
                const unsigned long long n = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += n;
            }
            if (MASS && shift == 24) need *= (double)__shfl_sync(FULL_MASK, incl, WARP - 1);
            // The bin where the running sum from the top reaches `need`; bin 0 if none does
            // (fewer candidates than asked for: all are kept).
            const unsigned int hit = __ballot_sync(FULL_MASK, (double)incl >= need);
            const int owner = hit ? __ffs(hit) - 1 : WARP - 1;
            if (lane == owner) {
                double above = (double)(incl - local);
                int j = 0;
                for (; j < 7; ++j) {
                    if (above + (double)c[j] >= need) break;
                    above += (double)c[j];
                }
                sc.digit = 255 - 8 * lane - j;
                sc.need = need - above;
                sc.left = (double)c[j];
            }
        }
        __syncthreads();
        prefix |= sc.digit << shift;
        mask |= 255u << shift;
        need = sc.need;
        bin_left = sc.left;
        __syncthreads(); // every thread has read the scratch before the next pass clears it
    }
    need_left = need;
    return prefix;
}

// The filter for top_k (0: none) and top_p (≥ 1: none). Every thread gets it.
__device__ Kept sample_filter(const float *__restrict__ xr, const int v, const MassScale ms,
                              const int top_k, const float top_p, SelectScratch &sc) {
    Kept kept{0u, 0u, 0xffffffffu};
    double need_left, bin_left;
    if (top_k > 0 && top_k < v)
        kept.k_key = radix_select<false>(xr, v, ms, 0u, (double)top_k, need_left, bin_left, sc);
    if (!(top_p < 1.f)) return kept;
    kept.p_key = radix_select<true>(xr, v, ms, kept.k_key, (double)top_p, need_left, bin_left, sc);
    // Ties at p_key share one weight; the first ceil(need_left / w) of them by id are kept
    // (each is kept while the mass before it is below the target).
    const double w = (double)ms.fixed(key_value(kept.p_key));
    const double n_ties = w > 0.0 ? bin_left / w : 0.0;
    const double n_keep = w > 0.0 ? ceil(need_left / w) : n_ties;
    if (n_keep >= n_ties) return kept;
    __shared__ unsigned int cut;
    if (threadIdx.x < WARP) { // warp 0 walks the row in tiles to the n_keep-th tie
        const int lane = threadIdx.x;
        int seen = 0;
        unsigned int found = 0xffffffffu;
        for (int t0 = 0; t0 < v && found == 0xffffffffu; t0 += WARP) {
            const int e = t0 + lane;
            const bool tie = e < v && !isnan(xr[e]) && order_key(xr[e]) == kept.p_key;
            const unsigned int ballot = __ballot_sync(FULL_MASK, tie);
            const int here = __popc(ballot);
            if (seen + here >= (int)n_keep) {
                unsigned int bits = ballot;
                for (int i = 1; i < (int)n_keep - seen; ++i) bits &= bits - 1; // drop lowest
                found = t0 + __ffs(bits) - 1;
            }
            seen += here;
        }
        if (lane == 0) cut = found;
    }
    __syncthreads();
    kept.p_cut = cut;
    return kept;
}

// ---------------------------------------------------------------------------------------
// A row's warped law (kestrel_spec::sampling::probs) as the kernels below use it: weight
// w_e = exp((x_e − best) / T) for a kept token (`Kept`), 0 for a filtered or NaN one; the
// law is w / Σ w. A row without a finite maximum has the host's one-hot law at its argmax.
// ---------------------------------------------------------------------------------------
struct RowLaw {
    float best; // the largest logit; not finite: one-hot at idx
    unsigned int idx;
    float inv_t;
    Kept kept;
    __device__ __forceinline__ bool one_hot() const { return !isfinite(best); }
    // Token e's weight; 0 at and past `end` (a chunk's end, so a warp's tiles stay full).
    __device__ __forceinline__ float weight(const float *__restrict__ xr, const int e,
                                            const int end) const {
        const float val = e < end ? xr[e] : NAN;
        return isnan(val) || !kept(order_key(val), e) ? 0.f : expf((val - best) * inv_t);
    }
    // Token e's probability, given Σ w (`total`).
    __device__ __forceinline__ float prob(const float *__restrict__ xr, const unsigned int e,
                                          const float total) const {
        if (one_hot()) return e == idx ? 1.f : 0.f;
        return weight(xr, (int)e, (int)e + 1) / total;
    }
};

// The row's largest logit and its id (all NaN: id 0, as on the host's argmax); every thread
// gets them. `sv`/`si`: 32 entries of shared memory each.
__device__ void row_best(const float *__restrict__ xr, const int v, float &best,
                         unsigned int &idx, float *sv, unsigned int *si) {
    best = -INFINITY;
    idx = NO_INDEX;
    // The order is total, so the result does not depend on who saw what.
    for_row_batched(xr, v, [&](const float val, const int e) {
        if (!isnan(val) && beats(val, e, best, idx)) {
            best = val;
            idx = e;
        }
    });
    block_best(best, idx, sv, si);
    if (idx == NO_INDEX) idx = 0;
}

// The row's law; every thread gets it. `sv`/`si`: 32 entries of shared memory each.
__device__ RowLaw row_law(const float *__restrict__ xr, const int v, const float inv_t,
                          const int top_k, const float top_p, SelectScratch &sc, float *sv,
                          unsigned int *si) {
    RowLaw law{-INFINITY, NO_INDEX, inv_t, Kept{0u, 0u, 0xffffffffu}};
    row_best(xr, v, law.best, law.idx, sv, si);
    if (law.one_hot()) return law;
    // Fixed-point masses: a row's sum fits 64 bits, a lane's 46 (radix_select's halves).
    const MassScale ms{law.best, inv_t, exp2((double)min(46, 62 - (32 - __clz(v))))};
    law.kept = sample_filter(xr, v, ms, top_k, top_p, sc);
    return law;
}

// Σ weight(e) over the row, in a fixed order: warp w sums its contiguous chunk in 32-wide
// tiles, in order, into `chunk_sum[w]`; the chunks' sums are added in warp order. Every
// thread gets the total.
template <typename W>
__device__ float chunk_sums(W &&weight, const int v, float *chunk_sum) {
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nwarps = blockDim.x / WARP;
    const int chunk = (v + nwarps - 1) / nwarps;
    const int c0 = min(v, warp * chunk), c1 = min(v, c0 + chunk);
    float sum = 0.f;
    for (int t0 = c0; t0 < c1; t0 += WARP)
        sum += __shfl_sync(FULL_MASK, tile_inclusive_scan(weight(t0 + lane, c1)), WARP - 1);
    __syncthreads(); // a previous call's readers are done with chunk_sum
    if (lane == 0) chunk_sum[warp] = sum;
    __syncthreads();
    float total = 0.f;
    for (int w = 0; w < nwarps; ++w) total += chunk_sum[w];
    return total;
}

// The inverse CDF of the weights `chunk_sums` has just summed into `chunk_sum` (`total`):
// the first id whose cumulative weight exceeds u · total; where rounding leaves the target
// past the last prefix, the last positive weight (as the host takes the row's); `fallback`
// when no weight is positive. The warp whose chunk holds the target walks it again with an
// inclusive scan per tile. Every thread gets the id.
template <typename W>
__device__ unsigned int inverse_cdf(W &&weight, const int v, const float u, const float total,
                                    const float *chunk_sum, const unsigned int fallback) {
    __shared__ unsigned int picked;
    const int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    const int nwarps = blockDim.x / WARP;
    const int chunk = (v + nwarps - 1) / nwarps;
    // Every thread finds the same owner: the first chunk whose end passes the target.
    const float target = u * total;
    float before = 0.f;
    int owner = -1, last_nonzero = 0;
    for (int w = 0; w < nwarps; ++w) {
        if (chunk_sum[w] > 0.f) last_nonzero = w;
        if (owner < 0 && target < before + chunk_sum[w] && chunk_sum[w] > 0.f) owner = w;
        else if (owner < 0) before += chunk_sum[w];
    }
    if (owner < 0) { // the target at or past the total: the last positive weight
        owner = last_nonzero;
        before = -INFINITY; // nothing in the chunk passes it; its last positive is taken
    }
    if (warp == owner) {
        const int o0 = min(v, owner * chunk), o1 = min(v, o0 + chunk);
        float running = before;
        unsigned int found = NO_INDEX, last_pos = NO_INDEX;
        for (int t0 = o0; t0 < o1 && found == NO_INDEX; t0 += WARP) {
            const float w = weight(t0 + lane, o1);
            const float s = tile_inclusive_scan(w);
            const unsigned int hit = __ballot_sync(FULL_MASK, w > 0.f && target < running + s);
            const unsigned int pos = __ballot_sync(FULL_MASK, w > 0.f);
            if (hit) found = t0 + __ffs(hit) - 1;
            if (pos) last_pos = t0 + 31 - __clz(pos);
            running += __shfl_sync(FULL_MASK, s, WARP - 1);
        }
        if (lane == 0) picked = found != NO_INDEX ? found : last_pos != NO_INDEX ? last_pos : fallback;
    }
    __syncthreads();
    return picked;
}

// Temperature sampling by inverse CDF: row r's token is the first i whose cumulative weight
// exceeds u_r · Σ w, w_i = exp((x_i − max) / T) (NaN, and tokens top-k or top-p filtered
// out: 0; `sample_filter` above), which is what the host's
// `sampling::sample(probs(row))` computes (in f64 there) from the same uniform u_r, drawn by
// the host from the sequence's own stream: the device consumes a sequence's randomness
// exactly as the host path does, and only one id per row crosses to the host instead of the
// row. One block of 1,024 threads per row: the row's law (row_law: the maximum as
// kestrel_argmax_f32 finds it, a row without a finite one taking its argmax like the host's
// one-hot; then the filter), its weights summed (chunk_sums) and the inverse CDF walked
// (inverse_cdf).
extern "C" __global__ void __launch_bounds__(1024)
    kestrel_sample_f32(const float *__restrict__ x, const float *__restrict__ uniforms,
                       unsigned int *__restrict__ out, const int v, const float inv_t,
                       const int top_k, const float top_p) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ unsigned int si[32];
    __shared__ float chunk_sum[32];
    __shared__ SelectScratch scratch;
    const float *xr = x + (size_t)blockIdx.x * v;
    const RowLaw law = row_law(xr, v, inv_t, top_k, top_p, scratch, sv, si);
    if (law.one_hot()) {
        if (threadIdx.x == 0) out[blockIdx.x] = law.idx;
        return;
    }
    auto weight = [&](const int e, const int end) { return law.weight(xr, e, end); };
    const float total = chunk_sums(weight, v, chunk_sum);
    const unsigned int t = inverse_cdf(weight, v, uniforms[blockIdx.x], total, chunk_sum, law.idx);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// Typical acceptance's draw at a verified node (kestrel_spec::accept::typical_probs,
// TensorRT-LLM's eagle_posterior_threshold ε): p = softmax(x / T), H = −Σ p ln p; tokens with
// p below min(ε, √ε · exp(−H)) are dropped, the most likely kept, and a token is drawn from the
// rest by inverse CDF at the row's uniform, as the host's sample_f64 draws it (in f64 there).
// Top-k and top-p do not apply. One block of 1,024 threads a row: the maximum, then Σ w and
// Σ w·ln w (w = exp((x − max) / T)) for the entropy, then the kept weights' sum and the walk.
extern "C" __global__ void __launch_bounds__(1024)
    kestrel_sample_typical_f32(const float *__restrict__ x, const float *__restrict__ uniforms,
                               unsigned int *__restrict__ out, const int v, const float inv_t,
                               const float eps) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ unsigned int si[32];
    __shared__ float chunk_sum[32];
    const float *xr = x + (size_t)blockIdx.x * v;
    float best;
    unsigned int idx;
    row_best(xr, v, best, idx, sv, si);
    if (!isfinite(best)) {
        if (threadIdx.x == 0) out[blockIdx.x] = idx;
        return;
    }
    // ln w = (x − max) / T, so H = ln Σw − Σ w ln w / Σ w; tokens of weight 0 add nothing.
    auto log_w = [&](const int e, const int end) {
        const float val = e < end ? xr[e] : NAN;
        return isnan(val) ? -INFINITY : (val - best) * inv_t;
    };
    auto weight = [&](const int e, const int end) { return expf(log_w(e, end)); };
    auto w_log_w = [&](const int e, const int end) {
        const float lw = log_w(e, end);
        const float w = expf(lw);
        return w > 0.f ? w * lw : 0.f;
    };
    const float z = chunk_sums(weight, v, chunk_sum);
    const float h = logf(z) - chunk_sums(w_log_w, v, chunk_sum) / z;
    const float cut = fminf(eps, sqrtf(fmaxf(eps, 0.f)) * expf(-h)) * z; // in units of w
    auto kept = [&](const int e, const int end) {
        const float w = weight(e, end);
        return w >= cut || e == (int)idx ? w : 0.f;
    };
    const float total = chunk_sums(kept, v, chunk_sum);
    const unsigned int t = inverse_cdf(kept, v, uniforms[blockIdx.x], total, chunk_sum, idx);
    if (threadIdx.x == 0) out[blockIdx.x] = t;
}

// ---------------------------------------------------------------------------------------
// Draft-target speculative sampling on the device (kestrel_spec::accept::draft_target, Leviathan
// et al. 2023): accept draft x_i with probability min(1, p_i(x_i)/q_i(x_i)); at the first
// rejection draw from norm(max(0, p_i − q_i)) (p_i when that is all zero) and stop; with every
// draft accepted draw the bonus from p_k. p and q are the target's and the draft's warped laws
// (temperature, top-k, top-p: RowLaw), computed from their logits here, so the rows never
// cross to the host: a sequence's step sends back two numbers.
// Two launches. kestrel_row_laws_f32 (a block a row, every row of a logits tensor at once)
// stores each row's law and Σ w in LAW_WORDS u32; kestrel_chain_accept_f32 (a block a
// sequence) then runs the tests in order from those, and walks the rows once more only for
// the token it draws: the residual's inverse CDF, or for the bonus exactly what
// kestrel_sample_f32 would draw from the row with that uniform.
// Uniforms come from the host, drawn from the sequence's stream: test i uses u_i, the drawn
// token u_{j+1} after a rejection at j (u_k for the bonus), as the host consumes them.
// ---------------------------------------------------------------------------------------
// best's bits, idx, kept.k_key, kept.p_key, kept.p_cut, Σ w's bits
#define LAW_WORDS 6

extern "C" __global__ void __launch_bounds__(1024)
    kestrel_row_laws_f32(const float *__restrict__ x, unsigned int *__restrict__ laws, const int v,
                         const float inv_t, const int top_k, const float top_p) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ unsigned int si[32];
    __shared__ float chunk_sum[32];
    __shared__ SelectScratch scratch;
    const float *xr = x + (size_t)blockIdx.x * v;
    const RowLaw law = row_law(xr, v, inv_t, top_k, top_p, scratch, sv, si);
    const float total =
        law.one_hot() ? 1.f
                      : chunk_sums([&](const int e, const int end) { return law.weight(xr, e, end); },
                                   v, chunk_sum);
    if (threadIdx.x == 0) {
        unsigned int *w = laws + (size_t)blockIdx.x * LAW_WORDS;
        w[0] = __float_as_uint(law.best);
        w[1] = law.idx;
        w[2] = law.kept.k_key;
        w[3] = law.kept.p_key;
        w[4] = law.kept.p_cut;
        w[5] = __float_as_uint(total);
    }
}

__device__ __forceinline__ RowLaw stored_law(const unsigned int *__restrict__ laws, const unsigned int row,
                                             const float inv_t, float &total) {
    const unsigned int *w = laws + (size_t)row * LAW_WORDS;
    total = __uint_as_float(w[5]);
    return RowLaw{__uint_as_float(w[0]), w[1], inv_t, Kept{w[2], w[3], w[4]}};
}

// out[s] = (accepted drafts, the token after them); CHAIN_ZERO_Q instead of the count when
// draft i has probability 0 under its own law (out[s][1] = i): the draft was not drawn from it.
#define CHAIN_ZERO_Q 0xffffffffu

// meta (u32), for n_seq sequences of at most kmax drafts (ChainAcceptMeta in lib.rs):
//   [2s], [2s + 1]                      sequence s's first target row (after its last
//                                       committed token) and its k drafts
//   [2n + s·kmax + i]                   the draft row of its draft i (in q)
//   [2n + n·kmax + s·kmax + i]          its draft token i
//   [2n + 2n·kmax + s·(kmax + 1) + i]   its uniform i, f32 bits (k + 1 of them)
extern "C" __global__ void __launch_bounds__(1024)
    kestrel_chain_accept_f32(const float *__restrict__ p, const unsigned int *__restrict__ p_laws,
                             const float *__restrict__ q, const unsigned int *__restrict__ q_laws,
                             const unsigned int *__restrict__ meta, unsigned int *__restrict__ out,
                             const int v, const int n_seq, const int kmax, const float inv_t) {
    pdl_enter();
    __shared__ float chunk_sum[32];
    const int s = blockIdx.x;
    const unsigned int t_row = meta[2 * s], k = meta[2 * s + 1];
    const unsigned int *q_rows = meta + 2 * n_seq + (size_t)s * kmax;
    const unsigned int *tokens = meta + 2 * n_seq + (size_t)n_seq * kmax + (size_t)s * kmax;
    const float *u = reinterpret_cast<const float *>(meta + 2 * n_seq + 2 * (size_t)n_seq * kmax +
                                                     (size_t)s * (kmax + 1));
    unsigned int accepted = 0, token = 0;
    for (; accepted < k; ++accepted) {
        const unsigned int i = accepted, x = tokens[i];
        const float *pr = p + (size_t)(t_row + i) * v, *qr = q + (size_t)q_rows[i] * v;
        float p_total, q_total;
        const RowLaw pl = stored_law(p_laws, t_row + i, inv_t, p_total);
        const RowLaw ql = stored_law(q_laws, q_rows[i], inv_t, q_total);
        const float px = pl.prob(pr, x, p_total), qx = ql.prob(qr, x, q_total);
        if (!(qx > 0.f)) {
            if (threadIdx.x == 0) {
                out[2 * s] = CHAIN_ZERO_Q;
                out[2 * s + 1] = i;
            }
            return;
        }
        if ((double)u[i] * (double)qx < (double)px) continue;
        auto residual = [&](const int e, const int end) {
            return e < end ? fmaxf(0.f, pl.prob(pr, e, p_total) - ql.prob(qr, e, q_total)) : 0.f;
        };
        const float r_total = chunk_sums(residual, v, chunk_sum);
        if (r_total > 1e-12f) {
            token = inverse_cdf(residual, v, u[i + 1], r_total, chunk_sum, pl.idx);
        } else { // p = q up to rounding: p is kept, as on the host
            auto target = [&](const int e, const int end) { return e < end ? pl.prob(pr, e, p_total) : 0.f; };
            token = inverse_cdf(target, v, u[i + 1], chunk_sums(target, v, chunk_sum), chunk_sum, pl.idx);
        }
        break;
    }
    if (accepted == k) { // the bonus, as kestrel_sample_f32 draws it from row t_row + k
        const float *pr = p + (size_t)(t_row + k) * v;
        float p_total;
        const RowLaw pl = stored_law(p_laws, t_row + k, inv_t, p_total);
        if (pl.one_hot()) {
            token = pl.idx;
        } else {
            auto weight = [&](const int e, const int end) { return pl.weight(pr, e, end); };
            token = inverse_cdf(weight, v, u[k], chunk_sums(weight, v, chunk_sum), chunk_sum, pl.idx);
        }
    }
    if (threadIdx.x == 0) {
        out[2 * s] = accepted;
        out[2 * s + 1] = token;
    }
}

// One block per row. A row is read with 16-byte loads, four in flight per thread: a single
// block streaming a 49,152-entry row one float at a time took ~28 µs, most of the step's
// sampling. The order is total, so the result does not depend on which thread saw what.
extern "C" __global__ void kestrel_argmax_f32(const float *__restrict__ x,
                                              unsigned int *__restrict__ out, const int v) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ unsigned int si[32];
    const float *xr = x + (size_t)blockIdx.x * v;
    float best = -INFINITY;
    unsigned int idx = NO_INDEX;
    auto see = [&](const float val, const unsigned int e) {
        if (!isnan(val) && beats(val, e, best, idx)) {
            best = val;
            idx = e;
        }
    };
    // The vectorised part needs 16-byte aligned rows; the rest goes one by one.
    const int v4 = (v % 4 == 0 && reinterpret_cast<size_t>(xr) % 16 == 0) ? v / 4 : 0;
    const float4 *x4 = reinterpret_cast<const float4 *>(xr);
    constexpr int UNROLL = 4;
    for (int base = threadIdx.x; base < v4; base += UNROLL * blockDim.x) {
        float4 q[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int e4 = base + u * blockDim.x;
            q[u] = e4 < v4 ? x4[e4] : make_float4(NAN, NAN, NAN, NAN);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const unsigned int e = 4u * (base + u * blockDim.x);
            see(q[u].x, e);
            see(q[u].y, e + 1);
            see(q[u].z, e + 2);
            see(q[u].w, e + 3);
        }
    }
    for (int e = 4 * v4 + threadIdx.x; e < v; e += blockDim.x) see(xr[e], e);
    block_best(best, idx, sv, si);
    if (threadIdx.x == 0) out[blockIdx.x] = idx == NO_INDEX ? 0u : idx; // all NaN → 0, as on the host
}

// The k best tokens of every row with their log-probabilities under softmax(row): out is
// [rows, 2k] u32, the ids then the log-probabilities' f32 bits (one copy to the host).
// log p = x − (max + log Σ exp(x − max)), capped at 0, NaNs left out of the sum.
// One pass over the row: every thread keeps its own k best (sorted, in registers) and an
// online (max, Σ exp) of its elements; then k block reductions over the threads' current
// heads pick the row's k best in order. k ≤ TOPK_MAX; TOPK_THREADS threads per block.
#define TOPK_MAX 32
#define TOPK_THREADS 256
extern "C" __global__ void __launch_bounds__(TOPK_THREADS)
kestrel_topk_logp_f32(const float *__restrict__ x, unsigned int *__restrict__ out, const int v,
                      const int k) {
    pdl_enter();
    __shared__ float sv[32];
    __shared__ unsigned int si[32];
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * v;
    unsigned int *orow = out + (size_t)blockIdx.x * 2 * k;
    float lv[TOPK_MAX];
    unsigned int li[TOPK_MAX];
    int cnt = 0;
    float tmax = -INFINITY, tsum = 0.f;
    for (int e = threadIdx.x; e < v; e += blockDim.x) {
        const float val = xr[e];
        if (isnan(val)) continue;
        if (val > tmax) {
            tsum = tsum * expf(tmax - val) + 1.f;
            tmax = val;
        } else {
            tsum += expf(val - tmax);
        }
        if (cnt == k && !beats(val, e, lv[k - 1], li[k - 1])) continue;
        // Insertion into the sorted local list (indices rise along the loop, so an equal
        // value goes after the ones already there).
        int pos = cnt < k ? cnt++ : k - 1;
        while (pos > 0 && beats(val, e, lv[pos - 1], li[pos - 1])) {
            lv[pos] = lv[pos - 1];
            li[pos] = li[pos - 1];
            --pos;
        }
        lv[pos] = val;
        li[pos] = e;
    }
    // Row max, then Σ exp(x − max) from every thread's (max, sum).
    float best = tmax;
    unsigned int idx = tmax == -INFINITY ? NO_INDEX : threadIdx.x;
    block_best(best, idx, sv, si);
    const float max = idx == NO_INDEX ? 0.f : best;
    const float lse = max + logf(block_sum(tmax == -INFINITY ? 0.f : tsum * expf(tmax - max), red));
    int head = 0;
    for (int r = 0; r < k; ++r) {
        best = head < cnt ? lv[head] : -INFINITY;
        idx = head < cnt ? li[head] : NO_INDEX;
        block_best(best, idx, sv, si);
        if (head < cnt && li[head] == idx) ++head; // the winner's owner moves on
        if (threadIdx.x == 0) {
            // Fewer than k choosable entries: the rest are token 0 at probability 0.
            orow[r] = idx == NO_INDEX ? 0u : idx;
            orow[k + r] = __float_as_uint(idx == NO_INDEX ? -INFINITY : fminf(best - lse, 0.f));
        }
    }
}


// ---------------------------------------------------------------------------------------
// EAGLE's exact rejection sampling over a tree on the device (kestrel_spec::accept::
// exact_tree_sampling, SpecInfer): from the root, at each accepted node with the target's law
// p and, for sampled children, the draft's law q at that node, the children are tried in rank
// order; child x is accepted with probability min(1, p(x)/q(x)) (sampled children; p(x) for
// children fixed independently of the target, `deterministic`); on rejection p ← norm(max(0,
// p − q)) and q ← q without x, renormalised (deterministic: p ← p without x). An accepted
// child becomes the current node; when none is, or the node is a leaf, the bonus is drawn
// from the current p. The draws use the sequence's host-drawn uniforms in the host's order
// (a test per tried child, then the bonus).
// The laws come from kestrel_row_laws_f32. A residual is never stored: p_j(v) is recomputed
// from p_0(v), q_0(v) and the j rejections' constants (the rejected tokens, the residuals'
// sums), which costs a pass over the row per rejection.
// ---------------------------------------------------------------------------------------
// Children a node may try (TREE_MAX_CHILDREN in lib.rs).
#define TREE_MAX_CHILDREN 64
// No draft row / no draft column.
#define TREE_NONE 0xffffffffu

struct LawRow {
    const float *row;
    RowLaw law;
    float total;
    __device__ __forceinline__ float prob(const unsigned int e) const { return law.prob(row, e, total); }
};

// A node's p and q after the rejections so far.
struct Rejections {
    unsigned int x[TREE_MAX_CHILDREN];  // the rejected tokens
    unsigned int xc[TREE_MAX_CHILDREN]; // their draft columns
    float p_sum[TREE_MAX_CHILDREN];     // the residual's sum after rejection i; ≤ 1e-12: p kept
    float q_left[TREE_MAX_CHILDREN];    // q_0's mass left after removing x_0..x_i
    int n;
};

template <bool SAMPLED>
__device__ __forceinline__ float tree_p(const LawRow &p0, const LawRow &q0, const unsigned int *__restrict__ col_of,
                                        const Rejections &rj, const unsigned int v) {
    float p = p0.prob(v);
    if (rj.n == 0) return p;
    const unsigned int c = SAMPLED ? (col_of ? col_of[v] : v) : TREE_NONE;
    const float q = (SAMPLED && c != TREE_NONE) ? q0.prob(c) : 0.f;
    float q_left = 1.f;
    bool removed = false;
    for (int i = 0; i < rj.n; ++i) {
        if (SAMPLED) {
            const float qi = removed ? 0.f : q / q_left;
            if (rj.p_sum[i] > 1e-12f) p = fmaxf(0.f, p - qi) / rj.p_sum[i];
            removed |= v == rj.x[i];
            q_left = rj.q_left[i];
        } else {
            p = v == rj.x[i] ? 0.f : p / rj.p_sum[i];
        }
    }
    return p;
}

__device__ __forceinline__ float tree_q(const LawRow &q0, const unsigned int *__restrict__ col_of,
                                        const Rejections &rj, const unsigned int v) {
    const unsigned int c = col_of ? col_of[v] : v;
    if (c == TREE_NONE) return 0.f;
    for (int i = 0; i < rj.n; ++i)
        if (v == rj.x[i]) return 0.f;
    return q0.prob(c) / (rj.n ? rj.q_left[rj.n - 1] : 1.f);
}

// meta (u32), for n_seq sequences of at most nmax nodes (TreeAcceptMeta in lib.rs):
//   [s]                                 sequence s's node count n
//   [n_seq + s]                         its root's target row (node i's row: + i)
//   [2·n_seq + s·nmax + i]              node i's token
//   [2·n_seq + (n_seq + s)·nmax + i]    node i's rank among its siblings
//   [2·n_seq + (2·n_seq + s)·nmax + i]  node i's draft row in q (TREE_NONE: none)
//   [2·n_seq + (3·n_seq + s)·nmax + i]  node i's first child's slot in the children array
//   [2·n_seq + (4·n_seq + s)·nmax + i]  node i's child count
//   [2·n_seq + (5·n_seq + s)·nmax + j]  children, node by node, in rank order
//   [2·n_seq + 6·n_seq·nmax + s·nmax + j]  uniform j's f32 bits (nmax of them)
// out [n_seq, 3 + nmax]: accepted nodes after the root, the bonus token, uniforms used, then
// the accepted nodes (root first). TREE_NONE as the count: a sampled child has probability 0
// under its parent's draft law (out[1] = the child).
extern "C" __global__ void __launch_bounds__(1024)
    kestrel_tree_accept_f32(const float *__restrict__ p, const unsigned int *__restrict__ p_laws,
                            const float *__restrict__ q, const unsigned int *__restrict__ q_laws,
                            const unsigned int *__restrict__ col_of,
                            const unsigned int *__restrict__ meta, unsigned int *__restrict__ out,
                            const int v, const int vq, const int n_seq, const int nmax,
                            const float inv_t, const int sampled) {
    pdl_enter();
    __shared__ float chunk_sum[32];
    __shared__ Rejections rj;
    const int s = blockIdx.x;
    const unsigned int *node_tok = meta + 2 * n_seq + (size_t)s * nmax;
    const unsigned int *node_rank = node_tok + (size_t)n_seq * nmax;
    const unsigned int *node_q = node_rank + (size_t)n_seq * nmax;
    const unsigned int *child_at = node_q + (size_t)n_seq * nmax;
    const unsigned int *child_n = child_at + (size_t)n_seq * nmax;
    const unsigned int *children = child_n + (size_t)n_seq * nmax;
    const float *u = reinterpret_cast<const float *>(meta + 2 * n_seq + 6 * (size_t)n_seq * nmax +
                                                     (size_t)s * nmax);
    unsigned int *o = out + (size_t)s * (3 + nmax);
    const unsigned int root_row = meta[n_seq + s];
    unsigned int node = 0, accepted = 0, used = 0;
    if (threadIdx.x == 0) o[3] = 0;
    for (;;) {
        LawRow p0{p + (size_t)(root_row + node) * v, RowLaw{}, 0.f};
        p0.law = stored_law(p_laws, root_row + node, inv_t, p0.total);
        const unsigned int q_row = node_q[node];
        LawRow q0{nullptr, RowLaw{}, 0.f};
        const bool with_q = sampled && q_row != TREE_NONE;
        if (with_q) {
            q0.row = q + (size_t)q_row * vq;
            q0.law = stored_law(q_laws, q_row, inv_t, q0.total);
        }
        __syncthreads(); // every thread is done with the last node's rejections
        if (threadIdx.x == 0) rj.n = 0;
        __syncthreads();
        unsigned int next = TREE_NONE;
        const unsigned int n_children = min(child_n[node], (unsigned int)TREE_MAX_CHILDREN);
        for (unsigned int j = 0; j < n_children && (sampled == 0 || with_q); ++j) {
            const unsigned int c = children[child_at[node] + j];
            if (sampled && node_rank[c] != j) break; // a missing rank ends the trials
            const unsigned int x = node_tok[c];
            float px, qx = 1.f;
            if (sampled) {
                px = tree_p<true>(p0, q0, col_of, rj, x);
                qx = tree_q(q0, col_of, rj, x);
                if (!(qx > 0.f)) {
                    if (threadIdx.x == 0) {
                        o[0] = TREE_NONE;
                        o[1] = c;
                    }
                    return;
                }
            } else {
                px = tree_p<false>(p0, q0, col_of, rj, x);
            }
            const float uj = u[used++];
            if ((double)uj * (double)qx < (double)px) {
                next = c;
                break;
            }
            // Rejected: the residual's sum (and q's mass left) for the next child.
            float p_sum, q_left = 0.f;
            if (sampled) {
                auto r = [&](const int e, const int end) {
                    return e < end ? fmaxf(0.f, tree_p<true>(p0, q0, col_of, rj, e) - tree_q(q0, col_of, rj, e)) : 0.f;
                };
                p_sum = chunk_sums(r, v, chunk_sum);
                // q's mass left once x is gone too, summed afresh over the draft's columns (as
                // the host sums its q): exactly 0 once every kept token has been tried.
                const unsigned int xc = col_of ? col_of[x] : x;
                auto left = [&](const int c, const int end) {
                    if (c >= end || (unsigned int)c == xc) return 0.f;
                    for (int i = 0; i < rj.n; ++i)
                        if ((unsigned int)c == rj.xc[i]) return 0.f;
                    return q0.prob(c);
                };
                q_left = chunk_sums(left, vq, chunk_sum);
            } else {
                p_sum = 1.f - px;
            }
            __syncthreads(); // every thread has read rj
            if (threadIdx.x == 0) {
                rj.x[rj.n] = x;
                rj.xc[rj.n] = sampled ? (col_of ? col_of[x] : x) : TREE_NONE;
                rj.p_sum[rj.n] = p_sum;
                rj.q_left[rj.n] = q_left;
                rj.n += 1;
            }
            __syncthreads();
            if (sampled && !(q_left / (rj.n > 1 ? rj.q_left[rj.n - 2] : 1.f) > 1e-12f)) break;
        }
        if (next == TREE_NONE) break;
        node = next;
        ++accepted;
        if (threadIdx.x == 0) o[3 + accepted] = node;
    }
    // The bonus from the current p.
    LawRow p0{p + (size_t)(root_row + node) * v, RowLaw{}, 0.f};
    p0.law = stored_law(p_laws, root_row + node, inv_t, p0.total);
    LawRow q0{nullptr, RowLaw{}, 0.f};
    if (sampled && node_q[node] != TREE_NONE) {
        q0.row = q + (size_t)node_q[node] * vq;
        q0.law = stored_law(q_laws, node_q[node], inv_t, q0.total);
    }
    auto bonus = [&](const int e, const int end) {
        if (e >= end) return 0.f;
        return sampled ? tree_p<true>(p0, q0, col_of, rj, e) : tree_p<false>(p0, q0, col_of, rj, e);
    };
    const float total = chunk_sums(bonus, v, chunk_sum);
    const unsigned int token = inverse_cdf(bonus, v, u[used++], total, chunk_sum, p0.law.idx);
    if (threadIdx.x == 0) {
        o[0] = accepted;
        o[1] = token;
        o[2] = used;
    }
}

// Sampled children of a static tree's expanded nodes (kestrel-runtime's
// sample_without_replacement): each row draws k distinct draft columns from its warped law, a
// draw by inverse CDF over the weights of the columns not drawn yet; when none is left the
// row's first draw (0 for none) fills in, taking no uniform. One block a sequence walks its
// `width` rows (row s·width + j) in order, taking its uniforms (`uniforms`: [n_seq, width·k])
// in the host's order; out: [rows, k] columns, then used[n_seq] uniforms.
extern "C" __global__ void __launch_bounds__(1024)
    kestrel_draw_children_f32(const float *__restrict__ x, const unsigned int *__restrict__ laws,
                              const float *__restrict__ uniforms, unsigned int *__restrict__ out,
                              const int v, const int n_seq, const int width, const int k,
                              const float inv_t) {
    pdl_enter();
    __shared__ float chunk_sum[32];
    __shared__ unsigned int drawn[TREE_MAX_CHILDREN];
    const int s = blockIdx.x;
    const float *u = uniforms + (size_t)s * width * k;
    unsigned int used = 0;
    for (int j = 0; j < width; ++j) {
        const unsigned int r = s * width + j;
        float total0;
        const LawRow q{x + (size_t)r * v, stored_law(laws, r, inv_t, total0), 0.f};
        int n = 0;
        for (int d = 0; d < k; ++d) {
            auto w = [&](const int e, const int end) {
                if (e >= end) return 0.f;
                for (int i = 0; i < n; ++i)
                    if ((unsigned int)e == drawn[i]) return 0.f;
                return q.law.one_hot() ? (e == (int)q.law.idx ? 1.f : 0.f) : q.law.weight(q.row, e, end);
            };
            const float total = chunk_sums(w, v, chunk_sum);
            unsigned int t;
            if (total > 0.f) {
                t = inverse_cdf(w, v, u[used++], total, chunk_sum, q.law.idx);
            } else {
                t = n > 0 ? drawn[0] : 0u;
            }
            __syncthreads(); // every thread has read drawn
            if (threadIdx.x == 0) {
                out[(size_t)r * k + d] = t;
                drawn[n] = t;
            }
            ++n;
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) out[(size_t)n_seq * width * k + s] = used;
}

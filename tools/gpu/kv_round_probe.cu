// Probe: what one round of the decode attention's K loads costs, and why. Session 27's
// stamps put ~3,500 cycles on each round (a lane's 8 × 16-byte loads of its slot's K row,
// then their use) where a DRAM round trip at rest is ~1,000-1,300, and session 58's cluster
// probe found spreading a row's warps over more multiprocessors no faster. This kernel does
// only that round, the way paged_attention does (lane j of warp w reads the K row of slot
// w · 32 + j of its head, 16 bytes × 8 at once, after reading the slot id), and stamps it
// (clock64, lane 0 of each warp, its multiprocessor's id), in variants that each change one
// thing:
//   pool      the shipped layout, [slots, n_kv, d]: a head's rows 8 KiB apart (Llama-2-7B),
//             slots 0..159 of a 16 GiB pool, 32 heads a block each, 8 warps (5 with rows)
//   spread    the same rows, one warp a block (160 blocks of 32 threads per 32 heads)
//   headmajor a head's rows contiguous ([n_kv, slots, d]: 256 bytes apart)
//   scatter   the shipped layout, slots spread over the whole 16 GiB pool (TLB reach)
//   warm      `pool` again without flushing L2 first (the rows in L2)
//   coalesced `pool`'s rows read two whole rows an instruction (lanes 0-15 one row's 16
//             vectors, 16-31 the next's), the same bytes a round; coal-warm from L2
// Each variant runs after a 256 MiB write that evicts L2 (except `warm`), 5 times; the
// table gives the median over warps with rows of the first and the second round (the same
// rows' next 128 bytes) in cycles, and the distinct multiprocessors the warps ran on.
//   nvcc -O3 -std=c++17 -arch=sm_90 -o kv_round_probe tools/gpu/kv_round_probe.cu && ./kv_round_probe
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <vector>

#define CHECK(x)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (x);                                                                  \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));                           \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

constexpr int HEADS = 32, D = 128, ROWS = 160, WARPS = 8, ROUNDS = 2, KB = 8;

struct Stamp {
    long long round[ROUNDS];
    int smid;
};

__device__ __forceinline__ int smid() {
    int id;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
    return id;
}

// Row r of head h is at pool + (slots[r] · row_stride + h · head_stride) 16-byte vectors.
// warps_per_block 8: block = head; 1: block = (head, warp), blockIdx.x = head · 8 + warp.
__global__ void k_round(const uint4 *__restrict__ pool, const unsigned int *__restrict__ slots,
                        const size_t row_stride, const size_t head_stride,
                        const int warps_per_block, const bool coalesced, Stamp *stamps, float *sink) {
    const int lane = threadIdx.x % 32;
    const int h = warps_per_block == WARPS ? blockIdx.x : blockIdx.x / WARPS;
    const int w = warps_per_block == WARPS ? threadIdx.x / 32 : blockIdx.x % WARPS;
    const int r = w * 32 + lane;
    if (w * 32 >= ROWS) return;
    float acc = 0.f;
    Stamp st;
    const unsigned int slot = r < ROWS ? slots[r] : 0;
    const uint4 *row = pool + (size_t)slot * row_stride + (size_t)h * head_stride;
    // Coalesced: load u of round k reads row w·32 + 16k + 2u + lane/16, vector lane % 16 (the
    // warp's 32 rows × 256 bytes in two rounds of 8 loads, two whole rows an instruction).
    const int half = lane / 16, vec = lane % 16;
    for (int round = 0; round < ROUNDS; ++round) {
        const long long t0 = clock64();
        uint4 raw[KB];
#pragma unroll
        for (int u = 0; u < KB; ++u) {
            if (coalesced) {
                const int rr = w * 32 + 16 * round + 2 * u + half;
                const unsigned int sl = __shfl_sync(0xffffffffu, slot, rr % 32);
                raw[u] = rr < ROWS ? pool[(size_t)sl * row_stride + (size_t)h * head_stride + vec] : make_uint4(0, 0, 0, 0);
            } else {
                raw[u] = row[round * KB + u];
            }
        }
#pragma unroll
        for (int u = 0; u < KB; ++u)
            acc += __uint_as_float(raw[u].x) + __uint_as_float(raw[u].y) + __uint_as_float(raw[u].z) +
                   __uint_as_float(raw[u].w);
        // Every lane's loads used before the stamp, as the warp's reductions need them.
        acc = __shfl_xor_sync(0xffffffffu, acc, 16) + acc;
        st.round[round] = clock64() - t0;
    }
    if (lane == 0) {
        st.smid = smid();
        stamps[h * WARPS + w] = st;
    }
    if (acc == 12345.f) *sink = acc;
}

__global__ void evict(uint4 *buf, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        buf[i] = make_uint4(i, i, i, i);
}

int main() {
    const size_t pool_bytes = 16ull << 30, evict_bytes = 256ull << 20;
    uint4 *pool, *ev;
    unsigned int *slots;
    Stamp *stamps;
    float *sink;
    CHECK(cudaMalloc(&pool, pool_bytes));
    CHECK(cudaMemset(pool, 0, pool_bytes));
    CHECK(cudaMalloc(&ev, evict_bytes));
    CHECK(cudaMalloc(&slots, ROWS * sizeof(unsigned int)));
    CHECK(cudaMalloc(&stamps, HEADS * WARPS * sizeof(Stamp)));
    CHECK(cudaMalloc(&sink, sizeof(float)));
    const size_t vec_row = HEADS * D * 2 / 16; // a slot's K row, all heads: 8 KiB
    const size_t vec_head = D * 2 / 16;        // one head's: 256 bytes
    const size_t total_slots = pool_bytes / (vec_row * 16);
    struct Variant {
        const char *name;
        size_t row_stride, head_stride;
        int warps_per_block;
        bool scatter, warm, coalesced;
    };
    const Variant variants[] = {
        {"pool", vec_row, vec_head, WARPS, false, false, false},
        {"spread", vec_row, vec_head, 1, false, false, false},
        {"headmajor", vec_head, ROWS * vec_head, WARPS, false, false, false},
        {"scatter", vec_row, vec_head, WARPS, true, false, false},
        {"warm", vec_row, vec_head, WARPS, false, true, false},
        {"coalesced", vec_row, vec_head, WARPS, false, false, true},
        {"coal-warm", vec_row, vec_head, WARPS, false, true, true},
    };
    printf("%-10s %6s %10s %10s %6s\n", "variant", "run", "round 1", "round 2", "SMs");
    for (const Variant &v : variants) {
        std::vector<unsigned int> host_slots(ROWS);
        for (int r = 0; r < ROWS; ++r)
            host_slots[r] = v.scatter ? (unsigned int)(((size_t)r * 104729u + 7) % total_slots) : r;
        CHECK(cudaMemcpy(slots, host_slots.data(), ROWS * sizeof(unsigned int), cudaMemcpyHostToDevice));
        for (int run = 0; run < 5; ++run) {
            if (!v.warm || run == 0) evict<<<1024, 256>>>(ev, evict_bytes / 16);
            CHECK(cudaMemset(stamps, 0, HEADS * WARPS * sizeof(Stamp)));
            const int blocks = v.warps_per_block == WARPS ? HEADS : HEADS * WARPS;
            k_round<<<blocks, 32 * v.warps_per_block>>>(pool, slots, v.row_stride, v.head_stride,
                                                        v.warps_per_block, v.coalesced, stamps, sink);
            CHECK(cudaDeviceSynchronize());
            std::vector<Stamp> host(HEADS * WARPS);
            CHECK(cudaMemcpy(host.data(), stamps, host.size() * sizeof(Stamp), cudaMemcpyDeviceToHost));
            std::vector<long long> r1, r2;
            std::set<int> sms;
            for (int h = 0; h < HEADS; ++h)
                for (int w = 0; w * 32 < ROWS; ++w) {
                    const Stamp &s = host[h * WARPS + w];
                    r1.push_back(s.round[0]);
                    r2.push_back(s.round[1]);
                    sms.insert(s.smid);
                }
            std::sort(r1.begin(), r1.end());
            std::sort(r2.begin(), r2.end());
            printf("%-10s %6d %10lld %10lld %6zu\n", v.name, run, r1[r1.size() / 2], r2[r2.size() / 2],
                   sms.size());
        }
    }
    return 0;
}

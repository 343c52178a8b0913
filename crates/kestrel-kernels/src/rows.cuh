// Row gather and scatter for any dtype: the embedding lookup, a step's output rows, the EAGLE
// node outputs and the drafted-token pool. candle's `index_select` / `scatter_set` would do,
// but loading candle's indexing module costs the process ~90 MiB of device memory on the
// H200 (docs/gpu-results.md, session 15), a third of SmolLM2's weights.
//
// Rows are copied as words of W (2, 4 or 16 bytes: the host picks the widest that divides
// the row's bytes and both tensors' offsets), one thread per word, `width` words per row.
// An id past the source's rows (u32::MAX included) gathers a zero row, as candle's
// `index_select` does for u32::MAX; a scatter to such an id writes nothing.

template <typename W>
__device__ void gather_rows(const W *__restrict__ src, W *__restrict__ dst,
                            const unsigned int *__restrict__ ids, const size_t total,
                            const unsigned int n_src, const int width) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const size_t r = i / width;
    const unsigned int id = ids[r];
    dst[i] = id < n_src ? src[(size_t)id * width + i % width] : W{};
}

template <typename W>
__device__ void scatter_rows(W *__restrict__ dst, const W *__restrict__ src,
                             const unsigned int *__restrict__ ids, const size_t total,
                             const unsigned int n_dst, const int width) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    const unsigned int id = ids[i / width];
    if (id < n_dst) dst[(size_t)id * width + i % width] = src[i];
}

#define KESTREL_ROW_OPS(W, SUFFIX)                                                              \
    extern "C" __global__ void kestrel_gather_rows_##SUFFIX(                                    \
        const W *src, W *dst, const unsigned int *ids, const size_t total,                      \
        const unsigned int n_src, const int width) {                                            \
        pdl_enter();                                                                            \
        gather_rows<W>(src, dst, ids, total, n_src, width);                                     \
    }                                                                                           \
    extern "C" __global__ void kestrel_scatter_rows_##SUFFIX(                                   \
        W *dst, const W *src, const unsigned int *ids, const size_t total,                      \
        const unsigned int n_dst, const int width) {                                            \
        pdl_enter();                                                                            \
        scatter_rows<W>(dst, src, ids, total, n_dst, width);                                    \
    }

KESTREL_ROW_OPS(unsigned short, w2)
KESTREL_ROW_OPS(unsigned int, w4)
KESTREL_ROW_OPS(uint4, w16)

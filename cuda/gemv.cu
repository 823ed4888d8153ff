// gemv.cu — the decoder's weight products for a few tokens: y[t, n] = sum_k x[t, k] w[n, k].
//
// Decoding one token per sequence multiplies every weight matrix w [N, K] (16-bit, row-major, as
// stored) by n_tok <= NB activation rows x [n_tok, K]: a matrix-vector product that reads each
// weight once and is bound by that read. cuBLAS's GEMM with 1-4 columns measured 2.7-4.1 TB/s on
// the H200 by shape; these kernels are written to stream w at the
// bandwidth limit. Two versions:
//
// v2 gemv_split (the default): grid (ceil(N / kRows)), block 128: block b computes rows
// n0 = b kRows .. n0 + kRows - 1 for every token, its 128 threads splitting the K chunks between
// them (thread i walks c = i, i + 128, ...), kU chunks of each row in flight per thread; reduced
// over each warp by shuffles, then over the 4 warps through shared memory. A 4096-wide row is one
// round of loads for the whole block, and N = 4096 rows make 2048 blocks: enough bytes in flight
// on every SM even for the layer's smallest matrices (v1 gave one warp two whole rows: 15 warps
// an SM and 14 dependent rounds at K = 14336, 2.7 TB/s).
//
// v1 gemv_rows: grid (ceil(N / (4 * kRows))), block 128: warp w of block b computes rows n0 .. n0 + kRows - 1,
// n0 = (4 b + w) kRows, for every token. Lane l walks the 16-byte chunks c = l, l + 32, ... of
// those rows, kU chunks of each row in flight (w read once, streaming: __ldcs); x's chunks come
// through L1 (every warp reads the same x). f32 accumulators, reduced over the warp by shuffles;
// y is f32 [n_tok, N], written (accumulate = 0) or added to (accumulate = 1: the residual update
// x += o W^T in one launch). K % 8 == 0 (whole 16-byte chunks), checked by the caller.
//
// v2 with the next small step as its epilogue, one launch instead of two and no f32 product in
// between (llama_min's decode step at batch 1): the block's two rows are the pair the epilogue needs.
//   gemv_rope  the QKV product + rotary + K/V append: rows i and i + D/2 of a head;
//   gemv_glu   the gate/up product + SiLU * up: gate row b and up row I + b.
// Both round as decoder.cu's rope_append / silu_mul after gemv_split do (decoder_math.cuh): the
// same results bit for bit.
// CPU references: llama_min/reference.py weight_product, rope_append, silu_mul (tests/test_gpu_gemv.py).
#include "common.cuh"
#include "decoder_math.cuh"

#define SC_GEMV_ROWS 2           // rows per warp (v1) / per block (v2)
#define SC_GEMV_U 4              // chunks of each row in flight per thread

// The weight chunks c0 + kStride u (u < U) of rows n0 + r row_stride (r < R), streaming (read once:
// __ldcs); zeros past the last row or chunk.
template <typename T, int R, int U, int kStride>
__device__ __forceinline__ void load_weight_chunks(const T* __restrict__ w, int n0, int row_stride, int N, int K,
                                                   int c0, int chunks, Chunk<T> (&wc)[R][U]) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int c = c0 + kStride * u, n = n0 + r * row_stride;
            wc[r][u].w[0] = c < chunks && n < N ? __ldcs(reinterpret_cast<const uint4*>(w + (i64)n * K) + c)
                                                : make_uint4(0u, 0u, 0u, 0u);
        }
}

// acc[r][t] += (chunk c of weight row r) . (chunk c of x's token t) for c = c0 + kStride u < chunks;
// x's chunks through L1 (every warp reads the same x).
template <typename T, int NB, int R, int U, int kStride>
__device__ __forceinline__ void fma_weight_chunks(const Chunk<T> (&wc)[R][U], const T* __restrict__ x, int K,
                                                  int c0, int chunks, int n_tok, float (&acc)[R][NB]) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = c0 + kStride * u;
        if (c >= chunks) break;
        float wf[R][8];
#pragma unroll
        for (int r = 0; r < R; ++r) wc[r][u].to_floats(wf[r]);
#pragma unroll
        for (int t = 0; t < NB; ++t) {
            if (t >= n_tok) break;
            Chunk<T> xc;
            xc.w[0] = __ldg(reinterpret_cast<const uint4*>(x + (i64)t * K) + c);
            float xf[8];
            xc.to_floats(xf);
#pragma unroll
            for (int r = 0; r < R; ++r)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][t] = fmaf(wf[r][i], xf[i], acc[r][t]);
        }
    }
}

template <typename T, int NB>
__global__ void __launch_bounds__(SC_NTHREADS)
gemv_rows(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ y, int N, int K, int n_tok,
           int accumulate) {
    static_assert(sizeof(T) == 2, "gemv: 16-bit weights");
    constexpr int R = SC_GEMV_ROWS, U = SC_GEMV_U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * (SC_NTHREADS / 32) + warp) * R;
    pdl_launch_dependents();
    pdl_wait();                                               // x and y come from earlier kernels
    if (n0 >= N) return;                                      // whole warp
    const int chunks = K / 8;
    float acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NB; ++t) acc[r][t] = 0.f;
    for (int c0 = lane; c0 < chunks; c0 += 32 * U) {          // warp-uniform trip count
        Chunk<T> wc[R][U];                                    // 8 elements: one uint4
        load_weight_chunks<T, R, U, 32>(w, n0, 1, N, K, c0, chunks, wc);  // every weight load first
        fma_weight_chunks<T, NB, R, U, 32>(wc, x, K, c0, chunks, n_tok, acc);
    }
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NB; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0 && t < n_tok && n0 + r < N) {
                float* dst = y + (i64)t * N + n0 + r;
                *dst = accumulate ? *dst + v : v;
            }
        }
}

// v2's body: rows n0 + r row_stride (r < R) of w times every token's x, summed over the block: on
// return (after a barrier) partial[i][r][t] holds warp i's sums; gemv_row_sum adds them in order.
template <typename T, int NB>
__device__ __forceinline__ void gemv_block_sums(const T* __restrict__ w, const T* __restrict__ x, int n0,
                                                int row_stride, int N, int K, int n_tok,
                                                float (&partial)[SC_NTHREADS / 32][SC_GEMV_ROWS][NB]) {
    static_assert(sizeof(T) == 2, "gemv: 16-bit weights");
    constexpr int R = SC_GEMV_ROWS, U = SC_GEMV_U;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int chunks = K / 8;
    pdl_launch_dependents();
    float acc[R][NB];
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NB; ++t) acc[r][t] = 0.f;
    for (int c0 = threadIdx.x; c0 < chunks; c0 += SC_NTHREADS * U) {
        Chunk<T> wc[R][U];
        load_weight_chunks<T, R, U, SC_NTHREADS>(w, n0, row_stride, N, K, c0, chunks, wc);   // weight loads first
        pdl_wait();                 // the weights are in flight; x is the previous kernel's output
        fma_weight_chunks<T, NB, R, U, SC_NTHREADS>(wc, x, K, c0, chunks, n_tok, acc);
    }
    pdl_wait();                     // (threads without a chunk) before anything is read or written
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int t = 0; t < NB; ++t) {
            const float v = warp_sum(acc[r][t]);
            if (lane == 0) partial[warp][r][t] = v;
        }
    __syncthreads();
}

template <int NB>
__device__ __forceinline__ float gemv_row_sum(const float (&partial)[SC_NTHREADS / 32][SC_GEMV_ROWS][NB], int r,
                                              int t) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < SC_NTHREADS / 32; ++i) v += partial[i][r][t];
    return v;
}

// y [n_tok, N] f32 = (or +=, accumulate) x w^T; block b: rows 2b, 2b + 1.
template <typename T, int NB>
__global__ void __launch_bounds__(SC_NTHREADS)
gemv_split(const T* __restrict__ w, const T* __restrict__ x, float* __restrict__ y, int N, int K, int n_tok,
           int accumulate) {
    __shared__ float partial[SC_NTHREADS / 32][SC_GEMV_ROWS][NB];
    const int n0 = blockIdx.x * SC_GEMV_ROWS;
    gemv_block_sums<T, NB>(w, x, n0, 1, N, K, n_tok, partial);
    if (threadIdx.x < SC_GEMV_ROWS * NB) {
        const int r = threadIdx.x / NB, t = threadIdx.x - r * NB;
        if (t < n_tok && n0 + r < N) {
            const float v = gemv_row_sum<NB>(partial, r, t);
            float* dst = y + (i64)t * N + n0 + r;
            *dst = accumulate ? *dst + v : v;
        }
    }
}

// The QKV product with rotary and the K/V append in its epilogue (decoder.cu rope_append without
// the f32 product in between, bit-identical to the two launches): w [(H + 2 KVH) D, K], block b
// computes head h = b / (D/2)'s rows i and i + D/2 (i = b % (D/2)), the pair a rotation mixes, and
// stores them as store_rope_pair does. cos/sin [P, D/2] f32, pos [n_tok] int32; q_out [n_tok, H, D],
// caches of Tkv as rope_append's: [n_tok, L_max, KVH, D] (page_size 0) or page pools
// [num_pages, page_size, KVH, D] with block_table [n_tok, max_pages] int32, and a feature-blocked
// k_cache with key_block > 0 (blocked_key_at). Grid (H + 2 KVH) D / 2.
template <typename T, typename Tkv, int NB>
__global__ void __launch_bounds__(SC_NTHREADS)
gemv_rope(const T* __restrict__ w, const T* __restrict__ x, int K, int n_tok, const float* __restrict__ cos_t,
          const float* __restrict__ sin_t, const int* __restrict__ pos, Tkv* __restrict__ q_out,
          Tkv* __restrict__ k_cache, Tkv* __restrict__ v_cache, int H, int KVH, int D, i64 L_max,
          const int* __restrict__ block_table, int max_pages, int page_size, int key_block) {
    static_assert(SC_GEMV_ROWS == 2, "one rotary pair a block");
    __shared__ float partial[SC_NTHREADS / 32][SC_GEMV_ROWS][NB];
    const int half = D / 2, h = blockIdx.x / half, i = blockIdx.x - h * half;
    gemv_block_sums<T, NB>(w, x, h * D + i, half, (H + 2 * KVH) * D, K, n_tok, partial);
    const int t = threadIdx.x;
    if (t < n_tok) {
        const i64 p = pos[t];
        store_rope_pair<Tkv>(gemv_row_sum<NB>(partial, 0, t), gemv_row_sum<NB>(partial, 1, t), h, i, t, p,
                             kv_cache_row(t, p, L_max, block_table, max_pages, page_size), cos_t, sin_t, q_out,
                             k_cache, v_cache, H, KVH, D, L_max, key_block);
    }
}

// The gate/up product with SiLU * up in its epilogue (decoder.cu silu_mul without the f32 product
// in between, bit-identical to the two launches): w [2 I, K] (gate rows, then up rows), block b
// computes rows b and I + b; a [n_tok, I] (To) = silu(gate) * up. Grid I.
template <typename T, typename To, int NB>
__global__ void __launch_bounds__(SC_NTHREADS)
gemv_glu(const T* __restrict__ w, const T* __restrict__ x, To* __restrict__ a, int I, int K, int n_tok) {
    static_assert(SC_GEMV_ROWS == 2, "a gate and an up row a block");
    __shared__ float partial[SC_NTHREADS / 32][SC_GEMV_ROWS][NB];
    gemv_block_sums<T, NB>(w, x, blockIdx.x, I, 2 * I, K, n_tok, partial);
    const int t = threadIdx.x;
    if (t < n_tok)
        a[(i64)t * I + blockIdx.x] = from_float<To>(silu_times(gemv_row_sum<NB>(partial, 0, t),
                                                               gemv_row_sum<NB>(partial, 1, t)));
}

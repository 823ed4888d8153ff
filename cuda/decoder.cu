// decoder.cu — the small steps of a Llama decode step, one kernel each.
//
// At batch 1 a decode step moves ~15 GB of weights through ~7 GEMVs a layer; everything between
// them (RMSNorm, rotary, the K/V append, SiLU * up, casts) is a few KB. Written as CuPy array
// expressions those few KB cost ~60 kernels a layer, ~2-3 µs each even inside a CUDA graph:
// ~4 ms of an 8 ms step (H200, 8B shape). Here each step is one launch.
//
// Storage types as in common.cuh: float, f16_t, bf16_t (bits). Tp = the dtype of a weight product's
// output (float or f16_t: the matmul dtype, or f32 from gemv.cu), Tkv = the KV-cache dtype. All
// arithmetic in f32, each product and sum rounded as the CuPy expressions it replaces round them
// (__fmul_rn & co. keep nvcc from contracting into FMAs), so rotary and SiLU are bit-identical to
// llama_min's array path.
// Each kernel lets the next start early and waits for its predecessor before reading (common.cuh).
// CPU references: llama_min/reference.py rms_norm, rope_append, silu_mul (tests/test_gpu_decoder.py).
#include "common.cuh"
#include "decoder_math.cuh"

#define SC_DECODER_THREADS 256
#define SC_RMS_THREADS 1024

// out [N, d] (To) = x * (1 / sqrt(mean(x * x) + eps)) * w, x [N, d] f32, w [d] f32.
// grid (N), block SC_RMS_THREADS: one block per row, wide enough that a 4096-wide row is four
// independent loads a thread (the step's latency, not its bytes, is what costs here).
template <typename To>
__global__ void __launch_bounds__(SC_RMS_THREADS)
rms_norm(const float* __restrict__ x, const float* __restrict__ w, To* __restrict__ out, int d, float eps) {
    __shared__ float warp_sums[SC_RMS_THREADS / 32];
    const float* row = x + (i64)blockIdx.x * d;
    pdl_launch_dependents();
    pdl_wait();
    float ss = 0.f;
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += SC_RMS_THREADS) ss = fmaf(row[i], row[i], ss);
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int i = 0; i < SC_RMS_THREADS / 32; ++i) total += warp_sums[i];
    const float inv = 1.0f / sqrtf(total / (float)d + eps);
    To* dst = out + (i64)blockIdx.x * d;
#pragma unroll 4
    for (int i = threadIdx.x; i < d; i += SC_RMS_THREADS)
        dst[i] = from_float<To>(__fmul_rn(__fmul_rn(row[i], inv), w[i]));
}

// Rotary embedding of q and k, and the K/V append, for one token per sequence n < N:
//   qkv [N, (H + 2 KVH) D] (Tp, the QKV product: q heads, then k heads, then v heads),
//   cos, sin [P, D/2] f32 tables, pos [N] int32 (the token's position = its cache row) ->
//   q_out [N, H, D] (Tkv) rotated q; k_cache row pos[n] of sequence n = rotated k; v_cache's = v.
// The caches are [N, L_max, KVH, D] (page_size 0), or page pools [num_pages, page_size, KVH, D]
// with block_table [N, max_pages] int32 (kv_cache_row, decoder_math.cuh): the page of row pos[n]
// must be in the table. key_block FB > 0 (contiguous caches only): k_cache is feature-blocked,
// [N, KVH, NP, D / FB, P, FB] (blocked_key_at), v_cache as before.
// Rotation (HF rotate_half): for i < D/2, (a, b) = (x_i, x_{i + D/2}) with c, s = cos/sin[pos, i]:
//   x_i <- a c - b s,  x_{i + D/2} <- b c + a s.
// grid (N, ceil((H + 2 KVH) D/2 / SC_DECODER_THREADS)), block SC_DECODER_THREADS: one pair a
// thread (a grid-stride loop beyond), so the step is one round of loads, not one per 256 pairs.
template <typename Tp, typename Tkv>
__global__ void __launch_bounds__(SC_DECODER_THREADS)
rope_append(const Tp* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
            const int* __restrict__ pos, Tkv* __restrict__ q_out, Tkv* __restrict__ k_cache,
            Tkv* __restrict__ v_cache, int H, int KVH, int D, i64 L_max, const int* __restrict__ block_table,
            int max_pages, int page_size, int key_block) {
    const int n = blockIdx.x, half = D / 2, heads = H + 2 * KVH;
    pdl_launch_dependents();
    pdl_wait();
    const i64 p = pos[n], r = kv_cache_row(n, p, L_max, block_table, max_pages, page_size);
    const Tp* row = qkv + (i64)n * heads * D;
    for (int j = blockIdx.y * SC_DECODER_THREADS + threadIdx.x; j < heads * half; j += gridDim.y * SC_DECODER_THREADS) {
        const int h = j / half, i = j - h * half;
        store_rope_pair<Tkv>(to_float(row[h * D + i]), to_float(row[h * D + i + half]), h, i, n, p, r, cos_t,
                             sin_t, q_out, k_cache, v_cache, H, KVH, D, L_max, key_block);
    }
}

// a [N, I] (To) = silu(g) * u, (g, u) = (gu[:, :I], gu[:, I:]) (Tp), silu(g) = g * 0.5 (1 + tanh(g / 2)).
// grid-stride over the N I outputs.
template <typename Tp, typename To>
__global__ void __launch_bounds__(SC_DECODER_THREADS)
silu_mul(const Tp* __restrict__ gu, To* __restrict__ a, int I, i64 total) {
    pdl_launch_dependents();
    pdl_wait();
    for (i64 e = (i64)blockIdx.x * SC_DECODER_THREADS + threadIdx.x; e < total;
         e += (i64)gridDim.x * SC_DECODER_THREADS) {
        const i64 n = e / I, i = e - n * I;
        a[e] = from_float<To>(silu_times(to_float(gu[n * 2 * I + i]), to_float(gu[n * 2 * I + I + i])));
    }
}

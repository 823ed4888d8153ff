// decoder_math.cuh — the element-wise math of the decode step's small steps, shared by decoder.cu's
// kernels and gemv.cu's fused epilogues, so that both round every product and sum alike (bit for
// bit; __fmul_rn & co. keep nvcc from contracting into FMAs, as the CuPy expressions they replace).
#pragma once
#include "common.cuh"

// silu(g) * u, silu(g) = g * 0.5 (1 + tanh(g / 2)).
__device__ __forceinline__ float silu_times(float g, float u) {
    const float sig = __fmul_rn(0.5f, __fadd_rn(1.0f, tanhf(__fmul_rn(0.5f, g))));
    return __fmul_rn(__fmul_rn(g, sig), u);
}

// The row of token position p of sequence n in a K or V cache seen as rows of [KVH, D]:
//   contiguous (page_size 0, as the attention kernels' CacheRows; the table is then not read):
//   [N, L_max, KVH, D], row n L_max + p;
//   paged (NHD, FlashInfer's and vLLM's layout): a page pool [num_pages, page_size, KVH, D] and
//   block_table [N, max_pages] int32 (the page ids of sequence n in order), row
//   block_table[n, p / page_size] page_size + p % page_size.
__device__ __forceinline__ i64 kv_cache_row(i64 n, i64 p, i64 L_max, const int* __restrict__ block_table,
                                            int max_pages, int page_size) {
    if (page_size == 0) return n * L_max + p;
    return (i64)block_table[n * max_pages + p / page_size] * page_size + p % page_size;
}

// Where element f of KV head g's key of position p of sequence n goes in a feature-blocked
// k_cache [N, KVH, NP, D / FB, P, FB] (FB = key_block 16 | 32, pages of P = SC_KEY_PAGE_ROWS rows,
// NP = ceil(L_max / P); contiguous caches only; santa_cupy/key_layout.py).
__device__ __forceinline__ i64 blocked_key_at(i64 n, i64 p, int g, int f, int KVH, int D, i64 L_max, int key_block) {
    constexpr int P = SC_KEY_PAGE_ROWS;
    const i64 page = (n * KVH + g) * ((L_max + P - 1) / P) + p / P;
    return ((page * (D / key_block) + f / key_block) * P + p % P) * key_block + f % key_block;
}

// Element pair (a, b) = (x_i, x_{i + D/2}) of head h of token n's QKV product, to where it goes:
// q heads (h < H) rotated into q_out [N, H, D]; k heads rotated into row `row` of k_cache (seen as
// [rows, KVH, D]: kv_cache_row of the token's position p), or with key_block > 0 into the blocked
// k_cache at blocked_key_at (L_max rows a sequence); v heads copied into row `row` of v_cache.
// Rotation (HF rotate_half) by c, s = cos/sin[p, i]: x_i <- a c - b s, x_{i + D/2} <- b c + a s.
template <typename Tkv>
__device__ __forceinline__ void store_rope_pair(float a, float b, int h, int i, i64 n, i64 p, i64 row,
                                                const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                                Tkv* __restrict__ q_out, Tkv* __restrict__ k_cache,
                                                Tkv* __restrict__ v_cache, int H, int KVH, int D, i64 L_max,
                                                int key_block) {
    const int half = D / 2;
    if (h >= H + KVH) {                                       // v: copied
        Tkv* dst = v_cache + (row * KVH + (h - H - KVH)) * D;
        dst[i] = from_float<Tkv>(a);
        dst[i + half] = from_float<Tkv>(b);
        return;
    }
    const float c = cos_t[p * half + i], s = sin_t[p * half + i];
    const Tkv lo = from_float<Tkv>(__fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s)));
    const Tkv hi = from_float<Tkv>(__fadd_rn(__fmul_rn(b, c), __fmul_rn(a, s)));
    if (h < H) {
        Tkv* dst = q_out + (n * H + h) * D;
        dst[i] = lo;
        dst[i + half] = hi;
        return;
    }
    if (key_block == 0) {
        Tkv* dst = k_cache + (row * KVH + (h - H)) * D;
        dst[i] = lo;
        dst[i + half] = hi;
        return;
    }
    k_cache[blocked_key_at(n, p, h - H, i, KVH, D, L_max, key_block)] = lo;
    k_cache[blocked_key_at(n, p, h - H, i + half, KVH, D, L_max, key_block)] = hi;
}

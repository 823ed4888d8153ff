// santa_score.cu — S2ANTA pass 1 (score stage): q K^T per tile, per-tile stats, score stash.
//
// grid (T_max, KVH, B), block SC_NTHREADS; tile t covers rows [t*BN, min((t+1)*BN, n_b)).
// K rows are streamed into registers (stream.cuh), scores land in shared memory, then
// scores[b, h, j] (float32, natural-log scale) is written for j < n_b and
// part_s[b, h, t] = (m_t, l_t, 0, 0). Tiles past n_b exit at once.
//
// Shared memory: s [G][BN] f32 | m, l [G] f32
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"

template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
santa_score(const T* __restrict__ q, const T* __restrict__ k_cache, const int* __restrict__ lengths,
            float scale, int H, int KVH, i64 L_max, int T_max, float* __restrict__ scores,
            float4* __restrict__ part_s) {
    const int t = blockIdx.x, g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const i64 row0 = (i64)t * BN;
    if (row0 >= n) return;
    const int nrows = (int)min((i64)BN, n - row0);

    __shared__ float s[G * BN];
    __shared__ float m[G], l[G];
    GroupQuery<T, D, G> gq;
    gq.load(q, b, g, H, scale);
    stream_tile_scores<T, D, G, BN>(s, gq, k_cache, b, row0, nrows, g, L_max, KVH);
    __syncthreads();
    tile_stats<BN>(m, l, s, G, nrows);
    const i64 head0 = b * H + (i64)g * G;
    for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
        const int h = idx / BN, j = idx % BN;
        if (j < nrows) scores[(head0 + h) * L_max + row0 + j] = s[idx];
    }
    __syncthreads();
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
        part_s[(head0 + h) * T_max + t] = make_float4(m[h], l[h], 0.f, 0.f);
}

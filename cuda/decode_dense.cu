// decode_dense.cu — exact split-KV decode attention (flash-decoding), the baseline and fallback.
//
// grid  (n_splits, KVH, B), block SC_NTHREADS.
// Block (s, g, b) streams tiles [s*tiles_per_split, (s+1)*tiles_per_split) of sequence b's KV
// head g through shared memory, keeping an online softmax for the G query heads of the group.
// Outputs per (b, h, split): part_o[D] = sum_j exp(s_j - m) V_j (unnormalised) and
// part_s = (m, l, 0, 0). merge.cu combines the splits.
//
// Shared memory (dynamic, bytes computed by santa_cupy/kernels.py:dense_smem_bytes):
//   Ks, Vs [BN][D+PAD] T | qs [G][D] f32 | s [G][BN] f32 | acc [RG][G][D] f32 | m, l, alpha [G] f32
#include "common.cuh"
#include "tile.cuh"

template <typename T, int D, int BN>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_partial(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                     const int* __restrict__ lengths, float scale, int tiles_per_split, int H, int KVH,
                     i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits) {
    constexpr int kThreadsPerRow = D / SC_CHUNK;
    constexpr int kRowGroups = SC_NTHREADS / kThreadsPerRow;
    const int split = blockIdx.x, g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int G = H / KVH;
    const int n = seq_len(lengths, b, L_max);
    const int tile0 = split * tiles_per_split;

    extern __shared__ __align__(16) unsigned char smem[];
    T* Ks = reinterpret_cast<T*>(smem);
    T* Vs = Ks + BN * (D + SC_PAD);
    float* qs = reinterpret_cast<float*>(Vs + BN * (D + SC_PAD));
    float* s = qs + G * D;
    float* acc = s + G * BN;
    float* m_run = acc + kRowGroups * G * D;
    float* l_run = m_run + G;
    float* alpha = l_run + G;
    float* m_tile = alpha + G;
    float* l_tile = m_tile + G;

    const i64 part = (b * H + (i64)g * G) * n_splits + split;   // (b, first head of group, split)
    if ((i64)tile0 * BN >= n) {                                   // nothing of this sequence here
        for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
            part_s[part + (i64)h * n_splits] = make_float4(-SC_INF, 0.f, 0.f, 0.f);
        for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS)
            part_o[(part + (i64)(idx / D) * n_splits) * D + idx % D] = 0.f;
        return;
    }
    load_group_queries<T, D>(qs, q, b, g, G, H, scale);
    for (int idx = threadIdx.x; idx < kRowGroups * G * D; idx += SC_NTHREADS) acc[idx] = 0.f;
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS) { m_run[h] = -SC_INF; l_run[h] = 0.f; }

    const int rg = threadIdx.x / kThreadsPerRow, dg = threadIdx.x % kThreadsPerRow;
    const int tile_end = min(tile0 + tiles_per_split, (n + BN - 1) / BN);
    for (int t = tile0; t < tile_end; ++t) {
        const i64 row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - row0);
        __syncthreads();                       // previous tile fully consumed
        load_tile<T, D, BN>(Ks, k_cache, b, row0, nrows, g, L_max, KVH);
        load_tile<T, D, BN>(Vs, v_cache, b, row0, nrows, g, L_max, KVH);
        __syncthreads();
        tile_scores<T, D, BN>(s, Ks, qs, G, nrows);
        __syncthreads();
        tile_stats<BN>(m_tile, l_tile, s, G, nrows);
        __syncthreads();
        for (int h = threadIdx.x; h < G; h += SC_NTHREADS) {   // online softmax bookkeeping
            const float m_new = fmaxf(m_run[h], m_tile[h]);
            alpha[h] = __expf(m_run[h] - m_new);
            l_run[h] = l_run[h] * alpha[h] + l_tile[h] * __expf(m_tile[h] - m_new);
            m_run[h] = m_new;
        }
        __syncthreads();
        for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS)   // p = exp(s - m_run)
            s[idx] = __expf(s[idx] - m_run[idx / BN]);
        __syncthreads();
        for (int h = 0; h < G; ++h) {          // acc[rg][h] = alpha*acc + sum_j p_j V_j (own rows)
            float o[SC_CHUNK];
            float* a = acc + (rg * G + h) * D + dg * SC_CHUNK;
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) o[e] = a[e] * alpha[h];
            for (int j = rg; j < nrows; j += kRowGroups) {
                Chunk<T> vc; vc.load(Vs + j * (D + SC_PAD) + dg * SC_CHUNK);
                float vf[SC_CHUNK]; vc.to_floats(vf);
                const float p = s[h * BN + j];
#pragma unroll
                for (int e = 0; e < SC_CHUNK; ++e) o[e] = fmaf(p, vf[e], o[e]);
            }
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) a[e] = o[e];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {   // reduce the row groups
        const int h = idx / D, d = idx % D;
        float sum = 0.f;
        for (int r = 0; r < kRowGroups; ++r) sum += acc[(r * G + h) * D + d];
        part_o[(part + (i64)h * n_splits) * D + d] = sum;
    }
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
        part_s[part + (i64)h * n_splits] = make_float4(m_run[h], l_run[h], 0.f, 0.f);
}

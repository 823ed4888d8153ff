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
#include "async_copy.cuh"

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

// v3: the same outputs from a split of consecutive tiles per block, K staged through a cp.async
// ring (async_copy.cuh) so that later stages are in flight while a stage is scored.
// grid (n_splits, KVH, B); block s takes tiles [s*tiles_per_split, (s+1)*tiles_per_split).
// Shared memory (kernels.py: score_smem_bytes): ring [SC_STAGES][kRows][D] T | s [G][BN] f32 | m, l [G]
template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
santa_score_async(const T* __restrict__ q, const T* __restrict__ k_cache, const int* __restrict__ lengths,
                  float scale, int H, int KVH, i64 L_max, int T_max, int tiles_per_split,
                  float* __restrict__ scores, float4* __restrict__ part_s) {
    using GQ = GroupQuery<T, D, G>;
    constexpr int kRG = GQ::kRowGroups;
    constexpr int kMaxRows = 2 * SC_STAGE_BYTES / (D * (int)sizeof(T));
    constexpr int kRows = kMaxRows < BN ? kMaxRows : BN;           // rows per ring stage
    constexpr int kStagesPerTile = BN / kRows;
    constexpr int U = kRows / kRG;                                   // rows per row group per stage
    static_assert(U >= 1 && kRows % kRG == 0 && BN % kRows == 0, "stage shape");
    const int g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const int t_begin = blockIdx.x * tiles_per_split;
    const int t_end = min(t_begin + tiles_per_split, (n + BN - 1) / BN);
    if (t_begin >= t_end) return;
    const i64 row_begin = (i64)t_begin * BN, row_end = n;
    const int n_stages = (t_end - t_begin) * kStagesPerTile;
    const i64 head0 = b * H + (i64)g * G;
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;

    extern __shared__ __align__(16) unsigned char smem[];
    T* ring = reinterpret_cast<T*>(smem);
    float* s = reinterpret_cast<float*>(ring + SC_STAGES * kRows * D);
    float* m = s + G * BN;
    float* l = m + G;

#pragma unroll
    for (int st = 0; st < SC_STAGES - 1; ++st) {
        if (st < n_stages)
            issue_stage<T, D, kRows, 1>(ring + st * kRows * D, k_cache, k_cache, b, row_begin + (i64)st * kRows,
                                        row_end, g, L_max, KVH);
        cp_async_commit();
    }
    GQ gq;
    gq.load(q, b, g, H, scale);
    for (int st = 0; st < n_stages; ++st) {
        cp_async_wait<SC_STAGES - 2>();
        __syncthreads();
        const int next = st + SC_STAGES - 1;
        if (next < n_stages)
            issue_stage<T, D, kRows, 1>(ring + (next % SC_STAGES) * kRows * D, k_cache, k_cache, b,
                                        row_begin + (i64)next * kRows, row_end, g, L_max, KVH);
        cp_async_commit();
        const T* stage = ring + (st % SC_STAGES) * kRows * D;
        const int t = t_begin + st / kStagesPerTile;
        const i64 tile_row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - tile_row0);
        const int r0 = (st % kStagesPerTile) * kRows;               // first row of the stage in its tile
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = u * kRG + rg, j = r0 + r;
            Chunk<T> kc; kc.load(stage + r * D + dg * SC_CHUNK);
            float sc[G];
            gq.scores(kc, sc);
            if (dg == 0)
#pragma unroll
                for (int h = 0; h < G; ++h) s[h * BN + j] = j < nrows ? sc[h] : -SC_INF;
        }
        if (st % kStagesPerTile == kStagesPerTile - 1) {            // tile t complete
            __syncthreads();
            tile_stats<BN>(m, l, s, G, nrows);
            for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
                const int h = idx / BN, j = idx % BN;
                if (j < nrows) scores[(head0 + h) * L_max + tile_row0 + j] = s[idx];
            }
            __syncthreads();
            for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
                part_s[(head0 + h) * T_max + t] = make_float4(m[h], l[h], 0.f, 0.f);
        }
    }
    cp_async_wait<0>();
}

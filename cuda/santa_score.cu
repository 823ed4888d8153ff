// santa_score.cu — S2ANTA pass 1 (score stage): q K^T per tile, per-tile stats, score stash.
//
// grid (T_max, KVH, B), block SC_NTHREADS; tile t covers rows [t*BN, min((t+1)*BN, n_b)).
// K rows are streamed into registers (stream.cuh), scores land in shared memory, then
// scores[b, h, j] (float32, natural-log scale) is written for j < n_b and
// part_s[b, h, t] = (m_t, l_t, 0, 0). Tiles past n_b exit at once.
//
// Shared memory: s [G][BN] f32 | m, l [G] f32
// Versions: santa_score (v2, above), santa_score_async (v3, cp.async ring), santa_score_mma (v4,
// tensor cores, one warp per tile; fp16/bf16, D 64/128), each below with its own comment.
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"
#include "async_copy.cuh"
#include "mma.cuh"

// Stash the tile's scores s[G][BN] (shared memory) into scores[b, h, row0 + j] for j < nrows and
// its stats into part_s[b, h, t] = (m, l, 0, 0); head0 = b * H + g * G. Whole block.
template <int BN>
__device__ __forceinline__ void write_tile_stash(float* scores, float4* part_s, const float* s, const float* m,
                                                 const float* l, int G, i64 head0, i64 L_max, i64 row0, int nrows,
                                                 int T_max, int t) {
    for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
        const int h = idx / BN, j = idx % BN;
        if (j < nrows) scores[(head0 + h) * L_max + row0 + j] = s[idx];
    }
    __syncthreads();
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
        part_s[(head0 + h) * T_max + t] = make_float4(m[h], l[h], 0.f, 0.f);
}

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
    write_tile_stash<BN>(scores, part_s, s, m, l, G, b * H + (i64)g * G, L_max, row0, nrows, T_max, t);
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
            write_tile_stash<BN>(scores, part_s, s, m, l, G, head0, L_max, tile_row0, nrows, T_max, t);
        }
    }
    cp_async_wait<0>();
}

// v4: tensor cores (mma.cuh), 16-bit types, D 64/128. One warp per tile, no block-level sync:
// grid (ceil(T_max / 4), KVH, B), warp w of block x takes tile 4x + w. The warp scores its tile in
// BN/16 steps of 16 keys (S = Q K^T as in decode_dense_mma, the K slices of the next step in
// flight while one computes), keeps the scores in registers, reduces the tile's (m, l) per head
// with shuffles and writes the stash and part_s itself.
template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
santa_score_mma(const T* __restrict__ q, const T* __restrict__ k_cache, const int* __restrict__ lengths,
                float scale, int H, int KVH, i64 L_max, int T_max, float* __restrict__ scores,
                float4* __restrict__ part_s) {
    static_assert(D == 64 || D == 128, "mma score: head_dim 64 or 128");
    static_assert(G >= 1 && G <= 16, "mma score: one m16 tile of heads");
    constexpr bool kHi = MmaQuery<T, D, G>::kHi;
    constexpr int KW = D / 8, NSTEP = BN / 16;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, tq = lane & 3;
    const int t = blockIdx.x * (SC_NTHREADS / 32) + warp, g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const i64 row0 = (i64)t * BN;
    if (t >= T_max || row0 >= n) return;                // whole warp
    const i64 row_end = min(row0 + BN, (i64)n);
    const i64 head0 = b * H + (i64)g * G;

    MmaQuery<T, D, G> mq;
    mq.load(q, head0, gi, tq);

    float s[NSTEP][2][4];                                // scores (natural-log scale), -inf past n
    u32 kbuf[2][2][KW];                                  // [buffer][n-tile][words]
#pragma unroll
    for (int j = 0; j < 2; ++j)
        load_key_slice<T, D>(kbuf[0][j], k_cache, b, row0 + 8 * j + gi, row_end, row0, g, L_max, KVH, tq);
#pragma unroll
    for (int st = 0; st < NSTEP; ++st) {
        const int cur = st & 1;
        if (st + 1 < NSTEP) {
#pragma unroll
            for (int j = 0; j < 2; ++j)
                load_key_slice<T, D>(kbuf[cur ^ 1][j], k_cache, b, row0 + 16 * (st + 1) + 8 * j + gi, row_end, row0, g,
                                     L_max, KVH, tq);
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            float acc[4];
            mq.scores(acc, kbuf[cur][j]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool valid = row0 + 16 * st + 8 * j + 2 * tq + (e & 1) < row_end;
                s[st][j][e] = valid ? acc[e] * scale : -SC_INF;
            }
        }
    }
    // Tile stats per row (head): max, then sum of exp, over the 4 threads of a group.
    float m_lo = -SC_INF, m_hi = -SC_INF;
#pragma unroll
    for (int st = 0; st < NSTEP; ++st)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            m_lo = fmaxf(m_lo, fmaxf(s[st][j][0], s[st][j][1]));
            if (kHi) m_hi = fmaxf(m_hi, fmaxf(s[st][j][2], s[st][j][3]));
        }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        m_lo = fmaxf(m_lo, __shfl_xor_sync(0xffffffffu, m_lo, off));
        if (kHi) m_hi = fmaxf(m_hi, __shfl_xor_sync(0xffffffffu, m_hi, off));
    }
    float l_lo = 0.f, l_hi = 0.f;
#pragma unroll
    for (int st = 0; st < NSTEP; ++st)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            l_lo += __expf(s[st][j][0] - m_lo) + __expf(s[st][j][1] - m_lo);
            if (kHi) l_hi += __expf(s[st][j][2] - m_hi) + __expf(s[st][j][3] - m_hi);
        }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        if (kHi) l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    // Stash: row gi (and gi + 8) holds keys row0 + 16 st + 8 j + 2 tq + {0, 1}.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int h = gi + 8 * half;
        if (h >= G || (half == 1 && !kHi)) continue;
        float* dst = scores + (head0 + h) * L_max + row0;
        const bool pairs = ((head0 + h) * L_max & 1) == 0;   // 8-byte aligned pairs (row0, r even)
#pragma unroll
        for (int st = 0; st < NSTEP; ++st)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
                const int r = 16 * st + 8 * j + 2 * tq;
                if (pairs && row0 + r + 1 < row_end)
                    *reinterpret_cast<float2*>(dst + r) = make_float2(s[st][j][2 * half], s[st][j][2 * half + 1]);
                else {
                    if (row0 + r < row_end) dst[r] = s[st][j][2 * half];
                    if (row0 + r + 1 < row_end) dst[r + 1] = s[st][j][2 * half + 1];
                }
            }
        if (tq == 0) part_s[(head0 + h) * T_max + t] = make_float4(half ? m_hi : m_lo, half ? l_hi : l_lo, 0.f, 0.f);
    }
}

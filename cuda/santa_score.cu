// santa_score.cu — S2ANTA pass 1 (score stage): q K^T per tile, per-tile stats, score stash.
//
// grid (T_max, KVH, B), block SC_NTHREADS; tile t covers rows [t*BN, min((t+1)*BN, n_b)).
// K rows are streamed into registers (stream.cuh), scores land in shared memory, then
// scores[b, h, j] (float32, natural-log scale) is written for j < n_b and
// part_s[b, h, t] = (m_t, l_t, 0, 0). Tiles past n_b exit at once.
//
// Shared memory: s [G][BN] f32 | m, l [G] f32
// Versions: santa_score (FMA, any dtype and head_dim: the generic fallback) and santa_score_mma
// (tensor cores, one warp per run of tiles; fp16/bf16, D 64/128: the production kernel), each
// with its own comment.
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"
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
            float4* __restrict__ part_s,
            const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_wait();                           // before reading an earlier kernel's output (dependents: at the end)
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
    stream_tile_scores<T, D, G, BN>(s, gq, SC_CACHE_ROWS(k_cache), b, row0, nrows, g);
    __syncthreads();
    tile_stats<BN>(m, l, s, G, nrows);
    write_tile_stash<BN>(scores, part_s, s, m, l, G, b * H + (i64)g * G, L_max, row0, nrows, T_max, t);
    pdl_launch_dependents();
}

// ---- v4 helpers (santa_score_mma) ---------------------------------------------------------
// The stash of one 8-key n-tile of a step: thread (gi, tq) holds keys c + 2 tq + {0, 1} of its
// row (c = 16 st + 8 j), x0/x1; dst = the row's stash at the tile's first key; lim = (rows in
// the tile) - 2 tq, so key c + 2 tq + e exists iff c + e < lim.
__device__ __forceinline__ void stash_pair(float* dst, bool pairs, int c, int tq, int lim, float x0, float x1) {
    const int r = c + 2 * tq;
    if (pairs && c + 1 < lim) *reinterpret_cast<float2*>(dst + r) = make_float2(x0, x1);
    else {
        if (c < lim) dst[r] = x0;
        if (c + 1 < lim) dst[r + 1] = x1;
    }
}

// v4: tensor cores (mma.cuh), 16-bit types, D 64/128. One warp per c tiles, no block-level sync:
// grid (KVH, blocks of the batch's runs) (common.cuh run_block: runs of c tiles, c from
// tiles_per_warp and the lengths); the sequence's block k holds tiles [4 k c, 4 (k + 1) c) and its
// warp w takes tiles 4 k c + w, + 4, + 8, ... of them that start before n_b. The warp scores each tile in BN/16 steps of 16 keys (S = Q K^T as in
// decode_dense_mma); each step's scores go straight to the stash and into per-thread online
// (m, l) (OnlineStats), combined over the 4 threads of a group at the tile's end into part_s.
// K goes through two register buffers by a step counter that runs across the warp's tiles:
// while step k computes, step k + 1 is loading, the first step of the next tile included, so
// the K stream does not stop at tile boundaries. Holding no scores keeps it at 136 registers with
// a real step in flight at BN 128, D 128, G 4 (holding the tile's scores for a two-pass max/sum
// took 162). Capping it at 128 for a 4th block per SM (__launch_bounds__(.., 4)) spills 20-40
// bytes inside the step loop and measured slower: B=16 32k score + prefix 280 -> 291 us, B=1 no
// faster (H200).
// The scores of tiles t_begin, t_begin + stride, ... (< t_end) of one (b, KV head) by one warp
// (santa_score_mma, below: stride 4, the block's warps on neighbouring tiles; the key pass: 1).
// Query: MmaQuery (loaded by the caller), KeyWeightedQuery or CompactKeyQuery; KRows: CacheRows,
// SampledKeyRows or CompactKeyRows; Run: KeyRun, or CompactKeyRun with CompactKeyRows.
template <typename T, int D, int BN, int G, typename Run, typename Query, typename KRows>
__device__ __forceinline__ void score_run(const Query& mq, const KRows& K, int n, float scale,
                                          i64 L_max, int T_max, int t_begin, int t_end, i64 b, int g,
                                          i64 head0, float* __restrict__ scores, float4* __restrict__ part_s,
                                          int stride = 1) {
    constexpr bool kHi = MmaQuery<T, D, G>::kHi;         // rows gi + 8 hold heads too
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, tq = lane & 3;
    // This thread's stash rows: head gi (and gi + 8); 8-byte aligned pairs when the row starts even.
    float* stash_lo = scores + (head0 + gi) * L_max;
    float* stash_hi = scores + (head0 + gi + 8) * L_max;
    const bool pairs_lo = ((head0 + gi) * L_max & 1) == 0, pairs_hi = ((head0 + gi + 8) * L_max & 1) == 0;
    const bool own_lo = gi < G, own_hi = kHi && gi + 8 < G;

    Run kr;
    const i64 first0 = (i64)t_begin * BN, first_end = min(first0 + BN, (i64)n);
    kr.start(K, b, first0, first_end, g, gi, tq);
    for (int t = t_begin, i = 0; t < t_end; t += stride, ++i) {   // warp-uniform trip count
        const i64 row0 = (i64)t * BN, row_end = min(row0 + BN, (i64)n);
        const int lim = (int)(row_end - row0) - 2 * tq;  // see stash_pair
        // Tile t + stride if the warp owns it, else the empty range [row0, row0): its first step loads nothing.
        const bool has_next = t + stride < t_end;
        const i64 next0 = has_next ? (i64)(t + stride) * BN : row0;
        const i64 next_end = has_next ? min(next0 + BN, (i64)n) : row0;
        OnlineStats lo, hi;
        kr.score_tile(mq, i, K, b, row0, row_end, next0, next_end, g, gi, tq,
                      [&](int st, int j, const float (&acc)[4]) {
            const int c = 16 * st + 8 * j;
            float sc[4];                                 // scores (natural-log scale), -inf past n
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[e] = c + (e & 1) < lim ? acc[e] * scale : -SC_INF;
            if (own_lo) stash_pair(stash_lo + row0, pairs_lo, c, tq, lim, sc[0], sc[1]);
            if (own_hi) stash_pair(stash_hi + row0, pairs_hi, c, tq, lim, sc[2], sc[3]);
            lo.push2(sc[0], sc[1]);
            if (kHi) hi.push2(sc[2], sc[3]);
        });
        lo.reduce_group();
        if (kHi) hi.reduce_group();
        if (tq == 0) {
            if (own_lo) part_s[(head0 + gi) * T_max + t] = make_float4(lo.m, lo.l, 0.f, 0.f);
            if (own_hi) part_s[(head0 + gi + 8) * T_max + t] = make_float4(hi.m, hi.l, 0.f, 0.f);
        }
    }
}

// score_run on the plain K rows, or (stash_in_l2, warp-uniform) on K read evict-first so that the
// stash stays in the L2 for pass 2.
template <typename T, int D, int BN, int G, typename Run>
__device__ __forceinline__ void score_run_rows(const MmaQuery<T, D, G>& mq, const CacheRows<T, D>& K, int stash_in_l2,
                                               int n, float scale, i64 L_max, int T_max, int t_begin, int t_end,
                                               int stride, i64 b, int g, i64 head0, float* __restrict__ scores,
                                               float4* __restrict__ part_s) {
    if (stash_in_l2)
        score_run<T, D, BN, G, Run>(mq, StreamedKeyRows<T, D>{K, l2_evict_first_policy()}, n, scale, L_max, T_max,
                                    t_begin, t_end, b, g, head0, scores, part_s, stride);
    else
        score_run<T, D, BN, G, Run>(mq, K, n, scale, L_max, T_max, t_begin, t_end, b, g, head0, scores, part_s,
                                    stride);
}

// SPAN: 16-key steps a K register buffer holds (KeyRun). Two (kernels.SCORE_SPAN), 8 KB a warp in
// flight at 2 blocks an SM (over 200 registers), measured 1-3% faster than one step at 3 blocks an
// SM (H200, B=16 32k 366.9 vs 373.4 us, B=1 32k 42.2 vs 43.5). A step must lie in one page, so the
// plan takes the SPAN 1 instance for pages of a size that is not a multiple of 32 rows (16, 48).
// One instance per SPAN rather than a branch on page_size inside one kernel: with both runs in one
// kernel ptxas gave it 210 registers instead of 222 and the stash-in-L2 route lost its gain
// (B=1 32k 43.6 against 38.9 us, H200).
template <typename T, int D, int BN, int G, int SPAN>
__global__ void __launch_bounds__(SC_NTHREADS)
santa_score_mma(const T* __restrict__ q, const T* __restrict__ k_cache, const int* __restrict__ lengths,
                float scale, int H, int KVH, i64 L_max, int T_max, int tiles_per_warp, int batch,
                float* __restrict__ scores,
                float4* __restrict__ part_s, int santa_from, int stash_in_l2,
                const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_wait();                           // before reading an earlier kernel's output (dependents: at the end)
    static_assert(D == 64 || D == 128, "mma score: head_dim 64 or 128");
    static_assert(G >= 1 && G <= 16, "mma score: one m16 tile of heads");
    const int warp = threadIdx.x >> 5;
    const int g = blockIdx.x;                // the KV heads of one block of runs are neighbours
    // block x: its sequence's block `blk`, runs of c tiles (common.cuh run_block; tiles_per_warp is
    // the plan's run length for full sequences). A sequence shorter than santa_from is
    // decode_dense_mma's (a santa plan's dense fallback): no tiles here.
    int b32, blk, c;
    run_block(lengths, batch, L_max, BN, T_max, tiles_per_warp, santa_from, blockIdx.y, &b32, &blk, &c);
    if (b32 < 0) return;
    const i64 b = b32;
    const int n = seq_len(lengths, b, L_max);
    const int n_tiles = seq_tiles(n, BN, T_max, santa_from);
    // The block's 4 c tiles, warp w on tiles w, w + 4, ... of them: the block's warps read
    // neighbouring tiles at a time rather than four runs c tiles apart.
    constexpr int kWarps = SC_NTHREADS / 32;
    const int t_begin = blk * kWarps * c + warp;
    const int t_end = min((blk + 1) * kWarps * c, n_tiles);
    if (t_begin < t_end) {                               // whole warp
        const i64 head0 = b * H + (i64)g * G;
        const int lane = threadIdx.x & 31;
        MmaQuery<T, D, G> mq;
        mq.load(q, head0, lane >> 2, lane & 3);
        const CacheRows<T, D> K = SC_CACHE_ROWS(k_cache);
        score_run_rows<T, D, BN, G, KeyRun<T, D, BN, SPAN>>(mq, K, stash_in_l2, n, scale, L_max, T_max, t_begin,
                                                             t_end, kWarps, b, g, head0, scores, part_s);
    }
    pdl_launch_dependents();
}

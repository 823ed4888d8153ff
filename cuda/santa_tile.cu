// santa_tile.cu — S2ANTA per-tile sample and gather-add (pass 2), and the fused fixed budget.
//
// grid (T_max, KVH, B), block SC_NTHREADS; one block = one tile of BN rows of one KV group.
// Scores come from the stash of santa_score.cu (own_scores 0: budgets global and largest_remainder,
// and the fixed budget of a plan whose fused run takes the warp pass 2 below, so that its
// standalone stages see the same scores) or, own_scores 1 (budget fixed only), are computed here
// from K (one fused pass). mode:
//   0 fused: sample, gather-add (tiles without samples return early and write nothing), write part_o[b,h,t,:] = sum c V and part_s[b,h,t] =
//            (m_t, l_t, sum c ||V||^2, ||sum c V||^2); rows_read[b,g] += distinct rows read
//   1 sample only: write counts[b, h, j] for the tile's rows
//   2 gather only: read counts[b, h, j] instead of sampling, then as mode 0
// Tiles past n_b exit at once. The RNG key of a head is head_key(seed, *step, layer, b, head_offset + h):
// head_offset is the global index of the plan's first query head (0, or a tensor-parallel rank's
// first head, so that a rank draws what the whole model's head draws).
//
// Shared memory (santa_cupy/kernels.py:tile_smem_bytes):
//   cum [G][BN] f32 | cnt [G][BN] i32 | acc [RG][G][D] f32 | m2p [RG][G] f32 | rows [BN] i32 |
//   warp_tot [4] i32 | m, l [G] f32 | draws [G] HeadDraw
#include "common.cuh"
#include "tile.cuh"
#include "santa_sample.cuh"
#include "santa_gather.cuh"
#include "stream.cuh"
#include "async_copy.cuh"
#include "gather_mma.cuh"
#include "merge.cuh"

#define SC_MODE_FUSED 0
#define SC_MODE_SAMPLE 1
#define SC_MODE_GATHER 2

__device__ __forceinline__ unsigned char* align16(unsigned char* p) {
    return reinterpret_cast<unsigned char*>((reinterpret_cast<u64>(p) + 15ull) & ~15ull);
}

template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
santa_tile(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
           const int* __restrict__ lengths, float scale, int H, int KVH, i64 L_max, int T_max,
           int budget, int sampler, int samples, int mode, int own_scores, u64 seed, const i64* __restrict__ step,
           int layer, int head_offset, const float* __restrict__ scores, const double* __restrict__ cdf,
           const int* __restrict__ alloc, float4* __restrict__ part_s, float* __restrict__ part_o,
           int* __restrict__ counts, int* __restrict__ rows_read,
           const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    constexpr int kThreadsPerRow = D / SC_CHUNK;
    constexpr int kRowGroups = SC_NTHREADS / kThreadsPerRow;
    const int t = blockIdx.x, g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const i64 row0 = (i64)t * BN;
    if (row0 >= n) return;
    const int nrows = (int)min((i64)BN, n - row0);
    const int n_tiles = (n + BN - 1) / BN;
    const i64 head0 = b * H + (i64)g * G;        // flat (b, h) index of the group's first head

    extern __shared__ __align__(16) unsigned char smem[];
    float* cum = reinterpret_cast<float*>(smem);
    int* cnt = reinterpret_cast<int*>(cum + G * BN);
    float* acc = reinterpret_cast<float*>(cnt + G * BN);
    float* m2p = acc + kRowGroups * G * D;
    int* rows = reinterpret_cast<int*>(m2p + kRowGroups * G);
    int* warp_tot = rows + BN;
    float* m = reinterpret_cast<float*>(warp_tot + 4);
    float* l = m + G;
    HeadDraw* draws = reinterpret_cast<HeadDraw*>(align16(reinterpret_cast<unsigned char*>(l + G)));

    // ---- tile stats (and, own_scores, the scores, into cum) ----
    if (own_scores) {                            // fused (budget fixed, one pass): score the tile here
        GroupQuery<T, D, G> gq;
        gq.load(q, b, g, H, scale);
        stream_tile_scores<T, D, G, BN>(cum, gq, SC_CACHE_ROWS(k_cache), b, row0, nrows, g);
        __syncthreads();
        tile_stats<BN>(m, l, cum, G, nrows);
    } else {                                     // two-pass: stats of santa_score.cu
        for (int h = threadIdx.x; h < G; h += SC_NTHREADS) {
            const float4 st = part_s[(head0 + h) * T_max + t];
            m[h] = st.x; l[h] = st.y;
        }
    }
    __syncthreads();

    // ---- sample ----
    if (mode == SC_MODE_GATHER) {
        for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
            const int h = idx / BN, j = idx % BN;
            cnt[idx] = j < nrows ? counts[(head0 + h) * L_max + row0 + j] : 0;
        }
    } else {
        if (threadIdx.x < G) {
            const int h = threadIdx.x;
            const u64 key = head_key(seed, (u64)step[0], (u64)layer, (u64)b, (u64)(head_offset + g * G + h));
            setup_head_draw(&draws[h], budget, sampler, samples, key, t, n_tiles, l[h],
                            cdf + (head0 + h) * T_max, alloc + (head0 + h) * T_max);
        }
        __syncthreads();
        // A tile that no comb point reaches is done: part_s keeps pass 1's (m, l, 0, 0), part_o
        // is not written (merge skips it), counts stay zero.
        bool any_points = false;
        for (int h = 0; h < G; ++h) any_points |= draws[h].n > 0 || draws[h].k_end > draws[h].k_begin;
        if (!any_points) return;
        for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
            const int h = idx / BN, j = idx % BN;
            float sc = 0.f;
            if (j < nrows)
                sc = own_scores ? cum[idx] : scores[(head0 + h) * L_max + row0 + j];
            cum[idx] = j < nrows ? __expf(sc - m[h]) : 0.f;
            cnt[idx] = 0;
        }
        __syncthreads();
        tile_cumsum<BN>(cum, G);
        __syncthreads();
        if (threadIdx.x < G) {                   // the counts' normaliser: the exp-sum as summed here
            const int h = threadIdx.x;
            setup_head_draw(&draws[h], budget, sampler, samples, draws[h].key, t, n_tiles, cum[h * BN + nrows - 1],
                            cdf + (head0 + h) * T_max, alloc + (head0 + h) * T_max);
        }
        __syncthreads();
        tile_counts<BN>(cnt, cum, draws, G, nrows, budget, sampler, samples, t);
    }
    __syncthreads();
    if (mode == SC_MODE_SAMPLE) {
        for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
            const int h = idx / BN, j = idx % BN;
            if (j < nrows) counts[(head0 + h) * L_max + row0 + j] = cnt[idx];
        }
        return;
    }

    // ---- gather-add ----
    for (int idx = threadIdx.x; idx < kRowGroups * G * D; idx += SC_NTHREADS) acc[idx] = 0.f;
    for (int idx = threadIdx.x; idx < kRowGroups * G; idx += SC_NTHREADS) m2p[idx] = 0.f;
    const int nsel = select_rows<BN>(rows, warp_tot, cnt, G, nrows);
    __syncthreads();
    gather_add<T, D, BN>(acc, m2p, rows, nsel, cnt, G, SC_CACHE_ROWS(v_cache), b, row0, g);
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {   // reduce the row groups
        const int h = idx / D, d = idx % D;
        float sum = 0.f;
        for (int r = 0; r < kRowGroups; ++r) sum += acc[(r * G + h) * D + d];
        part_o[((head0 + h) * T_max + t) * D + d] = sum;
        acc[h * D + d] = sum;                    // row group 0 now holds the total
    }
    __syncthreads();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int h = warp; h < G; h += SC_NTHREADS / 32) {
        float sq = 0.f;
        for (int d = lane; d < D; d += 32) sq = fmaf(acc[h * D + d], acc[h * D + d], sq);
        sq = warp_sum(sq);
        if (lane == 0) {
            float m2 = 0.f;
            for (int r = 0; r < kRowGroups; ++r) m2 += m2p[r * G + h];
            part_s[(head0 + h) * T_max + t] = make_float4(m[h], l[h], m2, sq);
        }
    }
    if (threadIdx.x == 0) atomicAdd(&rows_read[b * KVH + g], nsel);
}

// ---- v4 pass 2: one warp per run of tiles (systematic sampler, every budget, G <= 8) -----------
// The same counts as santa_tile (same exp, the same per-head cumulative sum order as tile_cumsum,
// the same closed-form comb counts, the slope over the tile's exp-sum as summed here) but computed
// in registers by the 32 lanes of one warp, each owning rows [lane * BN/32, (lane + 1) * BN/32) of
// a tile. Selected rows (the union over the group's heads) are gathered by one of two gathers
// (kGather, below): staged through shared memory with every lane adding its D/32 elements into
// per-head register accumulators of the tile (a light tile's rows in flight over the next tile's
// counts), or staged and added on tensor cores. It follows santa_score_mma and santa_prefix (the normalised cdf and the heads' lse, whose
// non-finite value marks a NaN/inf score: that head draws nothing and its o is NaN).
// grid (KVH, blocks of the batch's runs), block SC_NTHREADS (common.cuh run_block: runs of c tiles,
// c from tiles_per_warp and the lengths, as in santa_score_mma); warp w of its sequence's block k
// takes run r = 4k + w, tiles [r * c, (r + 1) * c).
// Sequences shorter than santa_from belong to decode_dense_mma (the plan's dense fallback).
// Every budget's estimate is a weighted sum over tiles; the warp sums its run:
//   global / largest_remainder: sum c V and m2 = sum c ||V||^2 (o = sum / S).
//   fixed: S_t = max(1, S // T_b) comb points in every tile, weight w_t = (W_t / Z) / S_t with
//     W_t / Z = cdf[t] - cdf[t-1]: sum_t w_t sum c V and m2 = sum_t w_t^2 (sum c ||V||^2 -
//     ||sum c V||^2 / S_t) (the tiles' variances; o = the sum).
// The block sums its 4 runs in shared memory, then one of two finishes (kFinish, the plan's choice
// from B * KVH, kernels.FINISH_MAX_GROUPS); either way the last block of the (sequence, KV head) to
// arrive writes o and spread, so sample, gather and merge are one launch:
//   kFinish: the block adds its sums into copy blockIdx.x % SC_ACC_COPIES of the accumulators
//     acc [copies][B*H*D + B*H]; the last block reads the copies (finish_head) and zeroes them.
//     For few groups, whose many blocks a group the atomics spread over the L2 (B=1 32k: 64).
//   !kFinish: the block stores its sums as its partial, part_o[b, h, blk, :] and part_s[b, h,
//     blk].z = m2 (pass 1's (m, l) of tile blk in .xy untouched); the last block sums the group's
//     partials in block order (finish_head_from_parts). For many groups, a few blocks each (B=16
//     32k: 4).
// A sequence of length 0 (santa_from 0): o = 0, lse = -inf, spread = 0, rows_read = 0.
// The run's sums live in shared memory (each lane its own D/32 slice per head, or the mma
// fragment's elements) rather than registers, so they are not live through the counts phase (at
// bf16, D 128, BN 128, G 4: 72 instead of 96 registers), for one shared read-add-write per tile
// and head; measured faster at every point of the H200 grid. Holding the next tile's stash scores
// across the gather (the pipelining below) took it to 127. __launch_bounds__(.., 4 blocks) for G <= 4 (128 registers, no spills; uncapped,
// nvcc takes 130-186 and the occupancy halves), 3 for G 5..8 (164-168, as the kernel took before
// this session; capped at 128 it spilled 100+ bytes).
// Shared memory (kernels.py: tile_warp_smem_bytes): per warp cnt [G][BN] i32 | rows [BN] i32;
// then per warp sums [G][D] f32; then per warp SC_GATHER_STAGE_BYTES of staged V rows; then, SC_GATHER_PIPE,
// per warp the pending tile's counts [G][kStageRows] f32.


template <typename T, int N>
__device__ __forceinline__ void load_slice(const T* p, float (&out)[N]) {
    constexpr int kBytes = N * (int)sizeof(T);
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16 || kBytes == 32, "slice size");
    T e[N];
    if constexpr (kBytes == 4) *reinterpret_cast<u32*>(e) = *reinterpret_cast<const u32*>(p);
    else if constexpr (kBytes == 8) *reinterpret_cast<uint2*>(e) = *reinterpret_cast<const uint2*>(p);
    else if constexpr (kBytes == 16) *reinterpret_cast<uint4*>(e) = *reinterpret_cast<const uint4*>(p);
    else {
        reinterpret_cast<uint4*>(e)[0] = reinterpret_cast<const uint4*>(p)[0];
        reinterpret_cast<uint4*>(e)[1] = reinterpret_cast<const uint4*>(p)[1];
    }
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(e[i]);
}

// One tile's stash scores of the heads in `heads` (bit h: head h draws a comb point here) into
// registers: lane holds rows lane * R .. + R - 1 (-inf past nrows); src = the group's first head at
// the tile's first row, head h at src + h * stride (the stash: L_max). A head without a point needs
// no scores (its counts are zero), so at long contexts, where a head-tile holds a point rarely, most
// of the stash is never read. Issued a tile ahead, they fly while the previous tile gathers.
template <int BN, int G>
__device__ __forceinline__ void warp_tile_scores(float (&sc)[G][BN / 32], const float* src, i64 stride, int nrows,
                                                 unsigned heads) {
    constexpr int R = BN / 32;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (!((heads >> h) & 1u)) continue;                 // warp-uniform
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int j = lane * R + i;
            sc[h][i] = j < nrows ? src[h * stride + j] : -SC_INF;
        }
    }
}

// Drops the stash rows of a tile's G heads (src: head 0's, heads `stride` apart) from the L2
// without writing them back (discard.global.L2, sm_80+: the bytes become undefined), once this
// warp has read them or found it needs none. The stash is scratch that nothing reads after pass 2,
// so a line dropped while the L2 still holds it is a line the DRAM never writes. Only the 128-byte
// lines wholly inside [src, src + nrows): a line shared with a neighbour tile, which another warp
// may still read, is left alone.
template <int BN, int G>
__device__ __forceinline__ void warp_discard_tile_stash(const float* src, i64 stride, int nrows) {
    constexpr int kLines = BN * (int)sizeof(float) / 128 + 1;   // lines a head's rows can touch
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < G * kLines; i += 32) {
        const int h = i / kLines, k = i % kLines;
        const unsigned long long lo = reinterpret_cast<unsigned long long>(src + h * stride);
        const unsigned long long hi = lo + (unsigned long long)nrows * sizeof(float);
        const unsigned long long line = ((lo + 127ull) & ~127ull) + 128ull * k;
        if (line + 128ull <= hi)
            asm volatile("{ .reg .u64 ga; cvta.to.global.u64 ga, %0; discard.global.L2 [ga], 128; }"
                         :: "l"(line) : "memory");
    }
}

// The rows of a tile that any head selected, in row order, into rows[] (lane owns rows
// lane * R .. + R - 1, any_row[i] for its i-th); returns how many (every lane).
template <int R>
__device__ __forceinline__ int warp_list_rows(int* rows, const bool (&any_row)[R]) {
    const int lane = threadIdx.x & 31;
    int mine = 0;
#pragma unroll
    for (int i = 0; i < R; ++i) mine += any_row[i];
    int incl = mine;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    int k = incl - mine;
#pragma unroll
    for (int i = 0; i < R; ++i)
        if (any_row[i]) rows[k++] = lane * R + i;
    __syncwarp();
    return __shfl_sync(0xffffffffu, incl, 31);
}

// Counts of one tile for the G heads, in registers, into cnt[G][BN] (shared, this warp's), and
// the ordered list of the selected rows (the union over the heads, row order) into rows[];
// returns how many. c_j = (comb points below cum_j) - (points below cum_{j-1}), the last row
// gets the rest. Lane h < G holds head h's draw `my` and tile max `my_m`; sc = warp_tile_scores
// of the heads in `heads` (the heads with n > 0); every other head's counts are zero.
template <int BN, int G>
__device__ __forceinline__ int warp_tile_counts(int* cnt, int* rows, const HeadDraw& my, float my_m,
                                                const float (&sc)[G][BN / 32], int nrows, unsigned heads) {
    constexpr int R = BN / 32;
    const int lane = threadIdx.x & 31;
    bool any_row[R];
#pragma unroll
    for (int i = 0; i < R; ++i) any_row[i] = false;
#pragma unroll
    for (int h = 0; h < G; ++h) {
        if (!((heads >> h) & 1u)) {                            // no comb point: zero counts
#pragma unroll
            for (int i = 0; i < R; ++i) cnt[h * BN + lane * R + i] = 0;
            continue;
        }
        HeadDraw d;
        d.a = __shfl_sync(0xffffffffu, my.a, h);
        d.off = __shfl_sync(0xffffffffu, my.off, h);
        d.n = __shfl_sync(0xffffffffu, my.n, h);
        const float m_h = __shfl_sync(0xffffffffu, my_m, h);
        float c[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int j = lane * R + i;
            c[i] = j < nrows ? __expf(sc[h][i] - m_h) : 0.f;
        }
        float run = 0.f;                                   // tile_cumsum's order
#pragma unroll
        for (int i = 0; i < R; ++i) { run += c[i]; c[i] = run; }
        const float before = warp_inclusive_scan(run) - run;
#pragma unroll
        for (int i = 0; i < R; ++i) c[i] += before;
        // the slope over this sum: the counts' normaliser is the tile's exp-sum as summed here
        // (the reference's l_t = cum at the last row), so the last row gets no points of rounding
        d.a = __fdiv_rn(d.a, __shfl_sync(0xffffffffu, c[R - 1], 31));
        int cb[R];
#pragma unroll
        for (int i = 0; i < R; ++i) cb[i] = comb_below(d, c[i]);
        const int prev_last = __shfl_up_sync(0xffffffffu, cb[R - 1], 1);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int j = lane * R + i;
            int count = 0;
            if (j < nrows) {
                const int upto = (j == nrows - 1) ? d.n : cb[i];
                const int below = j == 0 ? 0 : (i == 0 ? prev_last : cb[i - 1]);
                count = upto - below;
            }
            cnt[h * BN + j] = count;
            any_row[i] |= count > 0;
        }
    }
    return warp_list_rows<R>(rows, any_row);
}

// Gather-add of the nsel selected rows of one tile (first row row0), staged through shared memory
// by cp.async, kRows rows per round (4 KB per warp): acc[h][e] += c_h(j) V_j[lane*E + e] and
// m2p[h] += c_h(j) * (lane's part of ||V_j||^2). A tile's rows are in flight together without
// holding registers, so a tile of many selected rows costs ceil(nsel / kRows) round trips. Each lane copies and reads back only its own D/32 elements of
// every row, so its cp.async wait is all the synchronisation needed. stage: this warp's [kRows][D].
template <typename T, int D, int BN, int G, int kRows>
__device__ __forceinline__ void warp_gather_add_staged(float (&acc)[G][D / 32], float (&m2p)[G], const int* cnt,
                                                       const int* rows, int nsel, T* stage,
                                                       const CacheRows<T, D>& V, i64 b, i64 row0, int g) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    T* mine = stage + lane * E;
    for (int base = 0; base < nsel; base += kRows) {                // warp-uniform
        const int m = min(kRows, nsel - base);
        // a rolled loop: unrolled over kRows (16 at D 128) it inlined V.row's paged arithmetic 16
        // times, ~1400 of santa_tile_warp's 7680 SASS instructions for a path heavy tiles alone take
#pragma unroll 1
        for (int u = 0; u < m; ++u)
            cp_async_bytes<E * (int)sizeof(T)>(mine + u * D, V.row(b, row0 + rows[base + u], g) + lane * E);
        cp_async_commit();
        cp_async_wait<0>();
        for (int u = 0; u < m; ++u) {
            const int j = rows[base + u];
            float v[E];
            load_slice<T, E>(mine + u * D, v);
            float sq = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) sq = fmaf(v[e], v[e], sq);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const int ch = cnt[h * BN + j];
                if (ch == 0) continue;
                const float cf = (float)ch;
#pragma unroll
                for (int e = 0; e < E; ++e) acc[h][e] = fmaf(cf, v[e], acc[h][e]);
                m2p[h] = fmaf(cf, sq, m2p[h]);
            }
        }
    }
}

// kGather: how a tile's selected V rows are gathered and added (kernels.py picks by the rows a
// tile is expected to select):
//   SC_GATHER_PIPE (tile_kernel "warp"): a tile of at most kStageRows selected rows is issued
//     (cp.async into this warp's stage, its counts copied beside it) and added after the next
//     tile's counts, so its V round trip overlaps that work; a heavier tile is gathered at once,
//     kStageRows rows a round trip (warp_gather_add_staged). Measured on the H200 against the
//     earlier 4-rows-in-registers and staged-at-once gathers: 381 against 394 / 386 us at B=16 32k,
//     107 against 111 / 108 at B=4 32k, equal at 128k.
//   SC_GATHER_MMA (tile_kernel "warp_mma"): staged likewise, then added on tensor cores
//     (gather_mma.cuh; fp16/bf16 at D 64/128 only; a tile whose counts are not exact in T takes
//     the staged FMA gather).
#define SC_GATHER_PIPE 0
#define SC_GATHER_MMA 1

// Add the n rows a pipelined tile left in this warp's stage (lane slices), with their counts in
// coef [G][kRows] and this lane's head weight w_pend (lane h: head h), into the run sums and m2p,
// as the staged gather and the tile fold do.
template <typename T, int D, int G, int kRows>
__device__ __forceinline__ void add_staged_tile(float* sums, float (&m2p)[G], const T* stage, const float* coef,
                                                int n, float w_pend, float inv_s_t) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    float tile[G][E], tile_m2[G];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        tile_m2[h] = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) tile[h][e] = 0.f;
    }
    for (int r = 0; r < n; ++r) {                                   // warp-uniform
        float v[E];
        load_slice<T, E>(stage + r * D + lane * E, v);
        float sq = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) sq = fmaf(v[e], v[e], sq);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float cf = coef[h * kRows + r];
            if (cf == 0.f) continue;
#pragma unroll
            for (int e = 0; e < E; ++e) tile[h][e] = fmaf(cf, v[e], tile[h][e]);
            tile_m2[h] = fmaf(cf, sq, tile_m2[h]);
        }
    }
#pragma unroll
    for (int h = 0; h < G; ++h) {
        const float w = __shfl_sync(0xffffffffu, w_pend, h);
        float q2 = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            sums[h * D + e] = fmaf(w, tile[h][e], sums[h * D + e]);
            q2 = fmaf(tile[h][e], tile[h][e], q2);
        }
        m2p[h] = fmaf(w * w, tile_m2[h] - q2 * inv_s_t, m2p[h]);
    }
}

template <typename T, int D, int BN, int G, int kGather, bool kFinish>
__global__ void __launch_bounds__(SC_NTHREADS, G <= 4 ? 4 : 3)
santa_tile_warp(const T* __restrict__ v_cache, const int* __restrict__ lengths, int H, int KVH, i64 L_max,
                int T_max, int tiles_per_warp, int batch, int budget, int samples, u64 seed, const i64* __restrict__ step,
                int layer, int head_offset, const float* __restrict__ scores, const double* __restrict__ cdf,
                const int* __restrict__ alloc, float4* __restrict__ part_s, float* __restrict__ part_o,
                float* __restrict__ acc, unsigned* __restrict__ arrive, int* __restrict__ rows_read,
                T* __restrict__ out, float* __restrict__ lse, float* __restrict__ spread, int santa_from,
                int stash_in_l2, const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    // The next grid in at once only where the plan's dense fallback follows (santa_from > 1: its
    // blocks are light and wait); else it launches at this grid's completion. The next call's
    // score pass let in at once cost 2-4 us at B=1 (H100, B=1 24k 38.2 against 34.1 us at every
    // length; the fallback's plans 34.4 against 40.1 with no trigger: docs/results/
    // h100_7e71466_pass2_trigger).
    if (santa_from > 1) pdl_launch_dependents();
    static_assert(G <= 8, "warp tile: G <= 8 (register counts)");
    constexpr int E = D / 32;                // elements of a V row per lane
    constexpr int kWarps = SC_NTHREADS / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = blockIdx.x;                // the KV heads of one block of runs are neighbours
    // Before the wait, which lets this grid in while santa_prefix runs: what depends only on the
    // call's inputs (lengths, step), which no kernel of the pipeline writes, and whose writers
    // finished before the score pass's trigger (common.cuh), which comes before santa_prefix's
    // launch and so before this grid's: the block's run and sequence, the heads' RNG keys and
    // combs' offsets. Their round trips and hashing then overlap santa_prefix instead of adding
    // to this kernel's chain of round trips.
    // block x: its sequence's block `blk`, runs of c tiles (common.cuh run_block, as the score pass);
    // sequences shorter than santa_from are decode_dense_mma's and have no blocks here
    int b32, blk, c;
    run_block(lengths, batch, L_max, BN, T_max, tiles_per_warp, santa_from, blockIdx.y, &b32, &blk, &c);
    const i64 b = b32 < 0 ? 0 : b32;
    const int n = seq_len(lengths, b, L_max);
    const u64 key = lane < G ? head_key(seed, (u64)step[0], (u64)layer, (u64)b, (u64)(head_offset + g * G + lane))
                             : 0ull;
    const float u_global = budget == SC_BUDGET_GLOBAL ? comb_uniform(key, budget, 0) : 0.f;
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    if (b32 < 0) return;
    const int n_tiles = (n + BN - 1) / BN;
    const int t0 = (blk * kWarps + warp) * c;
    const int t_end = min(t0 + c, n_tiles);
    const i64 head0 = b * H + (i64)g * G;
    const CacheRows<T, D> V = SC_CACHE_ROWS(v_cache);
    if (n_tiles == 0 && t0 == 0) {                             // an empty sequence: o = 0, lse = -inf
        write_empty_heads<T, D>(out, lse, spread, head0, G);
        if (lane == 0) rows_read[b * KVH + g] = 0;
    }
    // blocks with work: those whose first warp owns a tile (an empty sequence has none)
    const unsigned blocks = (unsigned)((n_tiles + kWarps * c - 1) / (kWarps * c));
    if (blk >= blocks) return;                                 // whole block (an empty sequence)
    const bool fixed = budget == SC_BUDGET_FIXED;
    // fixed: S_t comb points in every tile; the tile's variance is w^2 (sum c ||V||^2 - ||sum c V||^2 / S_t)
    const float inv_s_t = fixed ? 1.f / (float)max(1, samples / n_tiles) : 0.f;
    extern __shared__ __align__(16) unsigned char smem[];
    int* cnt = reinterpret_cast<int*>(smem) + warp * (G * BN + BN);   // [G][BN]
    int* rows = cnt + G * BN;                                          // [BN]
    // this warp's [G][D] run sums: each lane owns a D/32 slice per head (zeroed and written out by
    // slices); the mma gather's threads add their fragment elements instead, which the
    // __syncwarp() of warp_tile_counts and of every tile's end order against the slice accesses
    float* sums_w = reinterpret_cast<float*>(smem) + kWarps * (G * BN + BN) + warp * (G * D);
    float* sums = sums_w + lane * E;
    // SC_GATHER_MMA: the results sit in the mma fragment layout, so they are added to sums_w by
    // (head, dim), not lane slices
    static_assert(kGather != SC_GATHER_MMA || MmaGatherable<T, D>::value, "mma gather: fp16/bf16, D 64/128");
    constexpr bool kMma = kGather == SC_GATHER_MMA;
    // staged gathers: this warp's [kStageRows][D] staging rows after the 4 warps' sums (16-byte aligned)
    constexpr int kStageRows = SC_GATHER_STAGE_BYTES / (D * (int)sizeof(T));
    T* stage = reinterpret_cast<T*>(reinterpret_cast<float*>(smem) + kWarps * (G * BN + BN + G * D)) +
               warp * kStageRows * D;
    // SC_GATHER_PIPE: the pending tile's counts [G][kStageRows] after the 4 warps' stages
    constexpr bool kPipe = kGather == SC_GATHER_PIPE;
    float* coef = reinterpret_cast<float*>(reinterpret_cast<T*>(reinterpret_cast<float*>(smem) +
                                                                kWarps * (G * BN + BN + G * D)) +
                                           kWarps * kStageRows * D) + warp * G * kStageRows;

    float* m2_w = reinterpret_cast<float*>(rows);              // after the run: its m2 per head
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int e = 0; e < E; ++e) sums[h * D + e] = 0.f;
    if (t0 < t_end) {                                          // whole warp
    float m2p[G];                            // this lane's part of m2 (sum c ||V||^2 or the variance)
#pragma unroll
    for (int h = 0; h < G; ++h) m2p[h] = 0.f;
    // A tile's work is a chain: its inputs (lane h < G: head h's pass-1 (m, l), the prefix's C_t,
    // the allocation) decide its comb; the comb says whether its stash scores are needed; the
    // scores give the counts and so the V rows. The chain is pipelined across tiles: inputs are
    // loaded two tiles ahead, and the next tile's comb is set up (and its stash scores issued)
    // before this tile's gather, so its DRAM round trip overlaps this tile's.
    // C_{t-1} is the previous tile's C_t, so only C_t travels ahead.
    constexpr int R = BN / 32;
    // A head whose log-sum-exp is not finite (NaN or inf in its scores) draws no points and its
    // output is NaN (finish_head).
    const i64 head_row = (head0 + (lane < G ? lane : 0)) * T_max;
    auto cdf_at = [&](int t) { return cdf[head_row + t]; };
    // The head's lse and the first tile's inputs in one round trip: every lane loads (a lane past
    // G head 0's, unused), so that no branch orders the loads one behind another.
    const float lse_h = lse[head0 + (lane < G ? lane : 0)];
    float2 st_ahead = *reinterpret_cast<const float2*>(part_s + head_row + t0);   // (m_t, l_t): part_s[., t].xy
    double cc_ahead = cdf_at(t0), c_before = cdf_at(t0 > 0 ? t0 - 1 : 0);
    int alloc_ahead = budget == SC_BUDGET_LR ? alloc[head_row + t0] : 0;
    if (t0 == 0) c_before = 0.0;
    const bool head_ok = lane < G ? isfinite(lse_h) : true;
    auto fetch = [&](int t) {
        if (lane < G && t < t_end) {
            st_ahead = *reinterpret_cast<const float2*>(part_s + head_row + t);
            cc_ahead = cdf_at(t);
            if (budget == SC_BUDGET_LR) alloc_ahead = alloc[head_row + t];
        }
    };
    // The next tile's comb (lane h < G: head h), tile max, weight (fixed: (W_t / Z) / S_t), whether
    // any head has a comb point there, and its stash scores when one has.
    HeadDraw my_next;
    float m_next = 0.f, w_next = 1.f, sc_next[G][R];
    unsigned heads_next = 0u;                // bit h: head h has a comb point in the next tile
    auto plan_tile = [&](int t) {                  // t < t_end; its inputs were fetched
        const float2 st = st_ahead;
        const double cp = c_before, cc = cc_ahead;
        const int alloc_t = alloc_ahead;
        c_before = cc;
        fetch(t + 1);
        if (lane < G && head_ok) {
            m_next = st.x;
            // l_t = 1: the draw's slope a is the tile's points sw, divided by the tile's re-summed
            // exp-sum in warp_tile_counts (the normaliser of the counts themselves)
            setup_head_draw_from(&my_next, budget, SC_SAMPLER_SYSTEMATIC, samples, key, t, n_tiles, 1.f, cp, cc,
                                 alloc_t, budget == SC_BUDGET_GLOBAL ? u_global : comb_uniform(key, budget, t));
            if (fixed) w_next = (float)(cc - cp) * inv_s_t;
        } else {
            my_next.n = 0; my_next.a = 0.f; my_next.off = 0.f; my_next.l = 0.f;
        }
        heads_next = __ballot_sync(0xffffffffu, lane < G && my_next.n > 0);
        if (heads_next)
            warp_tile_scores<BN, G>(sc_next, scores + head0 * L_max + (i64)t * BN, L_max,
                                    (int)min((i64)BN, n - (i64)t * BN), heads_next);
    };
    plan_tile(t0);
    int rows_total = 0;                      // distinct (tile, row) pairs read
    int pend = 0;                            // kPipe: rows of the previous tile waiting in the stage
    float w_pend = 1.f;                      // ... and its weight (lane h: head h)
    for (int t = t0; t < t_end; ++t) {
        const i64 row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - row0);
        const HeadDraw my = my_next;
        const float my_m = m_next, my_w = w_next;
        const unsigned heads = heads_next;
        const bool any = heads != 0u;
        // this tile's counts (into cnt, rows) free sc_next for the next tile's scores, issued
        // before this tile's gather
        const int nsel = any ? warp_tile_counts<BN, G>(cnt, rows, my, my_m, sc_next, nrows, heads) : 0;
        if (stash_in_l2) warp_discard_tile_stash<BN, G>(scores + head0 * L_max + row0, L_max, nrows);
        if (t + 1 < t_end) plan_tile(t + 1);
        if constexpr (kPipe) {
            if (pend) {                      // the previous tile's rows have had this tile's counts to land
                cp_async_wait<0>();
                add_staged_tile<T, D, G, kStageRows>(sums, m2p, stage, coef, pend, w_pend, inv_s_t);
                __syncwarp();                // stage and coef are rewritten below
                pend = 0;
            }
            if (any && nsel <= kStageRows) { // issue this tile's rows; add them after the next tile's counts
                for (int w = lane; w < nsel * G; w += 32) {
                    const int h = w / nsel, r = w - h * nsel;
                    coef[h * kStageRows + r] = (float)cnt[h * BN + rows[r]];
                }
                for (int r = 0; r < nsel; ++r)
                    cp_async_bytes<E * (int)sizeof(T)>(stage + r * D + lane * E, V.row(b, row0 + rows[r], g) + lane * E);
                cp_async_commit();
                __syncwarp();                // coef written; cnt and rows are rewritten by the next tile
                pend = nsel; w_pend = my_w; rows_total += nsel;
                continue;
            }
        }
        if (!any) continue;                  // no comb point here
        if constexpr (kMma) {
            // counts exact in T: no head draws more than kMaxCount points here (n bounds a count)
            if (__ballot_sync(0xffffffffu, lane < G && my.n > MmaGather<T, D, BN, G>::kMaxCount) == 0u) {
                MmaGather<T, D, BN, G> mg;
                mg.run(cnt, rows, nsel, stage, V, b, row0, g);
                // thread (gi, t) holds dims mt*16 + gi (+ 8) of heads 2t, 2t + 1 (gather_mma.cuh)
                const int gi = lane >> 2, tq = lane & 3;
                float q2[2] = {0.f, 0.f};        // this thread's part of ||sum c V||^2, heads 2t, 2t + 1
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                    const int h = 2 * tq + hh;
                    const float w = __shfl_sync(0xffffffffu, my_w, h);
                    if (h < G) {
#pragma unroll
                        for (int mt = 0; mt < MmaGather<T, D, BN, G>::MT; ++mt)
#pragma unroll
                            for (int half = 0; half < 2; ++half) {
                                const float x = mg.acc[mt][2 * half + hh];
                                float& s = sums_w[h * D + mt * 16 + gi + 8 * half];
                                s = fmaf(w, x, s);
                                q2[hh] = fmaf(x, x, q2[hh]);
                            }
                    }
                }
#pragma unroll
                for (int h = 0; h < G; ++h) {
                    const float w = __shfl_sync(0xffffffffu, my_w, h);
                    const float q = (h >> 1) == tq ? q2[h & 1] : 0.f;
                    m2p[h] = fmaf(w * w, mg.m2[h] - q * inv_s_t, m2p[h]);   // global: w = 1, inv_s_t = 0
                }
                rows_total += nsel;
                __syncwarp();                    // cnt, rows and the stage are rewritten by the next tile
                continue;
            }
        }
        float tile[G][E], tile_m2[G];        // this tile's sum c V and this lane's part of sum c ||V||^2
#pragma unroll
        for (int h = 0; h < G; ++h) {
            tile_m2[h] = 0.f;
#pragma unroll
            for (int e = 0; e < E; ++e) tile[h][e] = 0.f;
        }
        warp_gather_add_staged<T, D, BN, G, kStageRows>(tile, tile_m2, cnt, rows, nsel, stage, V, b, row0, g);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float w = __shfl_sync(0xffffffffu, my_w, h);
            float q2 = 0.f;                  // this lane's part of ||sum c V||^2
#pragma unroll
            for (int e = 0; e < E; ++e) {
                sums[h * D + e] = fmaf(w, tile[h][e], sums[h * D + e]);
                q2 = fmaf(tile[h][e], tile[h][e], q2);
            }
            m2p[h] = fmaf(w * w, tile_m2[h] - q2 * inv_s_t, m2p[h]);   // global: w = 1, inv_s_t = 0
        }
        rows_total += nsel;
        __syncwarp();                        // cnt and rows are rewritten by the next tile
    }
    if constexpr (kPipe) {
        if (pend) {                          // the run's last pipelined tile
            cp_async_wait<0>();
            add_staged_tile<T, D, G, kStageRows>(sums, m2p, stage, coef, pend, w_pend, inv_s_t);
            __syncwarp();
        }
    }
    // The run's m2 per head into this warp's m2_w (rows is free now); rows read.
#pragma unroll
    for (int h = 0; h < G; ++h) {
        const float m2 = warp_sum(m2p[h]);
        if (lane == 0) m2_w[h] = m2;
    }
    if (lane == 0 && rows_total > 0) atomicAdd(&rows_read[b * KVH + g], rows_total);
    } else if (lane < G) {
        m2_w[lane] = 0.f;
    }
    // The block's 4 runs summed (sums_all: the 4 warps' [G][D] sums; warp w's m2_w after its
    // cnt [G][BN]), then
    //   kFinish: added into one of SC_ACC_COPIES copies of the call's accumulators (by block: fewer
    //     atomics on each address; exact zeros, no point, are skipped);
    //   !kFinish: stored as the block's partial, part_o[b, h, blk, :] and part_s[b, h, blk].z = m2
    //     (every block with work writes one, zeros where it drew no point).
    __syncthreads();
    const float* sums_all = reinterpret_cast<const float*>(smem) + kWarps * (G * BN + BN);
    auto m2_of = [&](int w, int h) { return reinterpret_cast<const float*>(smem)[w * (G * BN + BN) + G * BN + h]; };
    const i64 copy_stride = (i64)batch * H * (D + 1);
    // kFinish: this block's copy (!kFinish: acc is a placeholder, never read)
    float* const copy = kFinish ? acc + (i64)(blk % SC_ACC_COPIES) * copy_stride : nullptr;
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) x += sums_all[w * G * D + idx];
        if constexpr (kFinish) {
            if (x != 0.f) atomicAdd(copy + head0 * D + idx, x);
        } else {
            part_o[((head0 + idx / D) * T_max + blk) * D + idx % D] = x;
        }
    }
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS) {
        float x = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) x += m2_of(w, h);
        if constexpr (kFinish) {
            if (x != 0.f) atomicAdd(copy + (i64)batch * H * D + head0 + h, x);
        } else {
            part_s[(head0 + h) * T_max + blk].z = x;
        }
    }
    // The last block of the (b, KV head) to finish writes o and spread (kFinish: and zeroes the
    // copies).
    if (!block_arrives_last(arrive + b * KVH + g, blocks)) return;
    const float inv_s = fixed ? 0.f : 1.f / (float)samples;
    for (int h = warp; h < G; h += kWarps) {
        if constexpr (kFinish)
            finish_head<T, D>(acc + (head0 + h) * D, acc + (i64)batch * H * D + head0 + h, copy_stride, inv_s,
                              isfinite(lse[head0 + h]), out + (head0 + h) * D, spread + head0 + h);
        else
            finish_head_from_parts<T, D>(part_o + (head0 + h) * T_max * D, part_s + (head0 + h) * T_max, (int)blocks,
                                         inv_s, isfinite(lse[head0 + h]), out + (head0 + h) * D, spread + head0 + h);
    }
}

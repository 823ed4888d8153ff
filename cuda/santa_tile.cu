// santa_tile.cu — S2ANTA per-tile sample and gather-add (pass 2), and the fused fixed budget.
//
// grid (T_max, KVH, B), block SC_NTHREADS; one block = one tile of BN rows of one KV group.
// Scores come from the stash of santa_score.cu (budgets global and largest_remainder) or, for
// budget fixed, are computed here from K (one fused pass). mode:
//   0 fused: sample, gather-add (tiles without samples return early and write nothing), write part_o[b,h,t,:] = sum c V and part_s[b,h,t] =
//            (m_t, l_t, sum c ||V||^2, ||sum c V||^2); rows_read[b,g] += distinct rows read
//   1 sample only: write counts[b, h, j] for the tile's rows
//   2 gather only: read counts[b, h, j] instead of sampling, then as mode 0
// Tiles past n_b exit at once. The RNG key of a head is head_key(seed, *step, layer, b, h).
//
// Shared memory (santa_cupy/kernels.py:tile_smem_bytes):
//   cum [G][BN] f32 | cnt [G][BN] i32 | acc [RG][G][D] f32 | m2p [RG][G] f32 | rows [BN] i32 |
//   warp_tot [4] i32 | m, l [G] f32 | draws [G] HeadDraw
#include "common.cuh"
#include "tile.cuh"
#include "santa_sample.cuh"
#include "santa_gather.cuh"
#include "stream.cuh"

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
           int budget, int sampler, int samples, int mode, u64 seed, const i64* __restrict__ step,
           int layer, const float* __restrict__ scores, const double* __restrict__ cdf,
           const int* __restrict__ alloc, float4* __restrict__ part_s, float* __restrict__ part_o,
           int* __restrict__ counts, int* __restrict__ rows_read) {
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

    // ---- tile stats (and, for budget fixed, the scores, into cum) ----
    if (budget == SC_BUDGET_FIXED) {             // fused: score the tile here
        GroupQuery<T, D, G> gq;
        gq.load(q, b, g, H, scale);
        stream_tile_scores<T, D, G, BN>(cum, gq, k_cache, b, row0, nrows, g, L_max, KVH);
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
            const u64 key = head_key(seed, (u64)step[0], (u64)layer, (u64)b, (u64)(g * G + h));
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
                sc = budget == SC_BUDGET_FIXED ? cum[idx] : scores[(head0 + h) * L_max + row0 + j];
            cum[idx] = j < nrows ? __expf(sc - m[h]) : 0.f;
            cnt[idx] = 0;
        }
        __syncthreads();
        tile_cumsum<BN>(cum, G);
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
    gather_add<T, D, BN>(acc, m2p, rows, nsel, cnt, G, v_cache, b, row0, g, L_max, KVH);
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

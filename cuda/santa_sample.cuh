// santa_sample.cuh — the sample stage of one tile: counts c[h][j] for the G heads of a group.
//
// Implements the sampling contract of docs/DESIGN.md (same arithmetic as santa_cupy/reference.py):
// per head a HeadDraw describes the comb points that fall in this tile; systematic draws use the
// closed form N(F) = clamp(ceil(a*cum_j - off), 0, n); stratified and iid draws locate each point
// by binary search in the tile's cumulative exp-sum. Explicit _rn intrinsics keep float32
// rounding identical to NumPy (no FMA contraction).
#pragma once

#define SC_BUDGET_FIXED 0
#define SC_BUDGET_GLOBAL 1
#define SC_BUDGET_LR 2
#define SC_SAMPLER_IID 0
#define SC_SAMPLER_STRATIFIED 1
#define SC_SAMPLER_SYSTEMATIC 2

struct HeadDraw {
    u64 key;          // head_key(seed, step, layer, b, h)
    double c_prev;    // global budget: C_{t-1}
    double c_cur;     // global budget: C_t
    float l;          // tile exp-sum l_t
    float off;        // systematic: offset of the first comb point, in [0, 1)
    float a;          // systematic: sw / l_t
    int n;            // systematic / local draws: number of samples in this tile
    int k_begin;      // global stratified / iid: first candidate point index
    int k_end;        // one past the last candidate
};

// Thread h < G fills draws[h] for tile t (n_tiles tiles in this sequence) from the tile's inputs:
// its exp-sum l_t, the prefix's C_{t-1} and C_t (budget global) and its allocation (largest
// remainder); the values, so that a caller may load them ahead (santa_tile_warp).
__device__ __forceinline__ void setup_head_draw_from(HeadDraw* d, int budget, int sampler, int samples,
                                                     u64 key, int t, int n_tiles, float l_t, double cp,
                                                     double cc, int alloc_t) {
    d->key = key; d->l = l_t; d->off = 0.f; d->a = 0.f; d->n = 0; d->k_begin = 0; d->k_end = 0;
    d->c_prev = 0.0; d->c_cur = 0.0;
    if (budget == SC_BUDGET_GLOBAL) {
        const double S = (double)samples;
        d->c_prev = cp; d->c_cur = cc;
        if (sampler == SC_SAMPLER_SYSTEMATIC) {
            const double U = (double)uniform01(key, SC_GLOBAL_TILE, 0);
            const double k0 = ceil(S * cp - U), k1 = ceil(S * cc - U);
            d->n = (int)(k1 - k0);
            d->off = (float)(k0 + U - S * cp);
            d->a = __fdiv_rn((float)(S * (cc - cp)), l_t);
        } else if (sampler == SC_SAMPLER_STRATIFIED) {
            d->k_begin = (int)floor(S * cp);
            d->k_end = min(samples - 1, (int)floor(S * cc)) + 1;
        } else {
            d->k_begin = 0; d->k_end = samples;
        }
    } else {
        const int s_t = budget == SC_BUDGET_FIXED ? max(1, samples / n_tiles) : alloc_t;
        d->n = s_t;
        if (sampler == SC_SAMPLER_SYSTEMATIC) {
            d->off = uniform01(key, (u64)t, 0);
            d->a = __fdiv_rn((float)s_t, l_t);
        } else {
            d->k_begin = 0; d->k_end = s_t;
        }
    }
}

// The same, loading what the budget needs from the head's cdf / alloc rows.
__device__ __forceinline__ void setup_head_draw(HeadDraw* d, int budget, int sampler, int samples,
                                                u64 key, int t, int n_tiles, float l_t,
                                                const double* cdf_head, const int* alloc_head) {
    if (budget == SC_BUDGET_GLOBAL)
        setup_head_draw_from(d, budget, sampler, samples, key, t, n_tiles, l_t, t ? cdf_head[t - 1] : 0.0,
                             cdf_head[t], 0);
    else
        setup_head_draw_from(d, budget, sampler, samples, key, t, n_tiles, l_t, 0.0, 0.0,
                             budget == SC_BUDGET_LR ? alloc_head[t] : 0);
}

// Number of systematic comb points below cumulative value `cum` (the closed form).
__device__ __forceinline__ int comb_below(const HeadDraw& d, float cum) {
    const float x = ceilf(__fsub_rn(__fmul_rn(d.a, cum), d.off));
    return (int)fminf(fmaxf(x, 0.f), (float)d.n);
}

// First row j < nrows with cum[j] > y * l (the last row if none).
template <int BN>
__device__ __forceinline__ int locate(const float* cum, int nrows, float y, float l) {
    const float target = __fmul_rn(y, l);
    int lo = 0, hi = nrows - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (cum[mid] > target) hi = mid; else lo = mid + 1;
    }
    return lo;
}

// Local coordinate y in [0, 1) of candidate point k of head draw d, or -1 if k is not in this tile.
__device__ __forceinline__ float point_coordinate(const HeadDraw& d, int budget, int sampler, int samples,
                                                  int t, int k) {
    if (budget == SC_BUDGET_GLOBAL) {
        const double u = (double)uniform01(d.key, SC_GLOBAL_TILE, (u64)k);
        const double x = sampler == SC_SAMPLER_STRATIFIED ? ((double)k + u) / (double)samples : u;
        if (x < d.c_prev || x >= d.c_cur) return -1.f;
        return (float)((x - d.c_prev) / (d.c_cur - d.c_prev));
    }
    const float u = uniform01(d.key, (u64)t, (u64)k);
    if (sampler == SC_SAMPLER_STRATIFIED) return __fdiv_rn(__fadd_rn((float)k, u), (float)d.n);
    return u;
}

// cum[G][BN] holds exp(s - m_t) on entry and becomes the inclusive per-head cumulative sum
// (one warp per head, lanes own consecutive runs of BN/32 rows: a fixed summation order).
template <int BN>
__device__ __forceinline__ void tile_cumsum(float* cum, int G) {
    constexpr int kPerLane = BN / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int h = warp; h < G; h += SC_NTHREADS / 32) {
        float* c = cum + h * BN + lane * kPerLane;
        float run = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) { run += c[i]; c[i] = run; }
        const float before = warp_inclusive_scan(run) - run;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) c[i] += before;
    }
}

// Fill cnt[G][BN] (must be zero on entry for non-systematic samplers) from cum[G][BN].
template <int BN>
__device__ __forceinline__ void tile_counts(int* cnt, const float* cum, const HeadDraw* draws, int G,
                                            int nrows, int budget, int sampler, int samples, int t) {
    if (sampler == SC_SAMPLER_SYSTEMATIC) {
        for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
            const int h = idx / BN, j = idx % BN;
            const HeadDraw& d = draws[h];
            int c = 0;
            if (j < nrows) {
                const int upto = (j == nrows - 1) ? d.n : comb_below(d, cum[idx]);
                const int before = j == 0 ? 0 : comb_below(d, cum[idx - 1]);
                c = upto - before;
            }
            cnt[idx] = c;
        }
        return;
    }
    for (int h = 0; h < G; ++h) {
        const HeadDraw& d = draws[h];
        for (int k = d.k_begin + threadIdx.x; k < d.k_end; k += SC_NTHREADS) {
            const float y = point_coordinate(d, budget, sampler, samples, t, k);
            if (y < 0.f) continue;
            atomicAdd(&cnt[h * BN + locate<BN>(cum + h * BN, nrows, y, d.l)], 1);
        }
    }
}

// ---- the two-level systematic comb (santa_tile_warp, and santa_tile on the two-pass route) ----
// A tile's rows fall in NS = BN / SC_SEG_ROWS segments of 32; the score pass writes each segment's
// (max m_c, exp-sum l_c) to seg_s[b, h, t, c]. Level 1 (segment_comb) spreads the tile's n comb
// points over its segments by their masses M_c = l_c exp(m_c - m_t), the slope over their float32
// sum (the counts' normaliser: the tile's last segment takes the rest); level 2
// (segment_row_counts) spreads a segment's points over its 32 rows by the rows' re-summed
// cumulative exp-sum x_j, the slope rescaled by M_c / x_last (the segment's last row takes the
// rest). In exact arithmetic these are the one-level comb's counts (points at (k + off) / a of the
// tile's mass); in float32 a point may move across a row boundary. Only segments holding a point
// read their scores: 32 rows a point at most, instead of the tile's BN rows of every head.
// Lanes own segments: lane p = hl * NS + c, segment c of the warp's head hl.
struct SegmentComb {
    float a;     // level-1 slope times M_c (level 2 divides it by the segment's re-summed exp-sum)
    float off;   // offset of the segment's first point, in points (the one-level comb's off, rebased)
    float m;     // m_t of the segment's head
    int n;       // points in the segment
};

// Level 1 for the lane's segment (valid: the lane owns one; sw, off, n: its head's draw with
// l_t = 1, i.e. a = sw; m_t its head's tile max; seg its (m_c, l_c)); nrows >= 1 rows in the
// tile. Returns the ballot of segments holding points. Whole warp.
template <int BN>
__device__ __forceinline__ unsigned segment_comb(SegmentComb& sc, bool valid, float sw, float off, int n,
                                                 float m_t, float2 seg, int nrows) {
    constexpr int NS = BN / SC_SEG_ROWS;
    const int lane = threadIdx.x & 31, c = lane % NS;
    const int c_last = (nrows - 1) / SC_SEG_ROWS;          // segments past it hold no rows
    const float M = valid && c <= c_last ? __fmul_rn(seg.y, __expf(seg.x - m_t)) : 0.f;
    float P = M;                                           // inclusive sum over the head's segments
#pragma unroll
    for (int o = 1; o < NS; o <<= 1) {
        const float x = __shfl_up_sync(0xffffffffu, P, o);
        if (c >= o) P = __fadd_rn(P, x);
    }
    HeadDraw d;
    d.a = __fdiv_rn(sw, __shfl_sync(0xffffffffu, P, lane - c + c_last));
    d.off = off;
    d.n = n;
    const int N = c >= c_last ? n : comb_below(d, P);      // points below the segment's end
    int N_prev = __shfl_up_sync(0xffffffffu, N, 1);
    float P_prev = __shfl_up_sync(0xffffffffu, P, 1);
    if (c == 0) { N_prev = 0; P_prev = 0.f; }
    sc.n = valid ? N - N_prev : 0;
    sc.off = __fsub_rn(__fadd_rn((float)N_prev, off), __fmul_rn(d.a, P_prev));
    sc.a = __fmul_rn(d.a, M);
    sc.m = m_t;
    return __ballot_sync(0xffffffffu, sc.n > 0);
}

// Level 2 for segment p (warp-uniform; sc: segment_comb's, held by lane p) of a tile of nrows
// rows: lane i's row c * 32 + i (c = p % NS) with score s (any value past nrows) gets its count
// into cnt_h[row] (cnt_h: the segment's head's [BN] counts). Returns the ballot of rows with a count.
template <int BN>
__device__ __forceinline__ unsigned segment_row_counts(int* cnt_h, const SegmentComb& sc, int p, float s, int nrows) {
    constexpr int NS = BN / SC_SEG_ROWS;
    const int lane = threadIdx.x & 31, c = p % NS, row = c * SC_SEG_ROWS + lane;
    const float a = __shfl_sync(0xffffffffu, sc.a, p), m_t = __shfl_sync(0xffffffffu, sc.m, p);
    HeadDraw d;
    d.off = __shfl_sync(0xffffffffu, sc.off, p);
    d.n = __shfl_sync(0xffffffffu, sc.n, p);
    const float x = warp_inclusive_scan(row < nrows ? __expf(s - m_t) : 0.f);
    const float X = __shfl_sync(0xffffffffu, x, 31);
    d.a = X > 0.f ? __fdiv_rn(a, X) : 0.f;
    const int last = min(c * SC_SEG_ROWS + SC_SEG_ROWS - 1, nrows - 1);
    const int N = row >= last ? d.n : comb_below(d, x);
    int prev = __shfl_up_sync(0xffffffffu, N, 1);
    if (lane == 0) prev = 0;
    cnt_h[row] = N - prev;
    return __ballot_sync(0xffffffffu, N > prev);
}

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

// The systematic comb's uniform offset of a head: one per head for the global budget (its comb
// spans the sequence), one per tile otherwise.
__device__ __forceinline__ float comb_uniform(u64 key, int budget, int t) {
    return uniform01(key, budget == SC_BUDGET_GLOBAL ? SC_GLOBAL_TILE : (u64)t, 0);
}

// Thread h < G fills draws[h] for tile t (n_tiles tiles in this sequence) from the tile's inputs:
// its exp-sum l_t, the prefix's C_{t-1} and C_t (budget global), its allocation (largest
// remainder) and, systematic, the comb's offset u = comb_uniform(key, budget, t); the values, so
// that a caller may load and draw them ahead (santa_tile_warp).
__device__ __forceinline__ void setup_head_draw_from(HeadDraw* d, int budget, int sampler, int samples,
                                                     u64 key, int t, int n_tiles, float l_t, double cp,
                                                     double cc, int alloc_t, float u) {
    d->key = key; d->l = l_t; d->off = 0.f; d->a = 0.f; d->n = 0; d->k_begin = 0; d->k_end = 0;
    d->c_prev = 0.0; d->c_cur = 0.0;
    if (budget == SC_BUDGET_GLOBAL) {
        const double S = (double)samples;
        d->c_prev = cp; d->c_cur = cc;
        if (sampler == SC_SAMPLER_SYSTEMATIC) {
            const double U = (double)u;
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
            d->off = u;
            d->a = __fdiv_rn((float)s_t, l_t);
        } else {
            d->k_begin = 0; d->k_end = s_t;
        }
    }
}

// The same, loading what the budget needs from the head's cdf / alloc rows and drawing u.
__device__ __forceinline__ void setup_head_draw(HeadDraw* d, int budget, int sampler, int samples,
                                                u64 key, int t, int n_tiles, float l_t,
                                                const double* cdf_head, const int* alloc_head) {
    auto u = [&] { return sampler == SC_SAMPLER_SYSTEMATIC ? comb_uniform(key, budget, t) : 0.f; };
    if (budget == SC_BUDGET_GLOBAL)
        setup_head_draw_from(d, budget, sampler, samples, key, t, n_tiles, l_t, t ? cdf_head[t - 1] : 0.0,
                             cdf_head[t], 0, u());
    else
        setup_head_draw_from(d, budget, sampler, samples, key, t, n_tiles, l_t, 0.0, 0.0,
                             budget == SC_BUDGET_LR ? alloc_head[t] : 0, u());
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

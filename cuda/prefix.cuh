// prefix.cuh — the float64 global prefix of one head's tiles, by one warp (santa_one_launch: every
// block computes its group's prefix itself).
#pragma once
#include "common.cuh"

// One warp: the float64 global prefix of one head from its tile stats st[0 .. n_tiles) (m_t, l_t):
// m* = max m_t, W_t = exp(m_t - m*) l_t, C_t = sum_{u <= t} W_u / Z (the last C exactly 1), as
// santa_prefix defines it (its block scan adds in another order: the two agree to rounding).
// Lane i sums tiles [i * per, (i + 1) * per) in order, loading kBatch of them at a time (three
// passes over L2: max, sums, the prefix where it is written); C_t is written for t in
// [w_begin, w_end) only. The same inputs give the same bits in every block of santa_one_launch.
// Returns lse = m* + log Z (NaN when a score was NaN).
__device__ __forceinline__ float warp_prefix(const float4* st, double* C, int n_tiles, int w_begin, int w_end) {
    constexpr int kBatch = 8;
    const int lane = threadIdx.x & 31;
    const int per = (n_tiles + 31) / 32;
    const int t_lo = min(lane * per, n_tiles), t_hi = min(t_lo + per, n_tiles);
    const float2* ml = reinterpret_cast<const float2*>(st);   // (m_t, l_t): .xy of the float4 stats
    double m_star = -1.0 / 0.0;
    for (int t = t_lo; t < t_hi; t += kBatch) {
        float x[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) x[i] = t + i < t_hi ? __ldcg(ml + 2 * (t + i)).x : -SC_INF;
#pragma unroll
        for (int i = 0; i < kBatch; ++i) m_star = fmax(m_star, (double)x[i]);
    }
    for (int o = 16; o > 0; o >>= 1) m_star = fmax(m_star, __shfl_xor_sync(0xffffffffu, m_star, o));
    double run = 0.0;
    for (int t = t_lo; t < t_hi; t += kBatch) {
        float2 x[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) x[i] = t + i < t_hi ? __ldcg(ml + 2 * (t + i)) : make_float2(0.f, 0.f);
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
            if (t + i < t_hi) run += exp((double)x[i].x - m_star) * (double)x[i].y;
    }
    double incl = run;
    for (int o = 1; o < 32; o <<= 1) {
        const double y = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += y;
    }
    const double Z = __shfl_sync(0xffffffffu, incl, 31);
    if (t_lo < w_end && t_hi > w_begin) {               // this lane's tiles reach the block's
        double c = incl - run;
        for (int t = t_lo; t < t_hi; t += kBatch) {
            float2 x[kBatch];
#pragma unroll
            for (int i = 0; i < kBatch; ++i) x[i] = t + i < t_hi ? __ldcg(ml + 2 * (t + i)) : make_float2(0.f, 0.f);
#pragma unroll
            for (int i = 0; i < kBatch; ++i) {
                if (t + i >= t_hi) break;
                c += exp((double)x[i].x - m_star) * (double)x[i].y;
                if (t + i >= w_begin && t + i < w_end) C[t + i] = (t + i == n_tiles - 1) ? 1.0 : c / Z;
            }
        }
    }
    return (float)(m_star + log(Z));
}

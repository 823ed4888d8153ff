// prefix.cuh — the float64 global prefix of one head's tiles, by one warp (santa_prefix and
// santa_one_launch compute it with this one function, so both pipelines draw the same comb).
#pragma once
#include "common.cuh"

// One warp: the float64 global prefix of one head from its tile stats st[0 .. n_tiles) (m_t, l_t)
// as santa_prefix computes it (m* = max m_t, W_t = exp(m_t - m*) l_t, C_t = sum_{u <= t} W_u / Z,
// the last C exactly 1), lane i summing tiles [i * per, (i + 1) * per) in order; C_t is written
// for t in [w_begin, w_end) only. Returns lse = m* + log Z (NaN when a score was NaN).
__device__ __forceinline__ float warp_prefix(const float4* st, double* C, int n_tiles, int w_begin, int w_end) {
    const int lane = threadIdx.x & 31;
    const int per = (n_tiles + 31) / 32;
    const int t_lo = min(lane * per, n_tiles), t_hi = min(t_lo + per, n_tiles);
    double m_star = -1.0 / 0.0;
    for (int t = t_lo; t < t_hi; ++t) m_star = fmax(m_star, (double)__ldcg(&st[t].x));
    for (int o = 16; o > 0; o >>= 1) m_star = fmax(m_star, __shfl_xor_sync(0xffffffffu, m_star, o));
    double run = 0.0;
    for (int t = t_lo; t < t_hi; ++t) {
        const float2 ml = __ldcg(reinterpret_cast<const float2*>(st + t));
        run += exp((double)ml.x - m_star) * (double)ml.y;
    }
    double incl = run;
    for (int o = 1; o < 32; o <<= 1) {
        const double x = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += x;
    }
    const double Z = __shfl_sync(0xffffffffu, incl, 31);
    if (t_lo < w_end && t_hi > w_begin) {               // this lane's tiles reach the block's
        double c = incl - run;
        for (int t = t_lo; t < t_hi; ++t) {
            const float2 ml = __ldcg(reinterpret_cast<const float2*>(st + t));
            c += exp((double)ml.x - m_star) * (double)ml.y;
            if (t >= w_begin && t < w_end) C[t] = (t == n_tiles - 1) ? 1.0 : c / Z;
        }
    }
    return (float)(m_star + log(Z));
}

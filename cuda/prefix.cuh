// prefix.cuh — one head's global comb preparation for the two-pass budgets (device code), by a
// whole block of NT threads: santa_prefix (a block a head) and santa_score_mma's last block per
// (sequence, KV head) (DecodePlan's fused prefix) run the same code, so both give the same bits.
//
// From the tile stats of pass 1, part_s[t] = (m_t, l_t, ., .) for t < n_tiles, in float64:
// m* = max m_t, W_t = exp(m_t - m*) l_t, Z, and the inclusive prefix C_t = sum W / Z (C of the last
// tile set to exactly 1), written to cdf[t]; *lse = m* + log Z (NaN when a score was NaN: the warp
// pass 2 then writes NaN). For budget largest_remainder it also writes the Hamilton allocation
// alloc[t] of S samples: floor(S w_t) plus one for the S - sum(floor) tiles with the largest
// remainders (ties: lower t first). The stats are read through L2 (__ldcg): in the fused prefix
// other blocks of the same kernel wrote them.
#pragma once

template <int NT>
__device__ __forceinline__ double block_reduce_max_d(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < NT / 32; ++w) v = fmax(v, red[w]);
    return v;
}

// Inclusive scan over the block (in thread order); returns this thread's prefix, *total the sum.
template <int NT>
__device__ __forceinline__ double block_scan_d(double v, double* red, double* total) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int o = 1; o < 32; o <<= 1) {
        const double n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    __syncthreads();
    if (lane == 31) red[warp] = v;
    __syncthreads();
    double before = 0.0, all = 0.0;
    for (int w = 0; w < NT / 32; ++w) {
        if (w < warp) before += red[w];
        all += red[w];
    }
    *total = all;
    return v + before;
}

// One head's cdf [n_tiles], lse and (budget_lr) alloc [n_tiles] from its stats st [n_tiles];
// n_tiles >= 1. Whole block (blockDim.x == NT); ends with a barrier, so it can run again at once.
template <int NT>
__device__ void head_prefix(const float4* st, int n_tiles, int samples, int budget_lr, double* C, int* alloc,
                            float* lse) {
    __shared__ double red[NT / 32];
    __shared__ int fsum[NT / 32];
    double m_star = -1.0 / 0.0;
    for (int t = threadIdx.x; t < n_tiles; t += NT) m_star = fmax(m_star, (double)__ldcg(&st[t].x));
    m_star = block_reduce_max_d<NT>(m_star, red);

    double carry = 0.0;                          // sum of W over the chunks already scanned
    for (int base = 0; base < n_tiles; base += NT) {
        const int t = base + threadIdx.x;
        const double w = t < n_tiles ? exp((double)__ldcg(&st[t].x) - m_star) * (double)__ldcg(&st[t].y) : 0.0;
        double chunk_total;
        const double incl = block_scan_d<NT>(w, red, &chunk_total);
        if (t < n_tiles) C[t] = carry + incl;    // unnormalised for now
        carry += chunk_total;
    }
    __syncthreads();
    const double Z = carry;
    if (threadIdx.x == 0) *lse = (float)(m_star + log(Z));
    for (int t = threadIdx.x; t < n_tiles; t += NT)
        C[t] = (t == n_tiles - 1) ? 1.0 : C[t] / Z;
    __syncthreads();
    if (!budget_lr) return;

    // Hamilton rounding: count the floors, then rank the remainders.
    const double S = (double)samples;
    int floor_sum = 0;
    for (int t = threadIdx.x; t < n_tiles; t += NT) {
        const double sw = S * (C[t] - (t ? C[t - 1] : 0.0));
        floor_sum += (int)floor(sw);
    }
    for (int o = 16; o > 0; o >>= 1) floor_sum += __shfl_xor_sync(0xffffffffu, floor_sum, o);
    if ((threadIdx.x & 31) == 0) fsum[threadIdx.x >> 5] = floor_sum;
    __syncthreads();
    int total_floor = 0;
    for (int w = 0; w < NT / 32; ++w) total_floor += fsum[w];
    const int extra = samples - total_floor;
    for (int t = threadIdx.x; t < n_tiles; t += NT) {
        const double sw = S * (C[t] - (t ? C[t - 1] : 0.0));
        const double rem = sw - floor(sw);
        int rank = 0;
        for (int u = 0; u < n_tiles; ++u) {
            const double su = S * (C[u] - (u ? C[u - 1] : 0.0));
            const double ru = su - floor(su);
            rank += (ru > rem) || (ru == rem && u < t);
        }
        alloc[t] = (int)floor(sw) + (rank < extra ? 1 : 0);
    }
    __syncthreads();
}

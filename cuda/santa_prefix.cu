// santa_prefix.cu — per-head global comb preparation for the two-pass budgets.
//
// grid (H, B), block 256 (SC_PREFIX_THREADS). From the tile stats of pass 1 it computes, in
// float64: m* = max m_t, W_t = exp(m_t - m*) l_t, Z, and the inclusive prefix C_t = sum W / Z
// (C of the last tile set to exactly 1), written to cdf[b, h, t]; lse[b, h] = m* + log Z (NaN when
// a score was NaN: the warp pass 2 then writes NaN), and rows_read[b, h / G] = 0 from the first
// head of each group (santa_tile_warp adds this call's rows). Sequences shorter than santa_from
// (a santa plan's dense fallback) are left alone. For budget largest_remainder
// it also writes the Hamilton allocation alloc[b, h, t] of S samples: floor(S w_t) plus one for
// the S - sum(floor) tiles with the largest remainders (ties: lower t first).
#include "common.cuh"

#define SC_PREFIX_THREADS 256

__device__ __forceinline__ double block_reduce_max_d(double v, double* red) {
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < SC_PREFIX_THREADS / 32; ++w) v = fmax(v, red[w]);
    return v;
}

// Inclusive scan over the block (in thread order); returns this thread's prefix, *total the sum.
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
    for (int w = 0; w < SC_PREFIX_THREADS / 32; ++w) {
        if (w < warp) before += red[w];
        all += red[w];
    }
    *total = all;
    return v + before;
}

__global__ void __launch_bounds__(SC_PREFIX_THREADS)
santa_prefix(const float4* __restrict__ part_s, const int* __restrict__ lengths, i64 L_max, int H, int BN,
             int T_max, int samples, int budget_lr, double* __restrict__ cdf, int* __restrict__ alloc,
             float* __restrict__ lse, int* __restrict__ rows_read, int G, int santa_from) {
    pdl_launch_dependents();
    __shared__ double red[SC_PREFIX_THREADS / 32];
    const int h = blockIdx.x;
    const i64 b = blockIdx.y;
    // lengths before the wait: no kernel of the pipeline writes them (common.cuh, pdl_wait)
    const int n = seq_len(lengths, b, L_max);
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    if (n < santa_from || n == 0) return;       // the dense kernel's, or empty (santa_tile_warp writes it)
    const int n_tiles = (n + BN - 1) / BN;
    if (threadIdx.x == 0 && h % G == 0) rows_read[b * (H / G) + h / G] = 0;
    const float4* st = part_s + (b * H + h) * T_max;
    double* C = cdf + (b * H + h) * T_max;

    double m_star = -1.0 / 0.0;
    for (int t = threadIdx.x; t < n_tiles; t += SC_PREFIX_THREADS) m_star = fmax(m_star, (double)st[t].x);
    m_star = block_reduce_max_d(m_star, red);

    // The first chunk's unnormalised C stays in a register (a sequence of up to 256 tiles is
    // written once, and its normalisation reads nothing back); later chunks' go through cdf.
    double carry = 0.0;                          // sum of W over the chunks already scanned
    double c_first = 0.0;                        // this thread's C of the first chunk, unnormalised
    for (int base = 0; base < n_tiles; base += SC_PREFIX_THREADS) {
        const int t = base + threadIdx.x;
        const double w = t < n_tiles ? exp((double)st[t].x - m_star) * (double)st[t].y : 0.0;
        double chunk_total;
        const double incl = block_scan_d(w, red, &chunk_total);
        if (base == 0) c_first = incl;
        else if (t < n_tiles) C[t] = carry + incl;   // unnormalised for now
        carry += chunk_total;
    }
    __syncthreads();
    const double Z = carry;
    if (threadIdx.x == 0) lse[b * H + h] = (float)(m_star + log(Z));
    for (int t = threadIdx.x; t < n_tiles; t += SC_PREFIX_THREADS)
        C[t] = (t == n_tiles - 1) ? 1.0 : (t < SC_PREFIX_THREADS ? c_first : C[t]) / Z;
    if (!budget_lr) return;

    __syncthreads();
    // Hamilton rounding: count the floors, then rank the remainders.
    const double S = (double)samples;
    int floor_sum = 0;
    for (int t = threadIdx.x; t < n_tiles; t += SC_PREFIX_THREADS) {
        const double sw = S * (C[t] - (t ? C[t - 1] : 0.0));
        floor_sum += (int)floor(sw);
    }
    for (int o = 16; o > 0; o >>= 1) floor_sum += __shfl_xor_sync(0xffffffffu, floor_sum, o);
    __shared__ int fsum[SC_PREFIX_THREADS / 32];
    if ((threadIdx.x & 31) == 0) fsum[threadIdx.x >> 5] = floor_sum;
    __syncthreads();
    int total_floor = 0;
    for (int w = 0; w < SC_PREFIX_THREADS / 32; ++w) total_floor += fsum[w];
    const int extra = samples - total_floor;
    for (int t = threadIdx.x; t < n_tiles; t += SC_PREFIX_THREADS) {
        const double sw = S * (C[t] - (t ? C[t - 1] : 0.0));
        const double rem = sw - floor(sw);
        int rank = 0;
        for (int u = 0; u < n_tiles; ++u) {
            const double su = S * (C[u] - (u ? C[u - 1] : 0.0));
            const double ru = su - floor(su);
            rank += (ru > rem) || (ru == rem && u < t);
        }
        alloc[(b * H + h) * T_max + t] = (int)floor(sw) + (rank < extra ? 1 : 0);
    }
}

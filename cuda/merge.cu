// merge.cu — merge per-part partials into the attention output, its log-sum-exp and spread.
//
// grid (H, B), block SC_MERGE_THREADS (below). Parts are dense splits (split_target > 0: rows per split
// from common.cuh's dense_split, as decode_dense_* split them) or santa tiles / runs (part_rows rows
// each); sequence b has ceil(n_b / part_rows) of them. part_s = (m, l, m2, q2).
// kind 0 dense:  o = sum_p e^(m_p - m*) part_o_p / Z,           Z = sum_p e^(m_p - m*) l_p
// kind 1 fixed:  o = sum_t (W_t/Z) part_o_t / S_t,             S_t = max(1, S // T_b)
//                var = sum_t (W_t/Z)^2 (m2_t - q2_t / S_t) / S_t^2
// kind 2 global / largest_remainder: o = part_o summed / S,   var = max(0, sum m2 / S - |o|^2) / S
// lse = m* + log Z; spread = sqrt(var / D). Parts with l == 0 hold no rows and are skipped, and
// (kind 2) tiles without samples (part_s.zw zero: santa_tile wrote no partial there).
// (santa_tile_warp, the two-launch pipeline's pass 2, finishes its heads itself.)
#include "common.cuh"
#include "merge.cuh"

#define SC_MERGE_DENSE 0
#define SC_MERGE_FIXED 1
#define SC_MERGE_SUM 2

#define SC_MERGE_THREADS 256

// Block-wide combine of the (m, z) pairs; every thread gets the result.
__device__ __forceinline__ void block_lse(float& m, float& z, float* red_m, float* red_z) {
    warp_lse(m, z);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) { red_m[warp] = m; red_z[warp] = z; }
    __syncthreads();
    m = -SC_INF; z = 0.f;
    for (int w = 0; w < SC_MERGE_THREADS / 32; ++w) lse_push(m, z, red_m[w], red_z[w]);
}

__device__ __forceinline__ float block_sum(float v, float* red) {
    v = warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = 0.f;
    for (int w = 0; w < SC_MERGE_THREADS / 32; ++w) v += red[w];
    return v;
}


// grid (H, B), block SC_MERGE_THREADS (8 warps). Pass 1: one read of part_s gives m* and Z
// (online log-sum-exp). Pass 2: warp w merges partials w, w + 8, ..., U of them in flight, its
// lanes over D (D/32 consecutive floats each, vector loads); the warps are summed through shared
// memory. U = 8 where the grid is at most one wave (B = 1: latency-bound, fewer round trips), 4
// otherwise (at D <= 128 at most 64 registers: four blocks an SM). 256 threads, not 512: at 64 registers a
// 512-thread block left 2 blocks an SM, so B=16 x H=32 ran in two waves (ncu at bb7ac73: 20.3 us,
// achieved occupancy 45%); four 256-thread blocks an SM take those 512 blocks in one.
template <typename T, int D, int U>
__global__ void __launch_bounds__(SC_MERGE_THREADS, U == 4 && D <= 128 ? 4 : 1)
santa_merge(const float* __restrict__ part_o, const float4* __restrict__ part_s, const int* __restrict__ lengths,
            i64 L_max, int H, int part_rows, int split_target, int P_max, int kind, int samples,
            T* __restrict__ out, float* __restrict__ lse, float* __restrict__ spread) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    constexpr int kWarps = SC_MERGE_THREADS / 32;
    constexpr int kPerLane = D / 32;
    __shared__ float red_m[kWarps], red_z[kWarps];
    __shared__ __align__(16) float o_w[kWarps][D];
    __shared__ float var_w[kWarps], m2_w[kWarps];
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 b = blockIdx.y;
    const i64 bh = b * H + h;
    const int n = seq_len(lengths, b, L_max);
    if (split_target > 0)                 // a dense plan's splits (its sequences are all the dense kernel's)
        part_rows = dense_split(n, dense_rows_total(lengths, gridDim.y, L_max, SC_ALL_DENSE), split_target, P_max,
                                SC_ALL_DENSE).rows;
    const int n_parts = (n + part_rows - 1) / part_rows;
    const float4* st = part_s + bh * P_max;
    const float* po = part_o + bh * P_max * D;

    float m_star = -SC_INF, z = 0.f;
    for (int p = threadIdx.x; p < n_parts; p += SC_MERGE_THREADS) {
        const float4 s4 = st[p];
        if (s4.y != 0.f) lse_push(m_star, z, s4.x, s4.y);   // a NaN exp-sum makes z NaN
    }
    block_lse(m_star, z, red_m, red_z);

    const float S = (float)samples;
    const float s_t = (float)max(1, samples / max(n_parts, 1));
    float o[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) o[i] = 0.f;
    float var = 0.f, m2 = 0.f;
    for (int k0 = warp; k0 < n_parts; k0 += kWarps * U) {
        float4 s4[U];
        float v[U][kPerLane];
#pragma unroll
        for (int u = 0; u < U; ++u) {                       // issue every load first
            const int k = k0 + u * kWarps;
            s4[u] = k < n_parts ? st[k] : make_float4(-SC_INF, 0.f, 0.f, 0.f);
            if (k < n_parts) load_lane<kPerLane>(po + (i64)k * D + lane * kPerLane, v[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (!(s4[u].y > 0.f)) continue;                  // empty part (or past n_parts)
            if (kind == SC_MERGE_SUM && s4[u].z == 0.f && s4[u].w == 0.f) continue;   // tile without samples
            float w;
            if (kind == SC_MERGE_DENSE) w = __expf(s4[u].x - m_star) / z;
            else if (kind == SC_MERGE_FIXED) {
                const float wt = __expf(s4[u].x - m_star) * s4[u].y / z;
                w = wt / s_t;
                var += wt * wt * fmaxf(0.f, s4[u].z - s4[u].w / s_t) / (s_t * s_t);
            } else { w = 1.f / S; m2 += s4[u].z; }   // SC_MERGE_SUM
#pragma unroll
            for (int i = 0; i < kPerLane; ++i) o[i] = fmaf(w, v[u][i], o[i]);
        }
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) o_w[warp][lane * kPerLane + i] = o[i];
    if (lane == 0) { var_w[warp] = var; m2_w[warp] = m2; }
    __syncthreads();
    var = 0.f; m2 = 0.f;
    for (int w = 0; w < kWarps; ++w) { var += var_w[w]; m2 += m2_w[w]; }
    float sq = 0.f;
    const bool poisoned = z != z;                   // a part's exp-sum NaN (a NaN score): o NaN
    for (int d = threadIdx.x; d < D; d += SC_MERGE_THREADS) {
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) sum += o_w[w][d];
        if (poisoned) sum = z;
        out[bh * D + d] = from_float<T>(sum);
        sq = fmaf(sum, sum, sq);
    }
    if (kind == SC_MERGE_SUM) {
        sq = block_sum(sq, red_m);
        var = fmaxf(0.f, m2 / S - sq) / S;
    }
    if (threadIdx.x == 0) {
        lse[bh] = m_star + __logf(z);
        spread[bh] = kind == SC_MERGE_DENSE ? 0.f : sqrtf(fmaxf(var, 0.f) / (float)D);
    }
}

// The device decode-step counter: a captured graph that ends with this advances on every replay.
__global__ void santa_advance_step(i64* step) { pdl_launch_dependents(); pdl_wait(); step[0] += 1; }

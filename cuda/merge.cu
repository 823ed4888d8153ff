// merge.cu — merge per-part partials into the attention output, its log-sum-exp and spread.
//
// grid (H, B), block SC_MERGE_THREADS. Parts are dense splits (part_rows = rows per split) or santa
// tiles (part_rows = BN); sequence b has ceil(n_b / part_rows) of them. part_s = (m, l, m2, q2).
// kind 0 dense:  o = sum_p e^(m_p - m*) part_o_p / Z,           Z = sum_p e^(m_p - m*) l_p
// kind 1 fixed:  o = sum_t (W_t/Z) part_o_t / S_t,             S_t = max(1, S // T_b)
//                var = sum_t (W_t/Z)^2 (m2_t - q2_t / S_t) / S_t^2
// kind 2 global / largest_remainder: o = part_o summed / S,   var = max(0, sum m2 / S - |o|^2) / S
// lse = m* + log Z; spread = sqrt(var / D). Parts with l == 0 hold no rows and are skipped.
#include "common.cuh"

#define SC_MERGE_DENSE 0
#define SC_MERGE_FIXED 1
#define SC_MERGE_SUM 2

#define SC_MERGE_THREADS 256

__device__ __forceinline__ float block_reduce(float v, float* red, bool is_max) {
    v = is_max ? warp_max(v) : warp_sum(v);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = red[0];
    for (int w = 1; w < SC_MERGE_THREADS / 32; ++w) v = is_max ? fmaxf(v, red[w]) : v + red[w];
    return v;
}

// grid (H, B), block SC_MERGE_THREADS: warp w merges parts w, w + 8, ... with its lanes over D
// (D/32 consecutive floats each), then the 8 warps are summed through shared memory.
template <typename T, int D>
__global__ void __launch_bounds__(SC_MERGE_THREADS)
santa_merge(const float* __restrict__ part_o, const float4* __restrict__ part_s, const int* __restrict__ lengths,
            i64 L_max, int H, int part_rows, int P_max, int kind, int samples, T* __restrict__ out,
            float* __restrict__ lse, float* __restrict__ spread) {
    constexpr int kWarps = SC_MERGE_THREADS / 32;
    constexpr int kPerLane = D / 32;
    __shared__ float red[kWarps];
    __shared__ float o_w[kWarps][D];
    __shared__ float var_w[kWarps], m2_w[kWarps];
    const int h = blockIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 b = blockIdx.y;
    const i64 bh = b * H + h;
    const int n_parts = (seq_len(lengths, b, L_max) + part_rows - 1) / part_rows;
    const float4* st = part_s + bh * P_max;
    const float* po = part_o + bh * P_max * D;

    float m_star = -SC_INF;
    for (int p = threadIdx.x; p < n_parts; p += SC_MERGE_THREADS) if (st[p].y > 0.f) m_star = fmaxf(m_star, st[p].x);
    m_star = block_reduce(m_star, red, true);
    float z = 0.f;
    for (int p = threadIdx.x; p < n_parts; p += SC_MERGE_THREADS) if (st[p].y > 0.f) z += __expf(st[p].x - m_star) * st[p].y;
    z = block_reduce(z, red, false);

    const float S = (float)samples;
    const float s_t = (float)max(1, samples / max(n_parts, 1));
    float o[kPerLane];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) o[i] = 0.f;
    float var = 0.f, m2 = 0.f;
#pragma unroll 2
    for (int p = warp; p < n_parts; p += kWarps) {
        const float4 s4 = st[p];
        if (!(s4.y > 0.f)) continue;
        if (kind == SC_MERGE_SUM && s4.z == 0.f && s4.w == 0.f) continue;   // tile without samples
        float w;
        if (kind == SC_MERGE_DENSE) w = __expf(s4.x - m_star) / z;
        else if (kind == SC_MERGE_FIXED) {
            const float wt = __expf(s4.x - m_star) * s4.y / z;
            w = wt / s_t;
            var += wt * wt * fmaxf(0.f, s4.z - s4.w / s_t) / (s_t * s_t);
        } else { w = 1.f / S; m2 += s4.z; }
        const float* src = po + (i64)p * D + lane * kPerLane;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) o[i] = fmaf(w, src[i], o[i]);
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) o_w[warp][lane * kPerLane + i] = o[i];
    if (lane == 0) { var_w[warp] = var; m2_w[warp] = m2; }
    __syncthreads();
    var = 0.f; m2 = 0.f;
    for (int w = 0; w < kWarps; ++w) { var += var_w[w]; m2 += m2_w[w]; }
    float sq = 0.f;
    for (int d = threadIdx.x; d < D; d += SC_MERGE_THREADS) {
        float sum = 0.f;
        for (int w = 0; w < kWarps; ++w) sum += o_w[w][d];
        out[bh * D + d] = from_float<T>(sum);
        sq = fmaf(sum, sum, sq);
    }
    if (kind == SC_MERGE_SUM) {
        sq = block_reduce(sq, red, false);
        var = fmaxf(0.f, m2 / S - sq) / S;
    }
    if (threadIdx.x == 0) {
        lse[bh] = m_star + __logf(z);
        spread[bh] = kind == SC_MERGE_DENSE ? 0.f : sqrtf(var / (float)D);
    }
}

// The device decode-step counter: a captured graph that ends with this advances on every replay.
__global__ void santa_advance_step(i64* step) { step[0] += 1; }

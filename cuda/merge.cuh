// merge.cuh — pieces of the partial merge shared by santa_merge (merge.cu) and the dense split-KV
// kernel's own merge (decode_dense_mma with a merge counter: the last block of a KV group to finish
// merges the group's heads, so B = 1 decoding needs one launch, not two).
#pragma once
#include "common.cuh"

// Online (max, sum) pair: the log-sum-exp of parts seen so far is m + log z.
__device__ __forceinline__ void lse_push(float& m, float& z, float m_p, float z_p) {
    if (z_p <= 0.f) return;
    if (m_p > m) { z = z * __expf(m - m_p) + z_p; m = m_p; }
    else z += z_p * __expf(m_p - m);
}

// The (m, z) pairs of the warp combined; every lane gets the result.
__device__ __forceinline__ void warp_lse(float& m, float& z) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
        const float mo = __shfl_xor_sync(0xffffffffu, m, off), zo = __shfl_xor_sync(0xffffffffu, z, off);
        lse_push(m, z, mo, zo);
    }
}

// N consecutive floats (N = 2, 4 or 8; 8- or 16-byte aligned) as vector loads; kThroughL2: __ldcg
// (data another block of the same kernel wrote).
template <int N, bool kThroughL2 = false>
__device__ __forceinline__ void load_lane(const float* src, float (&v)[N]) {
    static_assert(N % 2 == 0, "whole float2 loads");
    if constexpr (N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N; i += 4) {
            const float4* p = reinterpret_cast<const float4*>(src + i);
            const float4 x = kThroughL2 ? __ldcg(p) : *p;
            v[i] = x.x; v[i + 1] = x.y; v[i + 2] = x.z; v[i + 3] = x.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; i += 2) {
            const float2* p = reinterpret_cast<const float2*>(src + i);
            const float2 x = kThroughL2 ? __ldcg(p) : *p;
            v[i] = x.x; v[i + 1] = x.y;
        }
    }
}

// Whether this block is the last of `expected` to arrive at *counter (every thread gets the
// answer). The block's global writes before the call are visible to the last block after it; the
// last block resets the counter, so the next launch (or graph replay) finds it at 0.
__device__ __forceinline__ bool block_arrives_last(unsigned* counter, unsigned expected) {
    __shared__ unsigned last;
    __threadfence();                                    // this thread's partials, device-wide
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(counter, 1u) + 1u == expected;
        if (last) atomicExch(counter, 0u);
    }
    __syncthreads();
    const bool is_last = last;
    if (is_last) __threadfence();                       // ... before reading the others' partials
    return is_last;
}

// One warp merges head bh's n_parts dense split partials (merge kind dense: o = sum_p e^(m_p - m*)
// part_o_p / Z) into out[bh], lse[bh] (spread 0). Reads through L2 (__ldcg): other blocks wrote
// the partials during this kernel. part_o [.., P_max, D], part_s [.., P_max] of head bh.
// Up to 32 parts every load is issued at once (one L2 round trip: lane p holds part p's stats and
// every lane its D/32 floats of each part); more parts go U = 8 at a time after a pass over the stats.
template <typename T, int D>
__device__ __forceinline__ void warp_merge_dense_head(const float* part_o, const float4* part_s, int n_parts,
                                                      i64 bh, T* out, float* lse, float* spread) {
    constexpr int E = D / 32, U = 8;                    // floats per lane; partials in flight (> 32 parts)
    const int lane = threadIdx.x & 31;
    float m_star = -SC_INF, z = 0.f;
    float o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    if (n_parts <= 32) {
        const float4 mine = lane < n_parts ? __ldcg(part_s + lane) : make_float4(-SC_INF, 0.f, 0.f, 0.f);
        float v[32][E];
#pragma unroll
        for (int p = 0; p < 32; ++p) {
            if (p < n_parts) load_lane<E, true>(part_o + (i64)p * D + lane * E, v[p]);
            else
#pragma unroll
                for (int e = 0; e < E; ++e) v[p][e] = 0.f;
        }
        lse_push(m_star, z, mine.x, mine.y);
        warp_lse(m_star, z);
        const float w_mine = mine.y > 0.f ? __expf(mine.x - m_star) / z : 0.f;
#pragma unroll
        for (int p = 0; p < 32; ++p) {
            const float w = __shfl_sync(0xffffffffu, w_mine, p);
            if (w != 0.f) {                             // never 0 x an unwritten (NaN) partial
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] = fmaf(w, v[p][e], o[e]);
            }
        }
    } else {
        for (int p = lane; p < n_parts; p += 32) {
            const float4 s4 = __ldcg(part_s + p);
            lse_push(m_star, z, s4.x, s4.y);
        }
        warp_lse(m_star, z);
        for (int p0 = 0; p0 < n_parts; p0 += U) {
            float w[U], v[U][E];
#pragma unroll
            for (int u = 0; u < U; ++u) {               // issue every load first
                const int p = p0 + u;
                w[u] = 0.f;
#pragma unroll
                for (int e = 0; e < E; ++e) v[u][e] = 0.f;
                if (p < n_parts) {
                    const float2 ml = __ldcg(reinterpret_cast<const float2*>(part_s + p));
                    if (ml.y > 0.f) w[u] = __expf(ml.x - m_star) / z;
                    load_lane<E, true>(part_o + (i64)p * D + lane * E, v[u]);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u)
                if (w[u] != 0.f) {                      // never 0 x an unwritten (NaN) partial
#pragma unroll
                    for (int e = 0; e < E; ++e) o[e] = fmaf(w[u], v[u][e], o[e]);
                }
        }
    }
#pragma unroll
    for (int e = 0; e < E; ++e) out[bh * D + lane * E + e] = from_float<T>(o[e]);
    if (lane == 0) {
        lse[bh] = m_star + __logf(z);
        spread[bh] = 0.f;
    }
}

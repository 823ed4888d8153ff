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
// last block resets the counter, so the next launch (or graph replay) finds it at 0. Only thread 0
// fences, after the barrier (cooperative groups' grid sync does the same): the barrier orders the
// other threads' writes before its fence, which is cumulative. A fence in every thread, each
// waiting for its own atomics, held a sixth of santa_tile_warp's stall samples at B=1 32k and cost
// SANTA 0.8-0.9 µs there (H100, docs/results/h100_fence_thread0).
__device__ __forceinline__ bool block_arrives_last(unsigned* counter, unsigned expected) {
    __shared__ unsigned last;
    __syncthreads();                                    // every thread's partials, ordered before ...
    if (threadIdx.x == 0) {
        __threadfence();                                // ... thread 0's fence (cumulative), device-wide
        last = atomicAdd(counter, 1u) + 1u == expected;
        if (last) atomicExch(counter, 0u);
    }
    __syncthreads();
    const bool is_last = last;
    if (is_last) __threadfence();                       // ... before reading the others' partials
    return is_last;
}

// Heads head0 .. head0 + G - 1 of an empty sequence (length 0): o = 0, lse = -inf, spread = 0, by
// one warp. Every method writes this (the contract of DecodePlan.run for a length of 0).
template <typename T, int D>
__device__ __forceinline__ void write_empty_heads(T* out, float* lse, float* spread, i64 head0, int G) {
    const int lane = threadIdx.x & 31;
    for (int i = lane; i < G * D; i += 32) out[head0 * D + i] = from_float<T>(0.f);
    for (int h = lane; h < G; h += 32) { lse[head0 + h] = -SC_INF; spread[head0 + h] = 0.f; }
}

// Copies of the accumulators of santa_tile_warp (blocks add into copy blockIdx.x % SC_ACC_COPIES).
#define SC_ACC_COPIES 8

// One head's o and spread from its sums, by one warp (lane: its E = D/32 elements of o; m2 the
// whole warp's): o = inv_s * acc (global: inv_s = 1/S, sums of counted rows; fixed: 0 marks
// pre-weighted sums, o = acc), spread = sqrt(var / D) with var = max(0, m2 / S - |o|^2) / S
// (global) or max(0, m2) (fixed). valid false (the head's softmax normaliser was NaN or inf): o NaN.
template <typename T, int D>
__device__ __forceinline__ void write_head(float (&o)[D / 32], float m2, float inv_s, bool valid, T* out,
                                           float* spread) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    const float nan = __int_as_float(0x7fc00000);
    float sq = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        o[e] = valid ? (inv_s > 0.f ? o[e] * inv_s : o[e]) : nan;
        sq = fmaf(o[e], o[e], sq);
    }
    sq = warp_sum(sq);
#pragma unroll
    for (int e = 0; e < E; ++e) out[lane * E + e] = from_float<T>(o[e]);
    if (lane == 0) {
        const float var = inv_s > 0.f ? fmaxf(0.f, m2 * inv_s - sq) * inv_s : fmaxf(0.f, m2);
        *spread = valid ? sqrtf(var / (float)D) : nan;
    }
}

// One head's output from the call's accumulators, by one warp, which zeroes them for the next call:
// acc[c * stride + :D] and acc_var[c * stride] summed over the SC_ACC_COPIES copies c (write_head).
template <typename T, int D>
__device__ __forceinline__ void finish_head(float* acc, float* acc_var, i64 stride, float inv_s, bool valid, T* out,
                                            float* spread) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    float o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
#pragma unroll
    for (int c = 0; c < SC_ACC_COPIES; ++c)
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o[e] += __ldcg(acc + c * stride + lane * E + e);
            acc[c * stride + lane * E + e] = 0.f;
        }
    float m2 = 0.f;
    if (lane < SC_ACC_COPIES) { m2 = __ldcg(acc_var + lane * stride); acc_var[lane * stride] = 0.f; }
    write_head<T, D>(o, warp_sum(m2), inv_s, valid, out, spread);
}

// One head's output from its n_parts block partials, by one warp (write_head): part_o [n_parts, D]
// and part_s[p].z (m2), written by other blocks of this kernel (__ldcg), summed in part order (a
// re-run writes the same bits), 8 partials in flight a lane. Not inlined: inlined, it made the
// kernel spill (ptxas, the 128-register cap of santa_tile_warp).
template <typename T, int D>
__device__ __noinline__ void finish_head_from_parts(const float* part_o, const float4* part_s, int n_parts,
                                                       float inv_s, bool valid, T* out, float* spread) {
    constexpr int E = D / 32, U = 8;
    const int lane = threadIdx.x & 31;
    float o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    for (int p0 = 0; p0 < n_parts; p0 += U) {                // warp-uniform
        float v[U][E];
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (p0 + u < n_parts) load_lane<E, true>(part_o + (i64)(p0 + u) * D + lane * E, v[u]);
#pragma unroll
        for (int u = 0; u < U; ++u)
            if (p0 + u < n_parts)
#pragma unroll
                for (int e = 0; e < E; ++e) o[e] += v[u][e];
    }
    float m2 = 0.f;
    for (int p = lane; p < n_parts; p += 32) m2 += __ldcg(&part_s[p].z);
    write_head<T, D>(o, warp_sum(m2), inv_s, valid, out, spread);
}

// Up to 32 dense split partials of one head in one L2 round trip (lane p holds part p's stats, every
// lane its E = D/32 floats of each part; __ldcg: other blocks wrote them during this kernel):
// (m, z) their log-sum-exp pair (every lane) and o[E] = sum_p w_p part_o_p with w_p = e^(m_p - m) / z
// (kNormalize) or e^(m_p - m). n_parts <= 0 leaves m = -inf, z = 0, o = 0.
// part_o [n_parts, D], part_s [n_parts] of the head, from the first part to merge.
template <int D, bool kNormalize>
__device__ __forceinline__ void warp_merge_parts(const float* part_o, const float4* part_s, int n_parts, float& m_star,
                                                 float& z, float (&o)[D / 32]) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    m_star = -SC_INF; z = 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
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
    const float w_mine = mine.y > 0.f ? (kNormalize ? __expf(mine.x - m_star) / z : __expf(mine.x - m_star)) : 0.f;
#pragma unroll
    for (int p = 0; p < 32; ++p) {
        const float w = __shfl_sync(0xffffffffu, w_mine, p);
        if (w != 0.f) {                                 // never 0 x an unwritten (NaN) partial
#pragma unroll
            for (int e = 0; e < E; ++e) o[e] = fmaf(w, v[p][e], o[e]);
        }
    }
}

// One warp merges head bh's n_parts <= 32 dense split partials (merge kind dense: o = sum_p
// e^(m_p - m*) part_o_p / Z) into out[bh], lse[bh] (spread 0), in one L2 round trip.
template <typename T, int D>
__device__ __forceinline__ void warp_merge_dense_head(const float* part_o, const float4* part_s, int n_parts,
                                                      i64 bh, T* out, float* lse, float* spread) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    float m_star, z, o[E];
    warp_merge_parts<D, true>(part_o, part_s, n_parts, m_star, z, o);
    const bool poisoned = z != z;                       // a NaN score in some split: o NaN
#pragma unroll
    for (int e = 0; e < E; ++e) out[bh * D + lane * E + e] = from_float<T>(poisoned ? z : o[e]);
    if (lane == 0) {
        lse[bh] = m_star + __logf(z);
        spread[bh] = 0.f;
    }
}

// The whole block (kWarps warps) merges head bh's n_parts dense split partials, any number:
// warp w takes parts 32 (kWarps r + w) + [0, 32) in round r (one L2 round trip a round; one round
// up to 32 kWarps parts), folding each round into its own (m, z, o); the warps' results combine
// through shared memory (kWarps (D + 2) floats, free on entry). Same result as
// warp_merge_dense_head up to float rounding.
template <typename T, int D, int kWarps>
__device__ __forceinline__ void block_merge_dense_head(const float* part_o, const float4* part_s, int n_parts,
                                                       i64 bh, T* out, float* lse, float* spread, float* smem) {
    constexpr int E = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float m = -SC_INF, z = 0.f, o[E];
#pragma unroll
    for (int e = 0; e < E; ++e) o[e] = 0.f;
    for (int p0 = 32 * warp; p0 < n_parts; p0 += 32 * kWarps) {   // warp-uniform
        float m_r, z_r, o_r[E];
        warp_merge_parts<D, false>(part_o + (i64)p0 * D, part_s + p0, n_parts - p0, m_r, z_r, o_r);
        if (z_r <= 0.f) continue;
        const float m_new = fmaxf(m, m_r), a = __expf(m - m_new), a_r = __expf(m_r - m_new);
        z = z * a + z_r * a_r;
#pragma unroll
        for (int e = 0; e < E; ++e) o[e] = o[e] * a + o_r[e] * a_r;
        m = m_new;
    }
    float* o_s = smem;                                   // [kWarps][D]
    float* m_s = o_s + kWarps * D;                       // [kWarps]
    float* z_s = m_s + kWarps;                           // [kWarps]
#pragma unroll
    for (int e = 0; e < E; ++e) o_s[warp * D + lane * E + e] = o[e];
    if (lane == 0) { m_s[warp] = m; z_s[warp] = z; }
    __syncthreads();
    float m_star = -SC_INF, z_star = 0.f;
    for (int w = 0; w < kWarps; ++w) lse_push(m_star, z_star, m_s[w], z_s[w]);
    for (int d = threadIdx.x; d < D; d += kWarps * 32) {
        float acc = 0.f;
        for (int w = 0; w < kWarps; ++w)
            if (z_s[w] > 0.f) acc = fmaf(__expf(m_s[w] - m_star), o_s[w * D + d], acc);
        out[bh * D + d] = from_float<T>(z_star != z_star ? z_star : acc / z_star);   // NaN in: NaN out
    }
    if (threadIdx.x == 0) {
        lse[bh] = m_star + __logf(z_star);
        spread[bh] = 0.f;
    }
    __syncthreads();                                     // smem free again
}

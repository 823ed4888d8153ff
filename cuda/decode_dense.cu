// decode_dense.cu — exact split-KV decode attention (flash-decoding), the baseline and fallback.
//
// grid (n_splits, KVH, B), block SC_NTHREADS. Block (s, g, b) streams rows
// [s*part_rows, min((s+1)*part_rows, n_b)) of KV head g straight from global memory into
// registers (stream.cuh layout: D/8 lanes per row, U rows per row group in flight for K and V),
// keeping an online softmax per query head in the log2 domain. Row groups are combined through
// shared memory at the end. Outputs per (b, h, split): part_o[D] = sum_j 2^(s_j - m) V_j
// (unnormalised) and part_s = (m * ln2, l, 0, 0), merged by merge.cu.
//
// Shared memory (kernels.py: dense_smem_bytes): acc [RG][G][D] f32 | m, l [RG][G] f32
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"

#define SC_LOG2E 1.4426950408889634f
#define SC_LN2 0.6931471805599453f

template <typename T, int D, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_partial(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                     const int* __restrict__ lengths, float scale, int part_rows, int H, int KVH,
                     i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits) {
    using GQ = GroupQuery<T, D, G>;
    constexpr int kRG = GQ::kRowGroups;
    constexpr int U = G <= 4 ? 4 : 2;           // rows per row group in flight (register budget)
    const int split = blockIdx.x, g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const i64 row_begin = (i64)split * part_rows;
    const i64 row_end = min(row_begin + part_rows, (i64)n);
    const i64 part = (b * H + (i64)g * G) * n_splits + split;   // (b, first head of group, split)
    if (row_begin >= row_end) {                                   // nothing of this sequence here
        for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
            part_s[part + (i64)h * n_splits] = make_float4(-SC_INF, 0.f, 0.f, 0.f);
        return;
    }
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;

    GQ gq;
    gq.load(q, b, g, H, scale * SC_LOG2E);
    float m[G], l[G], acc[G][SC_CHUNK];
#pragma unroll
    for (int h = 0; h < G; ++h) {
        m[h] = -SC_INF; l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < SC_CHUNK; ++e) acc[h][e] = 0.f;
    }

    // The trip count must be warp-uniform (the score reduction shuffles across the whole warp,
    // which holds several row groups), so rows past row_end are masked, not skipped.
    for (i64 base = row_begin; base < row_end; base += (i64)U * kRG) {
        Chunk<T> kc[U], vc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 j = base + (i64)u * kRG + rg;
            if (j < row_end) {
                kc[u].load(cache_row<T, D>(k_cache, b, j, g, L_max, KVH) + dg * SC_CHUNK);
                vc[u].load(cache_row<T, D>(v_cache, b, j, g, L_max, KVH) + dg * SC_CHUNK);
            } else {
                kc[u].zero(); vc[u].zero();
            }
        }
        float s[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            gq.scores(kc[u], s[u]);
            if (base + (i64)u * kRG + rg >= row_end)
#pragma unroll
                for (int h = 0; h < G; ++h) s[u][h] = -SC_INF;
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float m_new = m[h];
#pragma unroll
            for (int u = 0; u < U; ++u) m_new = fmaxf(m_new, s[u][h]);
            if (m_new == -SC_INF) continue;          // no valid row yet in this row group
            const float alpha = exp2f(m[h] - m_new);
            float p[U];
#pragma unroll
            for (int u = 0; u < U; ++u) p[u] = exp2f(s[u][h] - m_new);
            float lsum = 0.f;
#pragma unroll
            for (int u = 0; u < U; ++u) lsum += p[u];
            l[h] = l[h] * alpha + lsum;
            m[h] = m_new;
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) acc[h][e] *= alpha;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float vf[SC_CHUNK]; vc[u].to_floats(vf);
#pragma unroll
                for (int e = 0; e < SC_CHUNK; ++e) acc[h][e] = fmaf(p[u], vf[e], acc[h][e]);
            }
        }
    }

    // Combine the row groups: M = max_rg m, o = sum_rg 2^(m_rg - M) acc_rg, L likewise.
    extern __shared__ __align__(16) unsigned char smem[];
    float* acc_s = reinterpret_cast<float*>(smem);            // [RG][G][D]
    float* m_s = acc_s + kRG * G * D;                          // [RG][G]
    float* l_s = m_s + kRG * G;                                // [RG][G]
#pragma unroll
    for (int h = 0; h < G; ++h) {
#pragma unroll
        for (int e = 0; e < SC_CHUNK; ++e) acc_s[(rg * G + h) * D + dg * SC_CHUNK + e] = acc[h][e];
        if (dg == 0) { m_s[rg * G + h] = m[h]; l_s[rg * G + h] = l[h]; }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {
        const int h = idx / D, d = idx % D;
        float M = -SC_INF;
        for (int r = 0; r < kRG; ++r) M = fmaxf(M, m_s[r * G + h]);
        float o = 0.f, L = 0.f;
        for (int r = 0; r < kRG; ++r) {
            const float mr = m_s[r * G + h];
            if (mr == -SC_INF) continue;
            const float w = exp2f(mr - M);
            o = fmaf(w, acc_s[(r * G + h) * D + d], o);
            L = fmaf(w, l_s[r * G + h], L);
        }
        part_o[(part + (i64)h * n_splits) * D + d] = o;
        if (d == 0) part_s[part + (i64)h * n_splits] = make_float4(M * SC_LN2, L, 0.f, 0.f);
    }
}

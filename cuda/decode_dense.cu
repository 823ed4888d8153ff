// decode_dense.cu — exact split-KV decode attention (flash-decoding), the baseline and fallback.
//
// grid (n_splits, KVH, B), block SC_NTHREADS. Block (s, g, b) covers rows
// [s*part_rows, min((s+1)*part_rows, n_b)) of KV head g for the G query heads of the group,
// keeping an online softmax per head in the log2 domain (DenseState), one state per row group
// (stream.cuh layout: D/8 lanes per row); the row groups are combined through shared memory at
// the end. Outputs per (b, h, split): part_o[D] = sum_j 2^(s_j - m) V_j (unnormalised) and
// part_s = (m * ln2, l, 0, 0), merged by merge.cu. Two versions of the row loop:
//   decode_dense_partial  (v2) K and V streamed from global memory straight into registers,
//                         U rows per row group in flight.
//   decode_dense_async    (v3) K and V staged through a SC_STAGES-deep shared-memory ring filled
//                         with cp.async (16-byte copies, L2 only), so the copies of later stages
//                         are in flight while a stage is computed.
//
// Shared memory (kernels.py: dense_smem_bytes): v2 acc [RG][G][D] f32 | m, l [RG][G] f32;
// v3 the ring SC_STAGES x 2 x kStageRows x D x T, reused for the combine afterwards.
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"
#include "async_copy.cuh"

#define SC_LOG2E 1.4426950408889634f
#define SC_LN2 0.6931471805599453f

template <typename T, int D, int G>
struct DenseState {
    using GQ = GroupQuery<T, D, G>;
    float m[G], l[G], acc[G][SC_CHUNK];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            m[h] = -SC_INF; l[h] = 0.f;
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) acc[h][e] = 0.f;
        }
    }

    // Online-softmax update with U rows of this row group; rows with valid[u] false are skipped.
    // Every lane of the warp must call this (the score reduction shuffles).
    template <int U>
    __device__ __forceinline__ void update(const GQ& gq, const Chunk<T> (&kc)[U], const Chunk<T> (&vc)[U],
                                           const bool (&valid)[U]) {
        float s[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            gq.scores(kc[u], s[u]);
            if (!valid[u])
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

    // Combine the row groups through shared memory (>= RG*G*(D+2) floats) and write the split's
    // partials: M = max_rg m, o = sum_rg 2^(m_rg - M) acc_rg, L likewise.
    __device__ __forceinline__ void write_partials(float* smem, float* part_o, float4* part_s, i64 part,
                                                   int n_splits) const {
        constexpr int kRG = GQ::kRowGroups;
        const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;
        float* acc_s = smem;                                       // [RG][G][D]
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
};

// Rows of this split, or an empty-split marker written (returns false).
__device__ __forceinline__ bool split_rows(const int* lengths, i64 b, i64 L_max, int split, int part_rows,
                                           int G, float4* part_s, i64 part, int n_splits,
                                           i64* row_begin, i64* row_end) {
    const int n = seq_len(lengths, b, L_max);
    *row_begin = (i64)split * part_rows;
    *row_end = min(*row_begin + part_rows, (i64)n);
    if (*row_begin < *row_end) return true;
    for (int h = threadIdx.x; h < G; h += SC_NTHREADS)
        part_s[part + (i64)h * n_splits] = make_float4(-SC_INF, 0.f, 0.f, 0.f);
    return false;
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_partial(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                     const int* __restrict__ lengths, float scale, int part_rows, int H, int KVH,
                     i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits) {
    using GQ = GroupQuery<T, D, G>;
    constexpr int kRG = GQ::kRowGroups;
    constexpr int U = G <= 4 ? 4 : 2;           // rows per row group in flight (register budget)
    const int g = blockIdx.y;
    const i64 b = blockIdx.z;
    const i64 part = (b * H + (i64)g * G) * n_splits + blockIdx.x;  // (b, first head of group, split)
    i64 row_begin, row_end;
    if (!split_rows(lengths, b, L_max, blockIdx.x, part_rows, G, part_s, part, n_splits, &row_begin, &row_end))
        return;
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;
    GQ gq;
    gq.load(q, b, g, H, scale * SC_LOG2E);
    DenseState<T, D, G> st;
    st.init();
    // The trip count must be warp-uniform (the score reduction shuffles across the whole warp,
    // which holds several row groups), so rows past row_end are masked, not skipped.
    for (i64 base = row_begin; base < row_end; base += (i64)U * kRG) {
        Chunk<T> kc[U], vc[U];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 j = base + (i64)u * kRG + rg;
            valid[u] = j < row_end;
            if (valid[u]) {
                kc[u].load(cache_row<T, D>(k_cache, b, j, g, L_max, KVH) + dg * SC_CHUNK);
                vc[u].load(cache_row<T, D>(v_cache, b, j, g, L_max, KVH) + dg * SC_CHUNK);
            } else {
                kc[u].zero(); vc[u].zero();
            }
        }
        st.update<U>(gq, kc, vc, valid);
    }
    extern __shared__ __align__(16) unsigned char smem[];
    st.write_partials(reinterpret_cast<float*>(smem), part_o, part_s, part, n_splits);
}

// ---- v3: cp.async ring (async_copy.cuh) ------------------------------------------------------
template <typename T, int D, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_async(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                   const int* __restrict__ lengths, float scale, int part_rows, int H, int KVH,
                   i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits) {
    using GQ = GroupQuery<T, D, G>;
    constexpr int kRG = GQ::kRowGroups;
    constexpr int kRows = SC_STAGE_BYTES / (D * (int)sizeof(T));   // rows per stage
    constexpr int U = kRows / kRG;                                   // rows per row group per stage
    static_assert(U >= 1 && kRows % kRG == 0, "stage rows must split over the row groups");
    const int g = blockIdx.y;
    const i64 b = blockIdx.z;
    const i64 part = (b * H + (i64)g * G) * n_splits + blockIdx.x;
    i64 row_begin, row_end;
    if (!split_rows(lengths, b, L_max, blockIdx.x, part_rows, G, part_s, part, n_splits, &row_begin, &row_end))
        return;
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;
    extern __shared__ __align__(16) unsigned char smem[];
    T* ring = reinterpret_cast<T*>(smem);                          // [SC_STAGES][2][kRows][D]
    constexpr int kStageElems = 2 * kRows * D;
    const int n_stages = (int)((row_end - row_begin + kRows - 1) / kRows);

#pragma unroll
    for (int s = 0; s < SC_STAGES - 1; ++s) {                      // prologue: fill the ring
        if (s < n_stages)
            issue_stage<T, D, kRows, 2>(ring + s * kStageElems, k_cache, v_cache, b, row_begin + (i64)s * kRows,
                                        row_end, g, L_max, KVH);
        cp_async_commit();                                         // (possibly empty) group per stage
    }
    GQ gq;
    gq.load(q, b, g, H, scale * SC_LOG2E);
    DenseState<T, D, G> st;
    st.init();
    for (int s = 0; s < n_stages; ++s) {
        cp_async_wait<SC_STAGES - 2>();      // this thread's copies of stage s have landed
        __syncthreads();                     // everyone's have; stage s-1 is fully consumed
        const int next = s + SC_STAGES - 1;
        if (next < n_stages)
            issue_stage<T, D, kRows, 2>(ring + (next % SC_STAGES) * kStageElems, k_cache, v_cache, b,
                                        row_begin + (i64)next * kRows, row_end, g, L_max, KVH);
        cp_async_commit();
        const T* stage = ring + (s % SC_STAGES) * kStageElems;
        const i64 row0 = row_begin + (i64)s * kRows;
        Chunk<T> kc[U], vc[U];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = u * kRG + rg;
            valid[u] = row0 + r < row_end;
            kc[u].load(stage + r * D + dg * SC_CHUNK);
            vc[u].load(stage + (kRows + r) * D + dg * SC_CHUNK);
        }
        st.update<U>(gq, kc, vc, valid);
    }
    cp_async_wait<0>();
    __syncthreads();                         // the ring is free: reuse it for the combine
    st.write_partials(reinterpret_cast<float*>(smem), part_o, part_s, part, n_splits);
}

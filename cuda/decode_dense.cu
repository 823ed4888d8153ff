// decode_dense.cu — exact split-KV decode attention (flash-decoding), the baseline and fallback.
//
// grid (KVH, pairs), block SC_NTHREADS. Block (g, w) takes the w-th (sequence b, split s) pair of
// the batch (common.cuh: dense_pair, the split balanced over the sequences' lengths) and covers rows
// [s*rows_b, min((s+1)*rows_b, n_b)) of KV head g for the G query heads of the group,
// keeping an online softmax per head in the log2 domain (DenseState), one state per row group
// (stream.cuh layout: D/8 lanes per row); the row groups are combined through shared memory at
// the end. Outputs per (b, h, split): part_o[D] = sum_j 2^(s_j - m) V_j (unnormalised) and
// part_s = (m * ln2, l, 0, 0), merged by merge.cu. Two versions of the row loop:
//   decode_dense_partial  (v2, the generic fallback: any dtype and head_dim) K and V streamed from
//                         global memory straight into registers, U rows per row group in flight.
//   decode_dense_mma      (v4, production) both products on tensor cores (mma.sync m16n8k16),
//                         fp16/bf16 and D 64/128 only; see the comment above the kernel.
//   decode_dense_mma_blocked  v4 on a feature-blocked K [B, KVH, NP, C, P, FB] (tile.cuh
//                         BlockedKeyRows; contiguous): the same body (dense_mma_split), K's
//                         addresses only differ. decode_dense_partial has no blocked form.
// (v3, a cp.async ring, measured no faster than v2 and was removed; git history has it.)
//
// Shared memory (kernels.py: dense_smem_bytes): v2 acc [RG][G][D] f32 | m, l [RG][G] f32.
#include "common.cuh"
#include "tile.cuh"
#include "stream.cuh"
#include "mma.cuh"
#include "merge.cuh"

#define SC_LOG2E 1.4426950408889634f
#define SC_LN2 0.6931471805599453f

// The split's partials from N partial online-softmax states (log2 domain) in shared memory,
// acc [N][G][D] | m [N][G] | l [N][G]: M = max_n m_n, o = sum_n 2^(m_n - M) acc_n, L likewise;
// part_s = (M ln 2, L, 0, 0). Called by the whole block after a barrier.
template <int D, int G, int N>
__device__ __forceinline__ void write_split_partials(const float* acc_s, const float* m_s, const float* l_s,
                                                     float* part_o, float4* part_s, i64 part, int n_splits) {
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {
        const int h = idx / D, d = idx % D;
        float M = -SC_INF;
        for (int r = 0; r < N; ++r) M = max_nan(M, m_s[r * G + h]);   // a NaN part: o and L NaN
        float o = 0.f, L = 0.f;
        for (int r = 0; r < N; ++r) {
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
            for (int u = 0; u < U; ++u) m_new = max_nan(m_new, s[u][h]);   // a NaN score: l NaN
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
        write_split_partials<D, G, kRG>(acc_s, m_s, l_s, part_o, part_s, part, n_splits);
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
                     const int* __restrict__ lengths, float scale, int split_target, int batch, int H, int KVH,
                     i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits,
                     const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    using GQ = GroupQuery<T, D, G>;
    constexpr int kRG = GQ::kRowGroups;
    constexpr int U = G <= 4 ? 4 : 2;           // rows per row group in flight (register budget)
    const int g = blockIdx.x;                // the KV heads of one pair are neighbours (common.cuh)
    int b, split, part_rows;
    dense_pair(lengths, batch, L_max, split_target, n_splits, SC_ALL_DENSE, blockIdx.y, &b, &split, &part_rows);
    if (b < 0) return;
    const i64 part = (b * H + (i64)g * G) * n_splits + split;      // (b, first head of group, split)
    i64 row_begin, row_end;
    if (!split_rows(lengths, b, L_max, split, part_rows, G, part_s, part, n_splits, &row_begin, &row_end))
        return;
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;
    const CacheRows<T, D> K = SC_CACHE_ROWS(k_cache), V = SC_CACHE_ROWS(v_cache);
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
                kc[u].load(K.row(b, j, g) + dg * SC_CHUNK);
                vc[u].load(V.row(b, j, g) + dg * SC_CHUNK);
            } else {
                kc[u].zero(); vc[u].zero();
            }
        }
        st.update<U>(gq, kc, vc, valid);
    }
    extern __shared__ __align__(16) unsigned char smem[];
    st.write_partials(reinterpret_cast<float*>(smem), part_o, part_s, part, n_splits);
}

// ---- v4: tensor cores (mma.cuh), 16-bit types, D in {64, 128} ----------------------------------
// Each warp owns keys base .. base+15 of its split (warps interleaved by 16 keys) and computes
//   S = Q K^T  as m16n8k16 tiles: rows = the G <= 16 heads of the group (zero-padded to 16),
//              2 n-tiles of 8 keys, D/16 k-steps;
//   O += P V   rows = heads, k = the 16 keys (P reused from S's accumulators, FA2 style),
//              D/8 n-tiles of output dims.
// Loads stay 16-byte vectors by permuting the reduction and output orders consistently, and each
// load instruction reads whole 32-byte sectors (no sector fetched by two instructions):
//   q.K: thread t of a group loads quads t, t + 4, ... of its key (and of its head's query),
//        MmaQuery's slice; k-step s uses words 2s and 2s+1 of that slice.
//   P.V: the thread of group n loads quads n, n + 8 (D 128; quad n at D 64) of keys 2t, 2t+1,
//        2t+8, 2t+9: slice element j is dim v_slice_dim(n, j), which output n-tile j's column n
//        holds; the halves of key pairs are paired by byte_perm.
// P is rounded to T for the second product (as FlashAttention does); l sums the unrounded p.
// Each warp keeps two register buffers of K/V slices: step i+1's loads fly while step i computes.
// The K and V slices one thread holds for one 16-key step.
// Dim of element j of V-slice n (quads n, n + 8 of the row, 8 dims each).
__device__ __forceinline__ int v_slice_dim(int n, int j) { return 64 * (j >> 3) + 8 * n + (j & 7); }

template <int D>
struct MmaStepLoads {
    u32 k[2][D / 8];          // keys base + 8j + gi, elements [t*D/4, (t+1)*D/4)
    u32 v[4][D / 16];         // keys base + 2t + {0, 1, 8, 9}, V-slice gi (quads gi, gi + 8)
};

// KRows: CacheRows<T, D> or BlockedKeyRows<T, D> (tile.cuh), V always CacheRows.
template <typename T, int D, typename KRows>
__device__ __forceinline__ void mma_step_load(MmaStepLoads<D>& ld, const KRows& K, const CacheRows<T, D>& V,
                                              i64 b, i64 base, i64 row_end, int g, int gi, int t) {
    const T* k0 = K.row(b, base, g);                 // one page-table lookup a step for each
    const T* v0 = V.row(b, base, g);
#pragma unroll
    for (int j = 0; j < 2; ++j)
        load_key_slice<T, D>(ld.k[j], K, k0, b, base, base + 8 * j + gi, row_end, g, t);
#pragma unroll
    for (int r = 0; r < 4; ++r) {
        const i64 key = base + 2 * t + (r & 1) + 8 * (r >> 1);
        load_quads<D / 16>(ld.v[r], V.step_key(v0, b, base, key < row_end ? key : base, g), gi, 8,
                           key < row_end);
    }
}

// Online-softmax state of one thread: O fragments and the (m, l) of rows gi and gi + 8.
template <typename T, int D, int G>
struct MmaDenseState {
    static constexpr bool kHi = MmaQuery<T, D, G>::kHi;
    static constexpr int NT = D / 8;
    float o[NT][4];
    float m_lo, m_hi, l_lo, l_hi;

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int j = 0; j < NT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
        m_lo = m_hi = -SC_INF; l_lo = l_hi = 0.f;
    }

    // One 16-key step: S = Q K^T, online softmax, O = alpha O + P V.
    __device__ __forceinline__ void step(const MmaQuery<T, D, G>& mq, const MmaStepLoads<D>& ld, i64 base,
                                         i64 row_end, float mult, int t) {
        float s[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            mq.scores(s[j], ld.k[j]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const bool valid = base + 8 * j + 2 * t + (e & 1) < row_end;
                s[j][e] = valid ? s[j][e] * mult : -SC_INF;
            }
        }
        // The 4 threads of a group share a row's max; NaN-propagating, so that a NaN score among
        // masked rows (a sequence of one NaN key) makes m NaN instead of leaving it at -inf.
        float mx_lo = max_nan(max_nan(s[0][0], s[0][1]), max_nan(s[1][0], s[1][1]));
        float mx_hi = max_nan(max_nan(s[0][2], s[0][3]), max_nan(s[1][2], s[1][3]));
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_lo = max_nan(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
            if (kHi) mx_hi = max_nan(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
        }
        const float mn_lo = max_nan(m_lo, mx_lo), mn_hi = max_nan(m_hi, mx_hi);   // all-NaN scores: m NaN
        const float ref_lo = mn_lo == -SC_INF ? 0.f : mn_lo, ref_hi = mn_hi == -SC_INF ? 0.f : mn_hi;
        const float alpha_lo = exp2f(m_lo - ref_lo), alpha_hi = exp2f(m_hi - ref_hi);
        m_lo = mn_lo; m_hi = mn_hi;
        float p[2][4];
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            p[j][0] = exp2f(s[j][0] - ref_lo); p[j][1] = exp2f(s[j][1] - ref_lo);
            p[j][2] = kHi ? exp2f(s[j][2] - ref_hi) : 0.f; p[j][3] = kHi ? exp2f(s[j][3] - ref_hi) : 0.f;
        }
        l_lo = l_lo * alpha_lo + (p[0][0] + p[0][1] + p[1][0] + p[1][1]);
        if (kHi) l_hi = l_hi * alpha_hi + (p[0][2] + p[0][3] + p[1][2] + p[1][3]);
        const u32 pa[4] = {pack2<T>(p[0][0], p[0][1]), kHi ? pack2<T>(p[0][2], p[0][3]) : 0u,
                           pack2<T>(p[1][0], p[1][1]), kHi ? pack2<T>(p[1][2], p[1][3]) : 0u};
        // n-tile j, column n = dim v_slice_dim(n, j)
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            o[j][0] *= alpha_lo; o[j][1] *= alpha_lo;
            if (kHi) { o[j][2] *= alpha_hi; o[j][3] *= alpha_hi; }
            const u32 b0 = pair_halves(ld.v[0][j / 2], ld.v[1][j / 2], j & 1);
            const u32 b1 = pair_halves(ld.v[2][j / 2], ld.v[3][j / 2], j & 1);
            mma_16816<T>(o[j], pa, b0, b1);
        }
    }
};

// The body of decode_dense_mma and decode_dense_mma_blocked (below), K's rows addressed by KRows
// (CacheRows or BlockedKeyRows), V's by CacheRows.
template <typename T, int D, int G, typename KRows>
__device__ __forceinline__ void dense_mma_split(const T* __restrict__ q, const KRows& K, const CacheRows<T, D>& V,
                                                const int* __restrict__ lengths, float scale, int split_target,
                                                int batch, int H, int KVH, i64 L_max, float* __restrict__ part_o,
                                                float4* __restrict__ part_s, int n_splits, int self_merge,
                                                unsigned* __restrict__ merge_counters, T* __restrict__ out,
                                                float* __restrict__ lse, float* __restrict__ spread, int santa_from,
                                                int* __restrict__ rows_read) {
    static_assert(D == 64 || D == 128, "mma decode: head_dim 64 or 128");
    static_assert(G >= 1 && G <= 16, "mma decode: one m16 tile of heads");
    using State = MmaDenseState<T, D, G>;
    constexpr int NT = D / 8;
    constexpr int kWarps = SC_NTHREADS / 32;
    constexpr int kStep = 16 * kWarps;       // keys per block per step
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, t = lane & 3;
    const int g = blockIdx.x;                // the KV heads of one pair are neighbours (common.cuh)
    // santa_from: sequences this long or longer are the santa kernels' (a santa plan's short
    // sequences run here; SC_ALL_DENSE in a dense plan): they have no pairs. rows_read [B, KVH]: the rows
    // this kernel read.
    int b0, split, part_rows;
    dense_pair(lengths, batch, L_max, split_target, n_splits, santa_from, blockIdx.y, &b0, &split, &part_rows);
    if (b0 < 0) return;
    // The block's sequence and row count per split, re-read from shared memory where used: the
    // step loop has no registers to spare (255; a register copy of them spilled 180 bytes).
    __shared__ int pair_s[2];
    if (threadIdx.x == 0) { pair_s[0] = b0; pair_s[1] = part_rows; }
    __syncthreads();
    volatile int* pair_v = pair_s;
    const i64 b = b0;
    const i64 part = (b * H + (i64)g * G) * n_splits + split;
    if (split == 0 && threadIdx.x == 0) rows_read[b * KVH + g] = seq_len(lengths, b, L_max);
    if (self_merge && split == 0 && seq_len(lengths, b, L_max) == 0) {   // no split merges: o = 0, lse = -inf
        if (warp == 0) write_empty_heads<T, D>(out, lse, spread, b * H + (i64)g * G, G);
        return;
    }
    i64 row_begin, row_end;
    if (!split_rows(lengths, b, L_max, split, part_rows, G, part_s, part, n_splits, &row_begin, &row_end))
        return;

    MmaQuery<T, D, G> mq;                   // Q as A fragments (rows gi and gi + 8 = heads)
    mq.load(q, b * H + (i64)g * G, gi, t);
    const float mult = scale * SC_LOG2E;     // scores in the log2 domain
    State st;
    st.init();

    // Two register buffers: the loads of the next step are in flight while this one computes.
    // (base is warp-uniform, so every lane runs the same trip count around the shuffles.)
    MmaStepLoads<D> bufA, bufB;
    i64 base = row_begin + 16 * warp;
    if (base < row_end) mma_step_load<T, D, KRows>(bufA, K, V, b, base, row_end, g, gi, t);
    while (base < row_end) {
        if (base + kStep < row_end)
            mma_step_load<T, D, KRows>(bufB, K, V, pair_v[0], base + kStep, row_end, g, gi, t);
        st.step(mq, bufA, base, row_end, mult, t);
        base += kStep;
        if (base >= row_end) break;
        if (base + kStep < row_end)
            mma_step_load<T, D, KRows>(bufA, K, V, pair_v[0], base + kStep, row_end, g, gi, t);
        st.step(mq, bufB, base, row_end, mult, t);
        base += kStep;
    }
    float l_lo = st.l_lo, l_hi = st.l_hi;
    // A row's l: sum over the group's 4 threads (each summed its own columns).
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_lo += __shfl_xor_sync(0xffffffffu, l_lo, off);
        l_hi += __shfl_xor_sync(0xffffffffu, l_hi, off);
    }
    // Combine the warps through shared memory: acc [W][G][D] | m [W][G] | l [W][G].
    extern __shared__ __align__(16) unsigned char smem[];
    float* acc_s = reinterpret_cast<float*>(smem);
    float* m_s = acc_s + kWarps * G * D;
    float* l_s = m_s + kWarps * G;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int h = gi + 8 * half;
        if (h >= G || (half == 1 && !State::kHi)) continue;
#pragma unroll
        for (int j = 0; j < NT; ++j) {
            acc_s[(warp * G + h) * D + v_slice_dim(2 * t, j)] = st.o[j][2 * half];
            acc_s[(warp * G + h) * D + v_slice_dim(2 * t + 1, j)] = st.o[j][2 * half + 1];
        }
        if (t == 0) {
            m_s[warp * G + h] = half ? st.m_hi : st.m_lo;
            l_s[warp * G + h] = half ? l_hi : l_lo;
        }
    }
    __syncthreads();
    write_split_partials<D, G, kWarps>(acc_s, m_s, l_s, part_o, part_s, part, n_splits);
    if (!self_merge) return;                               // santa_merge runs next
    // self_merge: the last of the group's splits holding rows (ceil(n / part_rows)) merges its G
    // heads from the partials the others left in L2 (merge.cuh): up to 32 splits a warp per head,
    // one round trip; more, the whole block per head, 32 splits a warp and round trip. One launch
    // instead of two: the plan asks for it up to kernels.DENSE_SELF_MERGE_MAX_SPLITS (32) splits a
    // group, where it measured faster than santa_merge's launch (H200, kernel_choice.py).
    const i64 bm = pair_v[0];
    const int active = (seq_len(lengths, bm, L_max) + pair_v[1] - 1) / pair_v[1];
    if (!block_arrives_last(merge_counters + bm * KVH + g, (unsigned)active)) return;
    if (active <= 32) {
        for (int h = warp; h < G; h += kWarps) {
            const i64 bh = bm * H + (i64)g * G + h;
            warp_merge_dense_head<T, D>(part_o + bh * n_splits * D, part_s + bh * n_splits, active, bh, out, lse,
                                        spread);
        }
    } else {
        for (int h = 0; h < G; ++h) {                       // the combine's shared memory is free
            const i64 bh = bm * H + (i64)g * G + h;
            block_merge_dense_head<T, D, kWarps>(part_o + bh * n_splits * D, part_s + bh * n_splits, active, bh, out,
                                                 lse, spread, acc_s);
        }
    }
}

template <typename T, int D, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_mma(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                 const int* __restrict__ lengths, float scale, int split_target, int batch, int H, int KVH,
                 i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits,
                 int self_merge, unsigned* __restrict__ merge_counters, T* __restrict__ out,
                 float* __restrict__ lse, float* __restrict__ spread, int santa_from, int* __restrict__ rows_read,
                 const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_launch_dependents();
    if (!dense_fallback_wait(lengths, batch, L_max, santa_from)) return;
    dense_mma_split<T, D, G>(q, SC_CACHE_ROWS(k_cache), SC_CACHE_ROWS(v_cache), lengths, scale, split_target, batch,
                             H, KVH, L_max, part_o, part_s, n_splits, self_merge, merge_counters, out, lse, spread,
                             santa_from, rows_read);
}

// decode_dense_mma on K in the feature-blocked layout kb [B, KVH, NP, C, P, FB] (tile.cuh
// BlockedKeyRows, FB = key_block 16 | 32, C = D / FB, pages of P rows) with V contiguous [B, L_max, KVH, D]:
// contiguous caches only, so no page arguments. Each thread loads the same K words into the same
// registers as decode_dense_mma (only their addresses differ) and the arithmetic is the same in the
// same order: for the same splits, o, lse and the partials equal decode_dense_mma's on the
// standard K bit for bit.
template <typename T, int D, int G>
__global__ void __launch_bounds__(SC_NTHREADS)
decode_dense_mma_blocked(const T* __restrict__ q, const T* __restrict__ kb, const T* __restrict__ v_cache,
                         const int* __restrict__ lengths, float scale, int split_target, int batch, int H, int KVH,
                         i64 L_max, float* __restrict__ part_o, float4* __restrict__ part_s, int n_splits,
                         int self_merge, unsigned* __restrict__ merge_counters, T* __restrict__ out,
                         float* __restrict__ lse, float* __restrict__ spread, int santa_from,
                         int* __restrict__ rows_read, int key_block) {
    pdl_launch_dependents();
    if (!dense_fallback_wait(lengths, batch, L_max, santa_from)) return;
    const BlockedKeyRows<T, D> K{kb, L_max, KVH, key_block};
    const CacheRows<T, D> V{v_cache, nullptr, L_max, KVH, 0, 0, 0};
    dense_mma_split<T, D, G>(q, K, V, lengths, scale, split_target, batch, H, KVH, L_max, part_o, part_s, n_splits,
                             self_merge, merge_counters, out, lse, spread, santa_from, rows_read);
}

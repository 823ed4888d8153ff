// santa_one_pass.cu — the one-pass budget (santa_cupy/one_pass.py, its float64 reference): score,
// sample and gather in one pass over the cache, like flash-decoding, then santa_merge (kind dense).
//
// For a head with scaled scores s_j and the caller's normaliser r (lse_hint[b, h]; any
// deterministic guess of the log-sum-exp): pi_j = min(1, S exp(s_j - r)); inside tile t, Madow's
// systematic design with one uniform U_t = uniform01(head_key, t, SC_ONE_PASS_DRAW) takes row j
// when ceil(P_j - U_t) > ceil(P_{j-1} - U_t) (P the running sum of pi over the tile's rows, float32
// here, float64 in the reference: they agree but for points within rounding of a row boundary);
// a taken row adds (exp(s_j - M) / pi_j) V_j and every row adds exp(s_j - M) to the exp-sum, M the
// run's running max. So the estimate N / Z is unbiased for any r, with about S exp(lse - r) rows.
// A NaN hint makes every pi 1 (the exact output, all of V read): a plan's first call.
//
// grid (ceil(ceil(T_max / tpw) / 4), KVH, B), block SC_NTHREADS; warp w of block x takes the run of
// tiles [c tpw, (c + 1) tpw), c = 4x + w (as santa_score_mma), scoring each on tensor cores
// (KeyRun) into shared memory, then selecting and gathering its rows before the next; the run's
// partial goes to part_o[b, h, c, :] (relative to M) and part_s[b, h, c] = (M, Z_run, 0, 0), which
// santa_merge combines (kind dense, part_rows = tpw BN). rows_read[b, g] (distinct rows over the
// group's heads) and drawn[b, h] (rows each head took) are added to, zero on entry.
// Shared memory (kernels.one_pass_smem_bytes): per warp sc [G][BN] f32 (scores, then coefficients)
// | rows [BN] i32 | sums [G][D] f32 | coefficients of the staged rows [G][kStage] f32; then per warp
// the staged V rows [kStage][D] (SC_GATHER_STAGE_BYTES): a tile's first kStage selected rows are
// copied there by cp.async and added after the next tile is scored.
#include "common.cuh"
#include "tile.cuh"
#include "mma.cuh"
#include "async_copy.cuh"
#include "gather_mma.cuh"

#define SC_ONE_PASS_DRAW 0xFFFFFFFDull

// sums[h] += c_h V for this lane's D/32 slice v of one V row, c_h = coef[h * stride] (0: not taken).
template <int D, int G>
__device__ __forceinline__ void add_row(float* sums, const float (&v)[D / 32], const float* coef, int stride) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int h = 0; h < G; ++h) {
        const float c = coef[h * stride];
        if (c == 0.f) continue;
#pragma unroll
        for (int e = 0; e < E; ++e) sums[h * D + lane * E + e] = fmaf(c, v[e], sums[h * D + lane * E + e]);
    }
}

// Wait for this lane's cp.async copies of the n staged rows and add them: sums[h] += coef[h][r] V_r
// (the lane's own D/32 slice of each row, so its own wait is all the synchronisation needed).
template <typename T, int D, int G, int kStage>
__device__ __forceinline__ void add_staged(float* sums, const float* coef, const T* stage, int n) {
    constexpr int E = D / 32;
    const int lane = threadIdx.x & 31;
    cp_async_wait<0>();
    __syncwarp();                                        // coef was written by other lanes
    for (int r = 0; r < n; ++r) {
        float v[E];
        load_slice<T, E>(stage + r * D + lane * E, v);
        add_row<D, G>(sums, v, coef + r, kStage);
    }
}

template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS, 3)
santa_one_pass(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
               const int* __restrict__ lengths, float scale, int H, int KVH, i64 L_max, int T_max,
               int tiles_per_warp, int samples, u64 seed, const i64* __restrict__ step, int layer,
               int head_offset, const float* __restrict__ lse_hint, float* __restrict__ part_o,
               float4* __restrict__ part_s, int P_max, int* __restrict__ rows_read, int* __restrict__ drawn,
               const int* __restrict__ block_table, int page_size, int table_stride, int page_hnd) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    static_assert(D == 64 || D == 128, "one pass: tensor-core scores, head_dim 64 or 128");
    static_assert(G >= 1 && G <= 8, "one pass: G <= 8");
    constexpr int kWarps = SC_NTHREADS / 32, R = BN / 32, E = D / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int gi = lane >> 2, tq = lane & 3;
    const int g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const int n_tiles = (n + BN - 1) / BN;
    const int run = blockIdx.x * kWarps + warp;
    const int t_begin = run * tiles_per_warp, t_end = min(t_begin + tiles_per_warp, n_tiles);
    if (t_begin >= t_end) return;                              // whole warp
    const i64 head0 = b * H + (i64)g * G;

    constexpr int kStage = SC_GATHER_STAGE_BYTES / (D * (int)sizeof(T));   // V rows staged a tile
    constexpr int kWarpFloats = G * BN + BN + G * D + G * kStage;
    extern __shared__ __align__(16) unsigned char smem[];
    float* sc = reinterpret_cast<float*>(smem) + warp * kWarpFloats;             // [G][BN]
    int* rows = reinterpret_cast<int*>(sc + G * BN);                            // [BN]
    float* sums = sc + G * BN + BN;                                             // [G][D]
    float* coef_st = sums + G * D;                                              // [G][kStage]
    T* stage = reinterpret_cast<T*>(reinterpret_cast<float*>(smem) + kWarps * kWarpFloats) +
               warp * kStage * D;                                               // [kStage][D]
#pragma unroll
    for (int h = 0; h < G; ++h)
#pragma unroll
        for (int e = 0; e < E; ++e) sums[h * D + lane * E + e] = 0.f;

    // lane h < G: head h's key and hint; every lane: the run's reference M and exp-sum per head
    // head_offset: the global index of the plan's first query head (tensor parallelism; 0 otherwise)
    const u64 key = lane < G ? head_key(seed, (u64)step[0], (u64)layer, (u64)b, (u64)(head_offset + g * G + lane))
                             : 0ull;
    const float hint = lane < G ? lse_hint[head0 + lane] : 0.f;
    const float log_s = __logf((float)samples);
    // lane h < G: head h's run reference M (the running max of its tiles), exp-sum Z relative to
    // it, and the rows it took (shuffled from lane h where every lane needs them)
    float my_M = -SC_INF, my_Z = 0.f;
    int my_took = 0;
    int rows_total = 0;
    int pending = 0;                                         // rows of the previous tile in the stage

    const CacheRows<T, D> K = SC_CACHE_ROWS(k_cache), V = SC_CACHE_ROWS(v_cache);
    MmaQuery<T, D, G> mq;
    mq.load(q, head0, gi, tq);
    KeyRun<T, D, BN> kr;
    const i64 first0 = (i64)t_begin * BN;
    kr.start(K, b, first0, min(first0 + BN, (i64)n), g, gi, tq);
    for (int t = t_begin; t < t_end; ++t) {                   // warp-uniform trip count
        const i64 row0 = (i64)t * BN, row_end = min(row0 + BN, (i64)n);
        const int nrows = (int)(row_end - row0);
        const int lim = nrows - 2 * tq;
        const bool has_next = t + 1 < t_end;
        const i64 next0 = has_next ? row0 + BN : row0, next_end = has_next ? min(next0 + BN, (i64)n) : row0;
        OnlineStats st;
        kr.score_tile(mq, t - t_begin, K, b, row0, row_end, next0, next_end, g, gi, tq,
                      [&](int s, int j, const float (&acc)[4]) {
            const int c = 16 * s + 8 * j;
            const float x0 = c < lim ? acc[0] * scale : -SC_INF, x1 = c + 1 < lim ? acc[1] * scale : -SC_INF;
            if (gi < G) {
                if (c < lim) sc[gi * BN + c + 2 * tq] = x0;
                if (c + 1 < lim) sc[gi * BN + c + 2 * tq + 1] = x1;
            }
            st.push2(x0, x1);
        });
        st.reduce_group();                                   // lanes 4 h .. 4 h + 3: head h's (m_t, l_t)
        // the previous tile's staged rows (relative to the reference before this tile's max)
        if (pending) add_staged<T, D, G, kStage>(sums, coef_st, stage, pending);
        pending = 0;
        __syncwarp();
        bool any_row[R];
#pragma unroll
        for (int i = 0; i < R; ++i) any_row[i] = false;
#pragma unroll 1
        for (int h = 0; h < G; ++h) {                        // not unrolled: the K step in flight holds registers
            const float m_t = __shfl_sync(0xffffffffu, st.m, 4 * h), l_t = __shfl_sync(0xffffffffu, st.l, 4 * h);
            const float r = __shfl_sync(0xffffffffu, hint, h);
            const float u = __shfl_sync(0xffffffffu, lane < G ? uniform01(key, (u64)t, SC_ONE_PASS_DRAW) : 0.f, h);
            // the run's reference: its running max (NaN once a score is NaN)
            const float m_prev = __shfl_sync(0xffffffffu, my_M, h);
            const float m_new = max_nan(m_prev, m_t);
            const bool rescale = m_new > m_prev && m_prev > -SC_INF;
            const float f = rescale ? __expf(m_prev - m_new) : 1.f;
            if (rescale)                                      // what the run holds, to the new max
#pragma unroll
                for (int e = 0; e < E; ++e) sums[h * D + lane * E + e] *= f;
            if (lane == h && m_new != -SC_INF) {
                my_Z = my_Z * f + (m_t == -SC_INF ? 0.f : l_t * __expf(m_t - m_new));
                my_M = m_new;
            }
            // Madow: this lane's rows j = lane R + i; P = running sum of pi over the tile
            // log pi_j = min(0, log S + s_j - r) (a NaN hint: 0, every row taken); P = running sum
            float P[R];
            float acc_p = 0.f;
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const int j = lane * R + i;
                const float x = j < nrows ? sc[h * BN + j] : -SC_INF;
                acc_p += x == -SC_INF ? 0.f : __expf(fminf(0.f, log_s + x - r));
                P[i] = acc_p;
            }
            const float before = warp_inclusive_scan(acc_p) - acc_p;
            // points below P_j: max(0, ceil(P_j - U)); a row's "points below P_{j-1}" is its
            // predecessor's value itself (across lanes by shuffle), so each point is in one row
#pragma unroll
            for (int i = 0; i < R; ++i) P[i] = fmaxf(0.f, ceilf(__fsub_rn(__fadd_rn(before, P[i]), u)));
            float below_prev = __shfl_up_sync(0xffffffffu, P[R - 1], 1);
            if (lane == 0) below_prev = 0.f;
            int picked = 0;
#pragma unroll
            for (int i = 0; i < R; ++i) {
                const int j = lane * R + i;
                const float x = j < nrows ? sc[h * BN + j] : -SC_INF;
                const bool take = x != -SC_INF && P[i] > below_prev;
                below_prev = P[i];
                // coefficient relative to the run's reference: exp(s - M) / pi
                sc[h * BN + j] = take ? __expf(x - m_new - fminf(0.f, log_s + x - r)) : 0.f;
                any_row[i] |= take;
                picked += take;
            }
            picked = (int)warp_sum((float)picked);
            if (lane == h) my_took += picked;
        }
        const int nsel = warp_list_rows<R>(rows, any_row);         // the rows taken by any head (santa_tile.cu)
        // The first kStage selected rows go to the stage by cp.async (each lane its own D/32
        // slice), with their coefficients, and are added after the next tile is scored: their
        // round trip overlaps it. More rows than that are gathered now.
        pending = min(nsel, kStage);
        for (int w = 0; w < pending; ++w) {
            const int j = rows[w];
            cp_async_bytes<E * (int)sizeof(T)>(stage + w * D + lane * E,
                                               V.row(b, row0 + j, g) + lane * E);
        }
        cp_async_commit();
        for (int w = lane; w < pending * G; w += 32) {
            const int h = w / pending, r = w % pending;
            coef_st[h * kStage + r] = sc[h * BN + rows[r]];
        }
        // the rest (a tile that selects more than kStage rows), one row at a time
        for (int w = pending; w < nsel; ++w) {                       // warp-uniform
            const int j = rows[w];
            float v[E];
            load_slice<T, E>(V.row(b, row0 + j, g) + lane * E, v);
            add_row<D, G>(sums, v, sc + j, BN);
        }
        rows_total += nsel;
        __syncwarp();                                    // sc and rows are rewritten by the next tile
    }
    if (pending) add_staged<T, D, G, kStage>(sums, coef_st, stage, pending);
    __syncwarp();
    // the run's partial (relative to M) and its counts
#pragma unroll
    for (int h = 0; h < G; ++h) {
        float* dst = part_o + ((head0 + h) * P_max + run) * D + lane * E;
#pragma unroll
        for (int e = 0; e < E; ++e) dst[e] = sums[h * D + lane * E + e];
    }
    if (lane < G) {
        part_s[(head0 + lane) * P_max + run] = make_float4(my_M, my_Z, 0.f, 0.f);
        if (my_took) atomicAdd(&drawn[head0 + lane], my_took);
    }
    if (lane == 0 && rows_total) atomicAdd(&rows_read[b * KVH + g], rows_total);
}

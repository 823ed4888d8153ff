// tile.cuh — loading one tile of the KV cache into shared memory and scoring it (device code).
//
// Cache layout: [B, L_max, KVH, D], row (b, j, g) starts at ((b * L_max + j) * KVH + g) * D.
// All row addressing goes through cache_row(), the one place a paged cache would slot in.
// A tile is BN consecutive positions of one sequence and one KV head; in shared memory it is
// stored as [BN][D + SC_PAD] so that 16-byte row-strided reads are bank-conflict free.
#pragma once

#define SC_PAD 8

template <typename T, int D>
__device__ __forceinline__ const T* cache_row(const T* cache, i64 b, i64 j, int g, i64 L_max, int KVH) {
    return cache + ((b * L_max + j) * (i64)KVH + g) * (i64)D;
}

// Copy rows [row0, row0 + nrows) of KV head g into dst[BN][D + SC_PAD]; rows >= nrows become 0.
// Issues up to 8 independent 16-byte loads per thread before the first store.
template <typename T, int D, int BN>
__device__ __forceinline__ void load_tile(T* dst, const T* cache, i64 b, i64 row0, int nrows, int g,
                                          i64 L_max, int KVH) {
    constexpr int kThreadsPerRow = D / SC_CHUNK;
    constexpr int kChunks = BN * kThreadsPerRow;
    constexpr int kPerThread = kChunks / SC_NTHREADS;
    constexpr int kBatch = kPerThread < 8 ? kPerThread : 8;
    static_assert(kChunks % SC_NTHREADS == 0, "tile must split evenly over the block");
#pragma unroll
    for (int base = 0; base < kPerThread; base += kBatch) {
        Chunk<T> c[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (base + i) * SC_NTHREADS;
            const int r = idx / kThreadsPerRow, cc = idx % kThreadsPerRow;
            if (r < nrows) c[i].load(cache_row<T, D>(cache, b, row0 + r, g, L_max, KVH) + cc * SC_CHUNK);
            else c[i].zero();
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
            const int idx = threadIdx.x + (base + i) * SC_NTHREADS;
            const int r = idx / kThreadsPerRow, cc = idx % kThreadsPerRow;
            c[i].store(dst + r * (D + SC_PAD) + cc * SC_CHUNK);
        }
    }
}

// qs[G][D] (float32) = scale * q[b, g*G + h, :] for the G query heads of KV head g.
template <typename T, int D>
__device__ __forceinline__ void load_group_queries(float* qs, const T* q, i64 b, int g, int G, int H,
                                                   float scale) {
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {
        const int h = idx / D, d = idx % D;
        qs[idx] = scale * to_float(q[(b * H + (i64)g * G + h) * D + d]);
    }
}

// s[G][BN] = qs[h] . Ks[j] for rows j < nrows, -inf beyond. Lanes take consecutive rows.
template <typename T, int D, int BN>
__device__ __forceinline__ void tile_scores(float* s, const T* Ks, const float* qs, int G, int nrows) {
    for (int idx = threadIdx.x; idx < G * BN; idx += SC_NTHREADS) {
        const int h = idx / BN, j = idx % BN;
        float acc = -SC_INF;
        if (j < nrows) {
            acc = 0.f;
            const T* krow = Ks + j * (D + SC_PAD);
            const float* qh = qs + h * D;
#pragma unroll 4
            for (int c = 0; c < D; c += SC_CHUNK) {
                Chunk<T> kc; kc.load(krow + c);
                float kf[SC_CHUNK]; kc.to_floats(kf);
#pragma unroll
                for (int e = 0; e < SC_CHUNK; ++e) acc = fmaf(qh[c + e], kf[e], acc);
            }
        }
        s[idx] = acc;
    }
}

// Per-head max and exp-sum of s[G][BN] over the first nrows rows; warp w takes heads w, w+4, ...
// Writes m[h], l[h]. Empty tiles (nrows == 0) give m = -inf, l = 0.
template <int BN>
__device__ __forceinline__ void tile_stats(float* m, float* l, const float* s, int G, int nrows) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int h = warp; h < G; h += SC_NTHREADS / 32) {
        float mx = -SC_INF;
        for (int j = lane; j < nrows; j += 32) mx = fmaxf(mx, s[h * BN + j]);
        mx = warp_max(mx);
        float sum = 0.f;
        for (int j = lane; j < nrows; j += 32) sum += __expf(s[h * BN + j] - mx);
        sum = warp_sum(sum);
        if (lane == 0) { m[h] = mx; l[h] = sum; }
    }
}

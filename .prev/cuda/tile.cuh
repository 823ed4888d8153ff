// tile.cuh — KV-cache row addressing and per-tile softmax statistics (device code).
//
// Cache layout: [B, L_max, KVH, D], row (b, j, g) starts at ((b * L_max + j) * KVH + g) * D.
// All row addressing goes through cache_row(), the one place a paged cache would slot in.
// A tile is BN consecutive positions of one sequence and one KV head.
#pragma once

template <typename T, int D>
__device__ __forceinline__ const T* cache_row(const T* cache, i64 b, i64 j, int g, i64 L_max, int KVH) {
    return cache + ((b * L_max + j) * (i64)KVH + g) * (i64)D;
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

// santa_gather.cuh — the gather-add stage of one tile (device code).
//
// rows[0..nsel) lists, in row order, the union over the G heads of the rows with a sample.
// Each selected V row is read from global memory once (8 elements per thread, D/8 threads per
// row, SC_NTHREADS / (D/8) row groups) and added into every head with its own count:
//   acc[rg][h][:] += c[h][j] * V_j,   m2p[rg][h] += c[h][j] * ||V_j||^2
#pragma once

// Ordered compaction of the rows with any count > 0: rows[], returns nsel. Needs BN <= SC_NTHREADS.
template <int BN>
__device__ __forceinline__ int select_rows(int* rows, int* warp_tot, const int* cnt, int G, int nrows) {
    const int j = threadIdx.x, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    bool any = false;
    if (j < nrows)
        for (int h = 0; h < G; ++h) any |= cnt[h * BN + j] > 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, any);
    if (lane == 0) warp_tot[warp] = __popc(ballot);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < SC_NTHREADS / 32; ++w) {
        if (w < warp) before += warp_tot[w];
        total += warp_tot[w];
    }
    if (any) rows[before + __popc(ballot & ((1u << lane) - 1u))] = j;
    return total;
}

template <typename T, int D, int BN>
__device__ __forceinline__ void gather_add(float* acc, float* m2p, const int* rows, int nsel, const int* cnt,
                                           int G, const CacheRows<T, D>& V, i64 b, i64 row0, int g) {
    constexpr int kThreadsPerRow = D / SC_CHUNK;
    constexpr int kRowGroups = SC_NTHREADS / kThreadsPerRow;
    const int rg = threadIdx.x / kThreadsPerRow, dg = threadIdx.x % kThreadsPerRow;
    for (int base = 0; base < nsel; base += kRowGroups) {      // warp-uniform trip count
        const int i = base + rg;
        const bool valid = i < nsel;
        const int j = valid ? rows[i] : 0;
        float vf[SC_CHUNK];
        if (valid) {
            Chunk<T> vc; vc.load(V.row(b, row0 + j, g) + dg * SC_CHUNK);
            vc.to_floats(vf);
        } else {
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) vf[e] = 0.f;
        }
        float sq = 0.f;
#pragma unroll
        for (int e = 0; e < SC_CHUNK; ++e) sq = fmaf(vf[e], vf[e], sq);
        sq = group_sum(sq, kThreadsPerRow);
        if (!valid) continue;
        for (int h = 0; h < G; ++h) {
            const int c = cnt[h * BN + j];
            if (c == 0) continue;
            const float cf = (float)c;
            float* a = acc + (rg * G + h) * D + dg * SC_CHUNK;
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) a[e] = fmaf(cf, vf[e], a[e]);
            if (dg == 0) m2p[rg * G + h] = fmaf(cf, sq, m2p[rg * G + h]);
        }
    }
}

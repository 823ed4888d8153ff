// stream.cuh — register-streaming q.K^T for the G query heads of one KV group (device code).
//
// Thread layout (SC_NTHREADS threads): a row of D elements is owned by kThreadsPerRow = D/8
// consecutive lanes (8 elements = one 16-byte load each for 16-bit types); the block holds
// kRowGroups = SC_NTHREADS / kThreadsPerRow row groups. Each thread keeps its 8-element slice of
// the G (pre-scaled) queries in registers, so K and V are read straight from global memory into
// registers with U independent 16-byte loads in flight per operand and no shared-memory staging.
// Scores are reduced over the row's lanes with xor-shuffles: every lane of a row group ends up
// with the full score.
#pragma once

template <typename T, int D, int G>
struct GroupQuery {
    static constexpr int kThreadsPerRow = D / SC_CHUNK;
    static constexpr int kRowGroups = SC_NTHREADS / kThreadsPerRow;
    float q[G][SC_CHUNK];

    // q[b, g*G + h, dg*8 .. dg*8+8) * mult, for this thread's dg.
    __device__ __forceinline__ void load(const T* qptr, i64 b, int g, int H, float mult) {
        const int dg = threadIdx.x % kThreadsPerRow;
#pragma unroll
        for (int h = 0; h < G; ++h) {
            Chunk<T> c; c.load(qptr + (b * H + (i64)g * G + h) * D + dg * SC_CHUNK);
            c.to_floats(q[h]);
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) q[h][e] *= mult;
        }
    }

    // s[h] = q[h] . row (the full dot product, on every lane of the row group).
    __device__ __forceinline__ void scores(const Chunk<T>& k, float (&s)[G]) const {
        float kf[SC_CHUNK]; k.to_floats(kf);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float acc = 0.f;
#pragma unroll
            for (int e = 0; e < SC_CHUNK; ++e) acc = fmaf(q[h][e], kf[e], acc);
            s[h] = group_sum(acc, kThreadsPerRow);
        }
    }
};

// Scores of rows [row0, row0 + nrows) of one tile into s[G][BN] (shared memory), -inf past nrows.
// U rows per row group are loaded before any is used.
template <typename T, int D, int G, int BN>
__device__ __forceinline__ void stream_tile_scores(float* s, const GroupQuery<T, D, G>& gq, const CacheRows<T, D>& K,
                                                   i64 b, i64 row0, int nrows, int g) {
    using GQ = GroupQuery<T, D, G>;
    constexpr int U = BN / GQ::kRowGroups < 4 ? BN / GQ::kRowGroups : 4;
    const int rg = threadIdx.x / GQ::kThreadsPerRow, dg = threadIdx.x % GQ::kThreadsPerRow;
    for (int base = 0; base < BN; base += U * GQ::kRowGroups) {
        Chunk<T> k[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * GQ::kRowGroups + rg;
            if (j < nrows) k[u].load(K.row(b, row0 + j, g) + dg * SC_CHUNK);
            else k[u].zero();
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = base + u * GQ::kRowGroups + rg;
            float sc[G];
            gq.scores(k[u], sc);
            if (dg == 0)
#pragma unroll
                for (int h = 0; h < G; ++h) s[h * BN + j] = j < nrows ? sc[h] : -SC_INF;
        }
    }
}

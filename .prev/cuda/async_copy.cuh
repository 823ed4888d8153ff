// async_copy.cuh — cp.async (sm_80+) helpers for shared-memory ring buffers (device code).
//
// A ring holds SC_STAGES stages; a stage is kRows consecutive cache rows of K (and V). Each thread
// issues 16-byte copies that complete asynchronously (L2 only, `.cg`); groups are committed per
// stage, so `cp_async_wait<SC_STAGES - 2>()` + `__syncthreads()` makes the oldest stage readable
// while the later ones are still in flight.
#pragma once

#define SC_STAGES 4
#define SC_STAGE_BYTES 8192      // bytes of each operand per ring stage

__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src, bool valid) {
    const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
    const int bytes = valid ? 16 : 0;         // 0: zero-fill the destination, read nothing
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(bytes)
                 : "memory");
}
// One thread's kBytes (4, 8, 16 or 32) from global to shared, asynchronously (`.ca` below 16 bytes:
// `.cg` takes 16 only); both addresses kBytes-aligned (16 for 32).
template <int kBytes>
__device__ __forceinline__ void cp_async_bytes(void* smem_dst, const void* gmem_src) {
    static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16 || kBytes == 32, "cp.async size");
    if constexpr (kBytes == 32) {
        cp_async16(smem_dst, gmem_src, true);
        cp_async16(static_cast<char*>(smem_dst) + 16, static_cast<const char*>(gmem_src) + 16, true);
    } else if constexpr (kBytes == 16) {
        cp_async16(smem_dst, gmem_src, true);
    } else {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(smem_dst);
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(dst), "l"(gmem_src), "n"(kBytes) : "memory");
    }
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// Issue the copies of rows [row0, row0 + kRows) of K (and V when kOps == 2; rows >= row_end
// zero-filled, nothing read for them) into one ring stage laid out [kOps][kRows][D].
template <typename T, int D, int kRows, int kOps>
__device__ __forceinline__ void issue_stage(T* stage, const T* k_cache, const T* v_cache, i64 b, i64 row0,
                                            i64 row_end, int g, i64 L_max, int KVH) {
    constexpr int kPiecesPerRow = D * (int)sizeof(T) / 16;
    constexpr int kPieces = kOps * kRows * kPiecesPerRow;
    static_assert(kPieces % SC_NTHREADS == 0, "stage must split evenly over the block");
    constexpr int kElemsPerPiece = 16 / (int)sizeof(T);
#pragma unroll
    for (int i = 0; i < kPieces / SC_NTHREADS; ++i) {
        const int idx = threadIdx.x + i * SC_NTHREADS;
        const int which = idx / (kRows * kPiecesPerRow);               // 0: K, 1: V
        const int r = (idx / kPiecesPerRow) % kRows, piece = idx % kPiecesPerRow;
        const i64 j = row0 + r;
        const bool valid = j < row_end;
        const T* src = cache_row<T, D>(which ? v_cache : k_cache, b, valid ? j : row0, g, L_max, KVH)
                       + piece * kElemsPerPiece;
        cp_async16(stage + (which * kRows + r) * D + piece * kElemsPerPiece, src, valid);
    }
}


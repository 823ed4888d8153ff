// async_copy.cuh — cp.async (sm_80+) helpers (device code): the staged gathers of santa_tile_warp
// copy the selected V rows into shared memory with these, commit a group and wait for it.
#pragma once

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

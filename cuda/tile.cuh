// tile.cuh — KV-cache row addressing and per-tile softmax statistics (device code).
//
// Cache layouts (CacheRows below), row (b, j, g) of D elements:
//   contiguous [B, L_max, KVH, D] (page_size 0): at ((b * L_max + j) * KVH + g) * D;
//   paged, page p = table[b * table_stride + j / page_size], slot s = j % page_size:
//     NHD [num_pages, page_size, KVH, D] (FlashInfer's and vLLM's): ((p * page_size + s) * KVH + g) * D,
//     HND [num_pages, KVH, page_size, D]:                           ((p * KVH + g) * page_size + s) * D.
// All row addressing goes through CacheRows::row() (a blocked K: BlockedKeyRows below). A tile is BN consecutive positions of one
// sequence and one KV head.
#pragma once

// Where the rows of one cache (K or V) live. Every kernel that reads the cache takes its
// (block_table, page_size, table_stride, page_hnd) after its other arguments; page_size 0 is the
// contiguous cache (the table, a placeholder then, is not read).
template <typename T, int D>
struct CacheRows {
    static constexpr bool kStepRows = false;   // KeyRun addresses its rows by step_key (HeadKeyRows: true)
    const T* data;
    const int* table;          // [B, table_stride] page ids (paged)
    i64 L_max;                 // contiguous: rows per sequence
    int KVH, page_size, table_stride, hnd;    // page_size 0: contiguous

    __device__ __forceinline__ const T* row(i64 b, i64 j, int g) const {
        if (page_size == 0) return data + ((b * L_max + j) * (i64)KVH + g) * (i64)D;
        const unsigned jj = (unsigned)j, ps = (unsigned)page_size;
        // a power-of-two page size (the common ones) by a shift, not a division
        const unsigned slot_page = (ps & (ps - 1)) == 0 ? jj >> (__ffs(ps) - 1) : jj / ps;
        const i64 page = __ldg(table + b * table_stride + slot_page);
        const i64 slot = (i64)(jj - slot_page * ps);
        const i64 at = hnd ? (page * KVH + g) * page_size + slot : (page * page_size + slot) * KVH + g;
        return data + at * (i64)D;
    }

    // A 16-key step (the tensor-core kernels' unit) that starts at a multiple of 16 lies in one
    // page when page_size is a multiple of 16 (or the cache is contiguous): its rows are then
    // step_row(base, key - j0) for base = row(b, j0, g), one table lookup a step.
    __device__ __forceinline__ bool steps_in_page() const { return (page_size & 15) == 0; }
    __device__ __forceinline__ const T* step_row(const T* base, i64 offset) const {
        return base + offset * (i64)(page_size != 0 && hnd ? D : KVH * D);
    }
    // Row `key` of a step starting at j0 (base = row(b, j0, g) when steps_in_page()).
    __device__ __forceinline__ const T* step_key(const T* base, i64 b, i64 j0, i64 key, int g) const {
        return steps_in_page() ? step_row(base, key - j0) : row(b, key, g);
    }
};

// A K cache in the feature-blocked layout kb [B, KVH, NP, C, P, FB] (santa_cupy/key_layout.py;
// FB = 16 | 32, C = D / FB, pages of P = SC_KEY_PAGE_ROWS (common.cuh) rows, NP = ceil(L_max / P); contiguous,
// no paged form): feature f of row (b, j, g) is element
// ((((b * KVH + g) * NP + j / P) * C + f / FB) * P + j % P) * FB + f % FB. The rows of one block
// of a page are FB elements apart, so 8 features at a multiple of 8 (a 16-byte piece) lie in one
// block, contiguous; the blocks of a page are P * FB elements apart.
// row() is the row's feature 0; piece(row, p) the p-th 16-byte piece of the row.
template <typename T, int D>
struct BlockedKeyRows {
    static constexpr bool kStepRows = false;
    static constexpr int P = SC_KEY_PAGE_ROWS;
    const T* data;
    i64 L_max;
    int KVH, FB;

    // Offset of row j from row 0 of its (sequence, KV head): its page, then its place in the page
    // (also row j0 + j's offset from a page-aligned row j0's).
    __device__ __forceinline__ i64 offset(i64 j) const { return j / P * (i64)(D * P) + (j % P) * FB; }
    __device__ __forceinline__ const T* row(i64 b, i64 j, int g) const {
        const i64 pages = (L_max + P - 1) / P;
        return data + (b * KVH + g) * pages * (i64)(D * P) + offset(j);
    }
    // features 8p .. 8p + 7: block 8p / FB, offset 8p % FB (FB a power of two)
    __device__ __forceinline__ const T* piece(const T* row, int p) const {
        const int f = SC_CHUNK * p;
        return row + (i64)(f & ~(FB - 1)) * P + (f & (FB - 1));
    }
    // Row `key` of a step starting at j0 (base = row(b, j0, g)): a 16-key step lies in one page.
    __device__ __forceinline__ const T* step_key(const T* base, i64 b, i64 j0, i64 key, int g) const {
        return base + (key - j0) * FB;
    }
};

// The CacheRows of a cache pointer inside a kernel: T, D, L_max, KVH and the four page arguments
// every cache-reading kernel takes last (const int* block_table, int page_size, int table_stride,
// int page_hnd) in scope.
#define SC_CACHE_ROWS(ptr) (CacheRows<T, D>{(ptr), block_table, L_max, KVH, page_size, table_stride, page_hnd})

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

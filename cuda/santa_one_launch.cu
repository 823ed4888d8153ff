// santa_one_launch.cu — the warp pipeline of the global and fixed budgets in one launch, for
// calls with few (sequence, KV head) groups (DecodePlan pipeline "one_launch").
//
// The three launches of the warp pipeline (santa_score_mma -> santa_prefix -> santa_tile_warp with
// its finish) cost their dependent round trips and each grid's ramp and tail; at B = 1 they are
// most of the call. Here one grid does all three, meeting at a barrier per (b, KV head):
//   1. score: warp w of block x scores tiles [c * tpw, (c + 1) * tpw), c = 4x + w (score_run of
//      santa_score.cu: stash and tile stats);
//   2. every block of the group arrives at barrier[b, g] and waits for the others (all of the
//      grid is resident at once: the plan sizes it from the occupancy, kernels.one_launch_fits);
//   3. each block computes the group's float64 prefix itself (warp_prefix, prefix.cuh: the same
//      inputs and arithmetic in every block, so the same bits; santa_prefix's block scan adds in
//      another order, so the three-launch pipeline agrees to rounding: a comb point within an
//      ulp of a tile boundary may fall on the other side), writes C_t of its own tiles (and the
//      tile before them) to cdf and keeps the heads' lse (block 0 writes lse);
//   4. the warp pass 2 over the same tiles (tile_warp_runs of santa_tile.cu, its finish: the last
//      block writes o and spread and resets both counters).
// grid (blocks, KVH, B), block SC_NTHREADS. Sequences shorter than santa_from are
// decode_dense_mma's; an empty sequence gets o = 0, lse = -inf. Budgets global and fixed
// (largest_remainder's Hamilton rounding stays with santa_prefix).
// The score stash and tile stats are read back by the warps that wrote them; only the tile stats
// of the other blocks cross the barrier (read through L2, __ldcg).
#include "common.cuh"
#include "merge.cuh"
#include "prefix.cuh"

// Arrive at *counter and wait until `expected` blocks have (every block of the group is resident).
// The counter is reset by the group's last block at the finish, when all have left this wait.
__device__ __forceinline__ void group_barrier(unsigned* counter, unsigned expected) {
    __threadfence();                                    // this block's stash and stats, device-wide
    __syncthreads();
    if (threadIdx.x == 0) {
        atomicAdd(counter, 1u);
        unsigned seen;
        do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
        } while (seen < expected);
    }
    __syncthreads();
}

template <typename T, int D, int BN, int G, int kGather>
__global__ void __launch_bounds__(SC_NTHREADS, 3)
santa_one_launch(const T* __restrict__ q, const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                 const int* __restrict__ lengths, float scale, int H, int KVH, i64 L_max, int T_max,
                 int tiles_per_warp, int budget, int samples, u64 seed, const i64* __restrict__ step, int layer,
                 float* __restrict__ scores, double* __restrict__ cdf, const int* __restrict__ alloc,
                 float4* __restrict__ part_s, float* __restrict__ part_o, float* __restrict__ acc,
                 unsigned* __restrict__ arrive, unsigned* __restrict__ barrier, int* __restrict__ rows_read,
                 T* __restrict__ out, float* __restrict__ lse, float* __restrict__ spread, int santa_from) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    constexpr int kWarps = SC_NTHREADS / 32;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = blockIdx.y;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    if (n < santa_from) return;                                // decode_dense_mma's sequence
    const int n_tiles = (n + BN - 1) / BN;
    const i64 head0 = b * H + (i64)g * G;
    if (n_tiles == 0) {                                        // an empty sequence: o = 0, lse = -inf
        if (blockIdx.x == 0 && warp == 0) {
            write_empty_heads<T, D>(out, lse, spread, head0, G);
            if (lane == 0) rows_read[b * KVH + g] = 0;
        }
        return;
    }
    const int run_tiles = kWarps * tiles_per_warp;             // tiles of one block
    const unsigned blocks = (unsigned)((n_tiles + run_tiles - 1) / run_tiles);
    if (blockIdx.x >= blocks) return;                          // whole block

    // 1. score this warp's run
    const int t_begin = (blockIdx.x * kWarps + warp) * tiles_per_warp;
    const int t_end = min(t_begin + tiles_per_warp, n_tiles);
    if (t_begin < t_end)                                       // whole warp
        score_run<T, D, BN, G>(q, k_cache, n, scale, KVH, L_max, T_max, t_begin, t_end, b, g, head0, scores,
                               part_s);
    if (blockIdx.x == 0 && threadIdx.x == 0) rows_read[b * KVH + g] = 0;   // before anyone adds to it

    // 2. wait for the group's other blocks
    unsigned* my_barrier = barrier + b * KVH + g;
    group_barrier(my_barrier, blocks);

    // 3. the prefix at this block's tiles, and the heads' lse
    __shared__ float lse_s[G];
    const int bt0 = blockIdx.x * run_tiles, bt_end = min(bt0 + run_tiles, n_tiles);
    for (int h = warp; h < G; h += kWarps) {
        const float lse_h = warp_prefix(part_s + (head0 + h) * T_max, cdf + (head0 + h) * T_max, n_tiles,
                                        max(bt0 - 1, 0), bt_end);
        if (lane == 0) {
            lse_s[h] = lse_h;
            if (blockIdx.x == 0) lse[head0 + h] = lse_h;
        }
    }
    __syncthreads();

    // 4. sample, gather and finish
    tile_warp_runs<T, D, BN, G, kGather, true>(v_cache, n, H, KVH, L_max, T_max, tiles_per_warp, budget, samples,
                                               seed, step, layer, scores, cdf, alloc, part_s, part_o, acc, arrive,
                                               my_barrier, rows_read, out, lse_s, spread, blocks);
}

// santa_prefix.cu — per-head global comb preparation for the two-pass budgets.
//
// grid (H, B), block SC_NTHREADS. Head h of sequence b: prefix.cuh's head_prefix (cdf[b, h, t],
// lse[b, h], and for budget largest_remainder the Hamilton allocation alloc[b, h, t]), and
// rows_read[b, h / G] = 0 from the first head of each group (santa_tile_warp adds this call's
// rows). Sequences shorter than santa_from (a santa plan's dense fallback) and empty ones are left
// alone. The warp pipeline's fused prefix (DecodePlan, KernelChoice.fused_prefix) runs the same
// head_prefix in santa_score_mma instead of this launch.
#include "common.cuh"
#include "prefix.cuh"

__global__ void __launch_bounds__(SC_NTHREADS)
santa_prefix(const float4* __restrict__ part_s, const int* __restrict__ lengths, i64 L_max, int H, int BN,
             int T_max, int samples, int budget_lr, double* __restrict__ cdf, int* __restrict__ alloc,
             float* __restrict__ lse, int* __restrict__ rows_read, int G, int santa_from) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    const int h = blockIdx.x;
    const i64 b = blockIdx.y;
    const int n = seq_len(lengths, b, L_max);
    if (n < santa_from || n == 0) return;       // the dense kernel's, or empty (santa_tile_warp writes it)
    if (threadIdx.x == 0 && h % G == 0) rows_read[b * (H / G) + h / G] = 0;
    const i64 row = (b * H + h) * T_max;
    head_prefix<SC_NTHREADS>(part_s + row, (n + BN - 1) / BN, samples, budget_lr, cdf + row, alloc + row,
                             lse + b * H + h);
}

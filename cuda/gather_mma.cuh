// gather_mma.cuh — the warp SANTA pass 2's gather-add on tensor cores (fp16/bf16, D 64 or 128).
//
// A tile's nsel selected V rows (rows[] of the tile, counts cnt[G][BN] of santa_tile_warp) are
// staged in shared memory kRows at a time (coalesced cp.async of whole rows); per k-step of 16 rows
//   acc[d][h] += sum_j V_j[d] c_h(j)   mma.m16n8k16, A = V^T (16 dims x 16 rows, ldmatrix.trans),
//                                      B = the counts (16 rows x 8 heads), exact integers in T
//   n_j = ||V_j||^2                    the diagonal of V V^T: A = V (16 rows x 16 dims, ldmatrix),
//                                      B = the same registers
// and m2[h] += c_h(j) n_j. The products are exact and accumulate in f32, as the FMA gather's do
// (in another order). Counts must be exact in T: a tile whose heads draw more than kMaxCount
// points takes the FMA gather (santa_tile_warp checks HeadDraw::n, an upper bound of a count).
//
// Where the FMA gather spends ~45 instructions a row (a 16-bit row slice per lane, a shared
// count load, a branch and E FMAs per head), a k-step of 16 rows is ~40 (ldmatrix, mma) at D 128.
// Measured on the H200: the fixed budget's tile stage at 32k 148 -> 127 us; below 16
// selected rows a tile the padded k-step loses to the FMA gathers, so kernels.py picks it from 16.
//
// Stage layout [kRows][D] T with 16-byte chunk c of row r stored at chunk c ^ (r & 7): the 8 row
// addresses of one ldmatrix 8x8 matrix then fall in 8 distinct bank groups.
// Results, thread (gi, t) (mma.cuh's fragment names): acc[mt][0..1] = dims mt*16 + gi of heads
// 2t, 2t + 1; acc[mt][2..3] = dims mt*16 + gi + 8 of the same heads (heads >= G stay zero);
// m2[h] = this thread's part of sum_j c_h(j) n_j (threads t == gi / 2 hold rows gi and gi + 8 of
// each k-step), summed over the warp later.
#pragma once
#include "mma.cuh"

#define SC_GATHER_STAGE_BYTES 4096   // per warp: staged V rows (this gather and warp_gather_add_staged)

// Whether santa_tile_warp has the tensor-core gather (SC_GATHER_MMA) for this (T, D).
template <typename T, int D> struct MmaGatherable { static constexpr bool value = false; };
template <int D> struct MmaGatherable<bf16_t, D> { static constexpr bool value = D == 64 || D == 128; };
template <int D> struct MmaGatherable<f16_t, D> { static constexpr bool value = D == 64 || D == 128; };

template <typename T> struct MmaExact;                 // largest integer count exact in T
template <> struct MmaExact<bf16_t> { static constexpr int kMaxCount = 256; };
template <> struct MmaExact<f16_t> { static constexpr int kMaxCount = 2048; };

// Four 8x8 16-bit matrices from shared memory (lanes 8q .. 8q + 7 give matrix q's row addresses).
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row_addr) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row_addr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row_addr) {
    const unsigned a = (unsigned)__cvta_generic_to_shared(row_addr);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

template <typename T, int D, int BN, int G>
struct MmaGather {
    static_assert(D == 64 || D == 128, "mma gather: head_dim 64 or 128");
    static_assert(G <= 8, "mma gather: the G heads are the 8 columns of one n-tile");
    static constexpr int MT = D / 16;                   // m-tiles (dims) of acc, k-steps of the Gram
    static constexpr int QC = D / 8;                    // 16-byte chunks of a row
    static constexpr int kRows = SC_GATHER_STAGE_BYTES / (D * 2);   // rows staged per round
    static_assert(kRows % 16 == 0 && kRows * QC % 32 == 0, "whole k-steps, whole copy rounds");
    static constexpr int kMaxCount = MmaExact<T>::kMaxCount;

    float acc[MT][4];
    float m2[G];

    __device__ __forceinline__ static T* chunk(T* stage, int r, int c) { return stage + r * D + ((c ^ (r & 7)) << 3); }

    // The tile's gather: rows[0 .. nsel) of the tile starting at row0, counts cnt[G][BN] (this
    // warp's shared arrays), stage = this warp's SC_GATHER_STAGE_BYTES.
    __device__ __forceinline__ void run(const int* cnt, const int* rows, int nsel, T* stage, const CacheRows<T, D>& V,
                                        i64 b, i64 row0, int g) {
        const int lane = threadIdx.x & 31, gi = lane >> 2, t = lane & 3;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) acc[mt][0] = acc[mt][1] = acc[mt][2] = acc[mt][3] = 0.f;
#pragma unroll
        for (int h = 0; h < G; ++h) m2[h] = 0.f;
        for (int base = 0; base < nsel; base += kRows) {              // warp-uniform
            __syncwarp();                                             // the last round's reads are done
#pragma unroll
            for (int i = 0; i < kRows * QC / 32; ++i) {
                const int idx = 32 * i + lane, r = idx / QC, c = idx % QC;
                const bool valid = base + r < nsel;                   // else zero-filled (0 x garbage = NaN)
                const i64 row = row0 + (valid ? rows[base + r] : 0);
                cp_async16(chunk(stage, r, c), V.row(b, row, g) + 8 * c, valid);
            }
            cp_async_commit();
            cp_async_wait<0>();
            __syncwarp();                                             // every lane's rows have landed
#pragma unroll
            for (int ks = 0; ks < kRows / 16; ++ks) {
                const int k0 = base + 16 * ks;                        // the k-step's first selected row
                if (k0 >= nsel) break;
                // B: counts of head gi for rows k0 + 2t, +1 (b0) and k0 + 2t + 8, +9 (b1)
                float c[4];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int k = k0 + 2 * t + (e & 1) + 8 * (e >> 1);
                    c[e] = gi < G && k < nsel ? (float)cnt[gi * BN + rows[k]] : 0.f;
                }
                const u32 b0 = pack2<T>(c[0], c[1]), b1 = pack2<T>(c[2], c[3]);
                const int q = lane >> 3, r8 = lane & 7;               // this lane's ldmatrix row address
                float n0[4] = {0.f, 0.f, 0.f, 0.f}, n1[4] = {0.f, 0.f, 0.f, 0.f};   // V V^T, rows 0-7 | 8-15
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    u32 a[4];
                    // A = V^T: matrix q = (dims +8 (q & 1), rows +8 (q >> 1)); .trans gives A[dim gi][row 2t, 2t+1]
                    ldmatrix_x4_trans(a, chunk(stage, 16 * ks + 8 * (q >> 1) + r8, 2 * mt + (q & 1)));
                    mma_16816<T>(acc[mt], a, b0, b1);
                    // A = V: matrix q = (rows +8 (q & 1), dims +8 (q >> 1)) of dims mt*16 ..; B = V^T from
                    // the same registers: rows 0-7 (a[0], a[2]) and rows 8-15 (a[1], a[3])
                    u32 v[4];
                    ldmatrix_x4(v, chunk(stage, 16 * ks + 8 * (q & 1) + r8, 2 * mt + (q >> 1)));
                    mma_16816<T>(n0, v, v[0], v[2]);
                    mma_16816<T>(n1, v, v[1], v[3]);
                }
                // the diagonal: thread (gi, t = gi / 2) holds n of rows gi (n0[gi & 1]) and gi + 8 (n1[2 + (gi & 1)])
                if (t == (gi >> 1)) {
                    const float nlo = n0[gi & 1], nhi = n1[2 + (gi & 1)];
                    const int klo = k0 + gi, khi = k0 + gi + 8;
                    const int jlo = klo < nsel ? rows[klo] : 0, jhi = khi < nsel ? rows[khi] : 0;
#pragma unroll
                    for (int h = 0; h < G; ++h) {
                        if (klo < nsel) m2[h] = fmaf((float)cnt[h * BN + jlo], nlo, m2[h]);
                        if (khi < nsel) m2[h] = fmaf((float)cnt[h * BN + jhi], nhi, m2[h]);
                    }
                }
            }
        }
    }
};

// santa_score_keys.cu — S2ANTA pass 1 (score stage) with block key sampling ("bernoulli_block",
// santa_cupy/key_sampling.py) on the feature-blocked K cache: it reads only the K blocks a draw
// selected.
//
// K layout (santa_cupy/key_layout.py, tile.cuh BlockedKeyRows): kb [B, KVH, NP, C, P, FB], C = D / FB,
// FB = 16 | 32 (a runtime argument), pages of P = SC_KEY_PAGE_ROWS rows: the P rows of block c of a
// page of KV head g are one contiguous run of P * FB elements. q [B, H, D]; heads g*G .. g*G + G - 1 read KV head g. Contiguous caches only.
//
// santa_key_blocks, then one of the two score passes, back to back (santa_cupy/key_pass.py):
// santa_score_keys (FMA, the fallback) or santa_score_keys_mma (tensor cores, the automatic one; at
// the end of this file).
//
// santa_key_blocks<T>: grid (KVH, B), block 32 (one warp per (b, g); lane c holds block c, C <= 8).
//   The group's block weights w_c (rule 0 "uniform": 1; 1 "qmax": max_h ||q_h[c]||; 2 "qrms":
//   sqrt(sum_h ||q_h[c]||^2)), pi_c = min(1, lam w_c) with lam as the reference computes it in
//   float64: in closed form for one draw (key_one_draw_lam), else by its bisection (80 steps,
//   5 a round on 31 lanes, stopping at its fixed point: key_bisect), pi rounded to float32, R draws I_{r,c} = [u_{r,c} < pi_c] from the group stream
//   (key_sampling_uniform: unit GROUP_UNIT | (kv_offset + g), k = (r << 32) | c), and each
//   block's Horvitz-Thompson weight, "mean" (combine 0) (count_c / R) / pi_c or "union" (1)
//   1 / (1 - (1 - pi_c)^R) where any draw selected it, else 0. Every float64 operation is an
//   explicit _rn intrinsic in the order santa_cupy/key_sampling.py documents (no FMA
//   contraction), so pi and the masks equal the NumPy reference's bit for bit.
//   Writes key_weight[b, g, c] (float32), key_pi[b, g, c] (float32), blocks_read[b, g] (int32:
//   blocks with a nonzero weight, the K blocks santa_score_keys reads per row), group_class[b, g]
//   (the 32-feature groups holding a read block) and, by the last warp to arrive (the counter
//   *arrive, back at 0 after), group_order [B * KVH]: the groups by class descending, then id,
//   santa_score_keys_mma's launch order.
//
// santa_score_keys<T, D, BN, G>: grid (ceil(T_max / tiles_per_block), KVH, B), block SC_NTHREADS
//   (128); block x takes the run of tiles [x * tpb, min((x + 1) * tpb, n_tiles)) of (b, g), tile t
//   the rows [t*BN, min((t+1)*BN, n_b)); blocks past n_b exit at once. Writes exactly what
//   santa_score writes (santa_prefix, santa_tile and santa_merge follow unchanged): scores[b, h, j]
//   = scale * sum_{c read} key_weight[b, g, c] * q_h[c] . K_j[c] (float32, for j < n_b) and
//   part_s[b, h, t] = (m_t, l_t, 0, 0). It reads key_weight and only the runs of the blocks with a
//   nonzero weight (the union over the draws), in units of one tile and 32 features: one read block
//   (FB 32) or two (FB 16). Thread i owns the 16-byte piece i mod 4 of the unit's rows
//   i / 4 + 32 m (m < BN / 32), so a warp reads 8 rows x 64 contiguous bytes of each run it touches
//   (FB 32: 512 bytes of one run; FB 16: 256 bytes of each of two). Units stream through
//   kStages register buffers across the run's tiles: while one unit is multiplied the next
//   kStages - 1 are loading, through a tile's stash and stats too. Partial dot products add over the
//   units in block order, then over the 4 lanes of a row (a fixed order: a re-run writes the same
//   bits). The block's prologue (the read list, scale * weight * q) is paid once per run.
//   Shared memory (static): qw [D/8][G][8] f32 (scale * weight_c * q, per 8-feature piece) |
//   read [C] i32 | s [G][BN] f32 | m, l [G] f32.
#include "common.cuh"
#include "tile.cuh"
// santa_score.cu: write_tile_stash (kernels.py concatenates the files in this order)
#include "santa_score.cu"

#define SC_KEY_SAMPLING_TILE 0xFFFFFFFEull   // rng.KEY_SAMPLING_TILE
#define SC_GROUP_UNIT 0x80000000ull          // rng.GROUP_UNIT
#define SC_KEY_BISECTION_STEPS 80            // key_sampling.block_probabilities' iterations
#define SC_KEY_MAX_BLOCKS 8                  // C = D / FB at D <= 128 (kernels.key_sampling_supported)

// x^R (R >= 1) by square-and-multiply from the lowest bit, starting at the first set bit
// (key_sampling._int_power).
__device__ __forceinline__ double key_int_power(double x, int R) {
    double result = 1.0, base = x;
    bool first = true;
    while (R) {
        if (R & 1) { result = first ? base : __dmul_rn(result, base); first = false; }
        R >>= 1;
        if (R) base = __dmul_rn(base, base);
    }
    return result;
}

// (1 / C) sum_c 1 - (1 - min(1, lam w_c))^R, the terms summed over c in order (wc: the C <=
// SC_KEY_MAX_BLOCKS weights, in this lane's registers).
// One draw (R = 1, the default), warp-uniform: x^1 = x, so the terms are 1 - (1 - pi) in the
// same operations, without the power's loop (it kept the loop over c rolled: ~100 instructions a
// term, where the bisection evaluates this in every probe).
__device__ __forceinline__ double key_read_fraction(double lam, const double (&wc)[SC_KEY_MAX_BLOCKS], int C, int R) {
    double total = 0.0;
    if (R == 1) {
#pragma unroll
        for (int c = 0; c < SC_KEY_MAX_BLOCKS; ++c) {
            const double pi = fmin(1.0, __dmul_rn(lam, wc[c]));
            if (c < C) total = __dadd_rn(total, __dsub_rn(1.0, __dsub_rn(1.0, pi)));
        }
    } else {
#pragma unroll
        for (int c = 0; c < SC_KEY_MAX_BLOCKS; ++c) {
            if (c >= C) break;
            const double pi = fmin(1.0, __dmul_rn(lam, wc[c]));
            total = __dadd_rn(total, __dsub_rn(1.0, key_int_power(__dsub_rn(1.0, pi), R)));
        }
    }
    // / C: C = D / FB is a power of two (2, 4 or 8), so the multiply by 1 / C is exact, the
    // reference's division bit for bit, without a float64 division in every bisection probe
    return __dmul_rn(total, 1.0 / (double)C);
}

// d f / d lam at lam (the read fraction's slope), for key_bisect's Newton estimate only.
__device__ __forceinline__ double key_read_slope(double lam, const double (&wc)[SC_KEY_MAX_BLOCKS], int C, int R) {
    double slope = 0.0;
#pragma unroll
    for (int c = 0; c < SC_KEY_MAX_BLOCKS; ++c) {
        const double x = lam * wc[c];
        if (c < C && x < 1.0) slope += R * wc[c] * (R == 1 ? 1.0 : key_int_power(1.0 - x, R - 1));
    }
    return slope / C;
}

// The reference's bisection on [0, lam_hi] (block_probabilities: mid = (lo + hi) / 2, hi = mid
// where the read fraction f at mid exceeds the budget, else lo = mid; SC_KEY_BISECTION_STEPS
// steps), bit for bit, in three parts:
//   1. x* = the smallest double in (0, lam_hi] with f(x*) > budget. f as computed is monotone in
//      lam (every operation rounds monotonically), so each step of the bisection goes "over"
//      exactly when its mid >= x*: x* decides the whole path.
//   2. x* found exactly: a Newton estimate from the left (f is concave; at R = 1 piecewise linear,
//      so a few steps land within rounding), a bracket of 2^12 doubles either side checked by two
//      lanes (else the whole range), then 31 probes a round over the bracket's bit patterns
//      (positive doubles order as their bits) until it is one double wide: ~3 rounds of probes
//      where the search tree over the bisection's own mids took ~11.
//   3. the reference's steps replayed with "over" = mid >= x*, stopping at the fixed point (mid ==
//      lo or mid == hi: every later step leaves lo and hi as they are), so hi is the sequential
//      bisection's even where 80 steps do not reach adjacent doubles.
// (Checked in NumPy against the reference's bisection on 2760 random weight vectors, C 2-8, R 1-8,
// 102 of them unconverged after 80 steps: the same hi every time.)
__device__ __forceinline__ double key_bisect(double lam_hi, const double (&wc)[SC_KEY_MAX_BLOCKS], int C, int R,
                                             double budget) {
    const int lane = threadIdx.x & 31;
    using ull = unsigned long long;
    // 1. the estimate (every lane the same)
    double est = 0.0;
    for (int it = 0; it < 16; ++it) {
        const double fx = key_read_fraction(est, wc, C, R);
        const double slope = key_read_slope(est, wc, C, R);
        if (!(fx < budget) || !(slope > 0.0)) break;
        const double next = fmin(lam_hi, est + (budget - fx) / slope);
        if (!(next > est)) break;
        est = next;
    }
    // 2. the bracket [lo, hi] of bit patterns, f(lo) <= budget < f(hi), then probes
    const ull top = (ull)__double_as_longlong(lam_hi);
    const ull mid_bits = (ull)__double_as_longlong(est);
    ull lo = mid_bits > (1ull << 12) ? mid_bits - (1ull << 12) : 0ull;
    ull hi = min(top, mid_bits + (1ull << 12));
    const ull check = lane == 0 ? lo : hi;
    const bool as_expected = lane > 1 || (lane == 0 ? !(key_read_fraction(__longlong_as_double((long long)check), wc,
                                                                            C, R) > budget)
                                                    : key_read_fraction(__longlong_as_double((long long)check), wc,
                                                                        C, R) > budget);
    if (!__all_sync(0xffffffffu, as_expected)) { lo = 0ull; hi = top; }   // f(0) = 0 <= budget < f(lam_hi)
    while (hi - lo > 1ull) {                              // warp-uniform
        const ull step = (hi - lo + 31ull) / 32ull;
        const ull p = min(hi, lo + (ull)(lane + 1) * step);   // lane 31: hi
        const bool over = p == hi || key_read_fraction(__longlong_as_double((long long)p), wc, C, R) > budget;
        const int first = __ffs(__ballot_sync(0xffffffffu, over)) - 1;
        const ull below = first ? __shfl_sync(0xffffffffu, p, first - 1) : lo;
        hi = __shfl_sync(0xffffffffu, p, first);
        lo = below;
    }
    const double x_star = __longlong_as_double((long long)hi);
    // 3. the reference's steps
    double b_lo = 0.0, b_hi = lam_hi;
    for (int s = 0; s < SC_KEY_BISECTION_STEPS; ++s) {
        const double mid = __dmul_rn(0.5, __dadd_rn(b_lo, b_hi));
        if (mid == b_lo || mid == b_hi) break;
        if (mid >= x_star) b_hi = mid;
        else b_lo = mid;
    }
    return b_hi;
}

// One draw (R = 1, the default): lam in closed form, the reference's _one_draw_lam bit for bit.
// Lane k < C takes ws_k, the k-th largest weight (w: this lane's own; ties by lane), its tail
// ws_k + .. + ws_{C-1} summed from ws_{C-1} down, and lam_k = (C budget - k) / tail; lam is the
// lam_k of the first lane with ws_k > 0 and lam_k ws_k <= 1. A few dependent float64 operations
// where the bisection's search took ~4 us of the kernel's 8.2 (H200, budget < 1).
__device__ __forceinline__ double key_one_draw_lam(double w, const double (&wc)[SC_KEY_MAX_BLOCKS], int C,
                                                   double budget, double* sorted) {
    const int lane = threadIdx.x & 31;
    // sort keys: the weights, a NaN one as -1, below every weight (a strict order: the ranks are a
    // permutation, each slot written once; such a group's pi is NaN whatever its order)
    const double key = isnan(w) ? -1.0 : w;
    int rank = 0;
#pragma unroll
    for (int c = 0; c < SC_KEY_MAX_BLOCKS; ++c) {
        const double kc = isnan(wc[c]) ? -1.0 : wc[c];
        rank += c < C && (kc > key || (kc == key && c < lane));
    }
    if (lane < C) sorted[rank] = w;
    __syncwarp();
    double ws = 0.0, tail = 0.0;
    if (lane < C) {
        ws = sorted[lane];
        for (int c = C - 1; c >= lane; --c) tail = __dadd_rn(tail, sorted[c]);
    }
    const double lam_k = __ddiv_rn(__dsub_rn(__dmul_rn((double)C, budget), (double)lane), ws > 0.0 ? tail : 1.0);
    const unsigned ok = __ballot_sync(0xffffffffu, lane < C && ws > 0.0 && __dmul_rn(lam_k, ws) <= 1.0);
    return __shfl_sync(0xffffffffu, lam_k, ok ? __ffs(ok) - 1 : 0);   // none: unreachable, not used
}

template <typename T>
__global__ void __launch_bounds__(32)
santa_key_blocks(const T* __restrict__ q, int H, int KVH, int D, int FB, int rule, int R, double budget,
                 int combine, u64 seed, const i64* __restrict__ step, int layer, int kv_offset,
                 float* __restrict__ key_weight, float* __restrict__ key_pi, int* __restrict__ blocks_read,
                 int* __restrict__ group_class, int* __restrict__ group_order, unsigned* __restrict__ arrive) {
    pdl_launch_dependents();
    pdl_wait();                           // before any read of an earlier kernel's output (common.cuh)
    const int g = blockIdx.x, lane = threadIdx.x;
    const i64 b = blockIdx.y;
    const int G = H / KVH, C = D / FB;
    // w_c: the FB squares in feature order per head, heads in order (qrms) or their max (qmax).
    // Lane j (and j + 32, ...) sums block j = h * C + c of the group's G * C blocks (head h, block
    // c: the group's q is G * D contiguous elements, block j its elements j * FB ..), its FB loads
    // issued together; lane c then takes the G norms in head order. (One lane a block looping over
    // the heads, each load waiting on the last, took ~3 us of a ~12 us kernel, H200.)
    __shared__ double norms[SC_MAX_G * SC_KEY_MAX_BLOCKS];
    __shared__ double sorted[SC_KEY_MAX_BLOCKS];          // key_one_draw_lam's weights, descending
    double w = 0.0;
    if (rule != 0) {
        const T* qg = q + (b * H + (i64)g * G) * D;
        for (int j = lane; j < G * C; j += 32) {
            float x[32];
#pragma unroll
            for (int i = 0; i < 32; ++i) x[i] = i < FB ? to_float(qg[(i64)j * FB + i]) : 0.f;
            double norm = 0.0;
#pragma unroll
            for (int i = 0; i < 32; ++i)
                if (i < FB) norm = __dadd_rn(norm, __dmul_rn((double)x[i], (double)x[i]));
            norms[j] = norm;
        }
        __syncwarp();
        if (lane < C) {
            double heads = 0.0;
            for (int h = 0; h < G; ++h) {
                const double norm = norms[h * C + lane];
                heads = rule == 1 ? fmax(heads, norm) : __dadd_rn(heads, norm);
            }
            w = __dsqrt_rn(heads);
        }
    } else if (lane < C) {
        w = 1.0;
    }
    // lam_hi: every positive block at pi = 1; bisection only where that reads more than the budget
    double wc[SC_KEY_MAX_BLOCKS];                         // every lane: all C weights
#pragma unroll
    for (int c = 0; c < SC_KEY_MAX_BLOCKS; ++c) wc[c] = __shfl_sync(0xffffffffu, w, c);
    double w_min = lane < C && w > 0.0 ? w : SC_INF;
    for (int o = 16; o > 0; o >>= 1) w_min = fmin(w_min, __shfl_xor_sync(0xffffffffu, w_min, o));
    const double lam_hi = w_min == (double)SC_INF ? 0.0 : __ddiv_rn(1.0, w_min);
    double lam = lam_hi;
    if (key_read_fraction(lam_hi, wc, C, R) > budget)     // warp-uniform
        lam = R == 1 ? key_one_draw_lam(w, wc, C, budget, sorted) : key_bisect(lam_hi, wc, C, R, budget);
    const float pi = (float)fmin(1.0, __dmul_rn(lam, w));
    // the draws: group stream, k = (r << 32) | c
    const u64 key = head_key(seed, (u64)step[0], (u64)layer, (u64)b, SC_GROUP_UNIT | (u64)(kv_offset + g));
    int count = 0;
    if (lane < C)
        for (int r = 0; r < R; ++r)
            count += uniform01(key, SC_KEY_SAMPLING_TILE, ((u64)r << 32) | (u64)lane) < pi;
    double weight = 0.0;
    if (count > 0) {
        weight = combine == 0 ? __ddiv_rn(__ddiv_rn((double)count, (double)R), (double)pi)
                              : __ddiv_rn(1.0, __dsub_rn(1.0, key_int_power(__dsub_rn(1.0, (double)pi), R)));
    }
    const i64 at = (b * KVH + g) * C + lane;
    if (lane < C) {
        key_weight[at] = (float)weight;
        key_pi[at] = pi;
    }
    const unsigned read = __ballot_sync(0xffffffffu, lane < C && count > 0);
    if (lane == 0) blocks_read[b * KVH + g] = __popc(read);
    // The score pass's launch order, heaviest group first: a group's class is the number of
    // 32-feature groups holding a read block (which of santa_score_keys_mma's runs it takes, and
    // about its cost); the last warp to arrive sorts the B * KVH groups by class, descending, then
    // by id: group_order[slot] = b * KVH + g, deterministic whichever warp is last.
    const int per = 32 / FB;                              // blocks a 32-feature group holds
    int cls = 0;
    for (int i = 0; i * 32 < D; ++i) cls += ((read >> (i * per)) & ((1u << per) - 1u)) != 0u;
    const int n_groups = (int)(gridDim.x * gridDim.y);
    if (lane == 0) group_class[b * KVH + g] = cls;
    if (!block_arrives_last(arrive, (unsigned)n_groups)) return;
    // A counting sort in two passes over the classes (32 groups a round; the loads of a pass do
    // not wait on each other): the count of each class, then each group's slot.
    constexpr int kClasses = SC_KEY_MAX_BLOCKS / 2 + 1;  // 0 .. D / 32 <= 4
    const unsigned below = (1u << lane) - 1u;
    int start[kClasses];
#pragma unroll
    for (int c = 0; c < kClasses; ++c) start[c] = 0;
#pragma unroll 4
    for (int base = 0; base < n_groups; base += 32) {     // warp-uniform
        const int x = base + lane < n_groups ? __ldcg(group_class + base + lane) : -1;
#pragma unroll
        for (int c = 0; c < kClasses; ++c) start[c] += __popc(__ballot_sync(0xffffffffu, x == c));
    }
    int before = 0;                                       // classes descending: heaviest first
#pragma unroll
    for (int c = kClasses - 1; c >= 0; --c) { const int n = start[c]; start[c] = before; before += n; }
#pragma unroll 4
    for (int base = 0; base < n_groups; base += 32) {
        const int j = base + lane;
        const int x = j < n_groups ? __ldcg(group_class + j) : -1;
#pragma unroll
        for (int c = 0; c < kClasses; ++c) {
            const unsigned m = __ballot_sync(0xffffffffu, x == c);
            if (x == c) group_order[start[c] + __popc(m & below)] = j;
            start[c] += __popc(m);
        }
    }
}

// 3 blocks an SM at least (<= 170 registers): without a bound, ptxas spilled a few bytes at 96
// registers in some instances (bf16 D 64 / 128, BN 64, G 8).
template <typename T, int D, int BN, int G>
__global__ void __launch_bounds__(SC_NTHREADS, 3)
santa_score_keys(const T* __restrict__ q, const T* __restrict__ kb, const int* __restrict__ lengths, float scale,
                 int H, int KVH, i64 L_max, int T_max, int tiles_per_block, int FB,
                 const float* __restrict__ key_weight, float* __restrict__ scores, float4* __restrict__ part_s) {
    pdl_wait();                           // before reading an earlier kernel's output (dependents: at the end)
    static_assert(BN % 32 == 0, "whole passes of 32 rows");
    constexpr int kMaxC = D / 16, kRows = BN / 32;        // rows a thread owns in a unit
    constexpr int kStages = G <= 8 ? 3 : 2;               // units in registers (G 16: the accumulators' room)
    const int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 b = blockIdx.z;
    const int n = seq_len(lengths, b, L_max);
    const int n_tiles = min(T_max, (n + BN - 1) / BN);
    const int t_begin = blockIdx.x * tiles_per_block, t_end = min(t_begin + tiles_per_block, n_tiles);
    if (t_begin >= t_end) return;
    const int C = D / FB;
    const int log2p = FB == 32 ? 2 : 1;                   // 16-byte pieces of a block's row: 2 | 4
    const int per_unit = FB == 32 ? 1 : 2;                // read blocks a unit covers

    __shared__ __align__(16) float qw[D * G];
    __shared__ int read[kMaxC];
    __shared__ int nread;
    __shared__ float s[G * BN];
    __shared__ float m[G], l[G];
    const float* wgt = key_weight + (b * KVH + g) * C;
    if (warp == 0) {                                      // the read blocks, in block order
        const bool r = lane < C && wgt[lane] != 0.f;
        const unsigned mask = __ballot_sync(0xffffffffu, r);
        if (r) read[__popc(mask & ((1u << lane) - 1u))] = lane;
        if (lane == 0) nread = __popc(mask);
    }
    for (int idx = threadIdx.x; idx < G * D; idx += SC_NTHREADS) {   // qw[piece][h][e]
        const int h = idx / D, f = idx % D;
        const float x = to_float(q[(b * H + (i64)g * G + h) * D + f]);
        qw[((f / SC_CHUNK) * G + h) * SC_CHUNK + f % SC_CHUNK] = scale * wgt[f / FB] * x;
    }
    __syncthreads();

    const int nr = nread, units = (nr + per_unit - 1) / per_unit;   // units per tile
    const int total = (t_end - t_begin) * units;
    const int piece = threadIdx.x & 3, rg = threadIdx.x >> 2;
    const int sub = piece >> log2p, within = piece & ((1 << log2p) - 1);   // which block of the unit, its piece
    const BlockedKeyRows<T, D> KB{kb, L_max, KVH, FB};
    // A tile starts a page (BN a multiple of SC_KEY_PAGE_ROWS): this thread's row rg + 32 mm of a
    // tile lies at row_off[mm] from the tile's first row, whichever the tile.
    static_assert(BN % SC_KEY_PAGE_ROWS == 0, "a tile starts a page");
    int row_off[kRows];
#pragma unroll
    for (int mm = 0; mm < kRows; ++mm) row_off[mm] = (int)KB.offset(rg + 32 * mm);
    // The read block this lane's pieces come from in unit v of a tile (-1: the unit has no second block)
    auto block_of = [&](int v) { const int ci = v * per_unit + sub; return ci < nr ? read[ci] : -1; };
    auto load_unit = [&](int u, Chunk<T> (&k)[kRows]) {
        const int t = t_begin + u / units, c = block_of(u % units);
        const i64 row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - row0);
        const T* base = KB.row(b, row0, g) + max(c, 0) * SC_KEY_PAGE_ROWS * FB + within * SC_CHUNK;
#pragma unroll
        for (int mm = 0; mm < kRows; ++mm) {
            if (c >= 0 && rg + 32 * mm < nrows) k[mm].load(base + row_off[mm]);
            else k[mm].zero();
        }
    };

    Chunk<T> st[kStages][kRows];
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i)
        if (i < total) load_unit(i, st[i]);
    int u = 0;
    for (int t = t_begin; t < t_end; ++t) {
        float acc[kRows][G];
#pragma unroll
        for (int mm = 0; mm < kRows; ++mm)
#pragma unroll
            for (int h = 0; h < G; ++h) acc[mm][h] = 0.f;
        for (int v = 0; v < units; ++v, ++u) {
            if (u + kStages - 1 < total) load_unit(u + kStages - 1, st[kStages - 1]);
            const int c = block_of(v);                   // K is zero where c < 0: any qw row will do
            const float* qp = qw + ((max(c, 0) * FB) / SC_CHUNK + within) * G * SC_CHUNK;
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float qh[SC_CHUNK];
                *reinterpret_cast<float4*>(qh) = *reinterpret_cast<const float4*>(qp + h * SC_CHUNK);
                *reinterpret_cast<float4*>(qh + 4) = *reinterpret_cast<const float4*>(qp + h * SC_CHUNK + 4);
#pragma unroll
                for (int mm = 0; mm < kRows; ++mm) {
                    float kf[SC_CHUNK];
                    st[0][mm].to_floats(kf);
#pragma unroll
                    for (int e = 0; e < SC_CHUNK; ++e) acc[mm][h] = fmaf(qh[e], kf[e], acc[mm][h]);
                }
            }
#pragma unroll
            for (int i = 0; i < kStages - 1; ++i)
#pragma unroll
                for (int mm = 0; mm < kRows; ++mm) st[i][mm] = st[i + 1][mm];
        }
        // the 4 lanes of a row hold its partial sums: add them, piece 0 writes the tile's scores
        const i64 row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - row0);
#pragma unroll
        for (int mm = 0; mm < kRows; ++mm) {
            const int j = rg + 32 * mm;
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float sc = acc[mm][h];
                sc += __shfl_xor_sync(0xffffffffu, sc, 1);
                sc += __shfl_xor_sync(0xffffffffu, sc, 2);
                if (piece == 0) s[h * BN + j] = j < nrows ? sc : -SC_INF;
            }
        }
        __syncthreads();
        tile_stats<BN>(m, l, s, G, nrows);
        write_tile_stash<BN>(scores, part_s, s, m, l, G, b * H + (i64)g * G, L_max, row0, nrows, T_max, t);
    }
    pdl_launch_dependents();
}

// The stash and stats of tiles [t_begin, t_end) of one (b, KV head) whose scores are all 0 (no
// key block read): scores[b, h, j] = 0 for the tiles' rows j < n, part_s[b, h, t] = (0, rows of
// tile t, 0, 0) for the G heads from head0. One warp (lane = its lane).
template <int BN>
__device__ __forceinline__ void stash_zero_scores(float* scores, float4* part_s, int n, i64 L_max, int T_max,
                                                  int t_begin, int t_end, i64 head0, int G, int lane) {
    for (int t = t_begin; t < t_end; ++t) {
        const i64 row0 = (i64)t * BN;
        const int nrows = (int)min((i64)BN, n - row0);
        for (int h = 0; h < G; ++h) {
            float* dst = scores + (head0 + h) * L_max + row0;
            for (int j = lane; j < nrows; j += 32) dst[j] = 0.f;
        }
        if (lane < G) part_s[(head0 + lane) * T_max + t] = make_float4(0.f, (float)nrows, 0.f, 0.f);
    }
}

// score_run (santa_score.cu) for a KeyRowsQuery (keys as A's rows, G <= 8): the same stash and
// tile stats from its fragments. Thread (gi, t) holds keys 16 u + gi and 16 u + gi + 8 of each
// 16-key unit u of a tile for heads 2t and 2t + 1 (those < G): it stashes them (the 8 threads of a
// t write 32 contiguous bytes of a head's row) and keeps one OnlineStats a head, combined over
// the 8 threads at the tile's end (OnlineStats::reduce_rows), written by the threads gi = 0.
// mq's products come scaled (KeyRowsQuery::load folds the scale into its block weights).
template <typename T, int D, int BN, int G, typename Run, typename Query, typename KRows>
__device__ __forceinline__ void score_run_key_rows(const Query& mq, const KRows& K, int n, i64 L_max,
                                                   int T_max, int t_begin, int t_end, i64 b, int g, i64 head0,
                                                   float* __restrict__ scores, float4* __restrict__ part_s) {
    const int lane = threadIdx.x & 31, gi = lane >> 2, tq = lane & 3;
    const int h0 = 2 * tq, h1 = 2 * tq + 1;
    const bool own0 = h0 < G, own1 = h1 < G;
    float* stash0 = scores + (head0 + (own0 ? h0 : 0)) * L_max;
    float* stash1 = scores + (head0 + (own1 ? h1 : 0)) * L_max;
    Run kr;
    const i64 first0 = (i64)t_begin * BN;
    kr.start(K, b, first0, min(first0 + BN, (i64)n), g, gi, tq);
    for (int t = t_begin, i = 0; t < t_end; ++t, ++i) {  // warp-uniform trip count
        const i64 row0 = (i64)t * BN, row_end = min(row0 + BN, (i64)n);
        const int nrows = (int)(row_end - row0);
        const bool has_next = t + 1 < t_end;
        const i64 next0 = has_next ? row0 + BN : row0, next_end = has_next ? min(next0 + BN, (i64)n) : row0;
        OnlineStats st0, st1;
        kr.score_tile(mq, i, K, b, row0, row_end, next0, next_end, g, gi, tq,
                      [&](int u, int, const float (&acc)[4]) {
            const int c = 16 * u + gi;                   // this thread's keys c and c + 8 of the tile
            const bool in0 = c < nrows, in1 = c + 8 < nrows;
            const float x0 = in0 ? acc[0] : -SC_INF, x1 = in0 ? acc[1] : -SC_INF;   // scaled: mq's weights
            const float y0 = in1 ? acc[2] : -SC_INF, y1 = in1 ? acc[3] : -SC_INF;
            float* d0 = stash0 + row0 + c;
            float* d1 = stash1 + row0 + c;
            if (own0 && in0) d0[0] = x0;
            if (own0 && in1) d0[8] = y0;
            if (own1 && in0) d1[0] = x1;
            if (own1 && in1) d1[8] = y1;
            st0.push2_log2(x0, y0);
            st1.push2_log2(x1, y1);
        });
        st0.reduce_rows();
        st1.reduce_rows();
        if (gi == 0) {
            if (own0) part_s[(head0 + h0) * T_max + t] = make_float4(st0.m, st0.l, 0.f, 0.f);
            if (own1) part_s[(head0 + h1) * T_max + t] = make_float4(st1.m, st1.l, 0.f, 0.f);
        }
    }
}

// santa_score_keys_mma's run over the NG read groups of `groups` (bits: 32-feature groups).
template <typename T, int D, int BN, int G, int NG>
__device__ __forceinline__ void score_compact(const T* q, const float* wgt, u32 groups, const T* kb, i64 L_max,
                                              int KVH, int FB, int n, float scale, int T_max, int t_begin, int t_end,
                                              i64 b, int g, i64 head0, float* scores, float4* part_s) {
    const int lane = threadIdx.x & 31, tq = lane & 3;
    int gid[NG];
#pragma unroll
    for (int k = 0; k < NG; ++k) {
        gid[k] = __ffs(groups) - 1;
        groups &= groups - 1u;
    }
    static_assert(16 * CompactSpan<D, BN, NG>::value <= SC_KEY_PAGE_ROWS, "a compact step lies in one page");
    CompactKeyRows<T, D, NG> K;
    K.init(kb, L_max, KVH, FB, b, g, tq);
#pragma unroll
    for (int k = 0; k < NG; ++k) K.goff[k] = gid[k] * 32 * SC_KEY_PAGE_ROWS;
    if constexpr (G <= 8) {                              // keys as A's rows
        KeyRowsQuery<T, D, G, NG> mq;
        mq.load(q, head0, lane >> 2, tq, wgt, FB, gid, scale);
        K.pieces = mq.read_pieces();
        score_run_key_rows<T, D, BN, G, CompactKeyRun<T, D, BN, NG>>(mq, K, n, L_max, T_max, t_begin, t_end,
                                                                     b, g, head0, scores, part_s);
    } else {
        CompactKeyQuery<T, D, G, NG> mq;
        mq.load(q, head0, lane >> 2, tq, wgt, FB, gid);
        K.pieces = mq.read_pieces();
        score_run<T, D, BN, G, CompactKeyRun<T, D, BN, NG>>(mq, K, n, scale, L_max, T_max, t_begin, t_end, b, g,
                                                            head0, scores, part_s);
    }
}

// santa_score_keys_mma<T, D, BN, G, FB>: santa_score_keys on tensor cores (the production pass; fp16 /
//   bf16, D 64 / 128, G <= 16): santa_score_mma's warp pipeline (KeyRun: K a 16-key step ahead
//   in registers across the run's tiles, scores straight to the stash and into online stats) on
//   the blocked K, reading only the pieces of read blocks (SampledKeyRows) and adding each read
//   block's product with its weight. G <= 8: the keys as the products' rows (KeyRowsQuery,
//   score_run_key_rows: half the products of heads as rows; the kernel alone at B=16 32k, FB 32,
//   H100: 402.2 -> 392.3 us reading all of K, 122.5 -> 119.1 a quarter); G > 8: the heads as rows
//   (KeyWeightedQuery, CompactKeyQuery, score_run). Grid (ceil(T_max / (4 c)), KVH, B), block
//   SC_NTHREADS, c = tiles_per_block here meaning tiles a warp: warp w of block x takes the run
//   [(4 x + w) c, (4 x + w + 1) c) of (b, g)'s tiles, (b, g) = group_order[y + KVH z] (heaviest
//   first: a quarter of K at B=16 32k, uniform rule, FB 32, took 129.6 us with the groups in id
//   order and 106.5 heaviest first, H200). Writes what santa_score_keys writes; no shared memory, no block-level
//   sync.
//   4 blocks an SM up to G 8 (128 registers; G >= 9 took 142-156 before any cap): with its
//   full-width path's steps rolled (mma.cuh KeyRun) ptxas wanted 141 at G 4 and 3 blocks an SM,
//   which measured 2-14% slower than the unrolled kernel; capped, it spills 40-52 bytes and
//   measured faster where blocks go unread (B=16 32k, FB 32: K pass at half / a quarter of K
//   186.3 -> 175.9 / 125.0 -> 114.8 us), 1% slower reading all of K (289.8 -> 293.0).
//   FB, the key block (16 or 32), is a template constant, so its branches fold away: static SASS
//   (sm_90, bf16 D 128 G 4) with FB an argument instead was 5280 instructions and spilled 56
//   bytes, against 3848 and none at FB 32 (a full-width step pair 580 -> 432, a tile of the
//   one-group run 1067 -> 851, of the two-group run 1769 -> 1128); on the H100 the pass took 3%
//   less at every fraction of K (B=16 32k, FB 32: 400.6 -> 388.3 us reading all of K, 128.1 ->
//   125.1 a quarter). The scale rides in the key-rows weights and the online stats take
//   e^(s - m) as one FFMA and ex2 (push2_log2): 432 -> 404, 851 -> 799, 1128 -> 1086, nothing
//   measurable on the H100 (interleaved, within 0.5 us), aimed at the H200's light classes.
template <typename T, int D, int BN, int G, int FB>
__global__ void __launch_bounds__(SC_NTHREADS, G <= 8 ? 4 : 1)
santa_score_keys_mma(const T* __restrict__ q, const T* __restrict__ kb, const int* __restrict__ lengths, float scale,
                     int H, int KVH, i64 L_max, int T_max, int tiles_per_block,
                     const float* __restrict__ key_weight, const int* __restrict__ group_order,
                     float* __restrict__ scores, float4* __restrict__ part_s) {
    pdl_wait();                           // before reading an earlier kernel's output (dependents: at the end)
    static_assert(D == 64 || D == 128, "mma key scores: head_dim 64 or 128");
    static_assert(FB == 16 || FB == 32, "key block: 16 or 32 features");
    static_assert(G >= 1 && G <= 16, "mma key scores: one m16 tile of heads");
    // The blocks of (y, z) slot s = y + KVH z are dispatched in slot order; slot s takes group
    // group_order[s] (santa_key_blocks: heaviest first, so that no heavy group's blocks start last)
    const int grp = group_order[blockIdx.y + (i64)KVH * blockIdx.z];
    const int g = grp % KVH, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const i64 b = grp / KVH;
    const int n = seq_len(lengths, b, L_max);
    const int n_tiles = min(T_max, (n + BN - 1) / BN);
    const int c = tiles_per_block;
    const int t_begin = (blockIdx.x * (SC_NTHREADS / 32) + warp) * c, t_end = min(t_begin + c, n_tiles);
    if (t_begin >= t_end) return;                        // whole warp
    const i64 head0 = b * H + (i64)g * G;
    const int tq = lane & 3;
    const float* wgt = key_weight + (b * KVH + g) * (D / FB);
    u32 groups = 0u;                                     // the 32-feature groups holding a read block
#pragma unroll
    for (int i = 0; i < D / 32; ++i)
        if (FB == 32 ? wgt[i] != 0.f : (wgt[2 * i] != 0.f || wgt[2 * i + 1] != 0.f)) groups |= 1u << i;
    const int ng = __popc(groups);
    // No block read: every score is exactly 0 (what the weighted product of no block gives), so
    // each tile's stash is zeros and its stats (m, l) = (0, rows), as the online stats would
    // sum them (exact integers); no K and no tensor-core work. A quarter of K read by the uniform
    // rule at FB 32 leaves a third of the groups here: through the full-width run below they
    // took longer than the groups that read one block (H200, B=16 32k).
    if (ng == 0) {
        stash_zero_scores<BN>(scores, part_s, n, L_max, T_max, t_begin, t_end, head0, G, lane);
        pdl_launch_dependents();
        return;
    }
    // Few groups read: their compact slices, SPAN steps in flight (CompactKeyRun). D 128: 1 or 2 of
    // 4 groups; D 64: 1 of 2.
    if (ng == 1) {
        score_compact<T, D, BN, G, 1>(q, wgt, groups, kb, L_max, KVH, FB, n, scale, T_max, t_begin, t_end, b, g,
                                      head0, scores, part_s);
        pdl_launch_dependents();
        return;
    }
    if constexpr (D == 128) {
        if (ng == 2) {
            score_compact<T, D, BN, G, 2>(q, wgt, groups, kb, L_max, KVH, FB, n, scale, T_max, t_begin, t_end, b, g,
                                          head0, scores, part_s);
            pdl_launch_dependents();
            return;
        }
    }
    SampledKeyRows<T, D> K;
    K.init(kb, L_max, KVH, FB, b, g, tq);
    if constexpr (G <= 8) {                              // keys as A's rows, every feature group in order
        constexpr int NG = D / 32;
        int gid[NG];
#pragma unroll
        for (int k = 0; k < NG; ++k) gid[k] = k;
        KeyRowsQuery<T, D, G, NG> mq;
        mq.load(q, head0, lane >> 2, tq, wgt, FB, gid, scale);
        K.pieces = mq.read_pieces();
        score_run_key_rows<T, D, BN, G, KeyRun<T, D, BN>>(mq, K, n, L_max, T_max, t_begin, t_end, b, g, head0,
                                                          scores, part_s);
    } else {
        KeyWeightedQuery<T, D, G> mq;
        mq.load(q, head0, lane >> 2, tq);
        mq.load_weights(wgt, FB, tq);
        K.pieces = mq.read_pieces(tq);
        score_run<T, D, BN, G, KeyRun<T, D, BN>>(mq, K, n, scale, L_max, T_max, t_begin, t_end, b, g, head0, scores,
                                               part_s);
    }
    pdl_launch_dependents();
}

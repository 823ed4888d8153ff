// sample_tokens.cu — the next token of every sequence from its logits, on the device, inside the
// decoder's captured step: one int32 a sequence is all that goes back to the host.
//
// The algorithm is llama_min/sampling.py's (its NumPy reference, sample_reference, chooses the
// same token bit for bit given the same logits, parameters, seed and step; that module's docstring
// is the contract). In short, for the logits l [V] of sequence b:
//   l_i <- l_i / penalty (l_i > 0) or l_i * penalty (l_i <= 0) where seen[b, i] (repetition penalty)
//   greedy: the argmax of l (ties: the lowest index).
//   else    z_i = l_i * inv_t (float32, rounded), order: z descending, then index ascending (key());
//           w_i = floor(exp32(z_i - z_max) * 2^40) (exp32: the polynomial exp below, every product
//           and sum rounded as NumPy float32 rounds them, so the weights are bit-identical), an
//           integer: every sum below is exact and independent of the order of the additions;
//           top_k: the first top_k elements in that order; top_p: the shortest prefix of those
//           whose weight reaches ceil(W * q / 2^32), W their total, q = top_p in 32-bit fixed point;
//           the token: the first kept index (ascending) whose running kept weight exceeds
//           floor(W_kept * r / 2^32), r the 32-bit uniform of (seed, step, b).
// No sort: the k-th element and the top-p cutoff are found by radix selection over the order key
// (4 passes of 8 bits, a 256-bin block histogram of counts or weights each), ties at the cutoff by a
// second selection over the index (3 passes, only when the tie is split), the token by one pass of
// per-thread chunk sums and a block scan.
// grid (B), block SC_SAMPLE_THREADS: one block per sequence, V up to 2^24 - 1.
#include "common.cuh"

#define SC_SAMPLE_THREADS 1024
#define SC_SAMPLE_BINS 256
#define SC_SAMPLE_WARPS (SC_SAMPLE_THREADS / 32)
#define SC_TOKEN_LAYER 0xFFFFFFFFull      // the layer field of the token-sampling RNG stream
#define SC_TOKEN_TILE 0xFFFFFFFDull       // its tile field (attention: tiles < 0xFFFFFFFD)
#define SC_WEIGHT_ONE (1ull << 40)        // the weight of z_max
#define SC_ALL_INDICES 0xFFFFFFFFu

// Total order of float32 values as unsigned keys (-0 taken as +0): larger value, larger key.
__device__ __forceinline__ u32 sample_key(float z) {
    const u32 b = __float_as_uint(__fadd_rn(z, 0.0f));
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7FFFFFFFu) : ~k);
}

// floor(exp(z - zmax) * 2^40): 0 below z - zmax = -80, 2^40 at zmax. exp by Cody-Waite reduction
// x = n ln2 + r (n = rint(x log2 e), ln2 = hi + lo, n * hi exact) and a degree-7 Taylor polynomial
// in r (|r| <= 0.35), each operation rounded on its own (no FMA).
__device__ __forceinline__ u64 sample_weight(float z, float zmax) {
    if (z == zmax) return SC_WEIGHT_ONE;
    const float x = __fsub_rn(z, zmax);
    if (!(x >= -80.0f)) return 0ull;
    const float n = rintf(__fmul_rn(x, __uint_as_float(0x3fb8aa3bu)));          // log2(e)
    float r = __fsub_rn(x, __fmul_rn(n, __uint_as_float(0x3f317200u)));        // ln2 hi
    r = __fsub_rn(r, __fmul_rn(n, __uint_as_float(0x35bfbe8eu)));             // ln2 lo
    float p = __uint_as_float(0x39500d01u);                                   // 1/7!
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3ab60b61u));             // 1/6!
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088889u));             // 1/5!
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aaaabu));             // 1/4!
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaabu));             // 1/3!
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    const float scale = __int_as_float(((int)n + 127 + 40) << 23);            // 2^(n + 40), n in [-116, 0]
    return __float2ull_rz(__fmul_rn(p, scale));
}

// floor(a * b / 2^32) for a < 2^63, b <= 2^32 (the product needs 96 bits); ceil with round_up.
__device__ __forceinline__ u64 mul_shift32(u64 a, u64 b, bool round_up) {
    const u64 lo = a * b, hi = __umul64hi(a, b);
    return ((hi << 32) | (lo >> 32)) + (round_up && (lo & 0xFFFFFFFFull) ? 1ull : 0ull);
}

__device__ __forceinline__ u64 warp_max_u64(u64 v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    return v;
}

__device__ __forceinline__ u64 warp_inclusive_scan_u64(u64 v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const u64 w = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += w;
    }
    return v;
}

// The block's maximum of v (every thread gets it). scratch: SC_SAMPLE_WARPS u64 in shared memory.
__device__ u64 block_max_u64(u64 v, u64* scratch) {
    v = warp_max_u64(v);
    __syncthreads();                                      // scratch free (earlier uses done)
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    v = threadIdx.x < 32 ? scratch[threadIdx.x] : 0ull;   // SC_SAMPLE_WARPS == 32
    if (threadIdx.x < 32) v = warp_max_u64(v);
    if (threadIdx.x == 0) scratch[0] = v;
    __syncthreads();
    return scratch[0];
}

// Exclusive prefix of v over the block in thread order; *total gets the sum (every thread).
__device__ u64 block_exclusive_scan_u64(u64 v, u64* scratch, u64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u64 inc = warp_inclusive_scan_u64(v);
    __syncthreads();
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        const u64 s = warp_inclusive_scan_u64(scratch[lane]);
        scratch[lane] = s;                                // inclusive prefix of the warp sums
    }
    __syncthreads();
    *total = scratch[SC_SAMPLE_WARPS - 1];
    return inc - v + (warp ? scratch[warp - 1] : 0ull);
}

// Shared state of one block's selection passes.
struct SampleShared {
    u64 hist[SC_SAMPLE_BINS];
    u64 scratch[SC_SAMPLE_WARPS];
    u64 base;            // weight of the elements ranked before the current digit range
    u64 digit_weight;    // weight in the chosen digit
    u32 digit;
    int token;
};

// Warp 0: the chosen digit of a selection pass. Bins in rank order (descending digits for the order
// key, ascending for the index): the first bin d at which base + (weight of the bins before d and of
// d) reaches need; base grows by the weight of the bins before d.
__device__ void choose_digit(SampleShared& s, u64 need, bool descending) {
    if (threadIdx.x >= 32) return;
    const int lane = threadIdx.x;
    u64 mine[8], sum = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int bin = descending ? 255 - (8 * lane + j) : 8 * lane + j;
        mine[j] = s.hist[bin];
        sum += mine[j];
    }
    const u64 inc = warp_inclusive_scan_u64(sum);
    const u64 base = s.base;
    const u32 hit = __ballot_sync(0xffffffffu, base + inc >= need);
    const int first = hit ? __ffs(hit) - 1 : 31;         // (no hit: only for NaN logits)
    if (lane == first) {
        u64 acc = base + inc - sum;
        int j = 0;
        for (; j < 7; ++j) {
            if (acc + mine[j] >= need) break;
            acc += mine[j];
        }
        s.digit = (u32)(descending ? 255 - (8 * lane + j) : 8 * lane + j);
        s.base = acc;
        s.digit_weight = mine[j];
    }
}

// Adds w to the bin d of the histogram, merging runs of one bin in a thread (the first passes see
// few distinct digits: one atomic per run, not per element).
struct BinRun {
    int bin = -1;
    u64 w = 0;
    __device__ __forceinline__ void add(u64* hist, int d, u64 x) {
        if (d != bin) {
            if (w) atomicAdd(hist + bin, w);
            bin = d;
            w = 0;
        }
        w += x;
    }
    __device__ __forceinline__ void flush(u64* hist) {
        if (w) atomicAdd(hist + bin, w);
    }
};

__device__ __forceinline__ void clear_hist(SampleShared& s) {
    for (int i = threadIdx.x; i < SC_SAMPLE_BINS; i += SC_SAMPLE_THREADS) s.hist[i] = 0ull;
    if (threadIdx.x == 0) s.base = 0ull;
}

// The cutoff (K, I) of the prefix, in the order (key descending, index ascending), of the elements
// kept by (K0, I0) whose weight reaches need: kept(i) = key > K || (key == K && i <= I).
// weight(i, key): an element's weight (1: a count); need <= the kept elements' total.
template <typename KeyF, typename WeightF>
__device__ void select_cutoff(SampleShared& s, int V, u32 K0, u32 I0, u64 need, KeyF key_of, WeightF weight,
                              u32* K_out, u32* I_out) {
    u32 prefix = 0, mask = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {                 // the order key, high digit first
        __syncthreads();
        if (shift == 24) clear_hist(s);
        else for (int i = threadIdx.x; i < SC_SAMPLE_BINS; i += SC_SAMPLE_THREADS) s.hist[i] = 0ull;
        __syncthreads();
        BinRun run;
        for (int i = threadIdx.x; i < V; i += SC_SAMPLE_THREADS) {
            const u32 k = key_of(i);
            if ((k > K0 || (k == K0 && (u32)i <= I0)) && (k & mask) == prefix) {
                const u64 w = weight(k);
                if (w) run.add(s.hist, (int)((k >> shift) & 255u), w);
            }
        }
        run.flush(s.hist);
        __syncthreads();
        choose_digit(s, need, true);
        __syncthreads();
        prefix |= s.digit << shift;
        mask |= 255u << shift;
    }
    const u32 K = prefix;
    const u64 above = s.base, unit = weight(K);                     // ties share one weight
    const u64 ties = unit ? s.digit_weight / unit : 0ull;                 // (unit 0: NaN logits only)
    const u64 take = unit ? (need - above + unit - 1) / unit : 0ull;
    u32 I = (K == K0) ? I0 : SC_ALL_INDICES;
    if (take < ties) {                                              // the tie is split: lowest indices
        __syncthreads();
        clear_hist(s);
        u32 iprefix = 0, imask = 0;
        for (int shift = 16; shift >= 0; shift -= 8) {              // V < 2^24: three index digits
            __syncthreads();
            for (int i = threadIdx.x; i < SC_SAMPLE_BINS; i += SC_SAMPLE_THREADS) s.hist[i] = 0ull;
            __syncthreads();
            BinRun run;
            for (int i = threadIdx.x; i < V; i += SC_SAMPLE_THREADS) {
                if (key_of(i) == K && (u32)i <= I && ((u32)i & imask) == iprefix)
                    run.add(s.hist, (int)(((u32)i >> shift) & 255u), 1ull);
            }
            run.flush(s.hist);
            __syncthreads();
            choose_digit(s, take, false);
            __syncthreads();
            iprefix |= s.digit << shift;
            imask |= 255u << shift;
        }
        I = iprefix;
    }
    __syncthreads();
    *K_out = K;
    *I_out = I;
}

// logits [B, V] (T: float), seen [B, V] uint8 (read where use_seen: the tokens the repetition
// penalty applies to; with mark, the chosen token is marked there), step: the device step counter
// (int64 [1], read once) -> out [B] int32. greedy: argmax; else temperature (inv_t = float32(1 / T)),
// top_k (0 or >= V: off), top_p_q (top_p * 2^32 rounded down, >= 2^32: off).
template <typename T>
__global__ void __launch_bounds__(SC_SAMPLE_THREADS)
sample_tokens(const T* __restrict__ logits, int V, unsigned char* __restrict__ seen, int use_seen, int mark,
              float penalty, const i64* __restrict__ step, u64 seed, int greedy, float inv_t, int top_k,
              u64 top_p_q, int* __restrict__ out) {
    __shared__ SampleShared s;
    const int b = blockIdx.x;
    const T* row = logits + (i64)b * V;
    unsigned char* seen_row = seen + (use_seen ? (i64)b * V : 0);
    pdl_launch_dependents();
    pdl_wait();                                             // the logits come from the step's last product
    auto value = [&](int i) -> float {                      // the penalised logit
        float l = to_float(row[i]);
        if (use_seen && seen_row[i]) l = l > 0.f ? __fdiv_rn(l, penalty) : __fmul_rn(l, penalty);
        return l;
    };
    auto zval = [&](int i) -> float { return greedy ? value(i) : __fmul_rn(value(i), inv_t); };
    auto key_of = [&](int i) -> u32 { return sample_key(zval(i)); };

    // the first element in the order: argmax, ties to the lowest index
    u64 best = 0ull;
    for (int i = threadIdx.x; i < V; i += SC_SAMPLE_THREADS) {
        const u64 c = ((u64)key_of(i) << 32) | (u64)(SC_ALL_INDICES - (u32)i);
        best = c > best ? c : best;
    }
    best = block_max_u64(best, s.scratch);
    int token = (int)(SC_ALL_INDICES - (u32)(best & 0xFFFFFFFFull));
    if (!greedy) {
        const float zmax = zval(token);
        auto weight = [&](u32 k) -> u64 { return sample_weight(key_value(k), zmax); };
        auto count = [&](u32) -> u64 { return 1ull; };
        u32 K = 0u, I = SC_ALL_INDICES;                             // kept: everything
        if (top_k > 0 && top_k < V) select_cutoff(s, V, 0u, SC_ALL_INDICES, (u64)top_k, key_of, count, &K, &I);
        if (top_p_q < (1ull << 32)) {
            u64 part = 0ull;
            for (int i = threadIdx.x; i < V; i += SC_SAMPLE_THREADS) {
                const u32 k = key_of(i);
                if (k > K || (k == K && (u32)i <= I)) part += weight(k);
            }
            u64 W;
            block_exclusive_scan_u64(part, s.scratch, &W);
            const u64 thr = mul_shift32(W, top_p_q, true);
            select_cutoff(s, V, K, I, thr < 1ull ? 1ull : thr, key_of, weight, &K, &I);
        }
        // the token: per-thread chunks of consecutive indices, their kept weights, a block scan
        const int chunk = (V + SC_SAMPLE_THREADS - 1) / SC_SAMPLE_THREADS;
        const int lo = threadIdx.x * chunk, hi = min(V, lo + chunk);
        u64 part = 0ull;
        for (int i = lo; i < hi; ++i) {
            const u32 k = key_of(i);
            if (k > K || (k == K && (u32)i <= I)) part += weight(k);
        }
        u64 total;
        const u64 before = block_exclusive_scan_u64(part, s.scratch, &total);
        const u64 key = head_key(seed, (u64)step[0], SC_TOKEN_LAYER, (u64)b, 0ull);
        const u64 r = mix64(mix64(key ^ SC_TOKEN_TILE) ^ 0ull) >> 32;
        const u64 target = mul_shift32(total, r, false);           // < total
        if (threadIdx.x == 0) s.token = token;                      // (only if no chunk holds it: NaN logits)
        __syncthreads();
        if (part && before <= target && target < before + part) {
            u64 acc = before;
            for (int i = lo; i < hi; ++i) {
                const u32 k = key_of(i);
                if (k > K || (k == K && (u32)i <= I)) {
                    acc += weight(k);
                    if (acc > target) {
                        s.token = i;
                        break;
                    }
                }
            }
        }
        __syncthreads();
        token = s.token;
    }
    if (threadIdx.x == 0) {
        out[b] = token;
        if (use_seen && mark) seen_row[token] = 1;
    }
}

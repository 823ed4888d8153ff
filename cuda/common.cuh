// common.cuh — shared device code for every santa-cupy kernel (no host code, no includes).
//
// * storage types and 8-element vector loads for float32 / float16 / bfloat16
// * warp reductions and scans
// * the counter-based RNG (bit-identical to santa_cupy/rng.py; see docs/DESIGN.md)
//
// Compiled through NVRTC with no headers at all: half and bfloat16 are handled as raw 16-bit
// patterns with PTX conversions, so the same source builds in CI without a CUDA toolkit.
#pragma once

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef unsigned short u16;

#define SC_INF __int_as_float(0x7f800000)
#define SC_NTHREADS 128          // threads per block of every tile kernel
#define SC_CHUNK 8               // elements of a head_dim row owned by one thread
#define SC_MAX_G 16              // largest GQA group (spec.MAX_G)
#define SC_KEY_PAGE_ROWS 64      // rows a page of the feature-blocked K (key_layout.KEY_PAGE_ROWS)

// ---- storage types -------------------------------------------------------------------------
struct f16_t { u16 bits; };     // IEEE half, stored as bits
struct bf16_t { u16 bits; };    // bfloat16, stored as bits

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(f16_t x) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x.bits)); return f;
}
__device__ __forceinline__ float to_float(bf16_t x) { return __uint_as_float(((u32)x.bits) << 16); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ f16_t from_float<f16_t>(float x) {
    f16_t r; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.bits) : "f"(x)); return r;
}
template <> __device__ __forceinline__ bf16_t from_float<bf16_t>(float x) {
    bf16_t r; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.bits) : "f"(x)); return r;
}

// Eight consecutive elements of a row: 16 bytes for the 16-bit types, 32 bytes for float32.
template <typename T> struct Chunk {
    static constexpr int kWords = sizeof(T) * SC_CHUNK / 16;   // uint4 words per chunk
    uint4 w[kWords];
    __device__ __forceinline__ void load(const T* p) {
        const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
        for (int i = 0; i < kWords; ++i) w[i] = src[i];
    }
    __device__ __forceinline__ void store(T* p) const {
        uint4* dst = reinterpret_cast<uint4*>(p);
#pragma unroll
        for (int i = 0; i < kWords; ++i) dst[i] = w[i];
    }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < kWords; ++i) w[i] = make_uint4(0u, 0u, 0u, 0u);
    }
    __device__ __forceinline__ void to_floats(float* out) const {
        const T* e = reinterpret_cast<const T*>(w);
#pragma unroll
        for (int i = 0; i < SC_CHUNK; ++i) out[i] = to_float(e[i]);
    }
};

// ---- programmatic dependent launch (sm_90) ---------------------------------------------------
// A kernel launched with the programmatic-stream-serialization attribute (kernels.launch, when
// programmatic launch is on) may start while the kernel before it in the stream is still running:
// it can issue loads that do not depend on that kernel (gemv's weight rows) and must call
// pdl_wait() before it reads that kernel's outputs or writes anything. Every thread calls it before
// exiting, so the kernel's completion still implies its predecessor's (a chain stays ordered).
// pdl_launch_dependents() lets the next such kernel be scheduled now instead of at this one's end.
// Most kernels call it first. The score passes (santa_score*, whose successor santa_prefix is tiny
// and at once lets pass 2 in) call it at their end: with it first, pass 2's whole grid sat resident
// through the score pass, and SANTA under PDL took 57.8 us instead of 42.7 plain at B=1 32k (H200,
// llama8b; 115 vs 101 at B=1 128k, 120 vs 105 at B=4 32k, B=16 unchanged); at the end, 41.8.
// santa_tile_warp calls it first only where a santa plan's dense fallback follows it (cuda/santa_tile.cu).
// Reads that may come before the wait in santa_prefix, santa_tile_warp and a santa plan's dense
// fallback (which runs after pass 2): the call's lengths and step, which no kernel of the pipeline
// writes. Their writers came before the score pass in the stream, and the score pass triggers
// only after its own wait, so every kernel before it had completed when a grid launched after
// that trigger starts (a writer after the pipeline waits first).
// Both are no-ops on a plain launch, and compile to nothing before sm_90.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Length of sequence b clamped to [0, L_max]: a bad length can never make a kernel read out of
// bounds (the Python entry points reject such lengths before launching).
__device__ __forceinline__ int seq_len(const int* lengths, i64 b, i64 L_max) {
    const int n = lengths[b];
    return n < 0 ? 0 : (n > L_max ? (int)L_max : n);
}

// ---- the dense kernel's split, balanced over the batch (decode_dense_*, santa_merge) ----------
// Sequence b (clamped length n) gets s = clamp(floor(target * n / N), 1, min(max_splits,
// ceil(n / 16))) splits of rows = 16 * ceil(ceil(n / s) / 16) rows, N = the summed lengths of the
// sequences the dense kernel takes (those shorter than santa_from); an empty sequence gets one
// split (it writes the empty result), one santa takes none. ceil(n / rows) <= s splits hold rows.
// Equal lengths give target / B splits each (the plan's wave-fitted count: target = B * it); a
// long sequence among short ones gets proportionally more blocks, so the grid's blocks (one per
// (sequence, split) pair, in sequence order) carry about equal rows. Computed from the lengths on
// the device by every block that needs it: no host sync, and graphs follow changing lengths.
#define SC_ALL_DENSE 0x7fffffff     // santa_from of a dense plan: every sequence is the dense kernel's

struct DenseSplit {
    int splits, rows;
};

__device__ __forceinline__ i64 dense_rows_total(const int* lengths, int batch, i64 L_max, int santa_from) {
    i64 total = 0;
    for (int i = 0; i < batch; ++i) {
        const int n = seq_len(lengths, i, L_max);
        if (n < santa_from) total += n;
    }
    return total;
}

__device__ __forceinline__ DenseSplit dense_split(int n, i64 total, int target, int max_splits, int santa_from) {
    if (n >= santa_from) return DenseSplit{0, 0};
    if (n == 0) return DenseSplit{1, 16};
    const int cap = min(max_splits, (n + 15) / 16);
    const int s = (int)max((i64)1, min((i64)cap, (i64)target * n / total));
    return DenseSplit{s, ((n + s - 1) / s + 15) / 16 * 16};
}

// ---- runs of tiles, balanced over the batch (santa_score_mma, santa_tile_warp, santa_merge) ----
// The warp kernels give each warp a run of c consecutive tiles of BN rows; a sequence of T_b tiles
// (0 for a dense fallback's: n_b < santa_from) has ceil(T_b / c) runs in ceil(runs / 4) blocks of 4
// warps (an empty santa sequence one block, which writes its empty result). The plan fits
// c_full to a batch of full sequences (B * T_max tiles, kernels.tiles_per_warp); the call takes
// c = clamp(ceil(c_full * tiles / (B * T_max)), 1, c_full) for the tiles it holds, so that fewer or
// shorter sequences get shorter runs rather than fewer warps, and a long sequence among short
// ones gets as many warps as its tiles ask for. Blocks are numbered over the sequences in order;
// there are at most ceil(B * T_max / (4 c_full)) + B of them a KV head, and the grid puts the KV
// heads of a block fastest (grid (KVH, blocks), as the dense kernel's (KVH, pairs)): the heads of a
// cache row [.., KVH, D] are read together (with the heads slowest, santa's B=16 32k took 5% longer).
__device__ __forceinline__ int seq_tiles(int n, int BN, int T_max, int santa_from) {
    return n < santa_from ? 0 : min(T_max, (n + BN - 1) / BN);
}

__device__ __forceinline__ int run_tiles(const int* lengths, int batch, i64 L_max, int BN, int T_max, int c_full,
                                         int santa_from) {
    i64 tiles = 0;
    for (int i = 0; i < batch; ++i) tiles += seq_tiles(seq_len(lengths, i, L_max), BN, T_max, santa_from);
    const i64 c = ((i64)c_full * tiles + (i64)batch * T_max - 1) / ((i64)batch * T_max);
    return (int)max((i64)1, min((i64)c_full, c));
}

// Block x of a warp kernel's grid: its sequence b (-1 past the last block), the block's index
// within the sequence and the run length c.
__device__ __forceinline__ void run_block(const int* lengths, int batch, i64 L_max, int BN, int T_max, int c_full,
                                          int santa_from, int x, int* b, int* block, int* c) {
    *c = run_tiles(lengths, batch, L_max, BN, T_max, c_full, santa_from);
    *b = -1;
    for (int i = 0; i < batch; ++i) {
        const int n = seq_len(lengths, i, L_max);
        const int runs = (seq_tiles(n, BN, T_max, santa_from) + *c - 1) / *c;
        const int blocks = n == 0 && n >= santa_from ? 1 : (runs + SC_NTHREADS / 32 - 1) / (SC_NTHREADS / 32);
        if (x < blocks) { *b = i; *block = x; return; }
        x -= blocks;
    }
}

// A santa plan's dense fallback (santa_from < SC_ALL_DENSE) first asks whether any sequence is
// its (one warp-wide read of 32 lengths a round trip, so whole warps must call): where none is,
// which is the common case the plan cannot see from the host, its blocks leave after that one
// round trip instead of the two loops over the lengths of dense_pair (dense_fallback_wait).
__device__ __forceinline__ bool any_dense_sequence(const int* lengths, int batch, i64 L_max, int santa_from) {
    const int lane = threadIdx.x & 31;
    for (int i0 = 0; i0 < batch; i0 += 32) {
        const int i = i0 + lane;
        if (__any_sync(0xffffffffu, i < batch && seq_len(lengths, i, L_max) < santa_from)) return true;
    }
    return false;
}

// pdl_wait() of the dense mma kernels; false when the block has nothing to do. A santa plan's
// dense fallback (santa_from < SC_ALL_DENSE) runs after pass 2, so it asks before the wait whether
// any sequence is its own (lengths: pdl_wait's comment): where none is, its blocks leave as soon
// as pass 2 completes, rather than after a round trip of their own in the pipeline's chain.
// Whole warps (any_dense_sequence).
__device__ __forceinline__ bool dense_fallback_wait(const int* lengths, int batch, i64 L_max, int santa_from) {
    const bool mine = santa_from == SC_ALL_DENSE || any_dense_sequence(lengths, batch, L_max, santa_from);
    pdl_wait();                           // before any read of an earlier kernel's output
    return mine;
}

// The (sequence, split) of pair w of the grid (sequences in order, each its dense_split), or
// b = -1 past the last pair.
__device__ __forceinline__ void dense_pair(const int* lengths, int batch, i64 L_max, int target, int max_splits,
                                           int santa_from, int w, int* b, int* split, int* rows) {
    *b = -1;
    const i64 total = dense_rows_total(lengths, batch, L_max, santa_from);
    for (int i = 0; i < batch; ++i) {
        const DenseSplit sp = dense_split(seq_len(lengths, i, L_max), total, target, max_splits, santa_from);
        if (w < sp.splits) { *b = i; *split = w; *rows = sp.rows; return; }
        w -= sp.splits;
    }
}

// ---- warp helpers --------------------------------------------------------------------------
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
// Sum over groups of `width` consecutive lanes (width a power of two <= 32).
__device__ __forceinline__ float group_sum(float v, int width) {
    for (int o = width >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_inclusive_scan(float v) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        float n = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += n;
    }
    return v;
}
// max that returns NaN when either operand is NaN (fmaxf drops it): online softmax statistics
// use it so that a NaN score makes its tile's exp-sum NaN instead of vanishing.
__device__ __forceinline__ float max_nan(float a, float b) {
    float r;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// ---- counter-based RNG (docs/DESIGN.md, santa_cupy/rng.py) ---------------------------------
#define SC_GLOBAL_TILE 0xFFFFFFFFull

__device__ __forceinline__ u64 mix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// Key of one (seed, step, layer, sequence, query head).
__device__ __forceinline__ u64 head_key(u64 seed, u64 step, u64 layer, u64 b, u64 h) {
    u64 x = mix64(seed ^ 0x9E3779B97F4A7C15ull);
    x = mix64(x ^ step);
    x = mix64(x ^ ((layer << 32) | b));
    return mix64(x ^ (h << 32));
}
// Uniform in [0, 1) with 24 random bits, exactly representable in float32.
__device__ __forceinline__ float uniform01(u64 key, u64 tile, u64 k) {
    const u64 x = mix64(mix64(key ^ tile) ^ k);
    return (float)(u32)(x >> 40) * 5.9604644775390625e-08f;   // 2^-24
}

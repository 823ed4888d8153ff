// mma.cuh — warp-level tensor-core helpers for the 16-bit types (mma.sync.m16n8k16, sm_80+).
//
// Fragment layout of mma.m16n8k16 (PTX ISA, "Matrix fragments for mma.m16n8k16"), with
// gi = lane / 4 (group) and t = lane % 4 (thread in group); each 32-bit register packs two
// 16-bit elements, the lower index in the low half:
//   A (16 x 16, row-major):  a[0] = A[gi][2t, 2t+1]     a[1] = A[gi+8][2t, 2t+1]
//                            a[2] = A[gi][2t+8, 2t+9]   a[3] = A[gi+8][2t+8, 2t+9]
//   B (16 x 8, "col"):       b[0] = B[2t, 2t+1][gi]     b[1] = B[2t+8, 2t+9][gi]
//   C, D (16 x 8, f32):      c[0], c[1] = C[gi][2t, 2t+1]    c[2], c[3] = C[gi+8][2t, 2t+1]
#pragma once

// d = a * b + d for T = f16_t or bf16_t operands, f32 accumulators: one specialisation per type,
// stamped from one body (PTX_TYPE = the operand type's PTX name).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

#define SC_MMA_16816(T, PTX_TYPE)                                                                     \
    template <>                                                                                       \
    __device__ __forceinline__ void mma_16816<T>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {  \
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." PTX_TYPE "." PTX_TYPE ".f32 "          \
                     "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"            \
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                \
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));                \
    }
SC_MMA_16816(bf16_t, "bf16")
SC_MMA_16816(f16_t, "f16")
#undef SC_MMA_16816

// Two floats rounded to T and packed: lo in bits 0..15, hi in bits 16..31.
template <typename T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<bf16_t>(float lo, float hi) {
    u32 r; asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}
template <> __device__ __forceinline__ u32 pack2<f16_t>(float lo, float hi) {
    u32 r; asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r;
}

// The low (half 0) or high (half 1) 16-bit elements of x and y, packed as (x's, y's).
__device__ __forceinline__ u32 pair_halves(u32 x, u32 y, int half) {
    return __byte_perm(x, y, half ? 0x7632 : 0x5410);
}

// An L2 policy for data read once: the L2 evicts its lines first, so a stream of them does not
// push out what is read again soon (the score stash, which pass 2 reads). createpolicy, sm_80+.
__device__ __forceinline__ u64 l2_evict_first_policy() {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// 16 bytes of read-only global memory under an L2 policy, not kept in L1. volatile: it stays
// after pdl_wait() (whose asm is volatile too).
__device__ __forceinline__ uint4 load16_l2_hint(const void* p, u64 policy) {
    uint4 x;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(x.x), "=r"(x.y), "=r"(x.z), "=r"(x.w) : "l"(p), "l"(policy));
    return x;
}

// N 32-bit words of a row as N/4 16-byte loads: quads first, first + stride, first + 2 stride, ...
// of the row (a quad = 16 bytes), or zeros. kHinted: each load under the L2 policy `policy`.
template <int N, bool kHinted = false>
__device__ __forceinline__ void load_quads(u32 (&w)[N], const void* row, int first, int stride, bool valid,
                                           u64 policy = 0ull) {
    static_assert(N % 4 == 0, "whole 16-byte loads");
    const uint4* p = reinterpret_cast<const uint4*>(row) + first;
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        uint4 x;
        if constexpr (kHinted) x = valid ? load16_l2_hint(p + i * stride, policy) : make_uint4(0u, 0u, 0u, 0u);
        else x = valid ? p[i * stride] : make_uint4(0u, 0u, 0u, 0u);
        w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
    }
}

// ---- Q K^T for the G <= 16 query heads of a KV group (decode_dense_mma, santa_score_mma) ------
// Thread (gi, t) holds the slice "quads t, t + 4, t + 8, ..." (D/32 quads of 16 bytes) of its query
// rows gi and gi + 8 (zero past G) and of the keys it loads; k-step ks of the m16n8k16 product
// uses words 2ks and 2ks + 1 of the slice, so the dot products pair the same dims in A and B while
// every load is a 16-byte vector. Interleaving the quads (not [t*D/4, (t+1)*D/4)) makes one load
// instruction of a group's 4 threads read 64 contiguous bytes, two whole 32-byte sectors: no sector
// is requested by two instructions (the contiguous slices doubled the L1 sector requests, ncu).
template <typename T, int D, int G>
struct MmaQuery {
    static constexpr bool kKeyRows = false;  // heads as A's rows (KeyRowsQuery: keys)
    static constexpr bool kHi = G > 8;       // rows 8..15 of the tile hold heads too
    static constexpr int KW = D / 8;         // words of a D/4-element slice
    u32 lo[KW], hi[KW];

    // head0 = b * H + g * G, the flat (b, h) index of the group's first head.
    __device__ __forceinline__ void load(const T* q, i64 head0, int gi, int t) {
        load_quads<KW>(lo, q + (head0 + gi) * D, t, 4, gi < G);
        if (kHi) load_quads<KW>(hi, q + (head0 + gi + 8) * D, t, 4, gi + 8 < G);
        else {
#pragma unroll
            for (int i = 0; i < KW; ++i) hi[i] = 0u;
        }
    }

    // s = unscaled scores of rows (gi, gi + 8) x the 8 keys whose slices the group's threads hold
    // in k (C-fragment layout: s[0..1] row gi, s[2..3] row gi + 8, keys 2t and 2t + 1).
    __device__ __forceinline__ void scores(float (&s)[4], const u32 (&k)[KW]) const {
        s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
            const u32 a[4] = {lo[2 * ks], hi[2 * ks], lo[2 * ks + 1], hi[2 * ks + 1]};
            mma_16816<T>(s, a, k[2 * ks], k[2 * ks + 1]);
        }
    }
};

// Thread t's slice (MmaQuery) of key `key` into registers: zeros where key >= row_end, whose
// address is formed from row step0 and not read. step0 = the first key of the key's 16-key step
// (a multiple of 16, a row that exists) and base = K.row(b, step0, g): one page-table lookup a step
// (CacheRows::step_key).
template <typename T, int D>
__device__ __forceinline__ void load_key_slice(u32 (&w)[D / 8], const CacheRows<T, D>& K, const T* base, i64 b,
                                               i64 step0, i64 key, i64 row_end, int g, int t) {
    load_quads<D / 8>(w, K.step_key(base, b, step0, key < row_end ? key : step0, g), t, 4, key < row_end);
}

// K read once by the score pass (santa_score_mma): CacheRows whose loads carry the L2 policy
// `policy` (l2_evict_first_policy), so that the K stream leaves the L2 to the score stash.
template <typename T, int D>
struct StreamedKeyRows : CacheRows<T, D> {
    u64 policy;
};

template <typename T, int D>
__device__ __forceinline__ void load_key_slice(u32 (&w)[D / 8], const StreamedKeyRows<T, D>& K, const T* base, i64 b,
                                               i64 step0, i64 key, i64 row_end, int g, int t) {
    load_quads<D / 8, true>(w, K.step_key(base, b, step0, key < row_end ? key : step0, g), t, 4, key < row_end,
                            K.policy);
}

// The D / 32 pieces p + i * (32 P) (piece t + 4 i of a row of the feature-blocked K: 32 i features
// on, 32 i / FB blocks of P * FB elements) into w, those with `valid` and bit i of `pieces` set;
// the others are zeros, their bytes never requested.
template <typename T, int D>
__device__ __forceinline__ void load_blocked_pieces(u32 (&w)[D / 8], const T* p, bool valid, u32 pieces) {
    constexpr int stride = 32 * SC_KEY_PAGE_ROWS;
#pragma unroll
    for (int i = 0; i < D / 32; ++i) {
        const bool read = valid && (pieces >> i & 1u);
        const uint4 x = read ? *reinterpret_cast<const uint4*>(p + i * stride) : make_uint4(0u, 0u, 0u, 0u);
        w[4 * i] = x.x; w[4 * i + 1] = x.y; w[4 * i + 2] = x.z; w[4 * i + 3] = x.w;
    }
}

// The same slice of a key of a feature-blocked K (BlockedKeyRows; base = K.row(b, step0, g)).
template <typename T, int D>
__device__ __forceinline__ void load_key_slice(u32 (&w)[D / 8], const BlockedKeyRows<T, D>& K, const T* base, i64 b,
                                               i64 step0, i64 key, i64 row_end, int g, int t) {
    const bool valid = key < row_end;
    load_blocked_pieces<T, D>(w, K.piece(K.step_key(base, b, step0, valid ? key : step0, g), t), valid, ~0u);
}

// The blocked K of one (sequence, KV head) as the key pass reads it (SampledKeyRows,
// CompactKeyRows): the head's row 0 and thread t's piece offset resolved once a run, so that a
// step's addresses are 32-bit row offsets from the step's first row (kStepRows: KeyRun::load_step
// calls load_step_row with the row r < 16 SPAN of the step). Addressing each key in 64 bits from
// (b, key) took ~60 of the full-width pass's ~500 instructions a step (SASS, sm_90).
template <typename T, int D>
struct HeadKeyRows {
    static constexpr bool kStepRows = true;
    static constexpr int P = SC_KEY_PAGE_ROWS;
    const T* head;                           // row 0, feature 0 of (b, g)
    int FB;
    int poff;                                // thread t's piece t from its row's feature 0

    // kb, L_max, KVH, FB as BlockedKeyRows takes them; (b, g) the run's, t the thread's
    __device__ __forceinline__ void init(const T* kb, i64 L_max, int KVH, int key_block, i64 b, int g, int t) {
        const BlockedKeyRows<T, D> K{kb, L_max, KVH, key_block};
        head = K.row(b, 0, g);
        FB = key_block;
        poff = (int)(K.piece(head, t) - head);
    }
    // row j (>= 0) of (b, g): its page, then its place in the page (b, g: the run's)
    __device__ __forceinline__ const T* row(i64, i64 j, int) const {
        const u64 jj = (u64)j;
        return head + (i64)(jj / P) * (D * P) + (int)(jj % P) * FB;
    }
};

// A feature-blocked K of which only some blocks are read (block key sampling, santa_score_keys_mma):
// bit i of `pieces` says whether this thread's piece t + 4 i (features 8 (t + 4 i) .. + 7) lies in
// a read block; the other pieces load as zeros, their bytes never requested.
template <typename T, int D>
struct SampledKeyRows : HeadKeyRows<T, D> {
    u32 pieces;
};

// Thread t's slice of row r of a step (base = K.row(b, step0, g)), or zeros where !valid.
template <typename T, int D>
__device__ __forceinline__ void load_step_row(u32 (&w)[D / 8], const SampledKeyRows<T, D>& K, const T* base, int r,
                                              bool valid) {
    load_blocked_pieces<T, D>(w, base + r * K.FB + K.poff, valid, K.pieces);
}

// The query of block key sampling on tensor cores (santa_score_keys_mma): MmaQuery's slices and
// the group's Horvitz-Thompson weight of each FB-feature block (w[c], 0: not read). The k-steps
// 2i and 2i + 1 of MmaQuery::scores cover features 32 i .. 32 i + 31 (thread t: its piece t + 4 i):
// FB 32 one block, FB 16 two, block 2 i + t / 2 from thread t. scores() adds each read block's
// product on its own (FB 16: the other block's A words zeroed) and weights it in float32, so the
// scores are sum_c w_c (q[c] . k[c]) with the products exact, as the FMA kernel's up to rounding.
// The weights are the group's, so every branch on them is warp-uniform; unread blocks cost no mma.
template <typename T, int D, int G>
struct KeyWeightedQuery : MmaQuery<T, D, G> {
    static constexpr int kMaxC = D / 16;
    float w[kMaxC];
    int FB, half;                            // half = t / 2: which FB-16 block of a group thread t holds

    __device__ __forceinline__ void load_weights(const float* wgt, int key_block, int t) {
        FB = key_block;
        half = t >> 1;
        const int C = D / key_block;
#pragma unroll
        for (int c = 0; c < kMaxC; ++c) w[c] = c < C ? wgt[c] : 0.f;
    }

    // this thread's pieces t + 4 i that lie in a read block (SampledKeyRows::pieces)
    __device__ __forceinline__ u32 read_pieces(int t) const {
        u32 bits = 0u;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
            const int c = (SC_CHUNK * (t + 4 * i)) / FB;
            if (weight(c) != 0.f) bits |= 1u << i;
        }
        return bits;
    }

    __device__ __forceinline__ float weight(int c) const {
        float x = 0.f;
#pragma unroll
        for (int i = 0; i < kMaxC; ++i) x = i == c ? w[i] : x;
        return x;
    }

    __device__ __forceinline__ void scores(float (&s)[4], const u32 (&k)[D / 8]) const {
        s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
        for (int i = 0; i < D / 32; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float wc = FB == 32 ? w[i] : w[2 * i + h];   // block i (FB 32) or 2 i + h (FB 16)
                if ((FB == 32 && h == 1) || wc == 0.f) continue;     // warp-uniform
                const bool mine = FB == 32 || half == h;             // FB 16: A words of block c only
                float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int ks = 2 * i; ks < 2 * i + 2; ++ks) {
                    const u32 a[4] = {mine ? this->lo[2 * ks] : 0u, mine ? this->hi[2 * ks] : 0u,
                                      mine ? this->lo[2 * ks + 1] : 0u, mine ? this->hi[2 * ks + 1] : 0u};
                    mma_16816<T>(p, a, k[2 * ks], k[2 * ks + 1]);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) s[e] = fmaf(wc, p[e], s[e]);
            }
        }
    }
};

// ---- block key sampling over the read 32-feature groups only (santa_score_keys_mma) ----------
// When only NG of the D / 32 groups of 32 features (MmaQuery's k-step pairs 2 i, 2 i + 1) hold a
// read block, a key's slice shrinks to the 4 NG words of those groups, and the same registers hold
// SPAN = (D / 32) / NG 16-key steps: CompactKeyRun keeps SPAN times the keys (and the same bytes a
// step as a full read) in flight, so the pass's time follows the bytes it reads rather than its
// steps. gid[k] (k < NG) = the groups, in order; warp-uniform (the group's weights).

// The blocked K seen through the read groups: thread t's piece of group gid[k] is SampledKeyRows'
// piece t + 4 gid[k], goff[k] = gid[k] * 32 * P elements past piece t; bit k of `pieces`: that
// piece lies in a read block (FB 16: one of the group's two blocks may be unread).
template <typename T, int D, int NG>
struct CompactKeyRows : HeadKeyRows<T, D> {
    int goff[NG];
    u32 pieces;
};

template <typename T, int D, int NG>
__device__ __forceinline__ void load_step_row(u32 (&w)[4 * NG], const CompactKeyRows<T, D, NG>& K, const T* base,
                                              int r, bool valid) {
    const T* p = base + r * K.FB + K.poff;
#pragma unroll
    for (int k = 0; k < NG; ++k) {
        const bool read = valid && (K.pieces >> k & 1u);
        const uint4 x = read ? *reinterpret_cast<const uint4*>(p + K.goff[k]) : make_uint4(0u, 0u, 0u, 0u);
        w[4 * k] = x.x; w[4 * k + 1] = x.y; w[4 * k + 2] = x.z; w[4 * k + 3] = x.w;
    }
}

// The Horvitz-Thompson weights of the NG 32-feature groups gid[k] a query of block key sampling
// multiplies (CompactKeyQuery, KeyRowsQuery), and which of them thread t's piece lies in.
template <int NG>
struct GroupBlockWeights {
    float w[NG][2];                          // FB 32: [k][0] group gid[k]'s block; FB 16: [k][h] block 2 gid[k] + h
    bool fb32;
    int half;                                // t / 2: which FB-16 block of a group thread t's features lie in

    // wgt = the group's C weights (key_weight[b, g])
    __device__ __forceinline__ void load_weights(const float* wgt, int key_block, int t, const int (&gid)[NG],
                                                 float scale = 1.f) {
        fb32 = key_block == 32;
        half = t >> 1;
#pragma unroll
        for (int k = 0; k < NG; ++k) {
            w[k][0] = (fb32 ? wgt[gid[k]] : wgt[2 * gid[k]]) * scale;
            w[k][1] = fb32 ? 0.f : wgt[2 * gid[k] + 1] * scale;
        }
    }

    // bit k: this thread's piece of group gid[k] lies in a read block (the K rows' `pieces`)
    __device__ __forceinline__ u32 read_pieces() const {
        u32 bits = 0u;
#pragma unroll
        for (int k = 0; k < NG; ++k)
            if ((fb32 || half == 0 ? w[k][0] : w[k][1]) != 0.f) bits |= 1u << k;
        return bits;
    }
};

// KeyWeightedQuery restricted to the groups gid[0..NG): their words and block weights, loaded
// from memory (selecting them from a full query's registers by a runtime group index would put
// those registers in local memory).
template <typename T, int D, int G, int NG>
struct CompactKeyQuery : GroupBlockWeights<NG> {
    using GroupBlockWeights<NG>::w;
    using GroupBlockWeights<NG>::fb32;
    using GroupBlockWeights<NG>::half;
    static constexpr bool kKeyRows = false;
    static constexpr bool kHi = G > 8;
    u32 lo[4 * NG], hi[4 * NG];

    // q [B, H, D], head0 = b * H + g * G; wgt = the group's C weights (key_weight[b, g])
    __device__ __forceinline__ void load(const T* q, i64 head0, int gi, int t, const float* wgt, int key_block,
                                         const int (&gid)[NG]) {
        this->load_weights(wgt, key_block, t, gid);
        const uint4* rlo = reinterpret_cast<const uint4*>(q + (head0 + gi) * D);
        const uint4* rhi = reinterpret_cast<const uint4*>(q + (head0 + gi + 8) * D);
#pragma unroll
        for (int k = 0; k < NG; ++k) {
            const int piece = t + 4 * gid[k];             // thread t's quad of group gid[k] (MmaQuery's)
            const uint4 x = gi < G ? rlo[piece] : make_uint4(0u, 0u, 0u, 0u);
            const uint4 y = kHi && gi + 8 < G ? rhi[piece] : make_uint4(0u, 0u, 0u, 0u);
            lo[4 * k] = x.x; lo[4 * k + 1] = x.y; lo[4 * k + 2] = x.z; lo[4 * k + 3] = x.w;
            hi[4 * k] = y.x; hi[4 * k + 1] = y.y; hi[4 * k + 2] = y.z; hi[4 * k + 3] = y.w;
        }
    }

    // KeyWeightedQuery::scores over the compact slice k (4 NG words)
    __device__ __forceinline__ void scores(float (&s)[4], const u32 (&k)[4 * NG]) const {
        s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float wc = w[g][h];
                if ((fb32 && h == 1) || wc == 0.f) continue;         // warp-uniform
                const bool mine = fb32 || half == h;
                float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int w0 = 4 * g + 2 * e;
                    const u32 a[4] = {mine ? lo[w0] : 0u, mine ? hi[w0] : 0u, mine ? lo[w0 + 1] : 0u,
                                      mine ? hi[w0 + 1] : 0u};
                    mma_16816<T>(p, a, k[w0], k[w0 + 1]);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) s[e] = fmaf(wc, p[e], s[e]);
            }
        }
    }
};

// ---- block key sampling with the keys as A's rows (santa_score_keys_mma, G <= 8) -------------
// m16n8k16 with a step's 16 keys as the rows of A and the group's heads as the columns of B:
// thread (gi, t)'s slices of keys gi and gi + 8 (KeyRun's n-tiles 2p and 2p + 1, as loaded) are
// A's fragment, its words of head gi (MmaQuery's slice) B's column gi, and the product C[key][head]
// leaves thread (gi, t) keys gi and gi + 8 of heads 2t and 2t + 1 (KeyRun::score_step with
// kKeyRows, score_run_key_rows). For G <= 8 heads this takes half the products of the
// heads-as-rows form (MmaQuery: 16 rows of which G hold heads), and no zero rows are rebuilt around
// each product.
// The NG 32-feature groups gid[k] are the ones read (compact runs) or all D / 32 of them (the
// full-width run on SampledKeyRows, whose slice of D / 8 words is groups 0 .. D / 32 - 1 in order).
template <typename T, int D, int G, int NG>
struct KeyRowsQuery : GroupBlockWeights<NG> {
    using GroupBlockWeights<NG>::w;
    using GroupBlockWeights<NG>::fb32;
    using GroupBlockWeights<NG>::half;
    static constexpr bool kKeyRows = true;
    static_assert(G <= 8, "keys as rows: the heads fit one n8 tile");
    u32 qw[4 * NG];                          // head gi's quad t + 4 gid[k] (zeros for gi >= G)

    // q [B, H, D], head0 = b * H + g * G; wgt = the group's C weights (key_weight[b, g]), each
    // times `scale` here, so that scores_rows gives the scaled scores
    __device__ __forceinline__ void load(const T* q, i64 head0, int gi, int t, const float* wgt, int key_block,
                                         const int (&gid)[NG], float scale) {
        this->load_weights(wgt, key_block, t, gid, scale);
        const uint4* row = reinterpret_cast<const uint4*>(q + (head0 + gi) * D);
#pragma unroll
        for (int k = 0; k < NG; ++k) {
            const uint4 x = gi < G ? row[t + 4 * gid[k]] : make_uint4(0u, 0u, 0u, 0u);
            qw[4 * k] = x.x; qw[4 * k + 1] = x.y; qw[4 * k + 2] = x.z; qw[4 * k + 3] = x.w;
        }
    }

    // s = sum over the read blocks c of w_c (q_h[c] . k[c]) for keys gi (k0) and gi + 8 (k1):
    // s[0], s[1] key gi, heads 2t, 2t + 1; s[2], s[3] key gi + 8. FB 16: block 2 gid + h's product
    // takes thread t's B words where t / 2 == h, zeros elsewhere.
    __device__ __forceinline__ void scores_rows(float (&s)[4], const u32 (&k0)[4 * NG], const u32 (&k1)[4 * NG]) const {
        s[0] = s[1] = s[2] = s[3] = 0.f;
#pragma unroll
        for (int g = 0; g < NG; ++g) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float wc = w[g][h];
                if (wc == 0.f) continue;                          // warp-uniform (FB 32: w[g][1] == 0)
                const bool mine = fb32 || half == h;
                float p[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int w0 = 4 * g + 2 * e;
                    const u32 a[4] = {k0[w0], k1[w0], k0[w0 + 1], k1[w0 + 1]};
                    mma_16816<T>(p, a, mine ? qw[w0] : 0u, mine ? qw[w0 + 1] : 0u);
                }
#pragma unroll
                for (int e = 0; e < 4; ++e) s[e] = fmaf(wc, p[e], s[e]);
            }
        }
    }
};

// e^x for the online stats: ex2.approx.ftz of x log2(e), __expf's own MUFU.EX2 without its path
// for results below 2^-126, which cannot change l (OnlineStats::push2).
constexpr float kLog2e = 1.4426950408889634f;
__device__ __forceinline__ float ex2_stats(float x) {   // 2^x (push2_log2 takes its own exponent)
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float exp_stats(float x) { return ex2_stats(x * kLog2e); }

// Online (max, exp-sum) of one thread's scores of one head row (a C-fragment row of
// MmaQuery::scores, or a head column of KeyRowsQuery::scores_rows): after the steps seen so far,
// l = sum exp(s - m). Keys past the sequence are -inf and add nothing; m stays -inf until a real
// key arrives (no -inf - -inf).
// push2 gives what l * e^(m - m_new) + e^(s0 - m_new) + e^(s1 - m_new) computed with __expf gave,
// bit for bit, in fewer instructions (the score passes' per-key work): after a push l >= 1 (the
// max's term is e^0 = 1 exactly), so exp_stats' flushed results add nothing that __expf's would;
// the rescale e^(m - m_new) is taken only where the max grew (or turned NaN): elsewhere it is
// e^0 = 1, and fmaf(l, 1, e0) = l + e0.
struct OnlineStats {
    float m = -SC_INF, l = 0.f;
    float mk = -SC_INF;                      // m log2(e) (push2_log2)
    __device__ __forceinline__ void push2(float s0, float s1) {
        const float m_new = max_nan(m, max_nan(s0, s1));   // a NaN score makes l NaN (santa_score_mma)
        if (m_new == -SC_INF) return;
        float r = 1.f;
        if (!(m_new <= m)) {                                // a new max, or NaN
            r = exp_stats(m - m_new);
            m = m_new;
        }
        l = fmaf(l, r, exp_stats(s0 - m)) + exp_stats(s1 - m);
    }
    // push2 with each e^(s - m) as 2^(s log2(e) - mk), mk = m log2(e) kept beside m: one FFMA a
    // score instead of push2's FADD and FMUL (santa_score_keys_mma's per-key work), the same l up
    // to rounding (mk's own, ~|m| 2^-24). The reduce_* functions leave mk stale: no push after them.
    __device__ __forceinline__ void push2_log2(float s0, float s1) {
        const float m_new = max_nan(m, max_nan(s0, s1));
        if (m_new == -SC_INF) return;
        float r = 1.f;
        if (!(m_new <= m)) {
            r = exp_stats(m - m_new);
            m = m_new;
            mk = m * kLog2e;
        }
        l = fmaf(l, r, ex2_stats(fmaf(s0, kLog2e, -mk))) + ex2_stats(fmaf(s1, kLog2e, -mk));
    }
    // Combine with the other 3 threads of the lane's group (lanes 4 gi .. 4 gi + 3).
    __device__ __forceinline__ void reduce_group() { reduce_xor<1, 4>(); }
    // Combine with the lanes of the same t (lanes t, t + 4, .., t + 28: KeyRowsQuery's key rows).
    __device__ __forceinline__ void reduce_rows() { reduce_xor<4, 32>(); }
    // Combine over the lanes lane ^ o for o = kFrom, 2 kFrom, .. < kTo.
    template <int kFrom, int kTo>
    __device__ __forceinline__ void reduce_xor() {
        float m_all = m;
#pragma unroll
        for (int off = kFrom; off < kTo; off <<= 1) m_all = fmaxf(m_all, __shfl_xor_sync(0xffffffffu, m_all, off));
        float l_all = m == -SC_INF ? 0.f : l * __expf(m - m_all);
#pragma unroll
        for (int off = kFrom; off < kTo; off <<= 1) l_all += __shfl_xor_sync(0xffffffffu, l_all, off);
        m = m_all; l = l_all;
    }
};

// ---- Q K^T over a run of consecutive tiles (santa_score_mma) -----------------------------------
// The K slices of the next step are in flight while a step computes: two register buffers and a
// step counter that runs across the run's tiles, so the first step of tile t + 1 loads while the
// last step of tile t computes and the K stream does not stop at tile boundaries.
//   KeyRun<T, D, BN> kr;  kr.start(...first tile...);
//   for each tile i of the run: kr.score_tile(mq, i, rows of tile i, rows of tile i + 1 or an
//                                              empty range, ..., f)
// f(st, j, s) receives the unscaled scores s (C-fragment layout, MmaQuery::scores) of keys
// row0 + 16 st + 8 j + [0, 8) of the tile, in step order; with a Query of kKeyRows
// (KeyRowsQuery), f(st, 0, s) those of keys row0 + 16 st + [0, 16) (KeyRowsQuery::scores_rows). A step is SPAN 16-key steps (2 SPAN
// n-tiles of 8 keys) of W-word slices: KeyRun's own (SPAN 1, the full D / 8 words), or
// CompactKeyRun's (the 4 NG words of NG read feature groups, SPAN more keys in the same registers).
// An even number of steps a tile keeps the buffer index k & 1 a compile-time st & 1 (a runtime one
// would put kbuf in local memory). KRows: CacheRows, SampledKeyRows or CompactKeyRows (their
// load_key_slice); Query: MmaQuery, KeyWeightedQuery or CompactKeyQuery (their scores(s, k)).
template <typename T, int D, int BN, int SPAN = 1, int W = D / 8>
struct KeyRun {
    static constexpr int NT = 2 * SPAN, KS = 16 * SPAN, NSTEP = BN / KS;
    static_assert(NSTEP * KS == BN && NSTEP % 2 == 0, "an even number of whole steps a tile");
    u32 kbuf[2][NT][W];                      // [buffer][n-tile][words]: step k in buffer k & 1

    // Step 0 of the run's first tile (rows [row0, row_end)).
    template <typename KRows>
    __device__ __forceinline__ void start(const KRows& K, i64 b, i64 row0, i64 row_end, int g, int gi, int tq) {
        load_step(kbuf[0], K, b, row0, row0, row_end, g, gi, tq);
    }

    // Step keys [key0, key0 + KS) (those < key_end) into buf; step0: a row of the sequence the step
    // may address, and the step's one page-table lookup, so a step must lie in one page
    // (santa_score_mma's instance per SPAN, kernels.score_span; a base per 16-key piece instead
    // cost 40% more instructions and 4-8% of the pass, H200).
    template <typename KRows>
    __device__ __forceinline__ void load_step(u32 (&buf)[NT][W], const KRows& K, i64 b, i64 key0, i64 step0,
                                              i64 key_end, int g, int gi, int tq) {
        const T* base = K.row(b, step0, g);
        if constexpr (KRows::kStepRows) {
            // rows of the step that exist (step0 == key0 where any does)
            const int lim = key0 < key_end ? (int)min(key_end - key0, (i64)KS) : 0;
#pragma unroll
            for (int j = 0; j < NT; ++j) load_step_row(buf[j], K, base, 8 * j + gi, 8 * j + gi < lim);
        } else {
#pragma unroll
            for (int j = 0; j < NT; ++j)
                load_key_slice(buf[j], K, base, b, step0, key0 + 8 * j + gi, key_end, g, tq);
        }
    }

    // Tile `index` of the run (rows [row0, row_end)); [next0, next_end) = the next tile of the run,
    // or an empty range (next_end == next0) after the last, whose loads then read nothing.
    // Steps go in pairs (buffer 0, then 1: the step counter is even at a tile's start). A tile of
    // more than 4 steps (SPAN 1: the key pass's full-width path, the paged score pass) rolls its
    // pairs, so its code is one pair's, not NSTEP steps': unrolled, santa_score_keys_mma's four
    // paths were 144 KB of SASS, and at a quarter of K a quarter of its stall samples were
    // instruction fetch (no_inst, Nsight Compute, H200). Rolled, SANTA on 16-row pages (the
    // score pass's SPAN 1 instance) took 380.2 instead of 401.1 us at B=16 32k.
    template <typename Query, typename KRows, typename F>
    __device__ __forceinline__ void score_tile(const Query& mq, int index, const KRows& K, i64 b, i64 row0,
                                               i64 row_end, i64 next0, i64 next_end, int g, int gi, int tq, F&& f) {
        (void)index;
        if constexpr (NSTEP > 4) {
#pragma unroll 1
            for (int st = 0; st < NSTEP; st += 2) {
                score_step<0>(mq, st, K, b, row0, row_end, next0, next_end, g, gi, tq, f);
                score_step<1>(mq, st + 1, K, b, row0, row_end, next0, next_end, g, gi, tq, f);
            }
        } else {
#pragma unroll
            for (int st = 0; st < NSTEP; st += 2) {
                score_step<0>(mq, st, K, b, row0, row_end, next0, next_end, g, gi, tq, f);
                score_step<1>(mq, st + 1, K, b, row0, row_end, next0, next_end, g, gi, tq, f);
            }
        }
    }

    // Step st of the tile from buffer CUR while step st + 1 (after the last: the next tile's first)
    // loads into the other.
    template <int CUR, typename Query, typename KRows, typename F>
    __device__ __forceinline__ void score_step(const Query& mq, int st, const KRows& K, i64 b, i64 row0,
                                               i64 row_end, i64 next0, i64 next_end, int g, int gi, int tq, F& f) {
        const bool last = st + 1 == NSTEP;
        const i64 key0 = last ? next0 : row0 + KS * (st + 1), key_end = last ? next_end : row_end;
        const i64 step0 = key0 < key_end ? key0 : (last ? next0 : row0);   // a row the step may read
        load_step(kbuf[CUR ^ 1], K, b, key0, step0, key_end, g, gi, tq);
        if constexpr (Query::kKeyRows) {
#pragma unroll
            for (int p = 0; p < SPAN; ++p) {             // 16 keys: the n-tiles 2p (keys gi) and 2p + 1 (gi + 8)
                float s[4];
                mq.scores_rows(s, kbuf[CUR][2 * p], kbuf[CUR][2 * p + 1]);
                f(SPAN * st + p, 0, s);
            }
        } else {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                float s[4];
                mq.scores(s, kbuf[CUR][j]);
                f(SPAN * st + (j >> 1), j & 1, s);
            }
        }
    }
};

// The compact run of NG read feature groups: SPAN = the 16-key steps KeyRun's registers hold
// ((D / 32) / NG), at most half a tile.
template <int D, int BN, int NG>
struct CompactSpan {
    static constexpr int value = (D / 32) / NG < BN / 32 ? (D / 32) / NG : BN / 32;
};

template <typename T, int D, int BN, int NG>
using CompactKeyRun = KeyRun<T, D, BN, CompactSpan<D, BN, NG>::value, 4 * NG>;


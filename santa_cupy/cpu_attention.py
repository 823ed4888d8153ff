"""Fast float32 NumPy SANTA decode attention: the CPU decoder's path (llama_min on NumPy).

The same estimator as santa_cupy.reference (docs/DESIGN.md, "Sampling contract"): the same
counter-based RNG (santa_cupy.rng), the same float32 tile statistics, float64 global prefix and
float32 comb arithmetic, so the sample counts are those of ``reference.counts_from_scores`` given the
same float32 scores. It differs from the reference only where the reference spends float64:

* scores are float32 products (``s = float32(q . K) * float32(scale)``, BLAS sgemm) instead of
  ``float32(float64 scores)``; a score may differ from the reference's by an ulp or so, and a sample
  then lands in the neighbouring row when its comb point lies within that rounding of a row
  boundary (tests/test_cpu_attention.py measures how often: rarely, and only by moving a sample);
* the output is ``o = sum_j coef_t(j) * c_j * V_j`` in float32 over the sampled rows only, with
  ``coef = 1/S`` (global, largest_remainder) or ``w_t / S_t`` (fixed; ``w_t`` the tile's share of
  the softmax mass from the float32 tile statistics, where the reference uses float64 scores).

The float64 reference stays the oracle of the tests; this module is what the decoder runs.

Shapes: B batch, H query heads, KVH KV heads, G = H // KVH, D head dim, L_max cache rows,
n valid rows of a sequence, R rows of scores (heads), T = ceil(n / BN) tiles of BN = block_n rows.
"""

from __future__ import annotations

import numpy as np

from santa_cupy import reference, rng, spec

F32 = np.float32
F64 = np.float64


def as_float32(x):
    """Cache or query array -> float32 (uint16 = bfloat16 bits; float32 without a copy)."""
    if x.dtype == np.uint16:
        return spec.to_float32(x, np)
    return x.astype(F32, copy=False)


def head_scores(q, k, scale):
    """float32 scores [H, n] of one sequence: q [H, D] float32, k [n, KVH, D] float32."""
    H, D = q.shape
    KVH = k.shape[1]
    qg = q.reshape(KVH, H // KVH, D)
    s = np.matmul(qg, k.transpose(1, 2, 0))                # [KVH, G, n]
    s *= F32(scale)
    return s.reshape(H, -1)


def tile_stats(scores, n, block_n):
    """reference.TileStats of float32 scores [R, >= n] (entries >= n ignored), in float32 as the
    reference's: m_t = tile max, e_j = float32(exp(float64(s_j - m_t))), cum = sequential float32
    running sum of e within the tile (constant past the last valid row), l_t = cum at the end."""
    R = scores.shape[0]
    T = reference.num_tiles(n, block_n)
    s = np.full((R, T * block_n), -np.inf, dtype=F32)
    s[:, :n] = scores[:, :n]
    s = s.reshape(R, T, block_n)
    m = s.max(axis=-1)                                      # [R, T]
    e = np.exp(s - m[..., None], dtype=F64, out=s, casting="same_kind")   # exp in float64, rounded once
    # The running sum over axis 0 of the [BN, R*T] layout adds the same terms in the same order as
    # a per-tile scan, but a whole row of tiles at a time (vectorised).
    cum = np.cumsum(e.reshape(R * T, block_n).T, axis=0, dtype=F32).T.reshape(R, T, block_n)
    valid = np.minimum(block_n, n - np.arange(T) * block_n).astype(np.int64)
    return reference.TileStats(m=m, l=cum[..., -1].copy(), cum=cum, valid=valid, n=int(n), block_n=int(block_n))


def tile_budget(prefix, budget, samples, n_rows, n_tiles):
    """Samples per tile S_t [R, T] int64 of the tile-local budgets (fixed, largest_remainder)."""
    if budget == "fixed":
        return np.full((n_rows, n_tiles), reference.fixed_tile_samples(samples, n_tiles), dtype=np.int64)
    return reference.hamilton(prefix.w, samples)


def counts_from_stats(stats, keys, *, samples, sampler, budget):
    """Counts [R, T, BN] float32 (integer valued) and the per-tile weight coef [R, T] float32 of
    the estimate o = sum_j coef_t(j) c_j V_j. keys [R] uint64 (rng.head_key)."""
    R, T, _ = stats.cum.shape
    prefix = reference.global_prefix(stats.m, stats.l)                 # float64 [R, T], no Hamilton
    if budget == "global":
        coef = np.full((R, T), 1.0 / samples, dtype=F32)
        if sampler == "systematic":
            return reference.local_systematic_counts(stats, *reference.global_systematic_comb(prefix, keys, samples),
                                                     dtype=F32), coef
        S_t = None
    else:
        S_t = tile_budget(prefix, budget, samples, R, T)
        coef = (prefix.w / S_t).astype(F32) if budget == "fixed" else np.full((R, T), 1.0 / samples, F32)
        if sampler == "systematic":
            U = rng.uniform(keys[:, None], np.arange(T)[None, :], 0)     # [R, T] float32
            return reference.local_systematic_counts(stats, U, S_t.astype(F32), S_t, dtype=F32), coef
    # iid / stratified: points located in float32 tile CDFs by the reference's own stage (its
    # cost is in the points, O(S) per head, not in the rows).
    c = reference.tile_counts(stats, prefix, keys, samples=samples, sampler=sampler, budget=budget)
    return c.astype(F32), coef


def sequence_counts(scores, keys, n, *, samples, sampler, budget, block_n):
    """Counts [R, n] int32 of float32 scores [R, >= n]: reference.counts_from_scores, fast."""
    c, _ = counts_from_stats(tile_stats(scores, n, block_n), rng.as_u64(keys),
                             samples=samples, sampler=sampler, budget=budget)
    return c.reshape(c.shape[0], -1)[:, :n].astype(np.int32)


def _estimate(counts, coef, v, G, block_n, n):
    """o [H, D] float32 = sum_j coef_t(j) c_j V_j over the rows sampled by any head.

    counts [H, T, BN] float32, coef [H, T] float32, v [n, KVH, D] (cache dtype)."""
    H, T, BN = counts.shape
    w = (counts * coef[..., None]).reshape(H, T * BN)[:, :n]            # [H, n]
    rows = np.flatnonzero(w.any(axis=0))                                 # sampled by some head
    vs = as_float32(v[rows]).transpose(1, 0, 2)                          # [KVH, r, D]
    ws = w[:, rows].reshape(vs.shape[0], G, rows.size)                  # [KVH, G, r]
    return np.matmul(ws, vs).reshape(H, -1)


def santa_attention(q, k_cache, v_cache, lengths, *, samples=256, sampler="systematic", budget="global",
                    seed=0, step=0, layer=0, scale=None, block_n=spec.DEFAULT_BLOCK_N, return_counts=False,
                    head_offset=0):
    """SANTA decode attention in float32 on NumPy arrays.

    q [B, H, D], k_cache/v_cache [B, L_max, KVH, D] (float32, float16 or bfloat16 as uint16),
    lengths [B] ints in 1..L_max. Returns o [B, H, D] float32, or (o, counts [B, H, L_max] int32)
    with ``return_counts``. head_offset: the global index of q's first head (the h of rng.head_key
    for head 0; tensor parallelism, see reference.santa_attention). Inputs are trusted (the decoder's own arrays); public callers go through
    santa_cupy.decode_attention, which validates."""
    B, H, D = q.shape
    L_max, KVH = k_cache.shape[1], k_cache.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    qf = as_float32(q)
    o = np.empty((B, H, D), dtype=F32)
    all_counts = np.zeros((B, H, L_max), dtype=np.int32) if return_counts else None
    for b in range(B):
        n = int(lengths[b])
        s = head_scores(qf[b], as_float32(k_cache[b, :n]), scale)       # [H, n]
        keys = rng.head_key(seed, step, layer, b, head_offset + np.arange(H))
        c, coef = counts_from_stats(tile_stats(s, n, block_n), keys, samples=samples, sampler=sampler,
                                    budget=budget)
        o[b] = _estimate(c, coef, v_cache[b, :n], H // KVH, block_n, n)
        if return_counts:
            all_counts[b, :, :n] = c.reshape(H, -1)[:, :n]
    return (o, all_counts) if return_counts else o

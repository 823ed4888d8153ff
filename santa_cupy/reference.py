"""float64 NumPy reference of every SANTA stage (docs/DESIGN.md, "Sampling contract").

Clarity first, vectorised over a leading "row" axis R (heads, or repeated draws of one head).

Precision choices (the sample counts follow DESIGN.md so that they match the CUDA kernels):

* Outputs ``o``, ``lse`` and the fixed-budget tile weights use float64 scores ``s = scale * q.K``.
* Counts use the float32 pipeline of the GPU: ``s32 = float32(s)``, per tile ``m_t = max s32``,
  ``e_j = float32(exp(float64(s32_j - m_t)))`` (the difference in float32, exp evaluated in float64 and
  rounded once), ``cum_j`` = sequential float32 running sum of ``e`` over the tile, ``l_t = cum_last``.
  Passing the GPU's float32 score stash as ``scores`` reproduces its inputs exactly.
* Global prefix in float64 from those float32 stats: ``W_t = exp(m_t - m*) * l_t``, ``P_t`` = sequential
  running sum of W, ``Z = P_{T-1}``, ``C_t = P_t / Z`` (so C is non-decreasing and ``C_{T-1} == 1.0``
  exactly, and it is still forced to 1.0), ``w_t = C_t - C_{t-1}``.
* Every float32 operation is rounded separately (no fused multiply-add): ``a * cum_j - off`` is a
  float32 product, rounded, then a float32 subtraction, rounded (CUDA: ``__fmul_rn``/``__fsub_rn``).

Shapes: R rows, n valid positions, T = ceil(n / BN) tiles of BN = block_n rows, D head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from santa_cupy import rng, spec

F32 = np.float32
F64 = np.float64


# ------------------------------------------------------------------------------------ inputs


def to_float64(x):
    """NumPy array -> float64; uint16 is bfloat16 bits."""
    if x.dtype == np.uint16:
        return spec.to_float32(x, np).astype(F64)
    return np.asarray(x, dtype=F64)


def head_scores(q, k_cache, lengths, scale=None):
    """Scaled scores [B, H, L_max] float64, -inf at positions >= lengths[b].

    q [B, H, D], k_cache [B, L_max, KVH, D]; head h reads KV head h // G.
    """
    B, H, D = q.shape
    _, L_max, KVH, _ = k_cache.shape
    G = H // KVH
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    qf = to_float64(q).reshape(B, KVH, G, D)
    kf = to_float64(k_cache)
    s = np.einsum("bkgd,blkd->bkgl", qf, kf).reshape(B, H, L_max) * scale
    positions = np.arange(L_max)[None, None, :]
    return np.where(positions < np.asarray(lengths).reshape(B, 1, 1), s, -np.inf)


def num_tiles(n, block_n):
    """Tiles of block_n rows covering n rows (the last one partial)."""
    return -(-int(n) // int(block_n))


def tile_draws(counts, block_n):
    """Points each tile of block_n rows draws: counts [..., L] -> [..., num_tiles(L, block_n)]."""
    L = counts.shape[-1]
    T = num_tiles(L, block_n)
    padded = np.zeros(counts.shape[:-1] + (T * block_n,), counts.dtype)
    padded[..., :L] = counts
    return padded.reshape(counts.shape[:-1] + (T, block_n)).sum(-1)


# --------------------------------------------------------------------------------- stage: tiles


@dataclass(frozen=True)
class TileStats:
    """Per-tile float32 statistics of R rows of scores (the GPU's pass-1 output)."""

    m: np.ndarray  # [R, T] float32   max score of the tile
    l: np.ndarray  # [R, T] float32   sum_j exp(s_j - m_t)  (= cum at the last valid row)
    cum: np.ndarray  # [R, T, BN] float32 running sum of exp(s_j - m_t); constant = l past the end
    valid: np.ndarray  # [T] int64       valid rows per tile (BN except maybe the last)
    n: int
    block_n: int


def tile_stats(scores, n, block_n):
    """Tile stats of scores [R, >= n] (float64 or float32; entries >= n ignored)."""
    scores = np.atleast_2d(scores)
    R = scores.shape[0]
    T = num_tiles(n, block_n)
    s32 = np.full((R, T * block_n), -np.inf, dtype=F32)
    s32[:, :n] = scores[:, :n]
    s32 = s32.reshape(R, T, block_n)
    m = s32.max(axis=-1)  # [R, T]
    diff = s32 - m[..., None]  # float32, -inf in the padding
    e = np.exp(diff.astype(F64)).astype(F32)
    cum = np.cumsum(e, axis=-1, dtype=F32)  # sequential float32 sum
    valid = np.minimum(block_n, n - np.arange(T) * block_n).astype(np.int64)
    return TileStats(m=m, l=cum[..., -1].copy(), cum=cum, valid=valid, n=int(n), block_n=int(block_n))


def stats_from_arrays(m, l, cum, n, block_n):
    """TileStats from externally computed float32 stats (e.g. the GPU's pass 1), to compare counts.

    m, l [R, T]; cum [R, >= n] the per-tile inclusive running sums laid out by row position.
    """
    R = np.shape(m)[0]
    T = num_tiles(n, block_n)
    padded = np.zeros((R, T * block_n), dtype=F32)
    padded[:, :n] = np.asarray(cum, dtype=F32)[:, :n]
    padded = padded.reshape(R, T, block_n)
    valid = np.minimum(block_n, n - np.arange(T) * block_n).astype(np.int64)
    tail = np.arange(block_n)[None, None, :] >= valid[None, :, None]
    last = np.take_along_axis(padded, (valid - 1)[None, :, None].repeat(R, 0), axis=-1)
    padded = np.where(tail, last, padded)  # constant past the end, like tile_stats
    m = np.asarray(m, dtype=F32).reshape(R, T)
    l = np.asarray(l, dtype=F32).reshape(R, T)
    return TileStats(m=m, l=l, cum=padded, valid=valid, n=int(n), block_n=int(block_n))


# -------------------------------------------------------------------------------- stage: prefix


@dataclass(frozen=True)
class Prefix:
    """float64 global prefix over the tiles of each row."""

    m_star: np.ndarray  # [R]    max_t m_t
    W: np.ndarray  # [R, T] exp(m_t - m*) * l_t
    Z: np.ndarray  # [R]    sum_t W_t
    C: np.ndarray  # [R, T] C_t, C[:, -1] == 1.0
    C_prev: np.ndarray  # [R, T] C_{t-1}, C_prev[:, 0] == 0.0
    w: np.ndarray  # [R, T] C_t - C_{t-1}
    S_lr: np.ndarray | None  # [R, T] int64 Hamilton allocation of `samples` (None without samples)


def hamilton(w, samples):
    """Largest-remainder rounding of samples * w [R, T]: floor, then +1 for the largest remainders.

    Ties go to the lower tile index. Rows of the result sum to `samples`.
    """
    R, T = w.shape
    exact = samples * w
    base = np.floor(exact)
    remainder = exact - base
    base = base.astype(np.int64)
    extra = np.clip(samples - base.sum(axis=-1), 0, T)  # [R]
    order = np.argsort(-remainder, axis=-1, kind="stable")  # largest first, lower t on ties
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.arange(T)[None, :].repeat(R, 0), axis=-1)
    return base + (rank < extra[:, None])


def global_prefix(m, l, samples=None):
    """float64 prefix from float32 tile stats m, l [R, T] (see module docstring)."""
    m64 = np.asarray(m, dtype=F64)
    l64 = np.asarray(l, dtype=F64)
    m_star = m64.max(axis=-1)
    W = np.exp(m64 - m_star[:, None]) * l64
    P = np.cumsum(W, axis=-1)  # sequential float64 sum
    Z = P[:, -1].copy()
    C = P / Z[:, None]
    C[:, -1] = 1.0
    C_prev = np.concatenate([np.zeros_like(C[:, :1]), C[:, :-1]], axis=-1)
    w = C - C_prev
    S_lr = None if samples is None else hamilton(w, int(samples))
    return Prefix(m_star=m_star, W=W, Z=Z, C=C, C_prev=C_prev, w=w, S_lr=S_lr)


# ------------------------------------------------------------------------ stage: in-tile sampling


def local_systematic_counts(stats, off, sw, n_points, dtype=np.int32):
    """Counts [R, T, BN] (``dtype``; santa_cupy.cpu_attention takes float32) of a systematic comb
    inside each tile.

    off, sw float32 [R, T]; n_points int [R, T]. N(F) = clamp(ceil(a*cum_j - off), 0, n) with
    a = float32(sw / l_t), every product and difference rounded to float32; row j gets
    N_j - N_{j-1}; N is forced to n at the last valid row. (N <= MAX_SAMPLES is exact in float32.)
    """
    a = (np.asarray(sw, dtype=F32) / stats.l).astype(F32)  # [R, T]
    x = a[..., None] * stats.cum  # float32, rounded
    x -= np.asarray(off, dtype=F32)[..., None]  # float32, rounded
    N = np.ceil(x, out=x)
    top = np.asarray(n_points).astype(F32)
    np.clip(N, F32(0), top[..., None], out=N)
    N[..., -1] = top  # the last row of every tile (full tiles)
    last = int(stats.valid[-1])
    N[:, -1, last - 1:] = top[:, -1, None]  # ... and of the last, partial tile
    return np.diff(N, axis=-1, prepend=F32(0)).astype(dtype, copy=False)


def locate(stats, r, t, y):
    """Row (local index in tile t) of each point: the first j with cum_j > y * l_t (float32
    compare), the last valid row of the tile if none.  r, t int [P]; y float32 [P] in [0, 1)."""
    R, T, BN = stats.cum.shape
    r = np.asarray(r, dtype=np.int64)
    t = np.asarray(t, dtype=np.int64)
    threshold = (np.asarray(y, dtype=F32) * stats.l[r, t]).astype(F32)  # >= +0
    if not np.all(np.diff(stats.cum, axis=-1) >= 0):  # e.g. stats from a parallel scan
        return _locate_brute_force(stats, r, t, threshold)
    # One sorted uint64 array: (segment << 32) | float32 bits (monotone for non-negative floats).
    seg_all = (np.arange(R * T, dtype=np.uint64) << np.uint64(32))[:, None]
    keys = (seg_all | stats.cum.reshape(R * T, BN).view(np.uint32).astype(np.uint64)).ravel()
    seg = (r * T + t).astype(np.uint64)
    query = (seg << np.uint64(32)) | threshold.view(np.uint32).astype(np.uint64)
    j = np.searchsorted(keys, query, side="right").astype(np.int64) - (r * T + t) * BN
    return np.minimum(j, stats.valid[t] - 1)


def _locate_brute_force(stats, r, t, threshold, chunk=1 << 16):
    """locate() without assuming cum is non-decreasing: O(points * BN)."""
    j = np.empty(r.shape, dtype=np.int64)
    for lo in range(0, r.size, chunk):
        sl = slice(lo, lo + chunk)
        above = stats.cum[r[sl], t[sl]] > threshold[sl, None]  # [P, BN]
        j[sl] = np.where(above.any(axis=1), above.argmax(axis=1), stats.block_n)
    return np.minimum(j, stats.valid[t] - 1)


def _counts_from_points(stats, r, t, y):
    """Scatter located points into counts [R, T, BN] int32."""
    R, T, BN = stats.cum.shape
    j = locate(stats, r, t, y)
    flat = (np.asarray(r, dtype=np.int64) * T + t) * BN + j
    return np.bincount(flat, minlength=R * T * BN).reshape(R, T, BN).astype(np.int32)


def global_systematic_comb(prefix, keys, samples):
    """One systematic comb of S points over the global CDF, per tile: (off float32 [R, T], the
    offset of the tile's first point; sw float32 [R, T] = S W_t / Z; n_points [R, T], the points
    in the tile), from the float64 prefix and one uniform per head (keys [R])."""
    S = samples
    U = rng.uniform(keys, spec.GLOBAL_TILE, 0).astype(F64)[:, None]  # [R, 1]
    k0 = np.ceil(S * prefix.C_prev - U)
    n_t = np.ceil(S * prefix.C - U) - k0
    off = (k0 + U - S * prefix.C_prev).astype(F32)
    return off, (S * prefix.w).astype(F32), n_t.astype(np.int64)


def _global_counts(stats, prefix, keys, samples, sampler):
    """budget="global": one comb (or S points) over the global CDF, exactly S samples per row."""
    S = samples
    C, C_prev, w = prefix.C, prefix.C_prev, prefix.w
    if sampler == "systematic":
        return local_systematic_counts(stats, *global_systematic_comb(prefix, keys, S))
    R = keys.shape[0]
    k = np.arange(S, dtype=np.int64)
    U = rng.uniform(keys[:, None], spec.GLOBAL_TILE, k[None, :]).astype(F64)  # [R, S]
    x = (k + U) / S if sampler == "stratified" else U
    t = np.stack([np.searchsorted(C[r], x[r], side="right") for r in range(R)])  # first t: x < C_t
    t = np.minimum(t, C.shape[1] - 1)  # [R, S]; x < 1 = C_{T-1}, so this never clips
    Cp = np.take_along_axis(C_prev, t, axis=-1)
    Ct = np.take_along_axis(C, t, axis=-1)
    wt = np.take_along_axis(w, t, axis=-1)
    owned = (Cp <= x) & (x < Ct)
    if sampler == "stratified":
        owned &= (k >= np.floor(S * Cp)) & (k <= np.minimum(S - 1, np.floor(S * Ct)))
    y = ((x - Cp) / np.where(owned, wt, 1.0)).astype(F32)
    r = np.broadcast_to(np.arange(R)[:, None], x.shape)
    return _counts_from_points(stats, r[owned], t[owned], y[owned])


def _tile_local_counts(stats, keys, S_t, sampler):
    """budget fixed / largest_remainder: S_t [R, T] draws from each tile's own distribution."""
    R, T, _ = stats.cum.shape
    tiles = np.arange(T)
    if sampler == "systematic":
        U = rng.uniform(keys[:, None], tiles[None, :], 0)  # [R, T] float32
        return local_systematic_counts(stats, U, S_t.astype(F32), S_t)
    i = np.arange(max(int(S_t.max()), 1))
    u = rng.uniform(keys[:, None, None], tiles[None, :, None], i[None, None, :])  # [R, T, P] f32
    if sampler == "stratified":
        denom = np.maximum(S_t, 1).astype(F32)[..., None]  # tiles with S_t = 0 draw nothing
        y = ((i.astype(F32) + u).astype(F32) / denom).astype(F32)
    else:
        y = u
    mask = i[None, None, :] < S_t[..., None]
    r, t, _ = np.nonzero(mask)
    return _counts_from_points(stats, r, t, y[mask])


def fixed_tile_samples(samples, n_tiles):
    """budget="fixed": S_t = max(1, S // T) for every tile."""
    return max(1, int(samples) // int(n_tiles))


def tile_counts(stats, prefix, keys, *, samples, sampler, budget):
    """Counts [R, T, BN] int32 for every sampler x budget; keys [R] uint64 from rng.head_key."""
    keys = np.atleast_1d(rng.as_u64(keys))
    samples = int(samples)
    R, T, _ = stats.cum.shape
    if budget == "global":
        return _global_counts(stats, prefix, keys, samples, sampler)
    if budget == "fixed":
        S_t = np.full((R, T), fixed_tile_samples(samples, T), dtype=np.int64)
    elif budget == "largest_remainder":
        S_t = prefix.S_lr if prefix.S_lr is not None else hamilton(prefix.w, samples)
    else:
        raise ValueError(f"budget must be one of {spec.BUDGETS}, got {budget!r}")
    return _tile_local_counts(stats, keys, S_t, sampler)


def counts_from_scores(scores, keys, n, *, samples, sampler, budget, block_n=spec.DEFAULT_BLOCK_N):
    """Counts [R, n] int32 from scores [R, >= n] (float64, or the GPU's float32 stash) and keys [R]."""
    return counts_from_stats(tile_stats(scores, n, block_n), keys, samples=samples, sampler=sampler, budget=budget)


def counts_from_stats(stats, keys, *, samples, sampler, budget):
    """Counts [R, n] int32 from TileStats (tile_stats or stats_from_arrays) and keys [R]."""
    if sampler not in spec.SAMPLERS:
        raise ValueError(f"sampler must be one of {spec.SAMPLERS}, got {sampler!r}")
    prefix = global_prefix(stats.m, stats.l, samples)
    c = tile_counts(stats, prefix, keys, samples=samples, sampler=sampler, budget=budget)
    return c.reshape(c.shape[0], -1)[:, : stats.n]


def sample_counts(
    q,
    k_cache,
    lengths,
    *,
    samples=256,
    sampler="systematic",
    budget="global",
    seed=0,
    step=0,
    layer=0,
    scale=None,
    block_n=spec.DEFAULT_BLOCK_N,
    head_offset=0,
):
    """Sample counts [B, H, L_max] int32 (0 past lengths[b]) for explicit (seed, step, layer).

    head_offset: the global index of q's first head (tensor parallelism: a rank holding query heads
    h0 .. h0 + H - 1 of a model keys head h by h0 + h, so its counts equal those of the whole model)."""
    B, H, _ = q.shape
    L_max = k_cache.shape[1]
    scores = head_scores(q, k_cache, lengths, scale)  # [B, H, L_max]
    counts = np.zeros((B, H, L_max), dtype=np.int32)
    for b in range(B):
        n = int(lengths[b])
        keys = rng.head_key(seed, step, layer, b, head_offset + np.arange(H))
        counts[b, :, :n] = counts_from_scores(
            scores[b], keys, n, samples=samples, sampler=sampler, budget=budget, block_n=block_n
        )
    return counts


# ------------------------------------------------------------------------------ estimators


def exact_tile_weights(scores, n, block_n):
    """float64 tile weights W_t / Z [..., T] and lse [...] of scores [..., >= n]."""
    T = num_tiles(n, block_n)
    s = np.full(scores.shape[:-1] + (T * block_n,), -np.inf)
    s[..., :n] = scores[..., :n]
    s = s.reshape(scores.shape[:-1] + (T, block_n))
    m_t = s.max(axis=-1)
    m_star = m_t.max(axis=-1, keepdims=True)
    W = np.exp(m_t - m_star) * np.exp(s - m_t[..., None]).sum(axis=-1)
    Z = W.sum(axis=-1, keepdims=True)
    return W / Z, (m_star + np.log(Z))[..., 0]


def estimate(counts, scores, v, *, samples, budget, block_n=spec.DEFAULT_BLOCK_N):
    """SANTA estimate and its spread from sample counts.

    counts [..., n] int, scores [..., n] float64 (for the fixed budget's tile weights),
    v [..., n, D] float64 (broadcasts against counts' leading axes, e.g. [KVH, 1, n, D]).
    global / largest_remainder: o = (1/S) sum_j c_j V_j, var = max(0, M2 - |o|^2) / S,
        M2 = (1/S) sum_j c_j |V_j|^2.
    fixed: o = sum_t (W_t/Z) o_t, o_t = (1/S_t) sum_{j in t} c_j V_j,
        var = sum_t (W_t/Z)^2 max(0, M2_t - |o_t|^2) / S_t.
    Returns (o [..., D], spread [...]) with spread = sqrt(var / D).
    """
    c = np.asarray(counts, dtype=F64)
    n = c.shape[-1]
    D = v.shape[-1]
    vsq = (v * v).sum(axis=-1)  # [..., n]
    if budget in ("global", "largest_remainder"):
        o = (c[..., None, :] @ v)[..., 0, :] / samples
        M2 = (c * vsq).sum(axis=-1) / samples
        var = np.maximum(0.0, M2 - (o * o).sum(axis=-1)) / samples
        return o, np.sqrt(var / D)
    if budget != "fixed":
        raise ValueError(f"budget must be one of {spec.BUDGETS}, got {budget!r}")
    T = num_tiles(n, block_n)
    S_t = fixed_tile_samples(samples, T)
    weight, _ = exact_tile_weights(scores, n, block_n)  # [..., T]
    pad = T * block_n - n
    ct = np.pad(c, [(0, 0)] * (c.ndim - 1) + [(0, pad)]).reshape(c.shape[:-1] + (T, block_n))
    vt = np.pad(v, [(0, 0)] * (v.ndim - 2) + [(0, pad), (0, 0)])
    vt = vt.reshape(v.shape[:-2] + (T, block_n, D))
    vsqt = (vt * vt).sum(axis=-1)  # [..., T, BN]
    o_t = (ct[..., None, :] @ vt)[..., 0, :] / S_t  # [..., T, D]
    M2_t = (ct * vsqt).sum(axis=-1) / S_t  # [..., T]
    o = (weight[..., None] * o_t).sum(axis=-2)
    var = (weight**2 * np.maximum(0.0, M2_t - (o_t * o_t).sum(axis=-1)) / S_t).sum(axis=-1)
    return o, np.sqrt(var / D)


# ---------------------------------------------------------------------------- attention


def dense_attention(q, k_cache, v_cache, lengths, scale=None):
    """Exact attention: o [B, H, D] float64 and lse [B, H] float64 (log-sum-exp of scaled scores).

    q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D] (float16, bfloat16 as uint16, float32 or
    float64); lengths [B] (1..L_max); scale None: 1 / sqrt(D). Inputs are trusted (public callers:
    santa_cupy.decode_attention, which validates)."""
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    s = head_scores(q, k_cache, lengths, scale)  # [B, H, L]
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - m)  # 0 past lengths
    Z = p.sum(axis=-1, keepdims=True)
    inside = np.arange(v_cache.shape[1])[None, :, None, None] < np.asarray(lengths).reshape(B, 1, 1, 1)
    v = np.where(inside, to_float64(v_cache), 0.0)  # [B, L, KVH, D], rows past lengths never read
    o = np.einsum("bkgl,blkd->bkgd", (p / Z).reshape(B, KVH, G, -1), v).reshape(B, H, D)
    return o, (m + np.log(Z))[..., 0]


def santa_attention(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    samples=256,
    sampler="systematic",
    budget="global",
    seed=0,
    step=0,
    layer=0,
    scale=None,
    block_n=spec.DEFAULT_BLOCK_N,
    head_offset=0,
):
    """SANTA decode attention (reference), in float64.

    q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D] (float16, bfloat16 as uint16, float32 or
    float64); lengths [B] (1..L_max); the estimator's fields as santa_cupy.AttentionSetting's.
    head_offset: the global index of q's first head, the h of rng.head_key for head 0 (tensor
    parallelism: a rank's heads h0 .. h0 + H - 1 draw what the whole model's heads draw).

    Returns o [B, H, D] float64, lse [B, H] float64, rows_read [B, KVH] int32 (distinct V rows
    sampled by any head of the GQA group), spread [B, H] float64, counts [B, H, L_max] int32.
    """
    B, H, D = q.shape
    L_max, KVH = k_cache.shape[1], k_cache.shape[2]
    G = H // KVH
    scores = head_scores(q, k_cache, lengths, scale)  # [B, H, L_max]
    v = to_float64(v_cache)
    o = np.zeros((B, H, D))
    lse = np.zeros((B, H))
    spread = np.zeros((B, H))
    rows_read = np.zeros((B, KVH), dtype=np.int32)
    counts = np.zeros((B, H, L_max), dtype=np.int32)
    for b in range(B):
        n = int(lengths[b])
        s = scores[b, :, :n]  # [H, n]
        keys = rng.head_key(seed, step, layer, b, head_offset + np.arange(H))
        c = counts_from_scores(s, keys, n, samples=samples, sampler=sampler, budget=budget, block_n=block_n)
        counts[b, :, :n] = c
        vb = v[b, :n].transpose(1, 0, 2)[:, None]  # [KVH, 1, n, D]
        cg = c.reshape(KVH, G, n)
        ob, sb = estimate(cg, s.reshape(KVH, G, n), vb, samples=samples, budget=budget, block_n=block_n)
        o[b] = ob.reshape(H, D)
        spread[b] = sb.reshape(H)
        _, lse[b] = exact_tile_weights(s, n, block_n)
        rows_read[b] = (cg > 0).any(axis=1).sum(axis=-1)
    # The kernels' contract: a head whose log-sum-exp is not finite (NaN or +inf among its scores,
    # from NaN/inf in K) has a NaN output and spread, not the estimate of a meaningless distribution.
    poisoned = ~np.isfinite(lse)
    o[poisoned] = np.nan
    spread[poisoned] = np.nan
    return o, lse, rows_read, spread, counts

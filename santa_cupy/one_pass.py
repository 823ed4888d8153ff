"""The one-pass budget (SPEC budgets table, ``one_pass``): Horvitz-Thompson sampling of value rows
with Madow's systematic design inside each tile, NumPy reference (float64).

For one sequence b and query head h with scaled scores s_j (j < n_b) and a deterministic normaliser
r (the caller's ``lse_hint``: any function of the inputs, not of the random draws)::

    w_j  = exp(s_j - r)                   unnormalised weight
    pi_j = min(1, S * w_j)                inclusion probability of row j
    Z    = sum_j w_j                      exact, from the same pass
    N^   = sum_{j selected} (w_j / pi_j) V_j
    o^   = N^ / Z

Selection inside tile t (rows [t*BN, (t+1)*BN)): one uniform U_t = uniform(head_key, tile=t,
k=ONE_PASS_DRAW) and the tile's running sum P_j of pi over its rows; row j is selected when the
comb U_t + m (m = 0, 1, ...) has a point in [P_{j-1}, P_j). Since pi_j <= 1 a row holds at most one
point, and it is selected with probability exactly pi_j, so E[N^] = N = sum_j w_j V_j and o^ is
unbiased for o = N / Z whatever r is. Rows with S w_j >= 1 are always taken (weight w_j: the exact
heavy rows); the others get weight w_j / pi_j = 1/S (gather-and-add). The number of selected rows
is random, with mean sum_j pi_j (about S exp(lse - r) when few rows are heavy): r sets both the
cost and the accuracy. ``lse_hint = None`` uses the exact lse (the reference's only way to say
"the first call"; a kernel would use the previous decode step's).

GQA: rows_read is the union over the heads of a KV group, as for the other budgets.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from santa_cupy import reference, rng, spec

ONE_PASS_DRAW = 0xFFFFFFFD      # draw index k of the tile's uniform (distinct from the other budgets')


@dataclass
class OnePassInfo:
    """Diagnostics of one_pass_attention (NumPy arrays).

    selected [B, H, L_max] bool: the rows each head took; weights [B, H, L_max] float64: w_j / pi_j
    where selected, else 0; rows_read [B, KVH] int: distinct rows over the group's heads;
    expected_rows [B, H] float64: sum_j pi_j; lse [B, H] float64: the exact log-sum-exp;
    lse_hint [B, H] float64: the normaliser r used.
    """

    selected: np.ndarray
    weights: np.ndarray
    rows_read: np.ndarray
    expected_rows: np.ndarray
    lse: np.ndarray
    lse_hint: np.ndarray


def inclusion_probabilities(scores, r, samples):
    """pi_j = min(1, S exp(s_j - r)) [.., L] float64 from scores [.., L] (-inf: pi = 0) and r [..]."""
    with np.errstate(over="ignore"):
        return np.minimum(1.0, samples * np.exp(scores - np.asarray(r, np.float64)[..., None]))


def madow_select(pi, uniforms, block_n):
    """Madow's systematic selection inside each tile: pi [R, L] float64 (<= 1), uniforms [R, T]
    float32 in [0, 1) (one per tile), T = ceil(L / BN) -> selected [R, L] bool. Row j of tile t is
    selected when a point U_t + m lies in [P_{j-1}, P_j), P the running sum of pi in the tile."""
    R, L = pi.shape
    T = -(-L // block_n)
    padded = np.zeros((R, T * block_n))
    padded[:, :L] = pi
    run = np.cumsum(padded.reshape(R, T, block_n), axis=-1)            # P_j, float64, tile order
    u = np.asarray(uniforms, np.float64)[:, :, None]
    # points below P: ceil(P - U) for P > U, else 0 (the number of m >= 0 with U + m < P)
    below = np.maximum(0.0, np.ceil(run - u))
    before = np.concatenate([np.zeros((R, T, 1)), below[..., :-1]], axis=-1)
    return (below > before).reshape(R, T * block_n)[:, :L]


def one_pass_attention(q, k_cache, v_cache, lengths, *, samples=256, lse_hint=None, seed=0, step=0, layer=0,
                       scale=None, block_n=spec.DEFAULT_BLOCK_N, head_offset=0):
    """The one-pass estimate o [B, H, D] float64 and OnePassInfo.

    q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D] (float16, bfloat16 as uint16, float32 or
    float64); lengths [B] (1..L_max). lse_hint [B, H] (the normaliser r; None: the exact lse).
    """
    spec.check_samples(samples)
    spec.check_block_n(block_n)
    B, H, _ = q.shape
    _, L_max, KVH, _ = k_cache.shape
    G = H // KVH
    lengths = np.asarray(lengths)
    s = reference.head_scores(q, k_cache, lengths, scale)                   # [B, H, L_max], -inf past n
    m = s.max(-1)
    lse = m + np.log(np.exp(s - m[..., None]).sum(-1))
    if lse_hint is None:
        r = lse
    else:
        r = np.asarray(lse_hint, np.float64)
        if r.shape != (B, H) or not np.all(np.isfinite(r)):
            raise ValueError(f"lse_hint must be a finite [B, H] = {(B, H)} array, got {r.shape}")
    pi = inclusion_probabilities(s, r, samples)                              # [B, H, L_max]
    T = -(-L_max // block_n)
    keys = rng.head_key(seed, step, layer, np.arange(B)[:, None], head_offset + np.arange(H)[None, :])   # [B, H]
    u = rng.uniform(keys[..., None], np.arange(T)[None, None, :], ONE_PASS_DRAW)           # [B, H, T]
    selected = madow_select(pi.reshape(B * H, L_max), u.reshape(B * H, T), block_n).reshape(B, H, L_max)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        w = np.exp(s - r[..., None])
        weights = np.where(selected, w / np.where(pi > 0, pi, 1.0), 0.0)
        Z = w.sum(-1)                                                        # exact
    v = reference.to_float64(v_cache)                                        # [B, L, KVH, D]
    N = np.einsum("bkgl,blkd->bkgd", weights.reshape(B, KVH, G, L_max), v).reshape(B, H, -1)
    o = N / Z[..., None]
    rows_read = selected.reshape(B, KVH, G, L_max).any(axis=2).sum(-1)
    info = OnePassInfo(selected=selected, weights=weights, rows_read=rows_read,
                       expected_rows=pi.sum(-1), lse=lse, lse_hint=np.broadcast_to(r, (B, H)).copy())
    return o, info

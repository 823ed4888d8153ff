"""Bytes each decode-attention call must move, how many rotating input copies a point needs, and the
numbers derived from the timed rows (TB/s, % of the ceiling, x dense, x best peer). Pure Python.
"""

from __future__ import annotations

import math

from santa_cupy.cli.bench.methods import ITEMSIZE, L2_FACTOR, MAX_COPIES, Method, PEERS, Shape


def kv_bytes(shape: Shape, B: int, L: int) -> int:
    """K + V of all sequences at length L."""
    return 2 * B * L * shape.kv_heads * shape.head_dim * ITEMSIZE[shape.dtype]


def attention_bytes(method: Method, shape: Shape, B: int, L: int, rows_read: int | None = None,
                    key_fraction: float | None = None, exact: bool = False) -> int:
    """Bytes a decode-attention call must move (see docs/BENCHMARKS.md, "Bytes").

    dense / external: K + V of all B*L rows, plus q read and o written.
    santa: K in full + rows_read (distinct V rows, summed over b and KV heads) * D * itemsize + q + o,
    plus, for the two-pass budgets (global, largest_remainder), the fp32 score stash written and
    read back: B*H*L*4*2 (not for fixed and one_pass). Tile partials and per-tile stats are not
    counted. one_pass: the plan's default hint, its previous call's lse. Key sampling
    (``key_fraction``, the fraction of K's blocks read): K counts that fraction. ``exact``: a santa
    plan that ran the exact kernel for every sequence (below its santa_min_length) moves dense's."""
    isz, D, H, KVH = ITEMSIZE[shape.dtype], shape.head_dim, shape.heads, shape.kv_heads
    qo = 2 * B * H * D * isz
    if method.kind != "santa" or exact:
        return kv_bytes(shape, B, L) + qo
    if rows_read is None:
        raise ValueError("santa bytes need rows_read (distinct V rows read, summed over b and KV heads)")
    k = B * L * KVH * D * isz
    if key_fraction is not None:
        k = int(round(k * key_fraction))
    stash = 0 if method.budget in ("fixed", "one_pass") else B * H * L * 4 * 2   # one_pass: no stash
    return k + int(rows_read) * D * isz + qo + stash


def copies_for(bytes_per_copy: int, l2_bytes: int, budget_bytes: int) -> int:
    """How many rotating input copies: enough that they total >= L2_FACTOR x L2, at least 1, at most
    what fits ``budget_bytes`` (and MAX_COPIES). 0 = not even one copy fits."""
    if bytes_per_copy > budget_bytes:
        return 0
    want = max(1, math.ceil(L2_FACTOR * l2_bytes / bytes_per_copy))
    return min(want, budget_bytes // bytes_per_copy, MAX_COPIES)



def best_peer(rows: list[dict]):
    """(method, µs) of the fastest peer (PEERS) that ran among the rows of one point, or None."""
    timed = [(r["us"], r["method"]) for r in rows if r["method"] in PEERS and r.get("us")]
    if not timed:
        return None
    us, method = min(timed)
    return method, us


def add_derived(rows: list[dict], ceiling_tbps: float | None) -> list[dict]:
    """Fill tbps, pct_ceiling, x_dense (our dense us / this us), x_peer (for our rows: the fastest
    peer's us / this us, that peer in best_peer), x_external (best external us / this us) and
    x_dense_bound (our dense us / (this row's bytes at the ceiling): the largest x_dense its bytes
    allow) per (shape, B, L). Rows without a time (skipped) get None."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["B"], r["L"]), []).append(r)
    for group in groups.values():
        timed = [r for r in group if r.get("us")]
        dense = next((r["us"] for r in timed if r["method"] == "dense"), None)
        ext = [r["us"] for r in timed if r.get("external")]
        best_ext = min(ext) if ext else None
        peer = best_peer(group)
        for r in group:
            us = r.get("us")
            r["tbps"] = r["bytes"] / (us * 1e-6) / 1e12 if us and r.get("bytes") else None
            r["pct_ceiling"] = 100.0 * r["tbps"] / ceiling_tbps if r["tbps"] and ceiling_tbps else None
            r["x_dense"] = dense / us if us and dense else None
            r["x_external"] = best_ext / us if us and best_ext else None
            ours = not r.get("external")
            r["x_peer"] = peer[1] / us if us and peer and ours else None
            r["best_peer"] = peer[0] if peer and ours else None
            floor_us = r["bytes"] / (ceiling_tbps * 1e12) * 1e6 if r.get("bytes") and ceiling_tbps else None
            r["x_dense_bound"] = dense / floor_us if dense and floor_us and us else None
    return rows


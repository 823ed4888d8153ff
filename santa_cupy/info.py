"""``AttentionInfo``: the diagnostics of one decode-attention call."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class AttentionInfo:
    """Diagnostics of one call (arrays of the input's array library: NumPy or CuPy).

    Attributes
    ----------
    lse : [B, H] float32
        Log-sum-exp of the scaled scores.
    rows_read : [B, KVH] int32
        Distinct V rows read (union over the GQA group); dense: the lengths.
    spread : [B, H] float32
        Estimated standard error of o, RMS over the D coordinates (0 for dense).
    counts : [B, H, L_max] int32 or None
        Sample counts (NumPy path, or GPU with ``return_counts``); else None.
    dense_fallback : [B] bool
        The sequences that ran the exact kernel (method dense: all; santa: those shorter than the
        plan's santa_min_length).
    samples_drawn : [B, H] int32 or None
        Rows each head took (budget one_pass: a random number, about samples * exp(lse -
        lse_hint)); ``samples`` for the other budgets; None for dense.
    key_fraction : [B, KVH] float32 or None
        Fraction of the K bytes of each sequence's rows that the KV group reads: 1 without key
        sampling; with it (santa_cupy.key_sampling; on the GPU measured from the blocks the
        kernel read, santa_cupy/key_pass.py) the fraction of the row's
        pieces read (blocks for "bernoulli_block", 32-byte sectors of 2-byte storage for
        "bernoulli"), the same for every row of the sequence. The fraction of the whole call is
        ``(key_fraction * lengths[:, None]).sum() / (lengths.sum() * KVH)``. None from
        ``DecodePlan.info()`` of a plan without key sampling (all of K is read).

    From ``decode_attention`` the arrays are the caller's; from ``DecodePlan.info()`` they are
    views of the plan's buffers, overwritten by its next run.
    """

    lse: Any
    rows_read: Any
    spread: Any
    counts: Any = None
    dense_fallback: Any = None
    samples_drawn: Any = None
    key_fraction: Any = None

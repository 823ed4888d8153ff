"""The feature-blocked key layout of the block key-sampling kernel (key_layout="blocked").

A K cache in the standard layout is ``[B, L_max, KVH, D]``. The blocked layout stores it as
``[B, KVH, C, L_max, FB]`` with ``FB = key_block`` features per block and ``C = D // FB`` blocks:
element ``kb[b, g, c, j, i] = k[b, j, g, c * FB + i]``. The rows of one block of one KV head are
then one contiguous run of ``L_max * FB`` elements, so a block that key sampling drops
(santa_cupy.key_sampling, "bernoulli_block") is a contiguous run the kernel never reads. V keeps
the standard layout. Paged caches have no blocked form.

Both helpers take NumPy or CuPy arrays (any dtype, bfloat16 as uint16) and return a new
C-contiguous array of the same library and dtype.
"""

from __future__ import annotations

import numbers

from santa_cupy import spec

KEY_LAYOUTS = ("standard", "blocked")

__all__ = ["KEY_LAYOUTS", "to_blocked", "from_blocked", "blocked_shape", "check_key_layout"]


def _module(x):
    if spec.is_cupy_array(x):
        import cupy
        return cupy
    import numpy
    if not isinstance(x, numpy.ndarray):
        raise TypeError(f"expected a numpy.ndarray or cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")
    return numpy


def _check_key_block(key_block):
    if isinstance(key_block, bool) or not isinstance(key_block, numbers.Integral) or key_block not in spec.KEY_BLOCKS:
        raise ValueError(f"key_block must be one of {spec.KEY_BLOCKS}, got {key_block!r}")
    return int(key_block)


def check_key_layout(key_layout):
    """ValueError unless key_layout is one of KEY_LAYOUTS."""
    spec.check_choice("key_layout", key_layout, KEY_LAYOUTS)
    return key_layout


def blocked_shape(k_shape, key_block):
    """The blocked shape (B, KVH, C, L_max, FB) of a standard-layout K shape (B, L_max, KVH, D)."""
    FB = _check_key_block(key_block)
    if len(k_shape) != 4:
        raise ValueError(f"k must have rank 4 [B, L_max, KVH, D] (the standard layout), got shape {tuple(k_shape)}")
    B, L_max, KVH, D = (int(n) for n in k_shape)
    if D % FB:
        raise ValueError(f"head dim D={D} (k.shape[3]) must be a multiple of key_block={FB}")
    return B, KVH, D // FB, L_max, FB


def to_blocked(k, key_block):
    """k [B, L_max, KVH, D] -> kb [B, KVH, C, L_max, FB], C = D // FB, FB = key_block (16 | 32):
    ``kb[b, g, c, j, i] = k[b, j, g, c * FB + i]``. ValueError for a rank other than 4 or a D that
    is not a multiple of key_block."""
    xp = _module(k)
    B, KVH, C, L_max, FB = blocked_shape(k.shape, key_block)
    kb = k.reshape(B, L_max, KVH, C, FB).transpose(0, 2, 3, 1, 4)
    return xp.ascontiguousarray(kb)


def from_blocked(kb):
    """kb [B, KVH, C, L_max, FB] -> k [B, L_max, KVH, C * FB] (to_blocked's inverse). ValueError
    for a rank other than 5 or an FB not in spec.KEY_BLOCKS."""
    xp = _module(kb)
    if kb.ndim != 5:
        raise ValueError(f"kb must have rank 5 [B, KVH, C, L_max, FB] (the blocked layout), got shape "
                         f"{tuple(kb.shape)}")
    B, KVH, C, L_max, FB = (int(n) for n in kb.shape)
    _check_key_block(FB)
    if C < 1:
        raise ValueError(f"kb must have C >= 1 blocks, got shape {tuple(kb.shape)}")
    return xp.ascontiguousarray(kb.transpose(0, 3, 1, 2, 4).reshape(B, L_max, KVH, C * FB))

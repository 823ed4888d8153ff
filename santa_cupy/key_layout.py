"""The feature-blocked key layout of the block key-sampling kernel (key_layout="blocked").

A K cache in the standard layout is ``[B, L_max, KVH, D]``. The blocked layout stores it in pages
of ``P = KEY_PAGE_ROWS`` (64) rows, each page holding its rows' ``C = D // FB`` feature blocks one
after another: ``[B, KVH, NP, C, P, FB]`` with ``FB = key_block`` features per block and
``NP = ceil(L_max / P)`` pages (rows past L_max are zero padding), element
``kb[b, g, j // P, c, j % P, i] = k[b, j, g, c * FB + i]``. The P rows of one block of one page
are one contiguous run of ``P * FB`` elements (2 KB at FB 16, bf16), so a block that key sampling
drops (santa_cupy.key_sampling, "bernoulli_block") is a run of whole DRAM bursts the kernel never
reads, while a 16-key step still finds all of its blocks within one page (P * D elements); with
each block one run of the whole length instead, dense on the blocked K measured up to 5.8%
slower than on the standard K (C DRAM streams a step; H200, docs/BENCHMARKS.md). V keeps the
standard layout. Paged caches have no blocked form.

The helpers take NumPy or CuPy arrays (any dtype, bfloat16 as uint16); to_blocked / from_blocked
return a new C-contiguous array of the same library and dtype, write_rows / write_token write into
a blocked K in place (llama_min's cache appends).
"""

from __future__ import annotations

import numbers

from santa_cupy import spec

KEY_LAYOUTS = ("standard", "blocked")
KEY_PAGE_ROWS = 64          # P: SC_KEY_PAGE_ROWS (cuda/common.cuh)

__all__ = ["KEY_LAYOUTS", "KEY_PAGE_ROWS", "to_blocked", "from_blocked", "blocked_shape", "blocked_rows",
           "write_rows", "write_token", "check_key_layout"]


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
    """The blocked shape (B, KVH, NP, C, P, FB) of a standard-layout K shape (B, L_max, KVH, D):
    NP = ceil(L_max / P) pages of P = KEY_PAGE_ROWS rows, C = D // FB blocks of FB = key_block."""
    FB = _check_key_block(key_block)
    if len(k_shape) != 4:
        raise ValueError(f"k must have rank 4 [B, L_max, KVH, D] (the standard layout), got shape {tuple(k_shape)}")
    B, L_max, KVH, D = (int(n) for n in k_shape)
    if D % FB:
        raise ValueError(f"head dim D={D} (k.shape[3]) must be a multiple of key_block={FB}")
    P = KEY_PAGE_ROWS
    return B, KVH, -(-L_max // P), D // FB, P, FB


def _check_blocked(kb):
    """(B, KVH, NP, C, P, FB) of a blocked K, or ValueError."""
    if kb.ndim != 6:
        raise ValueError(f"kb must have rank 6 [B, KVH, NP, C, P, FB] (the blocked layout), got shape "
                         f"{tuple(kb.shape)}")
    B, KVH, NP, C, P, FB = (int(n) for n in kb.shape)
    _check_key_block(FB)
    if C < 1 or P != KEY_PAGE_ROWS:
        raise ValueError(f"kb must have C >= 1 blocks and pages of P = {KEY_PAGE_ROWS} rows, got shape "
                         f"{tuple(kb.shape)}")
    return B, KVH, NP, C, P, FB


def blocked_rows(kb_shape) -> int:
    """Rows a blocked K of this shape holds: NP * P (its L_max rounded up to whole pages)."""
    return int(kb_shape[2]) * int(kb_shape[4])


def to_blocked(k, key_block):
    """k [B, L_max, KVH, D] -> kb [B, KVH, NP, C, P, FB] (blocked_shape; rows past L_max zero):
    ``kb[b, g, j // P, c, j % P, i] = k[b, j, g, c * FB + i]``. ValueError for a rank other than 4
    or a D that is not a multiple of key_block."""
    xp = _module(k)
    B, KVH, NP, C, P, FB = blocked_shape(k.shape, key_block)
    L_max = k.shape[1]
    if NP * P != L_max:
        padded = xp.zeros((B, NP * P) + tuple(k.shape[2:]), dtype=k.dtype)
        padded[:, :L_max] = k
        k = padded
    kb = k.reshape(B, NP, P, KVH, C, FB).transpose(0, 3, 1, 4, 2, 5)
    return xp.ascontiguousarray(kb)


def from_blocked(kb, length=None):
    """kb [B, KVH, NP, C, P, FB] -> k [B, length, KVH, C * FB] (to_blocked's inverse; length None:
    all NP * P rows; only the pages holding the first ``length`` rows are read). ValueError for a
    rank other than 6, an FB not in spec.KEY_BLOCKS, pages of other than KEY_PAGE_ROWS rows or a
    length outside 0 .. NP * P."""
    xp = _module(kb)
    B, KVH, NP, C, P, FB = _check_blocked(kb)
    rows = NP * P if length is None else int(length)
    if not 0 <= rows <= NP * P:
        raise ValueError(f"length must be in 0..{NP * P} (the blocked K's rows), got {length!r}")
    pages = -(-rows // P)
    k = kb[:, :, :pages].transpose(0, 2, 4, 1, 3, 5).reshape(B, pages * P, KVH, C * FB)
    return xp.ascontiguousarray(k[:, :rows])


def write_rows(kb, start, k):
    """Rows start .. start + T - 1 of every sequence of a blocked K from k [B, T, KVH, D] (standard
    layout), in place: at most three assignments (a partial first page, the whole pages, a partial
    last page). ValueError for rows past the blocked K's."""
    B, KVH, NP, C, P, FB = _check_blocked(kb)
    end = start + int(k.shape[1])
    if start < 0 or end > NP * P:
        raise ValueError(f"rows {start}..{end - 1} are outside the blocked K's 0..{NP * P - 1}")
    j = start
    while j < end:
        page, lo = divmod(j, P)
        if lo == 0 and end - j >= P:                      # whole pages
            pages = (end - j) // P
            rows = k[:, j - start:j - start + pages * P].reshape(B, pages, P, KVH, C, FB)
            kb[:, :, page:page + pages] = rows.transpose(0, 3, 1, 4, 2, 5)
            j += pages * P
        else:                                             # part of one page
            n = min(P - lo, end - j)
            rows = k[:, j - start:j - start + n].reshape(B, n, KVH, C, FB)
            kb[:, :, page, :, lo:lo + n, :] = rows.transpose(0, 2, 3, 1, 4)
            j += n


def write_token(kb, seqs, pos, k):
    """Row pos[i] of sequence seqs[i] of a blocked K from k [len(seqs), KVH, D], in place (seqs,
    pos: integer arrays of one length, of kb's library)."""
    B, KVH, NP, C, P, FB = _check_blocked(kb)
    kb[seqs, :, pos // P, :, pos % P] = k.reshape(k.shape[0], KVH, C, FB)

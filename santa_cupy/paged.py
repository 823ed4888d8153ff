"""Paged KV caches: the block table's validation, and the gather
into the contiguous cache that the NumPy reference path runs on. Callers pass pages to
``decode_attention(..., block_table=, page_layout=)`` or to a ``DecodePlan(page_size=)``.

Layout "NHD" (FlashInfer's and vLLM's): k_pages, v_pages [num_pages, page_size, KVH, D]; "HND":
[num_pages, KVH, page_size, D]. block_table [B, max_pages] int32: the page ids of sequence b in
order; lengths [B]. Row j of sequence b lives in page block_table[b, j // page_size] at slot
j % page_size. Entries past ceil(lengths[b] / page_size) are ignored (any value), so tables may be
padded; pages may be shared between sequences and listed in any order.

The GPU kernels read pages in place (cuda/tile.cuh, CacheRows: one page-table load per row).
"""

from __future__ import annotations

import numpy as np

from santa_cupy import spec

# the page layouts and limits, with every other shape rule, live in spec (one source of truth)
LAYOUTS, DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE = spec.PAGE_LAYOUTS, spec.DEFAULT_PAGE_SIZE, spec.MAX_PAGE_SIZE
page_shape = spec.page_shape


def validate_block_table(block_table, lengths, num_pages, page_size, max_length=None):
    """Check that every sequence's pages exist: block_table [B, max_pages] integer, enough columns
    for each length, every used entry in [0, num_pages), and (max_length given) no length above it.
    Raises ValueError naming block_table and the first bad entry (row-major order), or the first
    length too long; returns the table as int64 NumPy."""
    table = np.asarray(block_table.get() if hasattr(block_table, "get") else block_table)
    lengths = np.asarray(lengths.get() if hasattr(lengths, "get") else lengths)
    if table.ndim != 2 or table.dtype.kind not in "iu":
        raise ValueError(f"block_table must be a 2-D integer array [B, max_pages], got "
                         f"{table.dtype} of shape {table.shape}")
    if table.shape[0] != lengths.shape[0]:
        raise ValueError(f"block_table has {table.shape[0]} rows for {lengths.shape[0]} sequences (lengths)")
    if np.any(lengths < 0):
        b = int(np.argmax(lengths < 0))
        raise ValueError(f"lengths must be >= 0, got lengths[{b}] = {int(lengths[b])}")
    if max_length is not None and np.any(lengths > max_length):
        b = int(np.argmax(lengths > max_length))
        raise ValueError(f"lengths[{b}] = {int(lengths[b])} exceeds max_length {max_length}")
    needed = -(-lengths.astype(np.int64) // page_size)                   # pages each sequence uses
    for b in range(table.shape[0]):
        if needed[b] > table.shape[1]:
            raise ValueError(f"block_table row {b} has {table.shape[1]} pages, but lengths[{b}] = "
                             f"{int(lengths[b])} needs {int(needed[b])} pages of {page_size} rows")
        used = table[b, :needed[b]].astype(np.int64)
        bad = np.nonzero((used < 0) | (used >= num_pages))[0]
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"block_table[{b}, {i}] = {int(used[i])} is not a page id in [0, {num_pages}) "
                             f"(the first bad entry)")
    return table.astype(np.int64)


def gather_pages(pages, block_table, lengths, max_length=None, layout="NHD"):
    """The contiguous cache [B, L_max, KVH, D] of a page pool (NumPy): row j of sequence b from
    page block_table[b, j // page_size], slot j % page_size; rows >= lengths[b] are zero.
    L_max = max_length or the table's capacity (max_pages * page_size)."""
    num_pages, page_size, KVH, D = page_shape(pages, layout)
    if max_length is None:
        max_length = np.shape(block_table)[-1] * page_size
    table = validate_block_table(block_table, lengths, num_pages, page_size, int(max_length))
    lengths = np.asarray(lengths, np.int64)
    B, L_max = table.shape[0], int(max_length)
    nhd = pages if layout == "NHD" else np.swapaxes(pages, 1, 2)        # [num_pages, page_size, KVH, D]
    out = np.zeros((B, L_max, KVH, D), pages.dtype)
    for b in range(B):
        n = int(lengths[b])
        if n == 0:
            continue
        j = np.arange(n)
        out[b, :n] = nhd[table[b, j // page_size], j % page_size]
    return out

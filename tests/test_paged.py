"""Paged KV caches, NumPy path (santa_cupy.paged): layout, block-table validation, the reference."""

import numpy as np
import pytest

from santa_cupy import decode_attention, paged
from tests.gpu_util import paged_inputs


def _paged_inputs(rng, page_size=16, lengths=(50, 16, 1), layout="NHD"):
    """Shuffled pages, one shared by two sequences, padded tables, unused pages garbage (gpu_util)."""
    return paged_inputs(rng, lengths, page_size, D=64, layout=layout, spare=4)


@pytest.mark.parametrize("layout", paged.LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 48])
def test_gather_places_every_row_from_its_page(layout, page_size):
    rng = np.random.default_rng(page_size)
    q, kp, vp, table, lens = _paged_inputs(rng, page_size=page_size, lengths=(3 * page_size + 5, page_size, 1),
                                           layout=layout)
    k = paged.gather_pages(kp, table, lens, layout=layout)
    nhd = kp if layout == "NHD" else np.swapaxes(kp, 1, 2)
    for b, n in enumerate(lens):
        for j in range(n):
            assert np.array_equal(k[b, j], nhd[table[b, j // page_size], j % page_size])
        assert not k[b, n:].any()                                    # rows past the length are zero
    assert k.shape[1] == table.shape[1] * page_size


@pytest.mark.parametrize("method,budget", [("dense", "global"), ("santa", "global"), ("santa", "fixed")])
def test_paged_equals_contiguous(method, budget):
    """Shuffled, shared and partially filled pages: the same output and counts as the contiguous
    call on the gathered cache (bit for bit)."""
    rng = np.random.default_rng(5)
    q, kp, vp, table, lens = _paged_inputs(rng)
    kw = dict(method=method, budget=budget, samples=64, seed=3, return_info=True)
    o, info = decode_attention(q, kp, vp, lens, block_table=table, **kw)
    k, v = paged.gather_pages(kp, table, lens), paged.gather_pages(vp, table, lens)
    o2, info2 = decode_attention(q, k, v, lens, **kw)
    assert np.array_equal(o, o2) and np.array_equal(info.lse, info2.lse)
    if method == "santa":
        assert np.array_equal(info.counts, info2.counts)


@pytest.mark.parametrize("mutate,match", [
    (lambda t, lens: t.__setitem__((0, 1), 999), r"block_table\[0, 1\] = 999 is not a page id"),
    (lambda t, lens: t.__setitem__((2, 0), -1), r"block_table\[2, 0\] = -1"),
    (lambda t, lens: lens.__setitem__(0, 16 * t.shape[1] + 1), r"block_table row 0 has .* needs"),
])
def test_bad_tables_name_block_table_and_the_first_bad_entry(mutate, match):
    rng = np.random.default_rng(6)
    q, kp, vp, table, lens = _paged_inputs(rng)
    table, lens = table.copy(), lens.copy()
    mutate(table, lens)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, kp, vp, lens, block_table=table)


def test_shapes_and_layouts_are_checked():
    rng = np.random.default_rng(7)
    q, kp, vp, table, lens = _paged_inputs(rng)
    with pytest.raises(ValueError, match="layout"):
        paged.page_shape(kp, "BNHD")
    with pytest.raises(ValueError, match="k_pages must have 4 dimensions"):
        paged.page_shape(kp[0])
    with pytest.raises(ValueError, match="page_size"):
        paged.page_shape(np.zeros((2, 300, 2, 64), np.uint16))
    with pytest.raises(ValueError, match="must equal k_cache shape"):
        decode_attention(q, kp, vp[:-1], lens, block_table=table)
    with pytest.raises(ValueError, match="page_layout"):
        decode_attention(q, kp, vp, lens, block_table=table, page_layout="nhd")
    with pytest.raises(ValueError, match="block_table must be a 2-D"):
        decode_attention(q, kp, vp, lens, block_table=table[0])
    with pytest.raises(ValueError, match="2-D integer"):
        paged.validate_block_table(table.astype(np.float32), lens, kp.shape[0], 16)
    with pytest.raises(ValueError, match="rows for"):
        paged.validate_block_table(table[:2], lens, kp.shape[0], 16)
    with pytest.raises(ValueError, match="exceeds max_length"):
        paged.gather_pages(kp, table, lens, max_length=10)

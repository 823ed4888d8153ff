"""Paged KV caches on the GPU: every kernel reading pages in place (cuda/tile.cuh CacheRows) gives
the same bits as the contiguous call on the gathered cache of the same L_max: dense, every SANTA
route (warp pipeline, block pass 2, fused fixed, one pass), both layouts, page sizes 1 to 256
(powers of two or not), with shuffled, shared and partially filled pages; bad tables are a
ValueError naming block_table; a paged plan captures in a CUDA graph."""

import numpy as np
import pytest

from santa_cupy import DecodePlan, decode_attention, paged
from tests.gpu_util import paged_inputs, requires_gpu, to_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def contiguous(q, kp, vp, table, lengths, layout):
    L_max = table.shape[1] * paged.page_shape(kp, layout)[1]
    return (paged.gather_pages(kp, table, lengths, L_max, layout),
            paged.gather_pages(vp, table, lengths, L_max, layout))


CASES = [  # (method, budget, sampler, santa_min_length): every GPU route
    ("dense", "global", "systematic", "auto"),
    ("santa", "global", "systematic", 0),             # warp pipeline
    ("santa", "largest_remainder", "systematic", 0),
    ("santa", "fixed", "systematic", 0),
    ("santa", "global", "iid", 0),                    # block pass 2
    ("santa", "fixed", "stratified", 0),              # fused fixed (block kernel scores its tiles)
]


@pytest.mark.parametrize("layout", paged.LAYOUTS)
@pytest.mark.parametrize("page_size", [1, 16, 48, 256])
@pytest.mark.parametrize("method,budget,sampler,min_len", CASES)
def test_paged_equals_contiguous_bit_for_bit(method, budget, sampler, min_len, page_size, layout):
    import cupy
    rng = np.random.default_rng(page_size * 7 + len(layout) + CASES.index((method, budget, sampler, min_len)))
    lengths = [3 * page_size + 5, 700, 1, 2 * page_size]
    q, kp, vp, table, lens = paged_inputs(rng, lengths, page_size, layout=layout)
    k, v = contiguous(q, kp, vp, table, lens, layout)
    kw = dict(method=method, budget=budget, sampler=sampler, samples=64, seed=11, step=2, layer=1,
              santa_min_length=min_len, return_info=True, return_counts=method == "santa")
    o_p, info_p = decode_attention(*to_gpu(q, kp, vp, lens), block_table=cupy.asarray(table), page_layout=layout,
                                   **kw)
    o_c, info_c = decode_attention(*to_gpu(q, k, v, lens), **kw)
    assert np.array_equal(o_p.get(), o_c.get())
    assert np.array_equal(info_p.lse.get(), info_c.lse.get())
    assert np.array_equal(info_p.rows_read.get(), info_c.rows_read.get())
    if method == "santa":
        assert np.array_equal(info_p.counts.get(), info_c.counts.get())


@pytest.mark.parametrize("G,D,dtype", [(4, 128, "float16"), (8, 64, "bfloat16"), (1, 128, "float32")])
def test_paged_shapes_and_dtypes(G, D, dtype):
    import cupy
    rng = np.random.default_rng(G * D)
    q, kp, vp, table, lens = paged_inputs(rng, [1000, 33, 517], 16, H=2 * G, KVH=2, D=D, dtype=dtype)
    k, v = contiguous(q, kp, vp, table, lens, "NHD")
    for method in ("dense", "santa"):
        kw = dict(method=method, samples=128, seed=3, santa_min_length=0)
        o_p = decode_attention(*to_gpu(q, kp, vp, lens), block_table=cupy.asarray(table), **kw)
        o_c = decode_attention(*to_gpu(q, k, v, lens), **kw)
        assert np.array_equal(o_p.get(), o_c.get()), method


def test_one_pass_on_pages():
    import cupy
    rng = np.random.default_rng(9)
    q, kp, vp, table, lens = paged_inputs(rng, [2000, 129, 640], 32)
    k, v = contiguous(q, kp, vp, table, lens, "NHD")
    hint = cupy.zeros((3, 8), cupy.float32) + 2.0
    kw = dict(budget="one_pass", samples=64, seed=5, lse_hint=hint, return_info=True)
    o_p, i_p = decode_attention(*to_gpu(q, kp, vp, lens), block_table=cupy.asarray(table), **kw)
    o_c, i_c = decode_attention(*to_gpu(q, k, v, lens), **kw)
    assert np.array_equal(o_p.get(), o_c.get())
    assert np.array_equal(i_p.samples_drawn.get(), i_c.samples_drawn.get())


def test_plan_with_pages_captures_and_checks_its_table():
    """A paged plan in a CUDA graph (the table read by address, updated in place between replays);
    validate=True names the first bad entry; a contiguous plan refuses a table."""
    import cupy
    rng = np.random.default_rng(4)
    ps = 16
    q, kp, vp, table, lens = paged_inputs(rng, [900, 400], ps)
    k, v = contiguous(q, kp, vp, table, lens, "NHD")
    L = table.shape[1] * ps
    plan = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=L, dtype="bfloat16", samples=64,
                      santa_min_length=0, page_size=ps)
    ref = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=L, dtype="bfloat16", samples=64,
                     santa_min_length=0)
    gq, gkp, gvp, glens, gk, gv = to_gpu(q, kp, vp, lens, k, v)
    gtable = cupy.asarray(table)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        plan.run(gq, gkp, gvp, glens, block_table=gtable)             # warm-up (compiles)
        stream.begin_capture()
        plan.run(gq, gkp, gvp, glens, block_table=gtable, validate=False)
        graph = stream.end_capture()
        graph.launch(stream)
    stream.synchronize()
    want = ref.run(gq, gk, gv, glens).get()
    assert np.array_equal(plan.out.get(), want)
    # swap sequence 1's pages for copies elsewhere in the pool: same rows, new ids, same output
    used = table[1, :-(-400 // ps)].copy()
    fresh = np.arange(kp.shape[0], kp.shape[0] + len(used))
    kp2 = np.concatenate([kp, kp[used]]); vp2 = np.concatenate([vp, vp[used]])
    gkp2, gvp2 = to_gpu(kp2, vp2)
    t2 = table.copy(); t2[1, :len(used)] = fresh
    gtable[...] = cupy.asarray(t2)
    assert np.array_equal(plan.run(gq, gkp2, gvp2, glens, block_table=gtable).get(), want)
    bad = table.copy(); bad[0, 3] = kp.shape[0] + 50
    with pytest.raises(ValueError, match=r"block_table\[0, 3\]"):
        plan.run(gq, gkp, gvp, glens, block_table=cupy.asarray(bad))
    with pytest.raises(ValueError, match="block_table"):
        ref.run(gq, gk, gv, glens, block_table=gtable)
    with pytest.raises(ValueError, match="block_table"):
        plan.run(gq, gkp, gvp, glens)
    with pytest.raises(ValueError, match="block_table"):
        plan.run(gq, gkp, gvp, glens, block_table=gtable.astype(cupy.int64))

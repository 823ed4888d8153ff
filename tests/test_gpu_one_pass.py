"""The one-pass budget on the GPU (santa_one_pass + santa_merge) against its float64 reference
(santa_cupy/one_pass.py): the same rows but for points within float32 rounding of a row boundary,
unbiased over device steps for hints too low, exact and too high, the contracts (length 0, NaN).
"""

import numpy as np
import pytest

from santa_cupy import DecodePlan, decode_attention, one_pass, reference, spec
from tests.gpu_util import DENSE_TOL, as_float32, random_inputs, rel_l2, requires_gpu, to_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]




def _exact_lse(q, k, lens):
    s = reference.head_scores(q, k, lens)
    m = s.max(-1)
    return m + np.log(np.exp(s - m[..., None]).sum(-1))


@pytest.mark.parametrize("delta", [-1.0, 0.0, 1.5])
@pytest.mark.parametrize("G,D,dtype,block_n", [(4, 128, "bfloat16", 128), (3, 64, "float16", 64),
                                               (8, 128, "float16", 64), (1, 64, "bfloat16", 128)])
def test_one_pass_matches_reference(G, D, dtype, block_n, delta):
    """lse_hint = the exact lse + delta (delta < 0: more rows than S, > 0: fewer)."""
    import cupy
    rng = np.random.default_rng(G * D + block_n)
    KVH, S = 2, 64
    lengths = [1, block_n - 1, 3 * block_n + 17, 5000]
    L_max = max(lengths) + 5
    q, k, v, lens = random_inputs(rng, len(lengths), G * KVH, KVH, D, L_max, lengths, dtype, peak=2.0)
    hint = (_exact_lse(q, k, lens) + delta).astype(np.float32)
    kw = dict(method="santa", budget="one_pass", samples=S, seed=7, step=3, layer=2, block_n=block_n,
              santa_min_length=0)       # santa at every length (the default runs these exact)
    o_ref, info_ref = decode_attention(q, k, v, lens, lse_hint=hint, return_info=True, **kw)
    want, op = one_pass.one_pass_attention(q, k, v, lens, samples=S, lse_hint=hint.astype(np.float64), seed=7,
                                           step=3, layer=2, block_n=block_n)
    assert np.array_equal(info_ref.samples_drawn, op.selected.sum(-1))        # the NumPy path is the reference
    o, info = decode_attention(*to_gpu(q, k, v, lens), lse_hint=cupy.asarray(hint), return_info=True, **kw)
    drawn, want_drawn = info.samples_drawn.get(), op.selected.sum(-1)
    flips = int(np.abs(drawn - want_drawn).sum())
    total = int(want_drawn.sum())
    print(f"G={G} D={D} {dtype} delta={delta}: {total} rows taken, {flips} differ")
    assert flips <= max(2, total // 200), f"{flips} of {total} selections differ"
    assert np.abs(info.rows_read.get() - op.rows_read).sum() <= max(2, total // 200)
    assert np.allclose(info.lse.get(), op.lse, rtol=1e-4, atol=1e-4)          # the merge's exact lse
    err = rel_l2(as_float32(o), want)
    # equal counts per head may still hide a point that moved to a neighbouring row (the float32
    # running sum), so even then the tolerance is a few rows' worth above the output's rounding
    assert err < (DENSE_TOL[dtype] + 5e-3 if flips == 0 else 5e-2), f"rel. error {err:.2e} with {flips} flips"


def test_one_pass_nan_hint_is_exact_and_the_default_hint_follows_the_plan():
    """A plan's first call (its lse NaN) takes every row: the exact output; the next call's hint is
    that lse, so it takes about S rows a head."""
    rng = np.random.default_rng(3)
    B, H, KVH, D, L = 2, 8, 2, 128, 4000
    q, k, v, lens = random_inputs(rng, B, H, KVH, D, L, [4000, 2500], "bfloat16", peak=1.5)
    exact, lse = reference.dense_attention(q, k, v, lens)
    plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, budget="one_pass", samples=128,
                      santa_min_length=0)
    args = to_gpu(q, k, v, lens)
    o = as_float32(plan.run(*args))
    assert (plan.info().samples_drawn.get() == np.array(lens)[:, None]).all(), "NaN hint: every row"
    assert rel_l2(o, exact) < DENSE_TOL["bfloat16"]
    assert np.allclose(plan.lse.get(), lse, rtol=1e-4, atol=1e-4)
    plan.run(*args)
    drawn = plan.info().samples_drawn.get()
    assert 60 < drawn.mean() < 250, f"hint = the previous lse: about S = 128 rows, got {drawn.mean():.0f}"


@pytest.mark.parametrize("delta", [-1.0, 0.0, 1.5])
def test_one_pass_unbiased_over_steps_on_gpu(delta):
    """Mean over 600 device steps within 4 standard errors of exact attention, per coordinate, for
    a hint below, at and above the exact lse; the mean number of rows taken is sum_j pi_j."""
    import cupy
    rng = np.random.default_rng(11)
    q, k, v, lens = random_inputs(rng, 1, 4, 1, 64, 300, [300], "float16", peak=1.5)
    exact, lse = reference.dense_attention(q, k, v, lens)
    hint = (lse + delta).astype(np.float32)
    plan = DecodePlan(batch=1, heads=4, kv_heads=1, head_dim=64, max_length=300, dtype="float16", samples=16,
                      budget="one_pass", seed=99, block_n=64, santa_min_length=0)
    args = to_gpu(q, k, v, lens)
    hint_g = cupy.asarray(hint)
    runs, drawn = [], []
    for _ in range(600):
        runs.append(plan.run(*args, validate=False, lse_hint=hint_g).copy())
        drawn.append(plan.info().samples_drawn.copy())
        plan.advance()
    est = as_float32(cupy.stack(runs)).astype(np.float64)        # [600, 1, 4, 64]
    mean, se = est.mean(0), est.std(0, ddof=1) / np.sqrt(len(runs))
    z = np.abs(mean - exact) / np.maximum(se, 1e-12)
    assert np.mean(z < 4) > 0.995, f"max z {z.max():.1f}"
    d = cupy.stack(drawn).get().astype(np.float64)              # [600, 1, 4]
    pi = one_pass.inclusion_probabilities(reference.head_scores(q, k, lens), hint.astype(np.float64), 16)
    expected = pi.sum(-1)
    z_rows = np.abs(d.mean(0) - expected) / np.maximum(d.std(0, ddof=1) / np.sqrt(len(d)), 1e-12)
    assert (z_rows < 4).all(), f"rows taken {d.mean(0)} vs expected {expected}"
    assert len({r.get().tobytes() for r in runs[:10]}) > 1, "steps drew identical samples"


def test_one_pass_contracts():
    """Length 0: o = 0, lse = -inf, nothing read; a NaN key: that head NaN, the others finite."""
    import cupy
    rng = np.random.default_rng(5)
    B, H, KVH, D, L = 3, 8, 2, 128, 700
    q, k, v, lens = random_inputs(rng, B, H, KVH, D, L, [700, 1, 300], "bfloat16")
    lens[1] = 0
    nan = spec.from_float32(np.array([np.nan], np.float32), "bfloat16", np)[0]
    k[2, 100, 1, 3] = nan                                    # sequence 2, KV group 1
    plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, budget="one_pass", samples=64,
                      santa_min_length=0)
    plan.out.view(cupy.uint8).fill(0xFF)
    hint = cupy.zeros((B, H), cupy.float32)
    o = as_float32(plan.run(*to_gpu(q, k, v, lens), lse_hint=hint))
    info = plan.info()
    assert np.array_equal(o[1], np.zeros_like(o[1])) and np.isneginf(info.lse.get()[1]).all()
    assert not info.rows_read.get()[1].any() and not info.samples_drawn.get()[1].any()
    assert np.isnan(o[2, 4:]).all() and np.isfinite(o[2, :4]).all() and np.isfinite(o[0]).all()

"""The one-pass Horvitz-Thompson estimator (santa_cupy.one_pass), NumPy reference."""

import numpy as np
import pytest

from santa_cupy import decode_attention, one_pass, reference, spec
from tests.gpu_util import random_inputs


def _inputs(rng, B=2, H=6, KVH=2, D=16, L=300, lengths=(300, 131), peak=2.0, dtype="float32"):
    q = rng.standard_normal((B, H, D)).astype(np.float32) * peak
    k = rng.standard_normal((B, L, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, L, KVH, D)).astype(np.float32)
    conv = lambda x: spec.from_float32(x, dtype, np)  # noqa: E731
    return conv(q), conv(k), conv(v), np.asarray(lengths, np.int32)


def test_madow_takes_each_row_with_its_probability_and_floor_or_ceil_per_tile():
    """Inside a tile the number selected is floor or ceil of sum pi (Madow's design), and over
    uniforms each row's frequency is pi_j (z-test, 4.5 standard errors)."""
    rng = np.random.default_rng(1)
    R, L, BN = 3, 200, 64
    pi = np.minimum(1.0, rng.exponential(0.3, (R, L)))
    pi[0, :10] = 1.0
    n = 4000
    freq = np.zeros((R, L))
    T = -(-L // BN)
    for _ in range(n):
        sel = one_pass.madow_select(pi, rng.random((R, T)).astype(np.float32), BN)
        for t in range(T):
            got = sel[:, t * BN:(t + 1) * BN].sum(-1)
            want = pi[:, t * BN:(t + 1) * BN].sum(-1)
            assert np.all((got == np.floor(want)) | (got == np.ceil(want)))
        freq += sel
    freq /= n
    se = np.sqrt(pi * (1 - pi) / n) + 1e-12
    assert np.all(np.abs(freq - pi) <= 4.5 * se + 1e-9)
    assert np.all(freq[0, :10] == 1.0)                    # pi = 1: always taken


def test_all_heavy_rows_give_the_exact_output():
    """r far below the lse makes every pi 1: every row taken with weight w_j, o exact."""
    rng = np.random.default_rng(2)
    q, k, v, lens = _inputs(rng)
    exact, lse = reference.dense_attention(q, k, v, lens)
    o, info = one_pass.one_pass_attention(q, k, v, lens, samples=4, lse_hint=lse - 40.0, block_n=64)
    assert np.allclose(o, exact, rtol=1e-10, atol=1e-12)
    for b, n in enumerate(lens):
        assert info.selected[b, :, :n].all() and not info.selected[b, :, n:].any()
    assert np.array_equal(info.rows_read, np.repeat(lens[:, None], 2, axis=1))


@pytest.mark.parametrize("shift", [0.0, 1.5, -1.0])
def test_unbiased_over_seeds_for_any_normaliser(shift):
    """E[o^] = o for r = lse + shift (a stale guess moves cost and error, never the mean): every
    coordinate's mean over 500 seeds within 4.5 standard errors of the exact output."""
    rng = np.random.default_rng(3)
    q, k, v, lens = _inputs(rng, B=1, H=4, KVH=2, L=257, lengths=(257,))
    exact, lse = reference.dense_attention(q, k, v, lens)
    runs = np.stack([one_pass.one_pass_attention(q, k, v, lens, samples=32, lse_hint=lse + shift, seed=s,
                                                 block_n=64)[0] for s in range(500)])
    mean, se = runs.mean(0), runs.std(0, ddof=1) / np.sqrt(len(runs))
    z = np.abs(mean - exact) / np.maximum(se, 1e-12)
    assert z.max() < 4.5, f"max z {z.max():.2f}"
    assert np.all(se > 0), "the estimate never varied: the test would not see a bias"


def test_a_biased_variant_is_caught():
    """The z-test above has power: dropping the 1/pi weight (plain gather of selected rows with
    weight w_j) is biased and fails it by far."""
    rng = np.random.default_rng(3)
    q, k, v, lens = _inputs(rng, B=1, H=4, KVH=2, L=257, lengths=(257,))
    exact, lse = reference.dense_attention(q, k, v, lens)
    vf = reference.to_float64(v)
    outs = []
    for s in range(200):
        _, info = one_pass.one_pass_attention(q, k, v, lens, samples=32, lse_hint=lse, seed=s, block_n=64)
        w = np.exp(reference.head_scores(q, k, lens) - lse[..., None])
        biased = np.where(info.selected, w, 0.0)                         # no 1/pi
        outs.append(np.einsum("bkgl,blkd->bkgd", biased.reshape(1, 2, 2, -1), vf).reshape(1, 4, -1))
    outs = np.stack(outs)
    se = outs.std(0, ddof=1) / np.sqrt(len(outs))
    assert (np.abs(outs.mean(0) - exact) / np.maximum(se, 1e-12)).max() > 10


def test_rows_expected_reproducible_and_validated():
    rng = np.random.default_rng(4)
    q, k, v, lens = _inputs(rng)
    _, lse = reference.dense_attention(q, k, v, lens)
    o1, i1 = one_pass.one_pass_attention(q, k, v, lens, samples=64, seed=7, step=3)
    o2, i2 = one_pass.one_pass_attention(q, k, v, lens, samples=64, seed=7, step=3)
    o3, i3 = one_pass.one_pass_attention(q, k, v, lens, samples=64, seed=7, step=4)
    assert np.array_equal(o1, o2) and np.array_equal(i1.selected, i2.selected)
    assert not np.array_equal(i1.selected, i3.selected)                 # a new step draws anew
    assert np.allclose(i1.lse, lse) and np.allclose(i1.lse_hint, lse)   # None: the exact lse
    # mean selected rows over seeds = sum pi (each tile's count is unbiased): a z-test, 4.5 standard
    # errors of the 50-seed mean (a count that never varies must equal sum pi up to rounding)
    counts = np.stack([one_pass.one_pass_attention(q, k, v, lens, samples=64, seed=s)[1].selected.sum(-1)
                       for s in range(50)])
    se = counts.std(0, ddof=1) / np.sqrt(len(counts))
    assert (np.abs(counts.mean(0) - i1.expected_rows) <= 4.5 * se + 1e-6 * np.maximum(1.0, i1.expected_rows)).all()
    with pytest.raises(ValueError, match="lse_hint"):
        one_pass.one_pass_attention(q, k, v, lens, lse_hint=np.zeros((2, 5)))
    with pytest.raises(ValueError, match="lse_hint"):
        one_pass.one_pass_attention(q, k, v, lens, lse_hint=np.full((2, 6), np.nan))
    with pytest.raises(ValueError, match="samples"):
        one_pass.one_pass_attention(q, k, v, lens, samples=0)


def test_one_pass_numpy_path_and_validation():
    rng = np.random.default_rng(0)
    q, k, v, lens = random_inputs(rng, 2, 4, 2, 64, 300, [300, 77], "bfloat16")
    s = reference.head_scores(q, k, lens); m = s.max(-1); lse = m + np.log(np.exp(s - m[..., None]).sum(-1))
    hint = lse.astype(np.float32)
    o, info = decode_attention(q, k, v, lens, budget="one_pass", samples=32, lse_hint=hint, seed=1, return_info=True)
    want, op = one_pass.one_pass_attention(q, k, v, lens, samples=32, lse_hint=hint.astype(np.float64), seed=1)
    assert np.array_equal(o, spec.from_float32(want.astype(np.float32), "bfloat16", np))
    assert np.array_equal(info.samples_drawn, op.selected.sum(-1)) and info.counts is None
    with pytest.raises(ValueError, match="needs lse_hint"):
        decode_attention(q, k, v, lens, budget="one_pass")
    with pytest.raises(ValueError, match="lse_hint must be"):
        decode_attention(q, k, v, lens, budget="one_pass", lse_hint=hint[:1])
    with pytest.raises(ValueError, match="finite"):
        decode_attention(q, k, v, lens, budget="one_pass", lse_hint=np.full_like(hint, np.nan))
    with pytest.raises(ValueError, match="lse_hint is for"):
        decode_attention(q, k, v, lens, budget="global", lse_hint=hint)
    with pytest.raises(ValueError, match="systematic"):
        decode_attention(q, k, v, lens, budget="one_pass", sampler="iid", lse_hint=hint)

"""The systematic comb inside a tile stays unbiased up to spec.MAX_SAMPLES (issue 15: float32
arithmetic quantises comb points at large S). One tile holding every sample, peaked: a heavy row
of ~54% mass and 127 light ones. For the systematic sampler a row's count is floor(S p) or
ceil(S p), a Bernoulli of the fractional part per seed, which gives each row's standard error."""

import numpy as np
import pytest

from santa_cupy import reference, rng, spec

SEEDS = 1000


def _peaked_tile():
    gen = np.random.default_rng(0)
    D, L = 64, 128
    q = np.zeros((1, 1, D), np.float32)
    q[0, 0, 0] = 1.0
    k = np.zeros((1, L, 1, D), np.float32)
    k[0, :, 0, 0] = gen.normal(0, 1.0, L).astype(np.float32)
    k[0, 5, 0, 0] = 40.0                                        # the heavy row
    lens = np.array([L], np.int32)
    s = reference.head_scores(q, k, lens)[0]                     # [1, L]
    p = np.exp(s[0] - s[0].max())
    return s, p / p.sum(), L


def _max_z(samples):
    """max over rows of |mean count - S p| / its standard error, over SEEDS seeds."""
    s, p, L = _peaked_tile()
    keys = rng.head_key(np.arange(SEEDS), 0, 0, 0, 0)
    counts = np.stack([reference.counts_from_scores(s, keys[i:i + 1], L, samples=samples, sampler="systematic",
                                                    budget="global", block_n=128)[0] for i in range(SEEDS)])
    assert (counts.sum(-1) == samples).all()
    frac = samples * p - np.floor(samples * p)
    se = np.sqrt(np.maximum(frac * (1 - frac), 1.0 / SEEDS) / SEEDS)
    return float((np.abs(counts.mean(0) - samples * p) / se).max())


def test_comb_unbiased_at_max_samples():
    assert _max_z(spec.MAX_SAMPLES) < 4.5


def test_the_cap_is_where_float32_stops_holding():
    """The same test at 2^20 samples (past the cap, through the unvalidated stage) sees the bias:
    the reason for the cap, and the test's power."""
    assert _max_z(1 << 20) > 10
    with pytest.raises(ValueError, match="samples"):
        spec.check_samples(1 << 20)

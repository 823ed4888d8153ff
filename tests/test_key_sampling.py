"""Score-stage (key) sampling reference: unbiasedness, reproducibility, K fraction, validation.

Statistical tests draw N = SEEDS x REPLICAS independent realisations: seeds 0..SEEDS-1, each on a
batch of REPLICAS copies of one sequence (batch index b is an RNG field, so copies draw
independently). A score estimate passes when every entry is within Z_MAX standard errors of the
exact score. The inputs and seeds are fixed, so each test is deterministic; with 64 entries and
Z_MAX = 4.5 an unbiased estimator would fail with probability ~4e-4 per test on fresh seeds.
"""

import numpy as np
import pytest

from santa_cupy import key_sampling as ks
from santa_cupy import reference as ref
from santa_cupy import rng, spec

SEEDS = 20
REPLICAS = 150  # N = 3000 realisations
Z_MAX = 4.5
H, KVH, D, L = 4, 2, 64, 16
MASK = (1 << 64) - 1


def make_case(seed=0, L=L, heavy=True):
    """One sequence: q [1, H, D] with block-dependent magnitudes, K [1, L, KVH, D] with
    feature-dependent mean and spread (as real keys have), V like K."""
    rs = np.random.default_rng(seed)
    q = rs.standard_normal((1, H, D))
    if heavy:
        q *= np.exp(rs.standard_normal((1, H, D)))  # heavy-tailed magnitudes: p_i spread over (0, 1]
        q[:, :, 16:32] *= 0.2  # a weak block
    k = rs.standard_normal((1, L, KVH, D)) * rs.uniform(0.2, 3.0, (1, 1, KVH, D)) + rs.normal(0, 2, (1, 1, KVH, D))
    v = rs.standard_normal((1, L, KVH, D))
    return q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), np.array([L])


def realisations(q, k, options, seeds=SEEDS, replicas=REPLICAS):
    """Scores [N, H, L] float64 and group fractions [N, KVH] over seeds x replicas."""
    qr, kr = np.repeat(q, replicas, 0), np.repeat(k, replicas, 0)
    lens = np.full(replicas, k.shape[1])
    scores, fractions = [], []
    for seed in range(seeds):
        s, info = ks.key_scores(qr, kr, lens, seed=seed, step=3, layer=5, out_dtype=np.float64, **options)
        scores.append(s)
        fractions.append(info.group_fraction)
    return np.concatenate(scores), np.concatenate(fractions)


def max_z(samples, exact):
    """Largest |mean - exact| / standard error over entries; entries without spread must be exact."""
    err = np.abs(samples.mean(axis=0) - exact)
    se = samples.std(axis=0, ddof=1) / np.sqrt(samples.shape[0])
    fixed = se == 0
    assert np.all(err[fixed] <= 1e-9 * (1 + np.abs(exact[fixed]))), "a zero-variance entry is off"
    return float((err[~fixed] / se[~fixed]).max()) if np.any(~fixed) else 0.0


ESTIMATORS = [
    dict(key_sampling="bernoulli", key_draws=1, key_crn=True),
    dict(key_sampling="bernoulli", key_draws=4, key_crn=False),
    dict(key_sampling="bernoulli", key_draws=4, key_crn=True, key_combine="union"),
    dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.5, key_rule="qmax"),
    dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.75, key_rule="qkvar", key_draws=2),
    dict(key_sampling="bernoulli_block", key_block=32, key_budget=0.6, key_rule="qrms", key_combine="union",
         key_draws=3),
    dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.3, key_rule="uniform"),
    dict(key_sampling="bernoulli_block", key_block=16, key_variance=0.5, key_rule="qkvar"),
]


def label(options):
    return "-".join(f"{v}" for v in options.values())


# ---------------------------------------------------------------------------- unbiasedness


@pytest.mark.parametrize("options", ESTIMATORS, ids=label)
def test_scores_are_unbiased(options):
    q, k, _, lens = make_case()
    exact = ref.head_scores(q, k, lens)[0]
    samples, _ = realisations(q, k, options)
    assert samples.std(axis=0).max() > 0  # the estimator is random
    assert max_z(samples, exact) <= Z_MAX


def test_the_z_test_catches_a_missing_horvitz_thompson_weight():
    """Power: the same block masks without the 1/pi weight are biased, and max_z sees it."""
    q, k, _, lens = make_case()
    exact = ref.head_scores(q, k, lens)[0]
    options = dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.75, key_rule="qmax")
    qr, kr = np.repeat(q, REPLICAS, 0), np.repeat(k, REPLICAS, 0)
    biased = []
    for seed in range(SEEDS):
        _, info = ks.key_scores(qr, kr, np.full(REPLICAS, L), seed=seed, **options)
        weight = info.selected.mean(axis=2)  # [B, KVH, C]: the HT estimator divides this by pi
        q_bar = qr.reshape(REPLICAS, KVH, H // KVH, 4, 16) * weight[:, :, None, :, None]
        biased.append(ref.head_scores(q_bar.reshape(REPLICAS, H, D), kr, np.full(REPLICAS, L)))
    assert 0 < info.prob.min() < 1
    assert max_z(np.concatenate(biased), exact) > 3 * Z_MAX


def test_union_combine_never_has_more_variance_than_mean():
    q, k, _, _ = make_case()
    for base in (dict(key_sampling="bernoulli", key_crn=True),
                 dict(key_sampling="bernoulli_block", key_budget=0.6, key_rule="qmax")):
        var = {}
        for combine in ks.KEY_COMBINES:
            s, f = realisations(q, k, dict(base, key_draws=4, key_combine=combine), seeds=8)
            var[combine] = s.var(axis=0).sum()
        assert var["union"] < 0.9 * var["mean"], (base, var)


def test_mean_combine_variance_falls_as_one_over_R():
    q, k, _, _ = make_case()
    var = {R: realisations(q, k, dict(key_sampling="bernoulli", key_draws=R), seeds=8)[0].var(axis=0).sum()
           for R in (1, 4)}
    assert 3.4 < var[1] / var[4] < 4.6, var  # independent draws; relative error of each variance ~3%


# --------------------------------------------------------------------------- key fraction


@pytest.mark.parametrize("crn", [True, False])
@pytest.mark.parametrize("sector_features", [4, 16])
def test_bernoulli_sector_fraction_matches_its_expectation(crn, sector_features):
    q, k, _, _ = make_case(seed=2)
    q = q * np.exp(2 * np.random.default_rng(7).standard_normal(q.shape)).astype(np.float32)  # sparser p
    options = dict(key_sampling="bernoulli", key_draws=2, key_crn=crn, sector_features=sector_features)
    _, fractions = realisations(q, k, options, seeds=4)
    _, info = ks.key_scores(q, k, np.array([L]), **options)
    expected = info.expected_group_fraction[0]  # [KVH]
    assert max_z(fractions, expected) <= Z_MAX
    if sector_features == 4:
        assert np.all(expected < 0.99)  # a non-trivial case


def test_expected_sector_fraction_formula_on_a_hand_case():
    p = np.zeros((1, 2, 64), dtype=np.float32)  # one group of two heads
    p[0, 0, :16] = 0.5
    p[0, 1, :16] = 0.25
    p[0, 1, 16] = 1.0
    crn = ks.expected_sector_fraction(p, 2, 1, True, 16)
    ind = ks.expected_sector_fraction(p, 2, 1, False, 16)
    # sector 0 missed with (1 - 0.5)^16 (CRN) or (0.5 * 0.75)^16 (independent); sector 1 always read
    np.testing.assert_allclose(crn, [[(2 - 0.5**16) / 4]], rtol=1e-12)
    np.testing.assert_allclose(ind, [[(2 - 0.375**16) / 4]], rtol=1e-12)


def test_crn_reads_fewer_features_than_independent_heads():
    q, k, _, lens = make_case(seed=3)
    used = {crn: np.mean([ks.key_scores(q, k, lens, key_sampling="bernoulli", key_draws=2, key_crn=crn,
                                        seed=s)[1].feature_fraction for s in range(200)]) for crn in (True, False)}
    assert used[True] < used[False] - 0.02, used


@pytest.mark.parametrize("R", [1, 3])
@pytest.mark.parametrize("rule", ks.KEY_RULES)
def test_block_expected_fraction_is_the_budget_and_matches_the_empirical_one(rule, R):
    q, k, _, _ = make_case(seed=4)
    options = dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.55, key_rule=rule, key_draws=R)
    _, fractions = realisations(q, k, options, seeds=4)
    _, info = ks.key_scores(q, k, np.array([L]), **options)
    np.testing.assert_allclose(info.expected_group_fraction, 0.55, atol=1e-6)
    assert max_z(fractions, info.expected_group_fraction[0]) <= Z_MAX
    assert np.all(info.prob <= 1) and np.all(info.prob > 0)


def test_block_key_fraction_is_blocks_read_over_blocks():
    q, k, _, _ = make_case()
    q2, k2 = np.repeat(q, 2, 0), np.repeat(k, 2, 0)
    lens = np.array([L, 4])
    _, info = ks.key_scores(q2, k2, lens, key_sampling="bernoulli_block", key_budget=0.5, key_draws=2, seed=1)
    assert info.read.shape == (2, KVH, 4)
    np.testing.assert_array_equal(info.read, info.selected.any(axis=2))
    np.testing.assert_array_equal(info.group_fraction, info.read.mean(axis=-1))
    weights = np.array([L, 4])[:, None] * np.ones((1, KVH))
    assert info.key_fraction == pytest.approx((info.group_fraction * weights).sum() / weights.sum())


def test_block_with_zero_query_block_is_never_read_and_exact_there():
    q, k, _, lens = make_case()
    q[:, :, :16] = 0.0  # block 0 is zero for every head
    _, info = ks.key_scores(q, k, lens, key_sampling="bernoulli_block", key_budget=1.0, key_rule="qmax")
    np.testing.assert_array_equal(info.prob[..., 0], 0.0)
    np.testing.assert_array_equal(info.prob[..., 1:], 1.0)  # budget 1 cannot be spent: the rest is read
    np.testing.assert_allclose(info.expected_group_fraction, 0.75)
    s, _ = ks.key_scores(q, k, lens, key_sampling="bernoulli_block", key_budget=1.0, key_rule="qmax",
                         out_dtype=np.float64)
    np.testing.assert_allclose(s, ref.head_scores(q, k, lens), rtol=1e-12, atol=1e-12)


def test_given_key_variance_equals_the_computed_one():
    q, k, _, _ = make_case()
    q2, k2, lens = np.repeat(q, 2, 0), np.repeat(k, 2, 0), np.array([L, 7])
    k_var = ks.key_feature_variance(k2, lens)
    np.testing.assert_allclose(k_var[1], k2[1, :7].astype(float).var(axis=0), rtol=1e-12)
    options = dict(key_sampling="bernoulli_block", key_rule="qkvar", key_budget=0.5, seed=4)
    s1, i1 = ks.key_scores(q2, k2, lens, **options)
    s2, i2 = ks.key_scores(q2, k2, lens, k_var=k_var, **options)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(i1.prob, i2.prob)
    with pytest.raises(ValueError, match="k_var must have shape"):
        ks.key_scores(q2, k2, lens, k_var=k_var[:, :1], **options)


@pytest.mark.parametrize("R,combine", [(1, "mean"), (3, "mean"), (3, "union")])
def test_variance_target_is_met_by_the_fewest_blocks(R, combine):
    rs = np.random.default_rng(5)
    w = rs.uniform(0.1, 3.0, (50, 4))
    target = rs.uniform(0.05, 2.0, 50)
    pi = ks.block_probabilities_for_variance(w, target, R, combine).astype(float)
    v = (1 / pi - 1) / R if combine == "mean" else 1 / (1 - (1 - pi) ** R) - 1
    model = (w * w * v).sum(axis=-1)
    capped = (pi >= 1).all(axis=-1)
    np.testing.assert_allclose(model[~capped], target[~capped], rtol=1e-5)
    # proportional to w below the cap
    ratio = np.where(pi < 1, pi / w, np.nan)
    np.testing.assert_allclose(np.nanmax(ratio, axis=-1), np.nanmin(ratio, axis=-1), rtol=1e-5)


def test_variance_target_reads_more_where_scores_spread_more():
    q, k, _, lens = make_case()
    options = dict(key_sampling="bernoulli_block", key_rule="qkvar", key_variance=0.5)
    _, small = ks.key_scores(q, k, lens, **options)
    _, large = ks.key_scores(q * 3, k, lens, **options)  # 9x the score variance
    assert np.all(large.expected_group_fraction > small.expected_group_fraction)
    k_var = ks.key_feature_variance(k, lens)
    w = ks.block_weights(q, KVH, 16, "qkvar", k_var) / np.sqrt(D)
    model = (w**2 * (1 / small.prob.astype(float) - 1)).sum(axis=-1)
    np.testing.assert_allclose(model, (H // KVH) * 0.5, rtol=1e-5)


def test_block_probabilities_solve_the_budget():
    w = np.array([[4.0, 1.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0]])
    pi = ks.block_probabilities(w, 0.5)
    np.testing.assert_allclose(pi.mean(axis=-1), 0.5, atol=1e-6)
    assert pi[0, 0] == 1.0  # capped, the rest proportional to w
    np.testing.assert_allclose(pi[0, 1:] / w[0, 1:], pi[0, 1] / w[0, 1], rtol=1e-6)
    np.testing.assert_allclose(pi[1], 0.5)
    pi3 = ks.block_probabilities(w, 0.5, R=3)
    np.testing.assert_allclose((1 - (1 - pi3.astype(float)) ** 3).mean(axis=-1), 0.5, atol=1e-6)



def _bisected_pi(w, budget, steps=80):
    """One draw's pi by the 80-step bisection on lam that block_probabilities ran before its
    closed form (its read fraction, in its order): on ordinary weights the closed form must give
    the same float32 pi."""
    positive = w > 0
    lam_hi = 1.0 / np.where(positive, w, np.inf).min(axis=-1, keepdims=True)
    lo, hi = np.zeros_like(lam_hi), lam_hi
    for _ in range(steps):
        mid = 0.5 * (lo + hi)
        over = ks._read_fraction(np.minimum(1.0, mid * w), 1)[..., None] > budget
        hi, lo = np.where(over, mid, hi), np.where(over, lo, mid)
    return np.minimum(1.0, hi * w).astype(np.float32)


@pytest.mark.parametrize("C", [2, 4, 8])
def test_one_draw_closed_form_equals_the_bisection(C):
    rng = np.random.default_rng(C)
    w = rng.lognormal(0.0, 1.5, size=(2000, C))
    w[rng.random(w.shape) < 0.15] = 0.0
    w[:100] = np.round(w[:100], 1)  # ties
    for budget in (0.1, 0.25, 0.5, 0.8):
        rows = (w > 0).sum(axis=-1) > C * budget  # reachable: fewer blocks would all be read
        pi = ks.block_probabilities(w[rows], budget)
        np.testing.assert_array_equal(pi, _bisected_pi(w[rows], budget))
        np.testing.assert_allclose(pi.astype(float).mean(axis=-1), budget, atol=1e-6)


def test_one_draw_closed_form_is_exact_where_the_bisection_was_not():
    """A block weight 1e-20 of the others (a near-zero query block): the bisection starts at
    lam_hi = 1 / w_min = 1e20 and its 80 halvings end ~1e-4 wide, off the budget by ~3e-5; the
    closed form's read fraction is the budget to float32 rounding."""
    w = np.array([[1e-20, 1.0, 1.0, 1.0], [2e-21, 2.0, 5.0, 1.0]])
    for budget in (0.5, 0.7):
        closed = ks.block_probabilities(w, budget).astype(float)
        np.testing.assert_allclose(closed.mean(axis=-1), budget, atol=1e-7)
        assert np.abs(_bisected_pi(w, budget).astype(float).mean(axis=-1) - budget).min() > 1e-5

# ----------------------------------------------------------------------- reproducibility


def py_mix64(z):
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_key_sampling_uniform(seed, step, layer, b, unit, r, i):
    """rng.py's documented formula, in Python integers."""
    x = py_mix64((seed & MASK) ^ 0x9E3779B97F4A7C15)
    x = py_mix64(x ^ step)
    x = py_mix64(x ^ ((layer << 32) | b))
    key = py_mix64(x ^ (unit << 32))
    return (py_mix64(py_mix64(key ^ 0xFFFFFFFE) ^ ((r << 32) | i)) >> 40) * 2.0**-24


def test_key_sampling_uniform_follows_the_documented_formula():
    for args in [(0, 0, 0, 0, 0, 0, 0), (7, 3, 29, 1, rng.GROUP_UNIT | 2, 5, 63), (2**64 - 1, 10**9, 1, 9, 8, 255, 1)]:
        assert float(rng.key_sampling_uniform(*args)) == py_key_sampling_uniform(*args)
    # a stream apart from the value stage's: same key, tile fields differ
    key = rng.head_key(1, 2, 3, 0, 0)
    assert float(rng.key_sampling_uniform(1, 2, 3, 0, 0, 0, 0)) != float(rng.uniform(key, 0, 0))


def test_block_masks_are_u_below_pi_from_the_group_stream():
    q, k, _, lens = make_case()
    seed, step, layer = 11, 4, 2
    _, info = ks.key_scores(q, k, lens, key_sampling="bernoulli_block", key_budget=0.5, key_draws=3,
                            seed=seed, step=step, layer=layer)
    for g in range(KVH):
        for r in range(3):
            for c in range(4):
                u = py_key_sampling_uniform(seed, step, layer, 0, rng.GROUP_UNIT | g, r, c)
                assert info.selected[0, g, r, c] == (u < float(info.prob[0, g, c]))


@pytest.mark.parametrize("crn", [True, False])
def test_bernoulli_masks_are_u_below_p(crn):
    q, k, _, lens = make_case()
    _, info = ks.key_scores(q, k, lens, key_sampling="bernoulli", key_draws=2, key_crn=crn, seed=5)
    alpha = np.abs(q).max(axis=-1, keepdims=True)
    np.testing.assert_array_equal(info.prob, (np.abs(q) / alpha).astype(np.float32))
    for h in range(H):
        unit = (rng.GROUP_UNIT | (h // (H // KVH))) if crn else h
        for r in range(2):
            for i in range(0, D, 7):
                u = py_key_sampling_uniform(5, 0, 0, 0, unit, r, i)
                assert info.selected[0, h, r, i] == (u < float(info.prob[0, h, i]))


@pytest.mark.parametrize("options", ESTIMATORS, ids=label)
def test_reproducible_given_the_seed_and_different_otherwise(options):
    q, k, _, lens = make_case()
    base = dict(seed=3, step=1, layer=2)
    s1, i1 = ks.key_scores(q, k, lens, **base, **options)
    s2, i2 = ks.key_scores(q, k, lens, **base, **options)
    np.testing.assert_array_equal(s1, s2)
    np.testing.assert_array_equal(i1.selected, i2.selected)
    for field in ("seed", "step", "layer"):  # a block case has 8 random bits: try a few values
        changed = [ks.key_scores(q, k, lens, **dict(base, **{field: base[field] + d}), **options)[1].selected
                   for d in (1, 2, 3)]
        assert not all(np.array_equal(i1.selected, c) for c in changed), field


# ---------------------------------------------------------------------- exact paths, dtypes


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.float64])
def test_none_gives_the_exact_scores(dtype):
    q, k, _, lens = make_case()
    if dtype == "bfloat16":
        q, k = spec.from_float32(q, "bfloat16"), spec.from_float32(k, "bfloat16")
    else:
        q, k = q.astype(dtype), k.astype(dtype)
    s, info = ks.key_scores(q, k, lens, key_sampling="none", out_dtype=np.float64)
    np.testing.assert_array_equal(s, ref.head_scores(q, k, lens))
    assert info.key_fraction == 1.0
    s32, _ = ks.key_scores(q, k, lens, key_sampling="bernoulli_block", key_budget=1.0)
    assert s32.dtype == np.float32 and s32.shape == (1, H, L)


def test_scores_past_the_length_are_minus_inf():
    q, k, _, _ = make_case()
    s, _ = ks.key_scores(q, k, np.array([5]), key_sampling="bernoulli", key_draws=2)
    assert np.all(np.isneginf(s[..., 5:])) and np.all(np.isfinite(s[..., :5]))


def test_attention_without_key_sampling_equals_the_reference():
    q, k, v, lens = make_case(L=300)
    o, lse, info, counts = ks.key_sampled_attention(q, k, v, lens, key_sampling="none")
    o_ref, lse_ref = ref.dense_attention(q, k, v, lens)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12)
    assert counts is None and info.key_fraction == 1.0
    o, _, _, counts = ks.key_sampled_attention(q, k, v, lens, key_sampling="none", value="santa", samples=64,
                                               block_n=64, seed=9, step=2, layer=1)
    o_ref, _, _, _, counts_ref = ref.santa_attention(q, k, v, lens, samples=64, block_n=64, seed=9, step=2, layer=1)
    np.testing.assert_array_equal(counts, counts_ref)
    np.testing.assert_allclose(o, o_ref, rtol=1e-12, atol=1e-12)


def test_attention_on_sampled_scores_uses_those_scores():
    q, k, v, lens = make_case(L=200)
    options = dict(key_sampling="bernoulli_block", key_budget=0.5, key_rule="qkvar", seed=2)
    o, lse, info, _ = ks.key_sampled_attention(q, k, v, lens, **options)
    s, info2 = ks.key_scores(q, k, lens, out_dtype=np.float64, **options)
    p = np.exp(s[0] - s[0].max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    expected = np.stack([p[h] @ v[0, :, h // 2].astype(float) for h in range(H)])
    np.testing.assert_allclose(o[0], expected, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(info.selected, info2.selected)
    assert 0.25 <= info.key_fraction <= 0.75


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "options,match",
    [
        (dict(key_sampling="gumbel"), "key_sampling must be one of"),
        (dict(key_draws=0), r"key_draws must be in \[1, 256\]"),
        (dict(key_draws=1.5), "key_draws must be an int"),
        (dict(key_draws=True), "key_draws must be an int"),
        (dict(key_block=8), r"key_block must be one of \(16, 32\)"),
        (dict(key_budget=0.0), r"key_budget must be in \(0, 1\]"),
        (dict(key_budget=1.5), r"key_budget must be in \(0, 1\]"),
        (dict(key_budget="half"), "key_budget must be a real number"),
        (dict(key_rule="oracle"), "key_rule must be one of"),
        (dict(key_combine="median"), "key_combine must be one of"),
        (dict(key_crn="yes"), "key_crn must be a bool"),
        (dict(sector_features=3), "must be a multiple of sector_features=3"),
        (dict(sector_features=0), r"sector_features must be in \[1, 64\]"),
        (dict(out_dtype=np.int32), "out_dtype must be float32 or float64"),
        (dict(key_variance=0.0), "key_variance must be None or a finite real > 0"),
        (dict(key_variance=np.inf), "key_variance must be None or a finite real > 0"),
        (dict(key_variance=0.1, key_rule="qmax"), 'key_variance needs key_rule="qkvar"'),
        (dict(seed=-1), "seed must be in"),
        (dict(layer=2**32), "layer must be in"),
    ],
)
def test_bad_options_raise_value_errors(options, match):
    q, k, _, lens = make_case()
    with pytest.raises(ValueError, match=match):
        ks.key_scores(q, k, lens, **options)


def test_bad_shapes_raise_value_errors():
    q, k, v, lens = make_case()
    with pytest.raises(ValueError, match="q must have rank 3"):
        ks.key_scores(q[0], k, lens)
    with pytest.raises(ValueError, match="lengths must be in"):
        ks.key_scores(q, k, np.array([L + 1]))
    with pytest.raises(ValueError, match="must be a multiple of k_cache KV heads"):
        ks.key_scores(q[:, :3], k, lens)
    with pytest.raises(ValueError, match="value must be one of"):
        ks.key_sampled_attention(q, k, v, lens, value="sparse")
    with pytest.raises(ValueError, match="v_cache shape"):
        ks.key_sampled_attention(q, k, v[:, :4], lens)

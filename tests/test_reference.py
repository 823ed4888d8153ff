"""float64 NumPy reference: dense attention, the sampling contract and the SANTA estimators."""

import itertools

import numpy as np
import pytest

from santa_cupy import reference as ref
from santa_cupy import rng, spec

SEEDS = 2000  # independent draws for the statistical tests
N_ROWS = 200  # 4 tiles of 64 (64, 64, 64, 8)
BN = 64
D_SMALL = 8


# ------------------------------------------------------------------------------------ helpers


def make_inputs(B=2, H=4, KVH=2, D=64, L=300, lengths=(300, 150), dtype=np.float32, q_scale=2.0, seed=0):
    rs = np.random.default_rng(seed)
    q = (rs.standard_normal((B, H, D)) * q_scale).astype(np.float32)
    k = rs.standard_normal((B, L, KVH, D)).astype(np.float32)
    v = rs.standard_normal((B, L, KVH, D)).astype(np.float32)
    if dtype == "bfloat16":
        q, k, v = (spec.from_float32(x, "bfloat16") for x in (q, k, v))
    else:
        q, k, v = (x.astype(dtype) for x in (q, k, v))
    return q, k, v, np.asarray(lengths, dtype=np.int64)


def softmax64(s):
    e = np.exp(s - s.max())
    return e / e.sum()


def score_case(kind, seed=1):
    """One head's scores [N_ROWS] and values [N_ROWS, D_SMALL]."""
    rs = np.random.default_rng(seed)
    v = rs.standard_normal((N_ROWS, D_SMALL))
    if kind == "flat":
        return np.zeros(N_ROWS), v
    if kind == "heavy":  # log-normal weights: a few rows carry most of the mass, S*p_j fractional
        return rs.standard_normal(N_ROWS) * 3.5, v
    s = rs.standard_normal(N_ROWS) * 0.5
    s[[10, 75, 140, 196]] += [6.0, 5.0, 4.0, 5.5]  # a spike in every tile
    return s, v


def draws(scores, v, *, samples, sampler, budget, seeds=SEEDS):
    """o_hat [seeds, D], spread [seeds], counts [seeds, n] over seeds 0..seeds-1 of one head."""
    n = scores.shape[0]
    keys = rng.head_key(np.arange(seeds), 0, 0, 0, 0)
    rows = np.broadcast_to(scores, (seeds, n))
    counts = ref.counts_from_scores(rows, keys, n, samples=samples, sampler=sampler, budget=budget, block_n=BN)
    o, spread = ref.estimate(counts, rows, v[None], samples=samples, budget=budget, block_n=BN)
    return o, spread, counts


def tile_slices(n, block_n=BN):
    return [slice(t * block_n, min((t + 1) * block_n, n)) for t in range(ref.num_tiles(n, block_n))]


# ------------------------------------------------------------------------------------ dense


def naive_attention(q, k, v, lengths, scale):
    """Per-head Python loop, float64."""
    q, k, v = (ref.to_float64(x) for x in (q, k, v))
    B, H, D = q.shape
    G = H // k.shape[2]
    o = np.zeros((B, H, D))
    lse = np.zeros((B, H))
    for b in range(B):
        for h in range(H):
            g = h // G
            s = [scale * float(np.dot(q[b, h], k[b, j, g])) for j in range(int(lengths[b]))]
            m = max(s)
            w = [np.exp(x - m) for x in s]
            z = sum(w)
            o[b, h] = sum(wj * v[b, j, g] for j, wj in enumerate(w)) / z
            lse[b, h] = m + np.log(z)
    return o, lse


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16", np.float64])
def test_dense_matches_naive_loop(dtype):
    q, k, v, lengths = make_inputs(B=2, H=6, KVH=2, L=40, lengths=(40, 7), dtype=dtype)
    o, lse = ref.dense_attention(q, k, v, lengths, scale=0.3)
    o_naive, lse_naive = naive_attention(q, k, v, lengths, 0.3)
    np.testing.assert_allclose(o, o_naive, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_naive, rtol=1e-12, atol=1e-12)


def test_dense_ignores_rows_past_length():
    q, k, v, lengths = make_inputs(L=300, lengths=(300, 150))
    k2, v2 = k.copy(), v.copy()
    k2[1, 150:] = 1e4
    v2[1, 150:] = np.nan
    o1, _ = ref.dense_attention(q, k, v, lengths)
    o2, _ = ref.dense_attention(q, k2, v2, lengths)
    np.testing.assert_array_equal(o1, o2)


# ------------------------------------------------------------------------------------ stages


def test_tile_stats_values():
    rs = np.random.default_rng(3)
    s = rs.standard_normal((3, 150)) * 3
    st = ref.tile_stats(s, 150, 64)
    assert st.m.shape == (3, 3) and st.cum.shape == (3, 3, 64) and st.m.dtype == np.float32
    np.testing.assert_array_equal(st.valid, [64, 64, 22])
    for t, sl in enumerate(tile_slices(150)):
        np.testing.assert_array_equal(st.m[:, t], s[:, sl].astype(np.float32).max(axis=1))
        l64 = np.exp(s[:, sl] - s[:, sl].max(axis=1, keepdims=True)).sum(axis=1)
        np.testing.assert_allclose(st.l[:, t], l64, rtol=1e-5)
    assert np.all(np.diff(st.cum, axis=-1) >= 0)
    np.testing.assert_array_equal(st.cum[:, 2, 22:], st.l[:, 2:3].repeat(42, axis=1))


def test_tile_draws_sums_each_tile_at_awkward_lengths():
    """tile_draws: per-tile sums of counts [..., L], the last tile partial (L not a multiple)."""
    rs = np.random.default_rng(5)
    for L, block_n in ((1, 64), (63, 64), (129, 64), (300, 128)):
        counts = rs.integers(0, 4, size=(2, 3, L)).astype(np.int32)
        got = ref.tile_draws(counts, block_n)
        assert got.shape == (2, 3, ref.num_tiles(L, block_n))
        want = np.stack([counts[..., t * block_n:(t + 1) * block_n].sum(-1) for t in range(got.shape[-1])], -1)
        assert np.array_equal(got, want) and got.sum() == counts.sum()


def test_global_prefix_properties():
    rs = np.random.default_rng(4)
    m = (rs.standard_normal((50, 7)) * 20).astype(np.float32)
    l = rs.uniform(1, 64, (50, 7)).astype(np.float32)
    pre = ref.global_prefix(m, l, samples=37)
    assert np.all(pre.C[:, -1] == 1.0) and np.all(pre.C_prev[:, 0] == 0.0)
    assert np.all(np.diff(pre.C, axis=1) >= 0) and np.all(pre.w >= 0)
    W = np.exp(m.astype(float) - m.max(axis=1, keepdims=True)) * l
    np.testing.assert_allclose(pre.w, W / W.sum(axis=1, keepdims=True), atol=1e-15)
    assert np.all(pre.S_lr.sum(axis=1) == 37)
    assert np.all(np.abs(pre.S_lr - 37 * pre.w) < 1)


def test_hamilton_ties_go_to_lower_tile():
    w = np.array([[0.25, 0.25, 0.25, 0.25], [0.5, 0.1, 0.2, 0.2]])
    np.testing.assert_array_equal(ref.hamilton(w, 2), [[1, 1, 0, 0], [1, 0, 1, 0]])
    np.testing.assert_array_equal(ref.hamilton(w, 3), [[1, 1, 1, 0], [1, 0, 1, 1]])
    np.testing.assert_array_equal(ref.hamilton(w, 10), [[3, 3, 2, 2], [5, 1, 2, 2]])


def test_locate_matches_brute_force():
    rs = np.random.default_rng(5)
    st = ref.tile_stats(rs.standard_normal((4, 150)) * 2, 150, 64)
    P = 3000
    r = rs.integers(0, 4, P)
    t = rs.integers(0, 3, P)
    y = rs.uniform(0, 1, P).astype(np.float32)
    y[:5] = [0.0, 0.0, np.float32(1 - 2**-24), 0.5, 0.999]
    got = ref.locate(st, r, t, y)
    for i in range(P):
        thr = np.float32(y[i] * st.l[r[i], t[i]])
        cum = st.cum[r[i], t[i], : st.valid[t[i]]]
        above = np.flatnonzero(cum > thr)
        want = above[0] if above.size else st.valid[t[i]] - 1
        assert got[i] == want


def test_locate_without_monotone_cum_uses_the_definition():
    rs = np.random.default_rng(9)
    st = ref.tile_stats(rs.standard_normal((3, 150)), 150, 64)
    cum = st.cum.copy()
    cum[1, 1, 10] = cum[1, 1, 11] * np.float32(1.0001)  # a parallel scan can be 1 ulp off order
    bumpy = ref.TileStats(m=st.m, l=st.l, cum=cum, valid=st.valid, n=150, block_n=64)
    r, t = np.repeat([0, 1, 2], 200), np.tile(np.repeat([0, 1], 100), 3)
    y = rs.uniform(0, 1, 600).astype(np.float32)
    got = ref.locate(bumpy, r, t, y)
    for i in range(600):
        above = np.flatnonzero(cum[r[i], t[i], : st.valid[t[i]]] > np.float32(y[i] * st.l[r[i], t[i]]))
        assert got[i] == (above[0] if above.size else st.valid[t[i]] - 1)


@pytest.mark.parametrize("budget", spec.BUDGETS)
def test_counts_from_external_stats_arrays(budget):
    """GPU tests can feed their own m, l, cum; the reference's own arrays reproduce its counts."""
    rs = np.random.default_rng(10)
    n = 150
    scores = rs.standard_normal((5, n)) * 2
    keys = rng.head_key(1, 2, 3, 4, np.arange(5))
    st = ref.tile_stats(scores, n, 64)
    rows_cum = st.cum.reshape(5, -1)[:, :n]
    ext = ref.stats_from_arrays(st.m, st.l, rows_cum, n, 64)
    np.testing.assert_array_equal(ext.cum, st.cum)
    for sampler in spec.SAMPLERS:
        kw = dict(samples=40, sampler=sampler, budget=budget)
        np.testing.assert_array_equal(
            ref.counts_from_stats(ext, keys, **kw), ref.counts_from_scores(scores, keys, n, block_n=64, **kw)
        )


def test_local_systematic_equals_locating_each_comb_point():
    """Closed-form counts == locate every point (i + U)/S_t of the tile comb (fixed systematic)."""
    rs = np.random.default_rng(6)
    R, n, S = 300, 200, 48
    st = ref.tile_stats(rs.standard_normal((R, n)) * 2, n, BN)
    S_t = np.full((R, 4), 12)
    U = rs.uniform(0, 1, (R, 4)).astype(np.float32)
    closed = ref.local_systematic_counts(st, U, S_t.astype(np.float32), S_t)
    i = np.arange(12)
    y = ((i + U[..., None]) / 12).astype(np.float32)  # [R, 4, 12]
    r, t, _ = np.nonzero(np.ones_like(y, dtype=bool))
    j = ref.locate(st, r, t, y.ravel())
    pointwise = np.zeros_like(closed)
    np.add.at(pointwise, (r, t, j), 1)
    flips = np.abs(closed - pointwise).sum() // 2
    assert flips <= 2, f"{flips} rounding flips out of {R * S} points"


# ------------------------------------------------------------------------------- sample counts


@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_fixed_budget_gives_exactly_S_t_per_tile(sampler):
    q, k, v, lengths = make_inputs(L=300, lengths=(300, 130))
    c = ref.sample_counts(q, k, lengths, samples=40, sampler=sampler, budget="fixed", block_n=64, seed=3)
    for b, n in enumerate(lengths):
        T = ref.num_tiles(n, 64)
        for sl in tile_slices(n):
            np.testing.assert_array_equal(c[b, :, sl].sum(axis=-1), max(1, 40 // T))
        assert np.all(c[b, :, n:] == 0)


def test_fixed_budget_has_at_least_one_sample_per_tile():
    q, k, v, lengths = make_inputs(L=300, lengths=(300, 300))
    c = ref.sample_counts(q, k, lengths, samples=2, sampler="systematic", budget="fixed", block_n=64)
    for sl in tile_slices(300):
        np.testing.assert_array_equal(c[:, :, sl].sum(axis=-1), 1)


@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_largest_remainder_gives_hamilton_S_t_per_tile(sampler):
    q, k, v, lengths = make_inputs(L=300, lengths=(300, 200))
    S = 50
    c = ref.sample_counts(q, k, lengths, samples=S, sampler=sampler, budget="largest_remainder", block_n=64)
    scores = ref.head_scores(q, k, lengths)
    for b, n in enumerate(lengths):
        st = ref.tile_stats(scores[b], n, 64)
        S_t = ref.global_prefix(st.m, st.l, S).S_lr  # [H, T]
        got = np.stack([c[b, :, sl].sum(axis=-1) for sl in tile_slices(n)], axis=1)
        np.testing.assert_array_equal(got, S_t)
        assert np.all(got.sum(axis=1) == S)


@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_global_budget_gives_exactly_S(sampler):
    q, k, v, lengths = make_inputs(L=300, lengths=(300, 77))
    for S in (1, 7, 256):
        c = ref.sample_counts(q, k, lengths, samples=S, sampler=sampler, budget="global", block_n=128, seed=S)
        assert np.all(c.sum(axis=-1) == S) and c.min() >= 0


@pytest.mark.parametrize("S", [64, 1000])
def test_global_systematic_counts_are_floor_or_ceil(S):
    rs = np.random.default_rng(7)
    R, n = 400, 300
    scores = rs.standard_normal((R, n)) * rs.uniform(0.5, 4, (R, 1))
    keys = rng.head_key(11, 0, 0, 0, np.arange(R))
    c = ref.counts_from_scores(scores, keys, n, samples=S, sampler="systematic", budget="global", block_n=64)
    e = np.exp(scores - scores.max(1, keepdims=True))
    Sp = S * e / e.sum(1, keepdims=True)
    assert np.all(c.sum(axis=1) == S)
    outside = (c < np.floor(Sp)) | (c > np.ceil(Sp))
    near_integer = np.abs(Sp - np.round(Sp)) < 1e-4  # float32 cum: a flip is possible only here
    assert not np.any(outside & ~near_integer)
    assert outside.sum() <= 2, f"{outside.sum()} rounding flips at near-integer S*p"
    # every row with S * p_j >= 1 is always taken
    assert np.all(c[Sp >= 1 + 1e-4] >= 1)


def test_global_systematic_equals_the_global_comb():
    """Tile-parallel closed form == locating each global comb point (k + U)/S directly."""
    rs = np.random.default_rng(8)
    R, n, S = 200, 300, 96
    scores = rs.standard_normal((R, n)) * 2
    keys = rng.head_key(5, 1, 2, 3, np.arange(R))
    c = ref.counts_from_scores(scores, keys, n, samples=S, sampler="systematic", budget="global", block_n=64)
    st = ref.tile_stats(scores, n, 64)
    pre = ref.global_prefix(st.m, st.l)
    U = rng.uniform(keys, spec.GLOBAL_TILE, 0).astype(np.float64)
    x = (np.arange(S)[None, :] + U[:, None]) / S  # [R, S]
    t = (x[..., None] >= pre.C[:, None, :]).sum(-1)
    Cp = np.take_along_axis(pre.C_prev, t, 1)
    y = ((x - Cp) / np.take_along_axis(pre.w, t, 1)).astype(np.float32)
    r = np.repeat(np.arange(R), S)
    j = ref.locate(st, r, t.ravel(), y.ravel())
    direct = np.zeros((R, st.cum.shape[1] * 64), dtype=np.int64)
    np.add.at(direct, (r, t.ravel() * 64 + j), 1)
    flips = np.abs(direct[:, :n] - c).sum() // 2
    assert flips <= 2, f"{flips} rounding flips out of {R * S} points"


def test_counts_depend_on_every_rng_field_and_are_reproducible():
    q, k, v, lengths = make_inputs()
    kw = dict(samples=64, sampler="stratified", budget="global", block_n=64)
    base = ref.sample_counts(q, k, lengths, seed=1, step=2, layer=3, **kw)
    np.testing.assert_array_equal(base, ref.sample_counts(q, k, lengths, seed=1, step=2, layer=3, **kw))
    for other in ({"seed": 2, "step": 2, "layer": 3}, {"seed": 1, "step": 3, "layer": 3}, {"seed": 1, "step": 2, "layer": 4}):
        assert not np.array_equal(base, ref.sample_counts(q, k, lengths, **other, **kw))


def test_float32_score_stash_gives_the_same_counts():
    q, k, v, lengths = make_inputs()
    s = ref.head_scores(q, k, lengths)[0]  # [H, 300]
    keys = rng.head_key(0, 0, 0, 0, np.arange(4))
    for budget, sampler in itertools.product(spec.BUDGETS, spec.SAMPLERS):
        kw = dict(samples=64, sampler=sampler, budget=budget, block_n=128)
        np.testing.assert_array_equal(
            ref.counts_from_scores(s, keys, 300, **kw), ref.counts_from_scores(s.astype(np.float32), keys, 300, **kw)
        )


# ---------------------------------------------------------------------------- unbiasedness


def exact_output(scores, v):
    return softmax64(scores) @ v


def lr_expected_output(scores, v, S):
    """E[o_hat] of largest_remainder: sum_t (S_t / S) * (exact output of tile t alone)."""
    st = ref.tile_stats(scores[None], scores.size, BN)
    S_t = ref.global_prefix(st.m, st.l, S).S_lr[0]
    return sum(S_t[t] / S * exact_output(scores[sl], v[sl]) for t, sl in enumerate(tile_slices(scores.size))), S_t


@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("budget", ["global", "fixed"])
@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_unbiased(kind, budget, sampler):
    scores, v = score_case(kind)
    o, _, _ = draws(scores, v, samples=16, sampler=sampler, budget=budget)
    se = o.std(axis=0, ddof=1) / np.sqrt(SEEDS)
    err = np.abs(o.mean(axis=0) - exact_output(scores, v))
    assert np.all(err <= 4 * se + 1e-6), (err / np.maximum(se, 1e-300)).round(2)


@pytest.mark.parametrize("kind", ["peaked", "flat"])
@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_largest_remainder_bias_is_small(kind, sampler):
    S = 16
    scores, v = score_case(kind)
    o, _, _ = draws(scores, v, samples=S, sampler=sampler, budget="largest_remainder")
    se = o.std(axis=0, ddof=1) / np.sqrt(SEEDS)
    expected, S_t = lr_expected_output(scores, v, S)
    # unbiased for its own (rounded) allocation ...
    assert np.all(np.abs(o.mean(axis=0) - expected) <= 4 * se + 1e-6)
    # ... and that allocation is within the Hamilton rounding bound of the exact output
    w = np.array([softmax64(scores)[sl].sum() for sl in tile_slices(N_ROWS)])
    bound = np.abs(S_t / S - w).sum() * np.abs(v).max()
    assert np.all(np.abs(o.mean(axis=0) - exact_output(scores, v)) <= 4 * se + bound)


def test_largest_remainder_bias_is_detectable_when_a_tile_is_dropped():
    """The statistical check has power: a tile with S*w_t < 1 that never gets a sample is seen."""
    S = 16
    scores = np.zeros(N_ROWS)
    scores[:64] = 3.0  # tile 0 holds most of the mass; tile 3 (8 rows) gets S*w < 1 and loses
    v = np.zeros((N_ROWS, D_SMALL))
    v[192:] = 10.0
    o, _, _ = draws(scores, v, samples=S, sampler="systematic", budget="largest_remainder")
    _, S_t = lr_expected_output(scores, v, S)
    assert S_t[3] == 0
    se = o.std(axis=0, ddof=1) / np.sqrt(SEEDS)
    err = np.abs(o.mean(axis=0) - exact_output(scores, v))
    assert np.all(err > 4 * se + 1e-6)
    o_glob, _, _ = draws(scores, v, samples=S, sampler="systematic", budget="global")
    se_g = o_glob.std(axis=0, ddof=1) / np.sqrt(SEEDS)
    assert np.all(np.abs(o_glob.mean(axis=0) - exact_output(scores, v)) <= 4 * se_g + 1e-6)


@pytest.mark.parametrize("budget", ["global", "fixed"])
def test_variance_systematic_le_stratified_le_iid(budget):
    scores, v = score_case("heavy")
    var = {}
    for sampler in spec.SAMPLERS:
        o, _, _ = draws(scores, v, samples=16, sampler=sampler, budget=budget)
        var[sampler] = o.var(axis=0, ddof=1).sum()
    # relative standard error of each variance estimate is about 3%
    if budget == "global":
        assert var["systematic"] <= 0.85 * var["stratified"], var
        assert var["stratified"] <= 0.85 * var["iid"], var
    else:  # 4 samples per tile: systematic and stratified are close
        assert var["systematic"] <= var["stratified"], var
        assert var["stratified"] <= 0.9 * var["iid"], var


@pytest.mark.parametrize("budget", ["global", "fixed"])
def test_spread_matches_iid_standard_error(budget):
    scores, v = score_case("peaked")
    S = 16
    o, spread, _ = draws(scores, v, samples=S, sampler="iid", budget=budget)
    empirical = o.var(axis=0, ddof=1).sum() / D_SMALL  # mean per-coordinate variance
    predicted = np.mean(spread**2)
    # DESIGN.md's spread uses the plug-in second moment: E[spread^2] = (1 - 1/S_draws) * variance
    S_draws = S if budget == "global" else ref.fixed_tile_samples(S, ref.num_tiles(N_ROWS, BN))
    ratio = predicted / empirical / (1 - 1 / S_draws)
    assert 0.9 < ratio < 1.1, (predicted, empirical)


# ------------------------------------------------------------------------ santa_attention


@pytest.mark.parametrize("budget", spec.BUDGETS)
def test_rows_read_is_the_group_union(budget):
    q, k, v, lengths = make_inputs(B=2, H=8, KVH=2, L=300, lengths=(300, 100))
    o, lse, rows_read, spread, counts = ref.santa_attention(
        q, k, v, lengths, samples=32, sampler="iid", budget=budget, block_n=64, seed=4
    )
    assert rows_read.dtype == np.int32 and rows_read.shape == (2, 2)
    for b in range(2):
        for g in range(2):
            union = set()
            for h in range(4 * g, 4 * g + 4):
                union |= set(np.flatnonzero(counts[b, h]).tolist())
            assert rows_read[b, g] == len(union)
            assert rows_read[b, g] > np.count_nonzero(counts[b, 4 * g])  # the union is larger than one head


def test_santa_attention_consistent_with_stages():
    q, k, v, lengths = make_inputs(B=2, H=4, KVH=2, L=300, lengths=(300, 150))
    kw = dict(samples=64, sampler="systematic", budget="global", seed=9, step=4, layer=2, block_n=64)
    o, lse, rows_read, spread, counts = ref.santa_attention(q, k, v, lengths, **kw)
    np.testing.assert_array_equal(counts, ref.sample_counts(q, k, lengths, **kw))
    _, lse_dense = ref.dense_attention(q, k, v, lengths)
    np.testing.assert_allclose(lse, lse_dense, rtol=1e-12)
    v64 = ref.to_float64(v)
    for b, h in itertools.product(range(2), range(4)):
        manual = counts[b, h] @ v64[b, :, h // 2] / 64
        np.testing.assert_allclose(o[b, h], manual, rtol=1e-12, atol=1e-14)
    assert np.all(spread > 0)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_santa_converges_to_dense_with_many_samples(dtype):
    q, k, v, lengths = make_inputs(B=2, H=4, KVH=2, L=300, lengths=(300, 150), dtype=dtype)
    o_dense, _ = ref.dense_attention(q, k, v, lengths)
    o_few, *_ , spread_few, _ = ref.santa_attention(q, k, v, lengths, samples=32)
    o_many, *_, spread_many, _ = ref.santa_attention(q, k, v, lengths, samples=8192)
    err_few = np.linalg.norm(o_few - o_dense) / np.linalg.norm(o_dense)
    err_many = np.linalg.norm(o_many - o_dense) / np.linalg.norm(o_dense)
    assert err_many < 0.02 and err_many < err_few / 4
    assert np.all(spread_many < spread_few)


@pytest.mark.parametrize("budget", spec.BUDGETS)
@pytest.mark.parametrize("sampler", spec.SAMPLERS)
def test_edge_lengths_and_underflowing_tiles(budget, sampler):
    q, k, v, _ = make_inputs(B=3, H=2, KVH=1, L=256, lengths=(1, 128, 256))
    lengths = np.array([1, 128, 256])
    # sequence 2: scores +500 in tile 0 and -500 in tile 1, so W_1 = exp(-1000) = 0 in float64
    q[2] = 0.0
    q[2, :, 0] = 4000.0
    k[2, :128, 0, 0] = 1.0
    k[2, 128:, 0, 0] = -1.0
    o, lse, rows_read, spread, c = ref.santa_attention(
        q, k, v, lengths, samples=8, sampler=sampler, budget=budget, block_n=128
    )
    o_dense, _ = ref.dense_attention(q, k, v, lengths)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(spread)) and np.all(np.isfinite(lse))
    np.testing.assert_array_equal(c[0, :, 0], 8)  # one row takes every sample
    np.testing.assert_allclose(o[0], o_dense[0], rtol=1e-12)
    assert np.all(rows_read[0] == 1)
    assert np.all(c.sum(axis=-1)[:2] == 8)
    if budget != "fixed":  # a zero-weight tile is never sampled
        assert np.all(c[2, :, 128:] == 0) and np.all(c[2].sum(axis=-1) == 8)
    else:  # fixed samples it anyway, with weight 0 in the estimate
        assert np.all(c[2, :, 128:].sum(axis=-1) == 4)
    np.testing.assert_allclose(o[2], (c[2, :, :128] @ ref.to_float64(v)[2, :128, 0]) / (8 if budget != "fixed" else 4))

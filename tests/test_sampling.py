"""llama_min.sampling: the token sampler's contract (module docstring) on the CPU.

- the NumPy reference (sample_reference) against a brute-force statement of each step;
- a step-by-step NumPy model of cuda/sample_tokens.cu's block algorithm (radix selection of the
  top-k and top-p cutoffs with the kernel's digit passes and tie rule, per-thread chunks and a scan
  for the draw) against the reference: the kernel's logic, checked where no GPU is;
- the drawn distribution against the softmax (chi-square bound), and generate's use of it.
The kernel itself against the reference: tests/test_gpu_sampling.py.
"""

import math

import numpy as np
import pytest

from llama_min import sampling
from llama_min.sampling import SamplerParams, SamplingConfig, TokenSampler, sample_reference

THREADS = 1024       # SC_SAMPLE_THREADS


def _params(V, **kw):
    return SamplerParams.from_config(SamplingConfig(**kw), V)


# ------------------------------------------------------------------ a model of the kernel's passes


def _choose_digit(hist, base, need, descending):
    bins = range(255, -1, -1) if descending else range(256)
    acc = base
    for d in bins:
        if acc + int(hist[d]) >= need:
            return d, acc, int(hist[d])
        acc += int(hist[d])
    raise AssertionError("no digit reaches need")


def _select_cutoff(keys, weights_of, in_set, need):
    """select_cutoff: (K, I) with the kernel's 4 key passes and, for a split tie, 3 index passes."""
    V = keys.shape[0]
    idx = np.arange(V, dtype=np.uint64)
    prefix, mask, base = 0, 0, 0
    w = weights_of(keys)
    for shift in (24, 16, 8, 0):
        m = in_set & ((keys.astype(np.uint64) & mask) == prefix)
        hist = np.zeros(256, np.uint64)
        np.add.at(hist, ((keys[m] >> np.uint32(shift)) & np.uint32(255)).astype(np.int64), w[m])
        d, base, digit_weight = _choose_digit(hist, base, need, True)
        prefix |= d << shift
        mask |= 255 << shift
    K = prefix
    unit = int(weights_of(np.array([K], np.uint32))[0])
    ties, take = digit_weight // unit, (need - base + unit - 1) // unit
    I = None
    if take < ties:
        tie = in_set & (keys == K)
        iprefix, imask, below = 0, 0, 0
        for shift in (16, 8, 0):
            m = tie & ((idx & np.uint64(imask)) == iprefix)
            hist = np.bincount(((idx[m] >> np.uint64(shift)) & np.uint64(255)).astype(np.int64), minlength=256)
            d, below, _ = _choose_digit(hist, below, take, False)
            iprefix |= d << shift
            imask |= 255 << shift
        I = iprefix
    return K, I


def _kernel_model(l, p: SamplerParams, step, b=0):
    V = l.shape[0]
    z = l if p.greedy else (l * p.inv_t).astype(np.float32)
    keys = sampling.order_key(z)
    best = max((int(k) << 32) | (0xFFFFFFFF - i) for i, k in enumerate(keys))
    token = 0xFFFFFFFF - (best & 0xFFFFFFFF)
    if p.greedy:
        return token
    zmax = z[token]

    def weights_of(k):
        vals = np.where(k & np.uint32(0x80000000), k & np.uint32(0x7FFFFFFF), ~k).astype(np.uint32).view(np.float32)
        return sampling.weights(vals, zmax)

    idx = np.arange(V)
    kept = np.ones(V, bool)

    def kept_by(K, I, within):
        return within & ((keys > K) | ((keys == K) & (True if I is None else idx <= I)))
    if p.top_k:
        K, I = _select_cutoff(keys, lambda k: np.ones(k.shape, np.uint64), kept, p.top_k)
        kept = kept_by(K, I, kept)
    if p.top_p_q < sampling.TOP_P_OFF:
        W = int(weights_of(keys)[kept].sum())
        thr = max(1, -(-W * p.top_p_q // sampling.TOP_P_OFF))
        K, I = _select_cutoff(keys, weights_of, kept, thr)
        kept = kept_by(K, I, kept)
    w = np.where(kept, weights_of(keys), np.uint64(0))
    chunk = -(-V // THREADS)
    parts = [int(w[t * chunk:(t + 1) * chunk].sum()) for t in range(THREADS)]
    total = sum(parts)
    target = total * int(sampling.token_uniform(p.seed, step, b)) >> 32
    before = 0
    for t, part in enumerate(parts):
        if part and before <= target < before + part:
            acc = before
            for i in range(t * chunk, min(V, (t + 1) * chunk)):
                acc += int(w[i])
                if w[i] and acc > target:
                    return i
        before += part
    raise AssertionError("no chunk holds the target")


def _logits(V, seed, ties=False, spread=3.0):
    rng = np.random.default_rng(seed)
    l = (rng.standard_normal(V) * spread).astype(np.float32)
    if ties:                                   # many exact ties, also at the cutoffs
        l = np.round(l).astype(np.float32)
    return l


CASES = [dict(greedy=True), dict(greedy=False), dict(greedy=False, temperature=0.7),
         dict(greedy=False, top_k=5), dict(greedy=False, top_k=50, temperature=1.3),
         dict(greedy=False, top_p=0.9), dict(greedy=False, top_p=0.3, top_k=40, temperature=0.8),
         dict(greedy=False, top_p=1e-6), dict(greedy=False, top_k=1)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("V,ties", [(1000, False), (1000, True), (3001, True), (32007, False)])
def test_kernel_model_matches_reference(case, V, ties):
    p = _params(V, seed=11, **case)
    for step in range(3):
        l = _logits(V, 100 * step + V, ties)
        want = int(sample_reference(l[None], p, step)[0])
        assert _kernel_model(l, p, step) == want, (case, V, step)


def test_reference_steps_by_brute_force():
    """Each step of the contract stated directly (float64 softmax, explicit sort) on a small V."""
    V = 64
    l = _logits(V, 3, ties=True, spread=2.0)
    # greedy: argmax, lowest index on ties
    assert int(sample_reference(l[None], _params(V, greedy=True), 0)[0]) == int(np.argmax(l))
    # top-k: the drawn tokens are exactly the top k in (value desc, index asc) order
    order = sorted(range(V), key=lambda i: (-l[i], i))
    p = _params(V, greedy=False, top_k=7, seed=5)
    drawn = {int(sample_reference(l[None], p, s)[0]) for s in range(3000)}
    assert drawn == set(order[:7])
    # top-p: the shortest prefix of that order with mass >= top_p
    pr = np.exp(l.astype(np.float64) - l.max())
    pr /= pr.sum()
    cum = np.cumsum(pr[order])
    keep = int(np.searchsorted(cum, 0.6) + 1)
    p = _params(V, greedy=False, top_p=0.6, seed=5)
    drawn = {int(sample_reference(l[None], p, s)[0]) for s in range(3000)}
    assert drawn == set(order[:keep])


def test_weights_match_exp():
    z = np.linspace(-79.9, 0, 20001).astype(np.float32)
    w = sampling.weights(z, np.float32(0.0)).astype(np.float64) / sampling.WEIGHT_ONE
    np.testing.assert_allclose(w, np.exp(z.astype(np.float64)), rtol=3e-7, atol=2 ** -40)
    assert sampling.weights(np.array([0.0, -80.5, -np.inf], np.float32), np.float32(0.0)).tolist() == [1 << 40, 0, 0]


def test_uniform_is_the_rng_stream_and_depends_on_step_and_sequence():
    r = [int(sampling.token_uniform(9, s, b)) for s in range(4) for b in range(3)]
    assert len(set(r)) == len(r) and all(0 <= x < 2 ** 32 for x in r)
    from santa_cupy import rng
    key = rng.head_key(9, 2, sampling.TOKEN_LAYER, 1, 0)
    assert int(sampling.token_uniform(9, 2, 1)) == int(rng.mix64(rng.mix64(key ^ np.uint64(0xFFFFFFFD)) ^ np.uint64(0))) >> 32


def chi2_quantile(dof: int, z: float = 4.753) -> float:
    """Upper quantile of the chi-square law with dof degrees of freedom (Wilson-Hilferty), z = the
    standard normal quantile: 4.753 for a false alarm rate of 1e-6."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def _softmax_counts(l, n, temperature=1.0, top_k=None, top_p=None):
    """Expected counts of n draws from the renormalised softmax of the kept set."""
    V = len(l)
    z = l.astype(np.float64) / temperature
    pr = np.exp(z - z.max())
    order = sorted(range(V), key=lambda i: (-z[i], i))
    keep = order[:top_k or V]
    if top_p is not None:
        q = pr[keep] / pr[keep].sum()
        keep = keep[:int(np.searchsorted(np.cumsum(q), top_p) + 1)]
    expect = np.zeros(V)
    expect[keep] = pr[keep] / pr[keep].sum() * n
    return expect


def _chi2(counts, expect):
    m = expect > 0
    return float((((counts[m] - expect[m]) ** 2) / expect[m]).sum()), int(m.sum()) - 1


@pytest.mark.parametrize("case", [dict(temperature=1.0), dict(temperature=0.5, top_k=6), dict(top_p=0.8)])
def test_distribution_matches_softmax(case):
    """Draws over 20000 steps against the renormalised softmax of the kept set: a chi-square test at
    a false alarm rate of 1e-6, which a temperature 20% off fails (checked on the same draws)."""
    V, n = 12, 20000
    l = _logits(V, 1, spread=1.0)
    p = _params(V, greedy=False, seed=2, **case)
    counts = np.bincount([int(sample_reference(l[None], p, s)[0]) for s in range(n)], minlength=V)
    expect = _softmax_counts(l, n, **case)
    assert counts[expect == 0].sum() == 0
    chi2, dof = _chi2(counts, expect)
    assert chi2 < chi2_quantile(dof), (chi2, dof)
    wrong = _softmax_counts(l, n, **{**case, "temperature": 1.2 * case.get("temperature", 1.0)})
    chi2_wrong, dof_wrong = _chi2(counts, np.where(expect > 0, wrong, 0.0))
    assert chi2_wrong > chi2_quantile(dof_wrong), (chi2_wrong, dof_wrong)


def test_repetition_penalty_in_float32():
    l = np.array([[2.0, -1.0, 3.0, 0.5]], np.float32)
    seen = np.array([[1, 1, 0, 0]], np.uint8)
    np.testing.assert_array_equal(sampling.penalized_logits(l, seen, 2.0), [[1.0, -2.0, 3.0, 0.5]])
    p = _params(4, greedy=True, repetition_penalty=10.0)
    assert int(sample_reference(np.array([[3.0, 2.9, 0, 0]], np.float32), p, 0, np.array([[1, 0, 0, 0]]))[0]) == 1


def test_token_sampler_numpy_steps_and_marks():
    V = 50
    s = TokenSampler(np, SamplingConfig(greedy=False, temperature=2.0, seed=4, repetition_penalty=1.3), 2, V,
                     context=[[1, 2], [3]])
    assert s.seen[0, [1, 2]].tolist() == [1, 1] and s.seen[1, 3] == 1 and s.seen.sum() == 3
    logits = np.stack([_logits(V, 7), _logits(V, 8)])
    seen0 = s.seen.copy()
    got = s(logits).copy()
    np.testing.assert_array_equal(got, sample_reference(logits, s.params, 0, seen0))
    assert all(s.seen[b, got[b]] == 1 for b in range(2))
    s.advance()
    assert int(s.step[0]) == 1
    s(logits, update=False)
    np.testing.assert_array_equal(s.out, sample_reference(logits, s.params, 1, s.seen))


def test_params_off_switches():
    p = _params(100, greedy=False, top_k=100, top_p=1.0)
    assert p.top_k == 0 and p.top_p_q == sampling.TOP_P_OFF and not p.greedy
    assert _params(100, greedy=False, temperature=0.0).greedy and _params(100, greedy=False, top_k=1).greedy
    with pytest.raises(ValueError, match="logits"):
        sample_reference(np.zeros((3,), np.float32), p, 0)


@pytest.mark.parametrize("case", [dict(greedy=True), dict(greedy=False, top_k=3, top_p=0.5, seed=1),
                                  dict(greedy=False, temperature=0.3)])
@pytest.mark.parametrize("V", [1, 2, 1023, 1025])
def test_kernel_model_edge_rows(case, V):
    """All-equal rows (zeros, -inf) with one larger entry in the second: kernel model = reference."""
    p = _params(V, **case)
    for fill in (0.0, -np.inf):
        logits = np.full((2, V), fill, np.float32)
        logits[1, V // 2] = 1.0
        want = sample_reference(logits, p, 3)
        assert [_kernel_model(logits[b], p, 3, b) for b in range(2)] == want.tolist(), (case, V, fill)


def test_tiny_temperature_is_greedy():
    p = _params(10, greedy=False, temperature=1e-45)
    assert p.greedy and p.inv_t == np.float32(1.0)

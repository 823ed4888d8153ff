"""The block estimator's float64 arithmetic in the explicit order the GPU kernel follows
(santa_cupy/key_sampling.py docstring, cuda/santa_score_keys.cu): a scalar model of the kernel's
prologue, written with Python floats (IEEE double, one operation at a time), equals the reference
bit for bit: block weights, the bisection's pi (stepwise, and in the kernel's rounds of 5 steps on
31 lanes), the Horvitz-Thompson weights."""

import math

import numpy as np
import pytest

from santa_cupy import key_sampling as ks
from santa_cupy import reference as ref
from santa_cupy import rng, spec


def int_power(x, R):
    result, base = None, x
    while R:
        if R & 1:
            result = base if result is None else result * base
        R >>= 1
        if R:
            base = base * base
    return result


def read_fraction(lam, w, R):
    total = 0.0
    for wc in w:
        total = total + (1.0 - int_power(1.0 - min(1.0, lam * wc), R))
    return total / len(w)


def model_pi(w, budget, R, iterations=80):
    """The kernel's bisection (with its early exit at the fixed point lo < hi adjacent)."""
    positive = [x for x in w if x > 0]
    lam_hi = 1.0 / min(positive) if positive else 0.0
    if not read_fraction(lam_hi, w, R) > budget:
        return [np.float32(min(1.0, lam_hi * x)) for x in w]
    lo, hi = 0.0, lam_hi
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if mid == lo or mid == hi:
            break
        if read_fraction(mid, w, R) > budget:
            hi = mid
        else:
            lo = mid
    return [np.float32(min(1.0, hi * x)) for x in w]


def model_pi_rounds(w, budget, R, iterations=80, levels=5):
    """santa_key_blocks' key_bisect: 31 lanes evaluate the next 5 steps' search tree (heap order,
    node 2i the "over" child of node i), one ballot walks it."""
    positive = [x for x in w if x > 0]
    lam_hi = 1.0 / min(positive) if positive else 0.0
    if not read_fraction(lam_hi, w, R) > budget:
        return [np.float32(min(1.0, lam_hi * x)) for x in w]
    lo, hi, step = 0.0, lam_hi, 0
    while step < iterations:
        mask = 0
        for lane in range(1, 32):
            nlo, nhi = lo, hi
            for k in range(lane.bit_length() - 2, -1, -1):
                mid = 0.5 * (nlo + nhi)
                if (lane >> k) & 1:
                    nlo = mid
                else:
                    nhi = mid
            if read_fraction(0.5 * (nlo + nhi), w, R) > budget:
                mask |= 1 << lane
        node, level, done = 1, 0, False
        while level < levels and step < iterations:
            mid = 0.5 * (lo + hi)
            if mid == lo or mid == hi:
                done = True
                break
            if (mask >> node) & 1:
                hi, node = mid, 2 * node
            else:
                lo, node = mid, 2 * node + 1
            level, step = level + 1, step + 1
        if done:
            break
    return [np.float32(min(1.0, hi * x)) for x in w]


def model_weights(qg, FB, rule):
    """qg [G, D] float64 -> w [C]: per block the FB squares summed in order, qmax / qrms."""
    G, D = qg.shape
    out = []
    for c in range(D // FB):
        norms = []
        for h in range(G):
            acc = 0.0
            for i in range(FB):
                x = float(qg[h, c * FB + i])
                acc = acc + x * x
            norms.append(acc)
        if rule == "uniform":
            out.append(1.0)
        elif rule == "qmax":
            out.append(math.sqrt(max(norms)))
        else:
            acc = 0.0
            for n in norms:
                acc = acc + n
            out.append(math.sqrt(acc))
    return out


@pytest.mark.parametrize("R", [1, 2, 3, 7, 256])
@pytest.mark.parametrize("budget", [0.1, 0.5, 0.75, 0.999, 1.0])
def test_bisection_model_equals_reference(R, budget):
    rs = np.random.default_rng(R * 1000 + int(budget * 1000))
    for trial in range(6):
        w = np.exp(rs.standard_normal(8) * 2)
        if trial == 1:
            w[3] = 0.0
        if trial == 2:
            w[:] = 0.0
        if trial == 3:
            w = np.ones(4)
        got = ks.block_probabilities(w, budget, R)
        want = np.array(model_pi(list(w), budget, R), np.float32)
        assert np.array_equal(got, want), (trial, got, want)
        assert np.array_equal(got, np.array(model_pi_rounds(list(w), budget, R), np.float32)), trial


@pytest.mark.parametrize("rule", ["uniform", "qmax", "qrms"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_block_weights_model(rule, dtype):
    rs = np.random.default_rng(7)
    G, KVH, D, FB = 3, 2, 64, 16
    q = spec.from_float32((rs.standard_normal((2, G * KVH, D)) * 3).astype(np.float32), dtype, np)
    got = ks.block_weights(q, KVH, FB, rule)
    qf = ref.to_float64(q).reshape(2, KVH, G, D)
    for b in range(2):
        for g in range(KVH):
            assert list(got[b, g]) == model_weights(qf[b, g], FB, rule)


def test_int_power_is_square_and_multiply():
    x = np.array([0.3, 0.999, 1.0 - 2.0 ** -30, 0.0])
    for R in (1, 2, 5, 8, 13, 256):
        assert np.array_equal(ks._int_power(x, R), np.array([int_power(float(v), R) for v in x]))


@pytest.mark.parametrize("combine", ["mean", "union"])
def test_info_weight_is_horvitz_thompson(combine):
    """info.weight [B, KVH, C]: (count / R) / pi ("mean") or 1 / (1 - (1 - pi)^R) ("union") where
    read, else 0; the uniforms are rng.key_sampling_uniform's group streams."""
    rs = np.random.default_rng(3)
    B, H, KVH, D, L, R = 2, 4, 2, 64, 9, 3
    q = rs.standard_normal((B, H, D)).astype(np.float32)
    k = rs.standard_normal((B, L, KVH, D)).astype(np.float32)
    _, info = ks.key_scores(q, k, np.array([L, 5]), key_sampling="bernoulli_block", key_draws=R, key_budget=0.5,
                            key_rule="qrms", key_combine=combine, seed=11, step=2, layer=1)
    pi = info.prob.astype(np.float64)
    u = rng.key_sampling_uniform(11, 2, 1, np.arange(B)[:, None, None, None],
                                 (rng.GROUP_UNIT | np.arange(KVH))[None, :, None, None],
                                 np.arange(R)[None, None, :, None], np.arange(D // 16)[None, None, None, :])
    sel = u < info.prob[:, :, None, :]
    assert np.array_equal(sel, info.selected)
    count = sel.sum(axis=2)
    with np.errstate(divide="ignore", invalid="ignore"):
        want = np.where(count > 0, (count / R) / pi, 0.0) if combine == "mean" else \
            np.where(count > 0, 1.0 / (1.0 - ks._int_power(1.0 - pi, R)), 0.0)
    assert np.array_equal(info.weight, want)
    assert np.array_equal(info.read, info.weight > 0)

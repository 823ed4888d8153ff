"""Counter-based RNG: known answers and an independent pure-Python implementation of DESIGN.md."""

import numpy as np
import pytest

from santa_cupy import rng, spec

MASK = 0xFFFFFFFFFFFFFFFF


def py_mix64(z):
    z &= MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def py_head_key(seed, step, layer, b, h):
    x = py_mix64((seed & MASK) ^ 0x9E3779B97F4A7C15)
    x = py_mix64(x ^ step)
    x = py_mix64(x ^ (((layer << 32) | b) & MASK))
    return py_mix64(x ^ ((h << 32) & MASK))


def py_uniform(key, tile, k):
    bits = py_mix64(py_mix64(key ^ tile) ^ k) >> 40
    return bits * 2.0**-24


def test_mix64_splitmix64_known_answers():
    # SplitMix64 with seed 0 outputs mix64(i * golden) for i = 1, 2, 3 (published test vector).
    golden = 0x9E3779B97F4A7C15
    expected = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    for i, want in enumerate(expected, start=1):
        assert int(rng.mix64((i * golden) & MASK)) == want
        assert py_mix64(i * golden) == want


def test_literal_head_key_and_uniform_values():
    assert int(rng.head_key(0, 0, 0, 0, 1)) == 10550051238493717420
    assert int(rng.head_key(0, 0, 0, 2, 1)) == 18105395738362047213
    u = rng.uniform(rng.head_key(1, 2, 3, 4, 5), spec.GLOBAL_TILE, np.arange(4))
    assert float(u[0]) == py_uniform(py_head_key(1, 2, 3, 4, 5), spec.GLOBAL_TILE, 0)
    # 24-bit integers times 2**-24, compared exactly
    np.testing.assert_array_equal(u, np.array([10076155, 370669, 1654889, 8829584]) * 2.0**-24)


@pytest.mark.parametrize(
    "seed,step,layer,b,h",
    [(0, 0, 0, 0, 0), (1, 2, 3, 4, 5), (2**63 + 12345, 10**9, 31, 7, 15), (-1, 0, 0, 0, 0), (42, 7, 0, 255, 63)],
)
def test_head_key_matches_pure_python(seed, step, layer, b, h):
    assert int(rng.head_key(seed, step, layer, b, h)) == py_head_key(seed, step, layer, b, h)


def test_vectorised_matches_pure_python_and_is_float32():
    b = np.arange(3)[:, None]
    h = np.arange(4)[None, :]
    keys = rng.head_key(9, 8, 7, b, h)  # [3, 4]
    assert keys.dtype == np.uint64 and keys.shape == (3, 4)
    tiles = np.array([0, 1, spec.GLOBAL_TILE], dtype=np.uint64)
    for bi in range(3):
        for hi in range(4):
            assert int(keys[bi, hi]) == py_head_key(9, 8, 7, bi, hi)
            u = rng.uniform(keys[bi, hi], tiles[:, None], np.arange(5)[None, :])
            assert u.dtype == np.float32 and u.shape == (3, 5)
            for ti, tile in enumerate(tiles):
                for k in range(5):
                    assert float(u[ti, k]) == py_uniform(py_head_key(9, 8, 7, bi, hi), int(tile), k)


def test_uniform_range_and_moments():
    u = rng.uniform(rng.head_key(3, 0, 0, 0, 0), 0, np.arange(200_000))
    assert u.min() >= 0.0 and u.max() < 1.0
    assert abs(u.mean() - 0.5) < 4 * np.sqrt(1 / 12 / u.size)
    assert abs(u.var() - 1 / 12) < 0.002
    # distinct counters give distinct streams
    v = rng.uniform(rng.head_key(3, 0, 0, 0, 1), 0, np.arange(1000))
    assert np.mean(u[:1000] == v) < 0.01


def test_every_field_changes_the_key():
    base = (5, 6, 7, 8, 9)
    k0 = int(rng.head_key(*base))
    for i in range(5):
        changed = list(base)
        changed[i] += 1
        assert int(rng.head_key(*changed)) != k0

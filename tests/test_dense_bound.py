"""The GPU dense tests' yardstick (gpu_util.dense_error_bound / assert_dense_matches) on the CPU:
a NumPy model of decode_dense_mma's arithmetic (float32 scores and accumulators, an online
softmax over 16-row steps, P rounded to the storage dtype before P.V) stays inside the bound, and
the faults the old whole-output relative L2 tolerance let through do not: a dropped last row,
one head 5% off, one head 2% off."""

import numpy as np
import pytest

from santa_cupy import spec
from tests.gpu_util import as_float32, assert_dense_matches, dense_error_bound, random_inputs


def _model_kernel(q, k, v, lengths, dtype, step=16):
    """Float32 online-softmax decode (log2 domain), P rounded to dtype (not for float32), output
    rounded to dtype: the arithmetic of decode_dense_mma, one sequential split."""
    B, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    qf, kf, vf = (as_float32(x) for x in (q, k, v))
    out = np.zeros((B, H, D), np.float32)
    mult = np.float32(1 / np.sqrt(D) * 1.4426950408889634)
    for b, n in enumerate(lengths):
        Q = qf[b].reshape(KVH, G, D)
        m = np.full((KVH, G, 1), -np.inf, np.float32)
        l = np.zeros((KVH, G, 1), np.float32)
        acc = np.zeros((KVH, G, D), np.float32)
        for r0 in range(0, n, step):
            K = kf[b, r0:min(n, r0 + step)].transpose(1, 2, 0)             # [KVH, D, rows]
            V = vf[b, r0:min(n, r0 + step)].transpose(1, 0, 2)             # [KVH, rows, D]
            s = (Q @ K) * mult
            m_new = np.maximum(m, s.max(-1, keepdims=True))
            alpha = np.exp2(m - m_new).astype(np.float32)
            p = np.exp2(s - m_new).astype(np.float32)
            l = l * alpha + p.sum(-1, keepdims=True, dtype=np.float32)
            if dtype != "float32":
                p = as_float32(spec.from_float32(p, dtype, np))
            acc = acc * alpha + (p @ V).astype(np.float32)
            m = m_new
        if n:
            out[b] = (acc / l).reshape(H, D)
    return spec.from_float32(out, dtype, np)


def _fails(o, ref):
    try:
        assert_dense_matches(o, ref)
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("dtype,G,D", [("bfloat16", 4, 128), ("float16", 12, 64), ("float32", 3, 256)])
def test_dense_bound_passes_the_kernels_arithmetic_and_catches_faults(dtype, G, D):
    rng = np.random.default_rng(19)
    lengths = [1, 63, 65, 209]
    q, k, v, lens = random_inputs(rng, 4, 2 * G, 2, D, 212, lengths, dtype, spike=True)
    ref = dense_error_bound(q, k, v, lens, dtype)
    assert (ref.weights[np.arange(4), :, lens - 1] > 0.45).all()            # the spike: ~1/2 of every head
    o = _model_kernel(q, k, v, lens, dtype)
    assert_dense_matches(o, ref)
    assert (np.abs(as_float32(o) - ref.want) / ref.bound).max() < 0.75   # a margin for other summation orders
    assert _fails(_model_kernel(q, k, v, np.maximum(lens - 1, 0), dtype), ref), "dropped last row"
    for b, h, factor in ((3, 2 * G - 1, 1.05), (2, 0, 1.02)):
        bad = as_float32(o).copy()
        bad[b, h] *= factor
        assert _fails(spec.from_float32(bad, dtype, np), ref), f"(b={b}, h={h}) x {factor}"
    no_spike = random_inputs(np.random.default_rng(19), 4, 2 * G, 2, D, 212, lengths, dtype)
    with pytest.raises(AssertionError, match="no spike"):
        nref = dense_error_bound(*no_spike, dtype)
        assert_dense_matches(_model_kernel(*no_spike, dtype), nref)

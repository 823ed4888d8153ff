"""llama_min.reference (the decoder kernels' NumPy formulas) against the model's own CPU path."""

import numpy as np

from llama_min import reference
from llama_min.model import LlamaModel


def test_decoder_references_agree_with_llama_min():
    """reference.rope_append rotates as llama_min's CPU path does (bit for bit, float32), and
    reference.silu_mul / rms_norm are the model's formulas."""
    rng = np.random.default_rng(4)
    H, KVH, D, N, L = 4, 2, 16, 3, 7
    qkv = rng.standard_normal((N, (H + 2 * KVH) * D)).astype(np.float32)
    ang = rng.uniform(-3, 3, (L, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = np.array([0, 6, 2], np.int32)
    k, v = np.zeros((N, L, KVH, D), np.float32), np.zeros((N, L, KVH, D), np.float32)
    q = reference.rope_append(qkv, cos, sin, pos, k, v, H, KVH, "float32")
    x = qkv.reshape(N, H + 2 * KVH, D)
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]
    np.testing.assert_array_equal(q, LlamaModel._rope(x[:, :H], c, s))
    np.testing.assert_array_equal(k[np.arange(N), pos], LlamaModel._rope(x[:, H:H + KVH], c, s))
    np.testing.assert_array_equal(v[np.arange(N), pos], x[:, H + KVH:])
    gu = rng.standard_normal((2, 10))
    g, u = gu[:, :5], gu[:, 5:]
    np.testing.assert_allclose(reference.silu_mul(gu), g * (0.5 * (1.0 + np.tanh(0.5 * g))) * u, rtol=1e-12)
    w = rng.standard_normal(10)
    rms = np.sqrt((gu * gu).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(reference.rms_norm(gu, w, 1e-6), gu / rms * w)

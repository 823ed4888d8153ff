"""float64 / float32 NumPy references of the decoder's own kernels (llama_min.ops: cuda/gemv.cu,
cuda/decoder.cu), what tests/test_gpu_decoder.py and tests/test_gpu_gemv.py compare them with.
The token sampler's reference lives with its contract: llama_min.sampling.sample_reference.
"""

from __future__ import annotations

import numpy as np

from santa_cupy import key_layout, spec
from santa_cupy.reference import to_float64

F32 = np.float32


# ------------------------------------------------------------------- the decoder's weight products


def weight_product(x, w):
    """gemv.cu's product in float64: y [n, N] = x [n, K] @ w [N, K].T (uint16 is bfloat16 bits)."""
    return to_float64(x) @ to_float64(w).T


# ------------------------------------------------------- the small steps of a decode step (decoder.cu)


def rms_norm(x, w, eps):
    """decoder.cu rms_norm in float64: x [N, d] / sqrt(mean(x^2) + eps) * w [d]."""
    x64 = to_float64(x)
    return x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps) * to_float64(w)


def rope_append(qkv, cos, sin, pos, k_cache, v_cache, heads, kv_heads, kv_dtype, key_block=None):
    """decoder.cu rope_append in float32, each product and sum rounded (no FMA), as the kernel:
    -> q [N, heads, D] of kv_dtype; writes rotated k and v into row pos[n] of the (NumPy) caches
    [N, L_max, KVH, D], with key_block FB the rotated k into the blocked k_cache [N, KVH, NP, D / FB,
    P, FB] (santa_cupy.key_layout) instead."""
    N, D = qkv.shape[0], v_cache.shape[-1]
    h = D // 2
    x = spec.to_float32(qkv, np).reshape(N, heads + 2 * kv_heads, D)
    c, s = cos[pos][:, None, :].astype(F32), sin[pos][:, None, :].astype(F32)     # [N, 1, D/2]
    a, b = x[..., :h], x[..., h:]
    rot = np.concatenate([a * c - b * s, b * c + a * s], axis=-1)                 # float32 ops
    store = lambda t: spec.from_float32(t, kv_dtype, np)  # noqa: E731
    rows = np.arange(N)
    k = store(rot[:, heads:heads + kv_heads])                                       # [N, KVH, D]
    if key_block is None:
        k_cache[rows, pos] = k
    else:                                                                           # row pos[n] of its page
        key_layout.write_token(k_cache, rows, pos, k.reshape(N, kv_heads, D))
    v_cache[rows, pos] = store(x[:, heads + kv_heads:])
    return store(rot[:, :heads])


def silu_mul(gu):
    """decoder.cu silu_mul in float64: silu(gate) * up of gu [N, 2 I] -> [N, I]."""
    g64 = to_float64(gu)
    I = g64.shape[1] // 2
    g, u = g64[:, :I], g64[:, I:]
    return g / (1.0 + np.exp(-g)) * u

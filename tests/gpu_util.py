"""Shared helpers of the tests: the GPU skip marker, random decode inputs, page pools."""

import numpy as np
import pytest

from santa_cupy import spec


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


HAVE_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
NP_STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
# relative L2 error allowed for exact attention: output rounding of the storage dtype + fp32 math
DENSE_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


def random_inputs(rng, B, H, KVH, D, L_max, lengths, dtype, peak=1.0):
    """NumPy q [B,H,D], k, v [B,L_max,KVH,D] in storage dtype, lengths int32; random normal data.

    ``peak`` scales q so that the score distribution is flatter (< 1) or more peaked (> 1).
    Rows past each length are filled with large garbage, so a kernel that reads them is caught.
    """
    q = rng.standard_normal((B, H, D)).astype(np.float32) * peak
    k = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    for b, n in enumerate(lengths):
        k[b, n:] = 1e4
        v[b, n:] = -3e4
    conv = lambda x: spec.from_float32(x, dtype, np)  # noqa: E731
    return conv(q), conv(k), conv(v), np.asarray(lengths, np.int32)


def to_gpu(*arrays):
    import cupy
    return tuple(cupy.asarray(a) for a in arrays)


def rel_l2(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def rope_operands(rng, n, KVH, D, L_max, kv_dtype):
    """The rotary + K/V append's other operands for n tokens, drawn from rng in this order:
    cos, sin [L_max + 3, D/2] float32 (random angles), pos [n] int32 holding L_max - 1 and (n > 1) 0,
    and store [2, n, L_max, KVH, D] of kv_dtype, the K and V caches' starting contents."""
    ang = rng.uniform(-4, 4, (L_max + 3, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, L_max, n).astype(np.int32)
    pos[0] = L_max - 1
    if n > 1:
        pos[1] = 0
    store = spec.from_float32(rng.standard_normal((2, n, L_max, KVH, D)).astype(np.float32), kv_dtype, np)
    return cos, sin, pos, store


def stable_seed(*parts) -> int:
    """A seed from test parameters that is the same in every process (hash() of a str is salted
    per process, so seeds built from it changed the test data from run to run)."""
    import zlib
    return zlib.crc32(repr(parts).encode())


def as_float32(x):
    """A kernel's output (CuPy or NumPy; bf16 as uint16 bits) as a float32 NumPy array."""
    from santa_cupy import spec
    x = x.get() if hasattr(x, "get") else x
    return spec.to_float32(x, np) if x.dtype == np.uint16 else x.astype(np.float32)


def paged_inputs(rng, lengths, page_size, H=8, KVH=2, D=128, dtype="bfloat16", layout="NHD", spare=3):
    """q, page pools (shuffled page ids, one page shared by sequences 0 and 1, pages past each
    length filled with garbage the kernels must not read), block table [B, max_pages + 1] int32
    (padding -5 past each sequence's pages), lengths int32."""
    lengths = np.asarray(lengths, np.int32)
    need = -(-lengths // page_size)
    num_pages = int(need.sum()) + spare
    order = rng.permutation(num_pages)
    max_pages = int(need.max()) + 1
    table = np.full((len(lengths), max_pages), -5, np.int32)
    at = 0
    for b, k in enumerate(need):
        table[b, :k] = order[at:at + k]
        at += k
    if len(lengths) > 1 and need[0] and need[1]:
        table[1, 0] = table[0, 0]                               # a shared prefix page
    shape = (num_pages, page_size, KVH, D) if layout == "NHD" else (num_pages, KVH, page_size, D)
    conv = lambda x: spec.from_float32(x.astype(np.float32), dtype, np)   # noqa: E731
    kp = conv(rng.standard_normal(shape))
    vp = conv(rng.standard_normal(shape))
    used = set(table[table >= 0].ravel().tolist())
    for p in range(num_pages):                                  # unused pages: garbage
        if p not in used:
            kp[p] = conv(np.full(shape[1:], 1e4))
            vp[p] = conv(np.full(shape[1:], -3e4))
    q = conv(rng.standard_normal((len(lengths), H, D)))
    return q, kp, vp, table, lengths

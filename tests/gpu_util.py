"""Shared helpers of the tests: the GPU skip marker, random decode inputs, page pools."""

from typing import NamedTuple

import numpy as np
import pytest

from santa_cupy import reference, spec


def _gpu_available() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


HAVE_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs CuPy and a CUDA GPU")
NP_STORAGE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
# relative L2 error over a whole output, for estimators compared with their own reference (santa);
# dense kernels are checked element by element: dense_error_bound / assert_dense_matches
DENSE_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


def random_inputs(rng, B, H, KVH, D, L_max, lengths, dtype, peak=1.0, spike=False):
    """NumPy q [B,H,D], k, v [B,L_max,KVH,D] in storage dtype, lengths int32; random normal data.

    ``peak`` scales q so that the score distribution is flatter (< 1) or more peaked (> 1).
    Rows past each length are filled with large garbage, so a kernel that reads them is caught.
    ``spike``: the last row of every sequence (row length - 1) gets a key that gives every query
    head of its KV group a score equal to the log-sum-exp of the sequence's other rows (exactly, up
    to the storage rounding), so that row holds about half of each head's attention weight: a
    kernel that drops or misplaces the last row is off by ~half the output (plant_spike).
    """
    q = rng.standard_normal((B, H, D)).astype(np.float32) * peak
    k = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    for b, n in enumerate(lengths):
        k[b, n:] = 1e4
        v[b, n:] = -3e4
    conv = lambda x: spec.from_float32(x, dtype, np)  # noqa: E731
    q = conv(q)
    if spike:
        plant_spike(q, k, lengths, dtype)
    return q, conv(k), conv(v), np.asarray(lengths, np.int32)


def plant_spike(q, k, lengths, dtype):
    """k [B, L_max, KVH, D] float32 (before its storage rounding), in place: row n_b - 1 of every
    sequence (n_b >= 1) and KV head g := the minimum-norm key whose scores scale * q_h . k with the
    group's G query heads h (q in storage dtype) equal each head's log-sum-exp over rows
    0..n_b - 2 (1.0 for a one-row sequence): weight ~1/2 on the last row for every head."""
    B, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    scale = 1.0 / np.sqrt(D)
    qf = reference.to_float64(q).reshape(B, KVH, G, D)
    for b, n in enumerate(lengths):
        if n < 1:
            continue
        if n > 1:
            kb = reference.to_float64(spec.from_float32(k[b, :n - 1], dtype, np))      # [n-1, KVH, D]
            s = (qf[b] @ kb.transpose(1, 2, 0)) * scale                             # [KVH, G, n-1]
            m = s.max(-1, keepdims=True)
            target = (m + np.log(np.exp(s - m).sum(-1, keepdims=True)))[..., 0]     # [KVH, G]
        else:
            target = np.ones((KVH, G))
        for g in range(KVH):
            k[b, n - 1, g] = np.linalg.lstsq(qf[b, g] * scale, target[g], rcond=None)[0].astype(np.float32)


# unit roundoff of each storage dtype (round to nearest: |x - fl(x)| <= u |x|), and half the
# smallest subnormal (the absolute error of a value that underflows)
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
HALF_TINY = {"bfloat16": 2.0 ** -134, "float16": 2.0 ** -25, "float32": 2.0 ** -150}
F32_U = 2.0 ** -24


def round_to_storage(x, dtype):
    """float64 array -> float64 values of its rounding to the storage dtype (through float32)."""
    return spec.to_float32(spec.from_float32(np.asarray(x, np.float32), dtype, np), np).astype(np.float64)


class DenseCheck(NamedTuple):
    want: np.ndarray      # [B, H, D] float64: the reference rounded to the storage dtype
    bound: np.ndarray     # [B, H, D]: the most a correct kernel's output may differ from want
    weights: np.ndarray   # [B, H, L_max] exact attention weights
    lse: np.ndarray       # [B, H] exact log-sum-exp of the scaled scores (-inf: empty sequence)
    lengths: np.ndarray   # [B]


def dense_error_bound(q, k, v, lengths, dtype, scale=None):
    """DenseCheck(want [B, H, D]: the float64 reference rounded to the storage dtype, bound [B, H, D]:
    how far a correct kernel's output may be from it, element by element; weights, lse).

    A correct kernel computes scores and both products with float32 accumulation and may round the
    probabilities P to the storage dtype before the P.V product (decode_dense_mma does, on tensor
    cores, as FlashAttention; l sums the unrounded p). With w_j the exact weights, A_d = sum_j w_j
    |v_jd| and u the storage dtype's unit roundoff, its float32 output o32 satisfies
        |o32_d - ref_d| <= (u_P + 4 eps_s + gamma) A_d + n * tiny * w_max * max_j |v_jd|
    - u_P = u: each rounded weight is off by <= u relative (0 for float32 storage, never rounded);
    - eps_s = 2 (D + 8) 2^-24 max_j scale sum_i |q_i k_ji|: a float32 dot product's worst-case
      error (plus the scale / log2 e multiplications and exp2f's few ulp); a score error e moves
      the normalised weights by <= 2e relative, x2 margin;
    - gamma = 2 (n + 2 D + 16) 2^-24: worst-case float32 summation of <= n weighted rows, the
      online-softmax rescales and the split merges (the bound of recursive summation, x2);
    - fp16 P underflows below 2^-14 of the running max: <= tiny = 2^-25 absolute per row.
    Rounding o32 to the storage dtype and comparing with the rounded reference adds <= 2u |ref|
    (both sides' rounding; they may straddle a rounding boundary). The bound is worst case, not
    typical (the typical error is ~ u w_max |v|; a NumPy model of the kernel's arithmetic reaches
    about half of it: tests/test_dense_bound.py), so a correct kernel stays inside it; at the
    lengths of these tests it is still far below a dropped row that holds a planted spike's ~1/2
    weight, or a head 5% off (per (b, h) the bound is ~0.3% of the output at 300 rows in fp16,
    ~1.6% in bf16, ~4% at 100k rows, where gamma dominates)."""
    B, H, D = q.shape
    L, KVH = k.shape[1], k.shape[2]
    G = H // KVH
    scale = 1.0 / np.sqrt(D) if scale is None else float(scale)
    n = np.asarray(lengths).reshape(B, 1, 1, 1)
    inside = np.arange(L)[None, None, None, :] < n                           # [B, 1, 1, L]
    qf = reference.to_float64(q).reshape(B, KVH, G, D)
    kt = reference.to_float64(k).transpose(0, 2, 3, 1)                      # [B, KVH, D, L]
    vt = np.where(inside.reshape(B, 1, L, 1), reference.to_float64(v).transpose(0, 2, 1, 3), 0.0)
    s = np.where(inside, (qf @ kt) * scale, -np.inf)                          # [B, KVH, G, L]
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    z = p.sum(-1, keepdims=True)
    w = p / np.maximum(z, 1e-300)                                              # 0 for an empty sequence
    ref = (w @ vt).reshape(B, H, D)
    A = (w @ np.abs(vt)).reshape(B, H, D)
    # sum_i |q_i k_ji| <= |q| |k_j| (Cauchy-Schwarz; cheaper than the products, ~1.6x looser)
    knorm = np.where(inside, np.sqrt((kt * kt).sum(2, keepdims=True)), 0.0)   # [B, KVH, 1, L]
    dot_abs = np.sqrt((qf * qf).sum(-1, keepdims=True)) * knorm.max(-1, keepdims=True) * scale
    eps_s = 2 * (D + 8) * F32_U * dot_abs.reshape(B, H, 1)
    n = n.reshape(B, 1, 1).astype(np.float64)
    gamma = 2 * (n + 2 * D + 16) * F32_U
    u = UNIT_ROUNDOFF[dtype]
    u_p = 0.0 if dtype == "float32" else u
    underflow = 0.0
    if dtype == "float16":
        vmax = np.abs(vt).max(axis=2)[:, :, None, :].repeat(G, axis=2).reshape(B, H, D)
        underflow = n * HALF_TINY[dtype] * w.max(-1).reshape(B, H, 1) * vmax
    bound = (u_p + 4 * eps_s + gamma) * A + underflow
    bound = bound * (1 + u) + 2 * u * np.abs(ref) + 2 * HALF_TINY[dtype] + 1e-30
    lse = np.where(z[..., 0] > 0, m[..., 0] + np.log(np.maximum(z[..., 0], 1e-300)), -np.inf).reshape(B, H)
    return DenseCheck(round_to_storage(ref, dtype), bound, w.reshape(B, H, L), lse, np.asarray(lengths))


def assert_dense_matches(o, ref: DenseCheck, what="", spike=True):
    """A dense kernel's output o (CuPy or NumPy, storage dtype) within ref.bound of the float64
    reference rounded to the storage dtype (ref = dense_error_bound(...)), for every (b, h) and
    element. ``spike`` (True for all sequences, or one bool per sequence): the inputs carry a
    planted spike at row length - 1 (random_inputs(spike=True)); checks that it holds >= 1/5 of
    every head's weight, so a kernel that drops that row cannot pass."""
    got = as_float32(o).astype(np.float64)
    assert got.shape == ref.want.shape, (what, got.shape, ref.want.shape)
    assert np.isfinite(got).all(), f"{what}: output not fully written"
    ratio = np.abs(got - ref.want) / ref.bound                                 # [B, H, D]
    worst = ratio.max(-1)                                                      # per (b, h)
    bad = np.argwhere(worst > 1)
    assert not len(bad), (f"{what}: {len(bad)} of {worst.size} (b, h) outside the error bound, e.g. "
                          + ", ".join(f"(b={b}, h={h}): {worst[b, h]:.3g}x" for b, h in bad[:6]))
    spikes = [spike] * len(ref.lengths) if isinstance(spike, bool) else list(spike)
    for b, (n, planted) in enumerate(zip(ref.lengths, spikes)):
        if planted and n > 0:
            assert (ref.weights[b, :, n - 1] >= 0.2).all(), f"{what}: no spike at row {n - 1} of sequence {b}"


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


KERNEL_CHOICE_KEYS = ("dense_kernel", "score_kernel", "tile_kernel", "tiles_per_warp", "dense_splits",
                      "self_merge_max_splits", "fused_fixed_max_kv_bytes", "mma_min_rows", "finish_max_groups",
                      "merge_wide", "programmatic", "stash_l2_max_bytes")


def make_plan(**kw):
    """santa_cupy.DecodePlan(**kw) with the kernel-choice keywords among kw (KERNEL_CHOICE_KEYS)
    passed as the plan's internal ``_kernels=KernelChoice(...)`` override."""
    from santa_cupy import DecodePlan
    from santa_cupy.kernel_choice import KernelChoice

    choice = {k: kw.pop(k) for k in KERNEL_CHOICE_KEYS if k in kw}
    return DecodePlan(**kw, _kernels=KernelChoice(**choice) if choice else None)

"""Supported shapes, dtypes and limits of santa-cupy, and input validation: the one place for them.

Everything here works on NumPy arrays and, without importing CuPy at import time, on CuPy arrays.
bfloat16 has no NumPy dtype: a ``uint16`` array holds bf16 bit patterns (a uint16 array *is* bf16).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

HEAD_DIMS = (64, 128, 256)
MAX_G = 16  # largest GQA group size G = H // KVH
BLOCK_NS = (64, 128)  # tile sizes (rows per tile)
DEFAULT_BLOCK_N = 128


def default_block_n(method, head_dim) -> int:
    """Tile rows when the caller gives none. santa: 128 (64 at head_dim 256, which bounds the
    tile kernel's shared memory); dense: 64 (only the granularity of its split-KV partitions)."""
    if method == "dense":
        return 64
    return 64 if head_dim == 256 else DEFAULT_BLOCK_N
METHODS = ("dense", "santa")
SAMPLERS = ("iid", "stratified", "systematic")
BUDGETS = ("fixed", "global", "largest_remainder")
# The one-pass budget (santa_cupy/one_pass.py): Horvitz-Thompson rows from a normaliser guess
# (lse_hint), systematic inside each tile; a budget of decode_attention and DecodePlan, kept out of
# BUDGETS (the grids of the two-pass budgets that tests, eval and bench sweep).
ONE_PASS = "one_pass"
DECODE_BUDGETS = BUDGETS + (ONE_PASS,)
# Local comb arithmetic is float32: keep sample counts exact integers in float32 (2**24) with margin.
# The within-tile comb runs in float32 (a * cum - off, as the kernels do): its points are exact to
# about n * 2^-24 of a point for n points in a tile. Up to 2^16 samples the counts of a tile holding
# them all are unbiased within what 1000 seeds resolve; at 2^20 they are biased (z = 26 on a peaked
# tile; tests/test_comb_precision.py). So S is capped where the float32 comb holds.
MAX_SAMPLES = 1 << 16
GLOBAL_TILE = 0xFFFFFFFF  # RNG tile field for draws on the global comb (budget="global")

# numpy dtype -> public dtype name.  float64 is accepted by the NumPy reference path only.
DTYPE_NAMES = {
    np.dtype(np.float16): "float16",
    np.dtype(np.uint16): "bfloat16",
    np.dtype(np.float32): "float32",
    np.dtype(np.float64): "float64",
}
GPU_DTYPES = ("float16", "bfloat16", "float32")
CPU_DTYPES = GPU_DTYPES + ("float64",)


@dataclass(frozen=True)
class DecodeShape:
    """Validated problem size of one decode-attention call."""

    B: int  # batch (sequences)
    H: int  # query heads
    KVH: int  # KV heads
    G: int  # query heads per KV head (H // KVH)
    D: int  # head dim
    L_max: int  # KV cache capacity (rows per sequence)
    dtype_name: str  # "float16" | "bfloat16" | "float32" | "float64"
    scale: float  # score scale (1/sqrt(D) when not given)


# ----------------------------------------------------------------------------------- array modules


def is_cupy_array(x) -> bool:
    """True for a CuPy ndarray (checked by module name, CuPy is never imported here)."""
    return type(x).__module__.split(".")[0] == "cupy"


def array_module(x):
    """numpy for NumPy arrays, cupy for CuPy arrays (imported lazily)."""
    if is_cupy_array(x):
        import cupy

        return cupy
    return np


# --------------------------------------------------------------------------------- bf16 helpers


def to_float32(x, xp=None):
    """float32 copy of ``x``; a uint16 array is read as bfloat16 bit patterns (bits << 16)."""
    xp = array_module(x) if xp is None else xp
    if x.dtype == np.uint16:
        return (x.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)
    return x.astype(xp.float32)


def from_float32(x, dtype_name, xp=None):
    """Convert a float array to ``dtype_name``; "bfloat16" rounds to nearest even into uint16 bits.

    NaN stays NaN (quiet, sign kept); overflow rounds to +-inf as in hardware conversions.
    """
    xp = array_module(x) if xp is None else xp
    if dtype_name != "bfloat16":
        return x.astype(np.dtype(dtype_name))
    bits = xp.ascontiguousarray(x.astype(xp.float32)).view(xp.uint32)
    lsb = (bits >> xp.uint32(16)) & xp.uint32(1)
    rounded = ((bits + xp.uint32(0x7FFF) + lsb) >> xp.uint32(16)).astype(xp.uint16)
    quiet_nan = ((bits >> xp.uint32(16)) | xp.uint32(0x0040)).astype(xp.uint16)
    return xp.where(xp.isnan(x), quiet_nan, rounded)


# ----------------------------------------------------------------------------------- validation


def describe(x) -> str:
    """Short description of an argument for error messages."""
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None:
        return f"{type(x).__module__.split('.')[0]}.{type(x).__name__} shape={tuple(shape)} dtype={dtype}"
    return f"{type(x).__name__} {x!r}"


def check_choice(name, value, choices):
    """ValueError naming ``name`` unless ``value`` is one of the strings ``choices``."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_samples(samples):
    """TypeError unless an integer, ValueError unless 1 <= samples <= MAX_SAMPLES."""
    if isinstance(samples, bool) or not isinstance(samples, numbers.Integral):
        raise TypeError(f"samples must be an int, got {type(samples).__name__} {samples!r}")
    if not 1 <= int(samples) <= MAX_SAMPLES:
        raise ValueError(f"samples must be in [1, {MAX_SAMPLES}], got {int(samples)}")


def check_estimator(method, samples, sampler, budget):
    """The fields of an estimator (santa_cupy.AttentionSetting's): method, sampler and budget
    among the supported ones, the one-pass budget systematic, 1 <= samples <= MAX_SAMPLES."""
    check_choice("method", method, METHODS)
    check_choice("sampler", sampler, SAMPLERS)
    check_choice("budget", budget, DECODE_BUDGETS)
    if budget == ONE_PASS and method == "santa" and sampler != "systematic":
        raise ValueError(f"budget {ONE_PASS!r} draws systematically inside each tile: sampler must be "
                         f"'systematic', got {sampler!r}")
    check_samples(samples)


def check_block_n(block_n):
    """ValueError unless an integer in BLOCK_NS (no bool, no float)."""
    if isinstance(block_n, bool) or not isinstance(block_n, numbers.Integral) or int(block_n) not in BLOCK_NS:
        raise ValueError(f"block_n must be one of {BLOCK_NS}, got {block_n!r}")


# score-stage (key) sampling, santa_cupy.key_sampling (GPU: santa_cupy/key_pass.py)
KEY_SAMPLINGS = ("none", "bernoulli", "bernoulli_block")
KEY_BLOCKS = (16, 32)                 # features per block of the block estimator
KEY_RULES = ("uniform", "qmax", "qrms", "qkvar")
KEY_COMBINES = ("mean", "union")
MAX_KEY_DRAWS = 256


def _check_key_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {int(value)}")


def check_key_options(key_sampling, key_draws, key_block, key_budget, key_rule, key_combine, key_variance=None):
    """The key-sampling options (santa_cupy.key_sampling.key_scores', AttentionSetting's key_*
    fields): ValueError naming the first bad one. key_variance: None or a finite real > 0, with
    key_rule "qkvar" only. The head dim's divisibility by key_block is checked at the call."""
    check_choice("key_sampling", key_sampling, KEY_SAMPLINGS)
    check_choice("key_rule", key_rule, KEY_RULES)
    check_choice("key_combine", key_combine, KEY_COMBINES)
    _check_key_int("key_draws", key_draws, 1, MAX_KEY_DRAWS)
    if isinstance(key_block, bool) or not isinstance(key_block, numbers.Integral) or int(key_block) not in KEY_BLOCKS:
        raise ValueError(f"key_block must be one of {KEY_BLOCKS}, got {key_block!r}")
    if isinstance(key_budget, bool) or not isinstance(key_budget, numbers.Real):
        raise ValueError(f"key_budget must be a real number in (0, 1], got {key_budget!r}")
    if not 0.0 < float(key_budget) <= 1.0:
        raise ValueError(f"key_budget must be in (0, 1], got {key_budget!r}")
    if key_variance is not None:
        if isinstance(key_variance, bool) or not isinstance(key_variance, numbers.Real) or not (
                0.0 < float(key_variance) < math.inf):
            raise ValueError(f"key_variance must be None or a finite real > 0, got {key_variance!r}")
        if key_rule != "qkvar":
            raise ValueError(f'key_variance needs key_rule="qkvar", got key_rule={key_rule!r}')


def _array_library(name, x) -> str:
    """'numpy' or 'cupy'; TypeError for anything else."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if is_cupy_array(x) and hasattr(x, "dtype"):
        return "cupy"
    raise TypeError(f"{name} must be a numpy.ndarray or cupy.ndarray, got {type(x).__module__}.{type(x).__name__}")


def _check_libraries(arrays) -> str:
    libs = {name: _array_library(name, x) for name, x in arrays.items()}
    if len(set(libs.values())) > 1:
        seen = ", ".join(f"{n}={lib}" for n, lib in libs.items())
        raise TypeError(f"q, k_cache, v_cache and lengths must all be NumPy or all CuPy arrays, got {seen}")
    return next(iter(libs.values()))


def _check_ranks(q, k_cache, v_cache, lengths):
    for name, x, rank, layout in (
        ("q", q, 3, "[B, H, D]"),
        ("k_cache", k_cache, 4, "[B, L_max, KVH, D]"),
        ("v_cache", v_cache, 4, "[B, L_max, KVH, D]"),
        ("lengths", lengths, 1, "[B]"),
    ):
        if x.ndim != rank:
            raise ValueError(f"{name} must have rank {rank} {layout}, got {describe(x)}")


def _check_shapes(q, k_cache, v_cache, lengths):
    B, H, D = q.shape
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}")
    kb, L_max, KVH, kd = k_cache.shape
    if kb != B:
        raise ValueError(f"k_cache batch {kb} must equal q batch {B} (q shape {tuple(q.shape)})")
    if kd != D:
        raise ValueError(f"k_cache head dim {kd} must equal q head dim {D} (q shape {tuple(q.shape)})")
    if tuple(lengths.shape) != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
    if B < 1 or H < 1:
        raise ValueError(f"q must have B >= 1 and H >= 1, got shape {tuple(q.shape)}")
    if L_max < 1:
        raise ValueError(f"k_cache must have L_max >= 1, got shape {tuple(k_cache.shape)}")
    _check_heads(H, KVH, D)
    return B, H, KVH, H // KVH, D, L_max


def _check_heads(H, KVH, D):
    """The head dim and the GQA group of q's H heads over the cache's KVH (contiguous or pages)."""
    if D not in HEAD_DIMS:
        raise ValueError(f"head dim D (q.shape[2]) must be one of {HEAD_DIMS}, got {D}")
    if KVH < 1 or H % KVH != 0:
        raise ValueError(f"q heads H={H} must be a multiple of k_cache KV heads KVH={KVH}")
    if H // KVH > MAX_G:
        raise ValueError(f"GQA group size H/KVH = {H}/{KVH} = {H // KVH} exceeds MAX_G={MAX_G} (q, k_cache)")


PAGE_LAYOUTS = ("NHD", "HND")    # [num_pages, page_size, KVH, D] (FlashInfer's, vLLM's) | [num_pages, KVH, page_size, D]
DEFAULT_PAGE_SIZE = 16
MAX_PAGE_SIZE = 256


def page_shape(k_pages, layout="NHD"):
    """(num_pages, page_size, KVH, D) of a page pool in either layout; ValueError naming k_pages."""
    check_choice("layout", layout, PAGE_LAYOUTS)
    shape = tuple(getattr(k_pages, "shape", ()))
    if len(shape) != 4:
        raise ValueError(f"k_pages must have 4 dimensions [num_pages, page_size, KVH, D] ({layout}), "
                         f"got shape {shape}")
    num_pages, a, b, D = shape
    page_size, KVH = (a, b) if layout == "NHD" else (b, a)
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        raise ValueError(f"page_size (k_pages.shape[{1 if layout == 'NHD' else 2}]) must be in "
                         f"1..{MAX_PAGE_SIZE}, got {page_size}")
    return num_pages, page_size, KVH, D


def _check_page_shapes(q, k_pages, v_pages, lengths, layout, max_length):
    """_check_shapes for page pools: (B, H, KVH, G, D, L_max) with L_max = max_length."""
    if q.ndim != 3 or lengths.ndim != 1:
        raise ValueError(f"q must have rank 3 [B, H, D] and lengths rank 1 [B], got q {describe(q)}, "
                         f"lengths {describe(lengths)}")
    num_pages, page_size, KVH, kd = page_shape(k_pages, layout)
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(f"v_cache shape {tuple(v_pages.shape)} must equal k_cache shape {tuple(k_pages.shape)} "
                         f"(page pools, {layout})")
    B, H, D = q.shape
    if kd != D:
        raise ValueError(f"k_cache head dim {kd} must equal q head dim {D} (q shape {tuple(q.shape)})")
    if tuple(lengths.shape) != (B,) or B < 1 or H < 1 or num_pages < 1:
        raise ValueError(f"lengths must have shape ({B},) with B, H >= 1 and at least one page, got lengths "
                         f"{describe(lengths)}, q {describe(q)}, k_cache {describe(k_pages)}")
    if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
        raise ValueError(f"max_length must be an integer >= 1 for a paged cache, got {max_length!r}")
    _check_heads(H, KVH, D)
    return B, H, KVH, H // KVH, D, int(max_length)


def _check_dtypes(q, k_cache, v_cache, lengths, library) -> str:
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(
            f"q, k_cache and v_cache must share one dtype, got q={q.dtype}, k_cache={k_cache.dtype}, v_cache={v_cache.dtype}"
        )
    name = DTYPE_NAMES.get(np.dtype(q.dtype))
    allowed = CPU_DTYPES if library == "numpy" else GPU_DTYPES
    if name not in allowed:
        raise TypeError(
            f"q dtype {q.dtype} is not supported for {library} arrays; supported: {allowed} "
            "(bfloat16 as uint16 bit patterns)"
        )
    if np.dtype(lengths.dtype).kind not in "iu":
        raise TypeError(f"lengths must have an integer dtype, got {lengths.dtype}")
    return name


def _check_contiguous(arrays):
    for name, x in arrays.items():
        if not x.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous, got strides {tuple(x.strides)} for shape {tuple(x.shape)}")


def _check_length_values(lengths, L_max):
    host = lengths.get() if is_cupy_array(lengths) else lengths  # device -> host copy: a sync
    host = np.asarray(host).astype(np.int64)
    bad = np.flatnonzero((host < 1) | (host > L_max))
    if bad.size:
        shown = {int(i): int(host[i]) for i in bad[:8]}
        raise ValueError(f"lengths must be in [1, L_max={L_max}], got out-of-range values at {{index: value}} {shown}")


def _resolve_scale(scale, D) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} {scale!r}")
    value = float(scale)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"scale must be finite and > 0, got {value!r}")
    return value


def _check_finite_q(q, xp):
    ok = xp.isfinite(to_float32(q, xp)).all()  # for CuPy: a device -> host sync
    if not bool(ok):
        raise ValueError(f"q must be finite (no NaN/inf), got non-finite values in q of shape {tuple(q.shape)}")


def validate_decode_inputs(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    method="santa",
    samples=256,
    sampler="systematic",
    budget="global",
    scale=None,
    block_n=DEFAULT_BLOCK_N,
    xp=None,
    check_lengths=True,
    check_finite=True,
    page_layout=None,
    max_length=None,
) -> DecodeShape:
    """Check one decode-attention call; return its DecodeShape or raise ValueError/TypeError.

    Shapes: q [B, H, D], k_cache/v_cache [B, L_max, KVH, D] C-contiguous, lengths [B] integer.
    ``page_layout`` "NHD" | "HND": k_cache/v_cache are page pools instead (santa_cupy/paged.py:
    [num_pages, page_size, KVH, D] or [num_pages, KVH, page_size, D]) and L_max = ``max_length``,
    the longest sequence the call serves; the block table is checked by paged.validate_block_table.
    ``check_lengths`` (1 <= lengths <= L_max) and ``check_finite`` (q has no NaN/inf) read the data;
    on CuPy arrays each is a device sync, so a plan may validate once and switch them off.
    ``xp`` is the array module; None picks it from the arrays.
    """
    check_estimator(method, samples, sampler, budget)
    check_block_n(block_n)
    arrays = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "lengths": lengths}
    library = _check_libraries(arrays)
    if page_layout is None:
        _check_ranks(q, k_cache, v_cache, lengths)
        B, H, KVH, G, D, L_max = _check_shapes(q, k_cache, v_cache, lengths)
    else:
        B, H, KVH, G, D, L_max = _check_page_shapes(q, k_cache, v_cache, lengths, page_layout, max_length)
    dtype_name = _check_dtypes(q, k_cache, v_cache, lengths, library)
    _check_contiguous(arrays)
    resolved_scale = _resolve_scale(scale, D)
    if xp is None:
        xp = array_module(q)
    if check_lengths:
        _check_length_values(lengths, L_max)
    if check_finite:
        _check_finite_q(q, xp)
    return DecodeShape(B=B, H=H, KVH=KVH, G=G, D=D, L_max=L_max, dtype_name=dtype_name, scale=resolved_scale)

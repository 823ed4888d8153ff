"""Fuzz of the public API: santa_cupy.decode_attention on random valid and invalid calls.

Each case is drawn from numpy's default_rng seeded by its number (deterministic): random B, H,
KVH (G = H / KVH in 1..16), D, L_max, dtype, lengths (1 and the capacity often), method, sampler,
budget, samples, seed, step, layer, scale, block_n; rows past each length hold NaN or garbage. Most
cases then get one mutation: a bad value of one argument (length 0, negative or past L_max, strides,
ranks, shapes, dtypes, array libraries, NaN/inf in q, a bad method / sampler / ... value), or a valid
oddity (NaN/inf in the caches, bf16 as int16, other integer dtypes of lengths).

The contract checked: the call returns the float64 reference's answer (santa_cupy.reference, rounded
to the dtype of q), or it raises ValueError / TypeError whose message names the offending argument.
NaN/inf in q is an error (spec.validate_decode_inputs, check_finite); NaN/inf in K within a length
makes the heads whose softmax normaliser is not finite NaN (as on the GPU), never a finite number.

test_fuzz_numpy runs in CI; test_fuzz_cupy (marker gpu) feeds the same cases as CuPy arrays, with
santa at every length (santa_min_length=0), against the reference with the GPU tests' tolerances.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field

import numpy as np
import pytest

from santa_cupy import decode_attention, reference, spec
from tests.gpu_util import DENSE_TOL, rel_l2, requires_gpu

N_CASES = 1000         # CPU, in CI
N_GPU_CASES = 150      # each new (dtype, D, G, block_n, method) compiles kernels once
DTYPES = ("float16", "bfloat16", "float32", "float64")
CAPACITIES = (1, 2, 63, 64, 65, 128, 129, 200, 257)
MUTATION_RATE = 0.7
# relative rounding of the output dtype (one ulp); float16 also has subnormals below 6e-5
RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 2.0**-23, "float64": 1e-15}
ATOL = {"float16": 2.0**-24, "bfloat16": 1e-37, "float32": 1e-37, "float64": 0.0}


# ------------------------------------------------------------------------- array libraries


class FakeCupyArray:
    """What spec takes for a CuPy array (its module is cupy), holding NumPy data: one of these
    among NumPy arrays simulates mixing the two libraries without CuPy installed."""

    def __init__(self, a):
        self.a, self.dtype, self.shape, self.ndim = a, a.dtype, a.shape, a.ndim
        self.flags, self.strides = a.flags, a.strides


FakeCupyArray.__module__ = "cupy._core.core"


class ForeignTensor:
    """A tensor of another library (a torch CPU tensor, say): DLPack but no CuPy to take it."""

    def __init__(self, a):
        self.a, self.dtype, self.shape = a, a.dtype, a.shape

    def __dlpack__(self, stream=None):
        raise BufferError("not a GPU array")

    def __dlpack_device__(self):
        return (1, 0)  # kDLCPU


ForeignTensor.__module__ = "torch"


class NumpyLib:
    name, xp, dtypes = "numpy", np, spec.CPU_DTYPES

    @staticmethod
    def put(a):
        return a

    @staticmethod
    def get(a):
        return a

    @staticmethod
    def other(a):           # an array of the other library
        return FakeCupyArray(a)

    @staticmethod
    def foreign(a):         # an object that is neither (without CuPy, DLPack cannot help)
        return ForeignTensor(a)


class CupyLib:
    name, dtypes = "cupy", spec.GPU_DTYPES

    def __init__(self):
        import cupy
        self.xp = cupy

    def put(self, a):
        return self.xp.asarray(a)

    @staticmethod
    def get(a):
        return a.get()

    @staticmethod
    def other(a):
        return a.get()

    @staticmethod
    def foreign(a):
        return a.get().tolist()


# ------------------------------------------------------------------------------ the cases


ARRAYS = ("q", "k_cache", "v_cache", "lengths")


@dataclass
class Case:
    number: int
    dtype: str
    arrays: dict                      # q, k_cache, v_cache, lengths
    kwargs: dict                      # decode_attention's keywords (santa_min_length: if mutated)
    what: str = "valid"               # the mutation applied
    bad: set = field(default_factory=set)   # arguments an error may name; empty: a valid call

    def __str__(self):
        shapes = {n: getattr(a, "shape", type(a).__name__) for n, a in self.arrays.items()}
        return f"case {self.number} ({self.what}): {self.dtype} {shapes} {self.kwargs}"


def _pick(rng, values):
    return values[int(rng.integers(len(values)))]


def _data(rng, shape, dtype, lib):
    x = rng.standard_normal(shape).astype(np.float32)
    return lib.put(spec.from_float32(x, dtype, np))


def _strided(x, xp):
    """The same values with a stride of two elements along the last axis: not C-contiguous."""
    return xp.repeat(x, 2, axis=-1)[..., ::2]


def _put_value(x, index, value, lib):
    """x with x[index] = value (a float) in x's storage dtype (bf16 bits for uint16)."""
    host = lib.get(x).copy()
    host[index] = spec.from_float32(np.array([value], np.float32), _dtype_name(host), np)[0]
    return lib.put(host)


def _dtype_name(a):
    return spec.DTYPE_NAMES[np.dtype(a.dtype)]


def make_case(number, lib) -> Case:
    rng = np.random.default_rng([20, number])
    D = int(_pick(rng, spec.HEAD_DIMS))
    G = int(rng.integers(1, spec.MAX_G + 1))
    KVH = int(rng.integers(1, 4))
    H, B = G * KVH, int(rng.integers(1, 4))
    L_max = int(_pick(rng, CAPACITIES))
    dtype = _pick(rng, DTYPES)
    lengths = np.array([_pick(rng, (1, L_max, int(rng.integers(1, L_max + 1)))) for _ in range(B)], np.int32)
    q = rng.standard_normal((B, H, D)).astype(np.float32) * np.float32(_pick(rng, (0.3, 1.0, 3.0)))
    k = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    v = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    past = _pick(rng, (None, np.nan, 1e4))                       # rows past a length: never read
    if past is not None:
        for b, n in enumerate(lengths):
            k[b, n:], v[b, n:] = past, -past
    conv = lambda x: lib.put(spec.from_float32(x, dtype, np))   # noqa: E731
    samples = int(_pick(rng, (1, 2, 5, 64, 256, 1000)))
    if B * H <= 8 and rng.random() < 0.1:
        samples = spec.MAX_SAMPLES
    kwargs = dict(method=_pick(rng, spec.METHODS), samples=samples, sampler=_pick(rng, spec.SAMPLERS),
                  budget=_pick(rng, spec.BUDGETS), seed=int(_pick(rng, (0, 1, 2**64 - 1, int(rng.integers(2**62))))),
                  step=int(_pick(rng, (0, 7, 2**63 - 1))), layer=int(_pick(rng, (0, 3, 2**31 - 1))),
                  scale=_pick(rng, (None, None, 0.05, 1.0)), block_n=_pick(rng, (None, None, 64, 128)),
                  return_info=bool(rng.random() < 0.5))
    case = Case(number, dtype, {"q": conv(q), "k_cache": conv(k), "v_cache": conv(v), "lengths": lib.put(lengths)},
                kwargs)
    if rng.random() < MUTATION_RATE:
        name = _pick(rng, sorted(MUTATIONS))
        case.what = name
        MUTATIONS[name](case, rng, lib)
    if case.dtype not in lib.dtypes:                             # float64 on the GPU
        case.bad.add("q")
    return case


# Each mutation edits the case in place and adds to case.bad the argument(s) an error must name.


def _lengths_value(value):
    def mutate(case, rng, lib):
        host = lib.get(case.arrays["lengths"]).copy()
        L_max = case.arrays["k_cache"].shape[1]
        host[int(rng.integers(len(host)))] = {"zero": 0, "negative": -int(rng.integers(1, 5)),
                                              "over": L_max + int(rng.integers(1, 3))}[value]
        case.arrays["lengths"] = lib.put(host)
        case.bad.add("lengths")
    return mutate


def _lengths_as(kind):
    def mutate(case, rng, lib):
        host = lib.get(case.arrays["lengths"])
        new = {"float": lambda: lib.put(host.astype(np.float64)), "list": lambda: host.tolist(),
               "one more": lambda: lib.put(np.append(host, 1)), "rank 2": lambda: lib.put(host[:, None]),
               "rank 0": lambda: lib.put(host[0])}[kind]()
        case.arrays["lengths"] = new
        case.bad.add("lengths")
    return mutate


def _lengths_int_dtype(case, rng, lib):          # valid: any integer dtype that holds the values
    dt = _pick(rng, (np.int64, np.uint32, np.int16, np.uint64))
    case.arrays["lengths"] = lib.put(lib.get(case.arrays["lengths"]).astype(dt))


def _strides(name):
    def mutate(case, rng, lib):
        x = _strided(case.arrays[name], lib.xp)
        case.arrays[name] = x
        if not x.flags.c_contiguous:             # one element of lengths is contiguous anyway
            case.bad.add(name)
    return mutate


def _rank(name):
    def mutate(case, rng, lib):
        x = case.arrays[name]
        case.arrays[name] = x[..., None] if rng.random() < 0.5 else x[..., 0]
        case.bad.add(name)
    return mutate


def _v_shape(case, rng, lib):
    B, L, KVH, D = case.arrays["v_cache"].shape
    case.arrays["v_cache"] = _data(rng, (B, L + 1, KVH, D), case.dtype, lib)
    case.bad.add("v_cache")


def _kv_batch(case, rng, lib):
    B, L, KVH, D = case.arrays["k_cache"].shape
    for name in ("k_cache", "v_cache"):
        case.arrays[name] = _data(rng, (B + 1, L, KVH, D), case.dtype, lib)
    case.bad.add("k_cache")


def _kv_head_dim(case, rng, lib):
    B, L, KVH, D = case.arrays["k_cache"].shape
    other = _pick(rng, [d for d in spec.HEAD_DIMS if d != D])
    for name in ("k_cache", "v_cache"):
        case.arrays[name] = _data(rng, (B, L, KVH, other), case.dtype, lib)
    case.bad.add("k_cache")


def _head_dim_unsupported(case, rng, lib):
    B, H, _ = case.arrays["q"].shape
    _, L, KVH, _ = case.arrays["k_cache"].shape
    D = _pick(rng, (32, 80, 96, 512))
    case.arrays["q"] = _data(rng, (B, H, D), case.dtype, lib)
    for name in ("k_cache", "v_cache"):
        case.arrays[name] = _data(rng, (B, L, KVH, D), case.dtype, lib)
    case.bad.add("q")


def _heads(case, rng, lib):
    """H not a multiple of KVH, or a group larger than MAX_G (one KV head)."""
    B, H, D = case.arrays["q"].shape
    KVH = case.arrays["k_cache"].shape[2]
    H = H + 1 if KVH > 1 else spec.MAX_G + int(rng.integers(1, 5))
    case.arrays["q"] = _data(rng, (B, H, D), case.dtype, lib)
    case.bad.add("q")


def _empty(case, rng, lib):
    """A zero-sized batch, head count, capacity or KV head count."""
    axis = _pick(rng, ("B", "H", "L_max", "KVH"))
    q, k = case.arrays["q"], case.arrays["k_cache"]
    B, H, D = q.shape
    _, L, KVH, _ = k.shape
    B, H, L, KVH = (0 if axis == "B" else B), (0 if axis == "H" else H), (0 if axis == "L_max" else L), \
        (0 if axis == "KVH" else KVH)
    case.arrays.update(q=_data(rng, (B, H, D), case.dtype, lib),
                       k_cache=_data(rng, (B, L, KVH, D), case.dtype, lib),
                       v_cache=_data(rng, (B, L, KVH, D), case.dtype, lib))
    if axis == "B":
        case.arrays["lengths"] = case.arrays["lengths"][:0]
    case.bad.update({"B": {"q"}, "H": {"q"}, "L_max": {"k_cache"}, "KVH": {"q", "k_cache"}}[axis])


def _dtype_mismatch(case, rng, lib):
    name = _pick(rng, ("k_cache", "v_cache"))
    other = _pick(rng, [d for d in lib.dtypes if d != case.dtype])
    host = lib.get(case.arrays[name])
    case.arrays[name] = lib.put(spec.from_float32(spec.to_float32(host, np), other, np))
    case.bad.add(name)


def _dtype_unsupported(case, rng, lib):
    dt = _pick(rng, (np.int32, np.int8, np.bool_, np.complex64, np.uint8))
    for name in ("q", "k_cache", "v_cache"):
        with np.errstate(invalid="ignore"):      # NaN past a length, cast to an integer
            case.arrays[name] = lib.put(lib.get(case.arrays[name]).astype(dt))
    case.bad.add("q")


def _bf16_as_int16(case, rng, lib):               # valid: a torch bf16 tensor viewed as int16
    case.dtype = "bfloat16"
    for name in ("q", "k_cache", "v_cache"):
        host = spec.to_float32(lib.get(case.arrays[name]), np)
        case.arrays[name] = lib.put(spec.from_float32(host, "bfloat16", np).view(np.int16))


def _not_an_array(case, rng, lib):
    name = _pick(rng, ARRAYS)
    x = case.arrays[name]
    case.arrays[name] = _pick(rng, (None, 3, "q", lib.get(x).tolist()))
    case.bad.add(name)


def _other_library(case, rng, lib):
    name = _pick(rng, ARRAYS)
    case.arrays[name] = lib.other(case.arrays[name])
    case.bad.add(name)


def _foreign(case, rng, lib):
    name = _pick(rng, ARRAYS)
    case.arrays[name] = lib.foreign(case.arrays[name])
    case.bad.add(name)


def _nonfinite_q(case, rng, lib):
    q = case.arrays["q"]
    index = tuple(int(rng.integers(n)) for n in q.shape)
    case.arrays["q"] = _put_value(q, index, _pick(rng, (np.nan, np.inf, -np.inf)), lib)
    case.bad.add("q")


def _nonfinite_cache(name):
    """Valid: NaN/inf at a row inside its sequence's length (the output says so: NaN heads)."""
    def mutate(case, rng, lib):
        x, lengths = case.arrays[name], lib.get(case.arrays["lengths"])
        b = int(rng.integers(len(lengths)))
        index = (b, int(rng.integers(lengths[b])), int(rng.integers(x.shape[2])), int(rng.integers(x.shape[3])))
        case.arrays[name] = _put_value(x, index, _pick(rng, (np.nan, np.inf, -np.inf)), lib)
    return mutate


def _keyword(name, values):
    def mutate(case, rng, lib):
        case.kwargs[name] = _pick(rng, values)
        case.bad.add(name)
    return mutate


MUTATIONS = {
    "length 0": _lengths_value("zero"),
    "negative length": _lengths_value("negative"),
    "length past L_max": _lengths_value("over"),
    "float lengths": _lengths_as("float"),
    "lengths a list": _lengths_as("list"),
    "one length too many": _lengths_as("one more"),
    "lengths rank 2": _lengths_as("rank 2"),
    "lengths rank 0": _lengths_as("rank 0"),
    "lengths of another integer dtype": _lengths_int_dtype,
    "strided q": _strides("q"),
    "strided k_cache": _strides("k_cache"),
    "strided v_cache": _strides("v_cache"),
    "strided lengths": _strides("lengths"),
    "q rank": _rank("q"),
    "k_cache rank": _rank("k_cache"),
    "v_cache rank": _rank("v_cache"),
    "v_cache shape": _v_shape,
    "k/v batch": _kv_batch,
    "k/v head dim": _kv_head_dim,
    "unsupported head dim": _head_dim_unsupported,
    "heads": _heads,
    "empty axis": _empty,
    "dtype mismatch": _dtype_mismatch,
    "unsupported dtype": _dtype_unsupported,
    "bf16 as int16": _bf16_as_int16,
    "not an array": _not_an_array,
    "other array library": _other_library,
    "foreign object": _foreign,
    "NaN/inf in q": _nonfinite_q,
    "NaN/inf in k_cache": _nonfinite_cache("k_cache"),
    "NaN/inf in v_cache": _nonfinite_cache("v_cache"),
    "method": _keyword("method", ("sparse", "", None, 1, "Dense")),
    "sampler": _keyword("sampler", ("uniform", None, 0, "IID")),
    "budget": _keyword("budget", ("half", None, 2.0)),
    "samples": _keyword("samples", (0, -1, spec.MAX_SAMPLES + 1, 2.0, "64", True, None)),
    "seed": _keyword("seed", (-1, 2**64, 1.5, "0", True, None)),
    "step": _keyword("step", (-1, 2**63, 0.5, False)),
    "layer": _keyword("layer", (-1, 2**31, "1", 1.0)),
    "block_n": _keyword("block_n", (0, 32, 96, 256, "64", True, 64.0)),
    "scale": _keyword("scale", (0.0, -1.0, float("nan"), float("inf"), "0.1", True, 1j)),
    "santa_min_length": _keyword("santa_min_length", (-1, "never", 1.5, True, None, 2**40)),
}


# ------------------------------------------------------------------------------ the checks


def _names(message, name) -> bool:
    return re.search(rf"(?<![A-Za-z_]){re.escape(name)}(?![A-Za-z_])", message) is not None


def _call(case, **extra):
    a = case.arrays
    with np.errstate(all="ignore"):
        return decode_attention(a["q"], a["k_cache"], a["v_cache"], a["lengths"], **{**case.kwargs, **extra})


def _expect_error(case, **extra):
    with pytest.raises((ValueError, TypeError)) as info:
        _call(case, **extra)
    message = str(info.value)
    assert any(_names(message, n) for n in case.bad), f"{case}: message names none of {case.bad}: {message!r}"


def _host(case, lib):
    """NumPy copies of the four arrays, bf16 given as int16 read as uint16 (as interop does)."""
    out = [lib.get(case.arrays[n]) for n in ARRAYS]
    return [x.view(np.uint16) if x.dtype == np.int16 and i < 3 else x for i, x in enumerate(out)]


def _effective_block_n(case, D):
    return case.kwargs["block_n"] or spec.default_block_n(case.kwargs["method"], D)


def _reference(case, q, k, v, lengths):
    """(o float64 with the non-finite heads NaN, dense lse, santa extras or None) of the reference."""
    kw = case.kwargs
    with np.errstate(all="ignore"):
        o_dense, lse = reference.dense_attention(q, k, v, lengths, kw["scale"])
        poisoned = ~np.isfinite(lse)            # NaN or +inf among the head's scores
        if kw["method"] == "dense":
            return o_dense, lse, poisoned, None
        o, lse_santa, rows, spread, counts = reference.santa_attention(
            q, k, v, lengths, samples=kw["samples"], sampler=kw["sampler"], budget=kw["budget"], seed=kw["seed"],
            step=kw["step"], layer=kw["layer"], scale=kw["scale"], block_n=_effective_block_n(case, q.shape[-1]))
    o[poisoned] = np.nan
    spread[poisoned] = np.nan
    return o, lse, poisoned, dict(lse=lse_santa, rows_read=rows, spread=spread, counts=counts)


def _finite_inputs(q, k, v, lengths) -> bool:
    f = lambda x: np.isfinite(reference.to_float64(x))   # noqa: E731
    return f(q).all() and all(f(x[b, :n]).all() for x in (k, v) for b, n in enumerate(lengths))


@pytest.mark.parametrize("number", range(N_CASES))
def test_fuzz_numpy(number, monkeypatch):
    case = make_case(number, NumpyLib)
    if case.what == "foreign object":           # as on a machine without CuPy, wherever it runs
        monkeypatch.setitem(sys.modules, "cupy", None)
    if case.bad:
        _expect_error(case)
        return
    result = _call(case)
    o, info = result if case.kwargs["return_info"] else (result, None)
    q, k, v, lengths = _host(case, NumpyLib)
    want, lse, poisoned, santa = _reference(case, q, k, v, lengths)
    assert isinstance(o, np.ndarray) and o.shape == q.shape and o.dtype == q.dtype, str(case)
    got = reference.to_float64(o)
    np.testing.assert_allclose(got, want, rtol=RTOL[case.dtype], atol=ATOL[case.dtype], equal_nan=True,
                               err_msg=str(case))
    assert np.isnan(got[poisoned]).all(), f"{case}: a head with a non-finite softmax must be NaN"
    if _finite_inputs(q, k, v, lengths):
        assert np.isfinite(got).all(), f"{case}: finite inputs, non-finite output"
    if info is None:
        return
    if santa is None:
        np.testing.assert_allclose(info.lse, lse, rtol=2**-23, equal_nan=True, err_msg=str(case))
        assert np.array_equal(info.rows_read, np.repeat(lengths[:, None], k.shape[2], axis=1))
        assert info.dense_fallback.all() and not info.spread.any() and info.counts is None
    else:
        np.testing.assert_allclose(info.lse, santa["lse"], rtol=2**-23, equal_nan=True, err_msg=str(case))
        np.testing.assert_allclose(info.spread, santa["spread"], rtol=2**-23, atol=1e-37, equal_nan=True,
                                   err_msg=str(case))
        assert np.array_equal(info.counts, santa["counts"]) and np.array_equal(info.rows_read, santa["rows_read"])
        assert not info.dense_fallback.any()


def test_fuzz_covers_every_mutation_and_both_outcomes():
    """The generator is not stuck: every mutation occurs, and valid and invalid calls are both common."""
    cases = [make_case(n, NumpyLib) for n in range(N_CASES)]
    assert {c.what for c in cases} == set(MUTATIONS) | {"valid"}
    valid = sum(not c.bad for c in cases)
    assert 0.3 * N_CASES < valid < 0.7 * N_CASES
    lengths = [n for c in cases if not c.bad for n in np.atleast_1d(c.arrays["lengths"])]
    assert 1 in lengths and any(c.arrays["lengths"].max() == c.arrays["k_cache"].shape[1] > 1
                                for c in cases if not c.bad)
    assert {c.dtype for c in cases if not c.bad} == set(DTYPES)


def _fingerprint(case):
    def one(x):
        x = getattr(x, "a", x)                  # the data inside a fake array
        return (x.dtype.str, x.shape, x.tobytes()) if isinstance(x, np.ndarray) else repr(x)
    return case.what, repr(case.kwargs), [one(case.arrays[n]) for n in ARRAYS]


def test_fuzz_is_deterministic():
    for number in range(0, N_CASES, 17):
        assert _fingerprint(make_case(number, NumpyLib)) == _fingerprint(make_case(number, NumpyLib))


# ------------------------------------------------------------------------ the GPU twin


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("number", range(N_GPU_CASES))
def test_fuzz_cupy(number):
    """The same cases as CuPy arrays (santa for every length): an error naming the argument, or
    the reference's answer within the GPU tests' tolerances (test_gpu_kernels.py): dense to
    DENSE_TOL; santa's counts within a few comb-boundary flips of the reference's and its output
    the reference estimator applied to the GPU's own counts. Heads with NaN in V (which only the
    reference reads when the row is not sampled) are compared only where the reference is finite."""
    lib = CupyLib()
    case = make_case(number, lib)
    extra = {"santa_min_length": 0} if "santa_min_length" not in case.kwargs else {}
    if case.bad:
        _expect_error(case, **extra)
        return
    o, info = _call(case, **extra, return_info=True, return_counts=True)
    q, k, v, lengths = _host(case, lib)
    want, lse, poisoned, santa = _reference(case, q, k, v, lengths)
    got = reference.to_float64(o.get())
    assert o.shape == q.shape and o.dtype == q.dtype, str(case)
    assert np.isnan(got[poisoned]).all(), f"{case}: a head with a non-finite softmax must be NaN"
    kw = case.kwargs
    if santa is not None:
        counts = info.counts.get()
        flips = int(np.abs(counts[~poisoned].astype(np.int64) - santa["counts"][~poisoned]).sum())
        assert flips <= max(2, int(santa["counts"][~poisoned].sum()) // 500), f"{case}: {flips} count differences"
        scores, v64 = reference.head_scores(q, k, lengths, kw["scale"]), reference.to_float64(v)
        B, H, D = q.shape
        KVH = k.shape[2]
        want = np.empty_like(want)
        with np.errstate(all="ignore"):
            for b, n in enumerate(lengths):
                est, _ = reference.estimate(counts[b, :, :n].reshape(KVH, H // KVH, n),
                                            scores[b, :, :n].reshape(KVH, H // KVH, n),
                                            v64[b, :n].transpose(1, 0, 2)[:, None], samples=kw["samples"],
                                            budget=kw["budget"], block_n=_effective_block_n(case, D))
                want[b] = est.reshape(H, D)
    else:
        ok = ~poisoned
        assert np.allclose(info.lse.get()[ok], lse[ok], atol=1e-3, rtol=1e-4), str(case)
    check = ~poisoned & np.isfinite(want).all(-1)
    assert np.isfinite(got[check]).all(), f"{case}: non-finite output where the reference is finite"
    if check.any():
        tol = DENSE_TOL[case.dtype] + (1e-4 if santa is not None else 0.0)
        assert rel_l2(got[check], want[check]) < tol, str(case)

"""spec.validate_decode_inputs: one test per bad input, the message names the argument."""

import math

import numpy as np
import pytest

from santa_cupy import spec

B, H, KVH, D, L = 2, 4, 2, 64, 16


def make(dtype=np.float32, **over):
    rs = np.random.default_rng(0)
    args = {
        "q": rs.standard_normal((B, H, D)).astype(dtype),
        "k_cache": rs.standard_normal((B, L, KVH, D)).astype(dtype),
        "v_cache": rs.standard_normal((B, L, KVH, D)).astype(dtype),
        "lengths": np.array([L, 3], dtype=np.int32),
    }
    args.update(over)
    return args


def call(args, **kw):
    return spec.validate_decode_inputs(args["q"], args["k_cache"], args["v_cache"], args["lengths"], **kw)


def raises(exc, words, args, **kw):
    with pytest.raises(exc) as info:
        call(args, **kw)
    msg = str(info.value)
    for word in words:
        assert word in msg, f"{word!r} not in {msg!r}"


def test_valid_inputs_return_shape():
    shape = call(make())
    assert shape == spec.DecodeShape(B=B, H=H, KVH=KVH, G=2, D=D, L_max=L, dtype_name="float32", scale=1 / 8)
    assert call(make(np.float16), scale=0.5).dtype_name == "float16"
    assert call(make(np.float64)).dtype_name == "float64"
    with pytest.raises(Exception):
        shape.B = 3  # frozen


def test_bfloat16_as_uint16():
    args = make()
    bf = {n: spec.from_float32(args[n], "bfloat16") for n in ("q", "k_cache", "v_cache")}
    assert call(make(**bf)).dtype_name == "bfloat16"


def test_q_wrong_rank():
    raises(ValueError, ["q", "rank 3", "(2, 4, 64, 1)"], make(q=np.zeros((B, H, D, 1), np.float32)))


def test_k_cache_wrong_rank():
    raises(ValueError, ["k_cache", "rank 4"], make(k_cache=np.zeros((B, L, D), np.float32)))


def test_lengths_wrong_rank():
    raises(ValueError, ["lengths", "rank 1"], make(lengths=np.ones((B, 1), np.int32)))


def test_v_cache_shape_mismatch():
    raises(ValueError, ["v_cache", "k_cache"], make(v_cache=np.zeros((B, L + 1, KVH, D), np.float32)))


def test_batch_mismatch():
    args = make(k_cache=np.zeros((3, L, KVH, D), np.float32), v_cache=np.zeros((3, L, KVH, D), np.float32))
    raises(ValueError, ["k_cache batch 3", "q batch 2"], args)


def test_head_dim_mismatch():
    args = make(k_cache=np.zeros((B, L, KVH, 128), np.float32), v_cache=np.zeros((B, L, KVH, 128), np.float32))
    raises(ValueError, ["head dim 128", "q head dim 64"], args)


def test_lengths_shape_mismatch():
    raises(ValueError, ["lengths", "(2,)", "(3,)"], make(lengths=np.ones(3, np.int32)))


def test_empty_batch_or_heads():
    args = make(q=np.zeros((B, 0, D), np.float32))
    raises(ValueError, ["q must have B >= 1 and H >= 1", "(2, 0, 64)"], args)


def test_head_dim_not_supported():
    rs = np.random.default_rng(1)
    args = {
        "q": rs.standard_normal((B, H, 32)).astype(np.float32),
        "k_cache": rs.standard_normal((B, L, KVH, 32)).astype(np.float32),
        "v_cache": rs.standard_normal((B, L, KVH, 32)).astype(np.float32),
        "lengths": np.array([1, 1]),
    }
    raises(ValueError, ["head dim", "32", "(64, 128, 256)"], args)


def test_heads_not_multiple_of_kv_heads():
    args = make(q=np.zeros((B, 3, D), np.float32))
    raises(ValueError, ["H=3", "KVH=2"], args)


def test_group_too_large():
    args = make(
        q=np.zeros((B, 17, D), np.float32),
        k_cache=np.zeros((B, L, 1, D), np.float32),
        v_cache=np.zeros((B, L, 1, D), np.float32),
    )
    raises(ValueError, ["MAX_G=16", "17"], args)


def test_dtype_mismatch():
    args = make()
    args["k_cache"] = args["k_cache"].astype(np.float16)
    raises(TypeError, ["k_cache=float16", "q=float32"], args)


def test_unsupported_dtype():
    raises(TypeError, ["q dtype int32"], make(np.int32))


def test_lengths_not_integer():
    raises(TypeError, ["lengths", "float32"], make(lengths=np.array([1.0, 2.0], np.float32)))


class FakeCupyArray:
    """Looks like a CuPy array to the module-name check."""

    __module__ = "cupy._core.core"

    def __init__(self, a):
        self._a = a
        self.shape, self.dtype, self.ndim, self.flags, self.strides = a.shape, a.dtype, a.ndim, a.flags, a.strides


def test_mixed_numpy_and_cupy():
    args = make()
    args["v_cache"] = FakeCupyArray(args["v_cache"])
    raises(TypeError, ["v_cache=cupy", "q=numpy"], args)


def test_not_an_array():
    args = make()
    args["q"] = args["q"].tolist()
    raises(TypeError, ["q must be a numpy.ndarray or cupy.ndarray", "list"], args)


def test_non_contiguous():
    args = make()
    big = np.zeros((B, L, KVH, 2 * D), np.float32)
    args["k_cache"] = big[..., ::2]
    raises(ValueError, ["k_cache", "C-contiguous", "strides"], args)


def test_cupy_float64_rejected():
    args = {n: FakeCupyArray(a) for n, a in make(np.float64).items()}
    raises(TypeError, ["float64", "cupy"], args, check_lengths=False, check_finite=False)


@pytest.mark.parametrize("bad", [0, -1])
def test_lengths_too_small(bad):
    raises(ValueError, ["lengths", "[1, L_max=16]", f"1: {bad}"], make(lengths=np.array([L, bad])))


def test_lengths_too_large():
    raises(ValueError, ["lengths", "L_max=16", "0: 17"], make(lengths=np.array([L + 1, 1])))


def test_lengths_check_can_be_skipped():
    assert call(make(lengths=np.array([L + 1, 1])), check_lengths=False).B == B


@pytest.mark.parametrize("bad", [0, -3])
def test_samples_below_one(bad):
    raises(ValueError, ["samples", str(bad)], make(), samples=bad)


@pytest.mark.parametrize("bad", [2.0, "8", True])
def test_samples_not_int(bad):
    raises(TypeError, ["samples must be an int"], make(), samples=bad)


def test_samples_too_many():
    raises(ValueError, ["samples", str(spec.MAX_SAMPLES + 1)], make(), samples=spec.MAX_SAMPLES + 1)


def test_unknown_method():
    raises(ValueError, ["method", "'sparse'"], make(), method="sparse")


def test_unknown_sampler():
    raises(ValueError, ["sampler", "'gumbel'"], make(), sampler="gumbel")


def test_unknown_budget():
    raises(ValueError, ["budget", "'adaptive'"], make(), budget="adaptive")


def test_bad_block_n():
    raises(ValueError, ["block_n", "96"], make(), block_n=96)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_non_finite_q(value):
    args = make()
    args["q"][1, 2, 3] = value
    raises(ValueError, ["q must be finite"], args)
    assert call(args, check_finite=False).H == H


def test_non_finite_bf16_q():
    args = make()
    args["q"][0, 0, 0] = np.nan
    bf = {n: spec.from_float32(args[n], "bfloat16") for n in ("q", "k_cache", "v_cache")}
    raises(ValueError, ["q must be finite"], make(**bf))


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_scale_bad_value(bad):
    raises(ValueError, ["scale", "> 0"], make(), scale=bad)


def test_scale_not_number():
    raises(TypeError, ["scale must be a real number"], make(), scale="0.1")


def test_bf16_round_trip_and_rounding():
    x = np.array([1.0, -2.5, 3.14159, 1e-30, 65504.0, np.inf, -np.inf], np.float32)
    bits = spec.from_float32(x, "bfloat16")
    assert bits.dtype == np.uint16
    back = spec.to_float32(bits)
    assert back.dtype == np.float32
    np.testing.assert_allclose(back, x, rtol=2**-8)
    assert back[0] == 1.0 and back[1] == -2.5 and np.isinf(back[5]) and back[6] < 0
    # round to nearest even on exact halfway cases: 1 + 2**-8 is halfway between 1 and 1 + 2**-7
    halfway = np.array([1 + 2**-8, 1 + 3 * 2**-8], np.float32)
    np.testing.assert_array_equal(spec.to_float32(spec.from_float32(halfway, "bfloat16")), [1.0, 1 + 2**-6])
    nan = spec.from_float32(np.array([np.nan], np.float32), "bfloat16")
    assert np.isnan(spec.to_float32(nan))[0]


def test_decode_plan_without_cupy_says_what_is_needed(monkeypatch):
    """On a machine without CuPy, DecodePlan names what it needs and the CPU alternative."""
    import sys

    from santa_cupy import DecodePlan

    monkeypatch.setitem(sys.modules, "cupy", None)          # import cupy -> ImportError
    with pytest.raises(ModuleNotFoundError, match=r"needs CuPy .*santa-cupy\[cuda12\].*NumPy arrays"):
        DecodePlan(batch=1, heads=8, kv_heads=2, head_dim=128, max_length=64)

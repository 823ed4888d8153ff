"""CPU checks of the interop surface: stream= and out= arguments, santa_cupy.jax's lazy imports,
and that examples/ and tools/jax_overhead.py are valid Python (they run on the GPU elsewhere)."""

import ast
import inspect
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import santa_cupy
from santa_cupy import DecodePlan, decode_attention, interop

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _inputs(dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 64)).astype(dtype)
    k = rng.standard_normal((2, 50, 2, 64)).astype(dtype)
    v = rng.standard_normal((2, 50, 2, 64)).astype(dtype)
    return q, k, v, np.array([50, 20], np.int32)


class FakeTorchStream:
    def __init__(self, ptr):
        self.cuda_stream = ptr


@pytest.mark.parametrize("bad", ["0x1", 1.5, True, [1], object()])
def test_stream_bad_type_is_a_type_error_naming_stream(bad):
    with pytest.raises(TypeError, match="stream"):
        interop.check_stream(bad)
    with pytest.raises(TypeError, match="stream"):
        decode_attention(*_inputs(), method="dense", stream=bad)


def test_stream_negative_pointer_is_a_value_error():
    with pytest.raises(ValueError, match="stream"):
        interop.check_stream(-1)
    with pytest.raises(ValueError, match="stream"):
        interop.check_stream(FakeTorchStream(-5))
    with pytest.raises(TypeError, match="stream"):
        interop.check_stream(FakeTorchStream("nope"))


def test_stream_accepted_forms():
    assert interop.check_stream(None) == ("none", None)
    assert interop.check_stream(0) == ("ptr", 0)
    assert interop.check_stream(np.int64(1234)) == ("ptr", 1234)
    assert interop.check_stream(FakeTorchStream(99)) == ("ptr", 99)


def test_stream_in_signatures():
    for fn in (decode_attention, DecodePlan.run, DecodePlan.advance, DecodePlan.run_from_counts,
               DecodePlan.sample_counts):
        params = inspect.signature(fn).parameters
        assert "stream" in params and params["stream"].default is None, fn.__name__
        assert params["stream"].kind is inspect.Parameter.KEYWORD_ONLY
        assert "stream" in fn.__doc__, fn.__name__
    assert "out" in inspect.signature(decode_attention).parameters


def test_stream_none_is_the_plain_call():
    a = decode_attention(*_inputs(), method="dense")
    b = decode_attention(*_inputs(), method="dense", stream=None)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("method", ["dense", "santa"])
def test_out_numpy_path(method):
    q, k, v, n = _inputs()
    want = decode_attention(q, k, v, n, method=method)
    out = np.full(want.shape, np.nan, want.dtype)
    got = decode_attention(q, k, v, n, method=method, out=out)
    assert got is out
    np.testing.assert_array_equal(out, want)
    got, info = decode_attention(q, k, v, n, method=method, out=out, return_info=True)
    assert got is out and info.lse.shape == (2, 4)


def test_out_numpy_bf16_path():
    from santa_cupy import spec
    q, k, v, n = _inputs()
    q, k, v = (spec.from_float32(x, "bfloat16", np) for x in (q, k, v))     # bf16 bit patterns
    want = decode_attention(q, k, v, n, method="dense")
    out = np.zeros((2, 4, 64), np.uint16)
    assert decode_attention(q, k, v, n, method="dense", out=out) is out
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("bad", [np.zeros((2, 4, 63), np.float32), np.zeros((2, 4, 64), np.float16),
                                 np.zeros((2, 64, 4), np.float32).transpose(0, 2, 1), "buffer"])
def test_out_bad_is_a_value_error_naming_out(bad):
    with pytest.raises(ValueError, match="out"):
        decode_attention(*_inputs(), method="dense", out=bad)


def test_import_santa_cupy_does_not_import_jax_or_torch():
    code = ("import sys, santa_cupy, santa_cupy.jax, santa_cupy.interop; "
            "bad = [m for m in ('jax', 'torch') if m in sys.modules]; assert not bad, bad; print('clean')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "clean" in proc.stdout, proc.stderr


def test_santa_cupy_jax_without_jax_is_a_clear_error(monkeypatch):
    import santa_cupy.jax as santa_jax
    monkeypatch.setitem(sys.modules, "jax", None)          # as if JAX were not installed
    with pytest.raises(ModuleNotFoundError, match="santa_cupy.jax needs JAX"):
        santa_jax.decode_attention(*_inputs(), 0)


def test_santa_cupy_jax_without_cupy_is_a_clear_error(monkeypatch):
    import santa_cupy.jax as santa_jax
    fake = type(sys)("jax")
    fake.numpy = np
    exp = type(sys)("jax.experimental")
    cb = type(sys)("jax.experimental.buffer_callback")
    cb.buffer_callback = lambda *a, **k: None
    monkeypatch.setitem(sys.modules, "jax", fake)
    monkeypatch.setitem(sys.modules, "jax.experimental", exp)
    monkeypatch.setitem(sys.modules, "jax.experimental.buffer_callback", cb)
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(ModuleNotFoundError, match="CuPy"):
        santa_jax.decode_attention(*_inputs(), 0)


def test_santa_cupy_jax_is_not_in_the_package_namespace():
    assert "jax" not in santa_cupy.__all__


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")) + [ROOT / "tools" / "jax_overhead.py"],
                         ids=lambda p: p.name)
def test_scripts_parse_and_have_main(path):
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    names = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "main" in names, f"{path.name} has no main()"
    assert ast.get_docstring(tree), f"{path.name} has no module docstring"


def test_examples_cover_each_stack():
    names = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert {"cupy_example.py", "torch_example.py", "jax_example.py"} <= names

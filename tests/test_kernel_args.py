"""Kernel arguments against the kernels' C declarations (santa_cupy.kernel_args), on the CPU.

Every instance of every module parses; the parsed parameters of a few kernels are the ones written
in the .cu files (checked against literals, not against the parser); a wrong scalar type, array
dtype, argument count or a scalar for a pointer is a TypeError naming the parameter, and launch()
raises it before anything launches. (tests/test_plan_host.py records every launch of a grid of
plans through kernels.launch with these checks on.)
"""

import numpy as np
import pytest

from llama_min import ops
from santa_cupy import kernel_args, kernels


def test_every_instance_has_a_declaration():
    source = kernels.build_source()
    n = 0
    for dtype in ("float32", "float16", "bfloat16"):
        for head_dim, group in ((64, 3), (128, 4), (256, 8)):
            for role in kernels.roles():
                for instance in kernels.instance_names(dtype, head_dim, group, role).values():
                    sig = kernel_args.signature_of(source, instance)
                    assert sig.params, instance
                    n += 1
    decoder = kernels.build_source(ops.SOURCE_FILES)
    for instance in ops.instance_names().values():
        assert kernel_args.signature_of(decoder, instance).params
    assert n > 100


def test_parsed_parameters_are_the_declared_ones():
    source = kernels.build_source()
    merge = kernel_args.signature_of(source, "santa_merge<bf16_t, 128, 4>")
    # merge.cu: santa_merge(const float* part_o, const float4* part_s, const int* lengths, i64 L_max,
    # int H, int part_rows, int split_target, int P_max, int kind, int samples, T* out,
    # float* lse, float* spread)
    assert [p.name for p in merge.params] == ["part_o", "part_s", "lengths", "L_max", "H", "part_rows",
                                              "split_target", "P_max", "kind", "samples", "out",
                                              "lse", "spread"]
    types = {p.name: (p.pointer, p.numpy_type) for p in merge.params}
    assert types["L_max"] == (False, np.int64) and types["H"] == (False, np.int32)
    assert types["out"] == (True, np.uint16)               # T = bf16_t: bf16 travels as uint16 bits
    assert types["part_s"] == (True, np.float32)           # float4 arrays: float32 arrays
    fp16 = kernel_args.signature_of(source, "santa_merge<f16_t, 64, 8>")
    assert dict((p.name, p.numpy_type) for p in fp16.params)["out"] is np.float16
    tile = kernel_args.signature_of(source, "santa_tile_warp<bf16_t, 128, 64, 4, 0, false>")
    tt = {p.name: p.numpy_type for p in tile.params}
    assert tt["seed"] is np.uint64 and tt["step"] is np.int64 and tt["cdf"] is np.float64
    assert tt["v_cache"] is np.uint16 and tt["arrive"] is np.uint32
    decoder = kernels.build_source(ops.SOURCE_FILES)
    rope = {p.name: p.numpy_type for p in kernel_args.signature_of(decoder, "rope_append<f16_t, bf16_t>").params}
    assert rope["qkv"] is np.float16 and rope["cos_t"] is np.float32      # Tp = f16_t
    assert rope["k_cache"] is np.uint16                                   # Tkv = bf16_t


def _merge_args(**change):
    sig = kernel_args.signature_of(kernels.build_source(), "santa_merge<bf16_t, 128, 4>")
    values = {"part_o": np.zeros((2, 4, 128), np.float32), "part_s": np.zeros((2, 4, 4), np.float32),
              "lengths": np.ones(2, np.int32), "L_max": np.int64(8), "H": np.int32(4), "part_rows": np.int32(64),
              "split_target": np.int32(0), "P_max": np.int32(4), "kind": np.int32(2),
              "samples": np.int32(16), "out": np.zeros((2, 4, 128), np.uint16), "lse": np.zeros((2, 4), np.float32),
              "spread": np.zeros((2, 4), np.float32)}
    values.update(change)
    return sig, [values[p.name] for p in sig.params]


def test_matching_arguments_pass():
    sig, args = _merge_args()
    kernel_args.check(sig, args)


@pytest.mark.parametrize("change,needle", [
    (dict(L_max=np.int32(8)), r"argument 3 \(L_max, C type i64\) needs np.int64, got numpy.int32"),
    (dict(H=np.int64(4)), r"argument 4 \(H, C type int\) needs np.int32"),
    (dict(H=4), r"\(H, C type int\) needs np.int32, got builtins.int"),
    (dict(out=np.zeros((2, 4, 128), np.float16)), r"\(out, C type T \*\) needs an array of uint16"),
    (dict(lengths=np.ones(2, np.int64)), r"\(lengths, C type const int \*\) needs an array of int32"),
    (dict(lse=np.float32(0)), r"\(lse, C type float \*\) needs an array of float32, got numpy.float32 scalar"),
])
def test_mismatches_are_type_errors_naming_the_parameter(change, needle):
    sig, args = _merge_args(**change)
    with pytest.raises(TypeError, match=needle):
        kernel_args.check(sig, args)


def test_argument_count():
    sig, args = _merge_args()
    with pytest.raises(TypeError, match=r"12 arguments for 13 parameters"):
        kernel_args.check(sig, args[:-1])


def test_launch_checks_before_launching():
    calls = []

    class Kernel:
        max_dynamic_shared_size_bytes = 48 * 1024

        def __call__(self, *a, **k):
            calls.append(a)

    k = kernels.register_kernel(Kernel(), kernels.build_source(), "santa_merge<bf16_t, 128, 4>")
    sig, args = _merge_args()
    kernels.launch(k, (4, 2), args)
    assert len(calls) == 1
    _, bad = _merge_args(kind=np.int64(2))
    with pytest.raises(TypeError, match="kind"):
        kernels.launch(k, (4, 2), bad)
    assert len(calls) == 1                                  # nothing launched
    kernels.launch(Kernel(), (4, 2), bad)                   # an unregistered kernel is not checked


def test_a_plan_checks_each_kernel_at_its_first_launch_only(monkeypatch):
    """A plan's later runs pass the same argument types again: the check runs once a kernel."""
    from tests.test_plan_host import _fake_cupy, _inputs
    checked = []
    real = kernel_args.check
    monkeypatch.setattr(kernel_args, "check", lambda sig, args: (checked.append(sig.kernel), real(sig, args)))
    import sys
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    source = kernels.build_source()

    class Kernel:
        max_dynamic_shared_size_bytes = 48 * 1024

        def __call__(self, *a, **k):
            pass

    def fake_get_kernels(dtype_name, head_dim, group, block_n, method):
        role = "dense" if method == "dense" else f"santa{block_n}"
        names = kernels.instance_names(dtype_name, head_dim, group, role)
        return kernels.KernelSet(**{key: kernels.register_kernel(Kernel(), source, name) for key, name in names.items()})

    monkeypatch.setattr(kernels, "get_kernels", fake_get_kernels)
    from santa_cupy import DecodePlan
    q, k, v, lengths = _inputs(L=3000)
    plan = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=0)
    plan.run(q, k, v, lengths)
    first = len(checked)
    assert first >= 3                       # score, prefix, pass 2 (and the merge where it runs)
    plan.run(q, k, v, lengths)
    assert len(checked) == first


@pytest.mark.parametrize("value, mode", [("auto", None), ("on", True), ("1", True), ("OFF", False), ("0", False)])
def test_programmatic_mode_from_the_environment(monkeypatch, value, mode):
    monkeypatch.setenv("SANTA_CUPY_PDL", value)
    assert kernels._initial_programmatic_mode() is mode


def test_programmatic_mode_rejects_other_values(monkeypatch):
    monkeypatch.setenv("SANTA_CUPY_PDL", "yes")
    with pytest.raises(ValueError, match="SANTA_CUPY_PDL"):
        kernels._initial_programmatic_mode()
    with pytest.raises(TypeError, match="True, False or None"):
        kernels.set_programmatic_launch("on")


def test_automatic_mode_launches_programmatically_only_while_capturing(monkeypatch):
    """Mode None: a launch captured into a graph goes programmatic (where the device has it), an
    eager one plainly; a plan's own choice wins over the process-wide mode."""
    import sys
    import types
    capturing = [False]
    stream = types.SimpleNamespace(is_capturing=lambda: capturing[0])
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: stream)))
    monkeypatch.setattr(kernels, "programmatic_launch_available", lambda: True)
    monkeypatch.setitem(kernels._programmatic, "on", None)
    assert not kernels.launches_programmatically()
    capturing[0] = True
    assert kernels.launches_programmatically()
    assert not kernels.launches_programmatically(False)
    monkeypatch.setitem(kernels._programmatic, "on", False)
    assert not kernels.launches_programmatically() and kernels.launches_programmatically(True)

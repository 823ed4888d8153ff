"""santa_cupy.jax inside jax.jit (marker gpu; skipped without CuPy and a GPU, or without JAX on a GPU).

* the jitted call equals the eager CuPy decode_attention of the same inputs, (seed, step, layer):
  dense, santa on the warp pipeline and on the block pass 2; float16, bfloat16, float32; lse too;
* the step is an operand: one trace, different steps draw different samples (also in a lax.scan);
* inputs placed with a one-device NamedSharding;
* traced once, called repeatedly with no host transfers (jax.transfer_guard("disallow"));
* paged caches (both layouts, shuffled and shared pages): the block table is an operand, the jitted
  call equals the eager paged CuPy call, and a new table needs no retrace.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # leave GPU memory to CuPy's pool

import numpy as np   # noqa: E402
import pytest        # noqa: E402

from santa_cupy import decode_attention, spec   # noqa: E402
from tests.gpu_util import paged_inputs, random_inputs, rel_l2, requires_gpu, to_gpu   # noqa: E402

pytestmark = [pytest.mark.gpu, requires_gpu]

B, H, KVH, D, L_MAX = 3, 8, 2, 128, 1500
LENGTHS = [1500, 700, 33]
# same (seed, step): equal up to the order of float additions (the warp pipeline's fp32 atomics)
SAME_TOL = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-5}


@pytest.fixture(scope="module")
def jx():
    jax = pytest.importorskip("jax")
    pytest.importorskip("jax.experimental.buffer_callback")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError as exc:
        pytest.skip(f"JAX has no GPU backend here: {exc}")
    if not gpus:
        pytest.skip("JAX sees no GPU")
    from santa_cupy import jax as santa_jax
    return jax, jax.numpy, santa_jax


def _inputs(jnp, dtype, seed=0, peak=2.0):
    """The same decode inputs as NumPy (storage dtype), CuPy and JAX (bf16 as jnp.bfloat16) arrays."""
    rng = np.random.default_rng(seed)
    q, k, v, lengths = random_inputs(rng, B, H, KVH, D, L_MAX, LENGTHS, dtype, peak=peak)
    gpu = to_gpu(q, k, v, lengths)
    jarr = [jnp.asarray(x) for x in (q, k, v)]
    if dtype == "bfloat16":
        import jax
        jarr = [jax.lax.bitcast_convert_type(x, jnp.bfloat16) for x in jarr]
    return (q, k, v, lengths), gpu, (*jarr, jnp.asarray(lengths))


def _f32(x):
    """A JAX / CuPy / NumPy output as float32 NumPy (bf16 bit patterns decoded)."""
    x = x.get() if hasattr(x, "get") else np.asarray(x)
    if x.dtype == np.uint16:
        return spec.to_float32(x, np)
    return np.asarray(x).astype(np.float32)


CASES = [
    ("float16", dict(method="dense")),
    ("bfloat16", dict(method="dense")),
    ("float32", dict(method="dense")),
    ("bfloat16", dict(method="santa", budget="global")),                     # warp pipeline
    ("float16", dict(method="santa", budget="largest_remainder")),
    ("float16", dict(method="santa", budget="global", sampler="iid")),        # block pass 2
    ("float32", dict(method="santa", budget="fixed")),
]


@pytest.mark.parametrize("dtype,opts", CASES, ids=[f"{d}-{'-'.join(map(str, o.values()))}" for d, o in CASES])
def test_jit_equals_eager_cupy(jx, dtype, opts):
    jax, jnp, santa_jax = jx
    _, gpu, jarr = _inputs(jnp, dtype)
    kw = dict(opts, seed=5, layer=2, samples=256)
    if opts["method"] == "santa":
        kw["santa_min_length"] = 0               # santa at every length (the default runs short ones exact)
    step = 9
    fn = jax.jit(lambda q, k, v, n, s: santa_jax.decode_attention(q, k, v, n, s, return_lse=True, **kw))
    o_jax, lse_jax = fn(*jarr, jnp.int32(step))
    o_cp, info = decode_attention(*gpu, step=step, return_info=True, **kw)
    assert o_jax.shape == (B, H, D) and o_jax.dtype == jarr[0].dtype, (o_jax.shape, o_jax.dtype)
    a, b = _f32(o_jax), _f32(o_cp)
    err = rel_l2(a, b)
    n_diff = int((a != b).sum())
    print(f"{dtype} {opts}: jit vs eager rel L2 {err:.3e}, {n_diff}/{a.size} elements differ, "
          f"max |diff| {float(np.abs(a - b).max()):.3e}")
    assert np.isfinite(a).all()
    assert err <= SAME_TOL[dtype], f"jit differs from the eager call: rel L2 {err:.3e} ({n_diff} elements)"
    np.testing.assert_allclose(np.asarray(lse_jax), info.lse.get(), rtol=1e-5, atol=1e-5)


def test_step_operand_draws_new_samples(jx):
    jax, jnp, santa_jax = jx
    _, gpu, jarr = _inputs(jnp, "float16", seed=1, peak=1.0)
    traces = []

    @jax.jit
    def fn(q, k, v, n, s):
        traces.append(1)
        return santa_jax.decode_attention(q, k, v, n, s, samples=128, seed=3, santa_min_length=0)

    outs = {s: _f32(fn(*jarr, jnp.int32(s))) for s in (0, 1, 2)}
    again = _f32(fn(*jarr, jnp.int32(0)))
    assert len(traces) == 1, f"traced {len(traces)} times"
    noise = rel_l2(again, outs[0])
    moved = [rel_l2(outs[s], outs[0]) for s in (1, 2)]
    eager = [rel_l2(outs[s], _f32(decode_attention(*gpu, samples=128, seed=3, step=s, santa_min_length=0)))
             for s in (0, 1, 2)]
    print(f"repeat of step 0: {noise:.2e}; steps 1, 2 vs 0: {moved}; vs eager per step: {eager}")
    assert max(eager) <= SAME_TOL["float16"], eager
    assert min(moved) > max(10 * noise, 1e-3), (moved, noise)


def test_step_advances_inside_scan(jx):
    """The step a traced loop counter: each iteration of one jitted scan draws its own samples."""
    jax, jnp, santa_jax = jx
    _, gpu, jarr = _inputs(jnp, "bfloat16", seed=2, peak=1.0)
    q, k, v, n = jarr

    @jax.jit
    def loop(q, k, v, n):
        def body(carry, step):
            return carry, santa_jax.decode_attention(q, k, v, n, step, samples=256, seed=4, santa_min_length=0)
        return jax.lax.scan(body, 0, jnp.arange(4, dtype=jnp.int32))[1]

    outs = loop(q, k, v, n)
    assert outs.shape == (4, B, H, D), outs.shape
    errs = []
    for s in range(4):
        ref = _f32(decode_attention(*gpu, samples=256, seed=4, step=s, santa_min_length=0))
        errs.append(rel_l2(_f32(outs[s]), ref))
    moved = rel_l2(_f32(outs[1]), _f32(outs[0]))
    print(f"scan steps vs eager: {errs}; step 1 vs 0: {moved:.3e}")
    assert max(errs) <= SAME_TOL["bfloat16"], errs
    assert moved > max(5 * max(errs), 1e-3), (moved, errs)


def test_single_device_sharding(jx):
    jax, jnp, santa_jax = jx
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    _, gpu, jarr = _inputs(jnp, "bfloat16", seed=3)
    mesh = Mesh(np.array(jax.devices("gpu")[:1]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    placed = [jax.device_put(x, rep) for x in jarr]
    step = jax.device_put(jnp.int32(4), rep)
    fn = jax.jit(lambda q, k, v, n, s: santa_jax.decode_attention(q, k, v, n, s, method="dense"),
                 in_shardings=(rep,) * 5, out_shardings=rep)
    o = fn(*placed, step)
    assert o.sharding.is_equivalent_to(rep, o.ndim), o.sharding
    err = rel_l2(_f32(o), _f32(decode_attention(*gpu, method="dense")))
    print(f"sharded dense vs eager: {err:.3e}")
    assert err <= SAME_TOL["bfloat16"], err


def test_traced_once_no_host_transfers(jx):
    """Repeated calls of one compiled function with device operands: no retrace, no transfer (the
    callback copies the step on the device; JAX's transfer guard would raise on a host round trip)."""
    jax, jnp, santa_jax = jx
    _, _, jarr = _inputs(jnp, "bfloat16", seed=4, peak=1.0)
    traces = []

    @jax.jit
    def fn(q, k, v, n, s):
        traces.append(1)
        return santa_jax.decode_attention(q, k, v, n, s, samples=256, santa_min_length=0)

    steps = [jax.device_put(jnp.int32(s)) for s in range(8)]
    jax.block_until_ready(fn(*jarr, steps[0]))           # compile, build the plan
    with jax.transfer_guard("disallow"):
        outs = [fn(*jarr, s) for s in steps]
        jax.block_until_ready(outs)
    assert len(traces) == 1, f"traced {len(traces)} times"
    first = [_f32(o) for o in outs[:2]]
    assert rel_l2(first[1], first[0]) > 1e-3


def test_int64_step_with_x64(jx):
    jax, jnp, santa_jax = jx
    _, gpu, jarr = _inputs(jnp, "float16", seed=5)
    big = 2**33 + 5
    with jax.enable_x64(True):
        step = jnp.asarray(big, jnp.int64)
        assert step.dtype == jnp.int64
        o = jax.jit(lambda *a: santa_jax.decode_attention(*a, samples=64, seed=1, santa_min_length=0))(*jarr, step)
        o = _f32(o)
    ref = _f32(decode_attention(*gpu, samples=64, seed=1, step=big, santa_min_length=0))
    err = rel_l2(o, ref)
    print(f"int64 step {big}: jit vs eager {err:.3e}")
    assert err <= SAME_TOL["float16"], err


@pytest.mark.parametrize("layout,method", [("NHD", "santa"), ("HND", "santa"), ("NHD", "dense")])
def test_paged_jit_equals_eager_cupy(jx, layout, method):
    import cupy
    jax, jnp, santa_jax = jx
    rng = np.random.default_rng(21)
    q, kp, vp, table, lengths = paged_inputs(rng, [1500, 700, 33], 16, H=H, KVH=KVH, D=D, dtype="bfloat16",
                                             layout=layout)
    kw = dict(method=method, seed=3, layer=1, samples=256, page_layout=layout)
    if method == "santa":
        kw["santa_min_length"] = 0
    traces = []

    def fn(q, k, v, n, s, t):
        traces.append(1)
        return santa_jax.decode_attention(q, k, v, n, s, block_table=t, return_lse=True, **kw)

    jfn = jax.jit(fn)
    as_bf16 = lambda x: jax.lax.bitcast_convert_type(jnp.asarray(x), jnp.bfloat16)   # noqa: E731
    jq, jk, jv = as_bf16(q), as_bf16(kp), as_bf16(vp)
    o_jax, lse_jax = jfn(jq, jk, jv, jnp.asarray(lengths), jnp.int32(4), jnp.asarray(table))
    o_cp, info = decode_attention(cupy.asarray(q), cupy.asarray(kp), cupy.asarray(vp), cupy.asarray(lengths),
                                  step=4, block_table=cupy.asarray(table), return_info=True, **kw)
    a, b = _f32(o_jax), _f32(o_cp)
    assert np.isfinite(a).all()
    assert rel_l2(a, b) <= SAME_TOL["bfloat16"], rel_l2(a, b)
    np.testing.assert_allclose(np.asarray(lse_jax), info.lse.get(), rtol=1e-5, atol=1e-5)
    # sequences 0 and 1 swap their pages: a new operand, no retrace, the outputs follow the table
    swapped, lens2 = table[[1, 0, 2]], lengths[[1, 0, 2]]
    o2, _ = jfn(jq[jnp.array([1, 0, 2])], jk, jv, jnp.asarray(lens2), jnp.int32(4), jnp.asarray(swapped))
    assert len(traces) == 1
    if method == "dense":                # exact up to the split of rows (rounding)
        assert rel_l2(_f32(o2)[[1, 0, 2]], a) <= SAME_TOL["bfloat16"]

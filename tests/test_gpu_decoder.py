"""decoder.cu (RMSNorm, rotary + K/V append, SiLU * up) and gemv's accumulate mode against
llama_min.reference (marker gpu)."""

import numpy as np
import pytest

from llama_min import ops as decoder_ops
from llama_min import reference
from santa_cupy import kernels, spec
from tests.gpu_util import rel_l2, requires_gpu, rope_operands

pytestmark = [pytest.mark.gpu, requires_gpu]
OUT_TOL = {"float32": 1e-6, "float16": 1e-3}     # relative L2: the output's rounding


@pytest.mark.parametrize("out_dtype", decoder_ops.PRODUCT_DTYPES)
@pytest.mark.parametrize("N,d", [(1, 1), (1, 255), (3, 257), (2, 576), (1, 4096), (5, 4099)])
def test_rms_norm_matches_reference(out_dtype, N, d):
    import cupy
    rng = np.random.default_rng(N * d)
    x = (rng.standard_normal((N, d)) * 3).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    y = decoder_ops.rms_norm(cupy.asarray(x), cupy.asarray(w), 1e-5, out_dtype)
    assert y.dtype == np.dtype(out_dtype) and y.shape == (N, d)
    assert rel_l2(y.get().astype(np.float64), reference.rms_norm(x, w, 1e-5)) < OUT_TOL[out_dtype]


@pytest.mark.parametrize("product", decoder_ops.PRODUCT_DTYPES)
@pytest.mark.parametrize("kv_dtype", decoder_ops.KV_DTYPES)
@pytest.mark.parametrize("N,H,KVH,D,L_max", [(1, 1, 1, 2, 1), (1, 9, 3, 64, 5), (3, 32, 8, 128, 17),
                                               (2, 4, 4, 96, 3)])
def test_rope_append_is_bit_identical_to_reference(product, kv_dtype, N, H, KVH, D, L_max):
    """q and the two written cache rows bit for bit (float32 ops rounded one by one in both); every
    other cache row untouched. Positions include 0 and L_max - 1."""
    import cupy
    rng = np.random.default_rng(N * H * D + L_max)
    qkv = rng.standard_normal((N, (H + 2 * KVH) * D)).astype(product)
    cos, sin, pos, store = rope_operands(rng, N, KVH, D, L_max, kv_dtype)
    k_ref, v_ref = store[0].copy(), store[1].copy()
    q_ref = reference.rope_append(qkv, cos, sin, pos, k_ref, v_ref, H, KVH, kv_dtype)
    k, v = cupy.asarray(store[0]), cupy.asarray(store[1])
    q = decoder_ops.rope_append(cupy.asarray(qkv), cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(pos),
                                k, v, H, KVH, kv_dtype)
    assert q.dtype == k.dtype and q.shape == (N, H, D)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        np.testing.assert_array_equal(got.get().view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("product", decoder_ops.PRODUCT_DTYPES)
@pytest.mark.parametrize("out_dtype", decoder_ops.PRODUCT_DTYPES)
@pytest.mark.parametrize("N,I", [(1, 1), (1, 7), (5, 1536), (2, 14336), (1, 70001)])
def test_silu_mul_matches_reference(product, out_dtype, N, I):
    """70001 x 1 outputs run past the grid's one pass (2 blocks an SM x 256 threads): the grid-stride loop."""
    import cupy
    gu = (np.random.default_rng(N + I).standard_normal((N, 2 * I)) * 4).astype(product)
    a = decoder_ops.silu_mul(cupy.asarray(gu), out_dtype)
    assert a.dtype == np.dtype(out_dtype) and a.shape == (N, I)
    assert rel_l2(a.get().astype(np.float64), reference.silu_mul(gu)) < max(OUT_TOL[out_dtype], 1e-6)


@pytest.mark.parametrize("dtype", decoder_ops.GEMV_DTYPES)
def test_gemv_accumulates_into_out(dtype):
    import cupy
    rng = np.random.default_rng(3)
    conv = lambda a: spec.from_float32(a.astype(np.float32), dtype, np)  # noqa: E731
    x, w = conv(rng.standard_normal((3, 264))), conv(rng.standard_normal((40, 264)) / 16)
    base = rng.standard_normal((3, 40)).astype(np.float32)
    out = cupy.asarray(base)
    decoder_ops.gemv(cupy.asarray(x), cupy.asarray(w), out=out, accumulate=True)
    assert rel_l2(out.get(), base + reference.weight_product(x, w)) < 1e-6
    with pytest.raises(ValueError, match="accumulate=True needs out"):
        decoder_ops.gemv(cupy.asarray(x), cupy.asarray(w), accumulate=True)


def test_decoder_steps_in_a_graph():
    """The three kernels captured in one graph and replayed give what they give eagerly."""
    import cupy
    rng = np.random.default_rng(7)
    H, KVH, D, L_max, d, I = 4, 2, 64, 6, 96, 40
    x = cupy.asarray(rng.standard_normal((2, d)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(d).astype(np.float32))
    qkv = cupy.asarray(rng.standard_normal((2, (H + 2 * KVH) * D)).astype(np.float16))
    gu = cupy.asarray(rng.standard_normal((2, 2 * I)).astype(np.float16))
    cos = cupy.asarray(rng.standard_normal((L_max, D // 2)).astype(np.float32))
    sin = cupy.asarray(rng.standard_normal((L_max, D // 2)).astype(np.float32))
    pos = cupy.asarray(np.array([2, 5], np.int32))
    k, v = cupy.zeros((2, L_max, KVH, D), cupy.float16), cupy.zeros((2, L_max, KVH, D), cupy.float16)
    outs = (cupy.empty((2, d), cupy.float16), cupy.empty((2, H, D), cupy.float16), cupy.empty((2, I), cupy.float16))

    def step():
        decoder_ops.rms_norm(x, w, 1e-6, cupy.float16, out=outs[0])
        decoder_ops.rope_append(qkv, cos, sin, pos, k, v, H, KVH, "float16", q_out=outs[1])
        decoder_ops.silu_mul(gu, cupy.float16, out=outs[2])

    step()                                            # compile outside the capture
    eager = [o.get() for o in (*outs, k, v)]
    for o in (*outs, k, v):
        o.fill(cupy.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        step()
        graph = stream.end_capture()
    k.fill(0)
    v.fill(0)
    graph.launch(stream)
    stream.synchronize()
    for got, want in zip((*outs, k, v), eager):
        np.testing.assert_array_equal(got.get(), want)


def test_decoder_steps_reject_what_they_cannot_do():
    import cupy
    f32, f16 = cupy.float32, cupy.float16
    with pytest.raises(ValueError, match="rms_norm needs"):
        decoder_ops.rms_norm(cupy.zeros((2, 8), f16), cupy.zeros(8, f32), 1e-6, f16)
    with pytest.raises(ValueError, match="rms_norm needs"):
        decoder_ops.rms_norm(cupy.zeros((2, 8), f32), cupy.zeros(7, f32), 1e-6, f16)
    with pytest.raises(ValueError, match="out_dtype must be"):
        decoder_ops.rms_norm(cupy.zeros((2, 8), f32), cupy.zeros(8, f32), 1e-6, cupy.int8)
    with pytest.raises(ValueError, match="rms_norm needs out"):
        decoder_ops.rms_norm(cupy.zeros((2, 8), f32), cupy.zeros(8, f32), 1e-6, f16, out=cupy.zeros((2, 8), f32))
    qkv, cs = cupy.zeros((1, 4 * 8), f16), cupy.zeros((4, 4), f32)
    cache, pos = cupy.zeros((1, 4, 1, 8), f16), cupy.zeros(1, cupy.int32)
    good = (qkv, cs, cs, pos, cache, cache.copy(), 2, 1, "float16")
    decoder_ops.rope_append(*good)
    for i, bad in [(0, cupy.zeros((1, 3 * 8), f16)), (1, cupy.zeros((4, 3), f32)), (3, cupy.zeros(1, cupy.int64)),
                   (4, cupy.zeros((1, 4, 1, 8), f32)), (5, cupy.zeros((1, 4, 2, 8), f16))]:
        args = list(good)
        args[i] = bad
        with pytest.raises(ValueError):
            decoder_ops.rope_append(*args)
    with pytest.raises(ValueError, match="where bfloat16 was expected"):
        decoder_ops.rope_append(*good[:-1], "bfloat16")
    with pytest.raises(ValueError, match="silu_mul needs"):
        decoder_ops.silu_mul(cupy.zeros((1, 7), f16), f16)
    with pytest.raises(ValueError, match="silu_mul needs"):
        decoder_ops.silu_mul(cupy.zeros((1, 8), cupy.uint16), f16)


def test_programmatic_launch_gives_the_same_chain():
    """rms_norm -> gemv -> rope_append, gemv -> silu_mul -> gemv (accumulate): each kernel depends
    on the one before, so a kernel that read its input before griddepcontrol.wait would differ.
    Launched with programmatic dependent launch in a graph, replayed twice, bit-identical to plain."""
    import cupy
    rng = np.random.default_rng(11)
    H, KVH, D, L_max, d, I = 8, 2, 64, 9, 512, 1024
    f16 = lambda *s: cupy.asarray((rng.standard_normal(s) / np.sqrt(s[-1])).astype(np.float16))  # noqa: E731
    x0 = cupy.asarray(rng.standard_normal((1, d)).astype(np.float32))
    norm_w = cupy.asarray(rng.uniform(0.5, 1.5, d).astype(np.float32))
    w_qkv, w_gu, w_down = f16((H + 2 * KVH) * D, d), f16(2 * I, d), f16(d, I)
    table = cupy.asarray(rng.standard_normal((L_max, D // 2)).astype(np.float32))
    pos = cupy.asarray(np.array([4], np.int32))

    def chain(x, k, v):
        h = decoder_ops.rms_norm(x, norm_w, 1e-5, cupy.float16)
        q = decoder_ops.rope_append(decoder_ops.gemv(h, w_qkv), table, table, pos, k, v, H, KVH, "float16")
        a = decoder_ops.silu_mul(decoder_ops.gemv(h, w_gu), cupy.float16)
        decoder_ops.gemv(a, w_down, out=x, accumulate=True)
        return q

    def run(programmatic):
        assert kernels.set_programmatic_launch(programmatic) == programmatic
        try:
            x = x0.copy()
            k, v = cupy.zeros((1, L_max, KVH, D), cupy.float16), cupy.zeros((1, L_max, KVH, D), cupy.float16)
            chain(x.copy(), k, v)                            # compile outside the capture
            stream = cupy.cuda.Stream(non_blocking=True)
            with stream:
                stream.begin_capture()
                q = chain(x, k, v)
                graph = stream.end_capture()
                graph.launch(stream)
                graph.launch(stream)                         # x accumulates twice
            stream.synchronize()
            return [a.get() for a in (q, x, k, v)]
        finally:
            kernels.set_programmatic_launch(False)

    plain, programmatic = run(False), run(True)
    for got, want in zip(programmatic, plain):
        np.testing.assert_array_equal(got, want)

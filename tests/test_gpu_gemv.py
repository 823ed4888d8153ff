"""gemv.cu (the decoder's weight products for <= 4 tokens) against reference.weight_product (marker gpu)."""

import numpy as np
import pytest

from llama_min import ops as decoder_ops
from llama_min import reference
from santa_cupy import spec
from tests.gpu_util import rel_l2, requires_gpu, rope_operands

pytestmark = [pytest.mark.gpu, requires_gpu]


def _operands(rng, n, N, K, dtype):
    x = rng.standard_normal((n, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    conv = lambda a: spec.from_float32(a, dtype, np)  # noqa: E731
    x16, w16 = conv(x), conv(w)
    return x16, w16, reference.weight_product(x16, w16)


@pytest.mark.parametrize("kernel", decoder_ops.GEMV_KERNELS)
@pytest.mark.parametrize("dtype", decoder_ops.GEMV_DTYPES)
@pytest.mark.parametrize("n,N,K", [(1, 1, 8), (1, 7, 24), (2, 9, 264), (3, 8, 4096), (4, 33, 1000),
                                   (1, 4099, 4096), (4, 17, 14336)])
def test_gemv_matches_reference(kernel, dtype, n, N, K):
    """Awkward sizes: one row, rows not a multiple of a block's 8, K of 1 to 56 chunks per lane
    and not a multiple of the warp's chunk stride, 1 to 4 tokens (3 runs the 4-token instance)."""
    import cupy
    x, w, ref = _operands(np.random.default_rng(n * N + K), n, N, K, dtype)
    y = decoder_ops.gemv(cupy.asarray(x), cupy.asarray(w), kernel=kernel)
    assert y.dtype == cupy.float32 and y.shape == (n, N)
    assert rel_l2(y.get(), ref) < 1e-5            # f32 sums of exact 16-bit products


def test_gemv_in_a_graph_and_into_out():
    import cupy
    x, w, ref = _operands(np.random.default_rng(1), 2, 100, 512, "float16")
    xg, wg = cupy.asarray(x), cupy.asarray(w)
    out = cupy.full((2, 100), cupy.nan, cupy.float32)
    decoder_ops.gemv(xg, wg, out=out)                # compile outside the capture
    out.fill(cupy.nan)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        decoder_ops.gemv(xg, wg, out=out)
        graph = stream.end_capture()
    graph.launch(stream)
    stream.synchronize()
    assert rel_l2(out.get(), ref) < 1e-5


def test_gemv_rejects_what_it_cannot_do():
    import cupy
    x = cupy.zeros((1, 16), cupy.float16)
    w = cupy.zeros((4, 16), cupy.float16)
    for bad_x, bad_w in [(cupy.zeros((1, 12), cupy.float16), cupy.zeros((4, 12), cupy.float16)),   # K % 8
                         (cupy.zeros((5, 16), cupy.float16), w),                                   # 5 tokens
                         (x, w.astype(cupy.float32)), (x.astype(cupy.uint16), w),                   # dtypes
                         (x, cupy.zeros((4, 8), cupy.float16)), (x, cupy.zeros((16, 4), cupy.float16).T),
                         (cupy.zeros((1, 20), cupy.float16)[:, 4:], w)]:                           # unaligned
        with pytest.raises(ValueError, match="gemv needs"):
            decoder_ops.gemv(bad_x, bad_w)
    for bad_out in (cupy.zeros((1, 4), cupy.float16), cupy.zeros((4, 1), cupy.float32),
                    cupy.zeros((1, 8), cupy.float32)[:, ::2]):
        with pytest.raises(ValueError, match="gemv needs out"):
            decoder_ops.gemv(x, w, out=bad_out)


@pytest.mark.parametrize("dtype", decoder_ops.GEMV_DTYPES)
@pytest.mark.parametrize("kv_dtype", decoder_ops.GEMV_DTYPES)
@pytest.mark.parametrize("n,H,KVH,D,K,L_max", [(1, 1, 1, 2, 8, 1), (3, 9, 3, 64, 264, 5), (4, 4, 2, 96, 1000, 3),
                                               (1, 32, 8, 128, 4096, 17)])
def test_gemv_rope_is_the_two_launches_bit_for_bit(dtype, kv_dtype, n, H, KVH, D, K, L_max):
    """gemv_rope = gemv then rope_append (reference.rope_append, bit-identical to that kernel, on
    gemv's float32 product): q and both caches bit for bit, every other cache row untouched;
    1-4 tokens (3 runs the 4-token instance), positions 0 and L_max - 1, head dims 2 to 128."""
    import cupy
    rng = np.random.default_rng(n * H * D + K)
    x, w, _ = _operands(rng, n, (H + 2 * KVH) * D, K, dtype)
    cos, sin, pos, store = rope_operands(rng, n, KVH, D, L_max, kv_dtype)
    xg, wg = cupy.asarray(x), cupy.asarray(w)
    k_ref, v_ref = store[0].copy(), store[1].copy()
    q_ref = reference.rope_append(decoder_ops.gemv(xg, wg).get(), cos, sin, pos, k_ref, v_ref, H, KVH, kv_dtype)
    k, v = cupy.asarray(store[0]), cupy.asarray(store[1])
    q = decoder_ops.gemv_rope(xg, wg, cupy.asarray(cos), cupy.asarray(sin), cupy.asarray(pos), k, v, H, KVH, kv_dtype)
    assert q.dtype == k.dtype and q.shape == (n, H, D)
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        np.testing.assert_array_equal(got.get().view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", decoder_ops.GEMV_DTYPES)
@pytest.mark.parametrize("n,I,K", [(1, 1, 8), (3, 99, 264), (4, 1536, 1000), (1, 14336, 4096)])
def test_gemv_glu_is_the_two_launches_bit_for_bit(dtype, n, I, K):
    """gemv_glu = silu_mul(gemv(x, w)) rounded to w's dtype, bit for bit (odd I, 1-4 tokens), and
    close to the float64 reference."""
    import cupy
    x, w, prod = _operands(np.random.default_rng(n * I + K), n, 2 * I, K, dtype)
    xg, wg = cupy.asarray(x), cupy.asarray(w)
    want = spec.from_float32(decoder_ops.silu_mul(decoder_ops.gemv(xg, wg), "float32").get(), dtype, np)
    got = decoder_ops.gemv_glu(xg, wg)
    assert got.dtype == wg.dtype and got.shape == (n, I)
    np.testing.assert_array_equal(got.get().view(np.uint8), want.view(np.uint8))
    g, u = prod[:, :I], prod[:, I:]
    assert rel_l2(spec.to_float32(got.get(), np), g / (1 + np.exp(-g)) * u) < (8e-3 if dtype == "bfloat16" else 1e-3)


def test_fused_gemv_epilogues_reject_what_they_cannot_do():
    import cupy
    x = cupy.zeros((1, 16), cupy.float16)
    H, KVH, D, L = 2, 1, 8, 4
    w = cupy.zeros(((H + 2 * KVH) * D, 16), cupy.float16)
    cos = sin = cupy.zeros((L, D // 2), cupy.float32)
    pos = cupy.zeros((1,), cupy.int32)
    k = v = cupy.zeros((1, L, KVH, D), cupy.float16)
    args = (cos, sin, pos, k, v, H, KVH, "float16")
    with pytest.raises(ValueError, match="gemv_rope needs C-contiguous"):
        decoder_ops.gemv_rope(cupy.zeros((5, 16), cupy.float16), w, *args)                 # 5 tokens
    with pytest.raises(ValueError, match="gemv_rope needs w"):
        decoder_ops.gemv_rope(x, w[:-8], *args)                                           # rows != (H+2KVH) D
    with pytest.raises(ValueError, match="gemv_rope needs w"):
        kf = cupy.zeros((1, L, KVH, D), cupy.float32)
        decoder_ops.gemv_rope(x, w, cos, sin, pos, kf, kf, H, KVH, "float32")               # f32 caches
    with pytest.raises(ValueError, match="gemv_rope needs w"):
        decoder_ops.gemv_rope(x, w, cos, sin, cupy.zeros((2,), cupy.int32), k, v, H, KVH, "float16")
    with pytest.raises(ValueError, match="gemv_glu needs w"):
        decoder_ops.gemv_glu(x, cupy.zeros((7, 16), cupy.float16))                        # odd rows
    with pytest.raises(ValueError, match="gemv_glu needs C-contiguous"):
        decoder_ops.gemv_glu(x, cupy.zeros((8, 16), cupy.float32))
    with pytest.raises(ValueError, match="gemv_glu needs out"):
        decoder_ops.gemv_glu(x, cupy.zeros((8, 16), cupy.float16), out=cupy.zeros((1, 4), cupy.float32))

"""gemv.cu (the decoder's weight products for <= 4 tokens) against reference.weight_product (marker gpu)."""

import numpy as np
import pytest

from santa_cupy import decoder_ops, reference, spec
from tests.gpu_util import rel_l2, requires_gpu

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

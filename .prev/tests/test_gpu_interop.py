"""GPU arrays of other libraries go in without copies (marker gpu; skips without torch / JAX)."""

import numpy as np
import pytest

from santa_cupy import decode_attention, reference
from tests.gpu_util import rel_l2, requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]


def _torch_inputs():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 8, 128, device="cuda", dtype=torch.float16, generator=gen)
    k = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.float16, generator=gen)
    v = torch.randn(2, 300, 2, 128, device="cuda", dtype=torch.float16, generator=gen)
    lengths = torch.tensor([300, 77], device="cuda", dtype=torch.int32)
    return torch, q, k, v, lengths


def test_torch_tensors_zero_copy():
    import cupy
    torch, q, k, v, lengths = _torch_inputs()
    o = decode_attention(q, k, v, lengths, method="dense")
    ref, _ = reference.dense_attention(*(t.cpu().numpy() for t in (q, k, v, lengths)))
    assert isinstance(o, cupy.ndarray)
    assert rel_l2(o.get(), ref) < 2e-3
    assert cupy.from_dlpack(k).data.ptr == k.data_ptr()


def test_torch_bf16_as_int16_view():
    torch, q, k, v, lengths = _torch_inputs()
    views = [t.to(torch.bfloat16).view(torch.int16) for t in (q, k, v)]
    o = decode_attention(*views, lengths, samples=256)
    assert o.dtype == np.uint16 and o.shape == (2, 8, 128)


def test_jax_arrays():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 4, 64)).astype(np.float32)
    k = rng.standard_normal((1, 90, 1, 64)).astype(np.float32)
    v = rng.standard_normal((1, 90, 1, 64)).astype(np.float32)
    lengths = np.array([90], np.int32)
    try:
        arrays = [jnp.asarray(x) for x in (q, k, v, lengths)]
        if "cuda" not in str(arrays[0].devices()).lower() and "gpu" not in str(arrays[0].devices()).lower():
            pytest.skip("JAX runs on the CPU here")
    except Exception as exc:  # JAX without a usable backend
        pytest.skip(f"JAX unusable: {exc}")
    o = decode_attention(*arrays, method="dense")
    ref, _ = reference.dense_attention(q, k, v, lengths)
    assert rel_l2(o.get(), ref) < 1e-5

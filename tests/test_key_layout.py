"""santa_cupy.key_layout: the feature-blocked K layout's helpers (NumPy; CuPy in the GPU tests)."""

import numpy as np
import pytest

from santa_cupy import key_layout


@pytest.mark.parametrize("shape,FB", [((3, 5, 2, 64), 16), ((1, 1, 1, 32), 32), ((2, 129, 3, 128), 32),
                                      ((4, 17, 1, 48), 16)])
@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
def test_round_trip_and_element_map(shape, FB, dtype):
    rs = np.random.default_rng(sum(shape) + FB)
    k = rs.integers(0, 60000, shape).astype(dtype) if dtype == np.uint16 else rs.standard_normal(shape).astype(dtype)
    kb = key_layout.to_blocked(k, FB)
    B, L, KVH, D = shape
    assert kb.shape == (B, KVH, D // FB, L, FB) == key_layout.blocked_shape(shape, FB)
    assert kb.dtype == k.dtype and kb.flags.c_contiguous
    b, j, g, i = B - 1, L // 2, KVH - 1, D - 3
    assert kb[b, g, i // FB, j, i % FB] == k[b, j, g, i]
    back = key_layout.from_blocked(kb)
    assert back.flags.c_contiguous and back.dtype == k.dtype
    assert np.array_equal(back, k)


def test_block_run_is_contiguous():
    """The rows of block c of KV head g are one contiguous run of L_max * FB elements."""
    k = np.arange(2 * 7 * 3 * 64, dtype=np.float32).reshape(2, 7, 3, 64)
    kb = key_layout.to_blocked(k, 16)
    run = kb[1, 2, 3].ravel()
    assert np.array_equal(run, k[1, :, 2, 48:64].ravel())
    assert kb.strides[3] == 16 * 4 and kb.strides[2] == 7 * 16 * 4


@pytest.mark.parametrize("shape,FB,match", [((2, 3, 64), 16, "rank 4"), ((2, 3, 1, 40), 16, "multiple of key_block"),
                                            ((2, 3, 1, 64), 8, "key_block must be one of"),
                                            ((2, 3, 1, 64), True, "key_block must be one of")])
def test_to_blocked_errors(shape, FB, match):
    with pytest.raises(ValueError, match=match):
        key_layout.to_blocked(np.zeros(shape, np.float32), FB)


@pytest.mark.parametrize("shape,match", [((2, 1, 4, 3), "rank 5"), ((2, 1, 4, 3, 8), "key_block must be one of"),
                                         ((2, 1, 0, 3, 16), "C >= 1")])
def test_from_blocked_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        key_layout.from_blocked(np.zeros(shape, np.float32))


def test_not_an_array():
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        key_layout.to_blocked([[1.0]], 16)
    with pytest.raises(ValueError, match="key_layout"):
        key_layout.check_key_layout("NHD")

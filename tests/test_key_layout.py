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


@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
def test_the_kernels_blocked_addresses_are_to_blockeds_layout(FB, D):
    """The element offsets the CUDA code forms on a blocked K, modelled here, address what
    to_blocked put there: tile.cuh BlockedKeyRows::row / piece with mma.cuh's blocked
    load_key_slice (piece t + 4i of row j at piece t + 32 i L_max: thread t's slice, MmaQuery's
    order) and decoder_math.cuh blocked_key_at (element f of row p)."""
    rng = np.random.default_rng(D + FB)
    B, L_max, KVH = 2, 37, 3
    k = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    flat = key_layout.to_blocked(k, FB).ravel()
    for b, g, j in ((0, 0, 0), (1, 2, 36), (1, 0, 17)):
        row = (b * KVH + g) * D * L_max + j * FB                                   # BlockedKeyRows::row
        for t in range(4):
            f0 = 8 * t
            piece = row + (f0 & ~(FB - 1)) * L_max + (f0 & (FB - 1))              # BlockedKeyRows::piece
            for i in range(D // 32):                                               # load_key_slice
                at = piece + i * 32 * L_max
                np.testing.assert_array_equal(flat[at:at + 8], k[b, j, g, f0 + 32 * i:f0 + 32 * i + 8])
        for f in range(D):                                                         # blocked_key_at
            at = (((b * KVH + g) * (D // FB) + f // FB) * L_max + j) * FB + f % FB
            assert flat[at] == k[b, j, g, f]

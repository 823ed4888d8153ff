"""santa_cupy.key_layout: the feature-blocked K layout's helpers (NumPy; CuPy in the GPU tests)."""

import numpy as np
import pytest

from santa_cupy import key_layout

P = key_layout.KEY_PAGE_ROWS


@pytest.mark.parametrize("shape,FB", [((3, 5, 2, 64), 16), ((1, 1, 1, 32), 32), ((2, 129, 3, 128), 32),
                                      ((4, 17, 1, 48), 16), ((1, 128, 2, 64), 16)])
@pytest.mark.parametrize("dtype", [np.uint16, np.float16, np.float32])
def test_round_trip_and_element_map(shape, FB, dtype):
    rs = np.random.default_rng(sum(shape) + FB)
    k = rs.integers(0, 60000, shape).astype(dtype) if dtype == np.uint16 else rs.standard_normal(shape).astype(dtype)
    kb = key_layout.to_blocked(k, FB)
    B, L, KVH, D = shape
    NP = -(-L // P)
    assert kb.shape == (B, KVH, NP, D // FB, P, FB) == key_layout.blocked_shape(shape, FB)
    assert key_layout.blocked_rows(kb.shape) == NP * P >= L
    assert kb.dtype == k.dtype and kb.flags.c_contiguous
    for b, j, g, i in ((B - 1, L // 2, KVH - 1, D - 3), (0, L - 1, 0, 0)):
        assert kb[b, g, j // P, i // FB, j % P, i % FB] == k[b, j, g, i]
    padded = key_layout.from_blocked(kb)                 # every page's rows: zeros past L
    assert padded.shape == (B, NP * P, KVH, D) and not padded[:, L:].any()
    back = key_layout.from_blocked(kb, L)
    assert back.flags.c_contiguous and back.dtype == k.dtype
    assert np.array_equal(back, k)


def test_block_run_is_contiguous():
    """The P rows of block c of a page of KV head g are one contiguous run of P * FB elements, and
    a page's C blocks follow one another."""
    L = 2 * P + 5
    k = np.arange(2 * L * 3 * 64, dtype=np.float32).reshape(2, L, 3, 64)
    kb = key_layout.to_blocked(k, 16)
    run = kb[1, 2, 1, 3].ravel()                          # page 1, block 3
    assert np.array_equal(run, k[1, P:2 * P, 2, 48:64].ravel())
    assert kb.strides[4] == 16 * 4 and kb.strides[3] == P * 16 * 4 and kb.strides[2] == 4 * P * 16 * 4


def test_write_rows_and_token_fill_the_layout():
    """llama_min's appends: write_rows (a prefill across page boundaries) and write_token (one row a
    sequence at its own position) leave what to_blocked writes."""
    rs = np.random.default_rng(5)
    B, L, KVH, D, FB = 3, 150, 2, 64, 32
    k = rs.standard_normal((B, L, KVH, D)).astype(np.float32)
    want = key_layout.to_blocked(k, FB)
    kb = np.zeros_like(want)
    key_layout.write_rows(kb, 0, k[:, :60])
    key_layout.write_rows(kb, 60, k[:, 60:131])            # part of page 0, page 1 whole, part of page 2
    for p in range(131, L):
        key_layout.write_token(kb, np.arange(B), np.full(B, p), k[:, p])
    assert np.array_equal(kb, want)
    one = np.zeros_like(want)                              # sequences at different positions
    key_layout.write_token(one, np.array([2, 0]), np.array([70, 3]), k[[2, 0], [70, 3]])
    assert one[2, :, 1, :, 6].ravel().tolist() == k[2, 70].reshape(KVH, D).ravel().tolist()
    assert one[0, :, 0, :, 3].ravel().tolist() == k[0, 3].reshape(KVH, D).ravel().tolist()
    assert np.count_nonzero(one) == np.count_nonzero(k[[2, 0], [70, 3]])
    with pytest.raises(ValueError, match="outside the blocked K"):
        key_layout.write_rows(kb, L - 5, k[:, :P])
    whole = np.zeros_like(want)                            # one assignment of whole pages, then the rest
    key_layout.write_rows(whole, 0, k)
    assert np.array_equal(whole, want)


@pytest.mark.parametrize("shape,FB,match", [((2, 3, 64), 16, "rank 4"), ((2, 3, 1, 40), 16, "multiple of key_block"),
                                            ((2, 3, 1, 64), 8, "key_block must be one of"),
                                            ((2, 3, 1, 64), True, "key_block must be one of")])
def test_to_blocked_errors(shape, FB, match):
    with pytest.raises(ValueError, match=match):
        key_layout.to_blocked(np.zeros(shape, np.float32), FB)


@pytest.mark.parametrize("shape,match", [((2, 1, 4, 3, 16), "rank 6"), ((2, 1, 1, 4, P, 8), "key_block must be one of"),
                                         ((2, 1, 1, 0, P, 16), "C >= 1"), ((2, 1, 1, 4, 32, 16), f"pages of P = {P}")])
def test_from_blocked_errors(shape, match):
    with pytest.raises(ValueError, match=match):
        key_layout.from_blocked(np.zeros(shape, np.float32))


def test_from_blocked_length_errors():
    kb = np.zeros((1, 1, 2, 4, P, 16), np.float32)
    with pytest.raises(ValueError, match="length must be in 0..128"):
        key_layout.from_blocked(kb, 129)


def test_not_an_array():
    with pytest.raises(TypeError, match="numpy.ndarray or cupy.ndarray"):
        key_layout.to_blocked([[1.0]], 16)
    with pytest.raises(ValueError, match="key_layout"):
        key_layout.check_key_layout("NHD")


@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("L_max", [37, 130])
def test_the_kernels_blocked_addresses_are_to_blockeds_layout(FB, D, L_max):
    """The element offsets the CUDA code forms on a blocked K, modelled here, address what
    to_blocked put there: tile.cuh BlockedKeyRows::row / piece with mma.cuh's blocked
    load_key_slice (piece t + 4i of row j at piece t + 32 i P: thread t's slice, MmaQuery's
    order), santa_score_keys.cu's FMA pass (block c of row j at row + c P FB), CompactKeyRows
    (group k at piece t + 32 k P) and decoder_math.cuh blocked_key_at (element f of row p)."""
    rng = np.random.default_rng(D + FB + L_max)
    B, KVH = 2, 3
    k = rng.standard_normal((B, L_max, KVH, D)).astype(np.float32)
    flat = key_layout.to_blocked(k, FB).ravel()
    pages = -(-L_max // P)
    for b, g, j in ((0, 0, 0), (1, 2, L_max - 1), (1, 0, 17), (0, 1, min(L_max - 1, 64))):
        row = ((b * KVH + g) * pages + j // P) * D * P + (j % P) * FB            # BlockedKeyRows::row
        for t in range(4):
            f0 = 8 * t
            piece = row + (f0 & ~(FB - 1)) * P + (f0 & (FB - 1))                  # BlockedKeyRows::piece
            for i in range(D // 32):                                               # load_key_slice
                at = piece + i * 32 * P
                np.testing.assert_array_equal(flat[at:at + 8], k[b, j, g, f0 + 32 * i:f0 + 32 * i + 8])
        for c in range(D // FB):                                                   # the FMA pass's block c
            at = row + c * P * FB
            np.testing.assert_array_equal(flat[at:at + FB], k[b, j, g, c * FB:(c + 1) * FB])
        for f in range(D):                                                         # blocked_key_at
            page = (b * KVH + g) * pages + j // P
            at = ((page * (D // FB) + f // FB) * P + j % P) * FB + f % FB
            assert flat[at] == k[b, j, g, f]

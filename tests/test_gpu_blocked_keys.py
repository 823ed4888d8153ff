"""Dense attention and the decoder's K append on a feature-blocked K (issue 17 item 2; key_layout
"blocked": K [B, KVH, NP, C, P, FB], santa_cupy/key_layout.py) on the GPU.

(a) decode_dense_mma_blocked equals decode_dense_mma on the standard K bit for bit (the same K
    words in the same registers, the same arithmetic in the same order) for the same splits: B = 3,
    lengths 1, odd and past a 16-row step (rows past each length hold garbage, the last row of each
    sequence a spike), D 64 / 128, FB 16 / 32, fp16 / bf16, merged in the kernel's last block and
    by santa_merge; both within the dense error bound of the float64 reference;
(b) decode_attention(..., "dense", key_layout="blocked") with the automatic splits: within the
    bound, and bit for bit the standard call where the two plans split alike;
(c) the rotary + K/V append (ops.rope_append, ops.gemv_rope) with key_block writes to_blocked of
    the standard append's K, q and V unchanged;
(d) llama_min's GPU decoder on a cache with key_block: eager steps and a GraphDecoder give the
    standard cache's logits bit for bit, the cache holds to_blocked of the standard K;
(e) the same decoder with block key sampling (eager and graphed): dense's logits when every block
    is read, about the budget's fraction of K read otherwise.
Four attention modules (all in kernels.CI_CONFIGS, so tools/warm_kernel_cache.py warms them) and
the decoder's.
"""

import numpy as np
import pytest

import santa_cupy
from santa_cupy import key_layout
from tests.gpu_util import (assert_dense_matches, dense_error_bound, make_plan, random_inputs, requires_gpu,
                            rope_operands, to_gpu)

pytestmark = [pytest.mark.gpu, requires_gpu]

CONFIGS = [("bfloat16", 128, 4), ("float16", 64, 1), ("float16", 128, 8), ("bfloat16", 64, 4)]   # (dtype, D, G)
LENGTHS = [1, 77, 330]
L_MAX = 333                  # not a multiple of a 16-row step


def _case(dtype, D, G, seed, KVH=2):
    rng = np.random.default_rng(seed)
    return random_inputs(rng, len(LENGTHS), G * KVH, KVH, D, L_MAX, LENGTHS, dtype, spike=True)


def _plan(dtype, D, G, KVH=2, **kw):
    return make_plan(batch=len(LENGTHS), heads=G * KVH, kv_heads=KVH, head_dim=D, max_length=L_MAX, dtype=dtype,
                     method="dense", **kw)


@pytest.mark.parametrize("dtype,D,G", CONFIGS)
@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("merge", ["kernel", "santa_merge"])
def test_dense_on_a_blocked_key_is_the_standard_dense_bit_for_bit(dtype, D, G, FB, merge):
    import cupy
    q, k, v, lens = _case(dtype, D, G, seed=D + G + FB)
    choice = dict(dense_splits=3, self_merge_max_splits=32 if merge == "kernel" else 0)
    standard = _plan(dtype, D, G, **choice)
    blocked = _plan(dtype, D, G, key_layout="blocked", key_block=FB, **choice)
    assert blocked.dense_merges_itself == standard.dense_merges_itself == (merge == "kernel")
    qg, kg, kbg, vg, lg = to_gpu(q, k, key_layout.to_blocked(k, FB), v, lens)
    o_std = standard.run(qg, kg, vg, lg).copy()
    o_blk = blocked.run(qg, kbg, vg, lg).copy()
    cupy.cuda.Device().synchronize()
    np.testing.assert_array_equal(o_blk.get(), o_std.get())
    for name in ("lse", "spread"):
        np.testing.assert_array_equal(getattr(blocked.info(), name).get(), getattr(standard.info(), name).get())
    assert_dense_matches(o_blk, dense_error_bound(q, k, v, lens, dtype), f"blocked FB={FB}")


@pytest.mark.parametrize("dtype,D,G", CONFIGS[:2])
@pytest.mark.parametrize("FB", [16, 32])
def test_decode_attention_dense_on_a_blocked_key(dtype, D, G, FB):
    q, k, v, lens = _case(dtype, D, G, seed=7 * FB)
    qg, kg, kbg, vg, lg = to_gpu(q, k, key_layout.to_blocked(k, FB), v, lens)
    o_std = santa_cupy.decode_attention(qg, kg, vg, lg, "dense")
    o_blk, info = santa_cupy.decode_attention(qg, kbg, vg, lg, "dense", key_layout="blocked", return_info=True)
    assert_dense_matches(o_blk, dense_error_bound(q, k, v, lens, dtype), f"decode_attention blocked FB={FB}")
    np.testing.assert_array_equal(info.rows_read.get(), np.repeat(lens[:, None], 2, axis=1))
    standard, blocked = _plan(dtype, D, G), _plan(dtype, D, G, key_layout="blocked", key_block=FB)
    if (standard.part_rows, standard.P_max, standard.dense_pairs) == (blocked.part_rows, blocked.P_max,
                                                                      blocked.dense_pairs):
        np.testing.assert_array_equal(o_blk.get(), o_std.get())


@pytest.mark.parametrize("product", ["float32", "float16"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("FB", [16, 32])
def test_rope_append_into_a_blocked_k_is_the_blocked_standard_append(product, kv_dtype, FB):
    """ops.rope_append with key_block: K = to_blocked of the standard append's (every row: only the
    written ones change), q and V bit for bit the standard call's; the NumPy twin agrees."""
    import cupy

    from llama_min import ops, reference
    N, H, KVH, D, L_max = 3, 8, 2, 64, 150                  # K's rows on three pages
    rng = np.random.default_rng(FB)
    qkv = rng.standard_normal((N, (H + 2 * KVH) * D)).astype(product)
    cos, sin, pos, store = rope_operands(rng, N, KVH, D, L_max, kv_dtype)
    args = tuple(map(cupy.asarray, (qkv, cos, sin, pos)))
    k, v = cupy.asarray(store[0]), cupy.asarray(store[1])
    kb, vb = key_layout.to_blocked(k, FB), v.copy()
    q = ops.rope_append(*args, k, v, H, KVH, kv_dtype)
    qb = ops.rope_append(*args, kb, vb, H, KVH, kv_dtype, key_block=FB)
    for got, want in ((qb, q), (vb, v), (kb, key_layout.to_blocked(k, FB))):
        np.testing.assert_array_equal(got.get().view(np.uint8), want.get().view(np.uint8))
    k_ref, v_ref = key_layout.to_blocked(store[0], FB), store[1].copy()
    reference.rope_append(qkv, cos, sin, pos, k_ref, v_ref, H, KVH, kv_dtype, key_block=FB)
    np.testing.assert_array_equal(kb.get().view(np.uint8), k_ref.view(np.uint8))
    with pytest.raises(ValueError, match="blocked k_cache"):
        ops.rope_append(*args, k, v, H, KVH, kv_dtype, key_block=FB)            # a standard K with key_block


@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3])
def test_gemv_rope_into_a_blocked_k(kv_dtype, n):
    import cupy

    from llama_min import ops
    rng = np.random.default_rng(n)
    H, KVH, D, K, L_max, FB = 8, 2, 64, 256, 9, 16
    cos, sin, pos, store = rope_operands(rng, n, KVH, D, L_max, kv_dtype)
    x = cupy.asarray(rng.standard_normal((n, K)).astype(np.float16))
    w = cupy.asarray((rng.standard_normal(((H + 2 * KVH) * D, K)) / 16).astype(np.float16))
    cos, sin, pos = map(cupy.asarray, (cos, sin, pos))
    k, v = cupy.asarray(store[0]), cupy.asarray(store[1])
    kb, vb = key_layout.to_blocked(k, FB), v.copy()
    q = ops.gemv_rope(x, w, cos, sin, pos, k, v, H, KVH, kv_dtype)
    qb = ops.gemv_rope(x, w, cos, sin, pos, kb, vb, H, KVH, kv_dtype, key_block=FB)
    for got, want in ((qb, q), (vb, v), (kb, key_layout.to_blocked(k, FB))):
        np.testing.assert_array_equal(got.get(), want.get())


@pytest.mark.parametrize("dtype,gemv", [("float16", None), ("bfloat16", False), ("float16", True)])
@pytest.mark.parametrize("FB", [16, 32])
def test_gpu_decoder_on_a_blocked_cache_is_the_standard_one(tmp_path, dtype, gemv, FB):
    """The tiny Llama (D 64) on the GPU, prefill then 6 steps eager and 6 in a GraphDecoder: the
    blocked cache's logits equal the standard cache's bit for bit (one dense split at these
    lengths, so the two kernels sum alike), and its K is to_blocked of the standard cache's."""
    import cupy

    from llama_min.graph import GraphDecoder
    from llama_min.model import AttentionSetting, LlamaModel
    from tests.test_model import make_tiny
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, D=64, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype=dtype)
    att = AttentionSetting(method="dense")
    B = 1 if gemv else 2
    rng = np.random.default_rng(FB)
    prompt, steps = rng.integers(0, cfg["vocab_size"], (B, 9)), rng.integers(0, cfg["vocab_size"], (12, B))
    out = {}
    for block in (None, FB):
        cache = model.new_cache(B, 24, key_block=block)
        model.prefill(prompt, cache)
        logits = [cupy.asnumpy(model.decode(t, cache, att)) for t in steps[:6]]
        with GraphDecoder(model, cache, att, gemv=gemv) as gd:
            logits += [cupy.asnumpy(gd.replay(t)).copy() for t in steps[6:]]
        out[block] = (np.array(logits), [cupy.asnumpy(a) for a in cache.k], [cupy.asnumpy(a) for a in cache.v])
    (l0, k0, v0), (l1, k1, v1) = out[None], out[FB]
    np.testing.assert_array_equal(l1, l0)
    for layer in range(cfg["num_hidden_layers"]):
        np.testing.assert_array_equal(k1[layer], key_layout.to_blocked(k0[layer], FB))
        np.testing.assert_array_equal(v1[layer], v0[layer])
    santa = AttentionSetting(method="santa", samples=8)
    cache = model.new_cache(B, 24, key_block=FB)
    model.prefill(prompt, cache)
    with pytest.raises(ValueError, match="method 'dense'"):
        model.decode(steps[0], cache, santa)


@pytest.mark.parametrize("FB", [16, 32])
def test_gpu_decoder_with_key_sampling(tmp_path, FB):
    """The tiny Llama on the GPU with block key sampling on a blocked cache, eager and in a
    GraphDecoder: at key_budget 1 (every block read, weight 1) and S >> n its logits are dense's
    within the stash's float32; at key_budget 0.5 it reads about half of K (the tally of the eager
    steps), its logits finite and not dense's (on this random model half the blocks move the
    logits by about their own scale, as on the CPU reference)."""
    import cupy

    from llama_min.graph import GraphDecoder
    from llama_min.model import AttentionSetting, LlamaModel, key_read_fraction
    from tests.test_model import make_tiny
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, D=64, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype="float16")
    rng = np.random.default_rng(FB + 1)
    prompt, steps = rng.integers(0, cfg["vocab_size"], (2, 9)), rng.integers(0, cfg["vocab_size"], (8, 2))

    def run(att, key_block):
        cache = model.new_cache(2, 24, key_block=key_block)
        model.prefill(prompt, cache)
        logits = [cupy.asnumpy(model.decode(t, cache, att)) for t in steps[:4]]
        with GraphDecoder(model, cache, att) as gd:
            logits += [cupy.asnumpy(gd.replay(t)).copy() for t in steps[4:]]
        return np.array(logits), key_read_fraction(cache)

    dense, _ = run(AttentionSetting(method="dense"), None)
    keys = f"keys=block:FB={FB},rule=qrms,f=%s"
    full, read = run(AttentionSetting.parse(f"systematic/global/S=65536/{keys % 1}").replace(santa_min_length=0), FB)
    assert read == 1.0
    # fp16 attention outputs through two layers: logits within ~2e-3 of their scale (seen: 1.7e-3)
    assert np.abs(full - dense).max() < 4e-3 * np.abs(dense).max()
    half, read = run(AttentionSetting.parse(f"systematic/global/S=256/{keys % 0.5}").replace(santa_min_length=0), FB)
    assert 0.3 < read < 0.8, read
    assert np.isfinite(half).all() and np.abs(half - dense).max() > 1e-2 * np.abs(dense).max()

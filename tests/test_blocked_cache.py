"""llama_min on a KV cache with K feature-blocked (issue 17 item 2: new_cache(key_block=FB), K
[B, KVH, NP, D / FB, P, FB], santa_cupy's key_layout "blocked"): on the CPU the decode steps give
the standard cache's logits bit for bit and the cache holds to_blocked of the standard K; the
NumPy twin of the rotary + K/V append writes the blocked layout. The GPU side is
tests/test_gpu_blocked_keys.py."""

import numpy as np
import pytest

from llama_min import reference
from llama_min.model import AttentionSetting, LlamaModel
from santa_cupy import key_layout
from test_model import make_tiny
from test_paged_cache import _decode_all

ATTENTIONS = {
    "dense": AttentionSetting(method="dense"),
    "santa": AttentionSetting(method="santa", samples=8, seed=3),
    "keys": AttentionSetting.parse("systematic/global/S=16/keys=block:FB=16,f=0.5,rule=qrms"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, cfg = make_tiny(tmp_path_factory.mktemp("tiny"), H=4, KVH=2, D=64, max_pos=64)
    return LlamaModel.from_pretrained(path), cfg


@pytest.mark.parametrize("name", ATTENTIONS)
@pytest.mark.parametrize("FB", [16, 32])
def test_blocked_cache_decodes_as_the_standard_one(tiny, name, FB):
    """Batch 2, a prompt of 7 (two prefill chunks of 4 and 3) and 6 decode steps: the same logits
    at every step, bit for bit, and every layer's K is to_blocked of the standard cache's (one
    page of K: the tiny model's positions stop at 64; tests/test_key_layout.py writes across pages)."""
    model, cfg = tiny
    att = ATTENTIONS[name]
    rng = np.random.default_rng(FB)
    prompt, steps = rng.integers(0, cfg["vocab_size"], (2, 7)), rng.integers(0, cfg["vocab_size"], (6, 2))
    standard = model.new_cache(2, 20)
    want = np.stack([model.prefill(prompt[:, :4], standard), model.prefill(prompt[:, 4:], standard)]
                    + [model.decode(t, standard, att) for t in steps])
    cache = model.new_cache(2, 20, key_block=FB)
    assert cache.key_layout == "blocked" and cache.key_block == FB
    assert cache.k[0].shape == (2, 2, 1, 64 // FB, 64, FB) and cache.v[0].shape == (2, 20, 2, 64)
    got = np.stack([model.prefill(prompt[:, :4], cache), model.prefill(prompt[:, 4:], cache)]
                   + [model.decode(t, cache, att) for t in steps])
    np.testing.assert_array_equal(got, want)
    for layer in range(cfg["num_hidden_layers"]):
        np.testing.assert_array_equal(cache.k[layer], key_layout.to_blocked(standard.k[layer], FB))
        np.testing.assert_array_equal(cache.v[layer], standard.v[layer])
        k, v = cache.read(layer, 13)
        np.testing.assert_array_equal(k, standard.k[layer][:, :13])
        assert v.base is cache.v[layer] and v.shape == k.shape


def test_blocked_cache_options(tiny):
    model, _ = tiny
    assert model.new_cache(1, 8).key_layout == "standard"
    with pytest.raises(ValueError, match="no paged form"):
        model.new_cache(1, 8, page_size=4, key_block=16)
    for bad in (8, 64, True):
        with pytest.raises(ValueError, match="key_block must be one of"):
            model.new_cache(1, 8, key_block=bad)


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("FB", [16, 32])
def test_reference_rope_append_into_a_blocked_k(kv_dtype, FB):
    """llama_min.reference.rope_append with key_block: q and v as without it, K the blocked form of
    the standard append's (rows not written stay as they were)."""
    from santa_cupy import spec
    rng = np.random.default_rng(FB)
    N, H, KVH, D, L_max = 3, 8, 2, 64, 9
    qkv = rng.standard_normal((N, (H + 2 * KVH) * D)).astype(np.float32)
    ang = rng.uniform(-4, 4, (L_max, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = np.array([8, 0, 5], np.int32)
    k, v = (spec.from_float32(rng.standard_normal((N, L_max, KVH, D)).astype(np.float32), kv_dtype, np)
            for _ in range(2))
    kb, vb = key_layout.to_blocked(k, FB), v.copy()
    q = reference.rope_append(qkv, cos, sin, pos, k, v, H, KVH, kv_dtype)
    qb = reference.rope_append(qkv, cos, sin, pos, kb, vb, H, KVH, kv_dtype, key_block=FB)
    np.testing.assert_array_equal(qb, q)
    np.testing.assert_array_equal(vb, v)
    np.testing.assert_array_equal(kb, key_layout.to_blocked(k, FB))

"""llama_min model: a tiny random Llama written to tmp_path vs an independent float64 formula."""

import collections
import json
import math
import struct

import numpy as np
import pytest

from llama_min.config import ConfigError, load_config
from llama_min.model import AttentionSetting, LlamaModel, rope_inv_freq
from llama_min.weights import WeightsError

# ------------------------------------------------------------------ tiny checkpoint writer


def _bf16_round(a):
    """float32 -> bf16 bit patterns (uint16) by truncation, and the exact float64 values."""
    bits = (np.asarray(a, np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return bits, (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def write_safetensors(path, tensors):
    """tensors: name -> (dtype string 'F32'|'F16'|'BF16', ndarray with matching storage)."""
    header, blobs, off = {}, [], 0
    for name, (dt, arr) in tensors.items():
        b = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def make_tiny(tmp_path, *, H=4, KVH=2, D=64, d=48, inter=80, layers=2, vocab=37, max_pos=64,
              rope_scaling=False, tied=True, wdtype="F32", seed=0, shards=1, extra_cfg=None):
    """Write config.json + safetensors; return (dir, weights as float64 dict in HF names, cfg dict)."""
    rng = np.random.default_rng(seed)
    shapes = {"model.embed_tokens.weight": (vocab, d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, d)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (H * D, d), p + "self_attn.k_proj.weight": (KVH * D, d),
            p + "self_attn.v_proj.weight": (KVH * D, d), p + "self_attn.o_proj.weight": (d, H * D),
            p + "mlp.gate_proj.weight": (inter, d), p + "mlp.up_proj.weight": (inter, d),
            p + "mlp.down_proj.weight": (d, inter)})
    W, st = {}, {}
    for name, shp in shapes.items():
        if name.endswith("norm.weight"):
            a = (1.0 + 0.2 * rng.standard_normal(shp)).astype(np.float32)
        elif "embed" in name or "lm_head" in name:
            a = rng.standard_normal(shp).astype(np.float32)
        else:
            a = (rng.standard_normal(shp) / math.sqrt(shp[1]) * 1.5).astype(np.float32)
        if wdtype == "BF16":
            bits, exact = _bf16_round(a)
            st[name], W[name] = ("BF16", bits), exact
        elif wdtype == "F16":
            h = a.astype(np.float16)
            st[name], W[name] = ("F16", h), h.astype(np.float64)
        else:
            st[name], W[name] = ("F32", a), a.astype(np.float64)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": H,
           "num_key_value_heads": KVH, "head_dim": D, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "max_position_embeddings": max_pos, "vocab_size": vocab, "tie_word_embeddings": tied,
           "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    if rope_scaling:
        cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    cfg.update(extra_cfg or {})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    names = list(st)
    if shards == 1:
        write_safetensors(tmp_path / "model.safetensors", st)
    else:
        wmap = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: st[n] for n in names[s::shards]}
            write_safetensors(tmp_path / fn, part)
            wmap.update({n: fn for n in part})
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return tmp_path, W, cfg


# ------------------------------------------------------------------ independent float64 reference


def ref_inv_freq(cfg):
    D = cfg["head_dim"]
    out = []
    for i in range(D // 2):
        f = cfg["rope_theta"] ** (-2.0 * i / D)
        rs = cfg.get("rope_scaling")
        if rs:
            wl = 2 * math.pi / f
            lo_wl = rs["original_max_position_embeddings"] / rs["low_freq_factor"]
            hi_wl = rs["original_max_position_embeddings"] / rs["high_freq_factor"]
            if wl > lo_wl:
                f = f / rs["factor"]
            elif wl >= hi_wl:
                sm = (rs["original_max_position_embeddings"] / wl - rs["low_freq_factor"]) / (
                    rs["high_freq_factor"] - rs["low_freq_factor"])
                f = (1 - sm) * f / rs["factor"] + sm * f
        out.append(f)
    return np.array(out)


def ref_forward(W, cfg, ids):
    """Logits [V] float64 of the last position of `ids`, recomputing the whole prefix."""
    H, KVH, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, T = cfg["rms_norm_eps"], len(ids)
    inv = ref_inv_freq(cfg)

    def norm(x, w):
        return x / math.sqrt(float(np.mean(x * x)) + eps) * w

    def rot(v, p):            # rotate_half convention: pairs (i, i + D/2)
        out = np.empty(D)
        for i in range(D // 2):
            c, s = math.cos(p * inv[i]), math.sin(p * inv[i])
            out[i] = v[i] * c - v[i + D // 2] * s
            out[i + D // 2] = v[i + D // 2] * c + v[i] * s
        return out

    xs = [W["model.embed_tokens.weight"][t].copy() for t in ids]
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        Ks, Vs, Qs = [], [], []
        for t in range(T):
            h = norm(xs[t], W[p + "input_layernorm.weight"])
            q = (W[p + "self_attn.q_proj.weight"] @ h).reshape(H, D)
            k = (W[p + "self_attn.k_proj.weight"] @ h).reshape(KVH, D)
            Qs.append([rot(q[j], t) for j in range(H)])
            Ks.append([rot(k[j], t) for j in range(KVH)])
            Vs.append((W[p + "self_attn.v_proj.weight"] @ h).reshape(KVH, D))
        new = []
        for t in range(T):
            heads = []
            for j in range(H):
                kv = j // (H // KVH)
                sc = np.array([Qs[t][j] @ Ks[u][kv] / math.sqrt(D) for u in range(t + 1)])
                pr = np.exp(sc - sc.max())
                pr /= pr.sum()
                heads.append(sum(pr[u] * Vs[u][kv] for u in range(t + 1)))
            x = xs[t] + W[p + "self_attn.o_proj.weight"] @ np.concatenate(heads)
            h = norm(x, W[p + "post_attention_layernorm.weight"])
            g = W[p + "mlp.gate_proj.weight"] @ h
            a = g / (1 + np.exp(-g)) * (W[p + "mlp.up_proj.weight"] @ h)
            new.append(x + W[p + "mlp.down_proj.weight"] @ a)
        xs = new
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return head @ norm(xs[-1], W["model.norm.weight"])


def ref_logits_all(W, cfg, ids):
    return np.stack([ref_forward(W, cfg, ids[:t + 1]) for t in range(len(ids))])


# ------------------------------------------------------------------ tests

VARIANTS = [
    dict(H=4, KVH=4, rope_scaling=False, tied=True, wdtype="F32"),
    dict(H=4, KVH=2, rope_scaling=True, tied=False, wdtype="BF16"),
    dict(H=4, KVH=1, rope_scaling=True, tied=True, wdtype="F16", shards=3),
    dict(H=6, KVH=2, rope_scaling=False, tied=False, wdtype="BF16"),
]


def _close(a, b, tol=2e-4):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(1e-9, np.max(np.abs(b)))
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


@pytest.mark.parametrize("v", VARIANTS, ids=lambda v: "-".join(f"{k}{x}" for k, x in v.items()))
def test_prefill_decode_match_reference(tmp_path, v):
    path, W, cfg = make_tiny(tmp_path, **v)
    model = LlamaModel.from_pretrained(path)
    ids = [3, 17, 5, 0, 30, 8, 8, 21, 11, 2]
    ref = ref_logits_all(W, cfg, ids)                         # [T, V]
    _close(model.logits_all(ids), ref)
    cache = model.new_cache(1, 16)
    _close(model.prefill(np.array([ids[:4]]), cache)[0], ref[3])
    for t in range(4, len(ids)):
        _close(model.decode(np.array([ids[t]]), cache)[0], ref[t])
    assert cache.length == len(ids) and cache.step == len(ids) - 4
    assert int(cache.lengths[0]) == len(ids)


def test_chunked_prefill_equals_unchunked_and_batch(tmp_path):
    path, W, cfg = make_tiny(tmp_path, H=4, KVH=2, rope_scaling=True)
    model = LlamaModel.from_pretrained(path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, cfg["vocab_size"], size=(2, 23))
    c1, c2 = model.new_cache(2, 30), model.new_cache(2, 30)
    a = model.prefill(ids, c1)
    b = model.prefill(ids, c2, chunk=5)
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(c1.k[1][:, :23], c2.k[1][:, :23], rtol=1e-5, atol=1e-4)
    # batch rows are independent: row 1 alone gives the same logits
    c3 = model.new_cache(1, 30)
    np.testing.assert_allclose(model.prefill(ids[1:], c3)[0], a[1], rtol=1e-5, atol=1e-4)
    # decode continues identically in both caches
    nxt = np.array([4, 9])
    np.testing.assert_allclose(model.decode(nxt, c1), model.decode(nxt, c2), rtol=1e-5, atol=1e-4)
    # logits_all chunked == unchunked
    np.testing.assert_allclose(model.logits_all(ids[0], chunk=4), model.logits_all(ids[0]), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_kv_cache_close(tmp_path, dtype):
    path, W, cfg = make_tiny(tmp_path, H=4, KVH=2)
    ids = [3, 17, 5, 9, 30, 8]
    ref = ref_logits_all(W, cfg, ids)
    model = LlamaModel.from_pretrained(path, dtype=dtype)
    assert model.kv_dtype == dtype
    cache = model.new_cache(1, 8)
    model.prefill(np.array([ids[:3]]), cache)
    for t in range(3, len(ids)):
        _close(model.decode(np.array([ids[t]]), cache)[0], ref[t], tol=3e-2)


def test_rope_llama3_scaling_matches_reference(tmp_path):
    path, _, cfg = make_tiny(tmp_path, rope_scaling=True)
    inv = rope_inv_freq(load_config(path))
    np.testing.assert_allclose(inv, ref_inv_freq(cfg), rtol=1e-12)
    plain = dict(cfg, rope_scaling=None)
    assert not np.allclose(inv, ref_inv_freq(plain))


def test_santa_attention_with_many_samples_approximates_dense(tmp_path):
    santa_cupy = pytest.importorskip("santa_cupy")
    if not hasattr(santa_cupy, "decode_attention"):
        pytest.skip("santa_cupy.decode_attention not available yet")
    path, W, cfg = make_tiny(tmp_path, H=4, KVH=2)
    model = LlamaModel.from_pretrained(path)
    ids = [3, 17, 5, 9, 30, 8, 1, 4]
    ref = ref_logits_all(W, cfg, ids)
    for att in (AttentionSetting(method="santa", samples=1 << 16),
                AttentionSetting(method="santa", samples=1 << 14, sampler="iid", budget="fixed"),
                AttentionSetting(method="dense")):
        cache = model.new_cache(1, 10)
        model.prefill(np.array([ids[:4]]), cache)
        for t in range(4, len(ids)):
            out = model.decode(np.array([ids[t]]), cache, attention=att)[0]
            _close(out, ref[t], tol=3e-2 if att.method == "santa" else 2e-4)
    # few samples: different from dense but deterministic for a seed
    outs = []
    for att in (AttentionSetting(method="santa", samples=2, seed=5),) * 2 + (AttentionSetting(method="dense"),):
        cache = model.new_cache(1, 10)
        model.prefill(np.array([ids[:6]]), cache)
        outs.append(model.decode(np.array([ids[6]]), cache, attention=att))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert not np.allclose(outs[0], outs[2], atol=1e-3)   # two samples did not run dense


def test_one_pass_decodes_with_each_layers_previous_lse_as_hint(tmp_path, monkeypatch):
    """budget one_pass on the CPU: the first step's hint is the exact lse (None), every later one
    the same layer's lse of the previous step; with many samples it is dense to rounding."""
    from santa_cupy import one_pass

    path, W, cfg = make_tiny(tmp_path, H=4, KVH=2)
    model = LlamaModel.from_pretrained(path)
    ids = [3, 17, 5, 9, 30, 8, 1, 4]
    ref = ref_logits_all(W, cfg, ids)
    seen = []
    real = one_pass.one_pass_attention

    def spy(*args, lse_hint=None, layer=0, **kw):
        o, info = real(*args, lse_hint=lse_hint, layer=layer, **kw)
        seen.append((layer, None if lse_hint is None else np.array(lse_hint), info.lse.copy()))
        return o, info

    monkeypatch.setattr(one_pass, "one_pass_attention", spy)
    att = AttentionSetting(method="santa", budget="one_pass", samples=1 << 16)
    cache = model.new_cache(1, 10)
    model.prefill(np.array([ids[:4]]), cache)
    for t in range(4, len(ids)):
        _close(model.decode(np.array([ids[t]]), cache, attention=att)[0], ref[t], tol=3e-2)
    layers = cfg["num_hidden_layers"]
    assert len(seen) == layers * (len(ids) - 4)
    for i, (layer, hint, lse) in enumerate(seen):
        if i < layers:
            assert hint is None                              # the first step: the exact lse
        else:
            prev = seen[i - layers]
            assert prev[0] == layer and np.array_equal(hint, prev[2])
    assert cache.rows_taken > 0
    cache.reset()
    assert not cache.lse_hints and cache.rows_taken == 0


# ------------------------------------------------------------------ error paths


def test_bad_json_names_file(tmp_path):
    make_tiny(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json.*not valid JSON"):
        LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling.rope_type.*yarn"),
    ("architectures", ["MistralForCausalLM"], "architectures"),
    ("model_type", "gpt2", "model_type"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("hidden_size", "big", "hidden_size"),
])
def test_bad_config_fields(tmp_path, field, value, match):
    make_tiny(tmp_path, extra_cfg={field: value})
    with pytest.raises(ConfigError, match=match) as e:
        load_config(tmp_path)
    assert "config.json" in str(e.value)


def test_rope_default_and_missing_field(tmp_path):
    make_tiny(tmp_path, extra_cfg={"rope_scaling": {"rope_type": "default"}})
    assert load_config(tmp_path).rope_scaling is None
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["vocab_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="vocab_size.*missing"):
        load_config(tmp_path)


def test_eos_list_and_defaults(tmp_path):
    make_tiny(tmp_path, extra_cfg={"eos_token_id": [2, 7], "head_dim": None})
    c = load_config(tmp_path)
    assert c.eos_token_id == [2, 7] and c.head_dim == c.hidden_size // c.num_attention_heads


def test_truncated_safetensors(tmp_path):
    make_tiny(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(WeightsError, match="model.safetensors.*truncated"):
        LlamaModel.from_pretrained(tmp_path)
    f.write_bytes(data[:5])
    with pytest.raises(WeightsError, match="model.safetensors.*truncated"):
        LlamaModel.from_pretrained(tmp_path)
    f.write_bytes(struct.pack("<Q", 20) + b"{garbage" + b" " * 12 + data[36:])
    with pytest.raises(WeightsError, match="model.safetensors.*corrupt"):
        LlamaModel.from_pretrained(tmp_path)


def test_missing_tensor(tmp_path):
    _, W, _ = make_tiny(tmp_path, tied=True)
    st = {n: ("F32", a.astype(np.float32)) for n, a in W.items() if n != "model.layers.1.mlp.up_proj.weight"}
    write_safetensors(tmp_path / "model.safetensors", st)
    with pytest.raises(WeightsError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        LlamaModel.from_pretrained(tmp_path)


def test_wrong_shape_and_sharded_index_missing_file(tmp_path):
    make_tiny(tmp_path, shards=2)
    idx = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightsError, match="model-00002-of-00002.safetensors.*not found"):
        LlamaModel.from_pretrained(tmp_path)
    assert idx["weight_map"]


def test_decode_errors(tmp_path):
    path, _, _ = make_tiny(tmp_path)
    model = LlamaModel.from_pretrained(path)
    cache = model.new_cache(1, 4)
    with pytest.raises(ValueError, match="prefill"):
        model.decode(np.array([1]), cache)
    with pytest.raises(ValueError, match="does not fit"):
        model.prefill(np.array([[1, 2, 3, 4, 5]]), cache)
    with pytest.raises(ValueError, match="token ids"):
        model.prefill(np.array([[1, 99]]), cache)
    model.prefill(np.array([[1, 2, 3, 4]]), cache)
    with pytest.raises(ValueError, match="full"):
        model.decode(np.array([1]), cache)
    with pytest.raises(ValueError, match="device"):
        LlamaModel.from_pretrained(path, device="tpu")


# ------------------------------------------------------------------ GPU (CuPy) path

gpu = pytest.mark.gpu


def _cupy():
    cp = pytest.importorskip("cupy")
    try:
        n = cp.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no driver
        n = 0
    if n < 1:
        pytest.skip("no CUDA device")
    return cp


@gpu
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-3), ("float16", 3e-2), ("bfloat16", 3e-2)])
def test_gpu_matches_reference(tmp_path, dtype, tol):
    cp = _cupy()
    path, W, cfg = make_tiny(tmp_path, H=8, KVH=2, rope_scaling=True, tied=False, wdtype="BF16")
    ids = [3, 17, 5, 0, 30, 8, 8, 21, 11, 2]
    ref = ref_logits_all(W, cfg, ids)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype=dtype)
    _close(cp.asnumpy(model.logits_all(ids)), ref, tol)
    cache = model.new_cache(1, 16)
    _close(cp.asnumpy(model.prefill(np.array([ids[:4]]), cache))[0], ref[3], tol)
    for t in range(4, len(ids)):
        _close(cp.asnumpy(model.decode(np.array([ids[t]]), cache))[0], ref[t], tol)
    assert int(cache.lengths[0]) == len(ids) == cache.length


def _two_prefilled_caches(model, cfg, *, batch, prompt_len, n_steps, max_len, seed):
    """(decode tokens [n_steps, batch], cache, cache): one random prompt prefilled into two caches,
    for comparing two ways of decoding the same steps."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, cfg["vocab_size"], size=(batch, prompt_len))
    steps = rng.integers(0, cfg["vocab_size"], size=(n_steps, batch))
    c1, c2 = model.new_cache(batch, max_len), model.new_cache(batch, max_len)
    model.prefill(prompt, c1)
    model.prefill(prompt, c2)
    return steps, c1, c2


@gpu
@pytest.mark.parametrize("method,dtype", [("dense", "float32"), ("santa", "float32"), ("santa", "float16"),
                                          ("dense", "bfloat16")])
def test_graph_decoder_matches_eager(tmp_path, method, dtype):
    """The graph replays give the eager steps' logits. SANTA at every length (santa_min_length 0;
    "auto" would decode these short contexts with the dense kernel) with 64 samples: each step's
    estimate depends on its RNG step, so matching eager at every step means the graph's device
    step counter advanced with the cache's; a decoder whose counter stayed put (eager with the step
    held) would differ, and the counter ends at the cache's step."""
    cp = _cupy()
    from llama_min.graph import GraphDecoder
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype=dtype)
    att = AttentionSetting(method=method, samples=64, seed=3, santa_min_length=0)
    steps, c1, c2 = _two_prefilled_caches(model, cfg, batch=2, prompt_len=9, n_steps=6, max_len=20, seed=0)
    eager = [cp.asnumpy(model.decode(t, c1, att)) for t in steps]
    gd = GraphDecoder(model, c2, att)
    graph = [cp.asnumpy(gd.replay(t)) for t in steps]
    np.testing.assert_allclose(np.array(graph), np.array(eager), rtol=1e-4, atol=1e-4)
    assert c2.length == c1.length and c2.step == c1.step == 6
    np.testing.assert_array_equal(cp.asnumpy(c2.lengths), cp.asnumpy(c1.lengths))
    np.testing.assert_array_equal(cp.asnumpy(c2.k[1]), cp.asnumpy(c1.k[1]))
    if method == "santa":
        assert int(gd.plan.step.get()[0]) == c2.step                # the device counter: one per replay
        _, stuck_cache, _ = _two_prefilled_caches(model, cfg, batch=2, prompt_len=9, n_steps=6, max_len=20, seed=0)
        stuck = []
        for t in steps:                                             # the same steps, the RNG step held at 0
            stuck_cache.step = 0
            stuck.append(cp.asnumpy(model.decode(t, stuck_cache, att)))
        np.testing.assert_allclose(stuck[0], graph[0], rtol=1e-4, atol=1e-4)
        for t in range(1, len(steps)):
            assert not np.allclose(stuck[t], graph[t], rtol=1e-4, atol=1e-4), f"step {t}: the same as at RNG step 0"
        _, dense_cache, _ = _two_prefilled_caches(model, cfg, batch=2, prompt_len=9, n_steps=6, max_len=20, seed=0)
        dense = [cp.asnumpy(model.decode(t, dense_cache)) for t in steps]
        assert not np.allclose(dense[0], graph[0], rtol=1e-4, atol=1e-4), "santa did not run"


@gpu
def test_gpu_long_prompt_chunked_and_santa(tmp_path):
    cp = _cupy()
    from llama_min.generate import generate
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=2048, rope_scaling=True)
    cpu = LlamaModel.from_pretrained(path)
    g = LlamaModel.from_pretrained(path, device="gpu", dtype="float32")
    ids = np.random.default_rng(2).integers(0, cfg["vocab_size"], size=1100)
    np.testing.assert_allclose(cp.asnumpy(g.logits_all(ids)), cpu.logits_all(ids), rtol=1e-3, atol=2e-3)
    c_cpu, c_gpu = cpu.new_cache(1, 1200), g.new_cache(1, 1200)
    a = cpu.prefill(ids[None], c_cpu)
    b = cp.asnumpy(g.prefill(ids[None], c_gpu))
    np.testing.assert_allclose(b, a, rtol=1e-3, atol=2e-3)
    dense = cp.asnumpy(g.decode(np.array([5]), c_gpu))
    c2 = g.new_cache(1, 1200)
    g.prefill(ids[None], c2)
    santa = cp.asnumpy(g.decode(np.array([5]), c2, AttentionSetting(method="santa", samples=1 << 15)))
    _close(santa, dense, tol=3e-2)
    r1 = generate(g, list(ids[:50]), max_new_tokens=8)
    r2 = generate(g, list(ids[:50]), max_new_tokens=8, use_graph=True)
    r3 = generate(cpu, list(ids[:50]), max_new_tokens=8)
    assert r1.generated_tokens == r3.generated_tokens, (r1.generated_tokens, r3.generated_tokens)
    assert r2.generated_tokens == r3.generated_tokens, (r2.generated_tokens, r3.generated_tokens)


@gpu
def test_graph_decoder_with_gemv_matches_eager(tmp_path):
    """GraphDecoder(gemv=True): the <= 4-token weight products through gemv.cu (float32 out, the
    residual adds in the same launch) agree with the eager cuBLAS step (float16 out) to the
    products' rounding; the K/V rows it appends likewise."""
    cp = _cupy()
    from llama_min.backends import GemvBackend
    from llama_min.graph import GraphDecoder
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype="float16")
    steps, c1, c2 = _two_prefilled_caches(model, cfg, batch=3, prompt_len=7, n_steps=4, max_len=16, seed=5)
    eager = [cp.asnumpy(model.decode(t, c1)) for t in steps]
    with GraphDecoder(model, c2, gemv=True) as gd:
        assert isinstance(gd.backend, GemvBackend)
        graph = [cp.asnumpy(gd.replay(t)) for t in steps]
    for g, e in zip(graph, eager):
        _close(g, e, 1e-2)
    _close(cp.asnumpy(c2.k[1]).astype(np.float32), cp.asnumpy(c1.k[1]).astype(np.float32), 1e-2)


@gpu
def test_graph_decoder_fused_epilogues_are_bit_identical(tmp_path, monkeypatch):
    """With gemv.cu's products, the rotary + K/V append and SiLU * up ride in the QKV and gate/up
    launches (gemv_rope, gemv_glu; no rope_append or silu_mul launch in the step): the logits and
    the appended K/V are those of the same step with the two separate launches, bit for bit."""
    cp = _cupy()
    from llama_min import ops as decoder_ops
    from llama_min.backends import GemvBackend
    from llama_min.graph import GraphDecoder
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype="float16")
    steps, c1, c2 = _two_prefilled_caches(model, cfg, batch=3, prompt_len=7, n_steps=4, max_len=16, seed=6)
    calls = collections.Counter()
    for name in ("rope_append", "silu_mul", "gemv_rope", "gemv_glu"):
        def counted(*a, _f=getattr(decoder_ops, name), _n=name, **kw):
            calls[_n] += 1
            return _f(*a, **kw)
        monkeypatch.setattr(decoder_ops, name, counted)
    with GraphDecoder(model, c1, gemv=True) as gd:
        fused = [cp.asnumpy(gd.replay(t)) for t in steps]
    assert calls["gemv_rope"] > 0 and calls["gemv_rope"] == calls["gemv_glu"]
    assert calls["rope_append"] == calls["silu_mul"] == 0
    monkeypatch.setattr(GemvBackend, "fuse_epilogues", False)
    with GraphDecoder(model, c2, gemv=True) as gd:
        separate = [cp.asnumpy(gd.replay(t)) for t in steps]
    assert calls["rope_append"] > 0 and calls["silu_mul"] > 0
    for a, b in zip(fused, separate):
        np.testing.assert_array_equal(a, b)
    for layer in range(cfg["num_hidden_layers"]):
        np.testing.assert_array_equal(cp.asnumpy(c1.k[layer]), cp.asnumpy(c2.k[layer]))
        np.testing.assert_array_equal(cp.asnumpy(c1.v[layer]), cp.asnumpy(c2.v[layer]))


@gpu
def test_graph_decoder_with_programmatic_launch_is_bit_identical(tmp_path):
    """GraphDecoder's default captures santa-cupy's kernels with programmatic dependent launch (each
    overlaps its predecessor's tail) on sm_90+: the logits and the appended K/V are those of a plain
    capture, bit for bit, and the process-wide launch mode is left as it was."""
    cp = _cupy()
    from llama_min.graph import GraphDecoder
    from santa_cupy import kernels
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype="float16")
    prompt = np.random.default_rng(8).integers(0, cfg["vocab_size"], size=(1, 6))
    steps = np.random.default_rng(9).integers(0, cfg["vocab_size"], size=(4, 1))
    results, mode = [], kernels.programmatic_launch()
    for programmatic in (False, None):
        cache = model.new_cache(1, 16)
        model.prefill(prompt, cache)
        with GraphDecoder(model, cache, programmatic_launch=programmatic) as gd:    # batch 1: gemv.cu
            sm90 = int(cp.cuda.Device().compute_capability) >= 90
            assert gd.programmatic_launch == (programmatic is None and sm90)
            assert kernels.programmatic_launch() == mode
            results.append(([cp.asnumpy(gd.replay(t)) for t in steps], cp.asnumpy(cache.k[1])))
    for a, b in zip(results[0][0], results[1][0]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(results[0][1], results[1][1])


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_weights_fail_at_load_naming_the_tensor(tmp_path, bad):
    from safetensors.numpy import load_file, save_file
    make_tiny(tmp_path, wdtype="F16")
    f = tmp_path / "model.safetensors"
    tensors = load_file(str(f))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name][3, 5] = bad
    save_file(tensors, str(f))
    with pytest.raises(WeightsError, match=rf"tensor '{name}' has 1 non-finite value"):
        LlamaModel.from_pretrained(tmp_path)

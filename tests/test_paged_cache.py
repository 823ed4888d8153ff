"""llama_min on a paged KV cache (issue 18 item 2): KVCache's paged form (PagedKVCache) against the
contiguous one on the tiny random Llama of test_model, its page allocator, the CLI / bench options,
and (marker gpu) the GPU decoder and the paged rotary + K/V append."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from llama_min.generate import generate
from llama_min.model import AttentionSetting, KVCache, LlamaModel, PageAllocator, PagedKVCache
from santa_cupy import paged
from test_model import make_tiny

ATTENTIONS = {
    "dense": AttentionSetting(method="dense"),
    "santa": AttentionSetting(method="santa", samples=8, seed=3),          # few samples: any row move shows
    "santa-fixed-iid": AttentionSetting(method="santa", samples=16, sampler="iid", budget="fixed", seed=1),
    "santa-one-pass": AttentionSetting(method="santa", samples=32, budget="one_pass", seed=2),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, cfg = make_tiny(tmp_path_factory.mktemp("tiny"), H=4, KVH=2, max_pos=64)
    return LlamaModel.from_pretrained(path), cfg


def _decode_all(model, cache, prompt, steps, att):
    """Prefill `prompt` [B, T] into cache, then decode `steps` [n, B]: every step's logits, stacked."""
    out = [model.prefill(prompt, cache)]
    for t in steps:
        out.append(model.decode(t, cache, att))
    return np.stack(out)


def _close(a, b, tol):
    """Relative max error of a against b (as test_model's _close)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    err = np.max(np.abs(a - b)) / max(1e-9, np.max(np.abs(b)))
    assert err < tol, f"relative max error {err:.3g} >= {tol}"


def _tokens(cfg, B, T, n, seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, cfg["vocab_size"], (B, T)), rng.integers(0, cfg["vocab_size"], (n, B))


# ------------------------------------------------------------------ paged == contiguous


@pytest.mark.parametrize("name", ATTENTIONS)
@pytest.mark.parametrize("page_size,page_seed", [(16, None), (1, 5), (3, 7), (5, None)])
def test_paged_decode_is_the_contiguous_decode_bit_for_bit(tiny, name, page_size, page_seed):
    """Batch 2 (pages of the two sequences interleave in the pool; page_seed: in shuffled order),
    a prompt of 7 and 12 decode steps (crossing page boundaries): the same logits at every step,
    bit for bit, for dense and SANTA (same seed: the same samples)."""
    model, cfg = tiny
    att = ATTENTIONS[name]
    prompt, steps = _tokens(cfg, 2, 7, 12, seed=page_size)
    want = _decode_all(model, model.new_cache(2, 24), prompt, steps, att)
    cache = model.new_cache(2, 24, page_size=page_size, page_seed=page_seed)
    got = _decode_all(model, cache, prompt, steps, att)
    np.testing.assert_array_equal(got, want)
    assert cache.length == 19 and cache.step == 12 and list(cache.lengths) == [19, 19]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_paged_low_precision_cache_is_the_contiguous_one(tmp_path, dtype):
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=1, max_pos=32)
    model = LlamaModel.from_pretrained(path, dtype=dtype)
    prompt, steps = _tokens(cfg, 1, 5, 6, seed=4)
    for att in (ATTENTIONS["dense"], ATTENTIONS["santa"]):
        want = _decode_all(model, model.new_cache(1, 12), prompt, steps, att)
        got = _decode_all(model, model.new_cache(1, 12, page_size=4, page_seed=1), prompt, steps, att)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("name", ["dense", "santa"])
def test_paged_generate_gives_the_contiguous_tokens(tiny, name):
    model, _ = tiny
    prompt = [1, 5, 9, 3, 30, 12]
    want = generate(model, prompt, max_new_tokens=20, attention=ATTENTIONS[name])
    for page_size in (1, 4, 16, 256):
        got = generate(model, prompt, max_new_tokens=20, attention=ATTENTIONS[name], page_size=page_size)
        assert got.generated_tokens == want.generated_tokens, page_size
    assert len(want.generated_tokens) == 20


def test_paged_rows_are_what_santa_cupy_paged_gathers(tiny):
    """The cache's pages and block table, read by santa_cupy.paged.gather_pages (the library's NHD
    reference), are the contiguous cache's rows: the layout a paged decode_attention call reads."""
    model, cfg = tiny
    prompt, steps = _tokens(cfg, 3, 9, 4, seed=11)
    c, p = model.new_cache(3, 20), model.new_cache(3, 20, page_size=4, page_seed=2)
    _decode_all(model, c, prompt, steps, ATTENTIONS["dense"])
    _decode_all(model, p, prompt, steps, ATTENTIONS["dense"])
    n = c.length
    for layer in range(cfg["num_hidden_layers"]):
        for pool, contiguous in ((p.k[layer], c.k[layer]), (p.v[layer], c.v[layer])):
            rows = paged.gather_pages(pool, p.block_table, p.lengths, max_length=n, layout="NHD")
            np.testing.assert_array_equal(rows, contiguous[:, :n])
        k_rows, v_rows = p.read(layer, n)
        np.testing.assert_array_equal(k_rows[:, :n], c.k[layer][:, :n])
        np.testing.assert_array_equal(v_rows[:, :n], c.v[layer][:, :n])


def test_read_is_a_view_for_one_ascending_run_else_a_gather(tiny):
    """Batch 1 in the allocator's order (generate's case) reads the pools through a view, as the
    contiguous cache reads its arrays; a shuffled pool or a batch of 2 gathers the pages."""
    model, cfg = tiny
    for batch, seed, view in ((1, None, True), (1, 3, False), (2, None, False)):
        cache = model.new_cache(batch, 30, page_size=4, page_seed=seed)
        model.prefill(_tokens(cfg, batch, 13, 0, seed=6)[0], cache)
        k, v = cache.read(1, 13)
        assert k.shape == v.shape == (batch, 16, 2, 64)
        assert np.shares_memory(k, cache.k[1]) == np.shares_memory(v, cache.v[1]) == view


# ------------------------------------------------------------------ the allocator


def test_pages_are_allocated_lazily_round_the_batch(tiny):
    model, cfg = tiny
    cache = model.new_cache(2, 20, page_size=4)
    assert isinstance(cache, PagedKVCache) and isinstance(cache, KVCache) and cache.paged
    assert cache.k[0].shape == (2 * 5, 4, 2, 64) and cache.block_table.shape == (2, 5)
    assert cache.block_table.dtype == np.int32 and cache.attention_kwargs["block_table"] is cache.block_table
    assert cache.allocator.free == 10 and list(cache.pages_held) == [0, 0]
    prompt, steps = _tokens(cfg, 2, 5, 4, seed=0)
    model.prefill(prompt, cache)                                   # 5 rows: 2 pages each
    assert list(cache.pages_held) == [2, 2] and cache.allocator.free == 6
    assert cache.table[:, :2].tolist() == [[0, 2], [1, 3]]        # page by page round the batch
    assert not cache.table[:, 2:].any()
    model.decode(steps[0], cache)                                  # row 5: still page 1
    model.decode(steps[1], cache)                                  # row 6
    model.decode(steps[2], cache)                                  # row 7
    assert list(cache.pages_held) == [2, 2]
    model.decode(steps[3], cache)                                  # row 8: a third page
    assert list(cache.pages_held) == [3, 3] and cache.table[:, 2].tolist() == [4, 5]
    assert cache.allocator.free == 4


def test_shuffled_pool_gives_non_contiguous_tables(tiny):
    model, cfg = tiny
    cache = model.new_cache(2, 40, page_size=2, page_seed=9)
    prompt, _ = _tokens(cfg, 2, 33, 0, seed=1)
    model.prefill(prompt, cache)
    used = cache.table[:, :17]
    assert sorted(used.ravel().tolist()) == sorted(set(used.ravel().tolist()))     # no page twice
    assert np.any(np.diff(used, axis=1) != 2)                  # not the interleaved ascending order
    assert used.min() >= 0 and used.max() < cache.num_pages


def test_page_pool_exhaustion_is_a_clear_error_and_changes_nothing(tiny):
    model, cfg = tiny
    cache = model.new_cache(2, 20, page_size=4, num_pages=5)
    prompt, steps = _tokens(cfg, 2, 8, 1, seed=2)
    model.prefill(prompt, cache)                                   # 2 pages each: 4 of 5
    with pytest.raises(ValueError, match=r"page pool exhausted: 9 tokens in each of 2 sequences need 2 more "
                                         r"pages of 4 rows, 1 of 5 free"):
        model.decode(steps[0], cache)
    assert list(cache.pages_held) == [2, 2] and cache.allocator.free == 1 and cache.length == 8
    with pytest.raises(ValueError, match="page pool exhausted"):
        model.prefill(*_tokens(cfg, 2, 9, 0, seed=3)[:1], model.new_cache(2, 20, page_size=4, num_pages=4))
    with pytest.raises(ValueError, match="KV cache is full"):
        cache.reserve(21)


def test_reset_returns_every_page_and_the_cache_decodes_as_new(tiny):
    model, cfg = tiny
    cache = model.new_cache(2, 24, page_size=3, page_seed=4)
    prompt, steps = _tokens(cfg, 2, 7, 5, seed=5)
    first = _decode_all(model, cache, prompt, steps, ATTENTIONS["santa"])
    assert cache.allocator.free < cache.num_pages
    cache.reset()
    assert cache.allocator.free == cache.num_pages and not cache.pages_held.any() and not cache.table.any()
    assert cache.length == cache.step == 0 and not cache.lengths.any()
    np.testing.assert_array_equal(_decode_all(model, cache, prompt, steps, ATTENTIONS["santa"]), first)


def test_page_allocator():
    a = PageAllocator(6)
    assert a.alloc(2) == [0, 1] and a.alloc(1) == [2] and a.free == 3
    a.release([0, 1])
    assert a.alloc(3) == [0, 1, 3] and a.free == 2
    with pytest.raises(ValueError, match="3 more pages needed, 2 of 6 free"):
        a.alloc(3)
    shuffled = PageAllocator(50, seed=1).alloc(50)
    assert sorted(shuffled) == list(range(50)) and shuffled != list(range(50))


@pytest.mark.parametrize("page_size", [0, -1, 257, 2.5, True, "16"])
def test_bad_page_sizes(tiny, page_size):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"page_size must be an integer in 1\.\.256"):
        model.new_cache(1, 8, page_size=page_size)


def test_paged_options_need_a_paged_cache(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="need a paged cache"):
        model.new_cache(1, 8, num_pages=4)
    with pytest.raises(ValueError, match="num_pages must be >= 1"):
        model.new_cache(1, 8, page_size=4, num_pages=0)
    assert type(model.new_cache(1, 8)) is KVCache and not model.new_cache(1, 8).paged
    assert model.new_cache(1, 8).attention_kwargs == {} and model.new_cache(1, 8).block_table is None


# ------------------------------------------------------------------ user surface


@pytest.fixture()
def ckpt(tmp_path):
    from test_cli_generate import _write_tokenizer
    path, _, _ = make_tiny(tmp_path, H=4, KVH=2, max_pos=32)
    _write_tokenizer(path)
    return path


def _generate_json(ckpt, *extra):
    from llama_min.commands import generate as generate_cmd
    res = CliRunner().invoke(generate_cmd, [str(a) for a in ["--model", ckpt, "--prompt", "w1 w2 w3 w4",
                                                             "--max-new-tokens", 9, "--format", "json",
                                                             "--device", "cpu", *extra]])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_cli_generate_kv_cache_paged(ckpt):
    base = _generate_json(ckpt)
    assert base["kv_cache"] == {"layout": "contiguous"}
    paged_out = _generate_json(ckpt, "--kv-cache", "paged")
    assert paged_out["kv_cache"] == {"layout": "paged", "page_size": 16}
    small = _generate_json(ckpt, "--kv-cache", "paged", "--page-size", 2, "--attention", "santa", "--samples", 4)
    assert small["kv_cache"] == {"layout": "paged", "page_size": 2}
    assert paged_out["generated_tokens"] == base["generated_tokens"]
    assert small["generated_tokens"] == _generate_json(ckpt, "--attention", "santa", "--samples", 4)["generated_tokens"]


@pytest.mark.parametrize("args,match", [(["--kv-cache", "paged", "--page-size", "0"], "1<=x<=256"),
                                        (["--kv-cache", "paged", "--page-size", "257"], "1<=x<=256"),
                                        (["--page-size", "8"], "--page-size needs --kv-cache paged"),
                                        (["--kv-cache", "pages"], "contiguous")])
def test_cli_generate_bad_kv_cache_options(ckpt, args, match):
    from llama_min.commands import generate as generate_cmd
    res = CliRunner().invoke(generate_cmd, ["--model", str(ckpt), "--prompt", "w1", "--device", "cpu", *args])
    assert res.exit_code == 2 and match in res.output, res.output


@pytest.mark.parametrize("args,match", [(["--kv-cache", "paged", "--page-size", "300"], "1<=x<=256"),
                                        (["--page-size", "16"], "--page-size needs --kv-cache paged")])
def test_bench_e2e_bad_kv_cache_options(args, match):
    from santa_cupy.cli import bench
    res = CliRunner().invoke(bench.bench, ["e2e", *args])
    assert res.exit_code == 2 and match in res.output, res.output


def test_bench_e2e_paged_cache_is_shuffled_and_filled(tiny):
    """bench e2e --kv-cache paged's cache (on NumPy here): every page of the pool random, the
    context's pages reserved in shuffled order; contiguous stays as it was."""
    from santa_cupy.cli import bench
    model, _ = tiny

    class FakeCupy:                           # NumPy, with CuPy's random.standard_normal(n, dtype=)
        random = np.random.default_rng(0)

        def __getattr__(self, name):
            return getattr(np, name)

    c = bench.e2e.e2e_cache(model, 2, 40, 8)
    assert c.paged and c.page_size == 8
    bench.e2e._fill_random_kv(FakeCupy(), model, c, 33)
    assert c.length == 33 and list(c.lengths) == [33, 33] and list(c.pages_held) == [5, 5]
    assert np.all(c.k[1] != 0) and np.all(c.v[0] != 0)
    assert c.table[:, :5].tolist() != [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]
    assert not bench.e2e.e2e_cache(model, 2, 40, None).paged


# ------------------------------------------------------------------ GPU (marker gpu)

gpu = pytest.mark.gpu


def _cupy():
    from tests.gpu_util import HAVE_GPU
    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA GPU")
    import cupy
    return cupy


def _rope_append_paged_np(qkv, cos, sin, pos, k_pool, v_pool, table, heads, kv_heads, kv_dtype):
    """The paged rotary + K/V append's formula in NumPy: llama_min.reference.rope_append on
    one-row scratch caches, its rows then stored at slot pos % page_size of page
    table[n, pos // page_size] of the pools."""
    from llama_min import reference
    N, page_size = qkv.shape[0], k_pool.shape[1]
    scratch_k = np.zeros((N, int(pos.max()) + 1) + k_pool.shape[2:], k_pool.dtype)
    scratch_v = scratch_k.copy()
    q = reference.rope_append(qkv, cos, sin, pos, scratch_k, scratch_v, heads, kv_heads, kv_dtype)
    for n in range(N):
        page, slot = table[n, pos[n] // page_size], pos[n] % page_size
        k_pool[page, slot], v_pool[page, slot] = scratch_k[n, pos[n]], scratch_v[n, pos[n]]
    return q


def _paged_rope_inputs(rng, N, H, KVH, D, page_size, max_pages, product, kv_dtype):
    from santa_cupy import spec
    num_pages = N * max_pages + 3
    qkv = rng.standard_normal((N, (H + 2 * KVH) * D)).astype(np.float32)
    ang = rng.uniform(-4, 4, (max_pages * page_size, D // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    pos = rng.integers(0, max_pages * page_size, N).astype(np.int32)
    pos[0] = max_pages * page_size - 1
    table = rng.permutation(num_pages)[:N * max_pages].reshape(N, max_pages).astype(np.int32)
    pool = spec.from_float32(rng.standard_normal((2, num_pages, page_size, KVH, D)).astype(np.float32), kv_dtype, np)
    return qkv.astype(product), cos, sin, pos, table, pool


@gpu
@pytest.mark.parametrize("product", ["float32", "float16"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("N,H,KVH,D,page_size,max_pages", [(1, 1, 1, 2, 1, 3), (3, 8, 2, 64, 16, 4),
                                                            (2, 32, 8, 128, 5, 7), (4, 4, 4, 96, 256, 1)])
def test_paged_rope_append_is_its_numpy_formula(product, kv_dtype, N, H, KVH, D, page_size, max_pages):
    """decoder_ops.rope_append with block_table on shuffled pages: q and every page of both pools
    bit for bit as the NumPy formula (only the N written rows change)."""
    cp = _cupy()
    from llama_min import ops as decoder_ops
    rng = np.random.default_rng(N * D + page_size)
    qkv, cos, sin, pos, table, pool = _paged_rope_inputs(rng, N, H, KVH, D, page_size, max_pages, product, kv_dtype)
    k_ref, v_ref = pool[0].copy(), pool[1].copy()
    q_ref = _rope_append_paged_np(qkv, cos, sin, pos, k_ref, v_ref, table, H, KVH, kv_dtype)
    k, v = cp.asarray(pool[0]), cp.asarray(pool[1])
    q = decoder_ops.rope_append(*map(cp.asarray, (qkv, cos, sin, pos)), k, v, H, KVH, kv_dtype,
                                block_table=cp.asarray(table))
    for got, want in ((q, q_ref), (k, k_ref), (v, v_ref)):
        np.testing.assert_array_equal(got.get().view(np.uint8), want.view(np.uint8))


@gpu
@pytest.mark.parametrize("kv_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n", [1, 3])
def test_paged_gemv_rope_is_gemv_then_paged_rope_append(kv_dtype, n):
    cp = _cupy()
    from llama_min import ops as decoder_ops
    rng = np.random.default_rng(n)
    H, KVH, D, K = 8, 2, 64, 256
    _, cos, sin, pos, table, pool = _paged_rope_inputs(rng, n, H, KVH, D, 16, 3, "float32", kv_dtype)
    x = cp.asarray(rng.standard_normal((n, K)).astype(np.float16))
    w = cp.asarray((rng.standard_normal(((H + 2 * KVH) * D, K)) / 16).astype(np.float16))
    cos, sin, pos, table = map(cp.asarray, (cos, sin, pos, table))
    k1, v1, k2, v2 = (cp.asarray(pool[i % 2]) for i in range(4))
    q1 = decoder_ops.gemv_rope(x, w, cos, sin, pos, k1, v1, H, KVH, kv_dtype, block_table=table)
    q2 = decoder_ops.rope_append(decoder_ops.gemv(x, w), cos, sin, pos, k2, v2, H, KVH, kv_dtype, block_table=table)
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        np.testing.assert_array_equal(a.get(), b.get())


@gpu
def test_paged_rope_append_rejects_bad_tables():
    cp = _cupy()
    from llama_min import ops as decoder_ops
    f16 = cp.float16
    qkv, cs, pos = cp.zeros((2, 4 * 8), f16), cp.zeros((4, 4), cp.float32), cp.zeros(2, cp.int32)
    pool = cp.zeros((6, 4, 1, 8), f16)
    decoder_ops.rope_append(qkv, cs, cs, pos, pool, pool.copy(), 2, 1, "float16", block_table=cp.zeros((2, 3), cp.int32))
    for bad in (cp.zeros((2, 3), cp.int64), cp.zeros((3, 3), cp.int32), cp.zeros((2, 6), cp.int32)[:, ::2],
                np.zeros((2, 3), np.int32)):
        with pytest.raises(ValueError, match="block_table"):
            decoder_ops.rope_append(qkv, cs, cs, pos, pool, pool.copy(), 2, 1, "float16", block_table=bad)
    with pytest.raises(ValueError, match="rope_append needs"):                 # a page of 257 rows
        decoder_ops.rope_append(qkv, cs, cs, pos, cp.zeros((1, 257, 1, 8), f16), cp.zeros((1, 257, 1, 8), f16),
                                2, 1, "float16", block_table=cp.zeros((2, 1), cp.int32))


@gpu
@pytest.mark.parametrize("method,dtype,gemv", [("dense", "float16", None), ("santa", "float16", None),
                                               ("dense", "float32", False), ("santa", "bfloat16", False),
                                               ("dense", "float16", True)])
def test_gpu_paged_decoder_is_the_contiguous_one(tmp_path, method, dtype, gemv):
    """The GPU decoder on a paged cache (pages of 4 rows, shuffled pool, batch 2 or 1) against the
    contiguous cache: eager model.decode and a GraphDecoder replayed across page boundaries give
    the same logits and K/V rows (within the dtype's rounding; layer 0's rows, which no attention
    output feeds, bit for bit: the paged append writes what the contiguous one does), and the
    graph reads the block table at one address while replay() writes new pages into it."""
    cp = _cupy()
    from llama_min.graph import GraphDecoder
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype=dtype)
    att = AttentionSetting(method=method, samples=64, seed=3, santa_min_length=0)
    B = 1 if gemv else 2
    prompt, steps = _tokens(cfg, B, 9, 10, seed=1)
    results = {}
    for page_size in (None, 4):
        kw = {} if page_size is None else dict(page_size=page_size, page_seed=3)
        eager_cache, graph_cache = model.new_cache(B, 24, **kw), model.new_cache(B, 24, **kw)
        model.prefill(prompt, eager_cache)
        model.prefill(prompt, graph_cache)
        eager = [cp.asnumpy(model.decode(t, eager_cache, att)) for t in steps]
        table_ptr = None if page_size is None else graph_cache.block_table.data.ptr
        with GraphDecoder(model, graph_cache, att, gemv=gemv) as gd:
            graph = [cp.asnumpy(gd.replay(t)).copy() for t in steps]
        if page_size is not None:
            assert graph_cache.block_table.data.ptr == table_ptr
            assert list(graph_cache.pages_held) == [5] * B                   # 19 rows of 4
            np.testing.assert_array_equal(cp.asnumpy(graph_cache.block_table), graph_cache.table)
        rows = {(which, layer, kv): cp.asnumpy(a)[:, :19] for which, c in (("eager", eager_cache), ("graph", graph_cache))
                for layer in range(cfg["num_hidden_layers"]) for kv, a in zip("kv", c.read(layer, 19))}
        results[page_size] = (np.array(eager), np.array(graph), rows)
    (e0, g0, r0), (e1, g1, r1) = results[None], results[4]
    tol = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}[dtype]
    _close(e1, e0, tol)                        # eager: paged == contiguous
    _close(g1, g0, tol)                        # graph: paged == contiguous
    _close(g1, e1, 1e-2 if gemv else tol)      # gemv.cu (f32 out) against the eager cuBLAS step
    for key, b in r0.items():                  # the K/V rows both wrote
        a = r1[key]
        if key[1] == 0:
            np.testing.assert_array_equal(a, b)
        _close(a.astype(np.float32), b.astype(np.float32), tol)
    if method == "santa":                      # the device step counter advanced inside the graph
        assert not np.allclose(g1[0], g1[1])


@gpu
def test_gpu_paged_generate_gives_the_cpu_tokens(tmp_path):
    """generate() on the GPU with a paged cache (eager and CUDA graph) gives the CPU's greedy tokens."""
    cp = _cupy()  # noqa: F841
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=128)
    cpu = LlamaModel.from_pretrained(path)
    g = LlamaModel.from_pretrained(path, device="gpu", dtype="float32")
    prompt = list(np.random.default_rng(3).integers(0, cfg["vocab_size"], 21))
    want = generate(cpu, prompt, max_new_tokens=14).generated_tokens          # rows 21..34: pages 3, 4
    for use_graph in (False, True):
        got = generate(g, prompt, max_new_tokens=14, use_graph=use_graph, page_size=8).generated_tokens
        assert got == want, use_graph


@gpu
def test_gpu_bench_e2e_on_a_paged_cache(tmp_path):
    """bench e2e --kv-cache paged: the tiny checkpoint's decode step on a shuffled page pool through
    GraphDecoder, both methods; the JSON says which cache it timed."""
    _cupy()
    from santa_cupy.cli import bench
    path, _, _ = make_tiny(tmp_path, H=4, KVH=2, max_pos=512)
    out = tmp_path / "e2e.json"
    res = CliRunner().invoke(bench.bench, ["e2e", "--model", str(path), "--context", "300", "--steps", "3",
                                           "--warmup", "1", "--methods", "dense,santa-global-systematic-64",
                                           "--kv-cache", "paged", "--page-size", "32", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert data["meta"]["kv_cache"] == {"layout": "paged", "page_size": 32}
    rows = data["rows"]
    assert [r["method"] for r in rows] == ["dense", "santa-global-systematic-64"]
    assert all(r["ms"] > 0 and r["timing"] == "graph" and "paged KV" in r["note"] for r in rows)
    assert 0 < rows[1]["rows_frac"] <= 1

"""cuda/sample_tokens.cu (llama_min.ops.sample_tokens, TokenSampler on CuPy) against llama_min.sampling's
NumPy reference: the same token, bit for bit, at awkward vocabulary sizes, for every mode; the
distribution over many steps; inside a captured CUDA graph (GraphDecoder's sampler step) with the
device step counter and the repetition context advancing there (marker gpu)."""

import numpy as np
import pytest

from llama_min import ops
from llama_min.sampling import SamplerParams, SamplingConfig, TokenSampler, sample_reference
from tests.gpu_util import requires_gpu
from tests.test_sampling import _chi2, _softmax_counts, chi2_quantile

pytestmark = [pytest.mark.gpu, requires_gpu]

MODES = {
    "greedy": dict(greedy=True),
    "temperature": dict(greedy=False, temperature=0.8),
    "hot": dict(greedy=False, temperature=3.0),
    "top_k": dict(greedy=False, temperature=1.0, top_k=40),
    "top_k_big": dict(greedy=False, temperature=1.2, top_k=5000),
    "top_p": dict(greedy=False, temperature=1.0, top_p=0.9),
    "top_p_small": dict(greedy=False, temperature=0.7, top_p=0.05),
    "top_k_top_p": dict(greedy=False, temperature=0.9, top_k=100, top_p=0.7),
    "penalty": dict(greedy=False, temperature=1.0, top_p=0.95, repetition_penalty=1.3),
    "greedy_penalty": dict(greedy=True, repetition_penalty=1.2),
}


def _logits(rng, B, V, kind):
    if kind == "normal":
        return (rng.standard_normal((B, V)) * 3).astype(np.float32)
    if kind == "ties":                                    # exact ties everywhere, also at every cutoff
        return np.round(rng.standard_normal((B, V)) * 2).astype(np.float32)
    if kind == "peaked":                                  # a few tokens hold the mass (real models)
        l = (rng.standard_normal((B, V)) * 2).astype(np.float32)
        l[:, rng.integers(0, V, 5)] += 15
        return l
    raise ValueError(kind)


def _sample_gpu(cupy, logits, cfg, step, context=None):
    B, V = logits.shape
    s = TokenSampler(cupy, cfg, B, V, context=context)
    s.step.fill(step)
    seen = None if s.seen is None else s.seen.get()
    out = s(cupy.asarray(logits)).get()
    return out, seen, s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("V", [1000, 32000 + 7, 49152, 128256])
@pytest.mark.parametrize("kind", ["normal", "ties", "peaked"])
def test_kernel_matches_reference(mode, V, kind):
    import cupy
    rng = np.random.default_rng(V + len(mode) + len(kind))
    B = 3
    cfg = SamplingConfig(seed=7, **MODES[mode])
    context = [rng.integers(0, V, 50).tolist() for _ in range(B)]
    for step in (0, 1, 12345):
        logits = _logits(rng, B, V, kind)
        got, seen, s = _sample_gpu(cupy, logits, cfg, step, context)
        want = sample_reference(logits, SamplerParams.from_config(cfg, V), step, seen)
        np.testing.assert_array_equal(got, want, err_msg=f"{mode} V={V} {kind} step={step}")
        if s.seen is not None:                            # the chosen tokens are marked
            after = s.seen.get()
            assert all(after[b, got[b]] == 1 for b in range(B))
            assert int(after.sum()) - int(seen.sum()) == sum(int(seen[b, got[b]] == 0) for b in range(B))


def test_kernel_edge_rows():
    """V = 1, all-equal logits (greedy: index 0; sampled: any, as the reference), -inf entries."""
    import cupy
    for V in (1, 2, 1023, 1025):
        for cfg in (SamplingConfig(greedy=True), SamplingConfig(greedy=False, top_k=3, top_p=0.5, seed=1)):
            for logits in (np.zeros((2, V), np.float32), np.full((2, V), -np.inf, np.float32)):
                logits = logits.copy()
                logits[1, V // 2] = 1.0
                got, seen, _ = _sample_gpu(cupy, logits, cfg, 3)
                want = sample_reference(logits, SamplerParams.from_config(cfg, V), 3)
                np.testing.assert_array_equal(got, want, err_msg=f"V={V} {cfg}")


def test_kernel_distribution():
    """20000 device steps on one row of 12 logits: the counts against the kept softmax (chi-square
    at a false alarm rate of 1e-6, test_sampling's test of the reference)."""
    import cupy
    V, n = 12, 20000
    l = (np.random.default_rng(1).standard_normal(V)).astype(np.float32)
    for case in (dict(temperature=1.0), dict(temperature=0.5, top_k=6), dict(top_p=0.8)):
        s = TokenSampler(cupy, SamplingConfig(greedy=False, seed=2, **case), 1, V)
        logits = cupy.asarray(l[None])
        draws = []
        for _ in range(n):
            draws.append(s(logits).copy())
            s.advance()
        counts = np.bincount(cupy.concatenate(draws).get(), minlength=V)
        expect = _softmax_counts(l, n, **case)
        assert counts[expect == 0].sum() == 0, case
        chi2, dof = _chi2(counts, expect)
        assert chi2 < chi2_quantile(dof), (case, chi2, dof)


def test_kernel_in_graph_advances_its_step():
    """Captured once, replayed: each replay reads the device step counter that the graph advances,
    so the draws are the reference's at steps 0, 1, 2, ..."""
    import cupy
    V = 5000
    logits = cupy.asarray(_logits(np.random.default_rng(3), 2, V, "normal"))
    cfg = SamplingConfig(greedy=False, temperature=2.0, top_p=0.99, seed=5)
    s = TokenSampler(cupy, cfg, 2, V)
    s(logits, update=False)                               # compile outside the capture
    cupy.add(s.step, 1, out=s.step.copy())
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        s(logits)
        s.advance()
        graph = stream.end_capture()
    params = SamplerParams.from_config(cfg, V)
    host = logits.get()
    for step in range(6):
        graph.launch(stream)
        stream.synchronize()
        np.testing.assert_array_equal(s.out.get(), sample_reference(host, params, step))
    assert int(s.step.get()[0]) == 6


def test_sample_tokens_rejects_bad_operands():
    import cupy
    good = cupy.zeros((2, 10), cupy.float32)
    step, seen = cupy.zeros((1,), cupy.int64), cupy.zeros((2, 10), cupy.uint8)
    with pytest.raises(ValueError, match="float32 logits"):
        ops.sample_tokens(good.astype(cupy.float16), seen, False, False, 1.0, step, 0, True, 1.0, 0, 1 << 32)
    with pytest.raises(ValueError, match="seen"):
        ops.sample_tokens(good, seen[:, :5], True, True, 1.2, step, 0, True, 1.0, 0, 1 << 32)
    with pytest.raises(ValueError, match="step"):
        ops.sample_tokens(good, seen, False, False, 1.0, step.astype(cupy.int32), 0, True, 1.0, 0, 1 << 32)


def _tiny_gpu_model(tmp_path, dtype):
    from llama_min.model import LlamaModel
    from tests.test_model import make_tiny
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    return LlamaModel.from_pretrained(path, device="gpu", dtype=dtype), cfg


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("mode", ["greedy", "top_k_top_p", "penalty"])
def test_graph_decoder_sampler_step_matches_reference(tmp_path, dtype, mode):
    """GraphDecoder(sampler=...): each step() returns the reference's tokens for the graph's own
    logits at sampler step t with the repetition context so far; the graph feeds them back itself
    (step() without tokens), and positions, the SANTA step and the sampler step advance on device."""
    import cupy
    from llama_min.graph import GraphDecoder
    from llama_min.model import AttentionSetting
    model, cfg = _tiny_gpu_model(tmp_path, dtype)
    V, B = cfg["vocab_size"], 2
    prompt = np.random.default_rng(4).integers(0, V, size=(B, 6))
    cache = model.new_cache(B, 20)
    model.prefill(prompt, cache)
    sc = SamplingConfig(seed=9, **MODES[mode])
    sampler = TokenSampler(cupy, sc, B, V, context=prompt.tolist())
    params = SamplerParams.from_config(sc, V)
    seen = None if sampler.seen is None else sampler.seen.get()
    first = np.array([3, 4], np.int32)
    with GraphDecoder(model, cache, AttentionSetting(method="santa", samples=64, seed=1), sampler=sampler) as gd:
        tokens = first
        for t in range(8):
            got = gd.step(tokens if t == 0 else None)
            want = sample_reference(gd.logits.get(), params, t, seen)
            np.testing.assert_array_equal(got, want, err_msg=f"step {t}")
            np.testing.assert_array_equal(gd.tokens.get(), got)          # fed back inside the graph
            if seen is not None:
                seen[np.arange(B), got] = 1
                np.testing.assert_array_equal(sampler.seen.get(), seen)
            tokens = None
        assert int(sampler.step.get()[0]) == 8 and int(gd.plan.step.get()[0]) == 8
        assert cache.length == 6 + 8 and cache.lengths.get().tolist() == [14, 14]


def test_generate_graph_and_eager_sampling_agree(tmp_path):
    """generate on the GPU: the graph (sampler in the captured step) and eager decoding draw the
    same tokens for a seed on a float32 model (the same logits to cuBLAS's rounding: compared on a
    peaked tiny model where near-ties are unlikely), and greedy matches the CPU."""
    from llama_min.generate import generate
    from llama_min.model import LlamaModel
    from tests.test_model import make_tiny
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, max_pos=64)
    gpu = LlamaModel.from_pretrained(path, device="gpu", dtype="float32")
    cpu = LlamaModel.from_pretrained(path)
    prompt = [3, 17, 5, 0, 30, 8]
    sc = SamplingConfig(greedy=False, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    a = generate(gpu, prompt, max_new_tokens=10, sampling=sc, use_graph=True).generated_tokens
    b = generate(gpu, prompt, max_new_tokens=10, sampling=sc).generated_tokens
    c = generate(cpu, prompt, max_new_tokens=10, sampling=sc).generated_tokens
    assert a == b, (a, b)
    assert a == c, (a, c)          # the CPU draws with the same algorithm and uniforms
    g = generate(gpu, prompt, max_new_tokens=10, use_graph=True).generated_tokens
    assert g == generate(cpu, prompt, max_new_tokens=10).generated_tokens

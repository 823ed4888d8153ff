"""LlamaModel.decode(attention_hook=...): the seam for observing or replacing decode attention
(llama_min.model.AttentionHook), and the backend chosen at construction, on the CPU."""

import numpy as np
import pytest

from llama_min.backends import NumpyBackend
from llama_min.model import AttentionSetting, LlamaModel
from tests.gpu_util import requires_gpu
from tests.test_model import make_tiny


def _model_and_caches(tmp_path, n=2):
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)
    model = LlamaModel.from_pretrained(path)
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(2, 7))
    caches = [model.new_cache(2, 16) for _ in range(n)]
    for c in caches:
        model.prefill(prompt, c)
    return model, caches


def test_observing_hook_sees_every_layer_and_changes_nothing(tmp_path):
    model, (c1, c2) = _model_and_caches(tmp_path)
    assert isinstance(model.backend, NumpyBackend)
    seen = []

    def hook(layer, q, k, v, lengths, attend):
        seen.append((layer, q.shape, k.shape[0], lengths.tolist()))
        return attend(q, k, v, lengths)

    tokens = np.array([3, 5])
    for att in (AttentionSetting(method="dense"), AttentionSetting(method="santa", samples=64)):
        plain = model.decode(tokens, c1, att)
        hooked = model.decode(tokens, c2, att, attention_hook=hook)
        np.testing.assert_array_equal(hooked, plain)
    assert [s[0] for s in seen] == [0, 1, 0, 1]
    assert seen[0][1:] == ((2, 4, model.D), 2, [8, 8]) and seen[2][3] == [9, 9]
    assert "_eager_attention" not in vars(model)


def test_replacing_hook_changes_the_output(tmp_path):
    model, (c1, c2) = _model_and_caches(tmp_path)
    tokens = np.array([3, 5])
    plain = model.decode(tokens, c1)
    zero = model.decode(tokens, c2, attention_hook=lambda layer, q, k, v, lengths, attend: np.zeros_like(q))
    assert zero.shape == plain.shape and not np.allclose(zero, plain)
    assert c2.length == c1.length == 8 and int(c2.lengths[0]) == 8   # the step advanced as usual


@pytest.mark.gpu
@requires_gpu
def test_hook_on_the_gpu_eager_and_in_a_graph(tmp_path):
    """GPU: the hook sees the storage (cache.k[layer]) eagerly; inside a GraphDecoder it runs once,
    at capture, and an observing hook leaves the replayed logits those of the plain graph."""
    import cupy
    from llama_min.graph import GraphDecoder
    path, _, cfg = make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)
    model = LlamaModel.from_pretrained(path, device="gpu", dtype="float16")
    prompt = np.random.default_rng(0).integers(0, cfg["vocab_size"], size=(1, 7))
    caches = [model.new_cache(1, 16) for _ in range(3)]
    for c in caches:
        model.prefill(prompt, c)
    calls = []

    def hook(layer, q, k, v, lengths, attend):
        calls.append(layer)
        assert k is caches_in_use[0].k[layer]
        return attend(q, k, v, lengths)
    caches_in_use = [caches[0]]
    model.decode(np.array([3]), caches[0], attention_hook=hook)
    assert calls == [0, 1]
    steps = [np.array([t]) for t in (3, 5, 7)]
    caches_in_use[0] = caches[1]
    with GraphDecoder(model, caches[1], attention_hook=hook) as gd:
        hooked = [cupy.asnumpy(gd.replay(t)) for t in steps]
    assert calls == [0, 1, 0, 1, 0, 1]              # warm-up and capture, not per replay
    with GraphDecoder(model, caches[2]) as gd:
        plain = [cupy.asnumpy(gd.replay(t)) for t in steps]
    for a, b in zip(hooked, plain):
        np.testing.assert_array_equal(a, b)

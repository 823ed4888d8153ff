"""Driving the model for an evaluation: device choice, caches (prefill, clone), the attention
recorder on one model instance, and steppers that decode one token with a given attention.
"""

from __future__ import annotations

import numpy as np


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import cupy
        return "gpu" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no CuPy / no driver
        return "cpu"


def to_host(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.get()


def clone_cache(model, cache):
    """An independent copy of a KV cache (so every setting decodes from the same prefill)."""
    new = model.new_cache(cache.batch, cache.max_len)
    for dst, src in zip(new.k + new.v, cache.k + cache.v):
        dst[...] = src
    new.lengths[...] = cache.lengths
    new.length, new.step = cache.length, cache.step
    return new


def prefilled_cache(model, ids, max_len: int):
    """A cache of capacity max_len holding the dense prefill of ids (list of ints, non-empty)."""
    cache = model.new_cache(1, max_len)
    model.prefill(np.asarray(ids, np.int64)[None], cache)
    return cache


class AttentionRecorder:
    """An attention hook (llama_min.model.AttentionHook) that records decode-attention inputs, per layer.

        rec = AttentionRecorder()
        model.decode(tokens, cache, attention, attention_hook=rec)
        q, k_cache, v_cache, lengths = rec.calls[layer]

    ``q`` and ``lengths`` are copies; the caches are the live cache arrays (do not decode further
    on them). The attention itself is the configured one, unchanged.
    """

    def __init__(self):
        self.calls: dict[int, tuple] = {}

    def __call__(self, layer, q, k_cache, v_cache, lengths, attend):
        self.calls[layer] = (q.copy(), k_cache, v_cache, lengths.copy())
        return attend(q, k_cache, v_cache, lengths)


def decode_logits(model, cache, token: int, attention) -> np.ndarray:
    """One decode step -> host logits [V] float32."""
    return to_host(model.decode(np.asarray([token], np.int64), cache, attention)[0])


def make_stepper(model, cache, attention):
    """A Stepper: ``step(token)`` -> host logits [V] float32 after one decode step on ``cache``.

    On the GPU the step is a CUDA graph (llama_min.model.GraphDecoder, captured once per run):
    eager CuPy decoding spends ~50 ms of host time per step on a 30-layer model, the graph ~4 ms,
    which is what makes the full evaluation grid affordable. Same math, same SANTA step counter.
    Use it as a context manager: the graph's cuBLAS handle is released on exit (the retrieval
    grid builds thousands of them)."""
    return Stepper(model, cache, attention)


class Stepper:
    """One decode step at a time on a cache (see make_stepper)."""

    def __init__(self, model, cache, attention):
        self.graph = None
        if model.xp is not np:
            from llama_min.graph import GraphDecoder
            self.graph = GraphDecoder(model, cache, attention)
        self.model, self.cache, self.attention = model, cache, attention

    def __call__(self, token: int) -> np.ndarray:
        if self.graph is not None:
            return to_host(self.graph.replay(np.asarray([token], np.int32))[0])
        return decode_logits(self.model, self.cache, token, self.attention)

    def close(self):
        if self.graph is not None:
            self.graph.close()
            self.graph = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


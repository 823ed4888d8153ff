"""Driving the model for an evaluation: device choice, caches (prefill, clone), the attention
recorder on one model instance, steppers that decode one token with a given attention, the greedy
token rule, and (GPU) greedy decoders that reuse one captured step across samples (GraphGreedy),
several side by side (greedy_together).
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


def prefilled_cache(model, ids, max_len: int, chunk: int | None = None):
    """A cache of capacity max_len holding the dense prefill of ids (list of ints, non-empty), in
    chunks of `chunk` tokens (None: the model's default)."""
    cache = model.new_cache(1, max_len)
    kw = {} if chunk is None else {"chunk": int(chunk)}
    model.prefill(np.asarray(ids, np.int64)[None], cache, **kw)
    return cache


PREFILL_SCORES = 1 << 28          # float32 scores of one prefill chunk and layer: 1 GiB


def prefill_chunk(model, length: int) -> int | None:
    """The prefill chunk for a prompt of `length` tokens: on the GPU the largest power of two in
    512..4096 whose [H, chunk, length] float32 scores fit PREFILL_SCORES (the eager prefill pays
    host time per launch, ~30 launches a layer and chunk: 2048 at 8k on SmolLM2-135M takes a
    quarter of the default's launches); on the CPU None (the model's default)."""
    if model.xp is np:
        return None
    fit = PREFILL_SCORES // max(1, int(model.H) * int(length))
    c = 512
    while c * 2 <= min(fit, 4096):
        c *= 2
    return c


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


def greedy_token(logits) -> int:
    """The greedy token of host logits [V]: the largest, ties to the lowest index, -0 as +0, as the
    device sampler's greedy mode (llama_min.sampling's order_key argmax, the kernel's oracle), so
    the eager and the captured decoders pick the same token from the same logits."""
    from llama_min.sampling import order_key
    return int(np.argmax(order_key(np.asarray(logits, np.float32).reshape(-1))))


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


class _OwnsGraph:
    """close() / with-block release of the GraphDecoder in ``self.graph`` (None: nothing held)."""

    graph = None

    def close(self):
        if self.graph is not None:
            self.graph.close()
            self.graph = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Stepper(_OwnsGraph):
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




# ============================================================================ greedy decoding


def greedy_loop(step, first: int, n: int, stop_ids=(), done=None) -> list[int]:
    """Up to n greedy tokens: step(token) -> the next token (token: the one just chosen; the first
    call gets `first`). Stops at a stop id (left out), after n tokens, or once done(tokens so far)
    is true (checked on the host after every token)."""
    out, t = [], int(first)
    for _ in range(n):
        t = int(step(t))
        if t in stop_ids:
            break
        out.append(t)
        if done is not None and done(out):
            break
    return out


def is_one_pass(attention) -> bool:
    from santa_cupy import spec
    return attention.method == "santa" and attention.budget == spec.ONE_PASS


class OnePassLayers:
    """The one-pass budget on the GPU as an attention hook (llama_min.model.AttentionHook): one
    santa_cupy.DecodePlan per layer, so that each layer's hint is its own lse of the previous step
    (the plan's default hint; NaN before its first call, i.e. the exact output at the first step),
    as on the CPU (llama_min.model._santa_decode_np: each layer's hint its previous lse).
    llama_min's GPU decoder refuses this budget: its one plan for all layers would give each layer
    the previous layer's lse.

    Use it with a dense AttentionSetting, whose plan then never runs (gpu_attention): the hook
    replaces every layer's attention and, after the last layer, advances every plan's device step
    counter (captured into a CUDA graph with the rest). reset(step) before a new sequence: the step
    counters and the hints (NaN) back in place."""

    def __init__(self, model, cache, attention):
        import santa_cupy
        self.plans = [santa_cupy.DecodePlan(
            batch=cache.batch, heads=model.H, kv_heads=model.KVH, head_dim=model.D, max_length=cache.max_len,
            dtype=model.kv_dtype, method="santa", samples=attention.samples, sampler=attention.sampler,
            budget=attention.budget, seed=attention.seed, scale=float(model.scale), block_n=attention.block_n,
            step=cache.step, santa_min_length=0) for _ in range(model.cfg.num_hidden_layers)]

    def __call__(self, layer, q, k_cache, v_cache, lengths, attend):
        o = self.plans[layer].run(q, k_cache, v_cache, lengths, layer=layer, validate=False)
        if layer == len(self.plans) - 1:
            for p in self.plans:
                p.advance()
        return o

    def reset(self, step: int = 0):
        for p in self.plans:
            p.step.fill(int(step))
            p.lse.fill(np.nan)


def gpu_attention(model, cache, attention):
    """(attention config, hook) that run `attention` on the GPU decoder: the one-pass budget as
    OnePassLayers on a dense config, anything else as it is (hook None)."""
    if model.xp is np or not is_one_pass(attention):
        return attention, None
    from santa_cupy import AttentionSetting
    return AttentionSetting(method="dense", block_n=attention.block_n), OnePassLayers(model, cache, attention)


def eager_greedy(model, cache, first: int, n: int, attention, stop_ids=(), done=None) -> list[int]:
    """Greedy tokens decoding eagerly on `cache` (model.decode, host logits, greedy_token): the CPU
    path, and on the GPU the reference of GraphGreedy."""
    att, hook = gpu_attention(model, cache, attention)

    def step(t):
        logits = model.decode(np.asarray([t], np.int64), cache, att, attention_hook=hook)
        return greedy_token(to_host(logits[0]))
    return greedy_loop(step, first, n, stop_ids, done)


class GraphGreedy(_OwnsGraph):
    """Greedy decoding with one attention setting through one CUDA graph (llama_min.graph's
    GraphDecoder ending in the greedy device sampler, which picks greedy_token's token), captured
    once and replayed for every sample on the same cache.

        g = GraphGreedy(model, cache, attention)      # cache prefilled (any sample), batch 1
        toks = g.answer(n0, first, n, stop_ids, done) # after a new prefill of n0 tokens into cache

    answer() (or greedy_together, for several at once) first puts back, in place (the graph keeps
    the addresses), the cache's device lengths and host mirror (n0), the SANTA step counter(s) and
    the sampler's step (0, as after a prefill: load_prefill copies a prefill's rows in first);
    then one int32 a token comes back, on which the stop ids and done() are checked."""

    def __init__(self, model, cache, attention):
        from llama_min.graph import GraphDecoder
        from llama_min.sampling import SamplingConfig, TokenSampler
        self.cache = cache
        att, self.hook = gpu_attention(model, cache, attention)
        self.sampler = TokenSampler(model.xp, SamplingConfig(greedy=True), cache.batch, model.cfg.vocab_size)
        self.graph = GraphDecoder(model, cache, att, sampler=self.sampler, attention_hook=self.hook)

    def reset(self, n0: int):
        """The state of a fresh prefill of n0 tokens (cache rows 0 .. n0 - 1 hold it)."""
        c, g = self.cache, self.graph
        if not 1 <= n0 < c.max_len:
            raise ValueError(f"a prefill of {n0} tokens in a cache of {c.max_len} leaves no row to decode")
        with g.stream:
            c.lengths.fill(int(n0))
            g.plan.step.fill(0)
            self.sampler.step.fill(0)
            if self.hook is not None:
                self.hook.reset(0)
        c.length, c.step = int(n0), 0

    def answer(self, n0: int, first: int, n: int, stop_ids=(), done=None) -> list[int]:
        if n0 + n > self.cache.max_len:              # the n-th step writes row n0 + n - 1
            raise ValueError(f"{n0} prefilled + {n} tokens do not fit the cache (max_len {self.cache.max_len})")
        self.reset(n0)
        fed = []

        def step(t):
            tokens = None if fed else [t]          # afterwards the graph feeds its own sample back
            fed.append(t)
            return self.graph.step(tokens)[0]
        return greedy_loop(step, first, n, stop_ids, done)

    def launch(self, tokens=None):
        """One step queued on the graph's own stream (tokens: [first] at the first step, then None:
        the graph feeds its own sample back); fetch() waits for it and returns the token."""
        self.graph.replay(tokens)

    def fetch(self) -> int:
        g = self.graph
        with g.stream:
            return int(self.sampler.out.get(stream=g.stream)[0])



def load_prefill(dst, src, n0: int):
    """Rows 0 .. n0 - 1 of every layer of cache src copied into cache dst in place (a graph keeps
    dst's addresses), and dst's lengths (device, in place), length and step those of a prefill of
    n0 tokens."""
    for d, s_ in zip(dst.k + dst.v, src.k + src.v):
        d[:, :n0] = s_[:, :n0]
    dst.lengths[...] = int(n0)
    dst.length, dst.step = int(n0), 0


def greedy_together(decoders, n0: int, first: int, n: int, stop_ids=(), done=None, clock=None):
    """GraphGreedy.answer for several decoders at once, in lockstep: each decoder on its own cache
    holding the same prefill of n0 tokens (load_prefill) and its own stream. Every token, the step of
    every decoder still going is queued first, then their tokens are read back, so the GPU runs
    the settings' steps side by side (a small model's step is mostly launch latency); each decoder
    computes exactly what it would alone. A decoder stops as greedy_loop does (a stop id, n tokens,
    done(its tokens)). -> [(tokens, seconds from the start to its last token)] in decoders' order."""
    import time
    clock = clock or time.perf_counter
    for d in decoders:
        if n0 + n > d.cache.max_len:
            raise ValueError(f"{n0} prefilled + {n} tokens do not fit the cache (max_len {d.cache.max_len})")
        d.reset(n0)
    t0 = clock()
    outs = [[] for _ in decoders]
    secs = [0.0] * len(decoders)
    active = list(range(len(decoders)))
    for step in range(n):
        if not active:
            break
        for i in active:
            decoders[i].launch([int(first)] if step == 0 else None)
        going = []
        for i in active:
            t = decoders[i].fetch()
            secs[i] = clock() - t0
            if t in stop_ids:
                continue
            outs[i].append(t)
            if done is not None and done(outs[i]):
                continue
            going.append(i)
        active = going
    return list(zip(outs, secs))

"""One GPU decode step captured as a CUDA graph (GraphDecoder), optionally ending in the device
sampler, so that generation moves B int32 tokens a step to the host and nothing back.
"""

from __future__ import annotations

import gc

import numpy as np

from llama_min.backends import gpu_backend
from llama_min.kv_cache import KVCache
from llama_min.model import DENSE, AttentionHook, AttentionSetting, LlamaModel, _hooked


class GraphDecoder:
    """One GPU decode step captured as a CUDA graph (cupy.cuda.Graph).

        gd = GraphDecoder(model, cache, attention)    # after model.prefill(...)
        logits = gd.replay(tokens)                    # [B, V] f32, a static buffer (overwritten)

        gd = GraphDecoder(model, cache, attention, sampler=TokenSampler(...))
        tokens = gd.step(first_tokens)                # [B] int32 on the host: the sampled tokens
        tokens = gd.step()                            # the graph fed them back itself

    The backend (llama_min.backends) is the decoder's own, chosen here: gemv.cu's products instead
    of cuBLAS for batches of up to ops.GEMV_AUTO_TOKENS (gemv None, the default: where it measured
    faster), up to the largest gemv instance (True), or never (False); a cuBLAS handle of its own.
    programmatic_launch: capture every santa-cupy kernel with programmatic dependent launch, so each
    is scheduled while the one before it finishes (None, the default: on where the GPU has it,
    sm_90+; bit-identical results either way; cuBLAS calls stay plain). attention_hook: an
    AttentionHook captured into the graph (it runs once, at capture).

    What the graph advances on the device, every replay: the positions (cache.lengths), the SANTA
    step counter (the santa_cupy.DecodePlan's), and with a sampler its step counter (sampler.step,
    the token-sampling RNG's) and the token input (the sampled tokens are copied into it, so the
    next replay needs no upload). The host keeps only its count of steps (cache.length / step, for
    reserve() and the capacity check) and never reads any of these back.
    Static buffers: the token input and the logits output (and sampler.out).
    A paged cache's block table is read by the graph at a fixed address: replay() reserves the
    next token's page on the host first and writes it into the table in place, on the graph's stream.
    Temporaries come from a private memory pool kept alive with the graph, so no other allocation
    can reuse addresses the graph writes to."""

    def __init__(self, model: LlamaModel, cache: KVCache, attention: AttentionSetting = DENSE,
                 gemv: bool | None = None, programmatic_launch: bool | None = None, *, sampler=None,
                 attention_hook: AttentionHook | None = None):
        if model.xp is np:
            raise RuntimeError("GraphDecoder needs a model loaded with device='gpu'")
        if cache.length < 1:
            raise ValueError("GraphDecoder needs a prefilled cache")
        if cache.length >= cache.max_len:
            raise ValueError(f"KV cache is full (max_len {cache.max_len})")
        if sampler is not None and sampler.batch != cache.batch:
            raise ValueError(f"the sampler is for {sampler.batch} sequences, the cache holds {cache.batch}")
        import cupy
        from santa_cupy import kernels
        self.model, self.cache, self.attention, self.sampler = model, cache, attention, sampler
        # A blocking (non-default) stream: work on the legacy default stream, e.g. cupy.asnumpy
        # of the logits or the next token upload, waits for the replayed graph implicitly.
        self.stream = cupy.cuda.Stream(non_blocking=False)
        self.pool = cupy.cuda.MemoryPool()
        self.plan = model.make_plan(attention, cache)     # its own device step counter
        kw = cache.attention_kwargs                         # paged: block_table, whose address the graph keeps
        plan = self.plan
        attn = _hooked(lambda li, q, kc, vc, lens: plan.run(q, kc, vc, lens, layer=li, validate=False, **kw),
                       attention_hook)
        self.backend = gpu_backend(model, cache.batch, gemv)   # CuPy refuses its own cuBLAS calls in capture
        was_programmatic = kernels.programmatic_launch()
        self.programmatic_launch = kernels.set_programmatic_launch(programmatic_launch is not False)
        try:
            with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
                cache.reserve(cache.length + 1)          # paged: the page the warm-up and first replay write
                self.tokens = cupy.zeros((cache.batch,), cupy.int32)
                # Warm-up (compiles kernels, fills the private pool); writes K/V at the current
                # position, which the first replay overwrites; nothing advances, nothing is marked.
                logits = model._decode_core(self.tokens, cache, attn, self.backend)
                if sampler is not None:                  # the sampler's launches, on scratch: its kernel,
                    sampler(logits, update=False)        # the token copy and the step's add compiled
                    self.tokens.copy()[...] = sampler.out            # before the capture
                    cupy.add(sampler.step, 1, out=sampler.step.copy())
                self.stream.synchronize()
                # No garbage collection during the capture: collecting an earlier decoder's cycle
                # would free its private pool (cudaFree, which invalidates a capture) mid-capture.
                # (Disabling suffices: what is collectable now is collected after the capture; a
                # gc.collect() here would cost a full collection per decoder, and eval builds many.)
                gc_was_on = gc.isenabled()
                gc.disable()
                self.stream.begin_capture()
                try:
                    self.logits = model._decode_core(self.tokens, cache, attn, self.backend)
                    if sampler is not None:
                        sampler(self.logits)             # -> sampler.out, marks the repetition context
                        self.tokens[...] = sampler.out   # the next replay's input
                        sampler.advance()                # its device step counter
                    cache.lengths += 1                   # on device, inside the graph
                    self.plan.advance()                  # the SANTA step counter
                finally:
                    self.graph = self.stream.end_capture()
                    if gc_was_on:
                        gc.enable()
            self.stream.synchronize()
        except BaseException:
            self.backend.close()
            raise
        finally:
            kernels.set_programmatic_launch(was_programmatic)

    def close(self):
        """Release the graph, its memory pool and the cuBLAS handle (also on garbage collection)."""
        self.backend.close()
        self.graph = None
        if self.pool is not None:
            self.pool.free_all_blocks()          # now, not whenever a collector reaches the pool
        self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def replay(self, tokens=None):
        """tokens [B] (host or device ints; None: what the input holds, i.e. with a sampler the
        tokens it sampled at the previous replay) -> logits [B, V] float32 (static device buffer)."""
        import cupy
        c = self.cache
        if c.length >= c.max_len:
            raise ValueError(f"KV cache is full (max_len {c.max_len})")
        with self.stream:
            c.reserve(c.length + 1)             # paged: a new page at a boundary, into the table in place
            if isinstance(tokens, cupy.ndarray):
                self.tokens[...] = tokens.astype(cupy.int32).reshape(-1)
            elif tokens is not None:
                self.tokens.set(np.asarray(tokens, dtype=np.int32).reshape(-1))
            self.graph.launch(self.stream)
        c.advance(on_device=False)              # the graph advanced the device's counters
        return self.logits

    def step(self, tokens=None) -> np.ndarray:
        """One replay ending in the sampler -> the sampled tokens [B] int32 (host): the one copy a
        step to the host. tokens: as for replay (None: the graph's own previous sample)."""
        if self.sampler is None:
            raise RuntimeError("GraphDecoder.step needs a sampler (GraphDecoder(..., sampler=...))")
        self.replay(tokens)
        with self.stream:
            return self.sampler.out.get(stream=self.stream)

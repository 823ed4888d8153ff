"""The tensor-parallel decoders: run_ranks (one thread a rank), TensorParallelDecoder (eager, CPU or
GPU) and TensorParallelGraphDecoder (one CUDA graph a rank)."""

from __future__ import annotations

import threading

import numpy as np

from llama_min.tensor_parallel.backend import ShardedBackend
from llama_min.tensor_parallel.comms import FakeGroup
from llama_min.tensor_parallel.ranks import rank_model
from llama_min.tensor_parallel.sharding import shard_plan


def run_ranks(fn, n: int, abort=None):
    """fn(rank) on n threads at once (collectives wait for every rank) -> [result of each rank].
    The first exception is re-raised after every thread ended; abort() (e.g. FakeGroup.abort) is
    called on the first failure so that ranks waiting in a collective stop too."""
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:        # noqa: BLE001  (re-raised below, in the caller's thread)
            errors[r] = e
            if abort is not None:
                abort()

    if n == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class TensorParallelDecoder:
    """Eager tensor-parallel decoding: one rank model, cache and communicator a rank; each step runs
    LlamaModel._decode_core on every rank at once (one thread a rank) over a ShardedBackend.

        dec = TensorParallelDecoder.from_model(model, tp=4, batch=1, max_len=64)   # CPU: FakeGroup
        dec.prefill(prompt_ids)                   # LlamaModel.prefill on every rank (chunks)
        logits = dec.decode(tokens, attention)    # [B, V] float32, rank 0's (every rank has them)

    On the GPU build the rank models under their devices and pass NcclCommunicators (devices: the
    rank's device id each, used as the current device of its thread)."""

    def __init__(self, models, comms, caches, devices=None, lm_head: str = "gather", abort=None):
        self.models, self.comms, self.caches = list(models), list(comms), list(caches)
        self.tp = len(self.models)
        if not (len(self.comms) == len(self.caches) == self.tp):
            raise ValueError("one model, communicator and cache a rank")
        self.plan = self.models[0].tp_plan
        self.devices = devices
        self.abort = abort
        self.backends = [ShardedBackend(m.backend, c, self.plan, r, lm_head)
                         for r, (m, c) in enumerate(zip(self.models, self.comms))]
        for m, c in zip(self.models, self.comms):
            m.comm = c                                # the prefill's collectives

    @classmethod
    def from_model(cls, model, tp: int, batch: int = 1, max_len: int | None = None, lm_head: str = "gather",
                   align: int = 1, group: FakeGroup | None = None):
        """CPU: the rank models of a NumPy LlamaModel and a FakeGroup of tp ranks."""
        if model.xp is not np:
            raise ValueError("from_model builds the CPU decoder (FakeGroup); on the GPU use NcclCommunicator "
                             "(santa-cupy bench e2e --tp builds one)")
        plan = shard_plan(model.cfg, tp, align)
        group = group or FakeGroup(tp)
        models = [rank_model(model, plan, r) for r in range(tp)]
        caches = [m.new_cache(batch, max_len) for m in models]
        return cls(models, list(group.communicators), caches, lm_head=lm_head, abort=group.abort)

    def _on_ranks(self, fn):
        if self.devices is None:
            return run_ranks(fn, self.tp, self.abort)
        import cupy

        def on_device(r):
            with cupy.cuda.Device(self.devices[r]):
                return fn(r)
        return run_ranks(on_device, self.tp, self.abort)

    def _check_tokens(self, tokens):
        B = self.caches[0].batch
        t = np.asarray(tokens).reshape(-1) if not hasattr(tokens, "get") else tokens.get().reshape(-1)
        if t.shape[0] != B or t.dtype.kind not in "iu":
            raise ValueError(f"tokens must be [B={B}] integers, got {t.dtype} {t.shape}")
        if t.size and (t.min() < 0 or t.max() >= self.plan.vocab):
            raise ValueError(f"token ids must be in 0..{self.plan.vocab - 1}")
        return t.astype(np.int32)

    def decode(self, tokens, attention=None, attention_hook=None):
        """One step on every rank: tokens [B] -> rank 0's result ([B, V] float32 logits, or with
        lm_head="argmax" the greedy tokens [B] int32). attention_hook(rank, layer, q, k, v, lengths,
        attend) observes or replaces a rank's attention (its local heads)."""
        from llama_min.model import _hooked
        from santa_cupy import AttentionSetting

        attention = attention or AttentionSetting()
        t = self._check_tokens(tokens)
        for c in self.caches:
            if c.length >= c.max_len:
                raise ValueError(f"KV cache is full (max_len {c.max_len})")

        def step(r):
            m, cache = self.models[r], self.caches[r]
            cache.reserve(cache.length + 1)
            hook = None if attention_hook is None else (
                lambda li, q, k, v, lens, attend: attention_hook(r, li, q, k, v, lens, attend))
            attn = _hooked(m._eager_attention(attention, cache), hook)
            out = m._decode_core(m.xp.asarray(t), cache, attn, self.backends[r])
            cache.advance()
            return out
        return self._on_ranks(step)[0]

    def prefill(self, token_ids, chunk: int | None = None):
        """token_ids [B, T] appended on every rank (LlamaModel.prefill in chunks, its O / down
        products and embedding all-reduced, the logits gathered) -> the last position's logits
        [B, V] float32 (rank 0's)."""
        from llama_min.model import CHUNK

        ids = np.asarray(token_ids)
        return self._on_ranks(lambda r: self.models[r].prefill(ids, self.caches[r], chunk or CHUNK))[0]

    def prefill_by_decoding(self, token_ids):
        """token_ids [B, T] appended token by token (decode steps, exact attention; the SANTA step
        counter left where it was, as prefill leaves it) -> the last position's logits."""
        from santa_cupy import AttentionSetting

        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[0] != self.caches[0].batch or ids.shape[1] < 1:
            raise ValueError(f"token_ids must be [B={self.caches[0].batch}, T>=1], got shape {ids.shape}")
        steps = [c.step for c in self.caches]
        out = None
        for j in range(ids.shape[1]):
            out = self.decode(ids[:, j], AttentionSetting(method="dense"))
        for c, s in zip(self.caches, steps):
            c.step = s
        return out

    def close(self):
        for b in self.backends:
            b.close()


class TensorParallelGraphDecoder:
    """One decode step of every rank captured as one CUDA graph per rank (the NCCL all-reduces and
    the all-gather inside), replayed from the host thread: each rank's graph is launched on its
    stream under its device, the collectives synchronise the GPUs among themselves.

        dec = TensorParallelGraphDecoder(models, comms, caches, devices, attention)   # caches filled
        logits = dec.replay(tokens)        # rank 0's [B, V] float32 (a static buffer)

    Construction, per rank in its own thread: the backend (gpu_backend wrapped in a ShardedBackend),
    the rank's DecodePlan (head_offset: its first global head), a warm-up step (all ranks at once:
    compiles the kernels, fills the private pool, connects NCCL), then, after every rank's warm-up
    ended, the capture (thread-local capture mode; the garbage collector off meanwhile). Like
    GraphDecoder the graph advances the positions and the SANTA step counter itself."""

    def __init__(self, models, comms, caches, devices, attention=None, gemv=None, lm_head: str = "gather",
                 programmatic_launch: bool | None = None):
        import gc

        import cupy

        from llama_min.backends import gpu_backend
        from santa_cupy import AttentionSetting
        from santa_cupy import kernels

        self.models, self.comms, self.caches, self.devices = list(models), list(comms), list(caches), list(devices)
        self.tp = len(self.models)
        self.attention = attention or AttentionSetting()
        self.plan_tp = self.models[0].tp_plan
        for c in self.caches:
            if c.length < 1 or c.length >= c.max_len:
                raise ValueError("TensorParallelGraphDecoder needs filled caches with room for a step")
        n = self.tp
        self.streams, self.pools, self.plans = [None] * n, [None] * n, [None] * n
        self.backends, self.tokens, self.logits, self.graphs = [None] * n, [None] * n, [None] * n, [None] * n

        def setup_and_warm(r):
            m, cache = self.models[r], self.caches[r]
            self.streams[r] = cupy.cuda.Stream(non_blocking=False)
            self.pools[r] = cupy.cuda.MemoryPool()
            self.plans[r] = m.make_plan(self.attention, cache)
            self.backends[r] = ShardedBackend(gpu_backend(m, cache.batch, gemv), self.comms[r], self.plan_tp, r,
                                              lm_head)
            with cupy.cuda.using_allocator(self.pools[r].malloc), self.streams[r]:
                cache.reserve(cache.length + 1)
                self.tokens[r] = cupy.zeros((cache.batch,), cupy.int32)
                m._decode_core(self.tokens[r], cache, self._attn(r), self.backends[r])
            self.streams[r].synchronize()

        def capture(r):
            m, cache, stream = self.models[r], self.caches[r], self.streams[r]
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeThreadLocal", None)
            with cupy.cuda.using_allocator(self.pools[r].malloc), stream:
                stream.begin_capture(*(() if mode is None else (mode,)))
                try:
                    self.logits[r] = m._decode_core(self.tokens[r], cache, self._attn(r), self.backends[r])
                    cache.lengths += 1
                    self.plans[r].advance()
                finally:
                    self.graphs[r] = stream.end_capture()
            stream.synchronize()

        # programmatic dependent launch of santa-cupy's kernels as GraphDecoder's (None: on where the
        # GPU has it); the flag is process-wide, so it is set once here for every rank's capture
        was_programmatic = kernels.programmatic_launch()
        with cupy.cuda.Device(self.devices[0]):
            self.programmatic_launch = kernels.set_programmatic_launch(programmatic_launch is not False)
        try:
            self._run(setup_and_warm)
            gc.collect()
            was_on = gc.isenabled()
            gc.disable()
            try:
                self._run(capture)
            finally:
                if was_on:
                    gc.enable()
        except BaseException:
            self.close()
            raise
        finally:
            kernels.set_programmatic_launch(was_programmatic)

    def _attn(self, r):
        plan, kw = self.plans[r], self.caches[r].attention_kwargs
        return lambda li, q, kc, vc, lens: plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)

    def _run(self, fn):
        import cupy

        def on_device(r):
            with cupy.cuda.Device(self.devices[r]):
                return fn(r)
        return run_ranks(on_device, self.tp)

    def replay(self, tokens=None):
        """tokens [B] host ints (None: what the inputs hold) -> rank 0's logits (static buffer)."""
        import cupy
        for c in self.caches:
            if c.length >= c.max_len:
                raise ValueError(f"KV cache is full (max_len {c.max_len})")
        t = None if tokens is None else np.asarray(tokens, np.int32).reshape(-1)
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]), self.streams[r]:
                self.caches[r].reserve(self.caches[r].length + 1)
                if t is not None:
                    self.tokens[r].set(t, stream=self.streams[r])
                self.graphs[r].launch(self.streams[r])
        for c in self.caches:
            c.advance(on_device=False)
        return self.logits[0]

    def synchronize(self):
        import cupy
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]):
                self.streams[r].synchronize()

    def close(self):
        """Release the graphs, the private pools and the cuBLAS handles (each under its device)."""
        import cupy
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]):
                if self.backends[r] is not None:
                    self.backends[r].close()
                self.graphs[r] = None
                if self.pools[r] is not None:
                    self.pools[r].free_all_blocks()
        self.backends = [None] * self.tp

"""``bench e2e --tp N``: the decode step tensor-parallel over N GPUs of this host
(llama_min.tensor_parallel: one CUDA graph per rank with its NCCL all-reduces, NcclCommunicator,
NCCL_NVLS_ENABLE=0), a random model of ``--shape`` built shard by shard on the GPUs: ms/token, the
byte floor per GPU (the rank's weights and KV) and the collectives' time alone.
"""

from __future__ import annotations

import math
import os

import click

from santa_cupy.cli.bench.e2e import (E2E_ITEMSIZE, ModelShape, _fill_random_kv, e2e_cache, e2e_derived,
                                      random_model_config, random_weights)
from santa_cupy.cli.bench.report import _log, e2e_table, fmt_bytes, write_outputs
from santa_cupy.cli.bench.timing import measure_ceiling

def tp_plan(m: ModelShape, tp: int):
    """The llama_min.tensor_parallel ShardPlan of a shape (ValueError naming the valid degrees)."""
    from llama_min.tensor_parallel import shard_plan
    return shard_plan(dict(heads=m.heads, kv_heads=m.kv_heads, head_dim=m.head_dim, intermediate=m.intermediate,
                           vocab=m.vocab), tp, align=8)


def tp_bytes(m: ModelShape, B: int, L: int, tp: int) -> dict:
    """Byte floor of one decode step per GPU at TP=tp: the rank's weights read once (its layers'
    shards, the norms, its lm-head slice, one embedding row per sequence) and its K + V (its KV
    heads: KVH / tp, or one replicated head when tp > KVH) at length L. tp = 1 is e2e_bytes."""
    from llama_min.tensor_parallel import rank_weight_shapes
    plan = tp_plan(m, tp)
    d, D = m.hidden, m.head_dim
    shapes = rank_weight_shapes(plan, d)
    per_layer = sum(N * K for name, (N, K) in shapes.items() if name != "lm_head") * E2E_ITEMSIZE + 2 * d * 4
    weights = m.layers * per_layer + math.prod(shapes["lm_head"]) * E2E_ITEMSIZE + d * 4 + B * d * E2E_ITEMSIZE
    kv = m.layers * 2 * B * L * plan.kv_heads_per_rank * D * E2E_ITEMSIZE
    return {"weights": weights, "kv": kv, "total": weights + kv, "tp": tp,
            "kv_replicas": plan.replicas}


def tp_memory(m: ModelShape, B: int, L_max: int, tp: int) -> int:
    """Device memory a GPU holds at TP=tp: its weights with its embedding slice, KV, rotary tables."""
    plan = tp_plan(m, tp)
    return tp_bytes(m, B, L_max, tp)["total"] + plan.vocab_per_rank * m.hidden * E2E_ITEMSIZE + L_max * m.head_dim * 4


def tp_collective_sizes(m: ModelShape, B: int, tp: int) -> dict:
    """The collectives of one TP step: all-reduces of [B, d] float32 (two a layer, one for the
    embedding) and one all-gather of the [B, V / tp] float32 logit slices."""
    plan = tp_plan(m, tp)
    return {"all_reduce": 2 * m.layers + 1, "all_reduce_bytes": B * m.hidden * 4,
            "all_gather_bytes": B * plan.vocab_per_rank * 4}


def check_gpus(cp, tp: int) -> int:
    """The visible GPU count, or a click error when fewer than tp."""
    n = cp.cuda.runtime.getDeviceCount()
    if n < tp:
        raise click.ClickException(f"--tp {tp} needs {tp} GPUs, {n} visible (CUDA_VISIBLE_DEVICES="
                                   f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
    return n


def random_tp_llama(cp, m: ModelShape, tp: int, B: int, L: int, L_max: int, page_size: int | None = None):
    """-> (rank models, caches), rank r's on GPU r: random fp16 weights of the rank's shard shapes
    generated on its GPU (never a whole model anywhere), its cache of random K/V at L tokens."""
    from llama_min.tensor_parallel import make_rank_model, rank_weight_shapes

    plan = tp_plan(m, tp)
    cfg = random_model_config(m, L_max, "bench e2e --tp (random weights)")
    shapes = rank_weight_shapes(plan, m.hidden)
    models, caches = [], []
    for r in range(tp):
        with cp.cuda.Device(r):
            weights = random_weights(cp, m.layers, m.hidden, shapes)
            model = make_rank_model(cfg, plan, r, weights, cp, "gpu", "float16", "float16")
            cache = e2e_cache(model, B, L_max, page_size)
            _fill_random_kv(cp, model, cache, L)
            cp.cuda.Device().synchronize()
        models.append(model)
        caches.append(cache)
    return models, caches


def _time_tp(cp, run, dec, steps, warmup):
    """Median and min ms of single TP steps: events on rank 0's stream around one replay, every
    rank's stream synchronised after each (rank 0 ends with the all-gather, which waits for all)."""
    import statistics

    for _ in range(warmup):
        run()
        dec.synchronize()
    times = []
    with cp.cuda.Device(dec.devices[0]):
        start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(steps):
        with cp.cuda.Device(dec.devices[0]):
            start.record(dec.streams[0])
        run()
        with cp.cuda.Device(dec.devices[0]):
            end.record(dec.streams[0])
        dec.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), min(times)


class _CollectivesOnly:
    """The step's collectives alone (tp_collective_sizes), captured as one graph per rank: what the
    all-reduces and the all-gather cost in the step, without the rest. Exposes what _time_tp needs
    (devices, streams, synchronize) besides replay."""

    def __init__(self, cp, comms, devices, sizes):
        from llama_min.tensor_parallel import run_ranks

        self.cp, self.devices, n = cp, list(devices), len(devices)
        self.streams, self.graphs, self.pools = [None] * n, [None] * n, [None] * n
        self.buffers, self.gathered = [None] * n, [None] * n
        count = sizes["all_reduce"]

        def collectives(r):
            x, y = self.buffers[r]
            for _ in range(count):
                comms[r].all_reduce_sum(x)
            self.gathered[r] = comms[r].all_gather(y)

        def eager(r):                            # buffers, and one round (connects NCCL): nothing captured
            with cp.cuda.Device(self.devices[r]):
                self.streams[r] = cp.cuda.Stream(non_blocking=False)
                self.pools[r] = cp.cuda.MemoryPool()
                with cp.cuda.using_allocator(self.pools[r].malloc), self.streams[r]:
                    self.buffers[r] = (cp.zeros((sizes["all_reduce_bytes"] // 4,), cp.float32),
                                       cp.zeros((sizes["all_gather_bytes"] // 4,), cp.float32))
                    collectives(r)
                self.streams[r].synchronize()

        def capture(r):
            with cp.cuda.Device(self.devices[r]):
                stream = self.streams[r]
                mode = getattr(cp.cuda.runtime, "streamCaptureModeThreadLocal", None)
                with cp.cuda.using_allocator(self.pools[r].malloc), stream:
                    stream.begin_capture(*(() if mode is None else (mode,)))
                    try:
                        collectives(r)
                    finally:
                        self.graphs[r] = stream.end_capture()
                stream.synchronize()

        run_ranks(eager, n)
        run_ranks(capture, n)

    def replay(self):
        for r, d in enumerate(self.devices):
            with self.cp.cuda.Device(d):
                self.graphs[r].launch(self.streams[r])

    def synchronize(self):
        for r, d in enumerate(self.devices):
            with self.cp.cuda.Device(d):
                self.streams[r].synchronize()


def _e2e_tp_rows(cp, models, caches, comms, L, steps, warmup, methods, gemv=None, programmatic=True):
    """Time the TP step for each method over the same shards and caches (reset to L tokens)."""
    from santa_cupy import AttentionSetting
    from llama_min.tensor_parallel import TensorParallelGraphDecoder

    devices = list(range(len(models)))
    B = caches[0].batch
    rows = []
    for m in methods:
        for r, c in enumerate(caches):
            with cp.cuda.Device(r):
                c.lengths[...] = L
                c.length, c.step = L, 0
        att = AttentionSetting(method=m.kind, **({} if m.kind == "dense" else
                              dict(samples=m.samples, sampler=m.sampler, budget=m.budget, santa_min_length=0)))
        dec = TensorParallelGraphDecoder(models, comms, caches, devices, att, gemv=gemv,
                                         programmatic_launch=programmatic)
        tokens = [1] * B
        ms, ms_min = _time_tp(cp, lambda: dec.replay(tokens), dec, steps, warmup)
        rows.append({"method": m.name, "B": B, "L": L, "ms": ms, "ms_min": ms_min, "timing": "graph",
                     "tp": len(models), "programmatic": dec.programmatic_launch})
        dec.close()
        for r in devices:
            with cp.cuda.Device(r):
                cp.cuda.Device().synchronize()
    return rows


def _e2e_tp(cp, shape, tp, batch, L, L_max, steps, warmup, method_objs, gemv, page_size, meta, json_path,
            markdown_path, programmatic=True):
    from llama_min.tensor_parallel import NcclCommunicator

    check_gpus(cp, tp)
    _log("measuring the streaming-read ceiling (GPU 0) ...")
    ceiling = measure_ceiling(cp)
    _log(f"generating the {tp} shards' random weights and KV caches ({fmt_bytes(tp_memory(shape, batch, L_max, tp))} "
         "a GPU) ...")
    models, caches = random_tp_llama(cp, shape, tp, batch, L, L_max, page_size)
    comms = NcclCommunicator.create_all(list(range(tp)))
    try:
        rows = _e2e_tp_rows(cp, models, caches, comms, L, steps, warmup, method_objs, gemv, programmatic)
        sizes = tp_collective_sizes(shape, batch, tp)
        coll = _CollectivesOnly(cp, comms, list(range(tp)), sizes)
        coll_ms, coll_min = _time_tp(cp, coll.replay, coll, steps, warmup)
    finally:
        for c in comms:
            c.close()
    floor = tp_bytes(shape, batch, L, tp)
    note = f"TP={tp} over NCCL (NVLS off), random weights, random KV, no prefill"
    if floor["kv_replicas"] > 1:
        note += f", KV heads replicated x{floor['kv_replicas']}"
    for r in rows:
        r["note"] = note
        r["collectives_ms"] = coll_ms
    meta["tp"] = tp
    meta["programmatic_launch"] = bool(rows and rows[0].get("programmatic"))
    meta["collectives"] = dict(sizes, ms=coll_ms, ms_min=coll_min,
                               what="the step's all-reduces and all-gather alone, one graph per rank")
    meta["byte_floor"] = floor
    meta["byte_floor_text"] = (f"per GPU at TP={tp}: weights {fmt_bytes(floor['weights'])} + KV {fmt_bytes(floor['kv'])} "
                               f"at context {L} = {fmt_bytes(floor['total'])} a step; collectives alone "
                               f"{coll_ms:.3f} ms ({sizes['all_reduce']} all-reduces of {sizes['all_reduce_bytes']} B, "
                               f"an all-gather of {sizes['all_gather_bytes']} B a rank)")
    meta["timing"] = (f"median of {steps} single-step replays (every rank's graph launched, all synchronised) after "
                      f"{warmup} warm-up replays; events on rank 0's stream")
    e2e_derived(rows, ceiling["read_tbps"], floor["total"])
    write_outputs(meta, ceiling, rows, e2e_table(rows), json_path=json_path, markdown_path=markdown_path)



"""Tensor-parallel decoding on GPUs (marker gpu): the kernels' head_offset (one GPU), the TP step
with ranks sharing one GPU through a FakeGroup (one GPU), and over NCCL on several GPUs (multi_gpu:
skipped below 2 GPUs): NcclCommunicator's collectives, eager and graph-captured, TP=N against TP=1
within rounding, rank-invariant SANTA counts across devices.

Run on a machine with several GPUs with NCCL_NVLS_ENABLE=0 in the environment (llama_min's
NcclCommunicator sets it itself when unset; NVLink multicast is never used)."""

import os

import numpy as np
import pytest

from santa_cupy import AttentionSetting
from llama_min.tensor_parallel import (FakeGroup, NcclCommunicator, TensorParallelDecoder, TensorParallelGraphDecoder,
                                       rank_models_on_gpus, run_ranks, shard_plan)
from tests.gpu_util import HAVE_GPU, requires_gpu
from tests.test_tp import random_config, random_weights

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")


def _gpu_count() -> int:
    if not HAVE_GPU:
        return 0
    import cupy
    return cupy.cuda.runtime.getDeviceCount()


N_GPUS = _gpu_count()
pytestmark = [pytest.mark.gpu, requires_gpu]
multi_gpu = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 or more GPUs")
TP_DEGREES = [t for t in (2, 4, 8) if t <= N_GPUS]

B, H, D = 2, 8, 64
PROMPT = np.array([[3, 17, 5, 60, 2, 44], [9, 1, 33, 33, 7, 0]])


def _inputs(KVH, L=700, dtype="bfloat16", seed=0):
    from santa_cupy import spec
    rng = np.random.default_rng(seed)
    conv = lambda x: spec.from_float32(x.astype(np.float32), dtype, np)     # noqa: E731
    q = conv(rng.standard_normal((B, H, 128)) * 1.5)
    k = conv(rng.standard_normal((B, L, KVH, 128)))
    v = conv(rng.standard_normal((B, L, KVH, 128)))
    return q, k, v, np.array([L, 333], np.int32)


def _split(q, k, v, plan, r):
    qh, kvh = plan.query_heads(r), plan.kv_heads_of(r)
    return (np.ascontiguousarray(q[:, qh.start:qh.stop]), np.ascontiguousarray(k[:, :, kvh.start:kvh.stop]),
            np.ascontiguousarray(v[:, :, kvh.start:kvh.stop]), qh.start)


# ------------------------------------------------------------------ one GPU: the kernels' head_offset


@pytest.mark.parametrize("KVH,tp", [(8, 2), (8, 8), (2, 4), (2, 8)])
@pytest.mark.parametrize("budget", ["global", "largest_remainder", "fixed"])
def test_gpu_counts_with_head_offset_are_tp1s(KVH, tp, budget):
    """decode_attention(return_counts=True) on the GPU, rank by rank with head_offset: the counts of
    the whole model's heads, bit for bit."""
    import cupy

    from santa_cupy import decode_attention
    q, k, v, lengths = _inputs(KVH)
    kw = dict(samples=64, budget=budget, seed=3, step=2, layer=1, santa_min_length=0)
    _, full = decode_attention(*(cupy.asarray(a) for a in (q, k, v, lengths)), return_counts=True, **kw)
    full = full.counts.get()
    plan = shard_plan(dict(heads=H, kv_heads=KVH, head_dim=128, intermediate=8, vocab=8), tp)
    parts = []
    for r in range(tp):
        qr, kr, vr, h0 = _split(q, k, v, plan, r)
        _, info = decode_attention(*(cupy.asarray(a) for a in (qr, kr, vr, lengths)), return_counts=True,
                                   head_offset=h0, **kw)
        parts.append(info.counts.get())
    assert np.array_equal(np.concatenate(parts, 1), full)


@pytest.mark.parametrize("KVH,tp", [(8, 4), (2, 8)])
def test_gpu_warp_pipeline_and_one_pass_rank_invariant(KVH, tp):
    """The warp pipeline's output (santa_tile_warp keys the heads) and the one-pass budget's rows
    drawn, rank by rank with head_offset, equal the whole model's (o within the rounding of another
    group size; rows drawn exactly)."""
    import cupy

    from santa_cupy import decode_attention
    q, k, v, lengths = _inputs(KVH, dtype="float16")
    dev = [cupy.asarray(a) for a in (q, k, v, lengths)]
    kw = dict(samples=64, seed=4, step=1, layer=2, santa_min_length=0, return_info=True)
    o_full, _ = decode_attention(*dev, **kw)
    hint = cupy.full((B, H), 3.0, cupy.float32)
    one_pass = dict(budget="one_pass", seed=4, santa_min_length=0, return_info=True)
    _, op_full = decode_attention(*dev, lse_hint=hint, **one_pass)
    plan = shard_plan(dict(heads=H, kv_heads=KVH, head_dim=128, intermediate=8, vocab=8), tp)
    for r in range(tp):
        qr, kr, vr, h0 = _split(q, k, v, plan, r)
        dr = [cupy.asarray(a) for a in (qr, kr, vr, lengths)]
        hs = slice(h0, h0 + plan.heads_per_rank)
        o, _ = decode_attention(*dr, head_offset=h0, **kw)
        np.testing.assert_allclose(o.get().astype(np.float32), o_full[:, hs].get().astype(np.float32),
                                   rtol=2e-3, atol=2e-3)
        _, op = decode_attention(*dr, lse_hint=cupy.ascontiguousarray(hint[:, hs]), head_offset=h0, **one_pass)
        assert np.array_equal(op.samples_drawn.get(), op_full.samples_drawn[:, hs].get())


# ------------------------------------------------------------------ one GPU: ranks in threads, FakeGroup


def _gpu_models(tp, KVH, devices, dtype="float32", seed=0, **shape):
    cfg = random_config(H=H, KVH=KVH, D=D, d=128, inter=200, vocab=97, max_pos=64, **shape)
    w = random_weights(cfg, seed)
    plan = shard_plan(cfg, tp, align=8)
    return rank_models_on_gpus(cfg, w, plan, devices, dtype, dtype)


def _run(dec, attention, steps=4):
    first = dec.prefill(PROMPT)
    logits, tokens = [first.get()], [first.get().argmax(-1)]
    for _ in range(steps):
        out = dec.decode(tokens[-1], attention)
        logits.append(out.get())
        tokens.append(logits[-1].argmax(-1))
    return np.stack(logits), np.stack(tokens)


ATT = {"dense": AttentionSetting(method="dense"),
       "santa": AttentionSetting(method="santa", samples=64, seed=5, santa_min_length=0)}


@pytest.mark.parametrize("attention", list(ATT))
@pytest.mark.parametrize("KVH", [8, 2])
def test_tp_on_one_gpu_matches_tp1(attention, KVH):
    """TP=2, 4, 8 ranks sharing GPU 0 (FakeGroup of CuPy arrays, eager) against TP=1: greedy tokens
    equal, logits within float32 rounding."""
    import cupy

    ref = None
    for tp in (1, 2, 4, 8):
        group = FakeGroup(tp)
        models = _gpu_models(tp, KVH, [0] * tp)
        caches = [m.new_cache(B, 32) for m in models]
        dec = TensorParallelDecoder(models, group.communicators, caches, devices=[0] * tp, abort=group.abort)
        with cupy.cuda.Device(0):
            got = _run(dec, ATT[attention])
        dec.close()
        if ref is None:
            ref = got
            continue
        assert np.array_equal(got[1], ref[1]), tp
        assert np.abs(got[0] - ref[0]).max() <= 1e-4 * np.abs(ref[0]).max(), tp


# ------------------------------------------------------------------ several GPUs: NCCL


@pytest.fixture(scope="module")
def comms():
    if N_GPUS < 2:
        pytest.skip("needs 2 or more GPUs")
    cs = NcclCommunicator.create_all(list(range(N_GPUS)))
    yield cs
    for c in cs:
        c.close()


@multi_gpu
def test_nccl_environment_and_collectives(comms):
    import cupy

    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    n = len(comms)

    def body(r):
        with cupy.cuda.Device(r):
            x = cupy.arange(5, dtype=cupy.float32) * (r + 1)
            comms[r].all_reduce_sum(x)
            g = comms[r].all_gather(cupy.full((2, 3), r, cupy.int32))
            comms[r].barrier()
            return x.get(), g.get()
    for x, g in run_ranks(body, n):
        np.testing.assert_array_equal(x, np.arange(5) * n * (n + 1) / 2)
        assert g.shape == (n, 2, 3) and np.array_equal(g[:, 0, 0], np.arange(n))


@multi_gpu
def test_nccl_all_reduce_in_a_captured_graph(comms):
    """The all-reduce captured in one graph per rank (thread-local capture, one thread a GPU) sums
    on every replay; the graphs are launched from one host thread."""
    import cupy

    n = len(comms)
    state = {}

    def body(r, capture):
        with cupy.cuda.Device(r):
            if not capture:
                s = cupy.cuda.Stream(non_blocking=False)
                x = cupy.ones((1024,), cupy.float32)
                with s:
                    comms[r].all_reduce_sum(x)            # eager: connects
                s.synchronize()
                state[r] = [s, x, None]
                return
            s, x, _ = state[r]
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeThreadLocal", None)
            with s:
                s.begin_capture(*(() if mode is None else (mode,)))
                comms[r].all_reduce_sum(x)
                state[r][2] = s.end_capture()
    run_ranks(lambda r: body(r, False), n)
    run_ranks(lambda r: body(r, True), n)
    for _ in range(2):
        for r in range(n):
            with cupy.cuda.Device(r):
                state[r][2].launch(state[r][0])
    for r in range(n):
        with cupy.cuda.Device(r):
            state[r][0].synchronize()
            np.testing.assert_array_equal(state[r][1].get(), np.full(1024, float(n) ** 3, np.float32))


def _nccl_models(tp, KVH, dtype="float32"):
    """Rank r's model and cache on GPU r."""
    models = _gpu_models(tp, KVH, list(range(tp)), dtype)
    caches = []
    import cupy
    for r, m in enumerate(models):
        with cupy.cuda.Device(r):
            caches.append(m.new_cache(B, 32))
    return models, caches


@pytest.fixture(scope="module")
def tp1_reference():
    """TP=1 on GPU 0 (FakeGroup of one), dense and santa, KVH 8 and 2."""
    import cupy
    out = {}
    for KVH in (8, 2):
        for name, att in ATT.items():
            group = FakeGroup(1)
            models = _gpu_models(1, KVH, [0])
            with cupy.cuda.Device(0):
                dec = TensorParallelDecoder(models, group.communicators, [models[0].new_cache(B, 32)], devices=[0])
                out[KVH, name] = _run(dec, att)
                dec.close()
    return out


@multi_gpu
@pytest.mark.parametrize("attention", list(ATT))
@pytest.mark.parametrize("KVH", [8, 2])
@pytest.mark.parametrize("tp", TP_DEGREES)
def test_nccl_tp_decode_matches_tp1(comms, tp1_reference, attention, KVH, tp):
    """Eager TP=N over NCCL on N GPUs: TP=1's greedy tokens, logits within float32 rounding."""
    sub = NcclCommunicator.create_all(list(range(tp))) if tp != len(comms) else comms
    models, caches = _nccl_models(tp, KVH)
    dec = TensorParallelDecoder(models, sub, caches, devices=list(range(tp)))
    got = _run(dec, ATT[attention])
    dec.close()
    ref = tp1_reference[KVH, attention]
    assert np.array_equal(got[1], ref[1])
    assert np.abs(got[0] - ref[0]).max() <= 1e-4 * np.abs(ref[0]).max()
    if sub is not comms:
        for c in sub:
            c.close()


@multi_gpu
@pytest.mark.parametrize("attention", list(ATT))
@pytest.mark.parametrize("tp", TP_DEGREES)
def test_nccl_graph_decoder_matches_eager(comms, attention, tp):
    """One CUDA graph per rank (its all-reduces and all-gather inside), replayed: the eager TP
    decoder's tokens and logits within rounding (gemv products in the graph, cuBLAS eager)."""
    import cupy

    sub = NcclCommunicator.create_all(list(range(tp))) if tp != len(comms) else comms
    models, caches = _nccl_models(tp, 2, dtype="float16")
    eager = TensorParallelDecoder(models, sub, caches, devices=list(range(tp)))
    eager.prefill(PROMPT)
    length = caches[0].length
    want = [eager.decode([4, 8], ATT[attention]).get()]
    for _ in range(3):
        want.append(eager.decode(want[-1].argmax(-1), ATT[attention]).get())
    for r, c in enumerate(caches):                     # back to the prefilled caches
        with cupy.cuda.Device(r):
            c.lengths[...] = length
        c.length, c.step = length, 0
    graph = TensorParallelGraphDecoder(models, sub, caches, list(range(tp)), ATT[attention])
    got = [graph.replay([4, 8]).get()]
    for _ in range(3):
        got.append(graph.replay(got[-1].argmax(-1)).get())
    graph.close()
    eager.close()
    got, want = np.stack(got), np.stack(want)
    assert np.array_equal(got.argmax(-1), want.argmax(-1))
    assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max()
    if sub is not comms:
        for c in sub:
            c.close()

"""Tensor-parallel decoding on the CPU (llama_min.tensor_parallel): the sharding arithmetic and its
errors, the fake communicator, and TP=N against TP=1 on tiny random models (FakeGroup)."""

import os
import sys
import threading
import types

import numpy as np
import pytest

from llama_min.config import LlamaConfig
from llama_min.model import LlamaModel
from santa_cupy import AttentionSetting
from llama_min.tensor_parallel import (FakeGroup, ShardedBackend, TensorParallelDecoder, rank_config, run_ranks,
                                       shard_plan, shard_weights, valid_tp_degrees)

# --------------------------------------------------------------------------- a tiny random Llama in memory


def random_config(H=8, KVH=8, D=16, d=48, inter=80, layers=2, vocab=61, max_pos=64, tie=False) -> LlamaConfig:
    return LlamaConfig(hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=H,
                       num_key_value_heads=KVH, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=max_pos, vocab_size=vocab,
                       tie_word_embeddings=tie, bos_token_id=None, source="tests (random weights)")


def random_weights(cfg: LlamaConfig, seed=0, xp=np, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    H, KVH, D, d, I, V = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                          cfg.intermediate_size, cfg.vocab_size)

    def w(rows, cols, scale=None):
        a = rng.standard_normal((rows, cols)) * (scale if scale is not None else 1.0 / np.sqrt(cols))
        return xp.asarray(a.astype(dtype))

    def norm():
        return xp.asarray((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    layers = [{"attn_norm": norm(), "wqkv": w((H + 2 * KVH) * D, d, 2.0 / np.sqrt(d)), "wo": w(d, H * D),
               "mlp_norm": norm(), "w_gu": w(2 * I, d), "w_down": w(d, I)} for _ in range(cfg.num_hidden_layers)]
    embed = w(V, d, 1.0)
    return {"embed": embed, "lm_head": embed if cfg.tie_word_embeddings else w(V, d), "norm": norm(),
            "layers": layers}


def random_model(seed=0, **shape) -> LlamaModel:
    cfg = random_config(**shape)
    return LlamaModel(cfg, random_weights(cfg, seed), np, "cpu", "float32", "float32")


# --------------------------------------------------------------------------- sharding arithmetic


def test_plan_splits_heads_and_slices():
    p = shard_plan(dict(heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256), 8)
    assert (p.heads_per_rank, p.kv_heads_per_rank, p.replicas) == (8, 1, 1)
    assert p.query_heads(3) == range(24, 32) and p.kv_heads_of(3) == range(3, 4)
    assert p.intermediate_per_rank == 3584 and p.intermediate_slice(7) == (7 * 3584, 28672)
    assert p.vocab_per_rank == 16032 and p.vocab_slice(7) == (7 * 16032, 128256)
    p2 = shard_plan(dict(heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256), 2)
    assert p2.query_heads(1) == range(16, 32) and p2.kv_heads_of(1) == range(4, 8)


def test_plan_replicates_kv_heads_above_kvh():
    p = shard_plan(dict(heads=8, kv_heads=2, head_dim=16, intermediate=80, vocab=61), 8)
    assert (p.heads_per_rank, p.kv_heads_per_rank, p.replicas) == (1, 1, 4)
    # rank r's query head r belongs to KV group r // 4 (G = 4): the KV head it holds
    for r in range(8):
        assert p.kv_heads_of(r) == range(r // 4, r // 4 + 1)
        assert all(h // 4 == r // 4 for h in p.query_heads(r))
    p4 = shard_plan(dict(heads=8, kv_heads=2, head_dim=16, intermediate=80, vocab=61), 4)
    assert [p4.kv_heads_of(r).start for r in range(4)] == [0, 0, 1, 1]
    assert [p4.query_heads(r).start for r in range(4)] == [0, 2, 4, 6]


def test_plan_pads_intermediate_and_vocab():
    p = shard_plan(dict(heads=8, kv_heads=8, head_dim=16, intermediate=81, vocab=61), 4, align=8)
    assert p.intermediate_per_rank == 24 and p.vocab_per_rank == 16
    assert [p.intermediate_slice(r) for r in range(4)] == [(0, 24), (24, 48), (48, 72), (72, 81)]
    assert [p.vocab_slice(r) for r in range(4)] == [(0, 16), (16, 32), (32, 48), (48, 61)]
    q = shard_plan(dict(heads=8, kv_heads=8, head_dim=16, intermediate=3, vocab=61), 8)
    assert q.intermediate_per_rank == 1 and q.intermediate_slice(5) == (3, 3)     # an empty (all padding) slice


@pytest.mark.parametrize("tp,match", [(3, "does not divide the 8 KV heads"), (0, "integer >= 1"),
                                      (True, "integer >= 1"), (16, "multiple of them that divides the 8 query"),
                                      (12, "exceeds the 8 KV heads")])
def test_plan_errors(tp, match):
    with pytest.raises(ValueError, match=match):
        shard_plan(dict(heads=8, kv_heads=8, head_dim=16, intermediate=80, vocab=61), tp)


def test_plan_error_lists_valid_degrees_and_model_errors():
    with pytest.raises(ValueError, match=r"8 KV heads: \[1, 2, 4, 8, 16, 32, 64\]"):
        shard_plan(dict(heads=64, kv_heads=8, head_dim=128, intermediate=28672, vocab=128256), 6)
    assert valid_tp_degrees(8, 2) == [1, 2, 4, 8]
    assert valid_tp_degrees(12, 4) == [1, 2, 4, 12]
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        shard_plan(dict(heads=6, kv_heads=4, head_dim=16, intermediate=8, vocab=8), 2)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        shard_plan(dict(heads=8, kv_heads=8, head_dim=16, intermediate=80, vocab=61), 2).query_heads(2)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("KVH", [8, 2])
def test_shards_reassemble_the_weights(tp, KVH):
    """The shards' q/k/v rows, wo columns, gate/up rows and down columns, embedding rows: the whole
    model's, each once (KV heads: once per replica), the padding zeros."""
    cfg = random_config(H=8, KVH=KVH, inter=81, vocab=61)
    w = random_weights(cfg)
    p = shard_plan(cfg, tp, align=4)
    D, H, I = 16, 8, 81
    shards = [shard_weights(w, p, r) for r in range(tp)]
    Hr, KVr, Ir = p.heads_per_rank, p.kv_heads_per_rank, p.intermediate_per_rank
    for li, lw in enumerate(w["layers"]):
        q = np.concatenate([s["layers"][li]["wqkv"][:Hr * D] for s in shards])
        assert np.array_equal(q, lw["wqkv"][:H * D])
        wo = np.concatenate([s["layers"][li]["wo"] for s in shards], 1)
        assert np.array_equal(wo, lw["wo"])
        for r, s in enumerate(shards):
            g = p.kv_heads_of(r).start
            k = s["layers"][li]["wqkv"][Hr * D:(Hr + KVr) * D]
            v = s["layers"][li]["wqkv"][(Hr + KVr) * D:]
            assert np.array_equal(k, lw["wqkv"][(H + g) * D:(H + g + KVr) * D])
            assert np.array_equal(v, lw["wqkv"][(H + KVH + g) * D:(H + KVH + g + KVr) * D])
            assert s["layers"][li]["w_gu"].shape == (2 * Ir, 48) and s["layers"][li]["w_down"].shape == (48, Ir)
        gate = np.concatenate([s["layers"][li]["w_gu"][:Ir] for s in shards])
        up = np.concatenate([s["layers"][li]["w_gu"][Ir:] for s in shards])
        down = np.concatenate([s["layers"][li]["w_down"] for s in shards], 1)
        assert np.array_equal(gate[:I], lw["w_gu"][:I]) and not gate[I:].any()
        assert np.array_equal(up[:I], lw["w_gu"][I:]) and not up[I:].any()
        assert np.array_equal(down[:, :I], lw["w_down"]) and not down[:, I:].any()
    emb = np.concatenate([s["embed"] for s in shards])
    assert np.array_equal(emb[:61], w["embed"]) and not emb[61:].any()
    c = rank_config(cfg, p)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size, c.vocab_size) == (Hr, KVr, Ir,
                                                                                                 p.vocab_per_rank)


def test_tied_lm_head_stays_tied():
    cfg = random_config(tie=True)
    s = shard_weights(random_weights(cfg), shard_plan(cfg, 2), 1)
    assert s["lm_head"] is s["embed"]


# --------------------------------------------------------------------------- the fake communicator


def test_fake_group_sums_in_rank_order_and_gathers():
    g = FakeGroup(4)
    xs = [np.array([1e8, 1.0, -1e8], np.float32) * (r + 1) + np.float32(0.25 * r) for r in range(4)]
    want = xs[0].copy()
    for x in xs[1:]:
        want += x

    def body(r):
        x = xs[r].copy()
        out = g[r].all_reduce_sum(x)
        assert out is x
        gathered = g[r].all_gather(np.full((2, 3), r, np.int32))
        g[r].barrier()
        return x, gathered
    res = run_ranks(body, 4, g.abort)
    for x, gathered in res:
        assert np.array_equal(x, want)                       # the same bits on every rank
        assert gathered.shape == (4, 2, 3) and np.array_equal(gathered[:, 0, 0], [0, 1, 2, 3])
    assert g.calls == {"all_reduce": 1, "all_gather": 1, "barrier": 1}
    assert g.bytes["all_reduce"] == 12


def test_fake_group_failure_stops_the_other_ranks():
    g = FakeGroup(3, timeout=30)

    def body(r):
        if r == 1:
            raise RuntimeError("rank 1 failed")
        g[r].all_reduce_sum(np.zeros(2, np.float32))
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        run_ranks(body, 3, g.abort)
    assert threading.active_count() < 50


# --------------------------------------------------------------------------- TP=N against TP=1

PROMPT = np.array([[3, 17, 5, 60, 2, 44], [9, 1, 33, 33, 7, 0]])


def _generate(model, tp, attention, steps=4, lm_head="gather", align=1):
    """Greedy decoding of PROMPT through the TP decoder -> (logits [steps + 1, B, V], tokens, group)."""
    group = FakeGroup(tp)
    dec = TensorParallelDecoder.from_model(model, tp, batch=2, max_len=32, lm_head=lm_head, align=align,
                                           group=group)
    first = dec.prefill(PROMPT)                       # logits, gathered, in either lm_head mode
    logits, tokens = ([], [first.argmax(-1)]) if lm_head == "argmax" else ([first], [first.argmax(-1)])
    for _ in range(steps):
        out = dec.decode(tokens[-1], attention)
        if lm_head == "argmax":
            tokens.append(out)
        else:
            logits.append(out)
            tokens.append(out.argmax(-1))
    return (np.stack(logits) if logits else None), np.stack(tokens), group


ATTENTIONS = {"dense": AttentionSetting(method="dense"),
              "santa": AttentionSetting(method="santa", samples=32, block_n=64, seed=7),
              "santa-iid-fixed": AttentionSetting(method="santa", samples=24, sampler="iid", budget="fixed", block_n=64)}


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("KVH,tps", [(8, (2, 4, 8)), (2, (2, 4, 8))])       # KVH 2: replicated at 4 and 8
def test_tp_decode_matches_tp1(attention, KVH, tps):
    """Greedy tokens equal and logits within float32 rounding (the partial products sum in another
    order) at every TP degree, dense and SANTA."""
    model = random_model(H=8, KVH=KVH, inter=80, vocab=61)
    ref, ref_tok, _ = _generate(model, 1, ATTENTIONS[attention])
    scale = np.abs(ref).max()
    for tp in tps:
        got, tok, _ = _generate(model, tp, ATTENTIONS[attention])
        assert np.array_equal(tok, ref_tok), (tp, tok, ref_tok)
        assert np.abs(got - ref).max() <= 1e-5 * scale, (tp, np.abs(got - ref).max())


def test_tp1_is_the_model_bit_for_bit():
    """TP=1 (a RankModel's prefill, ShardedBackend's step) == the plain LlamaModel's prefill and
    decode, bit for bit."""
    model = random_model(H=8, KVH=2)
    att = ATTENTIONS["santa"]
    got, _, _ = _generate(model, 1, att, steps=3)
    cache = model.new_cache(2, 32)
    want = [model.prefill(PROMPT, cache)]
    for _ in range(3):
        want.append(model.decode(want[-1].argmax(-1), cache, att))
    assert np.array_equal(got, np.stack(want))


@pytest.mark.parametrize("tp", [2, 8])
def test_tp_prefill_in_chunks_matches_prefill_by_decoding(tp):
    """The chunked TP prefill (collectives in LlamaModel.prefill's seams) and a prefill of decode
    steps fill the caches alike and give the same logits, within rounding."""
    model = random_model(H=8, KVH=2)
    a = TensorParallelDecoder.from_model(model, tp, batch=2, max_len=32)
    b = TensorParallelDecoder.from_model(model, tp, batch=2, max_len=32)
    la, lb = a.prefill(PROMPT, chunk=4), b.prefill_by_decoding(PROMPT)
    assert np.abs(la - lb).max() <= 1e-5 * np.abs(lb).max()
    for ca, cb in zip(a.caches, b.caches):
        assert ca.length == cb.length == PROMPT.shape[1] and ca.step == cb.step == 0
        n = ca.length
        assert np.allclose(ca.k[1][:, :n], cb.k[1][:, :n], rtol=1e-5, atol=1e-5)


def test_tp_padding_and_collective_counts():
    """Intermediate and vocabulary not divisible by tp (zero padding) give TP=1's results; two
    all-reduces a layer plus the embedding's, one all-gather, a step."""
    model = random_model(H=8, KVH=8, inter=81, vocab=61, layers=3)
    ref, ref_tok, _ = _generate(model, 1, ATTENTIONS["dense"], steps=2)
    got, tok, group = _generate(model, 4, ATTENTIONS["dense"], steps=2, align=8)
    assert np.array_equal(tok, ref_tok) and np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    passes = 1 + 2                                     # the prefill (one chunk) and two decode steps
    assert group.calls["all_reduce"] == passes * (2 * 3 + 1)
    assert group.calls["all_gather"] == passes
    assert got.shape[-1] == 61


@pytest.mark.parametrize("tp", [2, 8])
def test_distributed_argmax_is_the_global_argmax(tp):
    model = random_model(H=8, KVH=8, vocab=61)
    ref, ref_tok, _ = _generate(model, 1, ATTENTIONS["dense"])
    _, tok, _ = _generate(model, tp, ATTENTIONS["dense"], lm_head="argmax")
    assert np.array_equal(tok, ref_tok)


def test_distributed_argmax_ties_go_to_the_lowest_index():
    group = FakeGroup(2)
    model = random_model(vocab=61)
    from llama_min.tensor_parallel import rank_model
    plan = shard_plan(model.cfg, 2)
    local = {0: np.array([[1.0] * 31, [0.0] * 31], np.float32), 1: np.array([[1.0] * 30, [2.0] * 30], np.float32)}
    local[0][1, 5] = 2.0

    def body(r):
        be = ShardedBackend(rank_model(model, plan, r).backend, group[r], plan, r, "argmax")
        return be._argmax(np, np.pad(local[r], ((0, 0), (0, plan.vocab_per_rank - local[r].shape[1])),
                                     constant_values=9.0))        # padding never wins
    out = run_ranks(body, 2, group.abort)
    assert np.array_equal(out[0], [0, 5]) and np.array_equal(out[1], [0, 5])


def test_decoder_input_errors():
    model = random_model()
    dec = TensorParallelDecoder.from_model(model, 2, batch=1, max_len=8)
    with pytest.raises(ValueError, match=r"tokens must be \[B=1\]"):
        dec.decode([1, 2])
    with pytest.raises(ValueError, match="token ids must be in 0..60"):
        dec.decode([61])
    with pytest.raises(ValueError, match="does not divide"):
        TensorParallelDecoder.from_model(model, 3)


# --------------------------------------------------------------------------- bench e2e --tp (CPU parts)


def test_bench_70b_shape_and_tp_byte_floor():
    from santa_cupy.cli.bench import e2e, e2e_tp

    m = e2e.LLAMA70B_MODEL
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.intermediate, m.vocab) == (
        80, 8192, 64, 8, 128, 28672, 128256)
    one = e2e_tp.tp_bytes(m, 1, 32768, 1)
    assert one["total"] == e2e.e2e_bytes(m, 1, 32768)["total"]          # TP=1 is the whole model
    assert 139e9 < one["weights"] < 140e9                                # 70.6 B parameters less the embedding, fp16
    for tp in (2, 4, 8):
        b = e2e_tp.tp_bytes(m, 1, 131072, tp)
        assert b["kv"] * tp == e2e.e2e_bytes(m, 1, 131072)["kv"]         # KV / tp: 8 KV heads split
        # weights / tp, plus the replicated norms and the one embedding row per sequence
        replicated = (m.layers * 2 + 1) * m.hidden * 4 + m.hidden * 2
        assert b["weights"] - replicated == (one["weights"] - replicated) // tp
    # TP=16 > KVH: each GPU holds (and reads) one replicated KV head: KV / 8, not / 16
    b16 = e2e_tp.tp_bytes(m, 1, 131072, 16)
    assert b16["kv"] * 8 == e2e.e2e_bytes(m, 1, 131072)["kv"] and b16["kv_replicas"] == 2
    sizes = e2e_tp.tp_collective_sizes(m, 2, 8)
    assert sizes == {"all_reduce": 161, "all_reduce_bytes": 2 * 8192 * 4, "all_gather_bytes": 2 * 16032 * 4}


def test_bench_tp_needs_enough_gpus():
    import click
    from types import SimpleNamespace

    from santa_cupy.cli.bench import e2e_tp

    cp = SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(getDeviceCount=lambda: 2)))
    assert e2e_tp.check_gpus(cp, 2) == 2
    with pytest.raises(click.ClickException, match="--tp 4 needs 4 GPUs, 2 visible"):
        e2e_tp.check_gpus(cp, 4)


@pytest.mark.parametrize("args,msg", [
    (["--tp", "3"], "does not divide the 8 KV heads"),
    (["--tp", "0"], "--tp"),
    (["--tp", "2", "--model", "."], "random model"),
    (["--tp", "2", "--no-graph"], "one CUDA graph per GPU"),
    (["--tp", "2", "--context", "128k"], "a GPU > --mem-gb"),          # 70b at TP=2: ~92 GB a GPU
    (["--tp", "2", "--shape", "8b", "--context", "128k", "--batch", "64"], "a GPU > --mem-gb"),
])
def test_bench_tp_argument_errors(args, msg):
    from click.testing import CliRunner

    from santa_cupy.cli import bench

    result = CliRunner().invoke(bench.bench, ["e2e"] + args)
    assert result.exit_code == 2, result.output
    assert msg in result.output


def test_bench_tp_memory_per_gpu():
    from santa_cupy.cli.bench import e2e, e2e_tp

    m = e2e.LLAMA70B_MODEL
    assert 85e9 < e2e_tp.tp_memory(m, 1, 131072 + 40, 2) < 100e9
    assert e2e_tp.tp_memory(m, 1, 131072 + 40, 8) < 30e9
    assert 15e9 < e2e_tp.tp_memory(e2e.LLAMA8B_MODEL, 1, 131072 + 40, 2) < 18e9      # (16 GB + 17 GB KV) / 2


# --------------------------------------------------------------------------- NcclCommunicator's host side


def test_nccl_environment_turns_nvls_off(monkeypatch):
    from llama_min import tensor_parallel as tpm

    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    tpm._nccl_environment()
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    with pytest.raises(RuntimeError, match="never uses NVLink multicast"):
        tpm._nccl_environment()


class _FakeDeviceArray:
    """What NcclCommunicator reads of a CuPy array: dtype, shape, size, flags, device, data.ptr."""

    def __init__(self, shape, dtype, device=0, ptr=4096):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.size = int(np.prod(self.shape))
        self.flags = types.SimpleNamespace(c_contiguous=True)
        self.device = types.SimpleNamespace(id=device)
        self.data = types.SimpleNamespace(ptr=ptr)


def test_nccl_communicator_calls(monkeypatch):
    """In-place all-reduce and all-gather on the current stream with NCCL's dtype codes; initAll
    over the devices; wrong arrays refused; NVLS off before NCCL initialises."""
    from llama_min import tensor_parallel as tpm

    calls = []

    class FakeNcclComm:
        def __init__(self, dev):
            self.dev = dev

        def allReduce(self, *a):
            calls.append(("allReduce", self.dev) + a)

        def allGather(self, *a):
            calls.append(("allGather", self.dev) + a)

        def destroy(self):
            calls.append(("destroy", self.dev))

    nccl = types.SimpleNamespace(available=True, NCCL_FLOAT32=7, NCCL_FLOAT16=6, NCCL_FLOAT64=8, NCCL_INT32=2,
                                 NCCL_SUM=0)
    nccl.NcclCommunicator = types.SimpleNamespace(initAll=lambda devs: [FakeNcclComm(d) for d in devs])
    cupy = types.ModuleType("cupy")
    cupy.ndarray = _FakeDeviceArray
    cupy.empty = lambda shape, dtype: _FakeDeviceArray(shape, dtype, ptr=8192)
    cupy.cuda = types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=77), nccl=nccl)
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setitem(sys.modules, "cupy.cuda", cupy.cuda)
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    comms = tpm.NcclCommunicator.create_all([2, 3])
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"
    assert [(c.rank, c.size, c.device) for c in comms] == [(0, 2, 2), (1, 2, 3)]
    x = _FakeDeviceArray((2, 8), np.float32, device=3, ptr=1000)
    assert comms[1].all_reduce_sum(x) is x
    assert calls[-1] == ("allReduce", 3, 1000, 1000, 16, 7, 0, 77)
    out = comms[1].all_gather(_FakeDeviceArray((2, 5), np.float16, device=3, ptr=2000))
    assert out.shape == (2, 2, 5) and calls[-1] == ("allGather", 3, 2000, 8192, 10, 6, 77)
    with pytest.raises(ValueError, match="on device 3"):
        comms[1].all_reduce_sum(_FakeDeviceArray((4,), np.float32, device=2))
    with pytest.raises(TypeError, match="NCCL collectives here take"):
        comms[1].all_reduce_sum(_FakeDeviceArray((4,), np.int8, device=3))
    for c in comms:
        c.close()
        c.close()                                      # idempotent
    assert [c for c in calls if c[0] == "destroy"] == [("destroy", 2), ("destroy", 3)]

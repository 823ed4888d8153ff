"""Rank-invariant sampling (issue #22): a tensor-parallel rank holding query heads h0 .. h0 + H/tp - 1
keys them by their global index (head_offset), so SANTA's sample counts at TP = 2, 4, 8 equal those
at TP = 1 given the seed and the attention inputs, bit for bit; the plan passes the offset to the
kernels (host side, recording kernels); the TP decoder gives each rank its offset."""

import numpy as np
import pytest

from santa_cupy.kernel_choice import KernelChoice

from santa_cupy import AttentionSetting
from llama_min.tensor_parallel import TensorParallelDecoder, shard_plan
from santa_cupy import cpu_attention, decode_attention, kernels, one_pass, reference
from tests import test_plan_host as host
from tests.test_tp import random_model

launches = host.launches          # the recording-kernel fixture of the plan's host-side tests

B, H, D, L = 2, 8, 16, 70
LENGTHS = np.array([70, 41], np.int32)
SAMPLERS = ("iid", "stratified", "systematic")
BUDGETS = ("fixed", "global", "largest_remainder")


def _inputs(KVH, seed=0, head_dim=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, head_dim)).astype(np.float32) * 1.5
    k = rng.standard_normal((B, L, KVH, head_dim)).astype(np.float32)
    v = rng.standard_normal((B, L, KVH, head_dim)).astype(np.float32)
    return q, k, v


def _rank_inputs(q, k, v, plan, r):
    """Rank r's attention inputs: its query heads and its (maybe replicated) KV heads."""
    qh, kvh = plan.query_heads(r), plan.kv_heads_of(r)
    return (np.ascontiguousarray(q[:, qh.start:qh.stop]), np.ascontiguousarray(k[:, :, kvh.start:kvh.stop]),
            np.ascontiguousarray(v[:, :, kvh.start:kvh.stop]), qh.start)


def _plan(KVH, tp):
    return shard_plan(dict(heads=H, kv_heads=KVH, head_dim=D, intermediate=8, vocab=8), tp)


@pytest.mark.parametrize("KVH,tp", [(8, 2), (8, 4), (8, 8), (2, 2), (2, 4), (2, 8)])
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_counts_per_global_head_equal_tp1(KVH, tp, budget, sampler):
    """The float64 reference's counts (reference.santa_attention) and the CPU decoder's
    (cpu_attention.santa_attention) at TP=tp, rank by rank with head_offset, are TP=1's."""
    q, k, v = _inputs(KVH)
    kw = dict(samples=40, sampler=sampler, budget=budget, seed=11, step=3, layer=2, block_n=8)
    want = reference.santa_attention(q, k, v, LENGTHS, **kw)[4]
    want_cpu = cpu_attention.santa_attention(q, k, v, LENGTHS, return_counts=True, **kw)[1]
    plan = _plan(KVH, tp)
    got, got_cpu, unkeyed = [], [], []
    for r in range(tp):
        qr, kr, vr, h0 = _rank_inputs(q, k, v, plan, r)
        got.append(reference.santa_attention(qr, kr, vr, LENGTHS, head_offset=h0, **kw)[4])
        got_cpu.append(cpu_attention.santa_attention(qr, kr, vr, LENGTHS, return_counts=True, head_offset=h0, **kw)[1])
        unkeyed.append(reference.sample_counts(qr, kr, LENGTHS, **kw))          # keyed locally: not TP=1's
        assert np.array_equal(reference.sample_counts(qr, kr, LENGTHS, head_offset=h0, **kw), got[-1])
    assert np.array_equal(np.concatenate(got, 1), want)
    assert np.array_equal(np.concatenate(got_cpu, 1), want_cpu)
    assert not np.array_equal(np.concatenate(unkeyed, 1), want)


@pytest.mark.parametrize("KVH,tp", [(8, 4), (2, 8)])
def test_one_pass_selection_and_decode_attention_are_rank_invariant(KVH, tp):
    q, k, v = _inputs(KVH, seed=1, head_dim=64)
    hint = np.full((B, H), 2.0)
    o_full, info_full = one_pass.one_pass_attention(q, k, v, LENGTHS, samples=16, lse_hint=hint, seed=5, step=1,
                                                    layer=0, block_n=64)
    full = decode_attention(q, k, v, LENGTHS, samples=24, seed=5, step=2, layer=1, block_n=64, return_info=True)[1]
    plan = _plan(KVH, tp)
    for r in range(tp):
        qr, kr, vr, h0 = _rank_inputs(q, k, v, plan, r)
        hs = slice(h0, h0 + plan.heads_per_rank)
        o, info = one_pass.one_pass_attention(qr, kr, vr, LENGTHS, samples=16, lse_hint=hint[:, hs], seed=5, step=1,
                                              layer=0, block_n=64, head_offset=h0)
        assert np.array_equal(info.selected, info_full.selected[:, hs])
        assert np.allclose(o, o_full[:, hs], rtol=1e-12, atol=1e-12)
        part = decode_attention(qr, kr, vr, LENGTHS, samples=24, seed=5, step=2, layer=1, block_n=64,
                                return_info=True, head_offset=h0)[1]
        assert np.array_equal(part.counts, full.counts[:, hs])


def test_head_offset_zero_is_the_default_and_validated():
    q, k, v = _inputs(2, head_dim=64)
    kw = dict(samples=32, seed=3, block_n=8)
    assert np.array_equal(reference.sample_counts(q, k, LENGTHS, **kw),
                          reference.sample_counts(q, k, LENGTHS, head_offset=0, **kw))
    with pytest.raises(ValueError, match="head_offset"):
        decode_attention(q, k, v, LENGTHS, head_offset=-1)
    with pytest.raises(TypeError, match="head_offset"):
        decode_attention(q, k, v, LENGTHS, head_offset=1.0)


@pytest.mark.parametrize("cfg,kernel", [
    (dict(method="santa", block_n=128, _kernels=KernelChoice(tile_kernel="warp")), "santa_tile_warp"),
    (dict(method="santa", block_n=64, _kernels=KernelChoice(tile_kernel="block"), budget="fixed"), "santa_tile"),
    (dict(method="santa", block_n=64, budget="one_pass"), "santa_one_pass")])
def test_plan_passes_head_offset_to_the_sampling_kernels(launches, cfg, kernel):
    from santa_cupy import DecodePlan

    q, k, v, lengths = host._inputs(L=3000)
    params = host._kernel_params()[kernel]
    assert params[params.index("layer") + 1] == "head_offset"
    for offset in (0, 24):
        launches.clear()
        plan = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, head_offset=offset,
                          santa_min_length=0, **cfg)
        plan.run(q, k, v, lengths, layer=5)
        (args,) = [a for name, _, _, a, _ in launches if name == kernel]
        assert int(args[params.index("head_offset")]) == offset and int(args[params.index("layer")]) == 5
        assert type(args[params.index("head_offset")]) is kernels.i32
    with pytest.raises(ValueError, match="head_offset"):
        DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, head_offset=2**31 - 4)


@pytest.mark.parametrize("KVH,tp", [(8, 4), (2, 8)])
def test_tp_decoder_keys_every_rank_by_its_global_heads(KVH, tp):
    """Through the TP decoder: each rank's model has head_offset = its first global head; its
    attention (recorded by a hook) is cpu_attention's with that offset, bit for bit; and the ranks'
    counts on their recorded inputs, put together, are TP=1's counts on the assembled inputs."""
    model = random_model(H=8, KVH=KVH, vocab=61)
    att = AttentionSetting(method="santa", samples=32, block_n=64, seed=9)
    dec = TensorParallelDecoder.from_model(model, tp, batch=2, max_len=24)
    dec.prefill(np.array([[3, 17, 5, 60, 2], [9, 1, 33, 33, 7]]))
    plan = dec.plan
    assert [m.head_offset for m in dec.models] == [plan.query_heads(r).start for r in range(tp)]
    seen = {}

    def hook(rank, layer, q, kc, vc, lens, attend):
        o = attend(q, kc, vc, lens)
        seen[rank, layer] = (q.copy(), kc.copy(), vc.copy(), np.array(lens), o.copy())
        return o
    dec.decode([4, 8], att, attention_hook=hook)
    step = dec.caches[0].step - 1
    kw = dict(samples=32, sampler="systematic", budget="global", seed=9, step=step, block_n=64,
              scale=float(model.scale))
    for layer in range(model.cfg.num_hidden_layers):
        per_rank = []
        for r in range(tp):
            q, kc, vc, lens, o = seen[r, layer]
            h0 = dec.models[r].head_offset
            o_want, counts = cpu_attention.santa_attention(q, kc, vc, lens, layer=layer, head_offset=h0,
                                                           return_counts=True, **kw)
            assert np.array_equal(o, o_want)
            per_rank.append(counts)
        # the assembled inputs: every rank's query heads, the KV heads of the ranks that hold them
        q_all = np.concatenate([seen[r, layer][0] for r in range(tp)], 1)
        owner = [next(r for r in range(tp) if g in plan.kv_heads_of(r)) for g in range(KVH)]
        k_all = np.stack([seen[owner[g], layer][1][:, :, g - plan.kv_heads_of(owner[g]).start] for g in range(KVH)], 2)
        v_all = np.stack([seen[owner[g], layer][2][:, :, g - plan.kv_heads_of(owner[g]).start] for g in range(KVH)], 2)
        for r in range(tp):                  # replicas compute their KV head alike (the same rows, the same bits)
            for g in plan.kv_heads_of(r):
                assert np.array_equal(seen[r, layer][1][:, :, g - plan.kv_heads_of(r).start], k_all[:, :, g])
        lens = seen[0, layer][3]
        _, want = cpu_attention.santa_attention(q_all, k_all, v_all, lens, layer=layer, return_counts=True, **kw)
        assert np.array_equal(np.concatenate(per_rank, 1), want)

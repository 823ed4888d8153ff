"""santa_cupy.AttentionSetting (the one setting type: its fields, checks and name format),
the internal KernelChoice, and decode_attention's plan cache (on the host stand-in cupy of
tests/test_plan_host.py)."""

import dataclasses
import inspect
import sys

import numpy as np
import pytest

import santa_cupy
from santa_cupy import AttentionSetting, DecodePlan, decode_attention, spec
from santa_cupy.kernel_choice import KernelChoice
from tests import test_plan_host
from tests.test_plan_host import FakeArray

launches = test_plan_host.launches            # the fixture

NAMES = ["dense", "dense/block_n=64", "systematic/global/S=256", "iid/fixed/S=1", "stratified/largest_remainder/S=65536",
         "systematic/one_pass/S=128/block_n=64/min_length=0/seed=18446744073709551615",
         "systematic/global/S=16/min_length=4096", "iid/global/S=64/seed=3"]


@pytest.mark.parametrize("name", NAMES)
def test_name_round_trip(name):
    setting = AttentionSetting.parse(name)
    assert str(setting) == setting.label == name
    assert AttentionSetting.parse(str(setting)) == setting
    assert AttentionSetting.parse(setting) is setting
    assert hash(setting) == hash(AttentionSetting.parse(name))


def test_every_setting_has_a_name_that_parses_back():
    for method in spec.METHODS:
        for sampler in spec.SAMPLERS:
            for budget in spec.DECODE_BUDGETS:
                if budget == spec.ONE_PASS and sampler != "systematic":
                    continue
                for extra in ({}, dict(seed=7, block_n=128, santa_min_length=0), dict(santa_min_length="auto")):
                    s = AttentionSetting(method=method, samples=33, sampler=sampler, budget=budget, **extra)
                    back = AttentionSetting.parse(str(s))
                    if method == "santa":
                        assert back == s
                    else:                          # dense: the name keeps block_n only
                        assert str(back) == str(s) and back.block_n == s.block_n


def test_the_benchs_names_parse_as_settings():
    assert AttentionSetting.parse("santa-global-systematic-256") == AttentionSetting()
    assert AttentionSetting.parse("santa-fixed-iid-2048") == AttentionSetting(sampler="iid", budget="fixed",
                                                                              samples=2048)


@pytest.mark.parametrize("bad", ["", "sparse", "systematic/global", "systematic/global/256", "systematic/global/S=0",
                                 "uniform/global/S=4", "iid/half/S=4", "iid/one_pass/S=4", "dense/seed=1",
                                 "iid/global/S=4/seed=1/seed=2", "iid/global/S=4/speed=1", "iid/global/S=4/seed=-1",
                                 "iid/global/S=4/block_n=96", "santa-global-systematic-0"])
def test_bad_names_say_the_format(bad):
    with pytest.raises(ValueError):
        AttentionSetting.parse(bad)


@pytest.mark.parametrize("field,bad", [("method", "sparse"), ("method", None), ("samples", 0), ("samples", 2.0),
                                       ("samples", True), ("sampler", "IID"), ("budget", None), ("seed", -1),
                                       ("seed", 2**64), ("seed", 1.5), ("block_n", 0), ("block_n", 96),
                                       ("santa_min_length", -1), ("santa_min_length", "never"),
                                       ("santa_min_length", True), ("santa_min_length", 2**40)])
def test_fields_are_checked_once_naming_the_field(field, bad):
    with pytest.raises((TypeError, ValueError), match=field):
        AttentionSetting(**{field: bad})


def test_setting_is_frozen_and_replace_checks_again():
    s = AttentionSetting()
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.samples = 3
    assert s.replace(samples=3).samples == 3
    with pytest.raises(ValueError, match="samples"):
        s.replace(samples=0)
    assert AttentionSetting.from_fields("iid/fixed/S=8", seed=4) == AttentionSetting(sampler="iid", budget="fixed",
                                                                                     samples=8, seed=4)
    with pytest.raises(TypeError, match="tile_kernel"):
        AttentionSetting.from_fields(None, tile_kernel="warp")


def test_public_signatures_carry_no_kernel_selection():
    """Kernel selection is internal: DecodePlan's public keywords and decode_attention's are the
    shape, dtype, setting (and its fields) and per-call values, not kernels."""
    kernel_words = {f.name for f in dataclasses.fields(KernelChoice)}
    for fn in (DecodePlan.__init__, decode_attention):
        params = set(inspect.signature(fn).parameters)
        assert not params & kernel_words, fn
        assert not {p for p in params if p.startswith("_")} - {"_kernels", "_dense_rows"}
    for name in santa_cupy.__all__:
        assert getattr(santa_cupy, name).__doc__, name


@pytest.mark.parametrize("field,bad", [("dense_kernel", "fast"), ("score_kernel", None), ("tile_kernel", "warp_smem"),
                                       ("tiles_per_warp", 0), ("tiles_per_warp", 2.0), ("dense_splits", True),
                                       ("self_merge_max_splits", -1), ("finish_max_groups", 1.5),
                                       ("merge_wide", 1), ("programmatic", "yes")])
def test_kernel_choice_is_checked(field, bad):
    with pytest.raises(ValueError, match=field):
        KernelChoice(**{field: bad})


def test_plan_takes_a_setting_or_its_fields(launches):
    kw = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300)
    a = DecodePlan(**kw, setting="iid/fixed/S=32/seed=3")
    b = DecodePlan(**kw, method="santa", sampler="iid", budget="fixed", samples=32, seed=3)
    c = DecodePlan(**kw, setting=AttentionSetting(sampler="iid", budget="fixed", samples=16), samples=32, seed=3)
    assert a.setting == b.setting == c.setting
    assert (a.sampler, a.budget, a.samples, a.seed) == ("iid", "fixed", 32, 3)
    with pytest.raises(TypeError, match="dense_kernel"):
        DecodePlan(**kw, dense_kernel="stream")
    with pytest.raises(TypeError, match="_kernels"):
        DecodePlan(**kw, _kernels={"tile_kernel": "block"})


# ---- decode_attention's plan cache ---------------------------------------------------------------
def _gpu_cupy(monkeypatch):
    """The stand-in cupy of the launches fixture, with what decode_attention's GPU path uses."""
    cp = sys.modules["cupy"]
    stream = type("Stream", (), {"ptr": 0})()
    device = cp.cuda.Device()
    device.id = 0
    monkeypatch.setattr(cp, "cuda", type(cp.cuda)(Device=lambda *a: device, get_current_stream=lambda: stream))
    cp.ascontiguousarray = lambda x, dtype=None: np.ascontiguousarray(x, dtype).view(FakeArray)
    cp.array = lambda x, copy=True: np.array(x, copy=copy).view(FakeArray)
    cp.broadcast_to = lambda x, shape: np.broadcast_to(x, shape).view(FakeArray)
    cp.ones = lambda shape, dtype=np.float32: np.ones(shape, dtype).view(FakeArray)
    cp.isfinite = np.isfinite
    cp.uint32 = np.uint32
    monkeypatch.setattr(FakeArray, "get", lambda self: np.asarray(self), raising=False)
    return stream


def test_decode_attention_reuses_plans_and_returns_owned_arrays(launches, monkeypatch):
    stream = _gpu_cupy(monkeypatch)
    santa_cupy.clear_plan_cache()
    made = []
    real_init = DecodePlan.__init__

    def counting_init(self, **kw):
        made.append(kw.get("setting"))
        real_init(self, **kw)

    monkeypatch.setattr(DecodePlan, "__init__", counting_init)
    q, k, v, lengths = test_plan_host._inputs()
    o1, info1 = decode_attention(q, k, v, lengths, samples=32, return_info=True)
    plans = list(santa_cupy.attention._plans.plans.values())
    assert len(plans) == 1 and o1 is not plans[0].out and info1.lse is not plans[0].lse
    first = [name for name, *_ in launches]
    launches.clear()
    o2 = decode_attention(q, k, v, lengths, "systematic/global/S=32", step=5)
    assert len(made) == 1 + (plans[0]._dense_plan is not None)          # the same plan (and its fallback)
    assert o2 is not o1 and [name for name, *_ in launches] == first  # the same launches
    assert int(plans[0].step[0]) == 5                                 # the call's step, on the device
    decode_attention(q, k, v, lengths, method="dense")                # another setting: another plan
    stream.ptr = 7
    decode_attention(q, k, v, lengths, samples=32)                    # another stream: another plan
    assert len(santa_cupy.attention._plans.plans) == 3
    for seed in range(santa_cupy.attention.PLAN_CACHE_SIZE + 2):
        decode_attention(q, k, v, lengths, samples=32, seed=seed)
    assert len(santa_cupy.attention._plans.plans) == santa_cupy.attention.PLAN_CACHE_SIZE
    out = np.empty(o1.shape, o1.dtype).view(FakeArray)
    assert decode_attention(q, k, v, lengths, samples=32, out=out) is out
    santa_cupy.clear_plan_cache()
    assert not santa_cupy.attention._plans.plans


def test_kernel_choice_thresholds_steer_the_plan(launches):
    """The thresholds that were module constants now come with the plan's KernelChoice."""
    kw = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000)
    q, k, v, lengths = test_plan_host._inputs(L=3000)

    def names(plan):
        launches.clear()
        plan.run(q, k, v, lengths)
        return [name for name, *_ in launches]

    dense = DecodePlan(**kw, method="dense")
    assert dense.dense_merges_itself and names(dense) == ["decode_dense_mma"]
    capped = DecodePlan(**kw, method="dense", _kernels=KernelChoice(self_merge_max_splits=0))
    assert not capped.dense_merges_itself and names(capped) == ["decode_dense_mma", "santa_merge"]
    santa = DecodePlan(**kw, santa_min_length=0)
    assert santa.atomic_finish and names(santa)[-1] == "santa_tile_warp"
    partials = DecodePlan(**kw, santa_min_length=0, _kernels=KernelChoice(finish_max_groups=0))
    assert not partials.atomic_finish and names(partials)[-1] == "santa_tile_warp"   # block partials, no merge
    assert santa.tile_kernel == "warp_mma"                                      # 44 rows a tile
    assert DecodePlan(**kw, _kernels=KernelChoice(mma_min_rows=1e9)).tile_kernel == "warp"
    every = dict(kw, budget="fixed", santa_min_length=0)
    assert DecodePlan(**every).tile_kernel == "block"                          # 6 MB: the fused pass
    assert DecodePlan(**every, _kernels=KernelChoice(fused_fixed_max_kv_bytes=0)).tile_kernel == "warp_mma"
    assert DecodePlan(**kw, _kernels=KernelChoice(programmatic=False))._programmatic is False
    assert santa._programmatic is None                                          # the process switch decides
    assert santa._merge_fn is santa.kernels.merge_wide                          # 16 blocks <= 132 SMs
    narrow = DecodePlan(**kw, santa_min_length=0, _kernels=KernelChoice(merge_wide=False))
    assert narrow._merge_fn is narrow.kernels.merge

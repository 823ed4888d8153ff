"""Key (score-stage) sampling through the public API (issue #17 items 3 and 4): the setting's
fields and name format, decode_attention and santa_cupy.key_scores on NumPy, the GPU refusal,
llama_min's CPU decoder, and the eval commands' key-sampling columns on a tiny model."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import santa_cupy
from santa_cupy import AttentionSetting, decode_attention, reference
from santa_cupy import key_sampling as ks
from santa_cupy.cli import evaluation as ev
from tests import test_plan_host
from test_model import make_tiny

launches = test_plan_host.launches            # the fixture (a host stand-in cupy)

B, H, KVH, D, L = 2, 4, 2, 64, 40


def make_case(seed=0, dtype=np.float32):
    rs = np.random.default_rng(seed)
    q = (rs.standard_normal((B, H, D)) * np.exp(rs.standard_normal((B, H, D)))).astype(dtype)
    k = (rs.standard_normal((B, L, KVH, D)) * rs.uniform(0.2, 3.0, (1, 1, KVH, D))).astype(dtype)
    v = rs.standard_normal((B, L, KVH, D)).astype(dtype)
    return q, k, v, np.array([L, 23])


# ------------------------------------------------------------------------------ the setting

KEY_NAMES = ["dense/keys=block:FB=16,f=0.875", "dense/keys=block:FB=32,f=0.5,R=2,rule=qrms,combine=union",
             "systematic/global/S=256/keys=block:FB=16,v=0.1", "iid/fixed/S=64/seed=3/keys=bernoulli:R=8",
             "dense/block_n=64/keys=bernoulli:R=1,combine=union", "dense/keys=block:FB=16,f=1.0,rule=uniform"]


@pytest.mark.parametrize("name", KEY_NAMES)
def test_key_names_round_trip(name):
    st = AttentionSetting.parse(name)
    assert str(st) == st.label == name and st.key_sampled
    assert AttentionSetting.parse(str(st)) == st and hash(st) == hash(AttentionSetting.parse(name))
    assert AttentionSetting(**st.as_dict()) == st
    assert set(st.key_options) == set(AttentionSetting.__dataclass_fields__) & set(st.key_options)


def test_key_fields_defaults_and_keywords():
    st = AttentionSetting()
    assert not st.key_sampled and st.key_sampling == "none" and "keys" not in str(st)
    assert "key_sampling" not in st.as_dict()                    # result files read as before
    blk = AttentionSetting.from_fields("dense", key_sampling="bernoulli_block")
    assert str(blk) == "dense/keys=block:FB=16,f=0.875"           # the study's block estimator
    assert blk.key_rule == "qkvar" and blk.key_draws == 1 and blk.key_combine == "mean"
    assert str(blk.replace(key_variance=0.2)) == "dense/keys=block:FB=16,v=0.2"
    assert isinstance(AttentionSetting(key_budget=1).key_budget, float)


@pytest.mark.parametrize("fields,match", [
    (dict(key_sampling="gumbel"), "key_sampling must be one of"),
    (dict(key_draws=0), r"key_draws must be in \[1, 256\]"),
    (dict(key_block=8), r"key_block must be one of \(16, 32\)"),
    (dict(key_budget=0.0), r"key_budget must be in \(0, 1\]"),
    (dict(key_rule="oracle"), "key_rule must be one of"),
    (dict(key_combine="median"), "key_combine must be one of"),
    (dict(key_variance=-1.0), "key_variance must be None or a finite real > 0"),
    (dict(key_variance=0.1, key_rule="qmax"), 'key_variance needs key_rule="qkvar"'),
    (dict(key_variance=0.1, key_budget=0.5), "key_budget or key_variance, not both"),
    (dict(key_sampling="bernoulli", budget="one_pass"), "not supported"),
])
def test_key_fields_validated(fields, match):
    with pytest.raises(ValueError, match=match):
        AttentionSetting(**fields)


@pytest.mark.parametrize("name,match", [
    ("dense/keys=block:FB=16", "needs FB= and one of f= or v="),
    ("dense/keys=gumbel:R=1", "is not keys=block"),
    ("dense/keys=block:FB=16,f=0.5,v=0.1", "gives both f= and v="),
    ("dense/keys=bernoulli:FB=16", "is not one of R=, combine="),
    ("dense/keys=bernoulli:R=x", "R must be a positive integer"),
    ("dense/keys=block:FB=16,f=inf", "f must be a finite number"),
    ("dense/keys=block:FB=16,f=2", r"key_budget must be in \(0, 1\]"),
    ("dense/keys=block:FB=16,f=0.5/seed=1", "nor a last /keys="),       # keys= comes last
    ("dense/keys=block:FB=16,f=0.5,R=2,R=3", "each at most once"),
])
def test_bad_key_names(name, match):
    with pytest.raises(ValueError, match=match):
        AttentionSetting.parse(name)


# ------------------------------------------------------------------------------ NumPy calls


@pytest.mark.parametrize("name", KEY_NAMES)
def test_decode_attention_equals_key_sampled_attention(name):
    st = AttentionSetting.parse(name)
    q, k, v, lens = make_case(dtype=np.float64)
    o, info = decode_attention(q, k, v, lens, st, step=7, layer=3, return_info=True)
    ref_o, lse, kinfo, counts = ks.key_sampled_attention(
        q, k, v, lens, value="dense" if st.method == "dense" else "santa", samples=st.samples, sampler=st.sampler,
        budget=st.budget, block_n=st.resolved_block_n(D), seed=st.seed, step=7, layer=3, **st.key_options)
    assert np.array_equal(o, ref_o) and np.array_equal(info.lse, lse.astype(np.float32))
    assert info.key_fraction.shape == (B, KVH) and info.key_fraction.dtype == np.float32
    assert np.array_equal(info.key_fraction, kinfo.group_fraction.astype(np.float32))
    n = lens.astype(np.float64)[:, None]
    assert (info.key_fraction * n).sum() / (n.sum() * KVH) == pytest.approx(kinfo.key_fraction)
    if st.method == "santa":
        assert np.array_equal(info.counts, counts) and (info.counts.sum(-1) == st.samples).all()
        assert (info.rows_read <= lens[:, None]).all() and (info.spread > 0).any()
    else:
        assert info.counts is None and (info.rows_read == lens[:, None]).all()
    # float32 inputs: the same estimator, o rounded to q's dtype
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    o32 = decode_attention(q32, k32, v32, lens, st, step=7, layer=3)
    assert o32.dtype == np.float32 and np.allclose(o32, ref_o, rtol=1e-3, atol=1e-4)


def test_block_budget_reads_less_and_seeds_differ():
    q, k, v, lens = make_case()
    _, a = decode_attention(q, k, v, lens, "dense/keys=block:FB=16,f=0.5", return_info=True)
    _, b = decode_attention(q, k, v, lens, "dense/keys=block:FB=16,f=0.5", step=1, return_info=True)
    assert a.key_fraction.mean() < 0.9 and not np.array_equal(a.lse, b.lse)
    o = decode_attention(q, k, v, lens, method="dense", key_sampling="bernoulli_block", key_budget=0.5)
    assert np.array_equal(o, decode_attention(q, k, v, lens, "dense/keys=block:FB=16,f=0.5"))
    o = decode_attention(q, k, v, lens, key_sampling="bernoulli", key_draws=3, key_block=32)   # santa values
    assert np.array_equal(o, decode_attention(q, k, v, lens, "systematic/global/S=256/keys=bernoulli:R=3"))


def test_key_sampling_none_is_todays_call():
    """key_sampling="none" takes today's paths: the same arrays as the reference, key_fraction 1."""
    q, k, v, lens = make_case()
    for name in ("dense", "systematic/global/S=64", "iid/fixed/S=16/seed=4"):
        st = AttentionSetting.parse(name)
        o, info = decode_attention(q, k, v, lens, st, step=2, layer=1, return_info=True)
        if st.method == "dense":
            ref_o, ref_lse = reference.dense_attention(q, k, v, lens)
        else:
            ref_o, ref_lse, *_ = reference.santa_attention(q, k, v, lens, samples=st.samples, sampler=st.sampler,
                                                           budget=st.budget, seed=st.seed, step=2, layer=1,
                                                           block_n=st.resolved_block_n(D))
        assert np.array_equal(o, ref_o.astype(np.float32)) and np.array_equal(info.lse, ref_lse.astype(np.float32))
        assert np.array_equal(info.key_fraction, np.ones((B, KVH), np.float32))
        o2 = decode_attention(q, k, v, lens, st.replace(key_sampling="none", key_draws=3), step=2, layer=1)
        assert np.array_equal(o, o2)


def test_public_key_scores():
    q, k, _, lens = make_case()
    s, info = santa_cupy.key_scores(q, k, lens, "dense/keys=bernoulli:R=4", step=3, layer=1)
    s2, info2 = ks.key_scores(q, k, lens, key_sampling="bernoulli", key_draws=4, step=3, layer=1)
    assert s.dtype == np.float32 and s.shape == (B, H, L) and np.array_equal(s, s2)
    assert info.key_fraction == info2.key_fraction
    exact, _ = santa_cupy.key_scores(q, k, lens)                  # the default setting: exact scores
    assert np.isneginf(exact[1, :, 23:]).all()
    s64, _ = santa_cupy.key_scores(q, k, lens, key_sampling="bernoulli_block", key_budget=0.5, out_dtype=np.float64)
    assert s64.dtype == np.float64


def test_paged_key_sampling_equals_contiguous():
    q, k, v, lens = make_case()
    page = 8
    pages = L // page
    table = np.arange(B * pages).reshape(B, pages)[:, ::-1].copy()
    kp = k.reshape(B * pages, page, KVH, D)[table.reshape(-1).argsort()]
    vp = v.reshape(B * pages, page, KVH, D)[table.reshape(-1).argsort()]
    name = "dense/keys=block:FB=16,f=0.75"
    o = decode_attention(q, k, v, lens, name)
    o_paged = decode_attention(q, kp, vp, lens, name, block_table=table)
    assert np.array_equal(o, o_paged)


def test_gpu_inputs_refuse_key_sampling_on_a_standard_k(launches):
    q, k, v, lengths = test_plan_host._inputs()
    santa_cupy.clear_plan_cache()
    with pytest.raises(NotImplementedError, match="key_layout='blocked'"):
        decode_attention(q, k, v, lengths, "dense/keys=block:FB=16,f=0.875")
    with pytest.raises(NotImplementedError, match="key_layout='blocked'"):
        santa_cupy.key_scores(q, k, lengths, key_sampling="bernoulli")
    assert not launches and not santa_cupy.attention._plans.plans


# ------------------------------------------------------------------------------ llama_min


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from llama_min.model import LlamaModel
    path, _, _ = make_tiny(tmp_path_factory.mktemp("tiny_keys"), H=4, KVH=2, layers=2, max_pos=64)
    return LlamaModel.from_pretrained(path)


IDS = [1, 5, 9, 3, 7, 2, 11, 4, 8, 6, 10, 12, 3, 14, 15, 1, 9, 20, 21, 5, 7, 30]


@pytest.mark.parametrize("name", ["dense/keys=block:FB=16,f=0.5", "systematic/global/S=64/keys=bernoulli:R=2"])
def test_cpu_decoder_attention_is_decode_attention(tiny, name):
    """Each layer's attention of a key-sampling setting is decode_attention at (seed, step, layer)."""
    from llama_min.model import key_read_fraction
    att = AttentionSetting.parse(name)
    cache = ev.decoding.prefilled_cache(tiny, IDS[:10], 16)
    calls = {}

    def hook(li, q, kc, vc, lens, attend):
        o = attend(q, kc, vc, lens)
        calls[li] = (q.copy(), np.ascontiguousarray(kc), np.ascontiguousarray(vc), lens.copy(), o.copy())
        return o
    for t in IDS[10:12]:
        step = cache.step
        tiny.decode(np.array([t]), cache, att, attention_hook=hook)
        for li, (q, kc, vc, lens, o) in calls.items():
            want = decode_attention(q, kc, vc, lens, att, step=step, layer=li, scale=float(tiny.scale))
            assert np.array_equal(o, want)
    assert 0 < key_read_fraction(cache) <= 1.0
    dense = ev.decoding.prefilled_cache(tiny, IDS[:10], 16)
    tiny.decode(np.array([IDS[10]]), dense, AttentionSetting(method="dense"))
    assert key_read_fraction(dense) == 1.0


def test_cpu_decoder_key_sampling_batched_and_paged(tiny):
    """Two sequences on a contiguous and on a paged cache: the same logits and K read."""
    from llama_min.model import key_read_fraction
    att = AttentionSetting.parse("dense/keys=block:FB=16,f=0.5")
    prompt = np.array([IDS[:8], IDS[8:16]])
    runs = []
    for page_size in (None, 4):
        cache = tiny.new_cache(2, 20, **({} if page_size is None else {"page_size": page_size}))
        tiny.prefill(prompt, cache)
        runs.append((np.stack([tiny.decode(np.array([3, 4]), cache, att) for _ in range(3)]),
                     key_read_fraction(cache)))
    assert np.array_equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1] < 1.0


def test_gpu_decoder_key_sampling_needs_a_blocked_cache(tiny):
    """The GPU decoder's key sampling reads a feature-blocked K: a standard cache is refused
    before any plan (or GPU) is made, naming the fix."""
    with pytest.raises(ValueError, match=r"new_cache\(\.\.\., key_block=FB\)"):
        tiny.make_plan(AttentionSetting.parse("iid/global/S=8/keys=block:FB=16,f=0.5"), tiny.new_cache(1, 20))


# ------------------------------------------------------------------------------ eval


def test_eval_config_extra_settings_and_no_grid():
    cfg = ev.config.resolve_config(True, settings=["iid/global/S=8/keys=block:FB=16,f=0.5"],
                                   keys=["block:FB=16,f=0.75", "bernoulli:R=2"], no_grid=True)
    names = [st.label for st in ev.runs.session_settings(cfg)]
    assert names == ["iid/global/S=8/keys=block:FB=16,f=0.5", "dense/keys=block:FB=16,f=0.75",
                     "dense/keys=bernoulli:R=2"]
    cfg = ev.config.resolve_config(True, keys=["block:FB=16,f=0.75"])
    assert [st.label for st in ev.runs.session_settings(cfg)][-1] == "dense/keys=block:FB=16,f=0.75"
    assert len(ev.runs.session_settings(cfg)) == 1 + len(ev.runs.session_settings(ev.config.resolve_config(True)))


def test_run_setting_keeps_the_seed_of_key_sampling():
    st = AttentionSetting.parse("dense/keys=block:FB=16,f=0.5")
    assert ev.settings.run_setting(st, 5, 64) == st.replace(seed=5, block_n=64)
    assert ev.settings.run_setting(ev.settings.DENSE, 5).seed == 0          # exact: no seed


def test_kernel_errors_key_columns(tiny):
    cap = ev.runs.capture_attention_inputs(tiny, IDS)
    settings = [AttentionSetting.parse("dense/keys=block:FB=16,f=0.5"),
                AttentionSetting.parse("dense/keys=block:FB=16,f=1.0"),
                AttentionSetting.parse("iid/global/S=16")]
    res = ev.runs.kernel_errors(cap, [0, 1], settings, [0, 1, 2])
    half, full = res["dense/keys=block:FB=16,f=0.5"], res["dense/keys=block:FB=16,f=1.0"]
    assert len(half["per_seed"]) == 3 and all("key_fraction" in p for p in half["per_seed"])
    assert half["key"]["key_fraction"] < 0.9 and half["key"]["seeds"] == 3
    assert half["key"]["lse_bias"] > 0 and half["key"]["output_bias"] >= 0          # Jensen: lse biased up
    # every block read with probability 1: the exact scores, no bias, the dtype's error
    assert full["key"]["key_fraction"] == 1.0 and abs(full["key"]["lse_bias"]) < 1e-5
    assert full["key"]["output_bias"] < 1e-5 and full["per_seed"][0]["mean"] < 1e-5
    assert "key" not in res["iid/global/S=16"] and "key_fraction" not in res["iid/global/S=16"]["per_seed"][0]
    table = ev.report.kernel_table(res)
    assert "| keys | K read |" in table and "lse bias (nats)" in table
    assert "| dense | - | - | block:FB=16,f=0.5 | " in table and "| iid | global | 16 | - | 1.000 |" in table
    assert "keys" not in ev.report.kernel_table({k: v for k, v in res.items() if "keys" not in k})


def test_model_and_retrieval_key_fraction(tiny):
    st = AttentionSetting.parse("dense/keys=block:FB=16,f=0.5")
    res = ev.runs.model_metrics(tiny, IDS, 14, [st], [0, 1], 3)
    row, other = res["results"][st.label]["per_seed"]
    assert 0 < row["key_fraction"] < 1 and row["kl"] >= 0
    assert (row["key_fraction"], row["kl"]) != (other["key_fraction"], other["kl"])     # seeds differ
    assert "| K read |" in ev.report.model_table(res)
    r = ev.runs.retrieval_trials(tiny, ev_tok(), [20], [0.5], 1, [st], [0], 2)
    assert 0 < r[st.label]["trials"][0]["key_fraction"] < 1 and "key_fraction" not in r["dense"]["trials"][0]
    assert "| K read |" in ev.report.retrieval_table(r)


def ev_tok():
    from test_evaluate import IdTok
    return IdTok()


def test_cli_eval_model_with_keys(tmp_path, monkeypatch):
    from test_evaluate import cli_tiny_model

    path = cli_tiny_model(tmp_path, monkeypatch)
    out, plot = tmp_path / "r.json", tmp_path / "r.png"
    r = CliRunner().invoke(ev.eval_command, [
        "model", "--model", str(path), "--device", "cpu", "--context", "30", "--steps", "3", "--greedy-tokens", "2",
        "--seeds", "0", "--no-grid", "--keys", "block:FB=16,f=0.5", "--keys", "bernoulli:R=1",
        "--setting", "iid/global/S=8/keys=block:FB=16,v=0.5", "--json", str(out), "--plot", str(plot)])
    assert r.exit_code == 0, r.output
    assert "| dense | - | - | block:FB=16,f=0.5 |" in r.output and "K read" in r.output
    data = json.loads(out.read_text())
    assert data["config"]["settings"] == ["iid/global/S=8/keys=block:FB=16,v=0.5", "dense/keys=block:FB=16,f=0.5",
                                          "dense/keys=bernoulli:R=1"]
    assert set(data["model"]["results"]) == {"dense"} | set(data["config"]["settings"])
    assert data["config"]["grid"] is False and data["config"]["samples"] == []
    from santa_cupy.cli.plotting import pyplot
    assert plot.exists() == (pyplot() is not None)
    r = CliRunner().invoke(ev.eval_command, ["kernel", "--model", str(path), "--device", "gpu", "--keys",
                                             "block:FB=16,f=0.5", "--no-grid"])
    assert r.exit_code == 2 and "--device cpu" in r.output
    r = CliRunner().invoke(ev.eval_command, ["kernel", "--small", "--keys", "block:FB=8,f=0.5"])
    assert r.exit_code == 2 and "key_block must be one of" in r.output


def test_eval_help_lists_key_options():
    for sub in ("kernel", "model", "retrieval", "all"):
        r = CliRunner().invoke(ev.eval_command, [sub, "--help"])
        assert r.exit_code == 0 and "--keys" in r.output and "--setting" in r.output and "--no-grid" in r.output


def test_decode_plan_refuses_key_sampling(monkeypatch):
    """A GPU plan has no key-sampling kernel: it refuses the setting instead of ignoring its fields."""
    import sys
    from tests.test_plan_host import _fake_cupy
    from santa_cupy import DecodePlan
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    with pytest.raises(NotImplementedError, match="key sampling"):
        DecodePlan(batch=1, heads=8, kv_heads=2, head_dim=128, max_length=256,
                   setting="dense/keys=block:FB=16,f=0.875")

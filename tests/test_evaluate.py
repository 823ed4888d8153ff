"""santa_cupy.cli.evaluation: metrics against hand-computed values; the pipelines on the tiny random Llama."""

import math

import click
import numpy as np
import pytest
from click.testing import CliRunner

from santa_cupy.cli import evaluation as ev
from llama_min.generate import generate
from llama_min.model import LlamaModel
from test_model import make_tiny

# ------------------------------------------------------------------------------ metrics


def test_relative_l2_hand_value():
    # diff = [3, -1] -> sqrt(10); ||ref|| = 5
    assert ev.metrics.relative_l2([3.0, 4.0], [0.0, 5.0]) == pytest.approx(math.sqrt(10) / 5, rel=1e-12)
    assert ev.metrics.relative_l2(np.ones((2, 3)), np.ones((2, 3))) == 0.0
    with pytest.raises(ValueError):
        ev.metrics.relative_l2([1.0], [0.0])
    with pytest.raises(ValueError):
        ev.metrics.relative_l2([1.0, 2.0], [1.0])


def test_log_softmax_hand_value_and_stability():
    np.testing.assert_allclose(ev.metrics.log_softmax([0.0, math.log(3)]), [math.log(0.25), math.log(0.75)],
                               rtol=1e-12)
    big = ev.metrics.log_softmax([1e4, 1e4 + math.log(3)])
    np.testing.assert_allclose(big, [math.log(0.25), math.log(0.75)], rtol=1e-9)
    assert ev.metrics.log_softmax(np.float32([[1, 2, 3]])).dtype == np.float64


def test_kl_hand_value():
    # p = [1/4, 3/4], q = [1/2, 1/2]
    want = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    kl = ev.metrics.kl_from_logits([[0.0, math.log(3)]], [[0.0, 0.0]])
    assert kl.shape == (1,) and kl[0] == pytest.approx(want, rel=1e-12)
    # shift invariance, large logits, and KL(p||p) = 0
    assert ev.metrics.kl_from_logits([[5e3, 5e3 + math.log(3)]], [[-7.0, -7.0]])[0] == pytest.approx(want, rel=1e-9)
    assert ev.metrics.kl_from_logits([[1.0, 2.0, 3.0]], [[1.0, 2.0, 3.0]])[0] == 0.0
    # asymmetric: KL(q||p) differs
    rev = ev.metrics.kl_from_logits([[0.0, 0.0]], [[0.0, math.log(3)]])[0]
    assert rev == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(2 / 3), rel=1e-12)


def test_top1_and_nll_and_perplexity():
    np.testing.assert_array_equal(ev.metrics.top1_agreement([[1, 2], [3, 0]], [[0, 5], [0, 1]]), [True, False])
    nll = ev.metrics.token_nll([[0.0, math.log(3)], [0.0, math.log(3)]], [1, 0])
    np.testing.assert_allclose(nll, [-math.log(0.75), -math.log(0.25)], rtol=1e-12)
    assert ev.metrics.perplexity([math.log(2), math.log(8)]) == pytest.approx(4.0, rel=1e-12)
    with pytest.raises(ValueError):
        ev.metrics.perplexity([])


def test_exact_match_length():
    assert ev.metrics.exact_match_length([1, 2, 3, 4], [1, 2, 5, 4]) == 2
    assert ev.metrics.exact_match_length([1, 2, 3], [1, 2, 3]) == 3
    assert ev.metrics.exact_match_length([1, 2, 3], [1, 2]) == 2
    assert ev.metrics.exact_match_length([7], [8]) == 0


def test_mean_std():
    assert ev.metrics.mean_std([1, 2, 3]) == (2.0, 1.0)          # sample std, ddof=1
    assert ev.metrics.mean_std([5]) == (5.0, 0.0)
    with pytest.raises(ValueError):
        ev.metrics.mean_std([])


def test_retrieval_scoring():
    assert ev.metrics.retrieval_success("The passcode is 48213.", 48213)
    assert ev.metrics.retrieval_success("48,213", 48213)
    assert not ev.metrics.retrieval_success("4821", 48213)
    assert not ev.metrics.retrieval_success("The code is 48312", 48213)
    assert ev.metrics.success_rate([True, False, True, True]) == 0.75
    with pytest.raises(ValueError):
        ev.metrics.success_rate([])


def test_exact_attention_matches_reference_dense():
    from santa_cupy import reference
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 6, 64))
    k = rng.standard_normal((2, 40, 3, 64))
    v = rng.standard_normal((2, 40, 3, 64))
    o = ev.metrics.exact_attention(q[:1], k[:1], v[:1], 25)
    want, _ = reference.dense_attention(q[:1], k[:1], v[:1], np.array([25]), 1 / 8)
    np.testing.assert_allclose(o, want, rtol=1e-10, atol=1e-12)
    # one row: the output is that row's value (per KV group)
    o1 = ev.metrics.exact_attention(q[:1], k[:1], v[:1], 1)
    np.testing.assert_allclose(o1[0, 4], v[0, 0, 2], rtol=1e-12)


# ------------------------------------------------------------------------------ tables / config


def test_kernel_table_formats_mean_std():
    res = {"dense": {"setting": {"method": "dense"}, "per_seed": [{"seed": 0, "layers": {0: 1e-7}, "mean": 1e-7}]},
           "x": {"setting": {"method": "santa", "sampler": "iid", "budget": "global", "samples": 64},
                 "per_seed": [{"seed": 0, "layers": {0: 0.1, 1: 0.3}, "mean": 0.2},
                              {"seed": 1, "layers": {0: 0.4, 1: 0.4}, "mean": 0.4}]}}
    t = ev.report.kernel_table(res).splitlines()
    assert t[0].startswith("| sampler | budget | S |")
    assert t[3] == "| iid | global | 64 | 0.3 ± 0.14 | 0.4 |"


def test_resolve_config_small_and_overrides():
    c = ev.config.resolve_config(True)
    assert c.samples == [64, 256] and c.context == 1024 and c.seeds == [0, 1]
    c = ev.config.resolve_config(True, samples="16,32", context=100)
    assert c.samples == [16, 32] and c.context == 100
    full = ev.config.resolve_config(False)
    assert full.samples == [16, 64, 256, 1024, 2048]
    with pytest.raises(Exception, match="sampler"):
        ev.config.resolve_config(False, samplers="bogus")


def test_select_layers():
    assert ev.config.select_layers("all", 3) == [0, 1, 2]
    assert ev.config.select_layers("0,-1", 30) == [0, 29]
    assert ev.config.select_layers("0,14,29", 2) == [0, 1]          # clamped for small models


def test_settings_grid():
    g = ev.settings.settings_grid(["iid", "systematic"], ["global"], [64, 256])
    assert [s.label for s in g] == ["iid/global/S=64", "iid/global/S=256",
                                    "systematic/global/S=64", "systematic/global/S=256"]
    run = ev.settings.run_setting(g[0], 5)
    assert run.seed == 5 and run.method == "santa" and run.santa_min_length == 0


# ------------------------------------------------------------------------------ texts


class WordTok:
    """Whitespace tokenizer: one id per word (ids assigned on first sight)."""

    has_chat_template = False

    def __init__(self):
        self.vocab = {}

    def encode(self, text, add_special_tokens=True):
        return [self.vocab.setdefault(w, len(self.vocab)) for w in text.split()]


def test_long_text_is_deterministic_and_exact_length():
    a = ev.texts.long_text_ids(WordTok(), 700)
    b = ev.texts.long_text_ids(WordTok(), 700)
    assert len(a) == 700 and a == b
    assert "As fact" in " ".join(ev.texts.long_text_paragraph(i) for i in range(10))


@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_retrieval_prompt_length_and_needle_depth(depth):
    tok = WordTok()
    code = ev.texts.passcode(300, depth, 0)
    assert 10000 <= code < 100000 and code == ev.texts.passcode(300, depth, 0)
    ids = ev.texts.retrieval_prompt_ids(tok, 300, depth, code)
    assert 280 <= len(ids) <= 300
    pos = ids.index(tok.vocab[f"{code}."])
    n_question = len(ev.texts.QUESTION.split())
    assert abs(pos / (len(ids) - n_question) - depth) < 0.05


# ------------------------------------------------------------------------------ pipelines (tiny model)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, _, _ = make_tiny(tmp_path_factory.mktemp("tiny_eval"), H=4, KVH=2, layers=2, max_pos=64)
    return LlamaModel.from_pretrained(path)


IDS = [1, 5, 9, 3, 7, 2, 11, 4, 8, 6, 10, 12, 3, 14, 15, 1, 9, 20, 21, 5, 7, 30]


def test_recorder_captures_every_layer_and_restores(tiny):
    cap = ev.runs.capture_attention_inputs(tiny, IDS)
    assert sorted(cap) == [0, 1]
    q, kc, vc, lens = cap[1]
    assert q.shape == (1, 4, 64) and kc.shape == (1, len(IDS), 2, 64) and int(lens[0]) == len(IDS)
    assert "_eager_attention" not in vars(tiny)
    # the captured caches are those of a full forward (prefill of all ids), layer by layer
    cache = ev.decoding.prefilled_cache(tiny, IDS, len(IDS))
    for li in (0, 1):
        np.testing.assert_allclose(cap[li][1], cache.k[li], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(cap[li][2], cache.v[li], rtol=1e-4, atol=1e-4)


def test_kernel_errors_dense_floor_and_decrease_with_S(tiny):
    cap = ev.runs.capture_attention_inputs(tiny, IDS)
    sts = ev.settings.settings_grid(["iid"], ["global"], [2, 4096])
    res = ev.runs.kernel_errors(cap, [0, 1], sts, seeds=[0, 1, 2])
    assert res["dense"]["per_seed"][0]["mean"] < 1e-5
    small = ev.metrics.mean_std([p["mean"] for p in res["iid/global/S=2"]["per_seed"]])[0]
    big = ev.metrics.mean_std([p["mean"] for p in res["iid/global/S=4096"]["per_seed"]])[0]
    assert small > 1e-3 and big < small / 5
    assert set(res["iid/global/S=2"]["per_seed"][0]["layers"]) == {0, 1}


def test_kernel_errors_run_the_estimator_at_every_length(tiny, monkeypatch):
    """The kernel eval measures SANTA itself: santa_min_length 0, so that the GPU's dense fallback
    below the crossover (~23k tokens) does not stand in for the estimator at the eval's 4k context
    (it did: SANTA's row read dense's error). Every call's setting is recorded."""
    import santa_cupy
    cap = ev.runs.capture_attention_inputs(tiny, IDS)
    calls = []
    real = santa_cupy.decode_attention

    def recording(q, k, v, lengths, setting, **kw):
        calls.append(setting)
        return real(q, k, v, lengths, setting, **kw)
    monkeypatch.setattr(santa_cupy, "decode_attention", recording)
    ev.runs.kernel_errors(cap, [0], ev.settings.settings_grid(["systematic"], ["global"], [16]), seeds=[0, 1])
    santa = [c for c in calls if c.method == "santa"]
    assert len(santa) == 2 and all(c.santa_min_length == 0 for c in santa)
    assert {c.seed for c in santa} == {0, 1}


def test_teacher_forced_dense_matches_logits_all(tiny):
    prefix = 10
    cache0 = ev.decoding.prefilled_cache(tiny, IDS[:prefix], len(IDS))
    lg = ev.runs.teacher_forced(tiny, cache0, IDS, prefix, ev.settings.run_setting(ev.settings.DENSE, 0))
    full = tiny.logits_all(np.asarray(IDS))
    assert lg.shape == (len(IDS) - 1 - prefix, 37)
    np.testing.assert_allclose(lg, full[prefix:-1], rtol=1e-4, atol=1e-4)
    assert cache0.length == prefix                     # the shared prefill is not advanced


def test_greedy_matches_generate(tiny):
    prefix, n = 8, 6
    cache0 = ev.decoding.prefilled_cache(tiny, IDS[:prefix], prefix + n + 2)
    got = ev.runs.greedy_tokens(tiny, cache0, IDS[prefix], n, ev.settings.run_setting(ev.settings.DENSE, 0))
    want = generate(tiny, IDS[:prefix + 1], max_new_tokens=n).generated_tokens
    assert got == want


def test_model_metrics_structure_and_dense_limit(tiny):
    sts = ev.settings.settings_grid(["systematic"], ["global"], [1, 4096])
    res = ev.runs.model_metrics(tiny, IDS, 12, sts, seeds=[0, 1], greedy_n=5)
    assert res["steps"] == len(IDS) - 13
    r = res["results"]
    d = r["dense"]["per_seed"][0]
    targets = IDS[13:]
    full = tiny.logits_all(np.asarray(IDS))[12:-1]
    assert d["ppl"] == pytest.approx(ev.metrics.perplexity(ev.metrics.token_nll(full, targets)), rel=1e-4)
    big = r["systematic/global/S=4096"]["per_seed"]
    one = r["systematic/global/S=1"]["per_seed"]
    assert all(p["kl"] < 1e-4 and p["top1"] == 1.0 and p["greedy_match"] == 5 for p in big)
    assert np.mean([p["kl"] for p in one]) > 10 * np.mean([p["kl"] for p in big])
    md = ev.report.model_table(res)
    assert "systematic | global | 4096" in md


class IdTok(WordTok):
    """Word tokenizer folded into the tiny vocabulary (37 ids); decode shows the ids."""

    eos_ids = [2]

    def encode(self, text, add_special_tokens=True):
        return [3 + i % 30 for i in super().encode(text)]

    def decode(self, ids):
        return " ".join(str(i) for i in ids)


def test_retrieval_trials_structure(tiny):
    sts = ev.settings.settings_grid(["iid"], ["global"], [16])
    res = ev.runs.retrieval_trials(tiny, IdTok(), [40], [0.5], 2, sts, seeds=[0, 1], answer_tokens=3)
    assert len(res["dense"]["trials"]) == 2 and len(res["iid/global/S=16"]["trials"]) == 4
    t = res["dense"]["trials"][0]
    assert t["tokens"] <= 40 and t["success"] == ev.metrics.retrieval_success(t["answer"], t["code"])
    assert "L=40" in ev.report.retrieval_table(res)


# ------------------------------------------------------------------------------ CLI


def test_cli_registers_eval_with_subcommands():
    from santa_cupy.cli import main as cli
    r = CliRunner().invoke(cli.main, ["eval", "--help"])
    assert r.exit_code == 0, r.output
    for sub in ("kernel", "model", "retrieval", "all", "merge"):
        assert sub in r.output
    r = CliRunner().invoke(cli.main, ["eval", "kernel", "--help"])
    assert "--samples" in r.output and "--small" in r.output and "--layers" in r.output


def cli_tiny_model(tmp_path, monkeypatch):
    """A tiny random checkpoint directory for the eval CLI, its tokenizer the id tokenizer."""
    class Tok(IdTok):
        @classmethod
        def from_dir(cls, path):
            return cls()

    monkeypatch.setattr("llama_min.tokenizer.Tokenizer", Tok)
    (tmp_path / "m").mkdir()
    return make_tiny(tmp_path / "m", H=4, KVH=2, layers=2, max_pos=64)[0]


def test_cli_kernel_on_tiny_model(tiny, tmp_path, monkeypatch):
    import json

    path = cli_tiny_model(tmp_path, monkeypatch)
    out = tmp_path / "r.json"
    r = CliRunner().invoke(ev.eval_command, [
        "kernel", "--model", str(path), "--device", "cpu", "--context", "30", "--samplers", "stratified",
        "--budgets", "fixed", "--samples", "8", "--seeds", "0", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "| stratified | fixed | 8 |" in r.output
    data = json.loads(out.read_text())
    assert data["kernel"]["context"] == 30 and data["kernel"]["layers"] == [0, 1]


def test_greedy_margins_are_top1_minus_top2(tiny):
    cache0 = ev.decoding.prefilled_cache(tiny, IDS[:8], 16)
    margins = []
    toks = ev.runs.greedy_tokens(tiny, cache0, IDS[8], 3, ev.settings.run_setting(ev.settings.DENSE, 0), margins=margins)
    cache = ev.decoding.clone_cache(tiny, cache0)
    first = ev.decoding.decode_logits(tiny, cache, IDS[8], ev.settings.run_setting(ev.settings.DENSE, 0))
    s = np.sort(first.astype(np.float64))
    assert len(margins) == 3 and margins[0] == pytest.approx(s[-1] - s[-2], rel=1e-6) and toks[0] == np.argmax(first)


# ------------------------------------------------------------------------------ GPU (CuPy) path


def _cupy_or_skip():
    cp = pytest.importorskip("cupy")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no CUDA device ({e})")
    return cp


@pytest.fixture(scope="module")
def tiny_gpu(tmp_path_factory):
    _cupy_or_skip()
    path, _, _ = make_tiny(tmp_path_factory.mktemp("tiny_eval_gpu"), H=4, KVH=2, layers=2, max_pos=64)
    return LlamaModel.from_pretrained(path, device="gpu", dtype="float32")


@pytest.mark.gpu
def test_gpu_kernel_errors(tiny_gpu):
    cap = ev.runs.capture_attention_inputs(tiny_gpu, IDS)
    assert type(cap[0][0]).__module__.startswith("cupy")
    sts = ev.settings.settings_grid(["systematic", "iid"], ["global", "fixed"], [2, 4096])
    res = ev.runs.kernel_errors(cap, [0, 1], sts, seeds=[0, 1])
    assert res["dense"]["per_seed"][0]["mean"] < 1e-5
    for sm in ("systematic", "iid"):
        for bu in ("global", "fixed"):
            lo = np.mean([p["mean"] for p in res[f"{sm}/{bu}/S=4096"]["per_seed"]])
            hi = np.mean([p["mean"] for p in res[f"{sm}/{bu}/S=2"]["per_seed"]])
            assert lo < hi / 5, (sm, bu, lo, hi)


@pytest.mark.gpu
def test_gpu_model_and_retrieval(tiny_gpu):
    sts = ev.settings.settings_grid(["systematic"], ["global"], [4096])
    res = ev.runs.model_metrics(tiny_gpu, IDS, 12, sts, seeds=[0], greedy_n=5)
    p = res["results"]["systematic/global/S=4096"]["per_seed"][0]
    assert p["kl"] < 1e-3 and p["greedy_match"] == 5
    r = ev.runs.retrieval_trials(tiny_gpu, IdTok(), [40], [0.5], 1, sts, seeds=[0], answer_tokens=3)
    assert len(r["systematic/global/S=4096"]["trials"]) == 1


# ------------------------------------------------------------------------------ merging split runs


def _retrieval_run(budgets, settings, dense_answer="1234", seconds=10.0):
    """A minimal `eval retrieval --json` result of one run split by --budgets."""
    def trials(ok):
        return [{"length": 1024, "tokens": 1030, "depth": 0.5, "needle": 0, "seed": 0, "code": 1234,
                 "answer": "1234" if ok else "no", "success": ok}]
    results = {"dense": {"setting": {"method": "dense", "sampler": "", "budget": "", "samples": 0},
                         "trials": trials(dense_answer == "1234")}}
    for label, ok in settings.items():
        sampler, budget, S = label.split("/")
        results[label] = {"setting": {"method": "santa", "sampler": sampler, "budget": budget,
                                      "samples": int(S.removeprefix("S="))}, "trials": trials(ok)}
    config = {"model": "m", "device": "gpu", "kv_dtype": "float16", "samplers": ["systematic"], "budgets": budgets,
              "samples": [16], "seeds": [0], "block_n": None, "small": False, "seconds": seconds}
    return {"config": config, "retrieval": {"lengths": [1024], "depths": [0.5], "needles": 1, "results": results,
                                           "seconds": seconds}}


def test_merge_results_unites_settings_and_checks_the_rest():
    a = _retrieval_run(["global"], {"systematic/global/S=16": True}, seconds=10.0)
    b = _retrieval_run(["fixed"], {"systematic/fixed/S=16": False}, seconds=4.5)
    m = ev.report.merge_results([a, b])
    assert list(m["retrieval"]["results"]) == ["dense", "systematic/global/S=16", "systematic/fixed/S=16"]
    assert m["config"]["budgets"] == ["global", "fixed"] and m["config"]["merged_from"] == 2
    assert m["retrieval"]["seconds"] == 14.5 and m["config"]["seconds"] == 14.5
    assert m["retrieval"]["lengths"] == [1024]
    table = ev.report.retrieval_table(m["retrieval"]["results"])
    assert "| systematic | global | 16 | 1.00 (1/1)" in table and "| systematic | fixed | 16 | 0.00 (0/1)" in table
    # dense must be the same in every run; so must the grid and the model
    with pytest.raises(ValueError, match="'dense'"):
        ev.report.merge_results([a, _retrieval_run(["fixed"], {}, dense_answer="9")])
    c = _retrieval_run(["fixed"], {})
    c["retrieval"]["lengths"] = [2048]
    with pytest.raises(ValueError, match="lengths"):
        ev.report.merge_results([a, c])
    d = _retrieval_run(["fixed"], {})
    d["config"]["seeds"] = [0, 1]
    with pytest.raises(ValueError, match="seeds"):
        ev.report.merge_results([a, d])
    with pytest.raises(ValueError, match="nothing"):
        ev.report.merge_results([])


def test_cli_merge_writes_one_report(tmp_path):
    import json

    paths = []
    for i, run in enumerate([_retrieval_run(["global"], {"systematic/global/S=16": True}),
                             _retrieval_run(["fixed"], {"systematic/fixed/S=16": True})]):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(run))
    out, md = tmp_path / "merged.json", tmp_path / "merged.md"
    r = CliRunner().invoke(ev.eval_command, ["merge", *map(str, paths), "--json", str(out), "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    assert len(json.loads(out.read_text())["retrieval"]["results"]) == 3
    assert "| systematic | fixed | 16 |" in md.read_text()
    bad = _retrieval_run(["fixed"], {}, dense_answer="9")
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    r = CliRunner().invoke(ev.eval_command, ["merge", str(paths[0]), str(tmp_path / "bad.json")])
    assert r.exit_code != 0 and "cannot merge" in r.output


@pytest.mark.parametrize("args,option", [
    (["--samples", "0"], "--samples"), (["--samples", "-5"], "--samples"), (["--samples", "abc"], "--samples"),
    (["--samples", "64,,2"], "--samples"), (["--seeds", "-1"], "--seeds"), (["--steps", "0"], "--steps"),
    (["--samplers", "iid,bogus"], "--samplers"), (["--budgets", "half"], "--budgets"),
    (["--depths", "1.5"], "--depths"), (["--lengths", "x"], "--lengths"), (["--needles", "0"], "--needles"),
    (["--block-n", "32"], "--block-n"), (["--context", "0"], "--context"), (["--layers", "1,x"], "--layers"),
    (["--greedy-tokens", "-1"], "--greedy-tokens"), (["--answer-tokens", "0"], "--answer-tokens"),
])
def test_eval_options_rejected_before_loading(args, option, monkeypatch):
    """Exit 2 with one error line naming the option, and no model resolved or loaded."""
    monkeypatch.setattr("llama_min.models.resolve_model", lambda *a, **k: pytest.fail("model resolved"))
    r = CliRunner().invoke(ev.eval_command, ["all", "--small", *args])
    assert r.exit_code == 2, r.output
    err = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and option in err[0], r.output
    assert "Traceback" not in r.output


def test_eval_lengths_beyond_context_rejected_or_noted(tmp_path):
    cfg = ev.config.resolve_config(True, lengths=[40, 99999])
    with pytest.raises(click.BadParameter, match="99999 beyond the model's context: at most 46"):
        ev.config.check_lengths_fit(cfg, 64, ["retrieval"])
    assert ev.config.check_lengths_fit(cfg, 64, ["kernel"]) == []                # lengths unused there
    notes = ev.config.check_lengths_fit(ev.config.resolve_config(True), 64, ["retrieval"])  # the default grid
    assert notes and "capped at 46" in notes[0]
    with pytest.raises(click.BadParameter, match="context"):
        ev.config.check_lengths_fit(ev.config.resolve_config(True, context=5000), 64, ["model"])
    assert ev.config.resolve_config(True, samples=[16, 32]).samples == [16, 32]   # parsed lists pass through


def test_eval_layers_beyond_the_model_rejected_given_clamped_preset():
    with pytest.raises(click.BadParameter, match="99 out of range: the model has 30 layers"):
        ev.config.check_lengths_fit(ev.config.resolve_config(True, layers="0,99"), 8192, ["kernel"], 30)
    with pytest.raises(click.BadParameter, match="-31 out of range"):
        ev.config.check_lengths_fit(ev.config.resolve_config(True, layers="-31"), 8192, ["kernel"], 30)
    fit, resolve = ev.config.check_lengths_fit, ev.config.resolve_config
    assert fit(resolve(True, layers="0,99"), 8192, ["model"], 30) == []  # unused there
    assert fit(resolve(True), 8192, ["kernel"], 2) == []   # the preset's 0,14,29
    assert ev.config.select_layers("0,14,29", 2) == [0, 1]
    with pytest.raises(click.BadParameter, match="14, 29 out of range") as e:
        ev.config.select_layers("0,14,29", 2, clamp=False)
    assert "--layers" in e.value.format_message()

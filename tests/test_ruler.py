"""santa_cupy.cli.evaluation.ruler: RULER's metrics on hand-made cases, the jsonl reader, the report's statistics,
the CLI on a tiny random model (no RULER package, no network), and (when the package is installed)
its generator on a byte-level tokenizer."""

import gzip
import json
import math
import subprocess
import sys
from pathlib import Path

import click
import numpy as np
import pytest
from click.testing import CliRunner

from santa_cupy import AttentionSetting
from santa_cupy.cli import evaluation as ev
from santa_cupy.cli.evaluation import ruler as er
from test_model import make_tiny

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------------------------------------ metrics


def test_string_match_all_is_the_fraction_of_references_found():
    assert er.scoring.string_match_all("The numbers are 1234567 and 7654321.", ["1234567", "7654321"]) == 1.0
    assert er.scoring.string_match_all("only 1234567", ["1234567", "7654321", "111", "1234"]) == 0.5
    assert er.scoring.string_match_all("nothing here", ["1234567"]) == 0.0
    assert er.scoring.string_match_all("ANSWER: Blue-Whale", ["blue-whale"]) == 1.0        # case-insensitive
    with pytest.raises(ValueError):
        er.scoring.string_match_all("x", [])


def test_string_match_part_is_any_reference():
    assert er.scoring.string_match_part("Paris, of course", ["Paris", "the city of Paris"]) == 1.0
    assert er.scoring.string_match_part("london", ["Paris", "Lyon"]) == 0.0
    assert er.scoring.string_match_part("PARIS", ["paris", "zzz"]) == 1.0
    assert er.scoring.string_match_part("the city of paris", ["paris", "city of paris"]) == 1.0


def test_postprocess_strips_and_turns_control_characters_into_newlines():
    assert er.scoring.postprocess_pred("  7 \n") == "7"
    assert er.scoring.postprocess_pred("a\x01b\tc") == "a\nb\nc"
    assert er.scoring.postprocess_pred(None) == ""
    # a reference with a tab no longer matches (the prediction's tab became a newline), as in RULER
    assert er.scoring.string_match_all("x a\tb", ["a\tb"]) == 0.0


def test_score_picks_the_metric_of_the_task():
    refs = ["alpha", "beta"]
    assert er.scoring.score("niah_multivalue", "alpha only", refs) == 0.5       # string_match_all
    assert er.scoring.score("qa_2", "alpha only", refs) == 1.0                  # string_match_part
    assert er.scoring.score("cwe", "alpha beta", refs) == 1.0
    assert er.scoring.score("niah_custom_x", "beta", refs) == 0.5               # niah* family
    with pytest.raises(click.ClickException, match="unknown RULER task"):
        er.scoring.score("summaries", "x", refs)


def test_every_standard_task_has_a_family_and_token_count():
    assert len(er.tasks.STANDARD_TASKS) == 13
    counts = {t: er.tasks.TOKENS_TO_GENERATE[er.scoring.task_family(t)] for t in er.tasks.STANDARD_TASKS}
    assert counts["niah_single_1"] == 128 and counts["vt"] == 30 and counts["cwe"] == 120
    assert counts["fwe"] == 50 and counts["qa_1"] == 32


# ------------------------------------------------------------------------------ jsonl files


def _write(path, records, gz=False):
    text = "\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n"
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_task_and_length_from_path():
    assert er.data.task_and_length_from_path("d/niah_single_1_4096.jsonl.gz") == ("niah_single_1", 4096)
    assert er.data.task_and_length_from_path("run/8192/data/qa_1/validation.jsonl") == ("qa_1", 8192)
    assert er.data.task_and_length_from_path("somewhere/cwe.jsonl") == ("cwe", None)
    assert er.data.task_and_length_from_path("d/qa_2_8192.jsonl.xz") == ("qa_2", 8192)


def test_read_jsonl_plain_and_gz(tmp_path):
    recs = [{"index": 0, "input": "Question? Answer:", "outputs": ["7"], "length": 3900},
            {"index": 1, "input": "Q2", "outputs": ["a", "b"], "length": 3000, "answer_prefix": " A:"}]
    for gz, name in ((False, "vt.jsonl"), (True, "vt.jsonl.gz")):
        got = er.data.read_jsonl(_write(tmp_path / name, recs, gz))
        assert [r["task"] for r in got] == ["vt", "vt"]
        assert [r["max_seq_length"] for r in got] == [4096, 4096]        # next power of two of 'length'
        assert got[1]["outputs"] == ["a", "b"] and got[1]["answer_prefix"] == " A:"
    assert er.data.prompt_text(got[1]) == "Q2 A:"
    assert er.data.prompt_text({"input": "Q2 A:", "answer_prefix": " A:"}) == "Q2 A:"       # not twice
    # a 'task' / 'max_seq_length' field beats the name
    got = er.data.read_jsonl(_write(tmp_path / "x_1024.jsonl", [{"task": "qa_1", "max_seq_length": 2048,
                                                           "input": "q", "outputs": ["r"]}]))
    assert got[0]["task"] == "qa_1" and got[0]["max_seq_length"] == 2048 and got[0]["index"] == 0


@pytest.mark.parametrize("lines, match", [
    (['{"input": "q", "outputs": ["a"], "length": 10}', "{not json"], r"vt\.jsonl:2: not JSON"),
    (['{"input": "q", "length": 10}'], "'outputs' must be a non-empty list"),
    (['{"input": "q", "outputs": [], "length": 10}'], "'outputs' must be a non-empty list"),
    (['{"outputs": ["a"], "length": 10}'], "no 'input' text"),
    (['[1, 2]'], "must be a JSON object"),
    (['{"input": "q", "outputs": ["a"]}'], "no length"),
    ([""], "no records"),
])
def test_read_jsonl_bad_files_are_one_clear_error(tmp_path, lines, match):
    path = tmp_path / "vt.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(click.ClickException, match=match):
        er.data.read_jsonl(path)


def test_read_jsonl_unknown_task_and_unreadable_gz(tmp_path):
    with pytest.raises(click.ClickException, match=r"essays\.jsonl:1: unknown RULER task 'essays'"):
        er.data.read_jsonl(_write(tmp_path / "essays.jsonl", [{"input": "q", "outputs": ["a"], "length": 9}]))
    bad = tmp_path / "vt.jsonl.gz"
    bad.write_bytes(b"not gzip at all")
    with pytest.raises(click.ClickException, match="cannot read"):
        er.data.read_jsonl(bad)


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz", ".jsonl.xz"])
def test_write_jsonl_round_trip_and_deterministic(tmp_path, suffix):
    recs = [{"task": "fwe", "max_seq_length": 4096, "index": i, "input": "ü x", "outputs": ["x"], "length": 5}
            for i in range(2)]
    a, b = tmp_path / f"fwe_4096{suffix}", tmp_path / "b" / f"fwe_4096{suffix}"
    b.parent.mkdir()
    er.data.write_jsonl(a, recs)
    er.data.write_jsonl(b, recs)
    assert a.read_bytes() == b.read_bytes()
    got = er.data.read_jsonl(a)
    assert [r["index"] for r in got] == [0, 1] and got[0]["input"] == "ü x" and got[0]["task"] == "fwe"


# ------------------------------------------------------------------------------ settings


def test_parse_setting_uses_the_setting_labels():
    st = er.runs.parse_setting("systematic/global/S=256")
    assert st == AttentionSetting(method="santa", sampler="systematic", budget="global", samples=256)
    assert st.label == str(st) == "systematic/global/S=256"
    assert er.runs.parse_setting("dense") is ev.settings.DENSE
    assert er.runs.parse_setting(" iid/fixed/S=2048 ").samples == 2048
    for bad in ("systematic/global", "foo/global/S=4", "iid/one_pass/S=256", "iid/fixed/S=0", "S=256"):
        with pytest.raises(click.BadParameter):
            er.runs.parse_setting(bad)
    labels = [s.label for s in er.runs.SettingList().convert(",".join(er.tasks.DEFAULT_SETTINGS), None, None)]
    assert labels == list(er.tasks.DEFAULT_SETTINGS)


# ------------------------------------------------------------------------------ statistics


def _rec(task, L, setting, index, score, seed=0):
    return {"task": task, "max_seq_length": L, "setting": setting, "index": index, "seed": seed,
            "score": score, "prefill_s": 1.0 if setting == "dense" else 0.0, "decode_s": 0.5, "new_tokens": 3}


def test_binomial_se_and_samples_to_resolve():
    assert er.summary.binomial_se(0.75, 4) == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert er.summary.binomial_se(1.0, 10) == 0.0
    with pytest.raises(ValueError):
        er.summary.binomial_se(0.5, 0)
    # SE of a difference 2 points at n = 50: 2 points is one SE, four times the samples make it two
    assert er.summary.samples_to_resolve(2.0, 50) == 200
    assert er.summary.samples_to_resolve(0.5, 50) == 13
    assert er.summary.samples_to_resolve(0.0, 5) is None                 # no spread seen: nothing to scale
    # the report's paired rule: 13 tasks, a fraction d of samples 1 apart -> about 770 d per task
    d, n = 0.065, 50
    per_task_se = 100 * math.sqrt(d / n)                          # std of the differences ~ sqrt(d)
    assert er.summary.samples_to_resolve(math.sqrt(13 * per_task_se ** 2) / 13, n) == pytest.approx(770 * d, abs=1)
    # the report's worst case: 13 tasks at p = 0.5, independent samples -> 385 per task
    def needed(n):
        se_avg = math.sqrt(13 * (100 * er.summary.binomial_se(0.5, n)) ** 2) / 13
        return er.summary.samples_to_resolve(math.hypot(se_avg, se_avg), n)
    assert needed(385) == 385 and needed(100) == 385


def test_summarize_per_task_average_parity_and_pairs():
    L = 4096
    dense_a, santa_a = [1, 1, 0, 1], [1, 0, 0, 1]
    dense_b = [0, 0, 0, 0.5]                       # dense 12.5 < 20: flagged, left out of parity
    recs = [_rec("niah_single_1", L, "dense", i, s) for i, s in enumerate(dense_a)]
    recs += [_rec("fwe", L, "dense", i, s) for i, s in enumerate(dense_b)]
    # two seeds for the setting: sample 1 scores 0 and 0 (mean 0); sample 3 scores 1 and 1
    for seed in (0, 1):
        recs += [_rec("niah_single_1", L, "systematic/global/S=256", i, s, seed) for i, s in enumerate(santa_a)]
        recs += [_rec("fwe", L, "systematic/global/S=256", i, s, seed) for i, s in enumerate([0, 0, 1, 0.5])]
    summ = er.summary.summarize(recs, ["dense", "systematic/global/S=256"])
    b = summ["lengths"][L]
    assert b["tasks"] == ["niah_single_1", "fwe"] and b["flagged"] == ["fwe"]
    d = b["settings"]["dense"]["tasks"]["niah_single_1"]
    assert d["score"] == 75.0 and d["fails"] == 1 and d["se"] == pytest.approx(100 * math.sqrt(.75 * .25 / 4))
    s = b["settings"]["systematic/global/S=256"]["tasks"]["niah_single_1"]
    assert s["score"] == 50.0 and s["delta"] == -25.0 and (s["lost"], s["gained"]) == (1, 0)
    assert s["delta_se"] == pytest.approx(100 * np.std([0, -1, 0, 0], ddof=1) / 2)
    f = b["settings"]["systematic/global/S=256"]["tasks"]["fwe"]
    assert f["score"] == 37.5 and (f["lost"], f["gained"]) == (0, 1)
    avg = b["settings"]["systematic/global/S=256"]["average"]
    assert avg["tasks"] == 2 and avg["score"] == pytest.approx((50 + 37.5) / 2)
    assert avg["se"] == pytest.approx(math.hypot(s["se"], f["se"]) / 2)
    par = b["settings"]["systematic/global/S=256"]["parity_average"]
    assert par["tasks"] == 1 and par["score"] == 50.0 and par["delta"] == -25.0
    assert par["samples_to_resolve_2pt_paired"] == er.summary.samples_to_resolve(s["delta_se"], 4)
    assert b["settings"]["dense"]["parity_average"]["score"] == 75.0


def test_report_markdown_flags_and_shows_dense_failures():
    recs = [_rec("qa_1", 8192, "dense", i, s) for i, s in enumerate([1, 0, 1])]
    recs += [_rec("qa_1", 8192, "iid/fixed/S=16", i, s) for i, s in enumerate([1, 1, 0])]
    recs += [_rec("cwe", 8192, "dense", i, 0.1) for i in range(3)]
    recs += [_rec("cwe", 8192, "iid/fixed/S=16", i, 0.1) for i in range(3)]
    labels = ["dense", "iid/fixed/S=16"]
    res = {"config": {"model": "m", "device": "cpu", "kv_dtype": "float32", "seeds": [0], "data": "files",
                      "max_new_tokens": 5, "full_answers": False, "seconds": 1.0, "settings": labels},
           "summary": er.summary.summarize(recs, labels), "timings": er.summary.timings(recs)}
    md = er.report.report_markdown(res)
    assert "cwe ⚑" in md and "qa_1 ⚑" not in md
    assert "66.7 ± 27.2 (1 fail)" in md                       # dense's own failure beside
    assert "66.7 ± 27.2 (+0.0; −1/+1)" in md
    assert "## L = 8192" in md and "samples for 2 pts (paired)" in md
    # the JSON round trip (lengths become strings) still renders
    again = json.loads(json.dumps(res))
    assert er.report.report_markdown(again) == md


# ------------------------------------------------------------------------------ CLI (tiny model)


class CharTok:
    """One id per character folded into the tiny vocabulary (37 ids, 2 = EOS); decode spells ids."""

    eos_ids = [2]

    @classmethod
    def from_dir(cls, path):
        return cls()

    def encode(self, text, add_special_tokens=True):
        return [3 + ord(c) % 34 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + (int(i) - 3) % 26) for i in ids if int(i) != 2)


def test_cli_registers_ruler():
    from santa_cupy.cli import main as cli
    r = CliRunner().invoke(cli.main, ["eval", "--help"])
    assert r.exit_code == 0 and "ruler" in r.output
    r = CliRunner().invoke(cli.main, ["eval", "ruler", "--help"])
    assert r.exit_code == 0 and "--data" in r.output and "--settings" in r.output


@pytest.mark.parametrize("order", ["santa_cupy.cli.evaluation.ruler, santa_cupy.cli.evaluation",
                                   "santa_cupy.cli.evaluation, santa_cupy.cli.evaluation.ruler"])
def test_either_import_order_registers_ruler(order):
    code = f"import {order}; import santa_cupy.cli.evaluation as ev; assert 'ruler' in ev.eval_command.commands"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_cli_on_tiny_model_with_data(tmp_path, monkeypatch):
    monkeypatch.setattr("llama_min.tokenizer.Tokenizer", CharTok)
    (tmp_path / "m").mkdir()
    path = make_tiny(tmp_path / "m", H=4, KVH=2, layers=2, max_pos=64)[0]
    data = _write(tmp_path / "niah_single_1.jsonl.gz", [
        # an empty reference is found at once: the early stop after one token
        {"index": 0, "input": "the magic number is", "outputs": [""], "length": 25, "max_seq_length": 64},
        {"index": 1, "input": "what is the code", "outputs": ["zzqqzzqq"], "length": 22, "max_seq_length": 64},  # never
        {"index": 2, "input": "third prompt here", "outputs": ["x"], "length": 23, "max_seq_length": 64}], gz=True)
    out, md = tmp_path / "r.json", tmp_path / "r.md"
    r = CliRunner().invoke(ev.eval_command, [
        "ruler", "--model", str(path), "--device", "cpu", "--data", str(data), "--settings",
        "dense,systematic/global/S=4,systematic/one_pass/S=8", "--seeds", "0,1", "--max-new-tokens", "5",
        "--json", str(out), "--markdown", str(md)])
    assert r.exit_code == 0, r.output
    res = json.loads(out.read_text())
    recs = res["records"]
    assert len(recs) == 3 * (1 + 2 * 2)
    assert {x["setting"] for x in recs} == {"dense", "systematic/global/S=4", "systematic/one_pass/S=8"}
    first = [x for x in recs if x["index"] == 0]
    assert all(x["score"] == 1.0 and x["new_tokens"] <= 1 for x in first)         # early stop
    never = [x for x in recs if x["index"] == 1]
    assert all(x["score"] == 0.0 and x["new_tokens"] <= 5 for x in never)
    assert all(x["score"] == er.scoring.score("niah_single_1", x["pred"], x["outputs"]) for x in recs)
    b = res["summary"]["lengths"]["64"]
    assert b["settings"]["dense"]["tasks"]["niah_single_1"]["n"] == 3
    assert "## L = 64" in md.read_text() and "niah_single_1" in r.output
    assert "niah_single_1 #2 L=64 (17 tokens): prefill" in r.output        # one line per sample
    # --full-answers decodes every token of the solved sample too
    r = CliRunner().invoke(ev.eval_command, [
        "ruler", "--model", str(path), "--device", "cpu", "--data", str(data), "--settings", "dense",
        "--max-new-tokens", "4", "--full-answers", "--samples", "1", "--json", str(out)])
    assert r.exit_code == 0, r.output
    (rec,) = json.loads(out.read_text())["records"]
    assert rec["index"] == 0 and rec["new_tokens"] == 4           # (this model draws no EOS there)
    assert rec["score"] == 1.0


def test_cli_missing_package_is_one_line_usage_error(monkeypatch):
    real = er.generation._have
    monkeypatch.setattr(er.generation, "_have", lambda m: False if m == "long_context_eval" else real(m))
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--tasks", "vt", "--lengths", "4096",
                                             "--model", "/nonexistent"])
    assert r.exit_code == 2
    assert "pip install 'santa-cupy[ruler]'" in r.output and "--data" in r.output
    assert "long_context_eval" in r.output and len(r.output.strip().splitlines()[-1]) > 40


def test_cli_data_errors(tmp_path):
    bad = tmp_path / "vt.jsonl"
    bad.write_text('{"input": "q"}\n')
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--data", str(bad), "--model", str(tmp_path / "no")])
    assert r.exit_code == 1 and "vt.jsonl:1: 'outputs' must be a non-empty list" in r.output   # before the model
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--settings", "dense,iid/nope/S=4"])
    assert r.exit_code == 2 and "--settings" in r.output
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--generate-only"])
    assert r.exit_code == 2 and "--save-data" in r.output


# ------------------------------------------------------------------------------ the RULER package


@pytest.mark.slow
@pytest.mark.skipif(not er.generation._have("long_context_eval") or not er.generation._have("wonderwords"),
                    reason="nvidia-long-context-eval is not installed")
def test_package_generates_niah_with_our_tokenizer(tmp_path):
    from test_tokenizer import make_dir
    tokdir = make_dir(tmp_path)                      # byte-level: one token per byte
    recs = er.generation.generate_task("niah_single_1", 1024, 2, tokdir)
    assert len(recs) == 2
    for r in recs:
        assert r["task"] == "niah_single_1" and r["max_seq_length"] == 1024
        assert r["length"] <= 1024 and len(r["input"].encode()) + 128 == r["length"]
        (code,) = r["outputs"]
        assert code.isdigit() and len(code) == 7 and code in r["input"]
        assert r["input"].startswith("A special magic number is hidden")       # base template
        assert r["input"].endswith("mentioned in the provided text is")       # + answer prefix
    assert recs[0]["outputs"] != recs[1]["outputs"]
    again = er.generation.generate_task("niah_single_1", 1024, 2, tokdir)
    assert [r["input"] for r in again] == [r["input"] for r in recs]         # seeded: reproducible


def test_merge_runs_unites_records_and_rejects_conflicts(tmp_path):
    base = {"model": "m", "device": "cpu", "kv_dtype": "float32", "seeds": [0], "data": "files",
            "max_new_tokens": 5, "full_answers": False, "block_n": None, "seconds": 2.0}
    a = [_rec("vt", 4096, lab, i, float(lab == "dense")) for lab in ("dense", "iid/fixed/S=16") for i in range(2)]
    b = [_rec("vt", 8192, lab, i, float(lab != "dense")) for lab in ("dense", "iid/fixed/S=16") for i in range(2)]
    labels = ["dense", "iid/fixed/S=16"]
    for name, recs in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps({"config": {**base, "settings": labels}, "records": recs + a[:1]}))
    out = tmp_path / "m.json"
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--merge", str(tmp_path / "a.json"), "--merge",
                                             str(tmp_path / "b.json"), "--json", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads(out.read_text())
    assert len(m["records"]) == 8 and m["config"]["seconds"] == 4.0
    assert m["summary"]["lengths"]["8192"]["settings"]["iid/fixed/S=16"]["tasks"]["vt"]["delta"] == 100.0
    bad = dict(a[0], score=0.5)
    (tmp_path / "c.json").write_text(json.dumps({"config": {**base, "settings": labels}, "records": [bad]}))
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--merge", str(tmp_path / "a.json"), "--merge",
                                             str(tmp_path / "c.json")])
    assert r.exit_code == 1 and "differs from an earlier run" in r.output


def test_plot_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    recs = [_rec("vt", 4096, lab, i, s) for lab in ("dense", "iid/fixed/S=16") for i, s in enumerate([1, 0])]
    res = {"config": {"settings": ["dense", "iid/fixed/S=16"]},
           "summary": er.summary.summarize(recs, ["dense", "iid/fixed/S=16"])}
    er.report.write_plot(str(tmp_path / "p.png"), res)
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_samples_skips_a_prompt_beyond_the_context_and_shortens_a_long_one(tmp_path):
    from llama_min.model import LlamaModel
    model = LlamaModel.from_pretrained(make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)[0])
    recs = [{"task": "fwe", "max_seq_length": 64, "index": 0, "input": "w" * 70, "outputs": ["x"]},
            {"task": "fwe", "max_seq_length": 64, "index": 1, "input": "w" * 60, "outputs": ["zzzz"]}]
    out = er.runs.run_samples(model, CharTok(), recs, [(ev.settings.DENSE, 0)], max_new=50, full=True)
    (r,) = out
    assert r["index"] == 1 and r["max_new_tokens"] == 64 - 60 + 1 and r["new_tokens"] <= 5


def test_select_slices_and_orders_sample_major(tmp_path):
    recs = [{"task": t, "max_seq_length": L, "index": i} for t in ("qa_1", "vt") for L in (4096, 8192)
            for i in range(4)]
    got = er.data._select(recs, None, None, 2, skip=1)
    assert [(r["index"], r["max_seq_length"], r["task"]) for r in got] == [
        (1, 4096, "vt"), (1, 4096, "qa_1"), (1, 8192, "vt"), (1, 8192, "qa_1"),
        (2, 4096, "vt"), (2, 4096, "qa_1"), (2, 8192, "vt"), (2, 8192, "qa_1")]
    assert len(er.data._select(recs, ["vt"], [8192], None)) == 4
    _write(tmp_path / "vt_4096.jsonl", [{"input": "q", "outputs": ["a"]}])
    (tmp_path / "notes.txt").write_text("x")
    assert er.data.data_files([str(tmp_path)]) == [str(tmp_path / "vt_4096.jsonl")]
    (tmp_path / "e").mkdir()
    with pytest.raises(click.UsageError, match="without"):
        er.data.data_files([str(tmp_path / "e")])


def test_time_limit_stops_before_the_next_sample(tmp_path):
    from llama_min.model import LlamaModel
    model = LlamaModel.from_pretrained(make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)[0])
    recs = [{"task": "vt", "max_seq_length": 64, "index": i, "input": "abc" * 5, "outputs": ["q"]} for i in range(3)]
    out = er.runs.run_samples(model, CharTok(), recs, [(ev.settings.DENSE, 0)], max_new=2, time_limit=0.0)
    assert [r["index"] for r in out] == [0]


def test_cli_generation_lengths_beyond_the_model_fail_before_generating(tmp_path, monkeypatch):
    monkeypatch.setattr(er.command, "check_package", lambda: tmp_path)
    called = []
    monkeypatch.setattr(er.command, "generate_task", lambda *a: called.append(a) or [])
    path = make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)[0]
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--model", str(path), "--lengths", "32,128", "--tasks", "vt"])
    assert r.exit_code == 2 and "128 beyond the model's context (64 tokens)" in r.output and not called


# ------------------------------------------------------------------------------ greedy rule, capacity, pacing


def test_greedy_token_is_the_device_samplers_rule():
    from llama_min.sampling import SamplerParams, SamplingConfig, sample_reference
    params = SamplerParams.from_config(SamplingConfig(greedy=True), 5)
    for row in ([1.0, 3.0, 3.0, 0.0, -1.0], [-0.0, 0.0, -1.0, -2.0, -0.0], [np.inf, 1.0, np.inf, 0.0, 0.0],
                [-np.inf] * 5, [0.5, np.nan, 0.5, 9.0, 0.0]):
        row = np.asarray(row, np.float32)
        want = int(sample_reference(row[None], params, 0)[0])
        assert ev.decoding.greedy_token(row) == want, row
    assert ev.decoding.greedy_token(np.array([1, 3, 3, 0], np.float32)) == 1          # ties: lowest index
    assert ev.decoding.greedy_token(np.array([-0.0, 0.0], np.float32)) == 0            # -0 == +0


def test_cache_capacity_rounds_up_within_the_context():
    cap = er.runs.cache_capacity
    assert cap(4095, 8192) == 4096 and cap(4096, 8192) == 4096 and cap(4097, 8192) == 5120
    assert cap(8100, 8192) == 8192 and cap(40, 64) == 64 and cap(64, 64) == 64


def test_progress_and_estimate_lines():
    now = 1764604800.0                                               # 2025-12-01 16:00:00 UTC
    line = er.runs.progress_line(10, 100, 25.0, setup_s=5.0, now=now)
    assert line == "progress: 10/100 samples (10%) in 25 s, 2.00 s a sample; ETA 180 s (16:03 UTC)"
    line = er.runs.progress_line(10, 100, 25.0, setup_s=5.0, time_limit=40, now=now)
    assert line.endswith("; --time-limit 40: ~8 more in this part")      # starts at 25, 27, ..., 39
    assert er.runs.progress_line(10, 100, 45.0, time_limit=40, now=now).endswith("~0 more in this part")
    est = er.runs.estimate_line(26, 1300, 57.0, setup_s=5.0, time_limit=500)
    assert est.startswith("estimate: 26 samples (one of every task and length) in 57.0 s: 2.00 s a sample "
                          "(+ 5.0 s of graph capture")
    assert "all 1300 samples ~2600 s (43.3 min)" in est and "~251 samples a part, 6 parts" in est


def test_pacer_prints_the_estimate_then_every_n_samples():
    t = [0.0]
    lines = []
    p = er.runs.Pacer(total=7, first=2, every=3, echo=lines.append, clock=lambda: t[0])
    for k in range(7):
        t[0] += 2.0
        p.sample(setup_s=1.0 if k == 0 else 0.0)
    assert len(lines) == 3 and lines[0].startswith("estimate: 2 samples") and "1.50 s a sample" in lines[0]
    assert lines[1].startswith("progress: 3/7 samples") and lines[2].startswith("progress: 6/7 samples")
    assert p.estimate == lines[0] and p.done == 7


def test_first_round_and_record_key():
    recs = [{"task": t, "max_seq_length": L, "index": i} for i in range(3) for t in ("vt", "qa_1") for L in (64, 128)]
    assert er.runs.first_round(recs) == 4
    r = {"task": "vt", "max_seq_length": "64", "index": 2, "setting": "dense", "seed": 0, "pred": "x"}
    assert er.runs.record_key(r) == ("vt", 64, 2, "dense", 0)


# ------------------------------------------------------------------------------ parts: --resume, --merge


def _tiny_ruler(tmp_path, monkeypatch, n=3):
    monkeypatch.setattr("llama_min.tokenizer.Tokenizer", CharTok)
    (tmp_path / "m").mkdir(exist_ok=True)
    path = make_tiny(tmp_path / "m", H=4, KVH=2, layers=2, max_pos=64)[0]
    prompts = ["the magic number is", "what is the code", "third prompt here", "and a fourth one"]
    data = _write(tmp_path / "niah_single_1.jsonl", [
        {"index": i, "input": prompts[i], "outputs": ["zzqq"], "length": 25, "max_seq_length": 64}
        for i in range(n)])
    data2 = _write(tmp_path / "vt.jsonl", [
        {"index": i, "input": prompts[-1 - i], "outputs": ["q"], "length": 25, "max_seq_length": 64}
        for i in range(n)])
    base = ["ruler", "--model", str(path), "--device", "cpu", "--data", str(data), "--data", str(data2),
            "--settings", "dense,systematic/global/S=4", "--seeds", "0,1", "--max-new-tokens", "3"]
    return base


def _run(args):
    r = CliRunner().invoke(ev.eval_command, [str(a) for a in args])
    assert r.exit_code == 0, r.output
    return r


def _answers(path):
    res = json.loads(Path(path).read_text())
    return {er.runs.record_key(r): (r["pred"], r["new_tokens"], r["score"]) for r in res["records"]}, res


def test_resume_after_a_time_limit_gives_the_whole_run(tmp_path, monkeypatch):
    base = _tiny_ruler(tmp_path, monkeypatch)
    whole, _ = _answers(_run(base + ["--json", tmp_path / "whole.json"]) and tmp_path / "whole.json")
    assert len(whole) == 2 * 3 * (1 + 2)
    # part 1 stops after its first sample (--time-limit 0), part 2 resumes it, part 3 has nothing left
    r = _run(base + ["--time-limit", "0", "--json", tmp_path / "p1.json"])
    assert "--time-limit 0 s: 1 samples run" in r.output
    p1, res1 = _answers(tmp_path / "p1.json")
    assert len(p1) == 3 and res1["config"]["samples_pending"] == 5 and res1["config"]["samples_run"] == 1
    r = _run(base + ["--resume", tmp_path / "p1.json", "--json", tmp_path / "p2.json"])
    assert "--resume" in r.output and "3 records kept, 5 of 6 samples left to run" in r.output
    p2, res2 = _answers(tmp_path / "p2.json")
    assert p2 == whole and res2["config"]["samples_pending"] == 0
    assert res2["config"]["merged_from"] == ["p1.json", "this run"]
    assert res2["summary"]["lengths"]["64"]["settings"]["dense"]["tasks"]["vt"]["n"] == 3
    r = _run(base + ["--resume", tmp_path / "p2.json", "--json", tmp_path / "p3.json"])
    assert "0 of 6 samples left to run" in r.output
    assert _answers(tmp_path / "p3.json")[0] == whole
    # a resumed file can resume itself (read before it is written) and merge with its parts: the
    # duplicates are the same answers, counted once
    _run(base + ["--resume", tmp_path / "p1.json", "--json", tmp_path / "p1.json"])
    assert _answers(tmp_path / "p1.json")[0] == whole
    r = _run(["ruler", "--merge", tmp_path / "p2.json", "--merge", tmp_path / "p3.json", "--merge",
              tmp_path / "whole.json", "--json", tmp_path / "m.json"])
    assert "merge: 36 duplicate records (same task, length, sample, setting, seed and answer) counted once" in r.output
    assert _answers(tmp_path / "m.json")[0] == whole


def test_resume_with_a_new_setting_runs_only_that_setting(tmp_path, monkeypatch):
    base = _tiny_ruler(tmp_path, monkeypatch, n=2)
    _run(base + ["--json", tmp_path / "a.json"])
    args = [a if a != "dense,systematic/global/S=4" else "dense,systematic/global/S=4,iid/fixed/S=8" for a in base]
    r = _run(args + ["--resume", tmp_path / "a.json", "--json", tmp_path / "b.json"])
    got, res = _answers(tmp_path / "b.json")
    assert len(got) == 2 * 2 * (1 + 2 + 2)
    assert res["config"]["settings"] == ["dense", "systematic/global/S=4", "iid/fixed/S=8"]
    new = [x for x in res["records"] if x["setting"] == "iid/fixed/S=8"]
    assert len(new) == 8 and "dense" not in r.output.split("--resume")[1].split("\n")[1]


def test_resume_refuses_a_different_run_before_running(tmp_path, monkeypatch):
    base = _tiny_ruler(tmp_path, monkeypatch, n=1)
    _run(base + ["--json", tmp_path / "a.json"])
    res = json.loads((tmp_path / "a.json").read_text())
    res["config"]["kv_dtype"] = "float16"
    (tmp_path / "b.json").write_text(json.dumps(res))
    r = CliRunner().invoke(ev.eval_command, [str(a) for a in base + ["--resume", tmp_path / "b.json"]])
    assert r.exit_code == 1 and "differs in kv_dtype" in r.output and "prefill" not in r.output
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--merge", str(tmp_path / "a.json"), "--resume",
                                             str(tmp_path / "a.json")])
    assert r.exit_code == 2 and "--resume" in r.output
    (tmp_path / "c.json").write_text("{}")
    r = CliRunner().invoke(ev.eval_command, [str(a) for a in base + ["--resume", tmp_path / "c.json"]])
    assert r.exit_code == 1 and "not the --json output of eval ruler" in r.output


def test_estimate_runs_one_sample_of_every_task_and_length(tmp_path, monkeypatch):
    base = _tiny_ruler(tmp_path, monkeypatch)
    r = _run(base + ["--estimate", "--time-limit", "100", "--json", tmp_path / "e.json"])
    got, res = _answers(tmp_path / "e.json")
    assert {(k[0], k[2]) for k in got} == {("niah_single_1", 0), ("vt", 0)}
    assert "estimate: 2 samples (one of every task and length)" in r.output and "all 6 samples ~" in r.output
    assert "--time-limit 100: ~" in r.output and res["config"]["samples_pending"] == 4
    r = _run(base + ["--resume", tmp_path / "e.json", "--progress-every", "2", "--json", tmp_path / "f.json"])
    assert "estimate: 2 samples" in r.output and "progress: 4/4" not in r.output
    assert _answers(tmp_path / "f.json")[0].keys() == _answers(_run(base + ["--json", tmp_path / "w.json"])
                                                             and tmp_path / "w.json")[0].keys()


def test_merge_detects_duplicates_with_other_answers(tmp_path):
    base = {"model": "m", "device": "cpu", "kv_dtype": "float32", "seeds": [0], "data": "files",
            "max_new_tokens": 5, "full_answers": False, "block_n": None, "seconds": 2.0,
            "settings": ["dense"]}
    rec = dict(_rec("vt", 4096, "dense", 0, 1.0), pred="x")
    for name, r in (("a", rec), ("b", dict(rec, decode_s=9.0)), ("c", dict(rec, pred="y"))):
        (tmp_path / f"{name}.json").write_text(json.dumps({"config": base, "records": [r]}))
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--merge", str(tmp_path / "a.json"), "--merge",
                                             str(tmp_path / "b.json"), "--json", str(tmp_path / "m.json")])
    assert r.exit_code == 0 and "merge: 1 duplicate record " in r.output          # timings may differ
    (kept,) = json.loads((tmp_path / "m.json").read_text())["records"]
    assert kept["decode_s"] == 0.5                                                 # the first one
    r = CliRunner().invoke(ev.eval_command, ["ruler", "--merge", str(tmp_path / "a.json"), "--merge",
                                             str(tmp_path / "c.json")])
    assert r.exit_code == 1 and "('vt', 4096, 0, 'dense', 0) differs from an earlier run's record" in r.output


class _EagerGraphGreedy:
    """GraphGreedy's contract on the CPU with eager steps: reset to a prefill of n0 tokens in place,
    launch (the first token given, then its own sample fed back) and fetch."""

    made = []

    def __init__(self, model, cache, attention):
        self.model, self.cache, self.attention = model, cache, attention
        _EagerGraphGreedy.made.append(attention)

    def reset(self, n0):
        c = self.cache
        c.lengths[...] = n0
        c.length, c.step = n0, 0
        c.lse_hints.clear()                      # the one-pass hints (on the GPU: OnePassLayers.reset)

    def launch(self, tokens=None):
        t = self.t if tokens is None else tokens[0]
        logits = self.model.decode(np.asarray([t], np.int64), self.cache, self.attention)
        self.t = ev.decoding.greedy_token(logits[0])

    def fetch(self):
        return self.t

    def close(self):
        pass


def test_graph_decoders_scheme_equals_clones(tmp_path, monkeypatch):
    """GraphDecoders' scheme (each sample prefilled once into a cache per capacity, its rows copied
    in place into every setting's own cache, the settings decoded in lockstep by greedy_together,
    each stopping on its own) gives the eager clone-per-setting answers, with the early stop too.
    One decoder per (capacity, setting, seed), reused across samples."""
    from llama_min.model import LlamaModel
    monkeypatch.setattr(er.runs, "GraphGreedy", _EagerGraphGreedy)
    _EagerGraphGreedy.made = []
    model = LlamaModel.from_pretrained(make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)[0])
    runs = [(ev.settings.DENSE, 0)] + [(er.runs.parse_setting(s), seed) for s in
                                      ("systematic/global/S=4", "systematic/one_pass/S=8") for seed in (0, 1)]
    for full, refs in ((True, ["zzzz"]), (False, ["b"]), (False, ["c"])):
        recs = [{"task": "vt", "max_seq_length": 64, "index": i, "input": t, "outputs": refs}
                for i, t in enumerate(["abc" * 5, "the code is", "x" * 40])]
        a = er.runs.run_samples(model, CharTok(), recs, runs, max_new=6, full=full, graph=True)
        b = er.runs.run_samples(model, CharTok(), recs, runs, max_new=6, full=full, graph=False)
        assert [(r["pred"], r["new_tokens"]) for r in a] == [(r["pred"], r["new_tokens"]) for r in b]
    assert len(_EagerGraphGreedy.made) == 3 * len(runs)        # per run_samples: the three samples share capacity 64


def test_greedy_together_stops_each_decoder_on_its_own():
    class Fake:
        def __init__(self, seq):
            self.seq, self.cache, self.at, self.calls = seq, type("C", (), {"max_len": 100})(), 0, []

        def reset(self, n0):
            self.at = 0

        def launch(self, tokens=None):
            self.calls.append(tokens)

        def fetch(self):
            self.at += 1
            return self.seq[self.at - 1]
    decs = [Fake([5, 6, 7, 8, 9]), Fake([5, 2, 7, 7, 7]), Fake([1, 1, 1, 1, 1])]
    out = ev.decoding.greedy_together(decs, 10, 4, 4, stop_ids={2}, done=lambda toks: sum(toks) >= 3,
                                      clock=iter(range(100)).__next__)
    assert [t for t, _ in out] == [[5], [5], [1, 1, 1]]
    assert [c.calls for c in decs] == [[[4]], [[4]], [[4], None, None]]
    out = ev.decoding.greedy_together(decs[:2], 10, 4, 4, stop_ids={2})
    assert [t for t, _ in out] == [[5, 6, 7, 8], [5]]
    with pytest.raises(ValueError, match="do not fit"):
        ev.decoding.greedy_together(decs, 90, 4, 11)


def test_prefill_chunk_on_the_gpu_fits_the_scores():
    class M:
        H, xp = 9, object()
    assert ev.decoding.prefill_chunk(M, 8192) == 2048 and ev.decoding.prefill_chunk(M, 4096) == 4096
    assert ev.decoding.prefill_chunk(M, 100) == 4096 and ev.decoding.prefill_chunk(M, 10 ** 6) == 512
    M.xp = np
    assert ev.decoding.prefill_chunk(M, 8192) is None


def test_checkpoints_are_parts_that_resume(tmp_path, monkeypatch):
    """Every CHECKPOINT_EVERY samples the --json file holds the records so far (partial): a run
    killed after its checkpoint resumes from it to the whole run's answers."""
    base = _tiny_ruler(tmp_path, monkeypatch)
    whole, _ = _answers(_run(base + ["--json", tmp_path / "whole.json"]) and tmp_path / "whole.json")
    monkeypatch.setattr(er.command, "CHECKPOINT_EVERY", 2)
    seen = []
    real = er.command.write_checkpoint

    def spy(path, results):
        real(path, results)
        seen.append(json.loads(Path(path).read_text()))
        if len(seen) == 2:
            raise KeyboardInterrupt                   # killed after its second checkpoint (4 samples)
    monkeypatch.setattr(er.command, "write_checkpoint", spy)
    r = CliRunner().invoke(ev.eval_command, [str(a) for a in base + ["--json", tmp_path / "k.json"]])
    assert r.exit_code != 0 and len(seen) == 2
    assert [len(c["records"]) for c in seen] == [6, 12] and seen[1]["config"]["partial"] is True
    assert seen[1]["config"]["samples_pending"] == 2 and not list(tmp_path.glob("k.json.tmp*"))
    monkeypatch.setattr(er.command, "write_checkpoint", real)
    _run(base + ["--resume", tmp_path / "k.json", "--json", tmp_path / "k2.json"])
    got, res = _answers(tmp_path / "k2.json")
    assert got == whole and "partial" not in res["config"]


def test_checkpoint_of_a_resumed_run_keeps_the_earlier_records(tmp_path, monkeypatch):
    base = _tiny_ruler(tmp_path, monkeypatch)
    whole, _ = _answers(_run(base + ["--json", tmp_path / "whole.json"]) and tmp_path / "whole.json")
    _run(base + ["--time-limit", "0", "--json", tmp_path / "p1.json"])              # 1 sample
    monkeypatch.setattr(er.command, "CHECKPOINT_EVERY", 2)
    real = er.command.write_checkpoint

    def killed(path, results):
        real(path, results)
        raise KeyboardInterrupt
    monkeypatch.setattr(er.command, "write_checkpoint", killed)
    CliRunner().invoke(ev.eval_command, [str(a) for a in base + ["--resume", tmp_path / "p1.json", "--json",
                                                                 tmp_path / "p2.json"]])
    got, res = _answers(tmp_path / "p2.json")
    assert len(got) == 9 and res["config"]["partial"] and res["config"]["samples_pending"] == 3
    assert all(whole[k] == v for k, v in got.items())
    monkeypatch.setattr(er.command, "write_checkpoint", real)
    _run(base + ["--resume", tmp_path / "p2.json", "--json", tmp_path / "p3.json"])
    assert _answers(tmp_path / "p3.json")[0] == whole

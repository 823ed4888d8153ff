"""CPU tests of santa_cupy.cli.bench's pure parts: argument parsing, grid expansion, byte accounting, derived
numbers, table/JSON formatting and argument errors. The GPU paths are exercised on the H200 only."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy.cli import bench  # noqa: E402
from santa_cupy import AttentionSetting  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402
from santa_cupy.cli.bench.methods import Method, SHAPES  # noqa: E402

LLAMA = SHAPES["llama8b"]


@pytest.mark.parametrize("text,want", [("32k", 32768), ("8K", 8192), ("128k", 131072), ("8192", 8192),
                                       (" 1m ", 1 << 20)])
def test_parse_size(text, want):
    assert bench.methods.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "k", "0", "-5", "3.5k", "32kb", "abc"])
def test_parse_size_errors(text):
    with pytest.raises(click.BadParameter, match="context"):
        bench.methods.parse_size(text)


def test_parse_list():
    assert bench.methods.parse_list("1,4,16", "batch") == [1, 4, 16]
    assert bench.methods.parse_list("8k, 32k,", "context") == [8192, 32768]
    assert bench.methods.parse_list("llama8b,smollm2", "shape", bench.methods.parse_shape) == [LLAMA, SHAPES["smollm2"]]
    with pytest.raises(click.BadParameter, match="empty"):
        bench.methods.parse_list(" , ", "batch")
    with pytest.raises(click.BadParameter, match="unknown shape"):
        bench.methods.parse_shape("llama70b")


def test_expand_grid_order():
    grid = bench.methods.expand_grid([LLAMA, SHAPES["smollm2"]], [1, 16], [8192, 32768])
    assert len(grid) == 8
    assert grid[0] == (LLAMA, 1, 8192) and grid[1] == (LLAMA, 1, 32768) and grid[2] == (LLAMA, 16, 8192)
    assert grid[-1] == (SHAPES["smollm2"], 16, 32768)


@pytest.mark.parametrize("name", ["dense", "flashinfer", "torch-flash", "torch-cudnn", "santa-global-systematic-256",
                                  "santa-largest_remainder-iid-128", "santa-fixed-stratified-2048"])
def test_method_roundtrip(name):
    assert bench.methods.parse_method(name).name == name


@pytest.mark.parametrize("name", ["sparse", "santa-global-systematic", "santa-foo-iid-256", "santa-global-iid-0",
                                  "santa-global-iid-x", "torch-math", "torch"])
def test_method_errors(name):
    with pytest.raises(click.BadParameter, match="unknown method"):
        bench.methods.parse_method(name)


def test_method_lists():
    default = [m.name for m in bench.methods.method_list(have_torch=True, have_flashinfer=True)]
    ours = ["dense", "dense-stream", "santa-global-systematic-256", "santa-global-systematic-256-always",
            "santa-global-systematic-256-block", "santa-fixed-systematic-2048", "santa-fixed-systematic-2048-always"]
    assert default == ours + ["torch-flash", "torch-cudnn", "torch-efficient", "flashinfer"]
    assert [m.name for m in bench.methods.method_list()] == ours
    quick = [m.name for m in bench.methods.method_list(quick=True, have_torch=True, have_flashinfer=True)]
    assert quick == ours + ["torch-flash", "torch-cudnn", "flashinfer"]        # every peer, --quick too
    assert bench.methods.parse_method("santa-global-iid-64-stream").backend == "stream"
    assert bench.methods.parse_method("santa-fixed-systematic-2048-block").backend == "block"
    assert bench.methods.parse_method("santa-fixed-systematic-2048-warpmma").backend == "warpmma"
    always = bench.methods.parse_method("santa-global-systematic-256-always")
    assert always.plan_setting().santa_min_length == 0 and always.kernel_choice() == KernelChoice()
    block = bench.methods.parse_method("santa-fixed-systematic-2048-block")
    assert block.kernel_choice() == KernelChoice(tile_kernel="block") and block.plan_setting() == block.setting
    assert bench.methods.parse_method("dense-p7").kernel_choice() == KernelChoice(dense_splits=7)
    both = bench.methods.parse_method("santa-global-systematic-256-warp-always")    # a kernel, then a setting suffix
    assert both.name == "santa-global-systematic-256-warp-always" and both.plan_setting().santa_min_length == 0
    assert both.kernel_choice() == KernelChoice(tile_kernel="warp")
    tiles = bench.methods.parse_method("santa-global-systematic-256-bn64-always")        # two setting suffixes
    assert tiles.plan_setting().block_n == 64 and tiles.plan_setting().santa_min_length == 0
    assert tiles.kernel_choice() == KernelChoice()
    for wrong_order in ("santa-global-systematic-256-always-warp", "santa-global-systematic-256-warp-block",
                        "santa-global-systematic-256-always-always"):
        with pytest.raises(click.BadParameter):
            bench.methods.parse_method(wrong_order)
    assert bench.methods.parse_method("santa-global-iid-64-stream").kernel_choice() == KernelChoice(score_kernel="stream")
    assert bench.methods.parse_method("santa-global-iid-64").setting == AttentionSetting.parse("iid/global/S=64")
    assert bench.methods.parse_method("santa-fixed-systematic-2048-warpmma").backend == "warpmma"
    for gone in ("santa-global-systematic-256-mma_ring", "dense-async", "santa-global-iid-64-async"):
        with pytest.raises(click.BadParameter):            # removed kernel versions (v3, the K ring)
            bench.methods.parse_method(gone)
    with pytest.raises(click.BadParameter):                # warp_smem became the only warp pass 2
        bench.methods.parse_method("santa-fixed-systematic-2048-warpsmem")
    assert bench.methods.parse_method("santa-global-systematic-256-tpw1").backend == "tpw1"
    assert bench.methods.parse_method("dense-mma") == Method("dense", backend="mma")
    assert bench.methods.parse_method("dense-stream").name == "dense-stream"
    assert bench.methods.parse_method("santa-global-iid-64-mma").name == "santa-global-iid-64-mma"
    with pytest.raises(click.BadParameter):
        bench.methods.parse_method("santa-global-iid-64-fast")
    full = bench.methods.method_list(full=True, have_torch=True)
    santa = [m for m in full if m.kind == "santa"]
    assert len(santa) == 3 * 3 * 4 and len({m.name for m in santa}) == 36
    assert {m.samples for m in santa} == {128, 256, 512, 2048}
    assert [m.name for m in bench.methods.method_list(["dense", "torch-flash"])] == ["dense", "torch-flash"]
    assert Method("torch", backend="flash").external and not Method("dense").external


def test_key_sampling_methods():
    """'-keys<P>': block key sampling (FB 16, rule uniform, budget P/100) on a blocked K; 'dense-blocked':
    exact dense on the blocked K; their bytes count the fraction of K read."""
    m = bench.methods.parse_method("santa-global-systematic-256-keys75")
    assert m.name == "santa-global-systematic-256-keys75" and m.key_percent == 75 and m.key_layout == "blocked"
    setting = m.plan_setting()
    assert (setting.key_sampling, setting.key_block, setting.key_budget, setting.key_rule) == \
        ("bernoulli_block", 16, 0.75, "uniform")
    assert setting.samples == 256 and setting.budget == "global" and m.kernel_choice() == KernelChoice()
    assert bench.methods.parse_method("santa-fixed-systematic-2048-keys100").plan_setting().key_budget == 1.0
    m32 = bench.methods.parse_method("santa-global-systematic-256-keys25fb32")
    assert (m32.key_percent, m32.key_block, m32.key_layout) == (25, 32, "blocked")
    assert (m32.plan_setting().key_block, m32.plan_setting().key_budget) == (32, 0.25) and m.key_block == 16
    d = bench.methods.parse_method("dense-blocked")
    assert d.key_layout == "blocked" and d.key_percent is None and d.plan_setting() == AttentionSetting(method="dense")
    assert bench.methods.parse_method("santa-global-systematic-256").key_layout == "standard"
    for bad in ("santa-global-systematic-256-keys0", "santa-global-systematic-256-keys101",
                "santa-global-systematic-256-keys", "dense-keys50", "santa-global-systematic-256-keys50fb64",
                "santa-global-systematic-256-keys50fb"):
        with pytest.raises(click.BadParameter, match="unknown method"):
            bench.methods.parse_method(bad)
    B, L = 2, 4096
    k = B * L * 8 * 128 * 2
    full = bench.accounting.attention_bytes(m, LLAMA, B, L, rows_read=100)
    half = bench.accounting.attention_bytes(m, LLAMA, B, L, rows_read=100, key_fraction=0.5)
    assert full - half == k // 2


def test_bytes_dense_and_external():
    B, L = 4, 32768
    kv = 2 * B * L * 8 * 128 * 2
    qo = 2 * B * 32 * 128 * 2
    assert bench.accounting.kv_bytes(LLAMA, B, L) == kv
    assert bench.accounting.attention_bytes(Method("dense"), LLAMA, B, L) == kv + qo
    assert bench.accounting.attention_bytes(Method("torch", backend="flash"), LLAMA, B, L) == kv + qo


def test_bytes_santa():
    B, L, rows = 2, 8192, 5000
    k = B * L * 8 * 128 * 2
    qo = 2 * B * 32 * 128 * 2
    stash = B * 32 * L * 4 * 2
    glob = bench.methods.parse_method("santa-global-systematic-256")
    fixed = bench.methods.parse_method("santa-fixed-systematic-2048")
    lr = bench.methods.parse_method("santa-largest_remainder-systematic-256")
    assert bench.accounting.attention_bytes(glob, LLAMA, B, L, rows) == k + rows * 128 * 2 + qo + stash
    assert bench.accounting.attention_bytes(lr, LLAMA, B, L, rows) == k + rows * 128 * 2 + qo + stash
    assert bench.accounting.attention_bytes(fixed, LLAMA, B, L, rows) == k + rows * 128 * 2 + qo
    # reading every V row without a stash is exactly the dense byte count
    assert bench.accounting.attention_bytes(fixed, LLAMA, B, L, B * L * 8) == \
        bench.accounting.attention_bytes(Method("dense"), LLAMA, B, L)
    # a plan that ran exact (below its santa_min_length) moves dense's bytes, no stash
    assert bench.accounting.attention_bytes(glob, LLAMA, B, L, B * L * 8, exact=True) == \
        bench.accounting.attention_bytes(Method("dense"), LLAMA, B, L)
    with pytest.raises(ValueError, match="rows_read"):
        bench.accounting.attention_bytes(glob, LLAMA, B, L)


def test_copies_for():
    l2 = 60 * 10**6
    assert bench.accounting.copies_for(10**6, l2, 10**12) == bench.methods.MAX_COPIES           # tiny: capped
    assert bench.accounting.copies_for(134 * 10**6, l2, 10**12) == 2                      # 2 x 134 MB >= 180 MB
    assert bench.accounting.copies_for(2 * 10**9, l2, 10**12) == 1                        # one copy already >> L2
    assert bench.accounting.copies_for(10**8, l2, 1.5e8) == 1                             # budget caps
    assert bench.accounting.copies_for(3 * 10**9, l2, 2 * 10**9) == 0                     # does not fit
    n = bench.accounting.copies_for(7 * 10**6, l2, 10**12)
    assert n * 7 * 10**6 >= bench.methods.L2_FACTOR * l2 and (n - 1) * 7 * 10**6 < bench.methods.L2_FACTOR * l2


def _rows():
    base = {"shape": "llama8b", "B": 1, "L": 32768}
    return [dict(base, method="dense", external=False, us=40.0, bytes=4 * 10**8, rows_frac=1.0),
            dict(base, method="santa-global-systematic-256", external=False, us=20.0, bytes=2 * 10**8, rows_frac=0.03),
            dict(base, method="torch-flash", external=True, us=50.0, bytes=4 * 10**8),
            dict(base, method="torch-cudnn", external=True, us=None, bytes=4 * 10**8, note="skipped: x | y"),
            dict(base, B=16, method="dense", external=False, us=100.0, bytes=10**9)]


def test_add_derived():
    rows = bench.accounting.add_derived(_rows(), 5.0)
    dense, santa, flash, cudnn, other = rows
    assert dense["tbps"] == pytest.approx(10.0) and dense["pct_ceiling"] == pytest.approx(200.0)
    assert santa["tbps"] == pytest.approx(10.0)
    assert santa["x_dense"] == pytest.approx(2.0) and santa["x_external"] == pytest.approx(2.5)
    assert dense["x_dense"] == pytest.approx(1.0) and flash["x_external"] == pytest.approx(1.0)
    assert cudnn["tbps"] is None and cudnn["x_dense"] is None
    assert other["x_external"] is None and other["x_dense"] == pytest.approx(1.0)   # its own group
    # the largest x_dense a row's bytes allow: our dense 40 µs over its bytes at 5 TB/s
    assert santa["x_dense_bound"] == pytest.approx(40.0 / 40.0) and dense["x_dense_bound"] == pytest.approx(40.0 / 80.0)
    assert cudnn["x_dense_bound"] is None
    assert bench.accounting.add_derived(_rows(), None)[0]["pct_ceiling"] is None
    assert bench.accounting.add_derived(_rows(), None)[1]["x_dense_bound"] is None


def test_kernel_table_and_header():
    rows = bench.accounting.add_derived(_rows(), 5.0)
    table = bench.report.kernel_table(rows)
    lines = table.strip().splitlines()
    assert len(lines) == 2 + len(rows)
    assert all(line.count("|") == len(bench.report.KERNEL_COLUMNS) + 1 for line in lines)   # "|" in notes escaped
    assert ("| llama8b | santa-global-systematic-256 | 1 | 32k | 20.0 | 200 MB | 10.00 | 200% | 2.00x | 2.50x (FA2) | "
            "1.00x | 2.50x | 3.00% |") in table
    assert "| llama8b | torch-flash | 1 | 32k | 50.0 | 400 MB | 8.00 | 160% | 0.80x | - |" in table   # peers: no column
    assert "| - | - |" in table                                                        # skipped row
    meta = {"command": "kernels", "gpu": "NVIDIA H200", "cupy": "14.2", "date": "2026", "commit": None}
    head = bench.report.header_markdown(meta, {"read_tbps": 4.6, "read_bytes": 2 << 30, "copy_tbps": 4.2})
    assert "NVIDIA H200" in head and "4.60 TB/s" in head and "commit" not in head


def test_fmt():
    assert bench.report.fmt_bytes(None) == "-" and bench.report.fmt_bytes(512) == "512 B"
    assert bench.report.fmt_bytes(2.5e9) == "2.5 GB" and bench.report.fmt_bytes(134217728) == "134 MB"
    assert bench.report.fmt_context(32768) == "32k" and bench.report.fmt_context(1000) == "1000"


def test_write_outputs(tmp_path, capsys):
    rows = bench.accounting.add_derived(_rows(), 5.0)
    meta = dict(bench.report.run_metadata("kernels"), gpu="X")
    js, md = tmp_path / "b.json", tmp_path / "b.md"
    bench.report.write_outputs(meta, None, rows, bench.report.kernel_table(rows), json_path=str(js),
                               markdown_path=str(md))
    data = json.loads(js.read_text())
    assert data["meta"]["command"] == "kernels" and "date" in data["meta"] and len(data["rows"]) == 5
    assert md.read_text() in capsys.readouterr().out


def test_plot_has_latency_and_speedup_panels(tmp_path, monkeypatch):
    """--plot: per (shape, B) latency and x our dense against context; skipped rows left out."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt
    rows = _rows() + [dict(r, L=131072, us=r["us"] and 2 * r["us"]) for r in _rows()]
    rows = bench.accounting.add_derived(rows, 5.0)
    figures = []
    monkeypatch.setattr(plt.Figure, "savefig", lambda fig, path, **kw: figures.append((fig, path)))
    bench.report.plot_rows(rows, str(tmp_path / "p.png"))
    (fig, path), = figures
    axes = fig.axes                                   # 2 rows x 2 panels (llama8b B=1, B=16)
    assert len(axes) == 4 and path.endswith("p.png")
    latency_b1, speedup_b1 = axes[0], axes[2]
    assert {line.get_label() for line in latency_b1.get_lines()} == {"dense", "santa-global-systematic-256", "torch-flash"}
    santa = next(line for line in speedup_b1.get_lines() if line.get_label() == "santa-global-systematic-256")
    assert list(santa.get_xdata()) == [32768, 131072] and list(santa.get_ydata()) == pytest.approx([2.0, 2.0])
    assert "dense" not in {line.get_label() for line in speedup_b1.get_lines()}
    colour = {line.get_label(): line.get_color() for line in latency_b1.get_lines()}
    assert all(line.get_color() == colour[line.get_label()] for line in speedup_b1.get_lines() if line.get_label() in colour)
    monkeypatch.undo()
    bench.report.plot_rows(rows, str(tmp_path / "real.png"))
    assert (tmp_path / "real.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_measure_ceiling_times_every_launch_shape_over_rotating_buffers(monkeypatch):
    """The ceiling is the fastest launch shape of a graph of reads rotating over the buffers (no GPU:
    a stand-in array module; the timings are the stand-in's)."""
    import types
    np = pytest.importorskip("numpy")
    launched = []

    class Kernel:
        def __init__(self, src, name):
            assert name == "stream_read" and name in src

        def __call__(self, grid, block, args):
            launched.append((grid[0], block[0], id(args[0]), int(args[1])))

    freed = []
    cp = types.SimpleNamespace(
        RawKernel=Kernel, uint32=np.uint32, int64=np.int64, arange=np.arange, zeros=np.zeros,
        cuda=types.SimpleNamespace(Device=lambda: types.SimpleNamespace(attributes={"MultiProcessorCount": 132})),
        get_default_memory_pool=lambda: types.SimpleNamespace(free_all_blocks=lambda: freed.append(1)))
    shape_us = {132: 500.0, 264: 400.0, 528: 450.0, 1056: 470.0, 2112: 480.0}    # grid size -> µs

    def fake_graph(cp_, fns, n_inner, repeats, warmup=3):
        before = len(launched)
        for i in range(n_inner):
            fns[i % len(fns)]()
        mine = launched[before:]
        assert len({buf for _, _, buf, _ in mine}) == 2                      # alternates over both buffers
        return shape_us[mine[0][0]], "graph"

    monkeypatch.setattr(bench.timing, "time_cupy_graph", fake_graph)
    monkeypatch.setattr(bench.timing, "_device_copy_us", lambda cp_, n: 1000.0)
    c = bench.timing.measure_ceiling(cp, read_bytes=1 << 12, copy_bytes=1 << 20)
    assert {(g, t) for g, t, _, _ in launched} == {(132 * p, t) for p, t in bench.timing.STREAM_LAUNCHES}
    assert all(n16 == (1 << 12) // 16 for *_, n16 in launched)
    assert c["read_tbps"] == pytest.approx((1 << 12) / 400e-6 / 1e12)
    assert c["read_launch"].startswith("2 blocks/SM x 1024 threads")
    assert c["copy_tbps"] == pytest.approx(2 * (1 << 20) / 1000e-6 / 1e12) and freed


def test_run_metadata_tolerates_missing_git(monkeypatch):
    def boom(*a, **k):
        raise OSError("no git")
    monkeypatch.setattr(bench.report.subprocess, "run", boom)
    assert bench.report.run_metadata("e2e")["commit"] is None


def test_e2e_bytes_llama8b():
    m = bench.e2e.LLAMA8B_MODEL
    b = bench.e2e.e2e_bytes(m, 1, 32768)
    assert b["kv"] == 32 * 2 * 32768 * 8 * 128 * 2                       # 4.29 GB
    assert 15.0e9 < b["weights"] < 15.1e9                                  # 7.5 B params minus the embedding, fp16
    assert b["total"] == b["weights"] + b["kv"]
    rows = bench.e2e.e2e_derived([{"method": "dense", "B": 2, "L": 32768, "ms": 10.0},
                              {"method": "santa-global-systematic-256", "B": 2, "L": 32768, "ms": 8.0}], 4.0, 3.2 * 10**10)
    assert rows[0]["floor_ms"] == pytest.approx(8.0) and rows[0]["pct_floor"] == pytest.approx(80.0)
    assert rows[1]["x_dense"] == pytest.approx(1.25) and rows[1]["tok_s"] == pytest.approx(250.0)
    table = bench.report.e2e_table(rows)
    assert table.count("\n") == 4 and "| santa-global-systematic-256 | 2 | 32k | 8.00 | 250.0 | 8.00 | 100% | 1.25x |" in table


def test_e2e_memory_refused():
    result = CliRunner().invoke(bench.bench, ["e2e", "--context", "128k", "--batch", "16"])
    assert result.exit_code == 2 and "--mem-gb" in result.output


@pytest.mark.parametrize("args,msg", [
    (["kernels", "--quick", "--full"], "exclude"),
    (["kernels", "--context", "32x"], "context"),
    (["kernels", "--batch", "0"], "batch"),
    (["kernels", "--shape", "gpt2"], "unknown shape"),
    (["kernels", "--methods", "santa-global"], "unknown method"),
    (["e2e", "--methods", "torch-flash"], "our kernels only"),
    (["e2e", "--context", "0"], "context"),
    (["e2e", "--products", "gemv", "--no-graph"], "needs the captured graph"),
])
def test_cli_argument_errors(args, msg):
    result = CliRunner().invoke(bench.bench, args)
    assert result.exit_code == 2, result.output
    assert msg in result.output


def test_cli_without_gpu_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)      # `import cupy` fails, installed or not
    result = CliRunner().invoke(bench.bench, ["kernels", "--quick"])
    assert result.exit_code == 1 and "need CuPy" in result.output


def test_cli_registers_bench():
    from santa_cupy.cli import main as cli
    assert "bench" in cli.main.commands
    assert set(cli.main.commands["bench"].commands) == {"kernels", "e2e", "stages", "products"}


class _FakeCupy:
    """Just enough of CuPy for time_cupy_graph's control flow (no GPU)."""

    def __init__(self, capture_ok=True):
        outer = self
        self.calls, self.capture_ok = [], capture_ok

        class Stream:
            def __init__(self, non_blocking=False):
                self.capturing = []

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

            def synchronize(self):
                pass

            def begin_capture(self):
                if not outer.capture_ok:
                    raise RuntimeError("capture not supported")

            def end_capture(self):
                n = len(outer.calls)
                return type("G", (), {"launch": lambda g, s=None: outer.calls.append(("replay", n))})()

        class Event:
            def record(self, stream=None):
                pass

            def synchronize(self):
                pass

        class Device:
            def synchronize(self):
                pass

        self.cuda = type("cuda", (), {"Stream": Stream, "Event": Event, "Device": Device,
                                      "get_elapsed_time": staticmethod(lambda a, b: 2.0)})


@pytest.mark.parametrize("capture_ok", [True, False])
def test_time_cupy_graph_control_flow(capture_ok):
    cp = _FakeCupy(capture_ok)
    fns = [lambda i=i: cp.calls.append(i) for i in range(3)]
    us, mode = bench.timing.time_cupy_graph(cp, fns, n_inner=6, repeats=5, warmup=2)
    assert us == pytest.approx(2000.0 / 6)                   # 2 ms per replay of 6 calls
    assert cp.calls[:3] == [0, 1, 2]                          # warm-up of every copy first
    if capture_ok:
        assert mode == "graph" and cp.calls[3:9] == [0, 1, 2, 0, 1, 2]
        assert cp.calls[9:] == [("replay", 9)] * 7            # 2 warm-up + 5 timed replays
    else:
        assert mode.startswith("eager: capture failed (RuntimeError")
        assert cp.calls[3:] == [0, 1, 2, 0, 1, 2] * 7


def test_stage_table_and_argument_errors():
    rows = [{"stage": "whole call", "us": 10.0, "share": 1.2}, {"stage": "score + prefix", "us": 6.0, "share": 0.75},
            {"stage": "merge", "us": 2.0, "share": 0.25}]
    text = bench.report.stage_table("santa", rows)
    assert "| whole call | 10.0 | - |" in text and "| score + prefix | 6.0 | 75% |" in text
    from click.testing import CliRunner
    res = CliRunner().invoke(bench.bench, ["stages", "--methods", "torch-flash"])
    assert res.exit_code != 0 and "not one of ours" in res.output


def test_products_argument_errors():
    for args, msg in [(["products", "--tokens", "5"], "1..4"),
                      (["products", "--methods", "cublas,magic"], "unknown method")]:
        result = CliRunner().invoke(bench.bench, args)
        assert result.exit_code == 2 and msg in result.output, result.output


def test_weight_shapes_are_the_8b_layer():
    shapes = bench.e2e.weight_shapes(bench.e2e.LLAMA8B_MODEL)
    assert shapes == {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
                      "lm_head": (128256, 4096)}


@pytest.mark.gpu
def test_e2e_with_a_checkpoint_on_the_gpu(tmp_path):
    """bench e2e --model DIR: a real (tiny) checkpoint through llama_min's GraphDecoder, both
    methods, a JSON row each with a time and santa's rows-read fraction."""
    from tests.gpu_util import HAVE_GPU
    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA GPU")
    from tests.test_model import make_tiny
    path, _, _ = make_tiny(tmp_path, H=4, KVH=2, max_pos=512)
    out = tmp_path / "e2e.json"
    result = CliRunner().invoke(bench.bench, ["e2e", "--model", str(path), "--context", "300", "--steps", "3",
                                              "--warmup", "1", "--methods", "dense,santa-global-systematic-64",
                                              "--json", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense", "santa-global-systematic-64"]
    assert all(r["ms"] > 0 and r["timing"] == "graph" for r in rows)
    assert 0 < rows[1]["rows_frac"] <= 1


# ---- peers: FlashInfer's page view, the best-peer column, the method lists, the device scripts --------
ROOT = Path(__file__).resolve().parents[1]


def flashinfer_seq_lens(indptr, last_page_len, page_size):
    """FlashInfer 0.6.13's own reading of a page table (flashinfer/page.py, get_seq_lens)."""
    import numpy as np
    return np.maximum(indptr[1:] - indptr[:-1] - 1, 0) * page_size + last_page_len


@pytest.mark.parametrize("B,L,pages,last", [(3, 64, 4, 16), (2, 32768, 2048, 16), (1, 16, 1, 16),
                                            (3, 50, 4, 2), (2, 1, 1, 1), (4, 8191, 512, 15)])
def test_paged_layout(B, L, pages, last):
    np = pytest.importorskip("numpy")
    lay = bench.paged.PagedLayout(B, L)
    assert lay.page_rows == 16 and lay.pages_per_seq == pages and lay.capacity == 16 * pages
    assert lay.free_view == (L % 16 == 0)
    indptr, indices, last_len = lay.indptr(), lay.indices(), lay.last_page_len()
    assert all(a.dtype == np.int32 for a in (indptr, indices, last_len))
    assert indptr.tolist() == [b * pages for b in range(B + 1)]                   # arange(0, B*P + 1, P)
    assert indices.tolist() == list(range(B * pages))
    assert last_len.tolist() == [last] * B and 1 <= last <= 16
    assert flashinfer_seq_lens(indptr, last_len, 16).tolist() == [L] * B          # every sequence is L rows


@pytest.mark.parametrize("L", [64, 50])
def test_paged_cache_is_a_free_view_or_a_padded_copy(L):
    np = pytest.importorskip("numpy")
    B, KVH, D = 3, 2, 4
    cache = np.arange(B * L * KVH * D, dtype=np.uint16).reshape(B, L, KVH, D)
    lay = bench.paged.PagedLayout(B, L)
    pages = bench.paged.paged_cache(np, cache, lay)
    assert pages.shape == (B * lay.pages_per_seq, 16, KVH, D)
    assert np.shares_memory(pages, cache) == (L % 16 == 0)                          # no copy when aligned
    indptr, indices, last = lay.indptr(), lay.indices(), lay.last_page_len()
    for b in range(B):                                # the rows FlashInfer reads are sequence b's, in order
        rows = np.concatenate([pages[p] for p in indices[indptr[b]:indptr[b + 1]]])[:(lay.pages_per_seq - 1) * 16 + last[b]]
        assert np.array_equal(rows, cache[b])
    with pytest.raises(ValueError, match="does not match"):
        bench.paged.paged_cache(np, cache, bench.paged.PagedLayout(B, L + 1))


def _peer_rows():
    base = {"shape": "llama8b", "B": 4, "L": 32768}
    us = {"dense": 40.0, "dense-stream": 42.0, "santa-global-systematic-256": 20.0, "torch-cudnn": 30.0,
          "torch-flash": 35.0, "flashinfer": 28.0, "torch-efficient": 10.0}
    rows = [dict(base, method=m, external=m.startswith(("torch", "flashinfer")), us=t, bytes=10**8) for m, t in us.items()]
    rows.append(dict(base, L=8192, method="santa-global-systematic-256", external=False, us=10.0, bytes=10**8))
    rows.append(dict(base, L=8192, method="flashinfer", external=True, us=None, bytes=10**8, note="failed: x"))
    rows.append(dict(base, L=8192, method="torch-efficient", external=True, us=5.0, bytes=10**8))
    return rows


def test_best_peer_column():
    rows = bench.accounting.add_derived(_peer_rows(), 5.0)
    by = {(r["L"], r["method"]): r for r in rows}
    santa = by[32768, "santa-global-systematic-256"]
    # the fastest of cuDNN, FA2 and FlashInfer (28 µs), not torch's efficient backend (10 µs, not a peer)
    assert santa["best_peer"] == "flashinfer" and santa["x_peer"] == pytest.approx(28.0 / 20.0)
    assert by[32768, "dense"]["x_peer"] == pytest.approx(28.0 / 40.0)
    assert by[32768, "dense-stream"]["x_peer"] == pytest.approx(28.0 / 42.0)
    assert santa["x_external"] == pytest.approx(10.0 / 20.0)                       # the old column unchanged
    for peer in ("torch-cudnn", "torch-flash", "flashinfer", "torch-efficient"):   # peers get no x best peer
        assert by[32768, peer]["x_peer"] is None and by[32768, peer]["best_peer"] is None
    lone = by[8192, "santa-global-systematic-256"]            # its only peer failed: blank, not 0 or inf
    assert lone["x_peer"] is None and lone["best_peer"] is None and lone["x_external"] == pytest.approx(0.5)
    assert bench.accounting.best_peer(rows) == ("flashinfer", 28.0) and bench.accounting.best_peer(rows[:3]) is None
    table = bench.report.kernel_table(rows)
    assert "| 2.00x | 1.40x (FlashInfer) |" in table and "| 1.00x | 0.70x (FlashInfer) |" in table
    assert "| llama8b | santa-global-systematic-256 | 4 | 8k | 10.0 | 100 MB | 10.00 | 200% | - | - |" in table
    header = table.splitlines()[0].split(" | ")
    assert header[header.index("x our dense") + 1] == "x best peer"
    for keep in ("bytes", "% ceiling", "max x dense"):
        assert keep in header


def test_best_peer_in_json(tmp_path, capsys):
    rows = bench.accounting.add_derived(_peer_rows(), 5.0)
    js = tmp_path / "b.json"
    bench.report.write_outputs({"command": "kernels"}, None, rows, bench.report.kernel_table(rows), json_path=str(js))
    santa = next(r for r in json.loads(js.read_text())["rows"] if r["method"] == "santa-global-systematic-256")
    assert santa["best_peer"] == "flashinfer" and santa["x_peer"] == pytest.approx(1.4)


def _fake_flashinfer_module(version="0.6.13"):
    mod = types.ModuleType("flashinfer")
    mod.__version__ = version
    return mod


def test_flashinfer_in_every_method_list_when_it_imports(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer_module())
    fi = bench.gpu._optional_flashinfer()
    assert fi is sys.modules["flashinfer"]
    for kw in ({}, {"quick": True}, {"full": True}):
        names = [m.name for m in bench.methods.method_list(have_torch=True, have_flashinfer=fi is not None, **kw)]
        assert names[-1] == "flashinfer" and {"torch-cudnn", "torch-flash"} <= set(names)
    monkeypatch.setitem(sys.modules, "flashinfer", None)                  # `import flashinfer` fails
    assert bench.gpu._optional_flashinfer() is None
    assert "flashinfer" not in [m.name for m in bench.methods.method_list(have_torch=True, have_flashinfer=False)]


@pytest.mark.parametrize("importable", [True, False])
def test_kernels_cli_runs_the_peers_it_can_import(monkeypatch, tmp_path, importable):
    """bench kernels --quick with FlashInfer importable (a mock module) or not: the methods handed to
    bench_config, and x best peer in the JSON and Markdown (stand-ins for the GPU parts)."""
    monkeypatch.setitem(sys.modules, "flashinfer", _fake_flashinfer_module() if importable else None)
    monkeypatch.setattr(bench.kernels, "_cupy", lambda: types.SimpleNamespace())
    monkeypatch.setattr(bench.kernels, "_optional_torch", lambda: types.SimpleNamespace(__version__="2.9"))
    monkeypatch.setattr(bench.kernels, "gpu_metadata",
                        lambda cp, torch=None: {"gpu": "stand-in", "l2_bytes": 1, "sms": 1})
    us = {"dense": 40.0, "santa-global-systematic-256": 20.0, "torch-cudnn": 38.0, "torch-flash": 45.0, "flashinfer": 30.0}
    calls = []

    def fake_config(cp, torch, flashinfer, shape, B, L, methods, **kw):
        calls.append(([m.name for m in methods], flashinfer, kw["pdl"]))
        return [dict(shape=shape.name, B=B, L=L, method=m.name, external=m.external, bytes=10**8,
                     us=us.get(m.name, 50.0)) for m in methods]

    monkeypatch.setattr(bench.kernels, "bench_config", fake_config)
    js, md = tmp_path / "k.json", tmp_path / "k.md"
    result = CliRunner().invoke(bench.bench, ["kernels", "--quick", "--no-ceiling", "--json", str(js), "--markdown", str(md)])
    assert result.exit_code == 0, result.output
    assert len(calls) == 2                                                      # B = 1 and 16 at 32k
    methods, fi, pdl = calls[0]
    assert ("flashinfer" in methods) == importable and (fi is not None) == importable and pdl is False
    data = json.loads(js.read_text())
    assert data["meta"]["flashinfer"] == ("0.6.13" if importable else None)
    santa = next(r for r in data["rows"] if r["method"] == "santa-global-systematic-256")
    want = ("flashinfer", 30.0) if importable else ("torch-cudnn", 38.0)
    assert santa["best_peer"] == want[0] and santa["x_peer"] == pytest.approx(want[1] / 20.0)
    label = bench.methods.PEERS[want[0]]
    assert f"| {want[1] / 20.0:.2f}x ({label}) |" in md.read_text()


class _Tensor:
    pass


def _numpy_torch():
    """Just enough of torch for bench_flashinfer on NumPy: tensors are NumPy arrays, bf16 is int16."""
    np = pytest.importorskip("numpy")

    class Host(np.ndarray):
        def to(self, device):
            return np.asarray(self)

    return types.SimpleNamespace(
        bfloat16=np.dtype(np.int16), int16=np.dtype(np.int16), uint8=np.dtype(np.uint8),
        device=lambda kind, index=0: f"{kind}:{index}",
        zeros=lambda n, dtype, device: np.zeros(n, dtype), empty=lambda shape, dtype, device: np.empty(shape, dtype),
        from_numpy=lambda a: a.view(Host), from_dlpack=np.from_dlpack,
        cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None))


class _NumpyAsCupy:
    """NumPy standing in for CuPy (cp.cuda.Device().id and the array functions)."""

    def __init__(self):
        self.cuda = types.SimpleNamespace(Device=lambda: types.SimpleNamespace(id=0, synchronize=lambda: None))

    def __getattr__(self, name):
        import numpy
        return getattr(numpy, name)


class _FakeDecodeWrapper:
    """FlashInfer 0.6.13's BatchDecodeWithPagedKVCacheWrapper with the signatures of its __init__, plan
    and run as in flashinfer/decode.py at tag v0.6.13 (a wrong argument name or order fails here), and
    decode attention computed in NumPy from the page table as FlashInfer reads it."""

    made = []

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        self.workspace, self.kv_layout, self.use_tensor_cores = float_workspace_buffer, kv_layout, use_tensor_cores
        self.plans, self.runs = [], []
        _FakeDecodeWrapper.made.append(self)

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             pos_encoding_mode="NONE", window_left=-1, logits_soft_cap=None, q_data_type="float16",
             kv_data_type=None, o_data_type=None, data_type=None, sm_scale=None, rope_scale=None, rope_theta=None,
             non_blocking=True, block_tables=None, seq_lens=None, fixed_split_size=None, disable_split_kv=False,
             q_len_per_req=1):
        import numpy as np
        self.plans.append(dict(indptr=np.asarray(indptr), indices=np.asarray(indices), last=np.asarray(last_page_len),
                               heads=(num_qo_heads, num_kv_heads, head_dim), page_size=page_size,
                               q_data_type=q_data_type, kv_data_type=kv_data_type))

    def run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None, lse=None,
            return_lse=False, enable_pdl=None, window_left=None, sinks=None, q_len_per_req=None,
            skip_softmax_threshold_scale_factor=None, kv_cache_sf=None):
        import numpy as np
        plan = self.plans[-1]
        k_cache, v_cache = paged_kv_cache                         # NHD: [pages, page_size, KVH, D]
        assert k_cache.shape[1] == plan["page_size"] and q.dtype == plan["q_data_type"]
        assert k_cache.dtype == (plan["kv_data_type"] or plan["q_data_type"])
        self.runs.append(dict(k=k_cache, out=out, enable_pdl=enable_pdl))
        H, KVH, D = plan["heads"]
        f32 = lambda a: bench.peers.bf16_to_float32(np, np.ascontiguousarray(a).view(np.uint16))  # noqa: E731
        for b in range(len(plan["last"])):
            pages = plan["indices"][plan["indptr"][b]:plan["indptr"][b + 1]]
            n = (len(pages) - 1) * plan["page_size"] + plan["last"][b]
            k, v = (np.concatenate([c[p] for p in pages])[:n] for c in (k_cache, v_cache))
            for h in range(H):
                s = f32(k[:, h // (H // KVH)]) @ f32(q[b, h]) / np.sqrt(D)
                w = np.exp(s - s.max())
                o = (w / w.sum()) @ f32(v[:, h // (H // KVH)])
                out[b, h] = (o.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16).view(np.int16)
        return out


def _fake_flashinfer():
    _FakeDecodeWrapper.made = []
    mod = _fake_flashinfer_module("0.6.13-fake")
    mod.BatchDecodeWithPagedKVCacheWrapper = _FakeDecodeWrapper
    return mod


TINY = bench.methods.Shape("tiny", heads=4, kv_heads=2, head_dim=8)


def _bf16_inputs(B, L, copies=2, seed=0):
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(seed)

    def bits(shape):
        return (rng.standard_normal(shape, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)

    return [(bits((B, TINY.heads, TINY.head_dim)), bits((B, L, TINY.kv_heads, TINY.head_dim)),
             bits((B, L, TINY.kv_heads, TINY.head_dim))) for _ in range(copies)]


@pytest.fixture
def flashinfer_stand_ins(monkeypatch):
    timed = []

    def fake_timer(torch, fns, n_inner, repeats, warmup=3):
        for i in range(n_inner):
            fns[i % len(fns)]()
        timed.append(n_inner)
        return 7.5, "graph"

    monkeypatch.setattr(bench.peers, "time_torch_graph", fake_timer)
    monkeypatch.setattr(bench.peers, "_flashinfer_broken", {"planned": False, "why": None})
    return _numpy_torch(), _fake_flashinfer(), _NumpyAsCupy(), timed


@pytest.mark.parametrize("L", [64, 50])
def test_bench_flashinfer_calls_the_0_6_13_api_on_16_row_pages(flashinfer_stand_ins, L):
    np = pytest.importorskip("numpy")
    torch, fi, cp, timed = flashinfer_stand_ins
    B = 3
    inputs = _bf16_inputs(B, L)
    row = bench.peers.bench_flashinfer(torch, fi, cp, TINY, B, L, inputs, n_inner=4, repeats=3)
    assert row["us"] == 7.5 and row["timing"] == "graph", row
    assert row["check_error"] < 0.01                                    # bf16 rounding of the output only
    (w,) = _FakeDecodeWrapper.made
    assert w.kv_layout == "NHD" and w.use_tensor_cores and w.workspace.nbytes == 128 << 20 and not w.workspace.any()
    (plan,) = w.plans                                                   # planned once, before any run
    P = -(-L // 16)
    assert plan["indptr"].tolist() == list(range(0, B * P + 1, P)) and plan["indices"].tolist() == list(range(B * P))
    assert plan["last"].tolist() == [L - 16 * (P - 1)] * B and plan["page_size"] == 16
    assert plan["heads"] == (4, 2, 8) and plan["q_data_type"] == torch.bfloat16 == plan["kv_data_type"]
    assert len(w.runs) == 1 + 4 and timed == [4]                        # the check, then the timed calls
    assert all(r["out"] is w.runs[0]["out"] and r["enable_pdl"] is False for r in w.runs)
    views = [np.shares_memory(r["k"], k) for r in w.runs[1:] for _, k, _ in inputs[:1]]
    assert any(views) == (L % 16 == 0)                                  # zero copy unless L % 16 != 0
    assert ("a free view" in row["note"]) == (L % 16 == 0) and "tensor cores" in row["note"]


def test_bench_flashinfer_times_plainly_where_pdl_is_refused(flashinfer_stand_ins, monkeypatch):
    """bench kernels asks FlashInfer for PDL where ours use it; a build that refuses it is timed
    plainly, and the row's note says so."""
    torch, fi, cp, timed = flashinfer_stand_ins
    real_run = _FakeDecodeWrapper.run

    def run(self, *a, enable_pdl=None, **k):
        if enable_pdl:
            raise RuntimeError("PDL needs sm_90")
        return real_run(self, *a, enable_pdl=enable_pdl, **k)

    monkeypatch.setattr(_FakeDecodeWrapper, "run", run)
    row = bench.peers.bench_flashinfer(torch, fi, cp, TINY, 2, 64, _bf16_inputs(2, 64), n_inner=2, repeats=3,
                                       pdl=True)
    assert row["us"] == 7.5 and "pdl off (enable_pdl failed: RuntimeError: PDL needs sm_90" in row["note"], row
    (w,) = _FakeDecodeWrapper.made
    assert [r["enable_pdl"] for r in w.runs] == [False] * 3 and timed == [2]


def test_bench_flashinfer_refuses_a_wrong_page_table(flashinfer_stand_ins, monkeypatch):
    """The output check is what makes a wrong view fail before it is timed."""
    torch, fi, cp, timed = flashinfer_stand_ins
    np = pytest.importorskip("numpy")
    monkeypatch.setattr(bench.paged.PagedLayout, "indices", lambda self: np.arange(self.batch * self.pages_per_seq,
                                                                            dtype=np.int32)[::-1].copy())
    row = bench.peers.bench_flashinfer(torch, fi, cp, TINY, 2, 64, _bf16_inputs(2, 64), n_inner=2, repeats=3)
    assert row["us"] is None and "differs from the exact reference" in row["note"] and row["check_error"] > 0.1
    assert timed == []


def test_bench_flashinfer_stops_after_a_failed_first_plan(flashinfer_stand_ins, monkeypatch):
    torch, fi, cp, timed = flashinfer_stand_ins
    tries = []

    def broken_plan(self, *a, **k):
        tries.append(1)
        raise RuntimeError("Ninja build failed.\nlong log")

    monkeypatch.setattr(_FakeDecodeWrapper, "plan", broken_plan)
    first = bench.peers.bench_flashinfer(torch, fi, cp, TINY, 1, 32, _bf16_inputs(1, 32), n_inner=2, repeats=3)
    again = bench.peers.bench_flashinfer(torch, fi, cp, TINY, 2, 32, _bf16_inputs(2, 32), n_inner=2, repeats=3)
    assert first["us"] is None and first["note"] == "failed: RuntimeError: Ninja build failed."
    assert again["us"] is None and again["note"].startswith("skipped: FlashInfer did not plan") and tries == [1]


def test_reference_decode_matches_a_loop():
    np = pytest.importorskip("numpy")
    (q, k, v), = _bf16_inputs(2, 20, copies=1, seed=3)
    f = lambda a: bench.peers.bf16_to_float32(np, a)  # noqa: E731
    o = bench.peers.reference_decode(np, q, k, v, 1, "bfloat16")
    for h in range(TINY.heads):
        s = f(k[1, :, h // 2]) @ f(q[1, h]) / np.sqrt(TINY.head_dim)
        w = np.exp(s - s.max())
        assert np.allclose(o[h], (w / w.sum()) @ f(v[1, :, h // 2]), rtol=1e-5, atol=1e-6)
    assert bench.peers.bf16_to_float32(np, np.array([0x3F80, 0xC000], np.uint16)).tolist() == [1.0, -2.0]


def _source_gpu_check(script, tmp_path, pythonpath, **env):
    """Runs `script` in bash after sourcing tools/gpu_check.sh (its functions only) -> its last line."""
    full = {k: v for k, v in os.environ.items() if k not in ("FLASHINFER_OK", "FLASHINFER_WARM", "SANTA_WHEELS")}
    full.update(PYTHONPATH=str(pythonpath), OUT=str(tmp_path), **env)
    out = subprocess.run(["bash", "-c", f"source tools/gpu_check.sh || exit 9\n{script}"], cwd=ROOT, env=full,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.fixture
def flashinfer_dirs(tmp_path):
    """Two PYTHONPATH folders: one where `import flashinfer` works (a mock), one where it fails."""
    dirs = {}
    for name, body in (("importable", "__version__ = '0.6.13'\n"), ("missing", "raise ImportError('mock: absent')\n")):
        pkg = tmp_path / name / "flashinfer"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text(body)
        dirs[name] = tmp_path / name
    return dirs


def test_perf_script_peers_include_flashinfer_when_it_imports(tmp_path, flashinfer_dirs):
    assert _source_gpu_check("peers", tmp_path, flashinfer_dirs["importable"]) == "torch-cudnn,torch-flash,flashinfer"
    assert _source_gpu_check("peers", tmp_path, flashinfer_dirs["missing"]) == "torch-cudnn,torch-flash"
    # no FlashInfer: no warm-up started, and the methods of grid_run.sh end with the two torch peers
    assert _source_gpu_check('start_flashinfer_warm; echo "pid=${FLASHINFER_WARM:-}"', tmp_path,
                             flashinfer_dirs["missing"]) == "pid="
    text = (ROOT / "tools" / "grid_run.sh").read_text()
    assert "source tools/gpu_check.sh" in text and ",$(peers)}" in text and text.index("wait_flashinfer_warm") < text.index("$(peers)")


@pytest.mark.parametrize("us,want", [(12.0, "torch-cudnn,torch-flash,flashinfer"), (None, "torch-cudnn,torch-flash")])
def test_perf_script_peers_follow_the_warm_up(tmp_path, flashinfer_dirs, us, want):
    """A warm-up that timed its point keeps FlashInfer among the peers; one that did not leaves it out
    (a broken JIT build would otherwise be retried at every point of the grid)."""
    warm = tmp_path / "warm.json"
    warm.write_text(json.dumps({"rows": [{"method": "flashinfer", "us": us}]}))
    got = _source_gpu_check('(exit 0) & FLASHINFER_WARM=$!; wait_flashinfer_warm; peers', tmp_path,
                            flashinfer_dirs["importable"], FI_WARM_JSON=str(warm))
    assert got == want


def test_device_scripts_install_the_wheels_only_when_carried(tmp_path):
    """install_wheels is a no-op without .whl/*.whl (pip is not even called: a stand-in that fails)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "python3").write_text("#!/bin/sh\necho called >> \"$OUT/pip_called\"\nexit 1\n")
    (fake_bin / "python3").chmod(0o755)
    work = tmp_path / "tree"
    (work / "tools").mkdir(parents=True)
    (work / "tools" / "gpu_check.sh").write_text((ROOT / "tools" / "gpu_check.sh").read_text())
    env = dict(os.environ, PATH=f"{fake_bin}:{os.environ['PATH']}", OUT=str(tmp_path))
    env.pop("SANTA_WHEELS", None)
    script = 'source tools/gpu_check.sh || exit 9\ninstall_wheels; echo "ok ${FLASHINFER_DISABLE_VERSION_CHECK:-unset}"'
    run = lambda: subprocess.run(["bash", "-c", script], cwd=work, env=env, capture_output=True, text=True)  # noqa: E731
    res = run()
    assert res.stdout.strip() == "ok unset" and not (tmp_path / "pip_called").exists()
    (work / ".whl").mkdir()
    (work / ".whl" / "x-1-py3-none-any.whl").write_text("")
    res = run()                                           # now it calls pip (the stand-in fails: no export)
    assert (tmp_path / "pip_called").exists() and "ok unset" in res.stdout
    text = (ROOT / "tools" / "gpu_check.sh").read_text()
    assert ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
            ".whl/*.whl") in text and "FLASHINFER_DISABLE_VERSION_CHECK=1" in text


def test_fit_min_length_recovers_the_costs_it_was_given(tmp_path, capsys):
    """tools/fit_min_length.py on a synthetic run whose crossovers follow kernels.santa_min_length
    exactly (each batch's dense and santa lines cross there): the fit gives back the costs."""
    import importlib.util
    import json

    from santa_cupy import kernels
    spec_ = importlib.util.spec_from_file_location("fit_min_length", ROOT / "tools" / "fit_min_length.py")
    fit = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(fit)
    costs = {256: (7.5e-6, 2.5e-6), 2048: (12.0e-6, 9.0e-6)}
    rows = []
    for B in (1, 4, 16):
        for method, S in fit.SAMPLES.items():
            fixed, per_seq = costs[S]
            n = (fixed + B * per_seq) * 4.8e12 / (B * 8 * 128 * 2)
            for L in (2048, 8192, 32768, 131072):
                dense = 10.0 + B * L * 1e-3
                rows += [{"shape": "llama8b", "B": B, "L": L, "method": "dense", "us": dense},
                         {"shape": "llama8b", "B": B, "L": L, "method": method, "us": dense - B * 4e-4 * (L - n)}]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": rows}))
    assert fit.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "S=256: fixed 7.50 us + 2.50 us a sequence" in out
    assert "S=2048: fixed 12.00 us + 9.00 us a sequence" in out
    assert f"SANTA_FIXED_COST_PER_SAMPLE_S = {(12.0 - 7.5) / 1792 * 1e3:.1f}e-9" in out
    assert fit.crossover([1, 2, 3], [5, 5, 5], [4, 4, 4]) is None
    assert fit.crossover([1, 2], [5, 5], [6, 6]) == float("inf")
    assert kernels.SANTA_COST_SAMPLES == 256


@pytest.mark.gpu
def test_kernels_rows_that_ran_exact_on_the_gpu(tmp_path):
    """bench kernels at 4k (below the default plan's crossover): the default santa row ran exact,
    is noted so and counts dense's bytes; its -always row samples (fewer bytes, rows read < 1)."""
    from tests.gpu_util import HAVE_GPU
    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA GPU")
    out = tmp_path / "kernels.json"
    result = CliRunner().invoke(bench.bench, ["kernels", "--batch", "1", "--context", "4k", "--no-ceiling",
                                              "--repeats", "3", "--inner", "1", "--methods",
                                              "dense,santa-global-systematic-256,santa-global-systematic-256-always",
                                              "--json", str(out)])
    assert result.exit_code == 0, result.output
    dense, default, always = json.loads(out.read_text())["rows"]
    assert default["exact"] and default["note"] == "ran exact (below santa_min_length)"
    assert default["bytes"] == dense["bytes"] and default["rows_frac"] == 1.0
    assert not always["exact"] and always["bytes"] < dense["bytes"] and always["rows_frac"] < 1

"""What a benchmark run prints and writes: number formatting, the Markdown tables (kernels, stages,
e2e), the run's header and metadata, the JSON / Markdown files, the latency plot and the log line.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path

import click

from santa_cupy.cli.bench.methods import PEERS
from santa_cupy.cli.plotting import pyplot


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def fmt_context(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def _f(x, spec, suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


KERNEL_COLUMNS = ("shape", "method", "B", "L", "µs (median)", "bytes", "TB/s", "% ceiling",
                  "x our dense", "x best peer", "max x dense", "x best ext", "rows read", "K read", "note")


def _peer_cell(r) -> str:
    """'1.32x (cuDNN)': x best peer and who that peer was; '-' where no peer ran."""
    if r.get("x_peer") is None:
        return "-"
    return f"{r['x_peer']:.2f}x ({PEERS[r['best_peer']]})"


def kernel_table(rows: list[dict]) -> str:
    """Markdown table of kernel rows (after add_derived)."""
    lines = ["| " + " | ".join(KERNEL_COLUMNS) + " |", "|" + "---|" * len(KERNEL_COLUMNS)]
    for r in rows:
        cells = (r["shape"], r["method"], str(r["B"]), fmt_context(r["L"]), _f(r.get("us"), ".1f"),
                 fmt_bytes(r.get("bytes")), _f(r.get("tbps"), ".2f"), _f(r.get("pct_ceiling"), ".0f", "%"),
                 _f(r.get("x_dense"), ".2f", "x"), _peer_cell(r), _f(r.get("x_dense_bound"), ".2f", "x"),
                 _f(r.get("x_external"), ".2f", "x"), _f(r.get("rows_frac"), ".2%"),
                 _f(r.get("key_fraction") if r.get("key_fraction") is not None else (1.0 if r.get("us") else None), ".1%"),
                 (r.get("note") or "").replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


E2E_COLUMNS = ("method", "B", "context", "ms/token", "tokens/s", "byte floor ms", "% of floor",
               "x dense", "rows read (last layer)", "note")


def e2e_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(E2E_COLUMNS) + " |", "|" + "---|" * len(E2E_COLUMNS)]
    for r in rows:
        cells = (r["method"], str(r["B"]), fmt_context(r["L"]), _f(r.get("ms"), ".2f"), _f(r.get("tok_s"), ".1f"),
                 _f(r.get("floor_ms"), ".2f"), _f(r.get("pct_floor"), ".0f", "%"), _f(r.get("x_dense"), ".2f", "x"),
                 _f(r.get("rows_frac"), ".2%"), (r.get("note") or "").replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def header_markdown(meta: dict, ceiling: dict | None) -> str:
    out = [f"# santa-cupy bench {meta.get('command', '')}", ""]
    for key in ("gpu", "cupy", "torch", "flashinfer", "date", "commit", "timing", "model", "byte_floor_text",
                "weight_products", "programmatic_launch"):
        if meta.get(key) is not None:
            out.append(f"- {key}: {meta[key]}")
    if ceiling:
        out.append(f"- streaming read ceiling: {_f(ceiling.get('read_tbps'), '.2f')} TB/s "
                   f"({fmt_bytes(ceiling.get('read_bytes'))} buffers; {ceiling.get('read_launch', '')}); device copy: "
                   f"{_f(ceiling.get('copy_tbps'), '.2f')} TB/s (read + write)")
    return "\n".join(out) + "\n\n"


def run_metadata(command: str) -> dict:
    """Date and git commit (tolerating no git); GPU fields are added by gpu_metadata()."""
    commit = os.environ.get("SANTA_CUPY_COMMIT")      # set where the tree has no .git (device copies)
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 timeout=10, cwd=Path(__file__).resolve().parent)
            commit = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit}


def write_outputs(meta, ceiling, rows, table, *, json_path=None, markdown_path=None):
    text = header_markdown(meta, ceiling) + table
    click.echo(text)
    try:
        if markdown_path:
            Path(markdown_path).write_text(text)
        if json_path:
            Path(json_path).write_text(json.dumps({"meta": meta, "ceiling": ceiling, "rows": rows}, indent=1,
                                                  default=str))
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the results'}: {e.strerror or e}") from None


def _log(msg):
    click.echo(msg, err=True)


def _exc_line(exc, width=120) -> str:
    """'TypeName: first line of the message' (cut to width) for a row's note."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:width] if text else ''}"



def plot_rows(rows, path):
    """PNG of kernel rows (after add_derived): per (shape, B) a column of two panels against context,
    latency (µs) on top and speedup over our dense ("x our dense") below. Needs matplotlib."""
    plt = pyplot()
    if plt is None:
        return
    panels = sorted({(r["shape"], r["B"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False, sharex="col")
    for col, (shape, B) in enumerate(panels):
        latency, speedup = axes[0][col], axes[1][col]
        for m in dict.fromkeys(r["method"] for r in rows):
            mine = sorted((r for r in rows if (r["shape"], r["B"], r["method"]) == (shape, B, m) and r.get("us")),
                          key=lambda r: r["L"])
            if not mine:
                continue
            contexts = [r["L"] for r in mine]
            line, = latency.plot(contexts, [r["us"] for r in mine], marker="o", label=m)
            if m != "dense" and all(r.get("x_dense") for r in mine):     # a method keeps its colour
                speedup.plot(contexts, [r["x_dense"] for r in mine], marker="o", label=m, color=line.get_color())
        latency.set(xscale="log", yscale="log", ylabel="µs", title=f"{shape} B={B}")
        latency.legend(fontsize=6)
        speedup.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        speedup.set(xscale="log", xlabel="context", ylabel="x our dense")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _log(f"plot written to {path}")



def stage_table(title: str, rows: list[dict]) -> str:
    lines = [f"### {title}", "", "| stage | µs | share of the sum of stages |", "|---|---|---|"]
    for r in rows:
        share = "-" if r["stage"] == "whole call" or r["share"] is None else f"{100 * r['share']:.0f}%"
        lines.append(f"| {r['stage']} | {r['us']:.1f} | {share} |")
    return "\n".join(lines) + "\n"


"""What an evaluation writes: the Markdown tables and report, the plot, the JSON, and the merge of
runs of one configuration.
"""

from __future__ import annotations

import json

import click
import numpy as np

from santa_cupy.cli.evaluation.metrics import mean_std, success_rate
from santa_cupy.cli.plotting import pyplot


def fmt_ms(m: float, s: float, digits: int = 3) -> str:
    return f"{m:.{digits}g} ± {s:.2g}"


def markdown_table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def _setting_cells(st: dict) -> list:
    if st["method"] == "dense":
        return ["dense", "-", "-"]
    return [st["sampler"], st["budget"], st["samples"]]


# key (score-stage) sampling: the tables gain a "keys" and a "K read" column only when a setting
# has it, so reports of runs without key sampling read as before


def is_key_sampled(st: dict) -> bool:
    return st.get("key_sampling", "none") != "none"


def key_spec(st: dict) -> str:
    """The keys= part of a setting's name ("block:FB=16,f=0.875"), "-" without key sampling."""
    if not is_key_sampled(st):
        return "-"
    from santa_cupy import AttentionSetting
    return str(AttentionSetting(**st)).partition("/keys=")[2]


def key_read(entry: dict) -> float:
    """Mean fraction of K read of a result entry (1.0 without key sampling)."""
    if not is_key_sampled(entry["setting"]):
        return 1.0
    rows = entry.get("per_seed") or entry.get("trials") or []
    return float(np.mean([r["key_fraction"] for r in rows]))


def _any_keys(entries) -> bool:
    return any(is_key_sampled(e["setting"]) for e in entries)


def _key_cells(entry: dict) -> list:
    return [key_spec(entry["setting"]), f"{key_read(entry):.3f}"]


def kernel_table(res: dict) -> str:
    rows = []
    keys = _any_keys(res.values())
    for entry in res.values():
        means = [p["mean"] for p in entry["per_seed"]]
        worst = max(max(p["layers"].values()) for p in entry["per_seed"])
        row = _setting_cells(entry["setting"]) + (_key_cells(entry) if keys else []) + \
            [fmt_ms(*mean_std(means)), f"{worst:.3g}"]
        if keys:
            kb = entry.get("key")
            row += [f"{kb['lse_bias']:.3g}", f"{kb['output_bias']:.3g}", f"{kb['bias_share']:.2f}"] if kb else \
                ["-", "-", "-"]
        rows.append(row)
    head = ["sampler", "budget", "S"] + (["keys", "K read"] if keys else []) + \
        ["rel. L2 error (mean over layers, ± std over seeds)", "worst layer"]
    if keys:
        head += ["lse bias (nats)", "output bias", "bias share"]
    return markdown_table(head, rows)


def model_table(res: dict) -> str:
    rows = []
    keys = _any_keys(res["results"].values())
    for entry in res["results"].values():
        ps = entry["per_seed"]
        col = lambda k: mean_std([p[k] for p in ps])  # noqa: E731
        rows.append(_setting_cells(entry["setting"]) + (_key_cells(entry) if keys else []) + [
            fmt_ms(*col("kl")), fmt_ms(*col("top1")), fmt_ms(*col("ppl"), 4),
            fmt_ms(*col("greedy_match"))])
    return markdown_table(["sampler", "budget", "S"] + (["keys", "K read"] if keys else []) +
                          ["KL(dense ‖ santa) / token", "top-1 agreement",
                           "perplexity", f"greedy exact match (of {res['greedy_tokens']})"], rows)


def retrieval_table(res: dict) -> str:
    lengths = sorted({t["length"] for e in res.values() for t in e["trials"]})
    rows = []
    keys = _any_keys(res.values())
    for entry in res.values():
        cells = []
        for L in lengths:
            flags = [t["success"] for t in entry["trials"] if t["length"] == L]
            cells.append(f"{success_rate(flags):.2f} ({sum(flags)}/{len(flags)})")
        allf = [t["success"] for t in entry["trials"]]
        rows.append(_setting_cells(entry["setting"]) + (_key_cells(entry) if keys else []) + cells +
                    [f"{success_rate(allf):.2f}"])
    return markdown_table(["sampler", "budget", "S"] + (["keys", "K read"] if keys else []) +
                          [f"L={L}" for L in lengths] + ["all"], rows)


KEY_NOTE = ("Key sampling (santa_cupy.key_sampling, the NumPy reference): the scores are estimated from part of "
            "K, then the row's value stage runs on them (sampler '-': the exact softmax). K read = fraction of the "
            "K bytes read (blocks of the block estimator; 32-byte sectors of 2-byte storage for the per-feature "
            "one), mean over layers, steps and seeds. Softmax of unbiased noisy scores is biased: lse bias = "
            "E[lse(s_hat)] - lse(s) in nats (>= 0 by Jensen), output bias = ||E o_hat - o|| / ||o|| with the "
            "seed noise subtracted (bias^2 = ||mean - o||^2 - var/seeds), bias share = sum bias^2 / sum MSE, "
            "over the seeds of eval kernel.")


# ============================================================================ plots


YLABELS = {"kernel": "rel. L2 error", "model": "KL(dense || santa)", "retrieval": "success rate"}


def write_plot(path: str, results: dict) -> None:
    """One panel per evaluation against S (the santa grid); with key sampling a second row of
    panels against the fraction of K read (one line per estimator and value stage)."""
    plt = pyplot()
    if plt is None:
        return
    panels = [k for k in ("kernel", "model", "retrieval") if k in results]
    rows = [kind for kind, fn in (("S", _plot_series), ("keys", _key_series))
            if kind == "S" or any(fn(name, results[name]) for name in panels)]
    if len(rows) > 1 and not any(_plot_series(name, results[name]) for name in panels):
        rows = ["keys"]                     # a --no-grid run: only the key-sampling panels
    fig, axes = plt.subplots(len(rows), len(panels), figsize=(6 * len(panels), 4.5 * len(rows)), squeeze=False)
    for r, kind in enumerate(rows):
        for ax, name in zip(axes[r], panels):
            series = (_plot_series if kind == "S" else _key_series)(name, results[name])
            for label, (xs, ys) in series.items():
                order = np.argsort(xs)
                ax.plot(np.asarray(xs)[order], np.asarray(ys)[order], marker="o", label=label)
            if kind == "S":
                ax.set_xscale("log", base=2)
                ax.set_xlabel("S (samples per head)")
            else:
                ax.set_xlabel("fraction of K read")
            ax.set_ylabel(YLABELS[name])
            if name != "retrieval" and series:
                ax.set_yscale("log")
            ax.set_title(f"eval {name}" + (" (key sampling)" if kind == "keys" else ""))
            if series:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    click.echo(f"wrote {path}", err=True)


def _metric(name: str, entry: dict) -> float:
    if name == "kernel":
        return mean_std([p["mean"] for p in entry["per_seed"]])[0]
    if name == "model":
        return mean_std([p["kl"] for p in entry["per_seed"]])[0]
    return success_rate(t["success"] for t in entry["trials"])


def _plot_series(name: str, res: dict) -> dict:
    entries = res["results"]
    series: dict[str, tuple[list, list]] = {}
    for entry in entries.values():
        st = entry["setting"]
        if st["method"] == "dense" or is_key_sampled(st):
            continue
        xs, ys = series.setdefault(f"{st['sampler']}/{st['budget']}", ([], []))
        xs.append(st["samples"])
        ys.append(_metric(name, entry))
    return series


def _key_series(name: str, res: dict) -> dict:
    """{estimator: (K fractions, metric)}: one line per key estimator and value stage, along its
    budget (block: f= or the variance target v=; bernoulli: the draws R); KL 0 (log axis) left out."""
    series: dict[str, tuple[list, list]] = {}
    for entry in res["results"].values():
        st = entry["setting"]
        if not is_key_sampled(st):
            continue
        y = _metric(name, entry)
        if name == "model" and y <= 0:
            continue
        block = st["key_sampling"] == "bernoulli_block"
        along = ("f=", "v=") if block else ("R=", "bernoulli:R=")
        spec_items = [x for x in key_spec(st).split(",") if not x.startswith(along)]
        target = ("v" if st.get("key_variance") is not None else "f") if block else "R"
        value = "dense" if st["method"] == "dense" else f"{st['sampler']}/{st['budget']}/S={st['samples']}"
        label = ",".join(spec_items if block else ["bernoulli"] + spec_items) + f" ({target}) + {value}"
        xs, ys = series.setdefault(label, ([], []))
        xs.append(key_read(entry))
        ys.append(y)
    return series



TABLES = {"kernel": lambda r: kernel_table(r["results"]), "model": model_table,
          "retrieval": lambda r: retrieval_table(r["results"])}
TITLES = {"kernel": "Attention output: relative L2 error vs exact float64 attention",
          "model": "Teacher forcing: next-token distributions vs dense decode",
          "retrieval": "Passcode retrieval: success rate"}


def report_markdown(results: dict) -> str:
    h = results["config"]
    parts = [f"# santa-cupy eval\n\nmodel `{h['model']}`, device {h['device']}, KV dtype "
             f"{h['kv_dtype']}, seeds {h['seeds']}" + (" (--small)" if h["small"] else "")]
    for name in ("kernel", "model", "retrieval"):
        if name in results:
            r = results[name]
            extra = ""
            if name == "kernel":
                extra = f" (context {r['context']}, layers {r['layers']})"
            elif name == "model":
                extra = f" (context {r['context']}, {r['steps']} decode steps after a {r['prefix']}-token prefix)"
            parts.append(f"## {TITLES[name]}{extra}\n\n{TABLES[name](r)}")
            if _any_keys(r["results"].values()):
                parts.append(KEY_NOTE if name == "kernel" else KEY_NOTE.rsplit(" Softmax", 1)[0])
            if name == "model" and r.get("dense_greedy_margins"):
                mg = r["dense_greedy_margins"]
                i = int(np.argmin(mg))
                parts.append(f"Dense greedy path: smallest top-1 - top-2 logit margin {mg[i]:.3g} at "
                             f"token {i} (a near tie there makes any later divergence a coin flip).")
    return "\n\n".join(parts) + "\n"



def write_report(results: dict, json_path=None, md_path=None, plot_path=None) -> None:
    """Print the Markdown report; optionally write the raw JSON, the report and a plot."""
    emit_report(report_markdown(results), results, json_path, md_path, plot_path, write_plot)


def emit_report(md: str, results: dict, json_path=None, md_path=None, plot_path=None, plot=None) -> None:
    """Print the Markdown report md, then write the results as JSON, md and plot(plot_path, results)
    where asked; a file that cannot be written is one error line (the printed report survives)."""
    click.echo(md)                           # first: the results survive a file that cannot be written
    try:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1, default=_json_default)
            click.echo(f"wrote {json_path}", err=True)
        if md_path:
            with open(md_path, "w") as f:
                f.write(md)
            click.echo(f"wrote {md_path}", err=True)
        if plot_path:
            plot(plot_path, results)
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the report'}: {e.strerror or e}") from None


MERGE_SAME_CONFIG = ("model", "kv_dtype", "seeds", "block_n", "small")   # must agree across merged runs
MERGE_UNION_CONFIG = ("samplers", "budgets", "samples", "settings")         # the merged run covers all


def merge_results(parts: list) -> dict:
    """One results dict from runs of the same evaluation(s) split by setting, e.g. the retrieval
    grid run as ``--budgets global,largest_remainder`` and ``--budgets fixed`` to fit a time limit.

    Per evaluation the "results" ({label: entry}) are united: a label may appear in several runs
    only if its entries are identical (dense, which every run repeats, is deterministic), else
    ValueError. Every other field of an evaluation (context, lengths, dense greedy path, ...) and
    the config's model / dtype / seeds must agree; samplers / budgets / samples are united (first
    seen order) and the seconds are added up. ``config["merged_from"]`` counts the runs.
    """
    if not parts:
        raise ValueError("nothing to merge")
    config = dict(parts[0]["config"])
    for i, part in enumerate(parts[1:], 2):
        for key in MERGE_SAME_CONFIG:
            if part["config"].get(key) != config.get(key):
                raise ValueError(f"run {i} differs in config[{key!r}]: {part['config'].get(key)!r} != "
                                 f"{config.get(key)!r}")
        for key in MERGE_UNION_CONFIG:
            if key in config or key in part["config"]:     # "settings": only runs with --setting / --keys
                config[key] = list(dict.fromkeys(list(config.get(key) or []) + list(part["config"].get(key) or [])))
    config["seconds"] = round(sum(p["config"].get("seconds", 0) for p in parts), 2)
    config["merged_from"] = len(parts)
    merged = {"config": config}
    for name in ("kernel", "model", "retrieval"):
        runs = [p[name] for p in parts if name in p]
        if not runs:
            continue
        out = {k: v for k, v in runs[0].items() if k not in ("results", "seconds")}
        out["results"] = {}
        for i, run in enumerate(runs, 1):
            for key, value in run.items():
                if key not in ("results", "seconds") and value != out.get(key):
                    raise ValueError(f"{name}: run {i} differs in {key!r}")
            for label, entry in run["results"].items():
                if label in out["results"] and out["results"][label] != entry:
                    raise ValueError(f"{name}: {label!r} appears in several runs with different results")
                out["results"][label] = entry
        out["seconds"] = round(sum(r.get("seconds", 0) for r in runs), 2)
        merged[name] = out
    return merged


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


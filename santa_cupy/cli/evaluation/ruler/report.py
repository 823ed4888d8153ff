"""What ``eval ruler`` writes: the Markdown report, the plot, the JSON, and the merge of runs.
"""

from __future__ import annotations

import json
import os

import click
import numpy as np

from santa_cupy.cli.evaluation.report import emit_report, markdown_table
from santa_cupy.cli.evaluation.ruler.summary import summarize, timings
from santa_cupy.cli.plotting import pyplot


def _cell(row: dict, dense: bool) -> str:
    if row is None:
        return "-"
    s = f"{row['score']:.1f} ± {row['se']:.1f}"
    if dense:
        return s + f" ({row['fails']} fail{'s' if row['fails'] != 1 else ''})"
    return s + f" ({row['delta']:+.1f}; −{row['lost']}/+{row['gained']})"


def report_markdown(results: dict) -> str:
    c, summ = results["config"], results["summary"]
    labels = c["settings"]
    parts = [f"# santa-cupy eval ruler\n\nmodel `{c['model']}`, device {c['device']}, KV dtype {c['kv_dtype']}, "
             f"seeds {c['seeds']}, data: {c['data']}, max new tokens: {c['max_new_tokens']}"
             + (", early stop once the score is 1 (same scores)" if not c["full_answers"] else "")
             + f", {c['seconds']:.0f} s.",
             "Scores: RULER's metrics x 100 (string_match_all; QA string_match_part), mean over samples "
             "(a sample's seeds averaged first). `±` is the binomial standard error sqrt(p(1-p)/n). Dense "
             "cells give the number of samples dense does not fully solve (its own failures); a setting's "
             "cell gives (Δ vs dense on the same samples; −samples where it scored below dense / +above). "
             f"Tasks marked ⚑ score below {summ['parity_floor']:g} with dense and are left out of the "
             "parity average."]
    lengths = sorted(summ["lengths"], key=int)
    head = ["setting"] + [f"L={L} average" for L in lengths] + [f"L={L} parity average" for L in lengths]
    rows = []
    for lab in labels:
        cells = []
        for name in ("average", "parity_average"):
            for L in lengths:
                a = summ["lengths"][L]["settings"].get(lab, {}).get(name)
                if a is None:
                    cells.append("-")
                elif lab == "dense":
                    cells.append(f"{a['score']:.2f} ± {a['se']:.2f}")
                else:
                    cells.append(f"{a['score']:.2f} ± {a['se']:.2f} ({a['delta']:+.2f} ± {a['delta_se']:.2f})")
        rows.append([lab] + cells)
    parts.append("## RULER average per length\n\n(Δ vs dense ± its paired standard error in brackets)\n\n"
                 + markdown_table(head, rows))
    for L in lengths:
        b = summ["lengths"][L]
        rows = []
        for t in b["tasks"]:
            name = f"{t} ⚑" if t in b["flagged"] else t
            n = b["settings"]["dense"]["tasks"][t]["n"]
            rows.append([name, n] + [_cell(b["settings"][lab]["tasks"].get(t), lab == "dense") for lab in labels])
        for name in ("average", "parity_average"):
            cells = []
            for lab in labels:
                a = b["settings"][lab].get(name)
                cells.append("-" if a is None else f"{a['score']:.2f} ± {a['se']:.2f}"
                             + ("" if lab == "dense" else f" ({a['delta']:+.2f} ± {a['delta_se']:.2f})"))
            rows.append([f"**{name.replace('_', ' ')}**", "", *cells])
        parts.append(f"## L = {L}\n\n" + markdown_table(["task", "n"] + list(labels), rows))
    stat = []
    for L in lengths:
        b = summ["lengths"][L]
        for lab in labels:
            a = b["settings"][lab].get("parity_average") or b["settings"][lab].get("average")
            if a is None or lab == "dense":
                continue
            unseen = f"- (no spread at n={a['n']})"
            stat.append([L, lab, a["tasks"], a["n"], f"{a['se']:.2f}", f"{a['delta_se']:.2f}",
                         a["samples_to_resolve_2pt_independent"] or unseen,
                         a["samples_to_resolve_2pt_paired"] or unseen])
    parts.append("## Resolution\n\nA 2-point difference on the (parity) average is resolved when it is two "
                 "standard errors of the difference. Independent samples: SE of the difference = "
                 "hypot(SE setting, SE dense); paired (same samples, as here): the standard error of the "
                 "per-sample differences. Samples per task needed = n (2 SE / 2)^2. Worst case for 13 tasks, "
                 "independent samples, every task at p = 0.5: 385 per task. Paired, with a fraction d of "
                 "the samples scored 1 apart: about 770 d per task (50 samples resolve 2 points while "
                 "d <= 6.5 %).\n\n" + markdown_table(
                     ["L", "setting", "tasks", "n per task", "SE of average", "SE of paired Δ",
                      "samples for 2 pts (independent)", "samples for 2 pts (paired)"], stat))
    tm = results["timings"]
    rows = [[lab, f"{tm['decode_s_per_sample'].get(lab, 0):.2f}", f"{tm['new_tokens_per_sample'].get(lab, 0):.1f}"]
            for lab in labels]
    side = (" The settings of a sample decode side by side (captured steps on streams of their own): a "
            "setting's time runs from their start to its last token.") if c.get("decoder") == "graph" else ""
    parts.append(f"## Time\n\nprefill {tm['prefill_s_per_sample']:.2f} s per sample (once, dense, shared by "
                 "every setting)." + side + "\n\n" + markdown_table(["setting", "decode s per sample (per seed)",
                                                           "new tokens per sample"], rows))
    return "\n\n".join(parts) + "\n"


def write_plot(path: str, results: dict) -> None:
    plt = pyplot()
    if plt is None:
        return
    summ, labels = results["summary"], results["config"]["settings"]
    lengths = sorted(summ["lengths"], key=int)
    fig, axes = plt.subplots(len(lengths), 1, figsize=(13, 3.6 * len(lengths)), squeeze=False)
    for ax, L in zip(axes[:, 0], lengths):
        b = summ["lengths"][L]
        names = b["tasks"] + ["average"]
        w = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            e = b["settings"][lab]
            ys = [e["tasks"][t]["score"] if t in e["tasks"] else np.nan for t in b["tasks"]]
            es = [e["tasks"][t]["se"] if t in e["tasks"] else 0 for t in b["tasks"]]
            ys.append(e["average"]["score"] if e["average"] else np.nan)
            es.append(e["average"]["se"] if e["average"] else 0)
            ax.bar(np.arange(len(names)) + (j - (len(labels) - 1) / 2) * w, ys, w, yerr=es, label=lab,
                   capsize=1.5)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("RULER score")
        ax.set_title(f"RULER at L = {L}")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    click.echo(f"wrote {path}", err=True)


def write_report(results: dict, json_path=None, md_path=None, plot_path=None) -> None:
    """Print the RULER report; optionally write the raw JSON, the report and a plot."""
    emit_report(report_markdown(results), results, json_path, md_path, plot_path, write_plot)



CHECKPOINT_EVERY = 10            # samples between two checkpoints of the --json file


def write_checkpoint(path, results: dict) -> None:
    """The results so far into path, atomically (a temporary file, then a rename): a run killed
    mid-write leaves the previous checkpoint."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or path}: {e.strerror or e}") from None


MERGE_SAME = ("model", "kv_dtype", "full_answers", "block_n")


def read_run(path) -> dict:
    """The results dict of an eval ruler --json file (a ClickException if it is not one)."""
    try:
        with open(path, encoding="utf-8") as f:
            part = json.load(f)
    except (OSError, ValueError) as e:
        raise click.ClickException(f"cannot read {path}: {e}") from None
    if not isinstance(part, dict) or not isinstance(part.get("records"), list) or "config" not in part:
        raise click.ClickException(f"{path} is not the --json output of eval ruler (no 'records')")
    return part


def check_same(name, config: dict, other: dict) -> None:
    """Runs can be joined only with the same model, KV dtype, early stop and tile size (MERGE_SAME)."""
    for k in MERGE_SAME:
        if other.get(k) != config.get(k):
            raise click.ClickException(f"{name} differs in {k}: {other.get(k)!r} != {config.get(k)!r}")


def _answer(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.endswith("_s")}      # timings may differ


def combine_runs(parts) -> dict:
    """One results dict from [(name, results dict)]: the records united, settings and seeds united
    in first-seen order, the summary recomputed. Records with the same record_key (task, length,
    sample index, setting, seed) are duplicates: identical ones but for their timings are kept
    once (the first; a note on stderr counts them), differing ones are an error."""
    from santa_cupy.cli.evaluation.ruler.runs import record_key
    config = dict(parts[0][1]["config"])
    for k in ("samples_run", "samples_pending", "partial"):          # a part's own
        config.pop(k, None)
    seen: dict = {}
    dupes = 0
    for name, part in parts:
        c = part["config"]
        check_same(name, config, c)
        for k in ("settings", "seeds"):
            config[k] = list(dict.fromkeys(list(config[k]) + list(c[k])))
        config.setdefault("setting_fields", {}).update(c.get("setting_fields", {}))
        for r in part["records"]:
            key = record_key(r)
            if key in seen:
                if _answer(seen[key]) != _answer(r):
                    raise click.ClickException(f"{name}: {key} differs from an earlier run's record")
                dupes += 1
                continue
            seen[key] = r
    if dupes:
        click.echo(f"merge: {dupes} duplicate record{'s' if dupes != 1 else ''} (same task, length, sample, "
                   "setting, seed and answer) counted once", err=True)
    records = list(seen.values())
    config["seconds"] = round(sum(part["config"].get("seconds", 0) for _, part in parts), 2)
    config["merged_from"] = [os.path.basename(str(p)) for p, _ in parts]
    if len({part["config"]["data"] for _, part in parts}) > 1:
        config["data"] = "; ".join(dict.fromkeys(part["config"]["data"] for _, part in parts))
    return {"config": config, "summary": summarize(records, config["settings"]), "timings": timings(records),
            "records": records}


def merge_runs(paths) -> dict:
    """One results dict from the --json files of several runs (parts split by task, length, setting,
    --skip / --samples, --time-limit, or --resume): combine_runs of the files."""
    return combine_runs([(p, read_run(p)) for p in paths])

"""RULER's statistics: scores per task, length and setting, binomial standard errors, the samples
a difference needs, and decode timings.
"""

from __future__ import annotations

import math

import numpy as np

from santa_cupy.cli.evaluation.ruler.tasks import PARITY_FLOOR, RESOLVE_POINTS, STANDARD_TASKS


def binomial_se(p: float, n: int) -> float:
    """Standard error of a success rate p in [0, 1] over n samples: sqrt(p (1 - p) / n) (for the
    fractional scores of string_match_all an upper bound, as their variance is at most p (1 - p))."""
    if n < 1:
        raise ValueError("no samples")
    p = min(max(p, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / n)


def samples_to_resolve(se_diff_points: float, n: int, points: float = RESOLVE_POINTS) -> int | None:
    """Samples per task at which a difference of `points` is two standard errors, given the
    standard error se_diff_points of the difference measured with n samples per task (None when
    that is 0: no spread seen, nothing to scale)."""
    if se_diff_points <= 0:
        return None
    return max(1, math.ceil(n * (2.0 * se_diff_points / points) ** 2))


def summarize(records, labels, parity_floor: float = PARITY_FLOOR) -> dict:
    """Per length, per task and per setting: mean score x 100 (samples' scores averaged over seeds
    first), binomial standard error, and the paired comparison with dense on the same samples.
    The average over tasks (and over the tasks where dense >= parity_floor) with its standard error
    sqrt(sum se_t^2) / T, and the samples per task that resolve a 2-point difference."""
    per: dict = {}
    for r in records:
        key = (r["max_seq_length"], r["task"], r["setting"])
        per.setdefault(key, {}).setdefault(r["index"], []).append(r["score"])
    lengths = sorted({k[0] for k in per})
    out = {"parity_floor": parity_floor, "lengths": {}}
    for L in lengths:
        tasks = [t for t in STANDARD_TASKS if (L, t, "dense") in per] + sorted(
            {k[1] for k in per if k[0] == L and k[2] == "dense"} - set(STANDARD_TASKS))
        dense_avg = {t: {i: float(np.mean(v)) for i, v in per[(L, t, "dense")].items()} for t in tasks}
        block = {"tasks": tasks, "flagged": [], "settings": {}}
        for lab in labels:
            rows = {}
            for t in tasks:
                if (L, t, lab) not in per:
                    continue
                s = {i: float(np.mean(v)) for i, v in per[(L, t, lab)].items()}
                idx = sorted(set(s) & set(dense_avg[t]))
                x = np.array([s[i] for i in idx])
                d = np.array([dense_avg[t][i] for i in idx])
                n = len(idx)
                diff = x - d
                rows[t] = {"n": n, "score": 100 * float(x.mean()), "se": 100 * binomial_se(float(x.mean()), n),
                           "fails": int(np.sum(x < 1.0)),
                           "delta": 100 * float(diff.mean()),
                           "delta_se": 100 * float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
                           "lost": int(np.sum(diff < 0)), "gained": int(np.sum(diff > 0))}
            block["settings"][lab] = {"tasks": rows}
        dense_rows = block["settings"]["dense"]["tasks"]
        block["flagged"] = [t for t in tasks if dense_rows[t]["score"] < parity_floor]
        for lab, entry in block["settings"].items():
            rows = entry["tasks"]
            for name, sel in (("average", tasks), ("parity_average",
                                                   [t for t in tasks if t not in block["flagged"]])):
                sel = [t for t in sel if t in rows]
                if not sel:
                    entry[name] = None
                    continue
                T = len(sel)
                se = math.sqrt(sum(rows[t]["se"] ** 2 for t in sel)) / T
                dse = math.sqrt(sum(rows[t]["delta_se"] ** 2 for t in sel)) / T
                dense_se = math.sqrt(sum(dense_rows[t]["se"] ** 2 for t in sel)) / T
                n = min(rows[t]["n"] for t in sel)
                entry[name] = {"tasks": T, "score": float(np.mean([rows[t]["score"] for t in sel])), "se": se,
                               "delta": float(np.mean([rows[t]["delta"] for t in sel])), "delta_se": dse,
                               "n": n,
                               "samples_to_resolve_2pt_independent": samples_to_resolve(math.hypot(se, dense_se), n),
                               "samples_to_resolve_2pt_paired": samples_to_resolve(dse, n) if lab != "dense" else None}
        out["lengths"][L] = block
    return out


def timings(records) -> dict:
    """Seconds per sample: prefill (once per sample) and decode per setting, mean over samples."""
    pre = [r["prefill_s"] for r in records if r["prefill_s"] > 0]
    dec: dict = {}
    for r in records:
        dec.setdefault(r["setting"], []).append((r["decode_s"], r["new_tokens"]))
    return {"prefill_s_per_sample": float(np.mean(pre)) if pre else 0.0,
            "decode_s_per_sample": {k: float(np.mean([a for a, _ in v])) for k, v in dec.items()},
            "new_tokens_per_sample": {k: float(np.mean([b for _, b in v])) for k, v in dec.items()}}


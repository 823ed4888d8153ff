"""Regenerate the H200 accuracy plots (docs/plots/h200_*.png) from the eval JSON files.

Run from the repository root: PYTHONPATH=. python docs/plots/make_h200_plots.py
Each JSON is a results dict ({"config", <name>}) as written by `santa-cupy eval <name> --json`;
evaluation.report.write_plot draws one panel per evaluation present, so one PNG per evaluation.
  docs/results/eval_h200     -> h200_*.png     commit 97995f3, v2 kernels (retrieval: reduced grid)
  docs/results/eval_h200_v4  -> h200_v4_*.png  commit 7a34e04, v4 kernels, full grids (the
                                               retrieval JSON merged from two device calls)
"""
import json
import os

from santa_cupy.cli import evaluation

RUNS = {"docs/results/eval_h200": "h200_", "docs/results/eval_h200_v4": "h200_v4_"}
OUT = "docs/plots"
NAMES = {"kernel": "kernel_error.png", "model": "model_kl.png", "retrieval": "retrieval.png"}

for src, prefix in RUNS.items():
    for name, png in NAMES.items():
        with open(os.path.join(src, f"{name}.json")) as f:
            results = json.load(f)
        evaluation.report.write_plot(os.path.join(OUT, prefix + png), {name: results[name]})

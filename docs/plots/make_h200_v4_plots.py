"""Regenerate docs/plots/h200_v4_*.png from docs/results/eval_h200_v4/*.json with evaluate.write_plot.

Run from the repository root: PYTHONPATH=. python docs/plots/make_h200_v4_plots.py
The H200 eval of commit 7a34e04 (v4 kernels): kernel and model full grids, retrieval full grid (the
JSON merged from the two device calls, --budgets global,largest_remainder and --budgets fixed).
Each JSON is a results dict ({"config", <name>}) as written by `santa-cupy eval <name> --json`;
write_plot draws one panel per evaluation present, so one PNG per evaluation.
"""
import json
import os

import evaluate

SRC = "docs/results/eval_h200_v4"
OUT = "docs/plots"
NAMES = {"kernel": "h200_v4_kernel_error.png", "model": "h200_v4_model_kl.png",
         "retrieval": "h200_v4_retrieval.png"}

for name, png in NAMES.items():
    with open(os.path.join(SRC, f"{name}.json")) as f:
        results = json.load(f)
    evaluate.write_plot(os.path.join(OUT, png), {name: results[name]})

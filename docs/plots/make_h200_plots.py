"""Regenerate docs/plots/h200_*.png from docs/results/eval_h200/*.json with evaluate.write_plot.

Run from the repository root: PYTHONPATH=. python docs/plots/make_h200_plots.py
Each JSON is already a results dict ({"config", <name>}) as written by `santa-cupy eval <name> --json`;
write_plot draws one panel per evaluation present, so one PNG per evaluation.
"""
import json
import os

import evaluate

SRC = "docs/results/eval_h200"
OUT = "docs/plots"
NAMES = {"kernel": "h200_kernel_error.png", "model": "h200_model_kl.png",
         "retrieval": "h200_retrieval.png"}

for name, png in NAMES.items():
    with open(os.path.join(SRC, f"{name}.json")) as f:
        results = json.load(f)
    evaluate.write_plot(os.path.join(OUT, png), {name: results[name]})

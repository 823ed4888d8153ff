"""Driver for the "CPU, 4k context" runs of docs/ACCURACY.md (issue 5, CPU-measurable part).

Uses santa_tools.evaluation's own Session / metrics / Markdown, with a hand-picked settings list (the CLI's
grid is samplers x budgets x S; here e.g. the fixed budget is run at one S only), so that one
dense prefill serves every setting. Run from the repo root:

    PYTHONPATH=. python docs/results/cpu4k_run.py model     docs/results/accuracy_cpu4k_model
    PYTHONPATH=. python docs/results/cpu4k_run.py retrieval docs/results/accuracy_cpu4k_retrieval
    PYTHONPATH=. python docs/results/cpu4k_run.py model_small_s docs/results/accuracy_cpu4k_model_small_s
    PYTHONPATH=. python docs/results/cpu4k_run.py model_default_s docs/results/accuracy_cpu4k_model_default_s
"""
import json
import sys
import time

from santa_tools import evaluation as E

MODEL = dict(context=4096, steps=16, greedy_tokens=0, seeds="0,1",
             settings=[(sm, "global", s) for sm in ("iid", "stratified", "systematic")
                       for s in (64, 256, 1024)] + [("systematic", "fixed", 256), ("iid", "fixed", 256)])
# a second, longer teacher-forced window at small S only (the iid vs systematic question)
MODEL_SMALL_S = dict(context=4096, steps=32, greedy_tokens=0, seeds="0,1",
                     settings=[(sm, "global", s) for sm in ("iid", "systematic") for s in (16, 64)])
# the same 32-step window at the default S
MODEL_DEFAULT_S = dict(MODEL_SMALL_S, settings=[(sm, "global", 256) for sm in ("iid", "systematic")])
RETRIEVAL = dict(lengths="2048,4096", depths="0.25,0.75", needles=2, answer_tokens=16, seeds="0,1",
                 settings=[("systematic", "global", 256), ("systematic", "global", 1024),
                           ("iid", "global", 256)])


def main(which: str, stem: str) -> None:
    grid = {"model": MODEL, "model_small_s": MODEL_SMALL_S, "model_default_s": MODEL_DEFAULT_S, "retrieval": RETRIEVAL}[which]
    run(grid, "retrieval" if which == "retrieval" else "model", stem)


def run(grid: dict, which: str, stem: str) -> None:
    """Run one grid (evaluation `which`: "model" or "retrieval"); write stem.json and stem.md."""
    opts = {k: v for k, v in grid.items() if k != "settings"}
    cfg = E.config.resolve_config(False, device="cpu", **opts)
    t0 = time.time()
    session = E.runs.Session(cfg)
    session.settings = [E.settings.Setting("santa", sm, bu, s) for sm, bu, s in grid["settings"]]
    results = {"config": session.header()}
    results["config"].update(settings=[st.label for st in session.settings],
                             samplers=sorted({sm for sm, _, _ in grid["settings"]}),
                             budgets=sorted({bu for _, bu, _ in grid["settings"]}),
                             samples=sorted({s for _, _, s in grid["settings"]}))
    results[which] = (session.run_model if which == "model" else session.run_retrieval)()
    results[which]["seconds"] = round(time.time() - t0, 2)
    results["config"]["seconds"] = round(time.time() - t0, 2)
    with open(stem + ".json", "w") as f:
        json.dump(results, f, indent=1, default=E.report._json_default)
    md = E.report.report_markdown(results)
    with open(stem + ".md", "w") as f:
        f.write(md)
    print(md)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""Normaliser guesses for the one-pass budget on the default model, on the CPU (issue #16, measurement).

    PYTHONPATH=. python tools/one_pass_guess_study.py [--contexts 2048,6144] [--warm 8] [--steps 24] ...

The one-pass estimator (santa_cupy.one_pass) includes row j with pi_j = min(1, S exp(s_j - r)) for a
deterministic normaliser r; its cost (rows read) is about S exp(lse - r) and it is unbiased for any r.
This tool measures candidate guesses r on real attention inputs:

1. Capture: dense prefill of `context` tokens of santa_cupy.cli.evaluation's deterministic long text, then
   `warm + steps` teacher-forced dense decode steps (the model's float32 NumPy attention), recording
   q of every layer at every step through key_sampling_study.dense_run (which shadows
   `_eager_attention` on the model instance; model.py and santa_cupy.cli.evaluation are only imported). The KV cache
   at step t is the first context + t + 1 rows of the final cache.
2. Exact float64 attention (o, lse) of every (layer, head, step). The first `warm` steps only provide
   the lse history that the history-based guesses need.
3. For each guess, S in --samples and --seeds seeds: the one-pass estimate on the `steps` evaluated
   steps (all layers, heads) -> rows read per head (distinct rows = selected rows), the GQA group's
   union, expected rows sum_j pi_j, exp(lse - r) and the per-head relative L2 error of o.
4. The comparison: santa_cupy.reference.santa_attention, budget="global", sampler="systematic", over a
   grid of S; its mean rows and error are interpolated (log-log) to each guess's mean rows.

Guesses whose r varies by tile (the running lse within the pass) are simulated with the library's
`inclusion_probabilities` / `madow_select` and the same RNG stream (`one_pass_tiled` below); for a
constant r it reproduces `one_pass_attention` exactly (checked at start).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

from santa_cupy.cli import evaluation as ev  # noqa: E402  (long text, prefill helper; used, never edited)
import key_sampling_study as kss  # noqa: E402  (dense_run: the decode-time q capture)
from llama_min import models  # noqa: E402
from llama_min.model import LlamaModel  # noqa: E402
from llama_min.tokenizer import Tokenizer  # noqa: E402
from santa_cupy import one_pass, reference, rng  # noqa: E402

BN = 128  # tile rows (spec.DEFAULT_BLOCK_N)
QUANTILES = (10, 50, 90, 99)


# ------------------------------------------------------------------------------------ capture


def capture(context, n_steps, cache_dir=None):
    """Decode-time attention inputs: q [steps, layers, H, D] float32, k, v [layers, context + steps,
    KVH, D] float32 (row i written at position i; step t attends to rows < context + t + 1)."""
    path = os.path.join(cache_dir, f"capture_{context}.npz") if cache_dir else None
    if path and os.path.exists(path):                                       # a capture of >= n_steps steps
        z = np.load(path)
        if z["q"].shape[0] >= n_steps:
            return z["q"][:n_steps], z["k"][:, :context + n_steps], z["v"][:, :context + n_steps]
    mpath = models.resolve_model(None)
    model = LlamaModel.from_pretrained(mpath, device="cpu")
    tok = Tokenizer.from_dir(mpath)
    ids = ev.texts.long_text_ids(tok, context + n_steps + 1)
    cache0 = ev.decoding.prefilled_cache(model, ids[:context], context + n_steps + 1)
    _, qs, cache = kss.dense_run(model, cache0, ids, context, n_steps)
    n = context + n_steps
    q = np.stack([np.stack([qs[t][li][0] for li in sorted(qs[t])]) for t in range(n_steps)])
    k = np.stack([c[0, :n] for c in cache.k])
    v = np.stack([c[0, :n] for c in cache.v])
    if path:
        os.makedirs(cache_dir, exist_ok=True)
        np.savez(path, q=q, k=k, v=v)
    return q, k, v


class Case:
    """One (layer, step): scores s [H, n] float64, softmax p [H, n], V [KVH, n, D] float64, exact o
    [H, D], lse [H], and the tensors santa_attention takes (q [1, H, D], k, v [1, n, KVH, D])."""

    def __init__(self, q, k, v):
        H, D = q.shape
        n, KVH, _ = k.shape
        self.q, self.k, self.v = q[None], k[None], v[None]
        self.lens = np.array([n])
        self.s = reference.head_scores(self.q, self.k, self.lens)[0]
        m = self.s.max(-1)
        e = np.exp(self.s - m[:, None])
        self.lse = m + np.log(e.sum(-1))
        self.p = e / e.sum(-1, keepdims=True)
        self.V = v.astype(np.float64).transpose(1, 0, 2)                      # [KVH, n, D]
        self.o = (self.p.reshape(KVH, H // KVH, n) @ self.V).reshape(H, D)
        self.H, self.KVH, self.n = H, KVH, n


# ------------------------------------------------------------------------------------ guesses


def tile_lse(s):
    """lse of each tile [H, T] from scores s [H, n]."""
    H, n = s.shape
    T = -(-n // BN)
    pad = np.full((H, T * BN), -np.inf)
    pad[:, :n] = s
    t = pad.reshape(H, T, BN)
    m = t.max(-1)
    return m + np.log(np.exp(t - m[..., None]).sum(-1))


def subsample_lse(s, stride):
    """Pre-pass estimate of lse [H]: tile 0 exactly, then every stride-th row after it, scaled."""
    rest = np.arange(BN, s.shape[1], stride)
    z0 = np.exp(s[:, :BN] - s[:, :BN].max(-1, keepdims=True))
    m = s[:, :BN].max(-1)
    scale = (s.shape[1] - BN) / max(len(rest), 1)
    zr = np.exp(s[:, rest] - m[:, None]).sum(-1) * scale if len(rest) else 0.0
    return m + np.log(z0.sum(-1) + zr)


def guesses():
    """name -> fn(case, hist, T) -> r [H, T]; hist [warm, H] = exact lse of the previous steps (oldest
    first). Each r is a deterministic function of the scores or of earlier steps, never of the draws."""
    const = lambda r, T: np.repeat(np.asarray(r)[:, None], T, axis=1)  # noqa: E731

    def tile0_proj(c):
        return tile_lse(c.s[:, :BN])[:, 0] + np.log(c.n / BN)

    def running(c):
        return np.logaddexp.accumulate(tile_lse(c.s), axis=1)                # lse of tiles 0..t

    def running_proj(c):
        T = -(-c.n // BN)
        seen = np.minimum(np.arange(1, T + 1) * BN, c.n)
        return running(c) + np.log(c.n / seen)[None, :]

    g = {
        "exact lse (oracle)": lambda c, h, T: const(c.lse, T),
        "prev": lambda c, h, T: const(h[-1], T),
        "max last 4": lambda c, h, T: const(h[-4:].max(0), T),
        "max last 8": lambda c, h, T: const(h[-8:].max(0), T),
        "prev + 0.5": lambda c, h, T: const(h[-1] + 0.5, T),
        "prev + 1": lambda c, h, T: const(h[-1] + 1.0, T),
        "prev + 2": lambda c, h, T: const(h[-1] + 2.0, T),
        "tile0 lse": lambda c, h, T: const(tile_lse(c.s[:, :BN])[:, 0], T),
        "tile0 lse + log(n/BN)": lambda c, h, T: const(tile0_proj(c), T),
        "running lse (tiles <= t)": lambda c, h, T: running(c),
        "running lse + log(n/seen)": lambda c, h, T: running_proj(c),
        "pre-pass 1/16": lambda c, h, T: const(subsample_lse(c.s, 16), T),
        "pre-pass 1/32": lambda c, h, T: const(subsample_lse(c.s, 32), T),
        "pre-pass 1/64": lambda c, h, T: const(subsample_lse(c.s, 64), T),
        "max(prev, tile0 + log(n/BN))": lambda c, h, T: const(np.maximum(h[-1], tile0_proj(c)), T),
        "max(prev, running)": lambda c, h, T: np.maximum(h[-1][:, None], running(c)),
        "max(prev, running + log(n/seen))": lambda c, h, T: np.maximum(h[-1][:, None], running_proj(c)),
        "max(prev, pre-pass 1/16)": lambda c, h, T: const(np.maximum(h[-1], subsample_lse(c.s, 16)), T),
        "max(max4, pre-pass 1/16)": lambda c, h, T: const(np.maximum(h[-4:].max(0), subsample_lse(c.s, 16)), T),
    }
    return g


# ---------------------------------------------------------------------------------- estimator


def tile_uniforms(seed, step, layer, H, T):
    """The one-pass RNG stream: u [H, T] float32 (head key of b = 0, draw ONE_PASS_DRAW per tile)."""
    keys = rng.head_key(seed, step, layer, 0, np.arange(H))
    return rng.uniform(keys[:, None], np.arange(T)[None, :], one_pass.ONE_PASS_DRAW)


def one_pass_tiled(c, r_tile, samples, u):
    """One-pass HT estimate with a per-tile normaliser: r_tile [H, T], u [R, H, T] (R seeds) ->
    o [R, H, D], selected [R, H, n] bool, pi [H, n]. Row j of tile t has pi_j = min(1, S exp(s_j - r_t));
    its HT weight is p_j / pi_j (p = exact softmax: Z is exact from the same pass)."""
    R, H, T = u.shape
    r_rows = np.repeat(r_tile, BN, axis=1)[:, :c.n]                         # [H, n]
    pi = np.minimum(1.0, samples * np.exp(c.s - r_rows))
    sel = one_pass.madow_select(np.broadcast_to(pi, (R, H, c.n)).reshape(R * H, c.n),
                                u.reshape(R * H, T), BN).reshape(R, H, c.n)
    w = np.where(sel, c.p / pi, 0.0)
    G = H // c.KVH
    o = (w.reshape(R, c.KVH, G, c.n) @ c.V[None]).reshape(R, H, -1)
    return o, sel, pi


def rel_err(o_hat, o):
    """Per-head relative L2 error [..., H] of o_hat [..., H, D] against o [H, D]."""
    return np.linalg.norm(o_hat - o, axis=-1) / np.linalg.norm(o, axis=-1)


def check_against_library(c, r, samples, seed, step, layer):
    """one_pass_tiled with a constant r must give one_pass_attention's rows and output."""
    T = -(-c.n // BN)
    o, sel, _ = one_pass_tiled(c, np.repeat(r[:, None], T, 1), samples, tile_uniforms(seed, step, layer, c.H, T)[None])
    o_lib, info = one_pass.one_pass_attention(c.q, c.k, c.v, c.lens, samples=samples, lse_hint=r[None], seed=seed,
                                              step=step, layer=layer, block_n=BN)
    assert np.array_equal(sel[0], info.selected[0]), "selection differs from one_pass_attention"
    assert np.allclose(o[0], o_lib[0], rtol=1e-9, atol=1e-12), "output differs from one_pass_attention"


# ---------------------------------------------------------------------------------- the study


def quantiles(x):
    x = np.asarray(x, np.float64).ravel()
    return {f"p{q}": float(np.percentile(x, q)) for q in QUANTILES} | {"max": float(x.max()), "mean": float(x.mean())}


def study_context(context, args, names):
    """All guesses and the global grid at one context -> dict of results."""
    t0 = time.time()
    q, k, v = capture(context, args.warm + args.steps, args.cache_dir)
    n_steps, L, H, _ = q.shape
    print(f"[{context}] capture {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    hist = np.zeros((n_steps, L, H))
    for t in range(args.warm):                                              # lse history of warm steps
        for li in range(L):
            hist[t, li] = Case(q[t, li], k[li, :context + t + 1], v[li, :context + t + 1]).lse
    gfns = guesses()
    seeds = list(range(args.seeds))
    acc = {(g, S): {"rows": [], "union": [], "expected": [], "factor": [], "err": [], "err_layer": []}
           for g in names for S in args.samples}
    glob = {S: {"rows": [], "union": [], "err": []} for S in args.global_grid}
    dlse = []
    checked = False
    for t in range(args.warm, n_steps):
        for li in range(L):
            n = context + t + 1
            c = Case(q[t, li], k[li, :n], v[li, :n])
            hist[t, li] = c.lse
            dlse.append(c.lse - hist[t - 1, li])
            if not checked:
                check_against_library(c, hist[t - 1, li], args.samples[0], 0, t, li)
                checked = True
            T = -(-n // BN)
            u = np.stack([tile_uniforms(sd, t, li, H, T) for sd in seeds])   # [R, H, T]
            for g in names:
                r_tile = gfns[g](c, hist[t - args.warm:t, li], T)
                factor = (np.exp(c.s - np.repeat(r_tile, BN, axis=1)[:, :n])).sum(-1)   # exp(lse - r) if r constant
                for S in args.samples:
                    o, sel, pi = one_pass_tiled(c, r_tile, S, u)
                    a = acc[(g, S)]
                    a["rows"].append(sel.sum(-1))                                        # [R, H]
                    a["union"].append(sel.reshape(len(seeds), c.KVH, -1, n).any(2).sum(-1))  # [R, KVH]
                    a["expected"].append(pi.sum(-1))
                    a["factor"].append(factor)
                    a["err"].append(rel_err(o, c.o))
                    a["err_layer"].append(np.linalg.norm(o - c.o, axis=(1, 2)) / np.linalg.norm(c.o))
            for S in args.global_grid:
                for sd in seeds[:args.global_seeds]:
                    o, _, rows_read, _, counts = reference.santa_attention(
                        c.q, c.k, c.v, c.lens, samples=S, budget="global", sampler="systematic", seed=sd, step=t,
                        layer=li, block_n=BN)
                    glob[S]["rows"].append((counts[0] > 0).sum(-1))
                    glob[S]["union"].append(rows_read[0])
                    glob[S]["err"].append(rel_err(o[0], c.o))
        print(f"[{context}] step {t} {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    g_rows = np.array([np.mean(glob[S]["rows"]) for S in args.global_grid])
    g_err = np.array([np.mean(glob[S]["err"]) for S in args.global_grid])
    out = {"context": context, "wall_s": None, "dlse_abs": quantiles(np.abs(np.concatenate(dlse))),
           "global": [{"S": S, "rows_mean": float(g_rows[i]), "union_mean": float(np.mean(glob[S]["union"])),
                       "rows": quantiles(glob[S]["rows"]), "err_mean": float(g_err[i]),
                       "err_p90": float(np.percentile(np.concatenate(glob[S]["err"]), 90))}
                      for i, S in enumerate(args.global_grid)], "guesses": []}
    order = np.argsort(g_rows)
    lr, le, ls = np.log(g_rows[order]), np.log(g_err[order]), np.log(np.array(args.global_grid, float)[order])
    for g in names:
        for S in args.samples:
            a = acc[(g, S)]
            rows_mean = float(np.mean(a["rows"]))
            inside = lr[0] <= np.log(rows_mean) <= lr[-1]
            g_at = float(np.exp(np.interp(np.log(rows_mean), lr, le))) if inside else None
            S_at = float(np.exp(np.interp(np.log(rows_mean), lr, ls))) if inside else None
            err = float(np.mean(a["err"]))
            out["guesses"].append({
                "guess": g, "S": S, "rows_mean": rows_mean, "rows": quantiles(a["rows"]),
                "rows_frac_max": float(max(np.max(x) for x in a["rows"]) / context),
                "union": quantiles(a["union"]), "expected": quantiles(a["expected"]),
                "factor": quantiles(a["factor"]), "err_mean": err,
                "err_p90": float(np.percentile(np.concatenate(a["err"]), 90)),
                "err_layer_mean": float(np.mean(a["err_layer"])),
                "global_S_equal_rows": S_at, "global_err_equal_rows": g_at,
                "ratio_to_global": err / g_at if g_at else None})
    out["wall_s"] = time.time() - t0
    return out


# ------------------------------------------------------------------------------------- report


def f3(x):
    return "-" if x is None else (f"{x:.3f}" if abs(x) >= 1e-3 else f"{x:.1e}")


def opt(x, spec):
    return "-" if x is None else format(x, spec)


def markdown(res):
    h = res["header"]
    lines = [
        "# Normaliser guesses for the one-pass budget, default model, CPU",
        "",
        f"Generated by `tools/one_pass_guess_study.py` at commit `{h['commit']}` ({h['date']}, {h['threads']} "
        f"threads, {h['wall_s']:.0f} s).{' PARTIAL: ' + h['partial'] if h.get('partial') else ''}",
        "",
        "## Method",
        "",
        f"- Model {h['model']} (30 layers, 9 heads, 3 KV heads, head_dim 64), float32 weights and KV cache, "
        f"NumPy on the CPU. Dense prefill of santa_cupy.cli.evaluation's deterministic long text (contexts "
        f"{', '.join(str(c['context']) for c in res['contexts'])}), then {h['warm']} + {h['steps']} "
        "teacher-forced dense decode steps; q of every layer captured at every step "
        "(`key_sampling_study.dense_run`), KV cache at that step. The first "
        f"{h['warm']} steps only supply the lse history; the {h['steps']} later ones are evaluated "
        "(all 30 layers x 9 heads).",
        f"- One-pass estimator: `santa_cupy.one_pass` (tiles of {BN}, Madow systematic per tile, its RNG stream), "
        "simulated with per-tile r where the guess varies by tile; checked to reproduce `one_pass_attention` "
        f"exactly for a constant r. {h['seeds']} seeds per (layer, step).",
        "- rows = rows selected per head (each row at most once: the distinct V rows of that head); union = "
        "distinct rows of a GQA group (3 heads); expected = sum_j pi_j. factor = sum_j exp(s_j - r_j) = "
        "exp(lse - r) for a constant r (the multiplier on S). err = per-head relative L2 error "
        "||o_hat - o|| / ||o|| against exact float64 attention, mean over layers, heads, steps, seeds.",
        f"- Global comb: `santa_cupy.reference.santa_attention(budget=\"global\", sampler=\"systematic\")` at S in "
        f"{h['global_grid']} ({h['global_seeds']} seeds); its mean rows per head (distinct) and mean error are "
        "interpolated log-log to each guess's mean rows (\"global err @ rows\", at the S shown). ratio = "
        "one-pass err / global err at equal mean rows.",
        "- Guesses: prev = exact lse of the same layer/head at the previous step; max last k = max over the last "
        "k steps; tile0 = lse of rows 0..127 (the sink tile, a lower bound on lse); + log(n/BN) projects it "
        "to n rows; running = lse of the tiles 0..t processed so far (tile t's scores are known before its "
        "rows are sampled), + log(n/seen) projects it; pre-pass 1/k = tile 0 exactly plus every k-th later "
        "row scaled by k (reads n/k extra K rows); exact lse (oracle) = what a two-pass kernel would use.",
        "",
    ]
    for c in res["contexts"]:
        lines += [f"## Context {c['context']}", "",
                  f"|lse_t - lse_(t-1)|: p50 {c['dlse_abs']['p50']:.2f}, p90 {c['dlse_abs']['p90']:.2f}, "
                  f"p99 {c['dlse_abs']['p99']:.2f}, max {c['dlse_abs']['max']:.2f} nats.", "",
                  "| guess | S | rows mean | rows p50 / p90 / p99 / max | union mean | factor p10 / p50 / p90 "
                  "| err | err p90 | global S @ rows | global err @ rows | ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for g in c["guesses"]:
            r, fa = g["rows"], g["factor"]
            lines.append(
                f"| {g['guess']} | {g['S']} | {g['rows_mean']:.1f} | {r['p50']:.0f} / {r['p90']:.0f} / "
                f"{r['p99']:.0f} / {r['max']:.0f} | {g['union']['mean']:.1f} | {fa['p10']:.2f} / {fa['p50']:.2f} / "
                f"{fa['p90']:.2f} | {f3(g['err_mean'])} | {f3(g['err_p90'])} | "
                f"{opt(g['global_S_equal_rows'], '.0f')} | {f3(g['global_err_equal_rows'])} | "
                f"{opt(g['ratio_to_global'], '.2f')} |")
        lines += ["", "Global comb grid:", "", "| S | rows mean | rows p99 / max | union mean | err | err p90 |",
                  "|---|---|---|---|---|---|"]
        for g in c["global"]:
            lines.append(f"| {g['S']} | {g['rows_mean']:.1f} | {g['rows']['p99']:.0f} / {g['rows']['max']:.0f} | "
                         f"{g['union_mean']:.1f} | {f3(g['err_mean'])} | {f3(g['err_p90'])} |")
        lines.append("")
    return "\n".join(lines)


def write_markdown(res, path):
    """Write the report; a hand-written "## Verdict" section already in the file is kept."""
    kss.write_report(path, markdown(res), "## Verdict")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="2048,6144")
    ap.add_argument("--warm", type=int, default=8, help="decode steps that only supply the lse history")
    ap.add_argument("--steps", type=int, default=16, help="evaluated decode steps")
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--samples", default="64,256")
    ap.add_argument("--global-grid", default="16,24,32,48,64,96,128,192,256,384,512,768,1024,1536,2048")
    ap.add_argument("--global-seeds", type=int, default=4)
    ap.add_argument("--only", default="", help="guesses to run, separated by ';' (default all)")
    ap.add_argument("--cache-dir", default=None, help="keep captured inputs here (npz) for reruns")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs/results/one_pass_guesses_cpu.json"))
    ap.add_argument("--md", default=os.path.join(ROOT, "docs/results/one_pass_guesses_cpu.md"))
    ap.add_argument("--report-only", action="store_true")
    ap.add_argument("--merge", default="", help="JSON files of runs (one context each, same settings) to "
                    "combine into --json / --md")
    args = ap.parse_args(argv)
    if args.merge:
        runs = [json.load(open(p)) for p in args.merge.split(",")]
        res = runs[0]
        res["contexts"] = [c for r in runs for c in r["contexts"]]
        res["header"]["wall_s"] = sum(r["header"]["wall_s"] for r in runs)
        res["header"]["commits"] = sorted({r["header"]["commit"] for r in runs})
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
        write_markdown(res, args.md)
        return
    if args.report_only:
        write_markdown(json.load(open(args.json)), args.md)
        return
    t0 = time.time()
    commit = kss.git_commit()
    args.samples = [int(x) for x in args.samples.split(",")]
    args.global_grid = [int(x) for x in args.global_grid.split(",")]
    names = [x.strip() for x in args.only.split(";") if x.strip()] or list(guesses())
    unknown = set(names) - set(guesses())
    if unknown:
        raise SystemExit(f"unknown guesses {sorted(unknown)}")
    res = {"header": {"commit": commit, "date": time.strftime("%Y-%m-%d"),
                      "machine": platform.processor() or platform.machine(),
                      "threads": os.environ.get("OMP_NUM_THREADS", "default"), "model": models.DEFAULT_MODEL,
                      "warm": args.warm, "steps": args.steps, "seeds": args.seeds, "samples": args.samples,
                      "global_grid": args.global_grid, "global_seeds": args.global_seeds, "wall_s": 0.0},
           "contexts": []}
    for ctx in [int(x) for x in args.contexts.split(",")]:
        res["contexts"].append(study_context(ctx, args, names))
        res["header"]["wall_s"] = time.time() - t0
        with open(args.json, "w") as f:                                      # after each context: partial results
            json.dump(res, f, indent=1)
        write_markdown(res, args.md)
    print(f"wrote {args.json} and {args.md} ({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

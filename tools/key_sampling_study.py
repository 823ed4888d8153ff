"""Accuracy of score-stage (key) sampling on the default model, on the CPU (issue #17, part 1).

    PYTHONPATH=. python tools/key_sampling_study.py [--context 3072] [--steps 32] ...

1. Dense prefill of `context` tokens of santa_cupy.cli.evaluation's deterministic long text, then `steps`
   teacher-forced dense decode steps (the model's own float32 NumPy attention): the reference
   next-token logits, and the decode-time q of every layer and step (recorded by shadowing
   `_eager_attention` on the model instance, as santa_cupy.cli.evaluation.decoding.AttentionRecorder does; model.py and
   santa_cupy.cli.evaluation are only imported).
2. Attention level, on the captured inputs (all layers, `kernel_steps` of the steps, `seeds`
   seeds): fraction of K bytes read, relative L2 error of the attention output (dense value stage on
   the estimated scores) against exact float64 attention, and the bias of softmax(noisy scores):
   output bias (||E o_hat - o|| with the seed noise removed), E[lse(s_hat)] - lse(s) (>= 0 by
   Jensen) and E[mass of the exact top-32 positions] - exact mass.
3. Model level: the same teacher-forced steps with key sampling in every layer
   (santa_cupy.key_sampling.key_sampled_attention, value stage dense or SANTA), KL(dense || key
   sampled) of the next-token distributions and top-1 agreement, `kl_seeds` seeds.

Writes a JSON file and a Markdown report: generated tables, then a hand-written "## Conclusion"
section that a rerun keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from santa_cupy.cli import evaluation as ev  # noqa: E402  (long text, prefill / clone helpers, KL; used, never edited)
from llama_min import models  # noqa: E402
from llama_min.model import DENSE, LlamaModel  # noqa: E402
from llama_min.tokenizer import Tokenizer  # noqa: E402
from santa_cupy import key_sampling as ks  # noqa: E402

TOP = 32  # positions of the exact top mass for the mass bias
LAYERS_SHOWN = [0, 1, 2, 5, 10, 15, 20, 25, 29]
BY_LAYER_ROWS = ["bernoulli R=8", "bernoulli R=32 union", "block FB=16 qkvar f=0.75", "block P FB=16 qkvar f=0.75",
                 "block P FB=16 qkvar f=0.875", "block P FB=16 qkvar v=0.15"]


@dataclass(frozen=True)
class Setting:
    label: str
    key: dict = field(default_factory=dict)  # key_scores options
    value: str = "dense"  # value stage: dense | santa
    samples: int = 256
    perm: bool = False  # K features in the calibrated per-(layer, KV head) order (see feature_orders)


def bern(R, crn=True, combine="mean"):
    label = f"bernoulli R={R}{'' if crn else ' indep'}{' union' if combine == 'union' else ''}"
    return Setting(label, dict(key_sampling="bernoulli", key_draws=R, key_crn=crn, key_combine=combine))


def block(FB, rule, f, perm=False, R=1, combine="mean", variance=None):
    """f: expected fraction read; or variance (nats^2 per head, then f is ignored and not shown)."""
    target = f"f={f:g}" if variance is None else f"v={variance:g}"
    label = f"block{' P' if perm else ''} FB={FB} {rule} {target}{f' R={R} {combine}' if R > 1 else ''}"
    return Setting(label, dict(key_sampling="bernoulli_block", key_block=FB, key_rule=rule, key_budget=f,
                               key_variance=variance, key_draws=R, key_combine=combine), perm=perm)


def with_santa(st):
    return Setting(st.label + " + SANTA S=256", st.key, value="santa", perm=st.perm)


def settings_grid(quick=False):
    """The rows of the study ("P": permuted feature order)."""
    none = Setting("none", dict(key_sampling="none"))
    if quick:
        return [none, bern(4), block(16, "qkvar", 0.75), block(16, "qkvar", 0.75, perm=True)]
    grid = [none] + [bern(R) for R in (1, 2, 4, 8)]
    grid += [bern(8, crn=False), bern(8, combine="union"), bern(32, combine="union")]
    grid += [block(16, rule, 0.75) for rule in ("uniform", "qmax", "qrms", "qkvar")]
    grid += [block(16, "qkvar", f) for f in (0.875, 0.9375)] + [block(32, "qkvar", 0.875)]
    grid += [block(16, "qkvar", f, perm=True) for f in (0.5, 0.625, 0.75, 0.875, 0.9375)]
    grid += [block(16, rule, f, perm=True) for rule, f in (("qrms", 0.75), ("qrms", 0.875), ("qmax", 0.875))]
    grid += [block(32, "qkvar", f, perm=True) for f in (0.75, 0.875)]
    grid += [block(16, "qkvar", 0.75, perm=True, R=2), block(16, "qkvar", 0.75, perm=True, R=2, combine="union")]
    grid += [with_santa(none), with_santa(block(16, "qkvar", 0.75, perm=True)),
             with_santa(block(16, "qkvar", 0.875, perm=True))]
    # second round (run with --only ... --append): a finer budget, and per-group variance targets
    grid += [block(16, "qkvar", 0.8125, perm=True), block(16, "qkvar", 1.0, variance=0.1)]
    grid += [block(16, "qkvar", 1.0, perm=True, variance=v) for v in (0.3, 0.2, 0.15, 0.08, 0.04)]
    grid += [with_santa(block(16, "qkvar", 1.0, perm=True, variance=v)) for v in (0.2, 0.15, 0.08)]
    return grid


# ------------------------------------------------------------------------------ model plumbing


class Patched:
    """Shadow model._eager_attention on the instance with fn(att, cache) -> attn(li, q, kc, vc, lens)."""

    def __init__(self, model, make):
        self.model, self.make = model, make

    def __enter__(self):
        self.model._eager_attention = self.make
        return self

    def __exit__(self, *exc):
        del self.model._eager_attention
        return False


def dense_run(model, cache0, ids, start, steps):
    """Teacher-forced dense steps feeding ids[start:start+steps]: logits [steps, V], q[t][layer]
    [1, H, D] float32, and the cache after them (a copy; cache0 is untouched)."""
    original = model._eager_attention
    qs = []

    def make(att, cache):
        attn = original(att, cache)
        qs.append({})

        def recording(li, q, kc, vc, lens):
            qs[-1][li] = q.copy()
            return attn(li, q, kc, vc, lens)
        return recording

    cache = ev.decoding.clone_cache(model, cache0)
    with Patched(model, make):
        logits = [model.decode(np.asarray([t]), cache, DENSE)[0] for t in ids[start:start + steps]]
    return np.stack(logits).astype(np.float64), qs, cache


class RunningMoments:
    """Per layer: sum_j K_j and sum_j K_j^2 over the cache rows [B, KVH, D] float64, updated with the
    rows appended since the last call (what a kernel would keep next to the cache); -> variance."""

    def __init__(self):
        self.sums = {}  # layer -> (rows counted, S1, S2)

    def variance(self, li, k):
        n = k.shape[1]
        done, s1, s2 = self.sums.get(li, (0, 0.0, 0.0))
        new = k[:, done:n].astype(np.float64)
        s1, s2 = s1 + new.sum(axis=1), s2 + (new * new).sum(axis=1)
        self.sums[li] = (n, s1, s2)
        return np.maximum(s2 / n - (s1 / n) ** 2, 0.0)


def permute(q, k, order):
    """q [B, H, D], k [B, n, KVH, D] with features in order [KVH, D] (head h takes its group's order)."""
    G = q.shape[1] // order.shape[0]
    qp = np.take_along_axis(q, np.repeat(order, G, axis=0)[None], axis=2)
    kp = np.take_along_axis(k, order[None, None], axis=3)
    return qp, np.ascontiguousarray(kp)


def sampled_run(model, cache0, ids, start, steps, st: Setting, seed, orders):
    """Teacher-forced steps ids[start:start+steps] with key sampling in every layer: logits
    [steps, V] and the mean K fraction. The K variance for "qkvar" comes from running sums."""
    fractions = []
    moments = RunningMoments()

    def make(att, cache):
        step = cache.step

        def attn(li, q, kc, vc, lens):
            n = int(lens.max())
            k = kc[:, :n]
            if st.perm:
                q, k = permute(q, k, orders[li])
            o, _, info, _ = ks.key_sampled_attention(q, k, vc[:, :n], lens, value=st.value, samples=st.samples,
                                                     seed=seed, step=step, layer=li,
                                                     k_var=moments.variance(li, k), **st.key)
            fractions.append(info.key_fraction)
            return o.astype(np.float32)
        return attn

    cache = ev.decoding.clone_cache(model, cache0)
    with Patched(model, make):
        logits = [model.decode(np.asarray([t]), cache, DENSE)[0] for t in ids[start:start + steps]]
    return np.stack(logits).astype(np.float64), float(np.mean(fractions))


def feature_orders(calib_qs, cache, n, G):
    """Static feature order per layer [KVH, D]: descending E_t[sum_{h in group} q_{h,i}^2] * var_j K_{j,i}
    over the calibration steps' q and the cache's first n rows. A layout choice: K is stored (and q
    rotated into) this order at append time, so dense q.K is unchanged and the dropped blocks are the
    features whose spread over positions carries the least score variance."""
    orders = {}
    for li in calib_qs[0]:
        q2 = np.mean([qs[li][0].astype(np.float64) ** 2 for qs in calib_qs], axis=0)  # [H, D]
        q2g = q2.reshape(-1, G, q2.shape[-1]).sum(axis=1)  # [KVH, D]
        var = ks.key_feature_variance(cache.k[li][:, :n], np.array([n]))[0]
        orders[li] = np.argsort(-(q2g * var), axis=-1, kind="stable")
    return orders


# ------------------------------------------------------------------------- attention metrics


def softmax_rows(s):
    e = np.exp(s - s.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def attention_metrics(captured, st: Setting, seeds):
    """Per (layer, step) over seeds: errors, bias, fractions; averaged over layers and steps."""
    rows = {k: [] for k in ("err", "bias", "mse", "lse_bias", "mass_bias", "frac", "feat")}
    per_layer_err = {}
    for (li, t), case in captured.items():
        q, k, v, lens, exact = case["q"], case["k"], case["v"], case["lens"], case["exact"]
        k_var = case["k_var"]
        if st.perm:
            q, k, k_var = case["q_perm"], case["k_perm"], case["k_var_perm"]
        H, G = q.shape[1], q.shape[1] // k.shape[2]
        vh = v[0].astype(np.float64).transpose(1, 0, 2)  # [KVH, n, D]
        outs, lses, masses = [], [], []
        for seed in seeds:
            s, info = ks.key_scores(q, k, lens, seed=seed, step=t, layer=li, out_dtype=np.float64,
                                    k_var=k_var, **st.key)
            s = s[0]  # [H, n]
            p = softmax_rows(s)
            if st.value == "dense":
                o = np.stack([p[h] @ vh[h // G] for h in range(H)])
            else:
                o = ks.key_sampled_attention(q, k, v, lens, value="santa", samples=st.samples, seed=seed,
                                             step=t, layer=li, k_var=k_var, **st.key)[0][0]
            m = s.max(axis=-1)
            lses.append(m + np.log(np.exp(s - m[:, None]).sum(axis=-1)))
            masses.append(np.take_along_axis(p, case["top"], axis=-1).sum(axis=-1))
            outs.append(o)
            rows["frac"].append(info.key_fraction)
            rows["feat"].append(float(info.feature_fraction.mean()))
        outs = np.stack(outs)  # [S, H, D]
        norm2 = (exact["o"] ** 2).sum()
        errs = np.sqrt(((outs - exact["o"]) ** 2).sum(axis=(1, 2)) / norm2)
        rows["err"].extend(errs)
        per_layer_err.setdefault(li, []).extend(errs)
        mse = ((outs - exact["o"]) ** 2).sum(axis=(1, 2)).mean()
        S = len(seeds)
        spread = ((outs - outs.mean(axis=0)) ** 2).sum(axis=(1, 2)).sum() / max(S - 1, 1)
        bias2 = ((outs.mean(axis=0) - exact["o"]) ** 2).sum() - (spread / S if S > 1 else 0.0)
        rows["bias"].append(np.sqrt(max(bias2, 0.0) / norm2))
        rows["mse"].append((max(bias2, 0.0), mse))
        rows["lse_bias"].append(float((np.mean(lses, axis=0) - exact["lse"]).mean()))
        rows["mass_bias"].append(float((np.mean(masses, axis=0) - exact["mass"]).mean()))
    b2 = sum(x for x, _ in rows["mse"])
    m2 = sum(y for _, y in rows["mse"])
    return {
        "key_fraction": float(np.mean(rows["frac"])),
        "feature_fraction": float(np.mean(rows["feat"])),
        "rel_l2": float(np.mean(rows["err"])),
        "rel_l2_p90": float(np.percentile(rows["err"], 90)),
        "rel_bias": float(np.mean(rows["bias"])),
        "bias_share": float(b2 / m2) if m2 > 0 else 0.0,
        "lse_bias": float(np.mean(rows["lse_bias"])),
        "top_mass_bias": float(np.mean(rows["mass_bias"])),
        "rel_l2_by_layer": {int(li): float(np.mean(e)) for li, e in sorted(per_layer_err.items())},
    }


def capture(qs, cache, start, kernel_steps, orders):
    """{(layer, step): q, k, v, lens, k_var (and permuted copies), exact o / lse / top-32 mass}."""
    out = {}
    for t in kernel_steps:
        n = start + t + 1
        for li, q in qs[t].items():
            k = np.ascontiguousarray(cache.k[li][:, :n])
            v = np.ascontiguousarray(cache.v[li][:, :n])
            lens = np.array([n])
            s, _ = ks.key_scores(q, k, lens, key_sampling="none", out_dtype=np.float64)
            p = softmax_rows(s[0])
            G = q.shape[1] // k.shape[2]
            o = np.stack([p[h] @ v[0, :, h // G].astype(np.float64) for h in range(q.shape[1])])
            m = s[0].max(axis=-1)
            top = np.argsort(-p, axis=-1)[:, :TOP]
            qp, kp = permute(q, k, orders[li])
            out[(li, t)] = dict(q=q, k=k, v=v, lens=lens, k_var=ks.key_feature_variance(k, lens), top=top,
                                q_perm=qp, k_perm=kp, k_var_perm=ks.key_feature_variance(kp, lens), exact=dict(
                o=o, lse=m + np.log(np.exp(s[0] - m[:, None]).sum(axis=-1)),
                mass=np.take_along_axis(p, top, axis=-1).sum(axis=-1)))
    return out


def block_pi_profile(captured, FB, rule, budget, perm=False):
    """Mean inclusion probability per block index over layers, steps and groups."""
    sfx = "_perm" if perm else ""
    pis = [ks.key_scores(c["q" + sfx], c["k" + sfx], c["lens"], key_sampling="bernoulli_block", key_block=FB,
                         key_rule=rule, key_budget=budget, k_var=c["k_var" + sfx])[1].prob.reshape(-1, 64 // FB)
           for c in captured.values()]
    return [round(float(x), 3) for x in np.concatenate(pis).mean(axis=0)]


def feature_profile(captured):
    """Distribution of p_i = |q_i| / max|q| over heads, layers and steps."""
    p = np.concatenate([np.abs(c["q"][0]) / np.abs(c["q"][0]).max(axis=-1, keepdims=True) for c in captured.values()])
    return {"mean_p": float(p.mean()), "frac_p_gt_0.5": float((p > 0.5).mean()),
            "frac_p_lt_0.1": float((p < 0.1).mean())}


# ------------------------------------------------------------------------------ report


def fmt(x, digits=3):
    return f"{x:.{digits}f}" if abs(x) >= 10 ** -digits or x == 0 else f"{x:.1e}"


def markdown(res):
    h = res["header"]
    lines = [
        "# Score-stage (key) sampling on the default model, CPU",
        "",
        f"Generated by `tools/key_sampling_study.py` at commit `{h['commit']}` ({h['date']}, {h['machine']}, "
        f"{h['threads']} threads, {h['wall_s']:.0f} s).",
        "",
    ] + [f"Rows {', '.join(a['rows'])} were added by `--append` at commit `{a['commit']}` ({a['wall_s']:.0f} s); "
         "same inputs, seeds and dense reference (a later append replaces the rows it names again)."
         for a in h.get("appended", [])] + [
        "",
        "## Method",
        "",
        f"- Model {h['model']} (30 layers, 9 heads, 3 KV heads, head_dim 64), float32 weights and KV "
        f"cache, NumPy on the CPU. Text: santa_cupy.cli.evaluation's deterministic long text; dense prefill of "
        f"{h['context']} tokens, {h['calib']} dense decode steps that calibrate the feature order (below), then "
        f"{h['steps']} teacher-forced decode steps (true tokens fed) that are evaluated.",
        "- Reference: the model's own dense float32 decode. Key-sampled runs replace the attention of every "
        "layer at every decode step with `santa_cupy.key_sampling.key_sampled_attention` (float64 reference).",
        f"- Attention level: q of every layer at decode steps {h['kernel_steps']} with the cache at that step, "
        f"{h['seeds']} seeds each, dense value stage on the estimated scores unless the row says SANTA. "
        "rel L2 = ||o_hat - o|| / ||o|| per layer (all heads), mean over layers, steps and seeds. "
        "Output bias = ||E o_hat - o|| / ||o|| with the seed noise subtracted (bias^2 = ||mean - o||^2 - "
        "var/S), mean over layers and steps; bias share = sum bias^2 / sum MSE. lse bias = E[lse(s_hat)] - "
        "lse(s) in nats (softmax of unbiased scores is biased: by Jensen this is >= 0). Top-32 mass bias = "
        "E[softmax(s_hat) mass on the 32 exact top positions] - exact mass, per head.",
        f"- Model level: KL(dense || key sampled) of next-token distributions, mean over {h['steps']} steps x "
        f"{h['kl_seeds']} seeds (p90 over steps and seeds); top-1 = argmax agreement with dense.",
        "- K read = fraction of the K bytes of the valid rows that a kernel must read: per-feature Bernoulli "
        "counts 32-byte sectors (16 features of 2-byte storage) touched by any head of the group in any "
        "draw; the block estimator counts blocks selected / blocks. Features = fraction of features used by "
        "the group (the paper's \"K accessed\").",
        "- Block rules (pi = min(1, lam*w), lam so that the expected fraction read = f): uniform w = 1; qmax "
        "w = max_h ||q_h[c]||; qrms w = sqrt(sum_h ||q_h[c]||^2); qkvar w = sqrt(sum_h sum_{i in c} "
        "q_hi^2 var_j K_ji; in the model runs var_j K comes from running sums of K and K^2 updated at "
        "every append, as a kernel would keep them). R > 1: R independent draws, combined by their mean or by "
        "HT on their union. \"v=x\" rows replace the budget by a variance target (`key_variance` = x nats^2 "
        "per head under the diagonal model): each group reads what its own spread needs, so K read is an "
        "outcome, not a setting.",
        "- \"P\" (permuted layout): per layer and KV head, K's features are stored in a static order, "
        "descending E_t[sum_{h in group} q_hi^2] * var_j K_ji from the calibration steps' q and the cache at "
        "the end of calibration, and q is permuted the same way (q . K unchanged; a layout choice at append "
        "time). Contiguous blocks then group features of similar score variance, so the blocks that get "
        "dropped carry little of it. The order is fixed before the evaluated steps.",
        "",
        "## Results",
        "",
        "| setting | K read | features | rel L2 | rel L2 p90 | output bias | bias share | lse bias (nats) "
        "| top-32 mass bias | KL mean (nats) | KL p90 | top-1 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        a, m = r["attention"], r.get("model")
        kl = [fmt(m["kl_mean"], 4), fmt(m["kl_p90"], 4), f"{m['top1']:.3f}"] if m else ["-", "-", "-"]
        lines.append("| " + " | ".join([r["label"], f"{a['key_fraction']:.3f}", f"{a['feature_fraction']:.3f}",
                                        fmt(a["rel_l2"]), fmt(a["rel_l2_p90"]), fmt(a["rel_bias"]),
                                        f"{a['bias_share']:.2f}", fmt(a["lse_bias"], 4),
                                        fmt(a["top_mass_bias"], 4)] + kl) + " |")
    lines += ["", "Relative L2 error by layer (dense value stage):", "",
              "| setting | " + " | ".join(f"L{li}" for li in LAYERS_SHOWN) + " |",
              "|---|" + "---|" * len(LAYERS_SHOWN)]
    for r in res["rows"]:
        if r["label"] in BY_LAYER_ROWS:
            by = {int(li): e for li, e in r["attention"]["rel_l2_by_layer"].items()}
            lines.append(f"| {r['label']} | " + " | ".join(fmt(by[li]) for li in LAYERS_SHOWN) + " |")
    lines += ["", f"Mean inclusion probability per block, FB=16 qkvar f=0.75 (blocks = features 0-15, 16-31, 32-47, "
              f"48-63): natural order {json.dumps(res['pi_profile'])}, permuted order "
              f"{json.dumps(res['pi_profile_perm'])}", "",
              f"Per-feature inclusion p_i = |q_i|/max|q|: {json.dumps(res['feature_profile'])}", ""]
    return "\n".join(lines)


def git_commit():
    """Short HEAD commit, with "+dirty" when tracked files differ from it."""
    def run(*args):
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()

    dirty = run("status", "--porcelain", "--untracked-files=no")
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else "")


def write_report(path, text, kept_heading):
    """Write `text` to the report at `path`, keeping a hand-written section that starts with the
    line `kept_heading` (e.g. "## Conclusion") and runs to the end, if the file has one."""
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            old = f.read()
        if "\n" + kept_heading in old:
            kept = "\n" + old[old.index("\n" + kept_heading):].strip("\n") + "\n"
    with open(path, "w") as f:
        f.write(text + "\n" + kept)


def write_markdown(res, path):
    """Write the report; a hand-written "## Conclusion" section already in the file is kept."""
    write_report(path, markdown(res), "## Conclusion")


# --------------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--calib", type=int, default=8, help="dense decode steps that calibrate the feature order")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kernel-steps", default="0,10,20,31")
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--kl-seeds", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="four settings, for a smoke test")
    ap.add_argument("--only", default="", help="run only these settings (labels, separated by ';')")
    ap.add_argument("--append", action="store_true",
                    help="add the rows to the existing JSON (same header settings) and rewrite the report")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs/results/key_sampling_cpu.json"))
    ap.add_argument("--md", default=os.path.join(ROOT, "docs/results/key_sampling_cpu.md"))
    ap.add_argument("--report-only", action="store_true", help="rewrite the Markdown report from the JSON")
    args = ap.parse_args(argv)
    if args.report_only:
        with open(args.json) as f:
            write_markdown(json.load(f), args.md)
        return
    t0 = time.time()
    commit = git_commit()  # the code that runs, before anyone edits the tree
    kernel_steps = [int(x) for x in args.kernel_steps.split(",") if int(x) < args.steps]
    path = models.resolve_model(None)
    model = LlamaModel.from_pretrained(path, device="cpu")
    tok = Tokenizer.from_dir(path)
    start = args.context + args.calib  # first token fed in the evaluated steps
    ids = ev.texts.long_text_ids(tok, start + args.steps + 1)
    cache0 = ev.decoding.prefilled_cache(model, ids[:args.context], start + args.steps + 1)
    print(f"prefill {args.context} tokens: {time.time() - t0:.0f} s", file=sys.stderr)
    _, calib_qs, cache_c = dense_run(model, cache0, ids, args.context, args.calib)  # calibration steps
    orders = feature_orders(calib_qs, cache_c, start, model.G)
    dense_logits, qs, dense_cache = dense_run(model, cache_c, ids, start, args.steps)
    captured = capture(qs, dense_cache, start, kernel_steps, orders)
    print(f"calibration, dense, capture: {time.time() - t0:.0f} s", file=sys.stderr)
    rows = []
    grid = settings_grid(args.quick)
    if args.only:
        wanted = [x.strip() for x in args.only.split(";") if x.strip()]
        unknown = sorted(set(wanted) - {st.label for st in grid})
        if unknown:
            raise SystemExit(f"unknown settings {unknown}")
        grid = [st for st in grid if st.label in wanted]
    for st in grid:
        t1 = time.time()
        row = {"label": st.label, "key": st.key, "value": st.value, "perm": st.perm,
               "attention": attention_metrics(captured, st, list(range(args.seeds)))}
        kls, top1, fr = [], [], []
        for seed in range(args.kl_seeds):
            lg, frac = sampled_run(model, cache_c, ids, start, args.steps, st, seed, orders)
            kls.append(ev.metrics.kl_from_logits(dense_logits, lg))
            top1.append(ev.metrics.top1_agreement(dense_logits, lg))
            fr.append(frac)
        kls = np.concatenate(kls)
        row["model"] = {"kl_mean": float(kls.mean()), "kl_p90": float(np.percentile(kls, 90)),
                        "kl_max": float(kls.max()), "top1": float(np.concatenate(top1).mean()),
                        "key_fraction": float(np.mean(fr))}
        rows.append(row)
        a, m = row["attention"], row["model"]
        print(f"{st.label:44s} K {a['key_fraction']:.3f} err {a['rel_l2']:.4f} bias {a['rel_bias']:.4f} "
              f"lse+ {a['lse_bias']:.4f} KL {m['kl_mean']:.4f} ({time.time() - t1:.0f} s)", file=sys.stderr)
    res = {
        "header": {"commit": commit, "date": time.strftime("%Y-%m-%d"),
                   "machine": platform.processor() or platform.machine(),
                   "threads": os.environ.get("OMP_NUM_THREADS", "default"), "model": models.DEFAULT_MODEL,
                   "context": args.context, "calib": args.calib, "steps": args.steps, "kernel_steps": kernel_steps,
                   "seeds": args.seeds, "kl_seeds": args.kl_seeds, "wall_s": time.time() - t0,
                   "dense_checksum": float(np.abs(dense_logits).sum())},
        "rows": rows,
        "pi_profile": block_pi_profile(captured, 16, "qkvar", 0.75),
        "pi_profile_perm": block_pi_profile(captured, 16, "qkvar", 0.75, perm=True),
        "feature_profile": feature_profile(captured),
    }
    if args.append:
        with open(args.json) as f:
            old = json.load(f)
        same = ("model", "context", "calib", "steps", "kernel_steps", "seeds", "kl_seeds", "dense_checksum")
        if any(k in old["header"] and old["header"][k] != res["header"][k] for k in same):
            raise SystemExit(f"--append: the run settings differ from {args.json}'s")
        res["header"]["appended"] = old["header"].get("appended", []) + [
            {"commit": res["header"]["commit"], "rows": [r["label"] for r in rows], "wall_s": res["header"]["wall_s"]}]
        res["header"]["commit"], res["header"]["wall_s"] = old["header"]["commit"], old["header"]["wall_s"]
        res["header"]["date"] = old["header"]["date"]
        new = {r["label"] for r in rows}
        order = {st.label: i for i, st in enumerate(settings_grid())}
        res["rows"] = sorted([r for r in old["rows"] if r["label"] not in new] + rows,
                             key=lambda r: order.get(r["label"], len(order)))
    with open(args.json, "w") as f:
        json.dump(res, f, indent=1)
    write_markdown(res, args.md)
    print(f"wrote {args.json} and {args.md} ({time.time() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()

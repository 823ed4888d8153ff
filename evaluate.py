"""``santa-cupy eval``: accuracy of SANTA decode attention against exact dense attention.

Three evaluations, each a function of sampler x budget x S (samples) x seed:

- ``eval kernel``: real attention inputs captured from the model on a long text (q and the KV
  cache of every layer at one decode step); relative L2 error of the attention output against
  float64 exact attention on the same inputs.
- ``eval model``: teacher forcing on a long text: prefill a prefix with dense attention, then decode
  the rest token by token (feeding the true tokens) with the attention under test. Per-step
  KL(dense || santa) of next-token distributions, top-1 agreement, perplexity, and the greedy
  exact-match length (first divergence from dense greedy decoding) from the same prefix.
- ``eval retrieval``: a passcode planted at a chosen depth of a filler haystack of L tokens, asked
  for at the end; success = the greedy answer contains the code.

SANTA affects decode steps only (prefill is dense), so every scored prediction comes from a decode
step: the last prompt token is always fed through ``model.decode``.

Capturing attention inputs: ``LlamaModel.decode`` has no public hook, so ``AttentionRecorder``
shadows the ``_eager_attention`` method on one model *instance* (never the class) with a wrapper
that records ``(q, k_cache, v_cache, lengths)`` per layer and then calls the original attention.
It works for every path (NumPy dense, NumPy SANTA reference, CuPy DecodePlan).

The metrics at the top of this file are pure NumPy and float64.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from dataclasses import asdict, dataclass

import click
import numpy as np

from llama_min.commands import check_output_path

# ============================================================================ metrics (NumPy)


def relative_l2(estimate, reference) -> float:
    """||estimate - reference||_2 / ||reference||_2 over all elements (float64)."""
    est = np.asarray(estimate, np.float64)
    ref = np.asarray(reference, np.float64)
    if est.shape != ref.shape:
        raise ValueError(f"shape mismatch: {est.shape} vs {ref.shape}")
    denom = np.linalg.norm(ref)
    if denom == 0:
        raise ValueError("reference has zero norm")
    return float(np.linalg.norm(est - ref) / denom)


def log_softmax(logits) -> np.ndarray:
    """Stable log-softmax over the last axis, float64."""
    x = np.asarray(logits, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def kl_from_logits(p_logits, q_logits) -> np.ndarray:
    """KL(p || q) per row (last axis = vocabulary) from unnormalised logits, float64, >= 0."""
    lp, lq = log_softmax(p_logits), log_softmax(q_logits)
    kl = (np.exp(lp) * (lp - lq)).sum(axis=-1)
    return np.maximum(kl, 0.0)


def top1_agreement(a_logits, b_logits) -> np.ndarray:
    """Per row: do the argmax tokens agree (bool array)."""
    return np.argmax(np.asarray(a_logits), -1) == np.argmax(np.asarray(b_logits), -1)


def token_nll(logits, targets) -> np.ndarray:
    """Per row negative log-likelihood of targets[i] under softmax(logits[i]), float64."""
    lp = log_softmax(logits)
    t = np.asarray(targets, np.int64)
    return -lp[np.arange(lp.shape[0]), t]


def perplexity(nll) -> float:
    """exp(mean NLL)."""
    nll = np.asarray(nll, np.float64)
    if nll.size == 0:
        raise ValueError("perplexity of zero tokens")
    return float(np.exp(nll.mean()))


def exact_match_length(reference, candidate) -> int:
    """Number of leading tokens on which two sequences agree (index of the first divergence)."""
    n = 0
    for a, b in zip(reference, candidate):
        if int(a) != int(b):
            break
        n += 1
    return n


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for a single value)."""
    v = np.asarray(values, np.float64)
    if v.size == 0:
        raise ValueError("mean_std of no values")
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def retrieval_success(answer: str, code) -> bool:
    """The answer contains the code's digits (spaces and thousands separators ignored)."""
    digits = re.sub(r"(?<=\d)[\s,.'](?=\d)", "", answer)
    return str(code) in digits


def success_rate(flags) -> float:
    flags = list(flags)
    if not flags:
        raise ValueError("success rate of no trials")
    return sum(bool(f) for f in flags) / len(flags)


def exact_attention(q, k_cache, v_cache, length: int, scale: float | None = None) -> np.ndarray:
    """Exact float64 decode attention of one sequence set: q [B,H,D], caches [B,L,KVH,D] (float
    arrays, already widened), first ``length`` rows -> o [B,H,D] float64."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k_cache[:, :length], np.float64)
    v = np.asarray(v_cache[:, :length], np.float64)
    B, H, D = q.shape
    KVH = k.shape[2]
    G = H // KVH
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.reshape(B, KVH, G, D)
    s = np.einsum("bkgd,blkd->bkgl", qg, k) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bkgl,blkd->bkgd", p, v).reshape(B, H, D)


# ============================================================================ settings


@dataclass(frozen=True)
class Setting:
    """One attention configuration under test ("dense" has no sampler/budget/S)."""

    method: str = "dense"
    sampler: str = ""
    budget: str = ""
    samples: int = 0

    @property
    def label(self) -> str:
        if self.method == "dense":
            return "dense"
        return f"{self.sampler}/{self.budget}/S={self.samples}"

    def attention(self, seed: int, block_n=None):
        from llama_min.model import AttentionConfig
        if self.method == "dense":
            return AttentionConfig(method="dense", block_n=block_n)
        return AttentionConfig(method="santa", samples=self.samples, sampler=self.sampler,   # the estimator
                               budget=self.budget, seed=seed, block_n=block_n, santa_min_length=0)  # everywhere


DENSE = Setting()


def settings_grid(samplers, budgets, samples) -> list[Setting]:
    """Every sampler x budget x S; the one-pass budget only with the systematic sampler (its design)."""
    from santa_cupy import spec
    return [Setting("santa", sm, bu, int(s)) for sm in samplers for bu in budgets for s in samples
            if bu != spec.ONE_PASS or sm == "systematic"]


# ============================================================================ texts


_NAMES = ["Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas",
          "Kira", "Leon", "Mara", "Nils", "Olga", "Pavel", "Quinn", "Rosa", "Sven", "Tara"]
_PLACES = ["Marrow Bay", "the old mill", "Glenford", "the harbour market", "Ashby Hill",
           "the river crossing", "Northwick", "the lighthouse", "Fenwater", "the stone bridge",
           "Kestrel Point", "the orchard", "Holloway", "the clock tower", "Brindle Cove"]
_OBJECTS = ["a brass compass", "a blue lantern", "a wooden flute", "a silver key", "a red kite",
            "a leather map", "a copper kettle", "a glass bottle", "a green umbrella", "a tin whistle",
            "a carved chess set", "a linen sail", "an iron anchor", "a painted drum"]
_VERBS = ["found", "sold", "repaired", "painted", "lost", "buried", "bought", "borrowed", "hid",
          "carried"]
_DETAILS = [
    "The morning was cold and the streets were quiet.",
    "Nobody in town could remember a stranger day.",
    "Rain had fallen for three days before it happened.",
    "The neighbours talked about it for weeks afterwards.",
    "It was written down carefully in the town ledger.",
    "A small crowd gathered to watch from a distance.",
    "The wind came in from the sea and smelled of salt.",
    "Later that evening the bells rang twice.",
]


def _fact(i: int) -> tuple[str, str, str, str, int]:
    return (_NAMES[(7 * i + 3) % len(_NAMES)], _VERBS[(3 * i + 1) % len(_VERBS)],
            _OBJECTS[(5 * i + 2) % len(_OBJECTS)], _PLACES[(11 * i + 4) % len(_PLACES)],
            1800 + (37 * i + 11) % 200)


def long_text_paragraph(i: int) -> str:
    """Paragraph i of the deterministic long text: a numbered fact, a detail, and every third
    paragraph a recall of an earlier fact (long-range copying, where attention quality shows)."""
    name, verb, obj, place, year = _fact(i)
    out = [f"Fact {i + 1}: In {year}, {name} {verb} {obj} at {place}.",
           _DETAILS[(i * 5) % len(_DETAILS)]]
    if i >= 6 and i % 3 == 0:
        j = (i * 13) % (i - 2)
        n2, v2, o2, p2, y2 = _fact(j)
        out.append(f"As fact {j + 1} records, in {y2} {n2} {v2} {o2} at {p2}.")
    return " ".join(out)


def long_text_ids(tok, n_tokens: int) -> list[int]:
    """The first n_tokens token ids of the deterministic long text."""
    n_par = 32
    while True:
        ids = tok.encode("\n\n".join(long_text_paragraph(i) for i in range(n_par)),
                         add_special_tokens=False)
        if len(ids) >= n_tokens:
            return list(ids[:n_tokens])
        if n_par > 1 << 20:
            raise RuntimeError(f"tokenizer gave only {len(ids)} tokens for {n_par} paragraphs")
        n_par *= 2


_FILLER = [
    "The grass grows slowly in the shade of the tall trees.",
    "A gardener waters the roses early, before the sun is high.",
    "Clouds drift over the valley and the hills turn grey and then gold.",
    "The library is quiet in the afternoon, and the pages turn softly.",
    "Boats rock gently against the pier while the gulls call overhead.",
    "In the kitchen, bread rises under a clean white cloth.",
    "The train crosses the plain without hurry, its windows full of light.",
    "Children chalk pictures on the pavement and the rain washes them away.",
    "An old dog sleeps by the fire, dreaming of long walks.",
    "The market opens at dawn with baskets of apples and pears.",
    "Snow settles on the rooftops and the town grows still.",
    "A letter waits on the table, sealed and not yet read.",
]

NEEDLE = "The secret passcode is {code}."
QUESTION = "What is the secret passcode? Answer with the number only."


def passcode(length: int, depth: float, rep: int) -> int:
    """A deterministic five-digit code per (length, depth, repetition)."""
    rng = np.random.default_rng([int(length), int(round(depth * 1000)), int(rep), 20260501])
    return int(rng.integers(10000, 100000))


def retrieval_prompt_ids(tok, length: int, depth: float, code: int) -> list[int]:
    """Prompt of about `length` tokens (never more): filler with the needle at fraction `depth`
    of the haystack, then the question; wrapped in the chat template when the tokenizer has one."""
    def render(n_filler: int) -> list[int]:
        sents = [_FILLER[i % len(_FILLER)] for i in range(n_filler)]
        sents.insert(int(round(depth * n_filler)), NEEDLE.format(code=code))
        content = " ".join(sents) + "\n\n" + QUESTION
        if getattr(tok, "has_chat_template", False):
            text = tok.apply_chat_template([{"role": "user", "content": content}])
            return tok.encode(text, add_special_tokens=False)
        return tok.encode(content)

    per = max(1, len(tok.encode(" ".join(_FILLER), add_special_tokens=False)) / len(_FILLER))
    n = max(0, int((length - len(render(0))) / per))
    ids = render(n)
    while len(ids) > length and n > 0:        # shrink until it fits
        n = max(0, n - max(1, (len(ids) - length) // int(per) + 1))
        ids = render(n)
    return ids


# ============================================================================ model plumbing


def pick_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        import cupy
        return "gpu" if cupy.cuda.runtime.getDeviceCount() > 0 else "cpu"
    except Exception:  # noqa: BLE001 - no CuPy / no driver
        return "cpu"


def to_host(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.get()


def clone_cache(model, cache):
    """An independent copy of a KV cache (so every setting decodes from the same prefill)."""
    new = model.new_cache(cache.batch, cache.max_len)
    for dst, src in zip(new.k + new.v, cache.k + cache.v):
        dst[...] = src
    new.lengths[...] = cache.lengths
    new.length, new.step = cache.length, cache.step
    return new


def prefilled_cache(model, ids, max_len: int):
    """A cache of capacity max_len holding the dense prefill of ids (list of ints, non-empty)."""
    cache = model.new_cache(1, max_len)
    model.prefill(np.asarray(ids, np.int64)[None], cache)
    return cache


class AttentionRecorder:
    """Context manager: records decode-attention inputs of one model instance, per layer.

        with AttentionRecorder(model) as rec:
            model.decode(tokens, cache)
        q, k_cache, v_cache, lengths = rec.calls[layer]

    Shadows ``model._eager_attention`` on the instance (see the module docstring). ``q`` and
    ``lengths`` are copies; the caches are the live cache arrays (do not decode further on them).
    """

    def __init__(self, model):
        if not hasattr(model, "_eager_attention"):
            raise RuntimeError("this model has no _eager_attention hook point; cannot capture inputs")
        self.model = model
        self.calls: dict[int, tuple] = {}

    def __enter__(self):
        original = self.model._eager_attention

        def patched(att, cache):
            attn = original(att, cache)

            def recording(li, q, kc, vc, lens):
                self.calls[li] = (q.copy(), kc, vc, lens.copy())
                return attn(li, q, kc, vc, lens)
            return recording

        self.model._eager_attention = patched
        return self

    def __exit__(self, *exc):
        del self.model._eager_attention
        return False


def decode_logits(model, cache, token: int, attention) -> np.ndarray:
    """One decode step -> host logits [V] float32."""
    return to_host(model.decode(np.asarray([token], np.int64), cache, attention)[0])


def make_stepper(model, cache, attention):
    """A Stepper: ``step(token)`` -> host logits [V] float32 after one decode step on ``cache``.

    On the GPU the step is a CUDA graph (llama_min.model.GraphDecoder, captured once per run):
    eager CuPy decoding spends ~50 ms of host time per step on a 30-layer model, the graph ~4 ms,
    which is what makes the full evaluation grid affordable. Same math, same SANTA step counter.
    Use it as a context manager: the graph's cuBLAS handle is released on exit (the retrieval
    grid builds thousands of them)."""
    return Stepper(model, cache, attention)


class Stepper:
    """One decode step at a time on a cache (see make_stepper)."""

    def __init__(self, model, cache, attention):
        self.graph = None
        if model.xp is not np:
            from llama_min.model import GraphDecoder
            self.graph = GraphDecoder(model, cache, attention)
        self.model, self.cache, self.attention = model, cache, attention

    def __call__(self, token: int) -> np.ndarray:
        if self.graph is not None:
            return to_host(self.graph.replay(np.asarray([token], np.int32))[0])
        return decode_logits(self.model, self.cache, token, self.attention)

    def close(self):
        if self.graph is not None:
            self.graph.close()
            self.graph = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ============================================================================ evaluations


def _progress(length: int, label: str):
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)


def capture_attention_inputs(model, ids) -> dict[int, tuple]:
    """Dense prefill of ids[:-1], one dense decode of ids[-1]; -> {layer: (q, k, v, lengths)}."""
    cache = prefilled_cache(model, ids[:-1], len(ids))
    from llama_min.model import AttentionConfig
    with AttentionRecorder(model) as rec:
        model.decode(np.asarray([ids[-1]], np.int64), cache, AttentionConfig(method="dense"))
    return rec.calls


def kernel_errors(captured, layers, settings, seeds, block_n=None, progress=None) -> dict:
    """Relative L2 error per (setting, seed, layer) against float64 exact attention.

    Also the "dense" setting: santa_cupy's dense path (kernel on GPU, reference on CPU) in the
    storage dtype, i.e. the floor set by the dtype. Returns {label: {"setting", "per_seed":
    [{"seed", "layers": {layer: err}, "mean": err}]}}."""
    import santa_cupy
    from santa_cupy import spec

    exact = {}
    for li in layers:
        q, kc, vc, lens = captured[li]
        n = int(to_host(lens)[0])
        exact[li] = exact_attention(to_host(spec.to_float32(q)), to_host(spec.to_float32(kc[:, :n])),
                                    to_host(spec.to_float32(vc[:, :n])), n)
    out = {}
    # the one-pass budget needs the previous step's lse of each layer, which one captured step has
    # not: it is measured by eval model and eval retrieval only
    for st in [DENSE] + [st for st in settings if st.budget != spec.ONE_PASS]:
        per_seed = []
        for seed in ([0] if st.method == "dense" else seeds):
            errs = {}
            for li in layers:
                q, kc, vc, lens = captured[li]
                kw = {} if st.method == "dense" else dict(samples=st.samples, sampler=st.sampler,
                                                          budget=st.budget, seed=int(seed))
                o = santa_cupy.decode_attention(q, kc, vc, lens, method=st.method, layer=li,
                                                block_n=block_n, **kw)
                errs[li] = relative_l2(to_host(spec.to_float32(o)), exact[li])
                if progress is not None:
                    progress.update(1)
            per_seed.append({"seed": int(seed), "layers": errs, "mean": float(np.mean(list(errs.values())))})
        out[st.label] = {"setting": asdict(st), "per_seed": per_seed}
    return out


def teacher_forced(model, cache0, ids, prefix: int, attention) -> np.ndarray:
    """Logits [len(ids)-1-prefix, V] predicting ids[prefix+1:], decoding ids[prefix:-1] one at a
    time (true tokens fed) on a copy of cache0 (the dense prefill of ids[:prefix])."""
    with make_stepper(model, clone_cache(model, cache0), attention) as step:
        return np.stack([step(int(t)) for t in ids[prefix:-1]])


def greedy_tokens(model, cache0, first: int, n: int, attention, stop_ids=(), margins=None) -> list[int]:
    """Greedy continuation: feed `first`, then each argmax; n tokens (fewer on a stop id).
    If `margins` is a list, the top-1 minus top-2 log-probability of every step is appended."""
    out, tok = [], int(first)
    with make_stepper(model, clone_cache(model, cache0), attention) as step:
        for _ in range(n):
            lg = step(tok)
            tok = int(np.argmax(lg))
            if margins is not None:
                top2 = np.partition(lg.astype(np.float64), -2)[-2:]
                margins.append(float(top2[1] - top2[0]))
            out.append(tok)
            if tok in stop_ids:
                break
    return out


def model_metrics(model, ids, prefix: int, settings, seeds, greedy_n: int, block_n=None,
                  progress=None) -> dict:
    """Teacher-forced KL / top-1 / perplexity and greedy exact-match length per setting and seed."""
    ids = [int(t) for t in ids]
    targets = np.asarray(ids[prefix + 1:])
    cache0 = prefilled_cache(model, ids[:prefix], max(len(ids), prefix + 1 + greedy_n) + 1)
    dense_logits = teacher_forced(model, cache0, ids, prefix, DENSE.attention(0, block_n))
    margins: list[float] = []
    dense_greedy = greedy_tokens(model, cache0, ids[prefix], greedy_n, DENSE.attention(0, block_n),
                                 margins=margins)
    if progress is not None:
        progress.update(1)
    out = {"dense": {"setting": asdict(DENSE), "per_seed": [{
        "seed": 0, "kl": 0.0, "top1": 1.0, "ppl": perplexity(token_nll(dense_logits, targets)),
        "greedy_match": len(dense_greedy)}]}}
    for st in settings:
        per_seed = []
        for seed in seeds:
            att = st.attention(int(seed), block_n)
            lg = teacher_forced(model, cache0, ids, prefix, att)
            gr = greedy_tokens(model, cache0, ids[prefix], greedy_n, att)
            per_seed.append({"seed": int(seed),
                             "kl": float(kl_from_logits(dense_logits, lg).mean()),
                             "top1": float(top1_agreement(dense_logits, lg).mean()),
                             "ppl": perplexity(token_nll(lg, targets)),
                             "greedy_match": exact_match_length(dense_greedy, gr)})
            if progress is not None:
                progress.update(1)
        out[st.label] = {"setting": asdict(st), "per_seed": per_seed}
    return {"steps": len(targets), "prefix": prefix, "greedy_tokens": greedy_n,
            "dense_greedy": dense_greedy, "dense_greedy_margins": margins, "results": out}


def retrieval_trials(model, tok, lengths, depths, needles, settings, seeds, answer_tokens: int,
                     block_n=None, progress=None) -> dict:
    """Greedy answers to the passcode question per (setting, seed, length, depth, needle)."""
    stop = set(getattr(tok, "eos_ids", []) or []) | set(np.atleast_1d(model.cfg.eos_token_id).tolist())
    runs = [(DENSE, 0)] + [(st, int(s)) for st in settings for s in seeds]
    out = {st.label: {"setting": asdict(st), "trials": []} for st, _ in runs}
    for L in lengths:
        for d in depths:
            for r in range(needles):
                code = passcode(L, d, r)
                ids = retrieval_prompt_ids(tok, L, d, code)
                cache0 = prefilled_cache(model, ids[:-1], len(ids) + answer_tokens + 1)
                for st, seed in runs:
                    ans = greedy_tokens(model, cache0, ids[-1], answer_tokens,
                                        st.attention(seed, block_n), stop)
                    text = tok.decode(ans)
                    out[st.label]["trials"].append({
                        "length": L, "tokens": len(ids), "depth": d, "needle": r, "seed": seed,
                        "code": code, "answer": text, "success": retrieval_success(text, code)})
                    if progress is not None:
                        progress.update(1)
    return out


# ============================================================================ summaries


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


def kernel_table(res: dict) -> str:
    rows = []
    for entry in res.values():
        means = [p["mean"] for p in entry["per_seed"]]
        worst = max(max(p["layers"].values()) for p in entry["per_seed"])
        rows.append(_setting_cells(entry["setting"]) + [fmt_ms(*mean_std(means)), f"{worst:.3g}"])
    return markdown_table(["sampler", "budget", "S", "rel. L2 error (mean over layers, ± std over seeds)",
                           "worst layer"], rows)


def model_table(res: dict) -> str:
    rows = []
    for entry in res["results"].values():
        ps = entry["per_seed"]
        col = lambda k: mean_std([p[k] for p in ps])  # noqa: E731
        rows.append(_setting_cells(entry["setting"]) + [
            fmt_ms(*col("kl")), fmt_ms(*col("top1")), fmt_ms(*col("ppl"), 4),
            fmt_ms(*col("greedy_match"))])
    return markdown_table(["sampler", "budget", "S", "KL(dense ‖ santa) / token", "top-1 agreement",
                           "perplexity", f"greedy exact match (of {res['greedy_tokens']})"], rows)


def retrieval_table(res: dict) -> str:
    lengths = sorted({t["length"] for e in res.values() for t in e["trials"]})
    rows = []
    for entry in res.values():
        cells = []
        for L in lengths:
            flags = [t["success"] for t in entry["trials"] if t["length"] == L]
            cells.append(f"{success_rate(flags):.2f} ({sum(flags)}/{len(flags)})")
        allf = [t["success"] for t in entry["trials"]]
        rows.append(_setting_cells(entry["setting"]) + cells + [f"{success_rate(allf):.2f}"])
    return markdown_table(["sampler", "budget", "S"] + [f"L={L}" for L in lengths] + ["all"], rows)


# ============================================================================ plots


def write_plot(path: str, results: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("matplotlib is not installed: skipping --plot (pip install matplotlib)", err=True)
        return
    panels = [k for k in ("kernel", "model", "retrieval") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, name in zip(axes[0], panels):
        series = _plot_series(name, results[name])
        for label, (xs, ys) in series.items():
            ax.plot(xs, ys, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (samples per head)")
        ax.set_ylabel({"kernel": "rel. L2 error", "model": "KL(dense || santa)",
                       "retrieval": "success rate"}[name])
        if name != "retrieval":
            ax.set_yscale("log")
        ax.set_title(f"eval {name}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    click.echo(f"wrote {path}", err=True)


def _plot_series(name: str, res: dict) -> dict:
    entries = res["results"]
    series: dict[str, tuple[list, list]] = {}
    for entry in entries.values():
        st = entry["setting"]
        if st["method"] == "dense":
            continue
        if name == "kernel":
            y = mean_std([p["mean"] for p in entry["per_seed"]])[0]
        elif name == "model":
            y = mean_std([p["kl"] for p in entry["per_seed"]])[0]
        else:
            y = success_rate(t["success"] for t in entry["trials"])
        xs, ys = series.setdefault(f"{st['sampler']}/{st['budget']}", ([], []))
        xs.append(st["samples"])
        ys.append(y)
    return series


# ============================================================================ configuration

FULL = dict(samplers="iid,stratified,systematic", budgets="global,fixed,largest_remainder",
            samples="16,64,256,1024,2048", seeds="0,1,2", context=4096, layers="all", steps=128,
            greedy_tokens=64, lengths="1024,2048,4096,8000", depths="0.1,0.5,0.9", needles=2,
            answer_tokens=16)
SMALL = dict(samplers="iid,systematic", budgets="global", samples="64,256", seeds="0,1",
             context=1024, layers="0,14,29", steps=24, greedy_tokens=16, lengths="512,1024",
             depths="0.25,0.75", needles=1, answer_tokens=16)


def _csv(text, kind=str) -> list:
    """'a,b' -> [kind(a), kind(b)]; a list (already parsed by CommaList) is returned as it is."""
    if isinstance(text, (list, tuple)):
        return list(text)
    return [kind(x.strip()) for x in str(text).split(",") if x.strip()]


class CommaList(click.ParamType):
    """A comma-separated list whose every item is checked by click type `item` (e.g. an IntRange
    or a Choice), so a bad value fails when the command line is parsed, before any model loads."""

    name = "list"

    def __init__(self, item: click.ParamType):
        self.item = item

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [x.strip() for x in str(value).split(",")]
        if not value or not all(items):
            self.fail(f"{value!r} is not a comma list of {self.item.name} values", param, ctx)
        return [self.item.convert(x, param, ctx) for x in items]


def _named(param_type, name):
    param_type.name = name            # click says "'abc' is not a valid {name}."
    return param_type


def _option_types():
    from santa_cupy import spec
    return {
        "samplers": CommaList(click.Choice(spec.SAMPLERS)),
        "budgets": CommaList(click.Choice(spec.DECODE_BUDGETS)),
        "samples": CommaList(_named(click.IntRange(1, spec.MAX_SAMPLES), "integer")),
        "seeds": CommaList(_named(click.IntRange(0, 2**64 - 1), "integer")),
        "lengths": CommaList(_named(click.IntRange(min=2), "integer")),
        "depths": CommaList(_named(click.FloatRange(0.0, 1.0), "number")),
    }


OPTION_TYPES = _option_types()


@dataclass
class EvalConfig:
    model: str | None
    device: str
    dtype: str | None
    samplers: list
    budgets: list
    samples: list
    seeds: list
    context: int
    layers: str
    steps: int
    greedy_tokens: int
    lengths: list
    depths: list
    needles: int
    answer_tokens: int
    block_n: int | None
    small: bool
    given: frozenset = frozenset()   # the options given on the command line (not defaults)


def resolve_config(small: bool, **given) -> EvalConfig:
    """Options left unset (None) take the --small or the full default."""
    base = SMALL if small else FULL
    v = {k: (given.get(k) if given.get(k) is not None else base[k]) for k in base}
    from santa_cupy import spec
    samplers, budgets = _csv(v["samplers"]), _csv(v["budgets"])
    for name, vals, ok in (("sampler", samplers, spec.SAMPLERS), ("budget", budgets, spec.DECODE_BUDGETS)):
        bad = [x for x in vals if x not in ok]
        if bad:
            raise click.BadParameter(f"unknown {name}(s) {bad}; choose from {list(ok)}")
    return EvalConfig(model=given.get("model"), device=given.get("device") or "auto",
                      dtype=given.get("dtype"), samplers=samplers, budgets=budgets,
                      samples=_csv(v["samples"], int), seeds=_csv(v["seeds"], int),
                      context=int(v["context"]), layers=str(v["layers"]), steps=int(v["steps"]),
                      greedy_tokens=int(v["greedy_tokens"]), lengths=_csv(v["lengths"], int),
                      depths=_csv(v["depths"], float), needles=int(v["needles"]),
                      answer_tokens=int(v["answer_tokens"]), block_n=given.get("block_n"), small=small,
                      given=frozenset(k for k in base if given.get(k) is not None))


def retrieval_cap(max_positions: int, answer_tokens: int) -> int:
    """Longest retrieval prompt that leaves room for the answer in the context window."""
    return max_positions - answer_tokens - 2


def check_lengths_fit(cfg: EvalConfig, max_positions: int, which, n_layers: int | None = None) -> list:
    """Retrieval lengths beyond the context window: a UsageError (exit 2) when the user asked for
    them, else (a default grid on a short-context model) a notice of the cap; likewise --layers
    beyond the model's n_layers. Returns the notices."""
    notices = []
    if "kernel" in which and n_layers is not None:
        select_layers(cfg.layers, n_layers, clamp="layers" not in cfg.given)
    if "retrieval" in which:
        cap = retrieval_cap(max_positions, cfg.answer_tokens)
        over = [L for L in cfg.lengths if L > cap]
        if over and "lengths" in cfg.given:
            raise click.BadParameter(
                f"{', '.join(map(str, over))} beyond the model's context: at most {cap} tokens "
                f"(max_position_embeddings {max_positions} - {cfg.answer_tokens} answer tokens - 2)",
                param_hint="'--lengths'")
        if over:
            notices.append(f"eval retrieval: default lengths {over} capped at {cap} tokens (the model's context)")
    if "context" in cfg.given and cfg.context > max_positions and {"kernel", "model"} & set(which):
        raise click.BadParameter(f"{cfg.context} is beyond the model's context window "
                                 f"({max_positions} tokens)", param_hint="'--context'")
    # run_model keeps greedy_tokens + 2 positions free and needs a text of 3 tokens (1 decode step)
    if "model" in which and max_positions - cfg.greedy_tokens - 2 < 3:
        raise click.BadParameter(f"{cfg.greedy_tokens} leaves no room for a text in the model's context "
                                 f"({max_positions} tokens): at most {max_positions - 5}",
                                 param_hint="'--greedy-tokens'")
    if "retrieval" in which and retrieval_cap(max_positions, cfg.answer_tokens) < 2:
        raise click.BadParameter(f"{cfg.answer_tokens} leaves no room for a prompt in the model's context "
                                 f"({max_positions} tokens): at most {max_positions - 4}",
                                 param_hint="'--answer-tokens'")
    return notices


def select_layers(spec_text: str, n_layers: int, clamp: bool = True) -> list[int]:
    """Layer indices from 'all' or a comma list (negative counts from the end). clamp: indices past
    the last layer become the last (a preset's grid on a smaller model); else they are an error
    naming --layers (what the user typed)."""
    if spec_text.strip() == "all":
        return list(range(n_layers))
    given = _csv(spec_text, int)
    over = [x for x in given if x >= n_layers or x < -n_layers]
    if over and not clamp:
        raise click.BadParameter(f"{', '.join(map(str, over))} out of range: the model has {n_layers} layers "
                                 f"(0..{n_layers - 1}, or -{n_layers}..-1 from the end)", param_hint="'--layers'")
    layers = sorted({min(x, n_layers - 1) if x >= 0 else n_layers + x for x in given})
    if any(not 0 <= li < n_layers for li in layers):
        raise click.BadParameter(f"layers must be in 0..{n_layers - 1}, got {spec_text}", param_hint="'--layers'")
    return layers


# ============================================================================ runners


class Session:
    """The loaded model and tokenizer, shared by the subcommands of one invocation."""

    def __init__(self, cfg: EvalConfig, which=("kernel", "model", "retrieval")):
        from llama_min.config import load_config
        from llama_min.model import LlamaModel
        from llama_min.models import resolve_model
        from llama_min.tokenizer import Tokenizer
        self.cfg = cfg
        self.device = pick_device(cfg.device)
        try:
            self.path = resolve_model(cfg.model, progress=True)
            model_cfg = load_config(self.path)
            for notice in check_lengths_fit(cfg, model_cfg.max_position_embeddings, which,
                                            model_cfg.num_hidden_layers):
                click.echo(notice, err=True)
            click.echo(f"loading {self.path} on {self.device} ...", err=True)
            self.model = LlamaModel.from_pretrained(self.path, device=self.device, dtype=cfg.dtype)
            self.tok = Tokenizer.from_dir(self.path)
        except (ValueError, RuntimeError, OSError) as e:
            raise click.ClickException(str(e)) from None
        self.settings = settings_grid(cfg.samplers, cfg.budgets, cfg.samples)

    def header(self) -> dict:
        c = self.cfg
        return {"model": str(self.path), "device": self.device, "kv_dtype": self.model.kv_dtype,
                "samplers": c.samplers, "budgets": c.budgets, "samples": c.samples, "seeds": c.seeds,
                "block_n": c.block_n, "small": c.small}

    def max_context(self) -> int:
        return int(self.model.cfg.max_position_embeddings)

    def run_kernel(self) -> dict:
        c = self.cfg
        n = min(c.context, self.max_context())
        ids = long_text_ids(self.tok, n)
        layers = select_layers(c.layers, self.model.cfg.num_hidden_layers, clamp="layers" not in c.given)
        click.echo(f"eval kernel: capturing q/K/V of {len(layers)} layers at context {n} ...", err=True)
        captured = capture_attention_inputs(self.model, ids)
        total = len(layers) * (1 + len(self.settings) * len(c.seeds))
        with _progress(total, "eval kernel") as bar:
            res = kernel_errors(captured, layers, self.settings, c.seeds, c.block_n, bar)
        return {"context": n, "layers": layers, "results": res}

    def run_model(self) -> dict:
        c = self.cfg
        n = min(c.context, self.max_context() - c.greedy_tokens - 2)
        steps = min(c.steps, n - 2)
        ids = long_text_ids(self.tok, n)
        click.echo(f"eval model: {n}-token text, {steps} teacher-forced decode steps, "
                   f"{c.greedy_tokens} greedy tokens ...", err=True)
        with _progress(1 + len(self.settings) * len(c.seeds), "eval model") as bar:
            res = model_metrics(self.model, ids, n - 1 - steps, self.settings, c.seeds,
                                c.greedy_tokens, c.block_n, bar)
        res["context"] = n
        return res

    def run_retrieval(self) -> dict:
        c = self.cfg
        cap = retrieval_cap(self.max_context(), c.answer_tokens)
        room = self.max_context() - c.answer_tokens - 1                  # the prompt's part of the cache
        shortest = len(retrieval_prompt_ids(self.tok, 0, 0.5, 10000))      # the needle and question alone
        if shortest > room:
            raise click.BadParameter(f"{c.answer_tokens} leaves {room} of the model's {self.max_context()} "
                                     f"positions for a prompt; the passcode question alone takes {shortest}",
                                     param_hint="'--answer-tokens'")
        lengths = sorted({min(L, cap) for L in c.lengths})
        trials = len(lengths) * len(c.depths) * c.needles * (1 + len(self.settings) * len(c.seeds))
        with _progress(trials, "eval retrieval") as bar:
            res = retrieval_trials(self.model, self.tok, lengths, c.depths, c.needles, self.settings,
                                   c.seeds, c.answer_tokens, c.block_n, bar)
        return {"lengths": lengths, "depths": c.depths, "needles": c.needles, "results": res}


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
            if name == "model" and r.get("dense_greedy_margins"):
                mg = r["dense_greedy_margins"]
                i = int(np.argmin(mg))
                parts.append(f"Dense greedy path: smallest top-1 - top-2 logit margin {mg[i]:.3g} at "
                             f"token {i} (a near tie there makes any later divergence a coin flip).")
    return "\n\n".join(parts) + "\n"


def run_and_report(cfg: EvalConfig, which, json_path, md_path, plot_path):
    t0 = time.time()
    session = Session(cfg, which)
    results = {"config": session.header()}
    runners = {"kernel": session.run_kernel, "model": session.run_model,
               "retrieval": session.run_retrieval}
    for name in which:
        t = time.time()
        results[name] = runners[name]()
        results[name]["seconds"] = round(time.time() - t, 2)
    results["config"]["seconds"] = round(time.time() - t0, 2)
    write_report(results, json_path, md_path, plot_path)
    return results


def write_report(results: dict, json_path=None, md_path=None, plot_path=None) -> None:
    """Print the Markdown report; optionally write the raw JSON, the report and a plot."""
    md = report_markdown(results)
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
            write_plot(plot_path, results)
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the report'}: {e.strerror or e}") from None


MERGE_SAME_CONFIG = ("model", "kv_dtype", "seeds", "block_n", "small")   # must agree across merged runs
MERGE_UNION_CONFIG = ("samplers", "budgets", "samples")                     # the merged run covers all


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


# ============================================================================ CLI


def _block_ns():
    from santa_cupy import spec
    return spec.BLOCK_NS


def _common(f):
    opts = [
        click.option("--model", default=None, metavar="PATH|NAME",
                     help="Checkpoint directory, .gguf or cached model name (default: SmolLM2-135M-Instruct)."),
        click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True),
        click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
                     help="KV/attention dtype (default: float32 on CPU, float16 on GPU)."),
        click.option("--samplers", type=OPTION_TYPES["samplers"], default=None,
                     help=f"Comma list [{FULL['samplers']}]."),
        click.option("--budgets", type=OPTION_TYPES["budgets"], default=None,
                     help=f"Comma list [{FULL['budgets']}]."),
        click.option("--samples", type=OPTION_TYPES["samples"], default=None,
                     help=f"Comma list of S >= 1 [{FULL['samples']}]."),
        click.option("--seeds", type=OPTION_TYPES["seeds"], default=None,
                     help=f"Comma list of seeds >= 0 [{FULL['seeds']}]."),
        click.option("--block-n", type=click.Choice([str(b) for b in _block_ns()]), default=None,
                     callback=lambda ctx, param, v: None if v is None else int(v),
                     help="SANTA tile size (default: santa_cupy's)."),
        click.option("--small", is_flag=True, help="A CPU-sized grid (minutes on 2 cores): " +
                     ", ".join(f"{k}={v}" for k, v in SMALL.items()) + "."),
        click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=check_output_path,
                     help="Write all raw results as JSON."),
        click.option("--markdown", "md_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=check_output_path,
                     help="Also write the Markdown report to a file."),
        click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
                     callback=check_output_path,
                     help="Write a PNG plot (needs matplotlib)."),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _text(f):
    f = click.option("--context", type=click.IntRange(min=4), default=None,
                     help=f"Tokens of long text (kernel: capture point; model: text length) [{FULL['context']}].")(f)
    return f


def _check_layers(ctx, param, value):
    """'all' or a comma list of integers (checked against the model's layers once it is known)."""
    if value is None or value.strip() == "all":
        return value
    try:
        _csv(value, int)
    except ValueError:
        raise click.BadParameter(f"{value!r} is not 'all' or a comma list of layer indices") from None
    return value


def _kernel_opts(f):
    return click.option("--layers", default=None, callback=_check_layers,
                        help="'all' or a comma list of layer indices [all].")(f)


def _model_opts(f):
    f = click.option("--steps", type=click.IntRange(min=1), default=None,
                     help=f"Teacher-forced decode steps at the end of the text [{FULL['steps']}].")(f)
    return click.option("--greedy-tokens", type=click.IntRange(min=1), default=None,
                        help=f"Greedy tokens for the exact-match length [{FULL['greedy_tokens']}].")(f)


def _retrieval_opts(f):
    f = click.option("--lengths", type=OPTION_TYPES["lengths"], default=None,
                     help=f"Prompt lengths in tokens, each within the model's context [{FULL['lengths']}].")(f)
    f = click.option("--depths", type=OPTION_TYPES["depths"], default=None,
                     help=f"Needle depths in [0,1] [{FULL['depths']}].")(f)
    f = click.option("--needles", type=click.IntRange(min=1), default=None,
                     help=f"Codes per (length, depth) [{FULL['needles']}].")(f)
    return click.option("--answer-tokens", type=click.IntRange(min=1), default=None,
                        help=f"Greedy answer tokens [{FULL['answer_tokens']}].")(f)


def _run(which, small, json_path, md_path, plot_path, **given):
    cfg = resolve_config(small, **given)
    run_and_report(cfg, which, json_path, md_path, plot_path)


@click.group("eval")
def eval_command():
    """Accuracy of SANTA attention against dense: kernel error, model KL/perplexity, retrieval."""


@eval_command.command("kernel")
@_common
@_text
@_kernel_opts
def eval_kernel(**kw):
    """Relative L2 error of the attention output on captured real q/K/V, per layer."""
    _run(["kernel"], **kw)


@eval_command.command("model")
@_common
@_text
@_model_opts
def eval_model(**kw):
    """Teacher forcing: KL(dense || santa), top-1 agreement, perplexity, greedy exact match."""
    _run(["model"], **kw)


@eval_command.command("retrieval")
@_common
@_retrieval_opts
def eval_retrieval(**kw):
    """Passcode-in-a-haystack retrieval success for dense and each setting."""
    _run(["retrieval"], **kw)


@eval_command.command("merge")
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path,
              help="Write the merged results as JSON.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path,
              help="Also write the Markdown report to a file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path,
              help="Write a PNG plot (needs matplotlib).")
def eval_merge(files, json_path, md_path, plot_path):
    """Merge the --json files of runs split by setting (e.g. by --budgets) into one report."""
    parts = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                part = json.load(f)
        except (OSError, ValueError) as exc:          # ValueError: bad JSON or not UTF-8
            raise click.ClickException(f"cannot read {path}: {exc}") from None
        if not isinstance(part, dict) or not isinstance(part.get("config"), dict):
            raise click.ClickException(f"{path} is not the --json output of an eval run (no 'config' object)")
        parts.append(part)
    try:
        results = merge_results(parts)
    except (ValueError, KeyError, TypeError) as exc:
        raise click.ClickException(f"cannot merge {', '.join(files)}: {exc}") from None
    write_report(results, json_path, md_path, plot_path)


@eval_command.command("all")
@_common
@_text
@_kernel_opts
@_model_opts
@_retrieval_opts
def eval_all(**kw):
    """kernel, model and retrieval with one model load."""
    _run(["kernel", "model", "retrieval"], **kw)


# `eval ruler` lives in evaluate_ruler.py, which adds itself to eval_command (either import order works)
import evaluate_ruler  # noqa: E402,F401

"""The three evaluations (kernel errors on captured inputs, teacher-forced model metrics, passcode
retrieval) and the Session that loads a model and runs them for one configuration.
"""

from __future__ import annotations

import sys
import time

import click
import numpy as np

from santa_cupy.cli.evaluation.config import EvalConfig, check_lengths_fit, retrieval_cap, select_layers
from llama_min.model import key_read_fraction
from santa_cupy.cli.evaluation.decoding import AttentionRecorder, clone_cache, make_stepper, pick_device, prefilled_cache, to_host
from santa_cupy.cli.evaluation.metrics import exact_attention, exact_lse, exact_match_length, kl_from_logits, perplexity, relative_l2, retrieval_success, seed_bias, token_nll, top1_agreement
from santa_cupy.cli.evaluation.report import write_report
from santa_cupy.cli.evaluation.settings import DENSE, run_setting, settings_grid
from santa_cupy.cli.evaluation.texts import long_text_ids, passcode, retrieval_prompt_ids


def _progress(length: int, label: str):
    return click.progressbar(length=length, label=label, file=sys.stderr, show_pos=True)


def capture_attention_inputs(model, ids) -> dict[int, tuple]:
    """Dense prefill of ids[:-1], one dense decode of ids[-1]; -> {layer: (q, k, v, lengths)}."""
    cache = prefilled_cache(model, ids[:-1], len(ids))
    rec = AttentionRecorder()
    model.decode(np.asarray([ids[-1]], np.int64), cache, DENSE, attention_hook=rec)
    return rec.calls


def kernel_errors(captured, layers, settings, seeds, block_n=None, progress=None) -> dict:
    """Relative L2 error per (setting, seed, layer) against float64 exact attention.

    Also the "dense" setting: santa_cupy's dense path (kernel on GPU, reference on CPU) in the
    storage dtype, i.e. the floor set by the dtype. Returns {label: {"setting", "per_seed":
    [{"seed", "layers": {layer: err}, "mean": err}]}}.

    A key-sampling setting (NumPy only) adds "key_fraction" (K read, mean over layers) to each seed
    and a "key" entry over the seeds, the bias of softmax of noisy scores as
    tools/key_sampling_study.py measures it: "lse_bias" = E[lse(s_hat)] - lse(s) in nats (mean over
    heads and layers; >= 0 by Jensen for unbiased scores), "output_bias" = ||E o_hat - o|| / ||o||
    with the seed noise subtracted (metrics.seed_bias; mean over layers; needs several seeds to
    separate bias from noise), "bias_share" = sum bias^2 / sum MSE and "key_fraction"."""
    import santa_cupy
    from santa_cupy import spec

    exact, lse_exact = {}, {}
    for li in layers:
        q, kc, vc, lens = captured[li]
        n = int(to_host(lens)[0])
        exact[li] = exact_attention(to_host(spec.to_float32(q)), to_host(spec.to_float32(kc[:, :n])),
                                    to_host(spec.to_float32(vc[:, :n])), n)
        if any(st.key_sampled for st in settings):
            lse_exact[li] = exact_lse(to_host(spec.to_float32(q)), to_host(spec.to_float32(kc[:, :n])), n)
    out = {}
    # the one-pass budget needs the previous step's lse of each layer, which one captured step has
    # not: it is measured by eval model and eval retrieval only
    for st in [DENSE] + [st for st in settings if st.budget != spec.ONE_PASS]:
        per_seed = []
        keyed = st.key_sampled
        outs = {li: [] for li in layers}                              # key sampling: o and lse per seed
        lses = {li: [] for li in layers}
        for seed in ([0] if st.method == "dense" and not keyed else seeds):
            errs, fractions = {}, []
            for li in layers:
                q, kc, vc, lens = captured[li]
                call = run_setting(st, seed, block_n)   # SANTA at every length, as eval model runs it
                if keyed:
                    o, info = santa_cupy.decode_attention(q, kc, vc, lens, call, layer=li, return_info=True)
                    fractions.append(float(np.mean(info.key_fraction)))       # batch 1: one sequence
                    outs[li].append(to_host(spec.to_float32(o)).astype(np.float64))
                    lses[li].append(np.asarray(info.lse, np.float64))
                else:
                    o = santa_cupy.decode_attention(q, kc, vc, lens, call, layer=li)
                errs[li] = relative_l2(to_host(spec.to_float32(o)), exact[li])
                if progress is not None:
                    progress.update(1)
            row = {"seed": int(seed), "layers": errs, "mean": float(np.mean(list(errs.values())))}
            if keyed:
                row["key_fraction"] = float(np.mean(fractions))
            per_seed.append(row)
        out[st.label] = {"setting": st.as_dict(), "per_seed": per_seed}
        if keyed:
            out[st.label]["key"] = _key_bias(outs, lses, exact, lse_exact, per_seed)
    return out


def _key_bias(outs, lses, exact, lse_exact, per_seed) -> dict:
    """kernel_errors' "key" entry of a key-sampling setting (its docstring)."""
    biases = {li: seed_bias(outs[li], exact[li]) for li in outs}
    b2, m2 = sum(b[1] for b in biases.values()), sum(b[2] for b in biases.values())
    return {"key_fraction": float(np.mean([p["key_fraction"] for p in per_seed])),
            "lse_bias": float(np.mean([(np.mean(lses[li], axis=0) - lse_exact[li]).mean() for li in lses])),
            "output_bias": float(np.mean([b[0] for b in biases.values()])),
            "bias_share": float(b2 / m2) if m2 > 0 else 0.0,
            "seeds": len(per_seed)}


def teacher_forced(model, cache0, ids, prefix: int, attention, key_reads=None) -> np.ndarray:
    """Logits [len(ids)-1-prefix, V] predicting ids[prefix+1:], decoding ids[prefix:-1] one at a
    time (true tokens fed) on a copy of cache0 (the dense prefill of ids[:prefix]). If `key_reads`
    is a list, the mean fraction of K read over the run's steps and layers is appended (1.0
    without key sampling)."""
    cache = clone_cache(model, cache0)
    with make_stepper(model, cache, attention) as step:
        logits = np.stack([step(int(t)) for t in ids[prefix:-1]])
    if key_reads is not None:
        key_reads.append(key_read_fraction(cache))
    return logits


def greedy_tokens(model, cache0, first: int, n: int, attention, stop_ids=(), margins=None,
                  key_reads=None) -> list[int]:
    """Greedy continuation: feed `first`, then each argmax; n tokens (fewer on a stop id).
    If `margins` is a list, the top-1 minus top-2 log-probability of every step is appended;
    if `key_reads` is a list, the mean fraction of K read (teacher_forced's)."""
    out, tok = [], int(first)
    cache = clone_cache(model, cache0)
    with make_stepper(model, cache, attention) as step:
        for _ in range(n):
            lg = step(tok)
            tok = int(np.argmax(lg))
            if margins is not None:
                top2 = np.partition(lg.astype(np.float64), -2)[-2:]
                margins.append(float(top2[1] - top2[0]))
            out.append(tok)
            if tok in stop_ids:
                break
    if key_reads is not None:
        key_reads.append(key_read_fraction(cache))
    return out


def model_metrics(model, ids, prefix: int, settings, seeds, greedy_n: int, block_n=None,
                  progress=None) -> dict:
    """Teacher-forced KL / top-1 / perplexity and greedy exact-match length per setting and seed."""
    ids = [int(t) for t in ids]
    targets = np.asarray(ids[prefix + 1:])
    cache0 = prefilled_cache(model, ids[:prefix], max(len(ids), prefix + 1 + greedy_n) + 1)
    dense_logits = teacher_forced(model, cache0, ids, prefix, run_setting(DENSE, 0, block_n))
    margins: list[float] = []
    dense_greedy = greedy_tokens(model, cache0, ids[prefix], greedy_n, run_setting(DENSE, 0, block_n),
                                 margins=margins)
    if progress is not None:
        progress.update(1)
    out = {"dense": {"setting": DENSE.as_dict(), "per_seed": [{
        "seed": 0, "kl": 0.0, "top1": 1.0, "ppl": perplexity(token_nll(dense_logits, targets)),
        "greedy_match": len(dense_greedy)}]}}
    for st in settings:
        per_seed = []
        for seed in seeds:
            att = run_setting(st, int(seed), block_n)
            reads = [] if st.key_sampled else None
            lg = teacher_forced(model, cache0, ids, prefix, att, key_reads=reads)
            gr = greedy_tokens(model, cache0, ids[prefix], greedy_n, att)
            per_seed.append({"seed": int(seed),
                             "kl": float(kl_from_logits(dense_logits, lg).mean()),
                             "top1": float(top1_agreement(dense_logits, lg).mean()),
                             "ppl": perplexity(token_nll(lg, targets)),
                             "greedy_match": exact_match_length(dense_greedy, gr)})
            if reads is not None:
                per_seed[-1]["key_fraction"] = reads[0]     # of the teacher-forced steps
            if progress is not None:
                progress.update(1)
        out[st.label] = {"setting": st.as_dict(), "per_seed": per_seed}
    return {"steps": len(targets), "prefix": prefix, "greedy_tokens": greedy_n,
            "dense_greedy": dense_greedy, "dense_greedy_margins": margins, "results": out}


def retrieval_trials(model, tok, lengths, depths, needles, settings, seeds, answer_tokens: int,
                     block_n=None, progress=None) -> dict:
    """Greedy answers to the passcode question per (setting, seed, length, depth, needle)."""
    stop = set(getattr(tok, "eos_ids", []) or []) | set(np.atleast_1d(model.cfg.eos_token_id).tolist())
    runs = [(DENSE, 0)] + [(st, int(s)) for st in settings for s in seeds]
    out = {st.label: {"setting": st.as_dict(), "trials": []} for st, _ in runs}
    for L in lengths:
        for d in depths:
            for r in range(needles):
                code = passcode(L, d, r)
                ids = retrieval_prompt_ids(tok, L, d, code)
                cache0 = prefilled_cache(model, ids[:-1], len(ids) + answer_tokens + 1)
                for st, seed in runs:
                    reads = [] if st.key_sampled else None
                    ans = greedy_tokens(model, cache0, ids[-1], answer_tokens,
                                        run_setting(st, seed, block_n), stop, key_reads=reads)
                    text = tok.decode(ans)
                    out[st.label]["trials"].append({
                        "length": L, "tokens": len(ids), "depth": d, "needle": r, "seed": seed,
                        "code": code, "answer": text, "success": retrieval_success(text, code)})
                    if reads is not None:
                        out[st.label]["trials"][-1]["key_fraction"] = reads[0]
                    if progress is not None:
                        progress.update(1)
    return out



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
        if self.device != "cpu" and any(st.key_sampled for st in cfg.extra):
            raise click.UsageError("key sampling (--keys, or a --setting with /keys=) runs on the NumPy reference "
                                   "only so far: add --device cpu")
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
        self.settings = session_settings(cfg)

    def header(self) -> dict:
        c = self.cfg
        h = {"model": str(self.path), "device": self.device, "kv_dtype": self.model.kv_dtype,
             "samplers": c.samplers, "budgets": c.budgets, "samples": c.samples, "seeds": c.seeds,
             "block_n": c.block_n, "small": c.small}
        if c.extra or not c.grid:                   # only then: the header of other runs stays as it was
            h["settings"] = [st.label for st in c.extra]
            h["grid"] = c.grid
        if not c.grid:                              # --no-grid: no sampler x budget x S ran
            h["samplers"], h["budgets"], h["samples"] = [], [], []
        return h

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



def session_settings(cfg: EvalConfig) -> list:
    """The settings under test: the sampler x budget x S grid (unless --no-grid), then the
    --setting / --keys ones not already in it (dense itself is always run first)."""
    grid = settings_grid(cfg.samplers, cfg.budgets, cfg.samples) if cfg.grid else []
    return grid + [st for st in cfg.extra if st not in grid and st != DENSE]


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


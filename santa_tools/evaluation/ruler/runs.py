"""Running RULER samples: the --settings labels, and greedy answers per (setting, seed) from one
dense prefill per sample.
"""

from __future__ import annotations

import time

import click
import numpy as np

from santa_cupy.setting import AttentionSetting
from santa_tools.evaluation.decoding import clone_cache, make_stepper, prefilled_cache
from santa_tools.evaluation.settings import DENSE, run_setting
from santa_tools.evaluation.ruler.data import prompt_text
from santa_tools.evaluation.ruler.scoring import score, task_family
from santa_tools.evaluation.ruler.tasks import TOKENS_TO_GENERATE


def parse_setting(label: str) -> AttentionSetting:
    """'dense' or a setting's name 'sampler/budget/S=N' (e.g. systematic/global/S=256):
    santa_cupy.AttentionSetting.parse, the seeds and tile size being options of their own."""
    try:
        setting = AttentionSetting.parse(label)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="'--settings'") from None
    if setting == DENSE:
        return DENSE
    if str(setting).count("/") != 2 or setting.method != "santa":
        raise click.BadParameter(f"{label!r} is not 'dense' or sampler/budget/S=N (e.g. systematic/global/S=256; "
                                 "the seeds are --seeds)", param_hint="'--settings'")
    return setting


class SettingList(click.ParamType):
    name = "settings"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        out = [parse_setting(x) for x in str(value).split(",") if x.strip()]
        if not out:
            self.fail("no settings given", param, ctx)
        return list(dict.fromkeys(out))


# ============================================================================ running


def greedy_answer(model, tok, cache0, first: int, n: int, attention, stop_ids=(), done=None):
    """Greedy tokens from a copy of cache0 (decoding.make_stepper); stops at a stop id, after n
    tokens, or once done(text so far) is true. -> (tokens, text)."""
    out, t = [], int(first)
    with make_stepper(model, clone_cache(model, cache0), attention) as step:
        for _ in range(n):
            t = int(np.argmax(step(t)))
            if t in stop_ids:
                break
            out.append(t)
            if done is not None and done(tok.decode(out)):
                break
    return out, tok.decode(out)


def run_samples(model, tok, samples, runs, max_new=None, full=False, block_n=None, progress=None,
                log=False, time_limit=None) -> list:
    """Every sample (dense prefill once) x every (setting, seed) of runs -> per-run records
    (log: one line per sample on stderr; time_limit: seconds after which no sample starts)."""
    stop = set(getattr(tok, "eos_ids", []) or []) | set(np.atleast_1d(model.cfg.eos_token_id).tolist())
    P = int(model.cfg.max_position_embeddings)
    out = []
    start = time.perf_counter()
    for k, rec in enumerate(samples):
        if k and time_limit is not None and time.perf_counter() - start > time_limit:
            click.echo(f"\n--time-limit {time_limit:g} s: {k} of {len(samples)} samples run", err=True)
            break
        ids = tok.encode(prompt_text(rec))
        n = max_new or TOKENS_TO_GENERATE[task_family(rec["task"])]
        n = min(n, P - len(ids) + 1)           # RULER's FWE can overshoot its length: a shorter answer
        if n < 1 or len(ids) < 2:
            click.echo(f"\nskipping {rec['task']} #{rec['index']} at {rec['max_seq_length']}: {len(ids)} prompt "
                       f"tokens leave no room for an answer in the model's {P} positions", err=True)
            if progress is not None:
                progress.update(len(runs))
            continue
        t0 = time.perf_counter()
        cache0 = prefilled_cache(model, ids[:-1], len(ids) + n - 1)
        if model.xp is not np:                 # CuPy runs asynchronously: the prefill's own time
            model.xp.cuda.Device().synchronize()
        prefill_s = time.perf_counter() - t0
        refs = rec["outputs"]
        done = None if full else (lambda text, task=rec["task"], refs=refs: score(task, text, refs) >= 1.0)
        for st, seed in runs:
            t = time.perf_counter()
            toks, text = greedy_answer(model, tok, cache0, ids[-1], n, run_setting(st, seed, block_n), stop, done)
            out.append({"task": rec["task"], "max_seq_length": rec["max_seq_length"], "index": rec["index"],
                        "setting": st.label, "seed": seed, "prompt_tokens": len(ids), "max_new_tokens": n,
                        "new_tokens": len(toks), "pred": text, "outputs": refs,
                        "score": score(rec["task"], text, refs), "prefill_s": round(prefill_s, 3),
                        "decode_s": round(time.perf_counter() - t, 3)})
            prefill_s = 0.0                                    # counted once per sample
            if progress is not None:
                progress.update(1)
        del cache0
        if log:                                    # a log file or pipe: one line per sample
            mine = out[-len(runs):]
            click.echo(f"{rec['task']} #{rec['index']} L={rec['max_seq_length']} ({len(ids)} tokens): prefill "
                       f"{mine[0]['prefill_s']:.1f} s; " + "; ".join(map(_run_note, mine)), err=True)
    return out


def _run_note(r: dict) -> str:
    who = r["setting"] if r["setting"] == "dense" else f"{r['setting']} seed {r['seed']}"
    return f"{who} {r['score']:.2f} ({r['new_tokens']} tok, {r['decode_s']:.1f} s)"


"""Running RULER samples: the --settings labels, the CPU (eager) and GPU (captured step) decoders,
greedy answers per (setting, seed) from one dense prefill per sample, and the pacing lines.
"""

from __future__ import annotations

import time

import click
import numpy as np

from santa_cupy.setting import AttentionSetting
from santa_cupy.cli.evaluation.decoding import (GraphGreedy, clone_cache, eager_greedy, greedy_together, load_prefill,
                                             prefill_chunk, prefilled_cache)
from santa_cupy.cli.evaluation.settings import DENSE, run_setting
from santa_cupy.cli.evaluation.ruler.data import prompt_text
from santa_cupy.cli.evaluation.ruler.scoring import score, task_family
from santa_cupy.cli.evaluation.ruler.tasks import TOKENS_TO_GENERATE


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

CAPACITY_STEP = 1024


def cache_capacity(rows: int, positions: int) -> int:
    """The KV cache capacity of a sample that needs `rows` rows (prefill + answer): rows rounded up
    to a multiple of CAPACITY_STEP, at most the model's positions. Samples of about one length then
    share one cache and its captured steps (GPU), and it is a function of the sample alone, so a run
    split into parts decodes every sample as the whole run would (the GPU's split of the attention
    depends on the capacity)."""
    return max(int(rows), min(int(positions), -(-int(rows) // CAPACITY_STEP) * CAPACITY_STEP))


class EagerDecoder:
    """The CPU's decoding (and the GPU's with --eager): a dense prefill per sample, then each
    setting decodes eagerly from a copy of it, one after the other."""

    def __init__(self, model):
        self.model, self.cache0, self.setup_s = model, None, 0.0

    def prefill(self, ids, capacity: int):
        self.cache0 = prefilled_cache(self.model, ids, capacity, prefill_chunk(self.model, len(ids)))

    def answers(self, attentions, first, n, stop_ids, done) -> list:
        """[(tokens, seconds)] per attention config."""
        out = []
        for att in attentions:
            t = time.perf_counter()
            toks = eager_greedy(self.model, clone_cache(self.model, self.cache0), first, n, att, stop_ids, done)
            out.append((toks, time.perf_counter() - t))
        return out

    def close(self):
        self.cache0 = None


class GraphDecoders:
    """The GPU's decoding: the sample's dense prefill into one cache per capacity (cache_capacity),
    and per (capacity, setting, seed) one GraphGreedy (a captured decode step ending in the greedy
    device sampler) on a cache of its own, captured at its first sample and replayed for every
    later one; the prefill's rows are copied into its cache in place (load_prefill) before each
    sample. The settings of a sample decode side by side (greedy_together: each on its own stream,
    their steps queued together every token). setup_s: seconds spent capturing."""

    def __init__(self, model):
        self.model, self.caches, self.by_key, self.setup_s = model, {}, {}, 0.0
        self.cache, self.n0, self.capacity = None, 0, None

    @property
    def graphs(self) -> int:
        return len(self.by_key)

    def prefill(self, ids, capacity: int):
        cache = self.caches.get(capacity)
        if cache is None:
            cache = self.caches[capacity] = self.model.new_cache(1, capacity)
        cache.reset()
        chunk = prefill_chunk(self.model, len(ids))
        self.model.prefill(np.asarray(ids, np.int64)[None], cache, **({} if chunk is None else {"chunk": chunk}))
        self.cache, self.n0, self.capacity = cache, len(ids), capacity

    def _decoder(self, attention) -> GraphGreedy:
        key = (self.capacity, attention)
        g = self.by_key.get(key)
        if g is not None:
            load_prefill(g.cache, self.cache, self.n0)
            return g
        t = time.perf_counter()
        c = self.model.new_cache(1, self.capacity)
        load_prefill(c, self.cache, self.n0)
        g = self.by_key[key] = GraphGreedy(self.model, c, attention)
        self.setup_s += time.perf_counter() - t
        return g

    def answers(self, attentions, first, n, stop_ids, done) -> list:
        """[(tokens, seconds from the start to that setting's last token)] per attention config."""
        decs = [self._decoder(a) for a in attentions]
        return greedy_together(decs, self.n0, first, n, stop_ids, done)

    def close(self):
        for g in self.by_key.values():
            g.close()
        self.by_key.clear()
        self.caches.clear()


def record_key(r: dict) -> tuple:
    """What identifies a run's record: (task, length, sample index, setting, seed)."""
    return (str(r["task"]), int(r["max_seq_length"]), int(r["index"]), str(r["setting"]), int(r["seed"]))


def first_round(samples) -> int:
    """Samples in the first round of the sample-major order: one of every (task, length)."""
    return len({(r["task"], int(r["max_seq_length"])) for r in samples})


def run_samples(model, tok, samples, runs, max_new=None, full=False, block_n=None, progress=None,
                log=False, time_limit=None, graph=None, skip_keys=(), max_samples=None, pacer=None,
                checkpoint=None) -> list:
    """Every sample (dense prefill once) x every (setting, seed) of runs -> per-run records.
    log: one line per sample on stderr; time_limit: seconds after which no sample starts;
    graph: decode through captured steps (GraphDecoders; None: on the GPU); skip_keys: record_key()s
    already run (--resume: left out; a sample with all of them is not even prefilled); max_samples:
    stop after running this many; pacer: a Pacer told of every sample run; checkpoint(records so
    far): called after every sample run."""
    stop = set(getattr(tok, "eos_ids", []) or []) | set(np.atleast_1d(model.cfg.eos_token_id).tolist())
    P = int(model.cfg.max_position_embeddings)
    gpu = model.xp is not np
    skip_keys = set(skip_keys)
    dec = (GraphDecoders if (gpu if graph is None else graph) else EagerDecoder)(model)
    out = []
    start = time.perf_counter()
    started = 0
    try:
        for rec in samples:
            todo = [(st, seed) for st, seed in runs
                    if record_key({**rec, "setting": st.label, "seed": seed}) not in skip_keys]
            if not todo:
                if progress is not None:
                    progress.update(len(runs))
                continue
            if started and time_limit is not None and time.perf_counter() - start > time_limit:
                click.echo(f"\n--time-limit {time_limit:g} s: {started} samples run, the rest left for "
                           "--resume", err=True)
                break
            if max_samples is not None and started >= max_samples:
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
            started += 1
            setup0 = dec.setup_s
            t0 = time.perf_counter()
            dec.prefill(ids[:-1], cache_capacity(len(ids) - 1 + n, P))
            if gpu:                                # CuPy runs asynchronously: the prefill's own time
                model.xp.cuda.Device().synchronize()
            prefill_s = time.perf_counter() - t0
            refs = rec["outputs"]
            done = None if full else (
                lambda toks, task=rec["task"], refs=refs: score(task, tok.decode(toks), refs) >= 1.0)
            mine = []
            answers = dec.answers([run_setting(st, seed, block_n) for st, seed in todo], ids[-1], n, stop, done)
            for (st, seed), (toks, secs) in zip(todo, answers):
                text = tok.decode(toks)
                mine.append({"task": rec["task"], "max_seq_length": rec["max_seq_length"], "index": rec["index"],
                             "setting": st.label, "seed": seed, "prompt_tokens": len(ids), "max_new_tokens": n,
                             "new_tokens": len(toks), "pred": text, "outputs": refs,
                             "score": score(rec["task"], text, refs), "prefill_s": round(prefill_s, 3),
                             "decode_s": round(secs, 3)})
                prefill_s = 0.0                                    # counted once per sample
            if progress is not None:
                progress.update(len(runs))
            out += mine
            if log:                                    # a log file or pipe: one line per sample
                click.echo(f"{rec['task']} #{rec['index']} L={rec['max_seq_length']} ({len(ids)} tokens): prefill "
                           f"{mine[0]['prefill_s']:.1f} s; " + "; ".join(map(_run_note, mine)), err=True)
            if pacer is not None:
                pacer.sample(dec.setup_s - setup0)
            if checkpoint is not None:
                checkpoint(out)
    finally:
        dec.close()
    return out


# ============================================================================ pacing


def _clock_at(seconds_from_now: float, now: float | None = None) -> str:
    t = (time.time() if now is None else now) + seconds_from_now
    return time.strftime("%H:%M UTC", time.gmtime(t))


def progress_line(done: int, total: int, elapsed: float, setup_s: float = 0.0, time_limit=None,
                  now: float | None = None) -> str:
    """'progress: done/total samples (p%) in E s, R s a sample; ETA S s (HH:MM UTC)[; time limit]'.
    R leaves out setup_s (one-off graph captures); the ETA is the remaining samples at R."""
    rate = max(elapsed - setup_s, 0.0) / max(done, 1)
    left = (total - done) * rate
    line = (f"progress: {done}/{total} samples ({100 * done / max(total, 1):.0f}%) in {elapsed:.0f} s, "
            f"{rate:.2f} s a sample; ETA {left:.0f} s ({_clock_at(left, now)})")
    if time_limit is not None and done < total:
        more = max(0, int((time_limit - elapsed) // rate) + 1) if rate > 0 and elapsed <= time_limit else 0
        more = min(more, total - done)
        line += f"; --time-limit {time_limit:g}: ~{more} more in this part"
    return line


def estimate_line(done: int, total: int, elapsed: float, setup_s: float = 0.0, time_limit=None) -> str:
    """The plan of a run from its first `done` samples (a first round: one of every task and length)."""
    rate = max(elapsed - setup_s, 0.0) / max(done, 1)
    whole = total * rate
    line = (f"estimate: {done} samples (one of every task and length) in {elapsed:.1f} s: {rate:.2f} s a sample"
            + (f" (+ {setup_s:.1f} s of graph capture, once per cache size and setting)" if setup_s else "")
            + f"; all {total} samples ~{whole:.0f} s ({whole / 60:.1f} min)")
    if time_limit and rate > 0:
        per = max(1, int(time_limit // rate) + 1)
        line += f"; --time-limit {time_limit:g}: ~{per} samples a part, {-(-total // per)} parts"
    return line


class Pacer:
    """Tells the user how a long run goes: the estimate once the first round (one sample of every
    task and length) is done, then a progress line every `every` samples (elapsed, seconds a
    sample, ETA). total: the samples this run is to run; echo: where the lines go (stderr)."""

    def __init__(self, total: int, first: int, every: int = 10, time_limit=None, echo=None,
                 clock=time.perf_counter):
        self.total, self.first, self.every, self.time_limit = int(total), int(first), int(every), time_limit
        self.echo = echo or (lambda line: click.echo(line, err=True))
        self.clock, self.start = clock, clock()
        self.done, self.setup_s = 0, 0.0
        self.estimate = None                        # the estimate line, once made

    def sample(self, setup_s: float = 0.0):
        self.done += 1
        self.setup_s += setup_s
        elapsed = self.clock() - self.start
        if self.done == min(self.first, self.total):
            self.estimate = estimate_line(self.done, self.total, elapsed, self.setup_s, self.time_limit)
            self.echo(self.estimate)
        elif self.every and self.done % self.every == 0 and self.done < self.total:
            self.echo(progress_line(self.done, self.total, elapsed, self.setup_s, self.time_limit))


def _run_note(r: dict) -> str:
    who = r["setting"] if r["setting"] == "dense" else f"{r['setting']} seed {r['seed']}"
    return f"{who} {r['score']:.2f} ({r['new_tokens']} tok, {r['decode_s']:.1f} s)"


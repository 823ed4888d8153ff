"""The ``eval ruler`` click command: generate or read the data, run the settings, report.
"""

from __future__ import annotations

import os
import sys
import time

import click

from llama_min.commands import check_output_path
from santa_cupy.cli.evaluation.commands import _block_ns
from santa_cupy.cli.evaluation.config import OPTION_TYPES, CommaList
from santa_cupy.cli.evaluation.decoding import pick_device
from santa_cupy.cli.evaluation.runs import _progress
from santa_cupy.cli.evaluation.settings import DENSE
from santa_cupy.cli.evaluation.ruler.data import _select, data_files, read_jsonl, read_record, write_jsonl
from santa_cupy.cli.evaluation.ruler.generation import _pkg_version, check_package, generate_task, sentence_splitter
from santa_cupy.cli.evaluation.ruler.report import (CHECKPOINT_EVERY, check_same, combine_runs, merge_runs, read_run,
                                                write_checkpoint, write_report)
from santa_cupy.cli.evaluation.ruler.runs import Pacer, SettingList, first_round, record_key, run_samples
from santa_cupy.cli.evaluation.ruler.summary import summarize, timings
from santa_cupy.cli.evaluation.ruler.tasks import DATA_SEED, DEFAULT_LENGTHS, DEFAULT_SETTINGS, PACKAGE, STANDARD_TASKS


@click.command("ruler")
@click.option("--model", default=None, metavar="PATH|NAME",
              help="Checkpoint directory, .gguf or cached model name (default: SmolLM2-135M-Instruct).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="KV/attention dtype (default: float32 on CPU, float16 on GPU).")
@click.option("--data", "data", multiple=True, type=click.Path(exists=True),
              help="RULER jsonl (or .jsonl.gz / .jsonl.xz) files, or a directory of them, to run instead of "
                   "generating (repeatable; task from a 'task' field or the file name <task>[_<length>].jsonl "
                   "or <task>/validation.jsonl).")
@click.option("--tasks", type=CommaList(click.Choice(STANDARD_TASKS)), default=None,
              help="Comma list of RULER tasks [all 13 standard tasks].")
@click.option("--lengths", type=OPTION_TYPES["lengths"], default=None,
              help="max_seq_length of the generated samples (prompt + answer tokens) [4096,8192].")
@click.option("--samples", "n_samples", type=click.IntRange(min=1), default=None,
              help="Samples per task and length [generation: 50; --data: every record].")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave out the first N samples of every task and length (with --samples: a slice, to split "
                   "a run into parts for --merge).")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None,
              help="Start no sample after this many seconds of running the model; report those done "
                   "(samples run in sample-major order, so every task has about as many); --resume the rest.")
@click.option("--resume", "resume_path", type=click.Path(exists=True, dir_okay=False), default=None,
              metavar="FILE.json",
              help="Keep the records of an earlier run's --json file (same model, dtype, options) and run "
                   "only the (task, length, sample, setting, seed) it lacks; --json then holds both.")
@click.option("--estimate", is_flag=True,
              help="Run one sample of every task and length only, print the time a sample and what the "
                   "whole run would take (and its parts under --time-limit); --json keeps them for --resume.")
@click.option("--progress-every", type=click.IntRange(min=0), default=10, show_default=True, metavar="N",
              help="A progress line (elapsed, seconds a sample, ETA) every N samples (0: none).")
@click.option("--eager", is_flag=True,
              help="GPU: decode with eager steps and host argmax instead of the captured step and the "
                   "device sampler (the same tokens, slower; to check).")
@click.option("--settings", type=SettingList(), default=",".join(DEFAULT_SETTINGS), show_default=True,
              help="Comma list: 'dense' or sampler/budget/S=N (dense always runs).")
@click.option("--seeds", type=OPTION_TYPES["seeds"], default="0", show_default=True,
              help="Comma list of SANTA seeds (dense runs once).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate for every task [RULER's per task: NIAH 128, VT 30, CWE 120, FWE 50, QA 32].")
@click.option("--full-answers", is_flag=True,
              help="Decode every token even after the score reached 1 (same scores, slower).")
@click.option("--data-seed", type=click.IntRange(min=0), default=DATA_SEED, show_default=True,
              help="Random seed of RULER's generators.")
@click.option("--save-data", type=click.Path(file_okay=False), default=None,
              help="Write the generated samples to DIR/<task>_<length>.jsonl.xz (for --data later).")
@click.option("--generate-only", is_flag=True, help="Generate (and --save-data) only; run no model.")
@click.option("--merge", "merge_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Instead of running: one report from the --json files of runs split by task, length or "
                   "setting (repeatable).")
@click.option("--block-n", type=click.Choice([str(b) for b in _block_ns()]), default=None,
              callback=lambda ctx, param, v: None if v is None else int(v),
              help="SANTA tile size (default: santa_cupy's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path,
              help="Write all raw results (every prediction) as JSON; while running, the records so far "
                   "every 10 samples (a partial part that --resume and --merge take).")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path, help="Also write the Markdown report to a file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path, help="Write a PNG plot (needs matplotlib).")
def eval_ruler(model, device, dtype, data, tasks, lengths, n_samples, skip, time_limit, resume_path, estimate,
               progress_every, eager, settings, seeds, max_new_tokens, full_answers, data_seed, save_data,
               generate_only, merge_files, block_n, json_path, md_path, plot_path):
    """RULER's 13 tasks (NIAH, variable tracking, common/frequent words, QA) with dense and SANTA."""
    t0 = time.time()
    if merge_files:
        if data or generate_only or resume_path:
            raise click.UsageError("--merge reads finished runs: leave out --data, --generate-only and --resume")
        write_report(merge_runs(merge_files), json_path, md_path, plot_path)
        return
    if generate_only and data:
        raise click.UsageError("--generate-only generates data: leave out --data")
    if generate_only and not save_data:
        raise click.UsageError("--generate-only needs --save-data DIR")
    earlier = read_run(resume_path) if resume_path else None
    done_keys = {record_key(r) for r in earlier["records"]} if earlier else set()
    if data:                                  # files and package first: their errors need no model
        files = data_files(data)
        samples = [r for f in files for r in read_jsonl(f)]
        samples = _select(samples, tasks, lengths, n_samples, skip)
        if not samples:
            raise click.UsageError("no records of --data are left by --tasks / --lengths / --skip")
        source = "files " + ", ".join(os.path.basename(f) for f in files)
    else:
        check_package()
    from llama_min.models import resolve_model
    try:
        path = resolve_model(model, progress=True)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not data:
        tasks, lengths, n = tasks or list(STANDARD_TASKS), lengths or list(DEFAULT_LENGTHS), n_samples or 50
        from llama_min.config import load_config
        try:
            P = load_config(path).max_position_embeddings
        except (ValueError, OSError) as e:
            raise click.ClickException(str(e)) from None
        over = [L for L in lengths if L > P]
        if over:
            raise click.BadParameter(f"{', '.join(map(str, over))} beyond the model's context ({P} tokens)",
                                     param_hint="'--lengths'")
        samples = []
        for L in lengths:
            for t in tasks:
                tg = time.time()
                recs = generate_task(t, L, skip + n, path, data_seed)      # --skip leaves out the first
                click.echo(f"generated {t} at {L}: {len(recs)} samples in {time.time() - tg:.1f} s", err=True)
                if save_data:
                    os.makedirs(save_data, exist_ok=True)
                    write_jsonl(os.path.join(save_data, f"{t}_{L}.jsonl.xz"), recs)
                samples += recs
        source = (f"generated by {PACKAGE} {_pkg_version()} (seed {data_seed}, sentence splitter "
                  f"{sentence_splitter()}, tokenizer of the model)")
        if generate_only:
            click.echo(f"wrote {len(samples)} samples to {save_data}", err=True)
            return
        samples = _select([read_record(r) for r in samples], None, None, None, skip)
    settings = [DENSE] + [s for s in settings if s != DENSE]
    runs = [(DENSE, 0)] + [(s, int(seed)) for s in settings[1:] for seed in seeds]
    from llama_min.model import LlamaModel
    from llama_min.tokenizer import Tokenizer
    dev = pick_device(device)
    click.echo(f"loading {path} on {dev} ...", err=True)
    try:
        lm = LlamaModel.from_pretrained(path, device=dev, dtype=dtype)
        tok = Tokenizer.from_dir(path)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if earlier is not None:                  # before running: a mismatch would waste the run
        check_same(resume_path, {"model": str(path), "kv_dtype": lm.kv_dtype, "full_answers": full_answers,
                                 "block_n": block_n}, earlier["config"])
    pending = [r for r in samples
               if any(record_key({**r, "setting": st.label, "seed": sd}) not in done_keys for st, sd in runs)]
    if earlier is not None:
        click.echo(f"--resume {resume_path}: {len(earlier['records'])} records kept, {len(pending)} of "
                   f"{len(samples)} samples left to run", err=True)
    pacer = Pacer(len(pending), first_round(pending), progress_every, time_limit)
    labels = [s.label for s in settings]

    def make_config(partial: bool) -> dict:
        return {"model": str(path), "device": dev, "kv_dtype": lm.kv_dtype, "settings": labels,
                "setting_fields": {s.label: s.as_dict() for s in settings}, "seeds": list(seeds),
                "data": source, "samples_per_task": n_samples,
                "max_new_tokens": max_new_tokens or "RULER's per task", "full_answers": full_answers,
                "block_n": block_n, "decoder": "eager" if eager or dev == "cpu" else "graph",
                "samples_run": pacer.done, "samples_pending": len(pending) - pacer.done,
                "seconds": round(time.time() - t0, 2), **({"partial": True} if partial else {})}

    def checkpoint(recs):
        """Every CHECKPOINT_EVERY samples the --json file holds the records so far (and the resumed
        file's), a part that --resume and --merge take: a run killed from outside loses little."""
        if json_path and pacer.done % CHECKPOINT_EVERY == 0:
            part = {"config": make_config(True), "records": list(recs)}
            if earlier is not None:
                part = combine_runs([(resume_path, earlier), ("this run", part)])
                part["config"].update(partial=True, samples_pending=len(pending) - pacer.done)
            write_checkpoint(json_path, part)

    with _progress(len(pending) * len(runs), "eval ruler") as bar:
        records = run_samples(lm, tok, pending, runs, max_new_tokens, full_answers, block_n, bar,
                              log=not sys.stderr.isatty(), time_limit=time_limit, graph=False if eager else None,
                              skip_keys=done_keys, max_samples=first_round(pending) if estimate else None,
                              pacer=pacer, checkpoint=checkpoint)
    results = {"config": make_config(False), "summary": summarize(records, labels), "timings": timings(records),
               "records": records}
    if earlier is not None:
        results = combine_runs([(resume_path, earlier), ("this run", results)])
        results["config"]["samples_pending"] = len(pending) - pacer.done
    write_report(results, json_path, md_path, plot_path)


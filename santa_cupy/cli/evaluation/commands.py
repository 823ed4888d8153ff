"""The ``eval`` click group: ``eval kernel``, ``eval model``, ``eval retrieval``, ``eval merge`` and
``eval all`` with their shared options.
"""

from __future__ import annotations

import json

import click

from llama_min.commands import check_output_path
from santa_cupy.cli.evaluation.config import FULL, OPTION_TYPES, SMALL, SettingName, _csv, resolve_config
from santa_cupy.cli.evaluation.report import merge_results, write_report
from santa_cupy.cli.evaluation.runs import run_and_report


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
        click.option("--setting", "settings", type=SettingName(), multiple=True, metavar="NAME",
                     help="An extra setting by name, after the grid's (repeatable), e.g. "
                          "'systematic/global/S=256/keys=block:FB=16,f=0.875' (key sampling: CPU only)."),
        click.option("--keys", type=SettingName("dense/keys="), multiple=True, metavar="SPEC",
                     help="Key (score-stage) sampling with the dense value stage, i.e. --setting "
                          "dense/keys=SPEC (repeatable): block:FB=16|32,f=FRACTION|v=VARIANCE[,R=N][,rule=R]"
                          "[,combine=mean|union] or bernoulli:R=N[,combine=C]. Reports the K fraction read "
                          "and (eval kernel) the lse and output bias. CPU only."),
        click.option("--no-grid", is_flag=True,
                     help="Only dense and the --setting / --keys settings (no sampler x budget x S grid)."),
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


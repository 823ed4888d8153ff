"""``santa-cupy generate`` (and the ``models`` group re-exported for santa_cupy/cli/main.py).

Text mode streams the generated text to stdout; JSON mode prints exactly one JSON object to
stdout. Progress and timings go to stderr.
"""

from __future__ import annotations

import codecs
import json
import os
import sys

import click

from llama_min.models_cli import models  # noqa: F401  (santa_cupy/cli/main.py imports it from here)
from santa_cupy.paged import DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE
from santa_cupy.spec import BUDGETS, MAX_SAMPLES, SAMPLERS


def _pick_device(device: str) -> str:
    if device != "auto":
        return device
    try:
        from llama_min.model import _import_cupy
        _import_cupy()
        return "gpu"
    except RuntimeError:
        return "cpu"


def _log(msg):
    click.echo(msg, err=True)


def _check_encoding(ctx, param, value):
    try:
        return codecs.lookup(value).name
    except LookupError:
        raise click.BadParameter(f"unknown text encoding {value!r}") from None


def check_output_path(ctx, param, value):
    """Callback of an output file option (--json, --markdown, --plot): a one-line usage error
    (exit 2) when the file cannot be written, before a run whose results it was to hold."""
    if value is None:
        return value
    parent = os.path.dirname(os.path.abspath(value))
    if not os.path.isdir(parent):
        raise click.BadParameter(f"cannot write {click.format_filename(value)}: no directory {parent}")
    if not os.access(parent, os.W_OK) or (os.path.exists(value) and not os.access(value, os.W_OK)):
        raise click.BadParameter(f"cannot write {click.format_filename(value)}: permission denied")
    return value


def read_prompt_file(f, encoding: str) -> str:
    """The text of an open binary prompt file; a one-line UsageError naming the file and the byte
    offset where it is not valid `encoding`."""
    data = f.read()
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        name = getattr(f, "name", "-")
        name = "stdin" if name in ("-", "<stdin>") else click.format_filename(name)
        raise click.BadParameter(f"{name} is not valid {encoding} text: byte 0x{data[e.start]:02x} at "
                                 f"offset {e.start} ({e.reason}); give its encoding with --encoding",
                                 param_hint="'--prompt-file'") from None


KV_CACHE_LAYOUTS = ("contiguous", "paged")


def kv_cache_page_size(kv_cache: str, page_size: int | None) -> int | None:
    """--kv-cache / --page-size -> the page size of llama_min's cache (None: contiguous); a
    UsageError for --page-size without --kv-cache paged."""
    if kv_cache == "paged":
        return DEFAULT_PAGE_SIZE if page_size is None else page_size
    if page_size is not None:
        raise click.UsageError("--page-size needs --kv-cache paged")
    return None


def kv_cache_report(page_size: int | None) -> dict:
    return {"layout": "contiguous"} if page_size is None else {"layout": "paged", "page_size": page_size}


def attention_report(attention) -> dict:
    """The attention settings that apply: dense has no samples, sampler, budget or seed."""
    d = attention.as_dict()
    if attention.method == "dense":
        return {k: d[k] for k in ("method", "block_n") if d[k] is not None}
    return d


def sampling_report(sampling) -> dict:
    """The sampling settings that apply: greedy decoding has no temperature, top-k/p or seed."""
    d = sampling.as_dict()
    if not sampling.greedy:
        return d
    return {k: d[k] for k in ("greedy", "repetition_penalty") if k == "greedy" or d[k] != 1.0}


@click.command("generate")
@click.option("--model", "model_name", default=None, metavar="PATH|NAME",
              help="Checkpoint directory, .gguf file or cached model name (default: SmolLM2-135M-Instruct).")
@click.option("--prompt", default=None, help="Prompt text.")
@click.option("--prompt-file", type=click.File("rb"), default=None,
              help="Read the prompt from a file ('-' = stdin).")
@click.option("--encoding", default="utf-8", show_default=True, callback=_check_encoding,
              help="Text encoding of --prompt-file.")
@click.option("--chat/--no-chat", default=None,
              help="Wrap the prompt in the chat template (default: on when the tokenizer has one).")
@click.option("--max-new-tokens", type=click.IntRange(min=0), default=128, show_default=True)
@click.option("--greedy", is_flag=True, default=False,
              help="Greedy decoding (default: the model's generation_config.json; greedy if it has none).")
@click.option("--temperature", type=click.FloatRange(min=0.0), default=None, help="Sample with this temperature.")
@click.option("--top-k", type=click.IntRange(min=0), default=None, help="Sample from the k most likely tokens.")
@click.option("--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=None, help="Nucleus sampling mass.")
@click.option("--repetition-penalty", type=click.FloatRange(min=0.0, min_open=True), default=None,
              help="Divide the logits of tokens already in the context by this (> 1 discourages loops).")
@click.option("--seed", type=click.IntRange(0, 2**64 - 1), default=0, show_default=True,
              help="Seed of token sampling and of SANTA attention.")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="Compute/KV dtype (default: float32 on CPU, float16 on GPU).")
@click.option("--attention", "method", type=click.Choice(["dense", "santa"]), default="dense", show_default=True)
@click.option("--samples", type=click.IntRange(1, MAX_SAMPLES), default=256, show_default=True,
              help="SANTA samples per head.")
@click.option("--sampler", type=click.Choice(list(SAMPLERS)), default="systematic", show_default=True)
@click.option("--budget", type=click.Choice(list(BUDGETS)), default="global", show_default=True)
@click.option("--cuda-graph/--no-cuda-graph", default=None,
              help="GPU: replay the decode step as a CUDA graph (default: on for the GPU).")
@click.option("--kv-cache", "kv_cache", type=click.Choice(KV_CACHE_LAYOUTS), default="contiguous", show_default=True,
              help="KV cache storage: one [L_max, KVH, D] block per sequence, or pages from a pool with a block "
                   "table (FlashInfer/vLLM's NHD layout).")
@click.option("--page-size", type=click.IntRange(1, MAX_PAGE_SIZE), default=None,
              help=f"Rows per page of the paged KV cache (1..{MAX_PAGE_SIZE}; default {DEFAULT_PAGE_SIZE}). "
                   "Needs --kv-cache paged.")
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
def generate(model_name, prompt, prompt_file, encoding, chat, max_new_tokens, greedy, temperature, top_k, top_p,
             repetition_penalty, seed, device, dtype, method, samples, sampler, budget, cuda_graph, kv_cache,
             page_size, fmt):
    """Generate text with a Llama-architecture model, dense or SANTA decode attention."""
    from llama_min import generation_config, progress, threads
    from llama_min.generate import SamplingConfig, generate as run_generate
    from llama_min.model import AttentionSetting, LlamaModel
    from llama_min.models import resolve_model
    from llama_min.tokenizer import Tokenizer

    if (prompt is None) == (prompt_file is None):
        raise click.UsageError("give exactly one of --prompt and --prompt-file")
    text_in = prompt if prompt is not None else read_prompt_file(prompt_file, encoding)
    sampling_opts = {k: v for k, v in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)) if v is not None}
    if greedy and sampling_opts:
        raise click.UsageError(f"--greedy conflicts with --{next(iter(sampling_opts)).replace('_', '-')}")
    attention = AttentionSetting(method=method, samples=samples, sampler=sampler, budget=budget, seed=seed)
    device = _pick_device(device)
    if cuda_graph and device != "gpu":
        raise click.UsageError("--cuda-graph needs --device gpu")
    cuda_graph = device == "gpu" if cuda_graph is None else cuda_graph
    page_size = kv_cache_page_size(kv_cache, page_size)

    try:
        threads.choose("decode")             # a bad SANTA_CUPY_BLAS_THREADS fails before loading
        path = resolve_model(model_name, progress=True)
        _log(f"loading {path} on {device} ...")
        model = LlamaModel.from_pretrained(path, device=device, dtype=dtype)
        tok = Tokenizer.from_dir(path)
        sampling = SamplingConfig(seed=seed, **generation_config.sampling_options(
            generation_config.load(path), dict(sampling_opts, repetition_penalty=repetition_penalty), greedy))
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None

    use_chat = tok.has_chat_template if chat is None else chat
    try:
        if use_chat:
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text_in}]),
                             add_special_tokens=False)
        else:
            ids = tok.encode(text_in)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    stop_ids = list(dict.fromkeys(list(tok.eos_ids) + list(model.cfg.eos_token_id)))

    stream = tok.stream_decoder()
    bar = progress.for_stream(sys.stderr, enabled=fmt == "text")   # a terminal only
    on_token = None
    if fmt == "text":
        def on_token(t):
            if bar is not None:
                bar.close()
            piece = stream.push(t)
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
    try:
        res = run_generate(model, ids, max_new_tokens=max_new_tokens, sampling=sampling,
                           attention=attention, stop_ids=stop_ids, on_token=on_token, use_graph=cuda_graph,
                           on_prefill=bar, page_size=page_size)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    finally:
        if bar is not None:
            bar.close()

    t = res.timings
    if fmt == "text":
        sys.stdout.write(stream.flush() + "\n")
        sys.stdout.flush()
    else:
        out = {
            "model": str(path),
            "prompt_tokens": list(res.prompt_tokens),
            "generated_tokens": list(res.generated_tokens),
            "text": tok.decode(res.generated_tokens),
            "attention": attention_report(attention),
            "timings": {k: t[k] for k in ("prefill_s", "decode_s", "tokens_per_s")},
            "stop_reason": res.stop_reason,
            "device": device,
            "dtype": model.kv_dtype,
            "kv_cache": kv_cache_report(page_size),
            "sampling": sampling_report(sampling),
        }
        click.echo(json.dumps(out))
    _log(f"{len(res.prompt_tokens)} prompt tokens, {len(res.generated_tokens)} generated ({res.stop_reason}); "
         f"prefill {t['prefill_s']:.3f} s, decode {t['decode_s']:.3f} s, {t['tokens_per_s']:.1f} tokens/s")

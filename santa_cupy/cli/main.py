"""The ``santa-cupy`` command line: generate, models, bench, eval, info.

Each command lives beside the code it drives; this file only assembles the click group.
"""

import click

EXIT_INTERRUPTED = 130   # 128 + SIGINT, as shells report a process ended by Ctrl-C


class _Group(click.Group):
    """The group of every command: Ctrl-C ends any of them with one line and exit status 130
    (click's default is "Aborted!" and 1, which scripts cannot tell from a failure)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\ninterrupted", err=True)
            raise click.exceptions.Exit(EXIT_INTERRUPTED) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="santa-cupy")
def main():
    """Stochastic sparse decode attention (SANTA / S2ANTA) on CuPy, with a NumPy reference."""


@main.command()
def info():
    """Versions, GPU availability, kernel sources and the supported shapes."""
    import platform

    import numpy

    from santa_cupy import __version__, kernels, spec

    click.echo(f"santa-cupy {__version__}, Python {platform.python_version()}, NumPy {numpy.__version__}")
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
        names = [cupy.cuda.runtime.getDeviceProperties(i)["name"].decode() for i in range(n)]
        click.echo(f"CuPy {cupy.__version__}: {n} GPU(s) {', '.join(names)}")
    except Exception as exc:  # no CuPy, no driver or no device: the NumPy path still works
        click.echo(f"GPU: not available ({type(exc).__name__}: {exc}); NumPy reference path only")
    click.echo(f"kernel sources: {kernels.kernel_dir()}")
    click.echo(f"head_dim {spec.HEAD_DIMS}, G = H/KVH in 1..{spec.MAX_G}, block_n {spec.BLOCK_NS}, "
               f"dtypes {spec.GPU_DTYPES} (bf16 as uint16)")
    click.echo(f"methods {spec.METHODS}, samplers {spec.SAMPLERS}, budgets {spec.BUDGETS}")


def _register():
    from llama_min.commands import generate, models
    main.add_command(generate)
    main.add_command(models)
    from santa_cupy.cli.bench import bench
    from santa_cupy.cli.evaluation import eval_command
    main.add_command(bench)
    main.add_command(eval_command, name="eval")


_register()

if __name__ == "__main__":
    main()

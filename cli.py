"""santa-cupy command line: generate, models, bench, eval, info.

Each command lives beside the code it drives; this file only assembles the click group.
"""

import click


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="santa-cupy")
def main():
    """Stochastic sparse decode attention (SANTA / S2ANTA) on CuPy, with a NumPy reference."""


def _register():
    from llama_min.commands import generate, models
    main.add_command(generate)
    main.add_command(models)
    try:
        from bench import bench
        main.add_command(bench)
    except ImportError:  # bench.py is optional in a trimmed install
        pass
    try:
        from evaluate import eval_command
        main.add_command(eval_command, name="eval")
    except ImportError:
        pass


_register()

if __name__ == "__main__":
    main()

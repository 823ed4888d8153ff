"""The click group: every command is registered, info runs without a GPU."""

from click.testing import CliRunner

from santa_cupy.cli import main as cli


def test_group_lists_every_command():
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0, res.output
    for name in ("generate", "models", "bench", "eval", "info"):
        assert f"  {name} " in res.output


def test_info_reports_shapes_and_kernels():
    """Every line of `info`, by content: the versions, the GPU line (without CuPy: why not), the
    kernel directory the kernels are compiled from (it holds them), the shapes and the options."""
    import importlib.util
    import platform
    from pathlib import Path

    import numpy as np

    import santa_cupy
    from santa_cupy import kernels, spec

    res = CliRunner().invoke(cli.main, ["info"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert len(lines) == 5, lines
    assert lines[0] == (f"santa-cupy {santa_cupy.__version__}, Python {platform.python_version()}, "
                        f"NumPy {np.__version__}")
    if importlib.util.find_spec("cupy") is None:
        assert lines[1].startswith("GPU: not available (ModuleNotFoundError: ") and "NumPy reference path" in lines[1]
    else:
        assert lines[1].startswith(("CuPy ", "GPU: not available (")), lines[1]
    prefix = "kernel sources: "
    assert lines[2].startswith(prefix)
    src = Path(lines[2][len(prefix):])
    assert src == kernels.kernel_dir()
    assert all((src / name).is_file() for name in ("common.cuh", "decode_dense.cu", "santa_tile.cu", "merge.cu"))
    assert lines[3] == ("head_dim (64, 128, 256), G = H/KVH in 1..16, block_n (64, 128), "
                        "dtypes ('float16', 'bfloat16', 'float32') (bf16 as uint16)")
    assert (spec.HEAD_DIMS, spec.MAX_G, spec.BLOCK_NS) == ((64, 128, 256), 16, (64, 128))
    assert lines[4] == f"methods {spec.METHODS}, samplers {spec.SAMPLERS}, budgets {spec.BUDGETS}"
    assert "systematic" in lines[4] and "'santa'" in lines[4]

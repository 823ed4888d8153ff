"""The click group: every command is registered, info runs without a GPU."""

from click.testing import CliRunner

from santa_tools import cli


def test_group_lists_every_command():
    res = CliRunner().invoke(cli.main, ["--help"])
    assert res.exit_code == 0, res.output
    for name in ("generate", "models", "bench", "eval", "info"):
        assert f"  {name} " in res.output


def test_info_reports_shapes_and_kernels():
    res = CliRunner().invoke(cli.main, ["info"])
    assert res.exit_code == 0, res.output
    assert "head_dim (64, 128, 256)" in res.output
    assert "kernel sources:" in res.output and "common.cuh" not in res.output

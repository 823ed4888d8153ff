"""The README's CPU API example runs as written (extracted from README.md, executed without CuPy)."""

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _cpu_example() -> str:
    text = README.read_text(encoding="utf-8")
    m = re.search(r"On the CPU \(NumPy arrays[^\n]*\n\n```python\n(.*?)```", text, re.S)
    assert m, "README has no CPU API example"
    return m.group(1)


def test_readme_cpu_api_example_runs(capsys):
    code = _cpu_example()
    assert "cupy" not in code.replace("santa_cupy", "")
    exec(compile(code, "README.md (CPU example)", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("(1, 8, 64) ")

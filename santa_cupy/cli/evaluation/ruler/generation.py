"""Generating RULER data with the ``nvidia-long-context-eval`` package: the package check, each
generator script run in a child Python with the evaluated model's tokenizer, the child's entry.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from santa_cupy.cli.evaluation.ruler.tasks import DATA_SEED, GENERATOR_TIMEOUT_S, INSTALL_HINT, PACKAGE


def _have(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def sentence_splitter() -> str:
    if _have("nupunkt"):
        from importlib.metadata import version
        return f"nupunkt {version('nupunkt')}"
    return "nltk punkt"


def check_package() -> Path:
    """The installed package's directory; a UsageError saying how to get it otherwise."""
    missing = [m for m, dist in (("long_context_eval", PACKAGE), ("wonderwords", "wonderwords"),
                                 ("scipy", "scipy"), ("yaml", "pyyaml"), ("tqdm", "tqdm"))
               if not _have(m)]
    if not _have("nupunkt") and not _have("nltk"):
        missing.append("nupunkt")
    if missing:
        raise click.UsageError(f"generating RULER data needs {', '.join(missing)} (not installed): "
                               f"{INSTALL_HINT}, or give jsonl files with --data")
    spec = importlib.util.find_spec("long_context_eval")
    return Path(list(spec.submodule_search_locations)[0])


def generate_task(task: str, length: int, n: int, model_path, seed: int = DATA_SEED) -> list[dict]:
    """n samples of one RULER task at max_seq_length `length`, from the package's generator run
    in a child Python (see the module docstring); records gain 'task' and 'max_seq_length'."""
    check_package()
    with tempfile.TemporaryDirectory(prefix="santa-ruler-") as tmp:
        job = {"task": task, "length": int(length), "n": int(n), "seed": int(seed),
               "model": str(model_path), "save_dir": tmp}
        env = dict(os.environ)
        here = str(Path(__file__).resolve().parents[4])     # the folder that holds santa_cupy
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        limit = GENERATOR_TIMEOUT_S + 5 * int(n)
        try:
            proc = subprocess.run([sys.executable, "-c", "from santa_cupy.cli.evaluation.ruler import generation; generation._child_main()",
                                   json.dumps(job)], env=env, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise click.ClickException(
                f"RULER's generator did not finish {task} at {length} in {limit} s (its QA generator never "
                "ends when its first 10 documents exceed the length: use 4096 or more)") from None
        out = Path(tmp) / task / "validation.jsonl"
        if proc.returncode != 0 or not out.is_file():
            tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-8:])
            raise click.ClickException(f"RULER's generator failed for {task} at {length}:\n{tail}")
        recs = []
        with open(out, encoding="utf-8") as f:
            for line in f:
                r = json.loads(line)
                recs.append({"task": task, "max_seq_length": int(length), **r})
    return recs


class _ModelTokenizer:
    """RULER's tokenizer interface (text_to_tokens / tokens_to_text) over llama_min's tokenizer."""

    def __init__(self, path):
        from llama_min.tokenizer import Tokenizer
        self.tok = Tokenizer.from_dir(path)

    def text_to_tokens(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def tokens_to_text(self, tokens) -> str:
        return self.tok.decode(tokens)


def _generator_argv(pkg: Path, task: str, length: int, n: int, seed: int, model: str, save_dir: str):
    """The script and the arguments prepare.py would give it (base template, chunk 0)."""
    import runpy

    import yaml
    with open(pkg / "synthetic.yaml", encoding="utf-8") as f:
        config = yaml.safe_load(f)[task]
    base = runpy.run_path(str(pkg / "data" / "synthetic" / "constants.py"))["TASKS"][config["task"]]
    templates = runpy.run_path(str(pkg / "data" / "template.py"))["Templates"]
    template = templates["base"].format(task_template=base["template"]) + base.get("answer_prefix", "")
    script = pkg / "data" / "synthetic" / f"{config['task']}.py"
    argv = [str(script), "--save_dir", save_dir, "--save_name", task, "--subset", "validation",
            "--tokenizer_path", model, "--tokenizer_type", "hf", "--max_seq_length", str(length),
            "--tokens_to_generate", str(base["tokens_to_generate"]), "--num_samples", str(n),
            "--random_seed", str(seed)]
    for k, v in config.get("args", {}).items():
        argv += [f"--{k}", str(v)]
    if config["task"] == "qa":
        argv += ["--pre_samples", "0"]
    return script, argv + ["--template", template]


def _child_main():
    """The child of generate_task: install the tokenizer / sentence-splitter modules, run the script."""
    import runpy
    import types
    job = json.loads(sys.argv[1])
    pkg = check_package()
    script, argv = _generator_argv(pkg, job["task"], job["length"], job["n"], job["seed"],
                                   job["model"], job["save_dir"])
    tok_mod = types.ModuleType("tokenizer")
    tok_mod.select_tokenizer = lambda tokenizer_type, tokenizer_path: _ModelTokenizer(tokenizer_path)
    import long_context_eval.data  # noqa: F401  (the parent package of the module replaced next)
    sys.modules["tokenizer"] = sys.modules["long_context_eval.data.tokenizer"] = tok_mod
    if _have("nupunkt"):
        import nupunkt
        nltk, nltk_tok = types.ModuleType("nltk"), types.ModuleType("nltk.tokenize")
        nltk_tok.sent_tokenize = lambda text, language="english": nupunkt.sent_tokenize(text)
        nltk.tokenize = nltk_tok
        sys.modules["nltk"], sys.modules["nltk.tokenize"] = nltk, nltk_tok
    sys.path[:0] = [str(script.parent), str(script.parent.parent)]     # as `python script.py` would
    sys.argv = argv
    runpy.run_path(str(script), run_name="__main__")



def _pkg_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "?"


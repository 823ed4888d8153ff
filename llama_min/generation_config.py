"""The model's own decoding defaults: ``generation_config.json`` (Hugging Face's keys).

Read: ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``. Options given
on the command line win over these. The default model's converted files carry only token ids, so
it gets defaults of ours: greedy decoding with a repetition penalty of 1.2. Plain greedy decoding
loops on open-ended prompts; the model card's sampling (temperature 0.2, top_p 0.9) with the
default model's Q4_1 weights starts the README's "capital of France" answer in French at seed 0
("L'Etoile, la Cite, ..."), 36% of the first token's mass; greedy with the penalty answers "The
capital of France is Paris." and ends the loops (measured 2026-12-01). The card's sampling stays
one option away: --temperature 0.2 --top-p 0.9.
"""

from __future__ import annotations

from pathlib import Path

from llama_min.config import read_json_object

KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")
# the default model's defaults (module docstring: why not the model card's sampling)
RECOMMENDED = {"SmolLM2-135M-Instruct": {"do_sample": False, "repetition_penalty": 1.2}}


class GenerationConfigError(ValueError):
    """generation_config.json holds a value of the wrong type or range."""


def _checked(path: Path, raw: dict) -> dict:
    out = {}
    for key in KEYS:
        if key not in raw or raw[key] is None:
            continue
        v = raw[key]
        ok = isinstance(v, bool) if key == "do_sample" else (
            isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0)
        if key == "top_k":
            ok = ok and float(v).is_integer()
        if key in ("top_p", "repetition_penalty"):
            ok = ok and v > 0 and (key != "top_p" or v <= 1)
        if not ok:
            raise GenerationConfigError(f"{path}: {key} = {v!r} is not a valid value")
        out[key] = int(v) if key == "top_k" else v
    return out


def load(model_dir) -> dict:
    """The decoding defaults of a checkpoint directory (a subset of KEYS; {} if none)."""
    model_dir = Path(model_dir)
    path = model_dir / "generation_config.json"
    raw = read_json_object(path, GenerationConfigError) if path.is_file() else {}
    found = _checked(path, raw)
    if not found:
        return dict(RECOMMENDED.get(model_dir.name, {}))
    return found


def sampling_options(defaults: dict, given: dict, greedy: bool) -> dict:
    """SamplingConfig keyword arguments: the model's defaults, overridden by the options the user
    gave (`given`: temperature / top_k / top_p / repetition_penalty, None = not given).
    `greedy` (--greedy) or a model without do_sample decodes greedily unless a sampling option
    is given; the repetition penalty applies either way."""
    given = {k: v for k, v in given.items() if v is not None}
    penalty = given.pop("repetition_penalty", defaults.get("repetition_penalty", 1.0))
    sample = bool(given) or (not greedy and defaults.get("do_sample", False))
    opts = {"greedy": not sample, "repetition_penalty": float(penalty)}
    if sample:
        opts.update({k: defaults[k] for k in ("temperature", "top_k", "top_p") if k in defaults})
        opts.update(given)
    return opts

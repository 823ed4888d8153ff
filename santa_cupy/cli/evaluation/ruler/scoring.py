"""RULER's scoring, as its ``eval/synthetic/constants.py`` defines it (reimplemented): the
prediction's post-processing, ``string_match_all`` / ``string_match_part``, and the task families.
"""

from __future__ import annotations

import re

import click

from santa_cupy.cli.evaluation.ruler.tasks import FAMILY, METRIC, STANDARD_TASKS, TOKENS_TO_GENERATE


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


"""``AttentionSetting``: what defines one decode-attention estimator, as one frozen value.

The setting is what a user picks once and keeps for many calls (a run of a model, a row of an
evaluation or a benchmark): the method, and for santa the sampler, the budget and the samples
``S``, plus the estimator's seed, its tile size ``block_n`` and ``santa_min_length`` (below which
length the GPU runs the exact kernel instead). What changes from call to call is not in it: the
RNG ``step`` and ``layer`` (the other two keys of the counter-based RNG), the score ``scale`` (a
property of the model), the output buffer, the hint of the one-pass budget, the block table.

One name format, ``str(setting)`` and ``AttentionSetting.parse``::

    dense                                   exact attention
    systematic/global/S=256                 santa: <sampler>/<budget>/S=<samples>
    systematic/one_pass/S=256/block_n=64/min_length=0/seed=3
                                            + the fields that differ from their defaults,
                                              in this order

``parse`` also reads the benchmark's older names ("santa-global-systematic-256", i.e.
santa-<budget>-<sampler>-<samples>) for the command-line options that took them.

Kernel choice is not part of the setting: it does not change the estimator, only how the GPU runs
it (santa_cupy/kernel_choice.py, internal).
"""

from __future__ import annotations

import dataclasses
import numbers
import re
from dataclasses import dataclass

from santa_cupy import spec

_INT32_MAX = 2**31 - 1
_EXTRA_KEYS = (("block_n", "block_n"), ("min_length", "santa_min_length"), ("seed", "seed"))


@dataclass(frozen=True)
class AttentionSetting:
    """One decode-attention estimator (hashable: a key of plan caches and result tables).

    Parameters
    ----------
    method : str
        ``"dense"`` (exact) or ``"santa"`` (stochastic: ``samples`` value rows per head).
    samples : int
        S, rows sampled per head, 1..``spec.MAX_SAMPLES`` (checked for dense too, unused there).
    sampler : str
        ``"iid"`` | ``"stratified"`` | ``"systematic"`` (``spec.SAMPLERS``).
    budget : str
        ``"fixed"`` | ``"global"`` | ``"largest_remainder"`` | ``"one_pass"``
        (``spec.DECODE_BUDGETS``; one_pass needs the systematic sampler).
    seed : int
        The RNG seed, 0..2**64-1; with the per-call ``step`` and ``layer`` it keys every draw.
    block_n : int or None
        Rows per tile, one of ``spec.BLOCK_NS``; None: ``spec.default_block_n(method, head_dim)``.
    santa_min_length : "auto" or int
        GPU only: sequences shorter than this run the exact kernel where it is faster; "auto" the
        plan's crossover for the shape and device, 0 (or 1) santa at every length. The NumPy
        reference always runs the estimator asked for.

    Validation happens here, once (ValueError / TypeError naming the field). For
    ``method="dense"`` the santa fields are kept as given (``str`` prints just ``dense``).
    """

    method: str = "santa"
    samples: int = 256
    sampler: str = "systematic"
    budget: str = "global"
    seed: int = 0
    block_n: int | None = None
    santa_min_length: int | str = "auto"

    def __post_init__(self):
        spec.check_estimator(self.method, self.samples, self.sampler, self.budget)
        object.__setattr__(self, "samples", int(self.samples))
        if self.block_n is not None:              # 0 or False is a bad value, not "the default"
            spec.check_block_n(self.block_n)
            object.__setattr__(self, "block_n", int(self.block_n))
        _check_int("seed", self.seed, 0, 2**64 - 1)
        object.__setattr__(self, "seed", int(self.seed))
        if not (isinstance(self.santa_min_length, str) and self.santa_min_length == "auto"):
            _check_int("santa_min_length", self.santa_min_length, 0, _INT32_MAX, what="'auto' or an integer")
            object.__setattr__(self, "santa_min_length", int(self.santa_min_length))

    # ---- derived -----------------------------------------------------------------------------
    @property
    def one_pass(self) -> bool:
        """Whether this is santa with the one-pass budget (it needs an ``lse_hint``)."""
        return self.method == "santa" and self.budget == spec.ONE_PASS

    def resolved_block_n(self, head_dim: int) -> int:
        """``block_n``, or the method's default at this head dim."""
        return self.block_n if self.block_n is not None else spec.default_block_n(self.method, head_dim)

    def replace(self, **changes) -> "AttentionSetting":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The fields as a dict (JSON-friendly)."""
        return dataclasses.asdict(self)

    # ---- the name format ---------------------------------------------------------------------
    def __str__(self) -> str:
        head = "dense" if self.method == "dense" else f"{self.sampler}/{self.budget}/S={self.samples}"
        default = AttentionSetting(method=self.method)
        extras = [f"{key}={getattr(self, field)}" for key, field in _EXTRA_KEYS
                  if getattr(self, field) != getattr(default, field) and (self.method == "santa" or key == "block_n")]
        return "/".join([head] + extras)

    @property
    def label(self) -> str:
        """``str(self)``: the setting's name in tables, reports and result files."""
        return str(self)

    @classmethod
    def parse(cls, text) -> "AttentionSetting":
        """The setting named ``text`` (the format of ``str``; also santa-<budget>-<sampler>-<S>).
        An AttentionSetting is returned as it is. ValueError for anything else, saying the format."""
        if isinstance(text, cls):
            return text
        if not isinstance(text, str):
            raise TypeError(f"an attention setting is an AttentionSetting or its name, got {type(text).__name__}")
        name = text.strip()
        legacy = re.fullmatch(r"santa-([a-z_]+)-([a-z_]+)-(\d+)", name)
        if legacy:
            budget, sampler, samples = legacy.groups()
            return cls._build(text, method="santa", sampler=sampler, budget=budget, samples=int(samples))
        parts = name.split("/")
        if parts[0] == "dense":
            fields, rest = {"method": "dense"}, parts[1:]
        else:
            m = len(parts) >= 3 and re.fullmatch(r"S=(\d+)", parts[2])
            if not m:
                raise ValueError(f"{text!r} is not an attention setting: 'dense' or <sampler>/<budget>/S=<samples> "
                                 f"(e.g. systematic/global/S=256; samplers {spec.SAMPLERS}, budgets "
                                 f"{spec.DECODE_BUDGETS}), optionally followed by /block_n=N, /min_length=N|auto, "
                                 f"/seed=N")
            fields = {"method": "santa", "sampler": parts[0], "budget": parts[1], "samples": int(m.group(1))}
            rest = parts[3:]
        keys = dict(_EXTRA_KEYS)
        for item in rest:
            key, eq, value = item.partition("=")
            if not eq or key not in keys or keys[key] in fields or (fields["method"] == "dense" and key != "block_n"):
                raise ValueError(f"{text!r}: {item!r} is not one of /block_n=N, /min_length=N|auto, /seed=N "
                                 "(each at most once; dense takes block_n only)")
            if key == "min_length" and value == "auto":
                fields[keys[key]] = "auto"
            elif value.isdigit():
                fields[keys[key]] = int(value)
            else:
                raise ValueError(f"{text!r}: {key} must be a non-negative integer, got {value!r}")
        return cls._build(text, **fields)

    @classmethod
    def _build(cls, text, **fields):
        try:
            return cls(**fields)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{text!r}: {e}") from None

    @classmethod
    def from_fields(cls, setting=None, **fields) -> "AttentionSetting":
        """``setting`` (an AttentionSetting, a name, or None: the defaults) with ``fields`` changed:
        what decode_attention's and DecodePlan's keyword arguments build. Unknown names: TypeError."""
        base = cls() if setting is None else cls.parse(setting)
        unknown = sorted(set(fields) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r} (the attention setting's fields: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))})")
        return base.replace(**fields) if fields else base


def _check_int(name, value, lo, hi, what="an integer"):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")

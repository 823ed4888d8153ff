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

    dense/keys=block:FB=16,f=0.875          score-stage (key) sampling, then the value stage
    systematic/global/S=256/keys=block:FB=16,v=0.1,R=2,combine=union
    dense/keys=block:FB=32,f=0.75,rule=qrms
    dense/keys=bernoulli:R=8,combine=union

The key-sampling part (santa_cupy.key_sampling; on the GPU block sampling on a blocked K) comes last:
``keys=block:`` (key_sampling "bernoulli_block") with ``FB=<key_block>`` and either
``f=<key_budget>`` (the expected fraction of K read) or ``v=<key_variance>`` (a variance target in
nats^2 per head that sets the fraction per group), or ``keys=bernoulli:R=<key_draws>`` (the
per-feature stochastic ternary query); then ``R=``, ``rule=`` and ``combine=`` where they differ
from their defaults (R=1, rule=qkvar, combine=mean; for bernoulli R is always printed). Without
key sampling (the default, key_sampling="none") the name is as before.

``parse`` also reads the benchmark's older names ("santa-global-systematic-256", i.e.
santa-<budget>-<sampler>-<samples>) for the command-line options that took them.

Kernel choice is not part of the setting: it does not change the estimator, only how the GPU runs
it (santa_cupy/kernel_choice.py, internal).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass

from santa_cupy import spec

_INT32_MAX = 2**31 - 1
_EXTRA_KEYS = (("block_n", "block_n"), ("min_length", "santa_min_length"), ("seed", "seed"))
_KEY_KINDS = {"block": "bernoulli_block", "bernoulli": "bernoulli"}       # name -> key_sampling
_KEY_ITEMS = {"FB": "key_block", "f": "key_budget", "v": "key_variance", "R": "key_draws", "rule": "key_rule",
              "combine": "key_combine"}
_KEY_FORMAT = ("keys=block:FB=16|32,f=<fraction in (0, 1]>|v=<variance > 0>[,R=N][,rule=R][,combine=C] or "
               "keys=bernoulli:R=N[,combine=C]")
KEY_FIELDS = ("key_sampling", "key_draws", "key_block", "key_budget", "key_variance", "key_rule", "key_combine")


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
        plan's crossover for the shape, the samples and the device, 0 (or 1) santa at every length.
        Plans that cannot mix per sequence (DecodePlan) run exact throughout when their max_length
        is below it. The NumPy reference always runs the estimator asked for.
    key_sampling : str
        Score-stage sampling (santa_cupy.key_sampling; the GPU runs "bernoulli_block" with rules
        uniform | qmax | qrms on K in key_layout="blocked", santa_cupy/key_pass.py; other GPU calls
        raise NotImplementedError): ``"none"`` (exact scores, the default), ``"bernoulli"``
        (per-feature stochastic ternary query) or ``"bernoulli_block"`` (one Horvitz-Thompson
        decision per block of ``key_block`` features and KV group). The value stage is ``method``'s
        (dense: exact softmax of the estimated scores; santa: SANTA sampling on them).
    key_draws : int
        R, independent draws combined by ``key_combine`` (1..256).
    key_block : int
        FB, features per block (16 or 32; bernoulli_block only).
    key_budget : float
        Expected fraction of the K blocks read, in (0, 1] (bernoulli_block only).
    key_variance : float or None
        A target score variance in nats^2 per head that replaces key_budget (bernoulli_block with
        key_rule "qkvar"; then key_budget must stay at its default).
    key_rule : str
        Block weights: "qkvar" (the variance-optimal one, default) | "qrms" | "qmax" | "uniform".
    key_combine : str
        "mean" (the paper's) | "union" (Horvitz-Thompson on the union of the draws).

    The key-sampling defaults are the block estimator the CPU study (docs/results/key_sampling_cpu.md)
    recommends: FB=16, rule qkvar, one draw, f=0.875. With key_sampling "none" the other key fields
    are kept as given and unused (``str`` prints none of them).

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
    key_sampling: str = "none"
    key_draws: int = 1
    key_block: int = 16
    key_budget: float = 0.875
    key_variance: float | None = None
    key_rule: str = "qkvar"
    key_combine: str = "mean"

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
        spec.check_key_options(self.key_sampling, self.key_draws, self.key_block, self.key_budget, self.key_rule,
                               self.key_combine, self.key_variance)
        object.__setattr__(self, "key_draws", int(self.key_draws))
        object.__setattr__(self, "key_block", int(self.key_block))
        object.__setattr__(self, "key_budget", float(self.key_budget))
        if self.key_variance is not None:
            if self.key_budget != _KEY_BUDGET_DEFAULT:
                raise ValueError(f"give key_budget or key_variance, not both (key_budget={self.key_budget}, "
                                 f"key_variance={self.key_variance})")
            object.__setattr__(self, "key_variance", float(self.key_variance))
        if self.key_sampling != "none" and self.one_pass:
            raise ValueError(f"key sampling with budget {spec.ONE_PASS!r} is not supported (its rows come from a "
                             "hint of the exact lse); use another budget or key_sampling='none'")

    # ---- derived -----------------------------------------------------------------------------
    @property
    def one_pass(self) -> bool:
        """Whether this is santa with the one-pass budget (it needs an ``lse_hint``)."""
        return self.method == "santa" and self.budget == spec.ONE_PASS

    @property
    def key_sampled(self) -> bool:
        """Whether the scores are estimated (key_sampling other than "none")."""
        return self.key_sampling != "none"

    @property
    def key_options(self) -> dict:
        """The key-sampling fields as santa_cupy.key_sampling.key_scores' keyword arguments."""
        return {f: getattr(self, f) for f in KEY_FIELDS}

    def resolved_block_n(self, head_dim: int) -> int:
        """``block_n``, or the method's default at this head dim."""
        return self.block_n if self.block_n is not None else spec.default_block_n(self.method, head_dim)

    def replace(self, **changes) -> "AttentionSetting":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict:
        """The fields as a dict (JSON-friendly; ``AttentionSetting(**d)`` builds it back). The
        key-sampling fields only with key sampling: without it the dict is the one of the settings
        before they existed (result files, the CLI's JSON)."""
        d = dataclasses.asdict(self)
        return d if self.key_sampled else {k: v for k, v in d.items() if k not in KEY_FIELDS}

    # ---- the name format ---------------------------------------------------------------------
    def __str__(self) -> str:
        head = "dense" if self.method == "dense" else f"{self.sampler}/{self.budget}/S={self.samples}"
        default = AttentionSetting(method=self.method)
        extras = [f"{key}={getattr(self, field)}" for key, field in _EXTRA_KEYS
                  if getattr(self, field) != getattr(default, field) and (self.method == "santa" or key == "block_n")]
        if self.key_sampled:
            extras.append(self._key_name())
        return "/".join([head] + extras)

    def _key_name(self) -> str:
        if self.key_sampling == "bernoulli":
            items = [f"R={self.key_draws}"]
        else:
            items = [f"FB={self.key_block}",
                     f"f={self.key_budget!r}" if self.key_variance is None else f"v={self.key_variance!r}"]
            if self.key_draws != 1:
                items.append(f"R={self.key_draws}")
            if self.key_rule != "qkvar":
                items.append(f"rule={self.key_rule}")
        if self.key_combine != "mean":
            items.append(f"combine={self.key_combine}")
        kind = {v: k for k, v in _KEY_KINDS.items()}[self.key_sampling]
        return f"keys={kind}:" + ",".join(items)

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
        if rest and rest[-1].startswith("keys="):
            fields.update(cls._parse_keys(text, rest[-1]))
            rest = rest[:-1]
        keys = dict(_EXTRA_KEYS)
        for item in rest:
            key, eq, value = item.partition("=")
            if not eq or key not in keys or keys[key] in fields or (fields["method"] == "dense" and key != "block_n"):
                raise ValueError(f"{text!r}: {item!r} is not one of /block_n=N, /min_length=N|auto, /seed=N "
                                 "(each at most once; dense takes block_n only), nor a last /" + _KEY_FORMAT)
            if key == "min_length" and value == "auto":
                fields[keys[key]] = "auto"
            elif value.isdigit():
                fields[keys[key]] = int(value)
            else:
                raise ValueError(f"{text!r}: {key} must be a non-negative integer, got {value!r}")
        return cls._build(text, **fields)

    @staticmethod
    def _parse_keys(text, part) -> dict:
        """The key-sampling fields of the ``keys=...`` part of a name."""
        kind, colon, body = part[len("keys="):].partition(":")
        if kind not in _KEY_KINDS or not colon or not body:
            raise ValueError(f"{text!r}: {part!r} is not {_KEY_FORMAT}")
        fields = {"key_sampling": _KEY_KINDS[kind]}
        allowed = ("FB", "f", "v", "R", "rule", "combine") if kind == "block" else ("R", "combine")
        for item in body.split(","):
            key, eq, value = item.partition("=")
            field = _KEY_ITEMS.get(key)
            if not eq or key not in allowed or field in fields:
                raise ValueError(f"{text!r}: {item!r} in {part!r} is not one of {', '.join(k + '=' for k in allowed)} "
                                 f"(each at most once): {_KEY_FORMAT}")
            if key in ("FB", "R"):
                if not value.isdigit():
                    raise ValueError(f"{text!r}: {key} must be a positive integer, got {value!r}")
                fields[field] = int(value)
            elif key in ("f", "v"):
                try:
                    number = float(value)
                except ValueError:
                    number = None
                if number is None or not math.isfinite(number):
                    raise ValueError(f"{text!r}: {key} must be a finite number, got {value!r}") from None
                fields[field] = number
            else:
                fields[field] = value
        if "key_budget" in fields and "key_variance" in fields:
            raise ValueError(f"{text!r}: {part!r} gives both f= and v= (one of them)")
        if kind == "block" and not ({"key_budget", "key_variance"} & set(fields) and "key_block" in fields):
            raise ValueError(f"{text!r}: {part!r} needs FB= and one of f= or v=: {_KEY_FORMAT}")
        if kind == "bernoulli" and "key_draws" not in fields:
            raise ValueError(f"{text!r}: {part!r} needs R=: {_KEY_FORMAT}")
        return fields

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


_KEY_BUDGET_DEFAULT = 0.875          # AttentionSetting.key_budget's default (key_variance replaces it)


def _check_int(name, value, lo, hi, what="an integer"):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")

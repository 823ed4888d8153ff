"""The evaluation's options: the full and --small grids, the comma-list option types, the resolved
EvalConfig, and the checks of lengths and layers against the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import click


FULL = dict(samplers="iid,stratified,systematic", budgets="global,fixed,largest_remainder",
            samples="16,64,256,1024,2048", seeds="0,1,2", context=4096, layers="all", steps=128,
            greedy_tokens=64, lengths="1024,2048,4096,8000", depths="0.1,0.5,0.9", needles=2,
            answer_tokens=16)
SMALL = dict(samplers="iid,systematic", budgets="global", samples="64,256", seeds="0,1",
             context=1024, layers="0,14,29", steps=24, greedy_tokens=16, lengths="512,1024",
             depths="0.25,0.75", needles=1, answer_tokens=16)


def _csv(text, kind=str) -> list:
    """'a,b' -> [kind(a), kind(b)]; a list (already parsed by CommaList) is returned as it is."""
    if isinstance(text, (list, tuple)):
        return list(text)
    return [kind(x.strip()) for x in str(text).split(",") if x.strip()]


class SettingName(click.ParamType):
    """One santa_cupy.AttentionSetting name (e.g. "dense/keys=block:FB=16,f=0.875"), checked when
    the command line is parsed; ``prefix`` is put in front of the text first (``--keys``: "dense/keys=")."""

    name = "setting"

    def __init__(self, prefix=""):
        self.prefix = prefix

    def convert(self, value, param, ctx):
        from santa_cupy import AttentionSetting
        if isinstance(value, AttentionSetting):
            return value
        try:
            return AttentionSetting.parse(self.prefix + str(value).strip())
        except (TypeError, ValueError) as e:
            self.fail(str(e), param, ctx)


class CommaList(click.ParamType):
    """A comma-separated list whose every item is checked by click type `item` (e.g. an IntRange
    or a Choice), so a bad value fails when the command line is parsed, before any model loads."""

    name = "list"

    def __init__(self, item: click.ParamType):
        self.item = item

    def convert(self, value, param, ctx):
        if isinstance(value, list):
            return value
        items = [x.strip() for x in str(value).split(",")]
        if not value or not all(items):
            self.fail(f"{value!r} is not a comma list of {self.item.name} values", param, ctx)
        return [self.item.convert(x, param, ctx) for x in items]


def _named(param_type, name):
    param_type.name = name            # click says "'abc' is not a valid {name}."
    return param_type


def _option_types():
    from santa_cupy import spec
    return {
        "samplers": CommaList(click.Choice(spec.SAMPLERS)),
        "budgets": CommaList(click.Choice(spec.DECODE_BUDGETS)),
        "samples": CommaList(_named(click.IntRange(1, spec.MAX_SAMPLES), "integer")),
        "seeds": CommaList(_named(click.IntRange(0, 2**64 - 1), "integer")),
        "lengths": CommaList(_named(click.IntRange(min=2), "integer")),
        "depths": CommaList(_named(click.FloatRange(0.0, 1.0), "number")),
    }


OPTION_TYPES = _option_types()


@dataclass
class EvalConfig:
    model: str | None
    device: str
    dtype: str | None
    samplers: list
    budgets: list
    samples: list
    seeds: list
    context: int
    layers: str
    steps: int
    greedy_tokens: int
    lengths: list
    depths: list
    needles: int
    answer_tokens: int
    block_n: int | None
    small: bool
    given: frozenset = frozenset()   # the options given on the command line (not defaults)
    extra: tuple = ()                # AttentionSettings of --setting / --keys, after the grid's
    grid: bool = True                # False (--no-grid): only the extra settings (and dense)


def resolve_config(small: bool, **given) -> EvalConfig:
    """Options left unset (None) take the --small or the full default."""
    base = SMALL if small else FULL
    v = {k: (given.get(k) if given.get(k) is not None else base[k]) for k in base}
    from santa_cupy import spec
    samplers, budgets = _csv(v["samplers"]), _csv(v["budgets"])
    for name, vals, ok in (("sampler", samplers, spec.SAMPLERS), ("budget", budgets, spec.DECODE_BUDGETS)):
        bad = [x for x in vals if x not in ok]
        if bad:
            raise click.BadParameter(f"unknown {name}(s) {bad}; choose from {list(ok)}")
    return EvalConfig(model=given.get("model"), device=given.get("device") or "auto",
                      dtype=given.get("dtype"), samplers=samplers, budgets=budgets,
                      samples=_csv(v["samples"], int), seeds=_csv(v["seeds"], int),
                      context=int(v["context"]), layers=str(v["layers"]), steps=int(v["steps"]),
                      greedy_tokens=int(v["greedy_tokens"]), lengths=_csv(v["lengths"], int),
                      depths=_csv(v["depths"], float), needles=int(v["needles"]),
                      answer_tokens=int(v["answer_tokens"]), block_n=given.get("block_n"), small=small,
                      given=frozenset(k for k in base if given.get(k) is not None),
                      extra=extra_settings(given.get("settings"), given.get("keys")),
                      grid=not given.get("no_grid"))


def extra_settings(settings=None, keys=None) -> tuple:
    """The settings of --setting NAME (any AttentionSetting name) and --keys SPEC (the dense
    value stage on key-sampled scores, "dense/keys=SPEC"), in that order, each once."""
    from santa_cupy import AttentionSetting
    sc = SettingName()
    out = [sc.convert(x, None, None) for x in (settings or ())]
    out += [SettingName("dense/keys=").convert(x, None, None) for x in (keys or ())]
    return tuple(dict.fromkeys(AttentionSetting.parse(x) for x in out))


def retrieval_cap(max_positions: int, answer_tokens: int) -> int:
    """Longest retrieval prompt that leaves room for the answer in the context window."""
    return max_positions - answer_tokens - 2


def check_lengths_fit(cfg: EvalConfig, max_positions: int, which, n_layers: int | None = None) -> list:
    """Retrieval lengths beyond the context window: a UsageError (exit 2) when the user asked for
    them, else (a default grid on a short-context model) a notice of the cap; likewise --layers
    beyond the model's n_layers. Returns the notices."""
    notices = []
    if "kernel" in which and n_layers is not None:
        select_layers(cfg.layers, n_layers, clamp="layers" not in cfg.given)
    if "retrieval" in which:
        cap = retrieval_cap(max_positions, cfg.answer_tokens)
        over = [L for L in cfg.lengths if L > cap]
        if over and "lengths" in cfg.given:
            raise click.BadParameter(
                f"{', '.join(map(str, over))} beyond the model's context: at most {cap} tokens "
                f"(max_position_embeddings {max_positions} - {cfg.answer_tokens} answer tokens - 2)",
                param_hint="'--lengths'")
        if over:
            notices.append(f"eval retrieval: default lengths {over} capped at {cap} tokens (the model's context)")
    if "context" in cfg.given and cfg.context > max_positions and {"kernel", "model"} & set(which):
        raise click.BadParameter(f"{cfg.context} is beyond the model's context window "
                                 f"({max_positions} tokens)", param_hint="'--context'")
    # run_model keeps greedy_tokens + 2 positions free and needs a text of 3 tokens (1 decode step)
    if "model" in which and max_positions - cfg.greedy_tokens - 2 < 3:
        raise click.BadParameter(f"{cfg.greedy_tokens} leaves no room for a text in the model's context "
                                 f"({max_positions} tokens): at most {max_positions - 5}",
                                 param_hint="'--greedy-tokens'")
    if "retrieval" in which and retrieval_cap(max_positions, cfg.answer_tokens) < 2:
        raise click.BadParameter(f"{cfg.answer_tokens} leaves no room for a prompt in the model's context "
                                 f"({max_positions} tokens): at most {max_positions - 4}",
                                 param_hint="'--answer-tokens'")
    return notices


def select_layers(spec_text: str, n_layers: int, clamp: bool = True) -> list[int]:
    """Layer indices from 'all' or a comma list (negative counts from the end). clamp: indices past
    the last layer become the last (a preset's grid on a smaller model); else they are an error
    naming --layers (what the user typed)."""
    if spec_text.strip() == "all":
        return list(range(n_layers))
    given = _csv(spec_text, int)
    over = [x for x in given if x >= n_layers or x < -n_layers]
    if over and not clamp:
        raise click.BadParameter(f"{', '.join(map(str, over))} out of range: the model has {n_layers} layers "
                                 f"(0..{n_layers - 1}, or -{n_layers}..-1 from the end)", param_hint="'--layers'")
    layers = sorted({min(x, n_layers - 1) if x >= 0 else n_layers + x for x in given})
    if any(not 0 <= li < n_layers for li in layers):
        raise click.BadParameter(f"layers must be in 0..{n_layers - 1}, got {spec_text}", param_hint="'--layers'")
    return layers


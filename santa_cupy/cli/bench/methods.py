"""What a kernel benchmark runs: the attention shapes, the method names (dense, santa-..., torch-...,
flashinfer) and their parser, the command-line list parsers and the (shape, batch, context) grid.
Pure Python (tests/test_bench.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import click

from santa_cupy import spec
from santa_cupy.setting import AttentionSetting


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"


SHAPES = {
    "llama8b": Shape("llama8b", heads=32, kv_heads=8, head_dim=128),
    "smollm2": Shape("smollm2", heads=9, kv_heads=3, head_dim=64),
}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
BUDGETS, SAMPLERS = spec.BUDGETS, spec.SAMPLERS        # the one list of each (santa_cupy.spec)
SAMPLE_COUNTS = (128, 256, 512, 2048)
TORCH_BACKENDS = ("flash", "cudnn", "efficient")
KERNEL_VERSIONS = ("stream", "mma")    # v2 (generic), v4 (santa_cupy.kernels); none = "auto"
# Method name suffixes -> the plan's kernel choice (santa_cupy/kernel_choice.py KernelChoice fields):
# a dense or score-pass version (KERNEL_VERSIONS), "block" = the v2 block-per-tile pass 2 (score
# "auto"; for the fixed budget the one fused pass), "tpw1" = the v4 kernels with one tile per warp
# (as before runs of tiles), or the warp pass 2's gather forced: "warp" = staged through shared
# memory, light tiles pipelined, "warpmma" = staged and on tensor cores; the warp pass 2's finish
# forced at any batch: "partials" = from block partials, "atomic" = through atomics (the plan picks
# by B x KVH, kernel_choice.FINISH_MAX_GROUPS); dense "p<N>": N splits a KV group
SANTA_KERNEL_SUFFIXES = {"block": {"tile_kernel": "block"}, "tpw1": {"tiles_per_warp": 1},
                         "warp": {"tile_kernel": "warp"}, "warpmma": {"tile_kernel": "warp_mma"},
                         "partials": {"finish_max_groups": 0}, "atomic": {"finish_max_groups": 1 << 30}}
# ... and the suffixes that change the attention setting: "always" = santa at every length (no
# dense fallback below the plan's santa_min_length); setting suffixes may follow a kernel suffix and
# each other ("-warp-always", "-bn64-always")
# "bn64" = tiles of 64 rows (the setting's block_n; the default is spec.DEFAULT_BLOCK_N)
SANTA_SETTING_SUFFIXES = {"always": {"santa_min_length": 0}, "bn64": {"block_n": 64}}
SANTA_SUFFIX_OPTIONS = {**SANTA_KERNEL_SUFFIXES, **SANTA_SETTING_SUFFIXES}
# "-keys<P>[fb<FB>]" (santa): block key sampling on a feature-blocked K (santa_cupy.key_layout),
# blocks of FB features (16 or 32; KEY_BENCH_BLOCK without "fb"), rule "uniform" (every block's
# inclusion probability P / 100, so the K fraction read is P% in expectation: the speed at a given
# fraction, not an accuracy setting)
KEY_BENCH_BLOCK = 16
KEYS_SUFFIX = re.compile(r"keys([1-9][0-9]?|100)(?:fb(16|32))?")
# "-blocked" (dense): exact dense attention on the feature-blocked K (the layout's own cost)
# "-paged" / "-shuffled" (dense or santa): the same plan on a paged cache, pages of PAGE_ROWS rows
# (the contiguous cache seen as pages, as FlashInfer gets it), listed in order or shuffled
PAGED_SUFFIXES = ("paged", "shuffled")
SANTA_VERSIONS = KERNEL_VERSIONS + tuple(SANTA_SUFFIX_OPTIONS) + PAGED_SUFFIXES
DEFAULT_METHODS = ("dense", "dense-stream", "santa-global-systematic-256",
                   "santa-global-systematic-256-always", "santa-global-systematic-256-block",
                   "santa-fixed-systematic-2048", "santa-fixed-systematic-2048-always")
QUICK = {"shapes": ("llama8b",), "batches": (1, 16), "contexts": (32768,),
         "methods": DEFAULT_METHODS, "torch_backends": ("flash", "cudnn")}
# the dense peers of "x best peer" (method name -> label): cuDNN, FA2 (torch SDPA's flash backend), FlashInfer
PEERS = {"torch-cudnn": "cuDNN", "torch-flash": "FA2", "flashinfer": "FlashInfer"}
L2_FACTOR = 3                          # rotating buffers together >= L2_FACTOR x L2
MAX_COPIES = 64


@dataclass(frozen=True)
class Method:
    """What one benchmark row runs. kind: dense | santa (ours: ``setting``, a
    santa_cupy.AttentionSetting, plus kernel-choice overrides named by ``backend``) | torch (a
    torch SDPA ``backend``) | flashinfer. ``backend`` "" = the defaults, else a suffix of the name
    (KERNEL_VERSIONS, SANTA_SUFFIX_OPTIONS, PAGED_SUFFIXES, dense "p<N>")."""

    kind: str
    setting: AttentionSetting | None = None
    backend: str = ""

    def __post_init__(self):
        if self.kind == "dense" and self.setting is None:
            object.__setattr__(self, "setting", AttentionSetting(method="dense"))
        if self.kind == "santa" and (self.setting is None or self.setting.method != "santa"):
            raise ValueError(f"a santa method needs a santa AttentionSetting, got {self.setting!r}")

    @classmethod
    def santa(cls, budget, sampler, samples, backend="") -> "Method":
        return cls("santa", AttentionSetting(method="santa", budget=budget, sampler=sampler, samples=int(samples)),
                   backend)

    @property
    def budget(self) -> str:
        return self.setting.budget if self.kind == "santa" else ""

    @property
    def sampler(self) -> str:
        return self.setting.sampler if self.kind == "santa" else ""

    @property
    def samples(self) -> int:
        return self.setting.samples if self.kind == "santa" else 0

    @property
    def name(self) -> str:
        if self.kind == "santa":
            return f"santa-{self.budget}-{self.sampler}-{self.samples}" + (f"-{self.backend}" if self.backend else "")
        if self.kind == "torch":
            return f"torch-{self.backend}"
        if self.kind == "dense" and self.backend:
            return f"dense-{self.backend}"
        return self.kind

    @property
    def external(self) -> bool:
        return self.kind in ("torch", "flashinfer")

    @property
    def suffixes(self) -> tuple[str, ...]:
        """The name's suffixes after the setting ("warp-always" -> ("warp", "always"))."""
        return tuple(self.backend.split("-")) if self.backend else ()

    @property
    def paged(self) -> bool:
        return self.backend in PAGED_SUFFIXES

    @property
    def _keys(self):
        """The "-keys<P>[fb<FB>]" suffix's match (groups P, FB), else None."""
        return KEYS_SUFFIX.fullmatch(self.backend) if self.kind == "santa" else None

    @property
    def key_percent(self) -> int | None:
        """P of a "-keys<P>[fb<FB>]" method, else None."""
        return int(self._keys.group(1)) if self._keys else None

    @property
    def key_block(self) -> int:
        """FB of the blocked K: a "-keys<P>fb<FB>" method's, else KEY_BENCH_BLOCK."""
        m = self._keys
        return int(m.group(2)) if m and m.group(2) else KEY_BENCH_BLOCK

    @property
    def key_layout(self) -> str:
        """The plan's key layout: "blocked" for "-keys<P>" and dense "-blocked", else "standard"."""
        blocked = self.key_percent is not None or (self.kind == "dense" and self.backend == "blocked")
        return "blocked" if blocked else "standard"

    def plan_setting(self) -> AttentionSetting:
        """Our methods' attention setting, with the suffix's setting changes ("always", "keys<P>")."""
        if self.key_percent is not None:
            return self.setting.replace(key_sampling="bernoulli_block", key_block=self.key_block,
                                        key_budget=self.key_percent / 100, key_rule="uniform")
        if self.key_layout == "blocked":     # dense-blocked: the plan's FB is the inputs' (kernels.py)
            return self.setting.replace(key_block=KEY_BENCH_BLOCK)
        changes = {}
        for suffix in self.suffixes:
            changes.update(SANTA_SETTING_SUFFIXES.get(suffix, {}))
        return self.setting.replace(**changes)

    def kernel_choice(self):
        """Our methods' santa_cupy.kernel_choice.KernelChoice: the overrides the suffix names."""
        from santa_cupy.kernel_choice import KernelChoice

        kernel = self.suffixes[0] if self.suffixes else ""   # "<kernel>[-<setting>...]"
        if self.paged or not kernel or kernel in SANTA_SETTING_SUFFIXES or self.key_layout == "blocked":
            return KernelChoice()
        if self.kind == "dense":
            if kernel.startswith("p"):
                return KernelChoice(dense_splits=int(kernel[1:]))
            return KernelChoice(dense_kernel=kernel)
        if kernel in SANTA_KERNEL_SUFFIXES:
            return KernelChoice(**SANTA_KERNEL_SUFFIXES[kernel])
        return KernelChoice(score_kernel=kernel)             # a score-pass version


def parse_method(name: str) -> Method:
    """'dense' | 'dense-stream' | 'santa-<budget>-<sampler>-<S>' | 'torch-<backend>' | 'flashinfer' -> Method."""
    name = name.strip()
    if name in ("dense", "flashinfer"):
        return Method(name)
    if name.startswith("dense-") and name.removeprefix("dense-") in KERNEL_VERSIONS + PAGED_SUFFIXES + ("blocked",):
        return Method("dense", backend=name.removeprefix("dense-"))
    if re.fullmatch(r"dense-p[1-9][0-9]*", name):            # forced splits per KV group
        return Method("dense", backend=name.removeprefix("dense-"))
    parts = name.split("-")
    if parts[0] == "torch" and len(parts) == 2 and parts[1] in TORCH_BACKENDS:
        return Method("torch", backend=parts[1])
    keys = len(parts) == 5 and KEYS_SUFFIX.fullmatch(parts[4]) is not None
    # a kernel or setting suffix may carry setting suffixes after it: santa-global-systematic-256-warp-always
    combined = (len(parts) >= 6 and parts[4] in KERNEL_VERSIONS + tuple(SANTA_SUFFIX_OPTIONS)
                and all(x in SANTA_SETTING_SUFFIXES for x in parts[5:]) and len(set(parts[4:])) == len(parts[4:]))
    if parts[0] == "santa" and (len(parts) in (4, 5) and (len(parts) == 4 or parts[4] in SANTA_VERSIONS or keys)
                                or combined):
        budget, sampler, s = parts[1:4]
        if budget in spec.DECODE_BUDGETS and sampler in SAMPLERS and s.isdigit() and int(s) >= 1:
            try:
                setting = AttentionSetting.parse("-".join(parts[:4]))   # the setting's checks (one_pass: systematic)
            except ValueError as e:
                raise click.BadParameter(f"{name!r}: {e}", param_hint="--methods") from None
            return Method("santa", setting, backend="-".join(parts[4:]))
    raise click.BadParameter(
        f"unknown method {name!r}; expected dense, dense-stream, dense-mma, dense-p<splits>, dense-paged, dense-shuffled, "
        f"dense-blocked, flashinfer, torch-<{'|'.join(TORCH_BACKENDS)}> or "
        f"santa-<{'|'.join(BUDGETS)}>-<{'|'.join(SAMPLERS)}>-<samples>[-{'|-'.join(SANTA_VERSIONS)}|-keys<percent>[fb32]]"
        "[-always|-bn64 ...], "
        "e.g. santa-global-systematic-256 or santa-global-systematic-256-keys75",
        param_hint="--methods")


def method_list(names=None, *, full=False, quick=False, have_torch=False, have_flashinfer=False) -> list[Method]:
    """The methods of a run. Explicit names win; else --full / --quick / the default grid, with the
    external baselines that are importable (FlashInfer in every grid: it is one of the peers)."""
    if names:
        return [parse_method(n) for n in names]
    if full:
        ours = [Method("dense")] + [Method.santa(b, s, n) for b in BUDGETS for s in SAMPLERS
                                    for n in SAMPLE_COUNTS]
        backends = TORCH_BACKENDS
    elif quick:
        ours, backends = [parse_method(n) for n in QUICK["methods"]], QUICK["torch_backends"]
    else:
        ours, backends = [parse_method(n) for n in DEFAULT_METHODS], TORCH_BACKENDS
    ext = [Method("torch", backend=b) for b in backends] if have_torch else []
    if have_flashinfer:
        ext.append(Method("flashinfer"))
    return ours + ext


# ---- argument parsing --------------------------------------------------------------------------
_SUFFIX = {"k": 1024, "m": 1024 * 1024}


def parse_size(text: str, what: str = "context") -> int:
    """'32k' -> 32768, '1m' -> 1048576, '8192' -> 8192 (k and m are powers of two)."""
    t = str(text).strip().lower()
    mult = _SUFFIX.get(t[-1:], 1)
    digits = t[:-1] if t[-1:] in _SUFFIX else t
    if not digits.isdigit() or int(digits) < 1:
        raise click.BadParameter(f"{what} must be a positive integer with an optional k/m suffix "
                                 f"(e.g. 32k), got {text!r}", param_hint=f"--{what}")
    return int(digits) * mult


def parse_list(text: str, what: str, parse=None) -> list:
    """Comma-separated list; ``parse`` converts each item (default: positive int with k/m suffix)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    if not items:
        raise click.BadParameter(f"{what} must not be empty", param_hint=f"--{what}")
    parse = parse or (lambda x: parse_size(x, what))
    return [parse(x) for x in items]


def parse_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise click.BadParameter(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}", param_hint="--shape")
    return SHAPES[name]


def expand_grid(shapes, batches, contexts) -> list[tuple[Shape, int, int]]:
    """Every (shape, batch, context), in that nesting order."""
    return [(s, b, L) for s in shapes for b in batches for L in contexts]


"""santa-cupy benchmark harness (SPEC section 7): ``bench kernels`` and ``bench e2e``.

    santa-cupy bench kernels --quick --json bench.json --markdown bench.md
    santa-cupy bench e2e --context 32k --batch 1 --steps 20
    (or ``python3 bench.py kernels ...`` / ``python3 bench.py e2e ...``)

kernels: decode attention alone, one DecodePlan per (shape, batch, context, method), timed as a
captured CUDA graph of many launches over rotating random input buffers (together >= 3x L2), median
of many replays; the streaming-read and device-copy ceilings are measured in the same run; torch SDPA
(flash / cudnn / efficient backends) and FlashInfer (our cache seen as pages of 16 rows, tensor cores)
are the external dense baselines when importable; "x best peer" divides our rows against the fastest
of cuDNN, FA2 (torch flash) and FlashInfer at the same point.
e2e: one whole decode step of a Llama-3.1-8B-shaped model with random fp16 weights and a random KV
cache, captured as a CUDA graph, dense vs SANTA attention. What is counted is in docs/BENCHMARKS.md.

Everything above the "GPU" line is pure Python/NumPy and tested on CPU (tests/test_bench.py).
"""

from __future__ import annotations

import datetime
import json
import math
import re
import statistics
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import click

from llama_min.commands import KV_CACHE_LAYOUTS, check_output_path, kv_cache_page_size, kv_cache_report

# ---- one table of shapes, one list of methods ------------------------------------------------


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
BUDGETS = ("fixed", "global", "largest_remainder")
SAMPLERS = ("iid", "stratified", "systematic")
SAMPLE_COUNTS = (128, 256, 512, 2048)
TORCH_BACKENDS = ("flash", "cudnn", "efficient")
KERNEL_VERSIONS = ("stream", "mma")    # v2 (generic), v4 (santa_cupy.kernels); none = "auto"
# santa suffixes: a score-pass version, "block" = the v2 block-per-tile pass 2 (score "auto"; for
# the fixed budget the one fused pass), "tpw1" = the v4 kernels with one tile per warp
# (tiles_per_warp=1, as before runs of tiles), or the warp pass 2's gather forced: "warp" = 4 rows
# at a time in registers, "staged" = through shared memory (tile_kernel="warp_staged"), "warpmma"
# = staged and on tensor cores (tile_kernel="warp_mma"), or "always" = santa at every length (no
# dense fallback below the plan's santa_min_length)
SANTA_SUFFIX_OPTIONS = {"block": {"tile_kernel": "block"}, "tpw1": {"tiles_per_warp": 1},
                        "warp": {"tile_kernel": "warp"}, "staged": {"tile_kernel": "warp_staged"},
                        "warpmma": {"tile_kernel": "warp_mma"},
                        "always": {"santa_min_length": 0}}
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
DEFAULT_L2_BYTES = 60 * 10**6          # used when the device does not report its L2 size
L2_FACTOR = 3                          # rotating buffers together >= L2_FACTOR x L2
MAX_COPIES = 64


@dataclass(frozen=True)
class Method:
    """kind: dense | santa | torch | flashinfer. santa has budget/sampler/samples, torch a backend,
    dense and santa a kernel version or an option in `backend` ("" = the defaults, "stream" = the
    generic FMA kernels, SANTA_SUFFIX_OPTIONS)."""

    kind: str
    budget: str = ""
    sampler: str = ""
    samples: int = 0
    backend: str = ""

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


def parse_method(name: str) -> Method:
    """'dense' | 'dense-stream' | 'santa-<budget>-<sampler>-<S>' | 'torch-<backend>' | 'flashinfer' -> Method."""
    name = name.strip()
    if name in ("dense", "flashinfer"):
        return Method(name)
    if name.startswith("dense-") and name.removeprefix("dense-") in KERNEL_VERSIONS + PAGED_SUFFIXES:
        return Method("dense", backend=name.removeprefix("dense-"))
    if re.fullmatch(r"dense-p[1-9][0-9]*", name):            # forced splits per KV group
        return Method("dense", backend=name.removeprefix("dense-"))
    parts = name.split("-")
    if parts[0] == "torch" and len(parts) == 2 and parts[1] in TORCH_BACKENDS:
        return Method("torch", backend=parts[1])
    if parts[0] == "santa" and len(parts) in (4, 5) and (len(parts) == 4 or parts[4] in SANTA_VERSIONS):
        budget, sampler, s = parts[1:4]
        if budget in BUDGETS + ("one_pass",) and sampler in SAMPLERS and s.isdigit() and int(s) >= 1:
            return Method("santa", budget, sampler, int(s), backend=parts[4] if len(parts) == 5 else "")
    raise click.BadParameter(
        f"unknown method {name!r}; expected dense, dense-stream, dense-mma, dense-p<splits>, dense-paged, dense-shuffled, "
        f"flashinfer, torch-<{'|'.join(TORCH_BACKENDS)}> or "
        f"santa-<{'|'.join(BUDGETS)}>-<{'|'.join(SAMPLERS)}>-<samples>[-{'|-'.join(SANTA_VERSIONS)}], e.g. santa-global-systematic-256",
        param_hint="--methods")


def method_list(names=None, *, full=False, quick=False, have_torch=False, have_flashinfer=False) -> list[Method]:
    """The methods of a run. Explicit names win; else --full / --quick / the default grid, with the
    external baselines that are importable (FlashInfer in every grid: it is one of the peers)."""
    if names:
        return [parse_method(n) for n in names]
    if full:
        ours = [Method("dense")] + [Method("santa", b, s, n) for b in BUDGETS for s in SAMPLERS
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


# ---- bytes and derived numbers -------------------------------------------------------------------
def kv_bytes(shape: Shape, B: int, L: int) -> int:
    """K + V of all sequences at length L."""
    return 2 * B * L * shape.kv_heads * shape.head_dim * ITEMSIZE[shape.dtype]


def attention_bytes(method: Method, shape: Shape, B: int, L: int, rows_read: int | None = None) -> int:
    """Bytes a decode-attention call must move (see docs/BENCHMARKS.md, "Bytes").

    dense / external: K + V of all B*L rows, plus q read and o written.
    santa: K in full + rows_read (distinct V rows, summed over b and KV heads) * D * itemsize + q + o,
    plus, for the two-pass budgets (global, largest_remainder), the fp32 score stash written and
    read back: B*H*L*4*2 (not for fixed and one_pass). Tile partials and per-tile stats are not
    counted. one_pass: the plan's default hint, its previous call's lse."""
    isz, D, H, KVH = ITEMSIZE[shape.dtype], shape.head_dim, shape.heads, shape.kv_heads
    qo = 2 * B * H * D * isz
    if method.kind != "santa":
        return kv_bytes(shape, B, L) + qo
    if rows_read is None:
        raise ValueError("santa bytes need rows_read (distinct V rows read, summed over b and KV heads)")
    k = B * L * KVH * D * isz
    stash = 0 if method.budget in ("fixed", "one_pass") else B * H * L * 4 * 2   # one_pass: no stash
    return k + int(rows_read) * D * isz + qo + stash


def copies_for(bytes_per_copy: int, l2_bytes: int, budget_bytes: int) -> int:
    """How many rotating input copies: enough that they total >= L2_FACTOR x L2, at least 1, at most
    what fits ``budget_bytes`` (and MAX_COPIES). 0 = not even one copy fits."""
    if bytes_per_copy > budget_bytes:
        return 0
    want = max(1, math.ceil(L2_FACTOR * l2_bytes / bytes_per_copy))
    return min(want, budget_bytes // bytes_per_copy, MAX_COPIES)


PAGE_ROWS = 16          # FlashInfer's page size here: a realistic one (one page of L rows runs ~30x slower)


@dataclass(frozen=True)
class PagedLayout:
    """Our cache [B, L, KVH, D] as FlashInfer's paged cache ("NHD": [pages, page_rows, KVH, D]).

    Sequence b owns pages b*P .. b*P + P - 1 (P = pages_per_seq = ceil(L / page_rows)); its last page
    holds last_page_len rows. Each sequence takes `capacity` = P * page_rows rows: when that is L the
    pages are a free view of the contiguous cache, else the cache is copied (outside the timing) into
    a padded one whose rows beyond L no page reads."""

    batch: int
    length: int
    page_rows: int = PAGE_ROWS

    @property
    def pages_per_seq(self) -> int:
        return -(-self.length // self.page_rows)

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_rows

    @property
    def free_view(self) -> bool:
        return self.capacity == self.length

    def indptr(self):
        """kv_indptr [B + 1] (int32): sequence b's pages are indices[indptr[b]:indptr[b + 1]]."""
        import numpy as np
        P = self.pages_per_seq
        return np.arange(0, self.batch * P + 1, P, dtype=np.int32)

    def indices(self):
        """kv_indices [B * P] (int32): the pages in cache order."""
        import numpy as np
        return np.arange(self.batch * self.pages_per_seq, dtype=np.int32)

    def last_page_len(self):
        """kv_last_page_len [B] (int32), each in 1..page_rows."""
        import numpy as np
        return np.full(self.batch, self.length - (self.pages_per_seq - 1) * self.page_rows, dtype=np.int32)


def paged_cache(xp, cache, layout: PagedLayout):
    """cache [B, L, KVH, D] (an xp array) -> its pages [B * P, page_rows, KVH, D]: a view of `cache`
    when layout.free_view, else a copy of it into a zero-padded [B, capacity, KVH, D]."""
    B, L, KVH, D = cache.shape
    if (B, L) != (layout.batch, layout.length):
        raise ValueError(f"cache of {B} x {L} rows does not match the layout's {layout.batch} x {layout.length}")
    if not layout.free_view:
        padded = xp.zeros((B, layout.capacity, KVH, D), dtype=cache.dtype)
        padded[:, :L] = cache
        cache = padded
    return cache.reshape(B * layout.pages_per_seq, layout.page_rows, KVH, D)


def best_peer(rows: list[dict]):
    """(method, µs) of the fastest peer (PEERS) that ran among the rows of one point, or None."""
    timed = [(r["us"], r["method"]) for r in rows if r["method"] in PEERS and r.get("us")]
    if not timed:
        return None
    us, method = min(timed)
    return method, us


def add_derived(rows: list[dict], ceiling_tbps: float | None) -> list[dict]:
    """Fill tbps, pct_ceiling, x_dense (our dense us / this us), x_peer (for our rows: the fastest
    peer's us / this us, that peer in best_peer), x_external (best external us / this us) and
    x_dense_bound (our dense us / (this row's bytes at the ceiling): the largest x_dense its bytes
    allow) per (shape, B, L). Rows without a time (skipped) get None."""
    groups = {}
    for r in rows:
        groups.setdefault((r["shape"], r["B"], r["L"]), []).append(r)
    for group in groups.values():
        timed = [r for r in group if r.get("us")]
        dense = next((r["us"] for r in timed if r["method"] == "dense"), None)
        ext = [r["us"] for r in timed if r.get("external")]
        best_ext = min(ext) if ext else None
        peer = best_peer(group)
        for r in group:
            us = r.get("us")
            r["tbps"] = r["bytes"] / (us * 1e-6) / 1e12 if us and r.get("bytes") else None
            r["pct_ceiling"] = 100.0 * r["tbps"] / ceiling_tbps if r["tbps"] and ceiling_tbps else None
            r["x_dense"] = dense / us if us and dense else None
            r["x_external"] = best_ext / us if us and best_ext else None
            ours = not r.get("external")
            r["x_peer"] = peer[1] / us if us and peer and ours else None
            r["best_peer"] = peer[0] if peer and ours else None
            floor_us = r["bytes"] / (ceiling_tbps * 1e12) * 1e6 if r.get("bytes") and ceiling_tbps else None
            r["x_dense_bound"] = dense / floor_us if dense and floor_us and us else None
    return rows


# ---- formatting ----------------------------------------------------------------------------------
def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.3g} {unit}"
    return f"{int(n)} B"


def fmt_context(L: int) -> str:
    return f"{L // 1024}k" if L % 1024 == 0 else str(L)


def _f(x, spec, suffix=""):
    return "-" if x is None else f"{x:{spec}}{suffix}"


KERNEL_COLUMNS = ("shape", "method", "B", "L", "µs (median)", "bytes", "TB/s", "% ceiling",
                  "x our dense", "x best peer", "max x dense", "x best ext", "rows read", "note")


def _peer_cell(r) -> str:
    """'1.32x (cuDNN)': x best peer and who that peer was; '-' where no peer ran."""
    if r.get("x_peer") is None:
        return "-"
    return f"{r['x_peer']:.2f}x ({PEERS[r['best_peer']]})"


def kernel_table(rows: list[dict]) -> str:
    """Markdown table of kernel rows (after add_derived)."""
    lines = ["| " + " | ".join(KERNEL_COLUMNS) + " |", "|" + "---|" * len(KERNEL_COLUMNS)]
    for r in rows:
        cells = (r["shape"], r["method"], str(r["B"]), fmt_context(r["L"]), _f(r.get("us"), ".1f"),
                 fmt_bytes(r.get("bytes")), _f(r.get("tbps"), ".2f"), _f(r.get("pct_ceiling"), ".0f", "%"),
                 _f(r.get("x_dense"), ".2f", "x"), _peer_cell(r), _f(r.get("x_dense_bound"), ".2f", "x"),
                 _f(r.get("x_external"), ".2f", "x"), _f(r.get("rows_frac"), ".2%"), (r.get("note") or "").replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


E2E_COLUMNS = ("method", "B", "context", "ms/token", "tokens/s", "byte floor ms", "% of floor",
               "x dense", "rows read (last layer)", "note")


def e2e_table(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(E2E_COLUMNS) + " |", "|" + "---|" * len(E2E_COLUMNS)]
    for r in rows:
        cells = (r["method"], str(r["B"]), fmt_context(r["L"]), _f(r.get("ms"), ".2f"), _f(r.get("tok_s"), ".1f"),
                 _f(r.get("floor_ms"), ".2f"), _f(r.get("pct_floor"), ".0f", "%"), _f(r.get("x_dense"), ".2f", "x"),
                 _f(r.get("rows_frac"), ".2%"), (r.get("note") or "").replace("|", "/"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def header_markdown(meta: dict, ceiling: dict | None) -> str:
    out = [f"# santa-cupy bench {meta.get('command', '')}", ""]
    for key in ("gpu", "cupy", "torch", "flashinfer", "date", "commit", "timing", "model", "byte_floor_text",
                "weight_products", "programmatic_launch"):
        if meta.get(key) is not None:
            out.append(f"- {key}: {meta[key]}")
    if ceiling:
        out.append(f"- streaming read ceiling: {_f(ceiling.get('read_tbps'), '.2f')} TB/s "
                   f"({fmt_bytes(ceiling.get('read_bytes'))} buffers; {ceiling.get('read_launch', '')}); device copy: "
                   f"{_f(ceiling.get('copy_tbps'), '.2f')} TB/s (read + write)")
    return "\n".join(out) + "\n\n"


def run_metadata(command: str) -> dict:
    """Date and git commit (tolerating no git); GPU fields are added by gpu_metadata()."""
    commit = os.environ.get("SANTA_CUPY_COMMIT")      # set where the tree has no .git (device copies)
    if not commit:
        try:
            out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 timeout=10, cwd=Path(__file__).resolve().parent)
            commit = out.stdout.strip() if out.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            commit = None
    return {"command": command, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit}


def write_outputs(meta, ceiling, rows, table, *, json_path=None, markdown_path=None):
    text = header_markdown(meta, ceiling) + table
    click.echo(text)
    try:
        if markdown_path:
            Path(markdown_path).write_text(text)
        if json_path:
            Path(json_path).write_text(json.dumps({"meta": meta, "ceiling": ceiling, "rows": rows}, indent=1,
                                                  default=str))
    except OSError as e:
        raise click.ClickException(f"cannot write {e.filename or 'the results'}: {e.strerror or e}") from None


def _log(msg):
    click.echo(msg, err=True)


def _exc_line(exc, width=120) -> str:
    """'TypeName: first line of the message' (cut to width) for a row's note."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0][:width] if text else ''}"


# =================================== GPU (needs CuPy) ===========================================
def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as exc:  # ImportError, or no driver/device
        raise click.ClickException(f"the benchmarks need CuPy and a CUDA GPU ({type(exc).__name__}: {exc})")


def _optional_torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _optional_flashinfer():
    try:
        import flashinfer
        return flashinfer
    except Exception:
        return None


def gpu_metadata(cp, torch=None) -> dict:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"gpu": name, "cupy": cp.__version__, "torch": getattr(torch, "__version__", None),
            "l2_bytes": int(props.get("l2CacheSize", 0)) or DEFAULT_L2_BYTES,
            "sms": int(props["multiProcessorCount"])}


STREAM_READ_SRC = r"""
extern "C" __global__ void stream_read(const uint4* __restrict__ p, long long n, unsigned int* out) {
    unsigned int acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n; i += 4 * stride) {          // 4 independent 16-byte loads in flight
        uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
        acc += (a.x ^ b.y) + (c.z ^ d.w) + (a.y ^ b.z) + (c.w ^ d.x) + (a.z ^ b.w) + (c.x ^ d.y) + (a.w ^ b.x) + (c.y ^ d.z);
    }
    for (; i < n; i += stride) { uint4 a = p[i]; acc += a.x ^ a.y ^ a.z ^ a.w; }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if ((threadIdx.x & 31) == 0) atomicAdd(out, acc);      // keeps every load live
}
"""


def _event_median_us(cp, fn, stream, repeats=20, warmup=3, inner=1):
    for _ in range(warmup):
        fn()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(repeats):
        start.record(stream)
        for _ in range(inner):
            fn()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) * 1000.0 / inner)
    return statistics.median(times)


def _device_copy_us(cp, nbytes) -> float:
    """Median µs of a cudaMemcpyAsync device-to-device copy of nbytes (its buffers freed on return)."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        src = cp.arange(nbytes // 4, dtype=cp.uint32)
        dst = cp.empty_like(src)
        us = _event_median_us(cp, lambda: dst.data.copy_from_device_async(src.data, nbytes, stream), stream, repeats=10)
    stream.synchronize()
    return us


STREAM_LAUNCHES = ((1, 1024), (2, 1024), (4, 512), (8, 256), (16, 256))   # (blocks per SM, threads)


def stream_read_us(cp, nbytes, copies, launches=STREAM_LAUNCHES, inner=8, repeats=15) -> dict:
    """µs of one streaming read (stream_read) of nbytes per launch shape (blocks per SM, threads),
    timed as the kernels are: a CUDA graph of `inner` reads rotating over `copies` buffers (so that
    with enough bytes nothing is served from L2), warm-up replays, median of `repeats`."""
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    kernel = cp.RawKernel(STREAM_READ_SRC, "stream_read")
    bufs = [cp.arange(nbytes // 4, dtype=cp.uint32) + i for i in range(copies)]   # never zeros
    out = cp.zeros((1,), cp.uint32)
    n16 = cp.int64(nbytes // 16)
    times = {}
    for per_sm, threads in launches:
        reads = [lambda b=b: kernel((sms * per_sm,), (threads,), (b, n16, out)) for b in bufs]
        times[(per_sm, threads)] = time_cupy_graph(cp, reads, n_inner=inner, repeats=repeats, warmup=3)[0]
    return times


def measure_ceiling(cp, read_bytes=2 << 30, copy_bytes=2 << 30, buffers=2, launches=8) -> dict:
    """Streaming read (own kernel, 16-byte loads, grid-stride, reduction) and device-to-device copy
    (cudaMemcpyAsync; read + write counted), in TB/s. The read is timed as the kernels are
    (stream_read_us: a graph of `launches` reads over `buffers` rotating buffers of read_bytes);
    best of the launch shapes."""
    times = stream_read_us(cp, read_bytes, buffers, inner=launches)
    (per_sm, threads), us = min(times.items(), key=lambda kv: kv[1])
    cp.get_default_memory_pool().free_all_blocks()                  # the read buffers
    copy_us = _device_copy_us(cp, copy_bytes)
    cp.get_default_memory_pool().free_all_blocks()
    return {"read_tbps": read_bytes / (us * 1e-6) / 1e12, "read_bytes": read_bytes,
            "read_launch": f"{per_sm} blocks/SM x {threads} threads, graph of {launches} over {buffers} buffers",
            "copy_tbps": 2 * copy_bytes / (copy_us * 1e-6) / 1e12, "copy_bytes": copy_bytes}


def random_array(cp, shape, dtype, scale=1.0, chunk=1 << 27):
    """Random normal values (never zeros) of a storage dtype: bfloat16 -> uint16 bit patterns
    (float32 truncated), float16, float32. Generated in chunks to bound the float32 temporary."""
    out = cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else dtype)
    flat = out.reshape(-1)
    for i in range(0, flat.size, chunk):
        x = cp.random.standard_normal(min(chunk, flat.size - i), dtype=cp.float32)
        if scale != 1.0:
            x *= scale
        flat[i:i + x.size] = (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(dtype)
    return out


def time_cupy_graph(cp, fns, n_inner, repeats, warmup=3):
    """Median µs per call of fns[i % len(fns)] (i < n_inner), captured as one CUDA graph on a
    non-default stream and replayed; eager launches timed with events if capture fails.
    -> (µs, "graph" | "eager: <why>")."""
    cp.cuda.Device().synchronize()                       # inputs were made on the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for f in fns:                                    # compile, set smem limits, fill pools
            f()
        stream.synchronize()
        mode, graph = "graph", None
        try:
            stream.begin_capture()
            try:
                for i in range(n_inner):
                    fns[i % len(fns)]()
            finally:
                graph = stream.end_capture()
            run = lambda: graph.launch(stream)  # noqa: E731
        except Exception as exc:
            mode = f"eager: capture failed ({type(exc).__name__}: {str(exc)[:80]})"

            def run():
                for i in range(n_inner):
                    fns[i % len(fns)]()
        us = _event_median_us(cp, run, stream, repeats=repeats, warmup=warmup) / n_inner
    return us, mode


def time_torch_graph(torch, fns, n_inner, repeats, warmup=3):
    """As time_cupy_graph, with torch.cuda.CUDAGraph and torch.cuda.Event."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for f in fns:
                f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    mode = "graph"
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(n_inner):
                fns[i % len(fns)]()
        run = graph.replay
    except Exception as exc:
        torch.cuda.synchronize()
        mode = f"eager: capture failed ({type(exc).__name__}: {str(exc)[:80]})"

        def run():
            for i in range(n_inner):
                fns[i % len(fns)]()
    for _ in range(warmup):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / n_inner)
    return statistics.median(times), mode


def make_inputs(cp, shape: Shape, B: int, L: int, n: int) -> list[tuple]:
    """n rotating copies of (q [B,H,D], k [B,L,KVH,D], v [B,L,KVH,D]) of random normal data."""
    out = []
    for _ in range(n):
        q = random_array(cp, (B, shape.heads, shape.head_dim), shape.dtype)
        k = random_array(cp, (B, L, shape.kv_heads, shape.head_dim), shape.dtype)
        v = random_array(cp, (B, L, shape.kv_heads, shape.head_dim), shape.dtype)
        out.append((q, k, v))
    return out


def our_plan(method: Method, shape: Shape, B: int, L: int):
    """The DecodePlan of one of our methods (dense kernel version or santa settings)."""
    from santa_cupy import DecodePlan

    paged = method.backend in PAGED_SUFFIXES
    if paged:
        kw = dict(method=method.kind, page_size=PAGE_ROWS)
        if method.kind == "santa":
            kw.update(samples=method.samples, sampler=method.sampler, budget=method.budget)
    elif method.kind == "dense" and method.backend.startswith("p"):
        kw = dict(method="dense", dense_splits=int(method.backend[1:]))
    elif method.kind == "dense":
        kw = dict(method="dense", dense_kernel=method.backend or "auto")
    else:
        kw = dict(method="santa", samples=method.samples, sampler=method.sampler, budget=method.budget)
        if method.backend in SANTA_SUFFIX_OPTIONS:
            kw.update(SANTA_SUFFIX_OPTIONS[method.backend])
        elif method.backend:                         # a score-pass version
            kw["score_kernel"] = method.backend
    return DecodePlan(batch=B, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_length=L, dtype=shape.dtype, **kw)


def bench_ours(cp, method: Method, shape: Shape, B: int, L: int, inputs, n_inner, repeats) -> dict:
    """One DecodePlan; plan.run(q, k, v, lengths, validate=False) over the rotating inputs. The RNG
    step is NOT advanced inside the timed graph (each input copy draws its own samples anyway)."""
    plan = our_plan(method, shape, B, L)
    lengths = cp.full((B,), L, dtype=cp.int32)
    table = None
    if method.backend in PAGED_SUFFIXES:         # the caches as pages (a free view when L % PAGE_ROWS == 0)
        import numpy as np
        layout = PagedLayout(B, L)
        ids = layout.indices()
        if method.backend == "shuffled":
            ids = np.random.default_rng(0).permutation(ids).astype(np.int32)
        table = cp.asarray(ids.reshape(B, layout.pages_per_seq))
        inputs = [(q, paged_cache(cp, k, layout), paged_cache(cp, v, layout)) for q, k, v in inputs]
        plan.run(*inputs[0], lengths, block_table=table)           # validated once
    fns = [lambda q=q, k=k, v=v: plan.run(q, k, v, lengths, validate=False, block_table=table) for q, k, v in inputs]
    us, mode = time_cupy_graph(cp, fns, n_inner, repeats)
    rows_read = None
    if method.kind == "santa":
        q, k, v = inputs[0]
        plan.run(q, k, v, lengths, validate=False, block_table=table)
        rows_read = int(plan.info().rows_read.sum())     # int() syncs the default stream
    return {"us": us, "timing": mode, "rows_read": rows_read,
            "rows_frac": rows_read / (B * L * shape.kv_heads) if rows_read is not None else 1.0}


TORCH_BACKEND_ENUM = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def as_torch(torch, a, dtype: str):
    """A CuPy array of storage dtype `dtype` as a torch tensor over the same memory (no copy). bf16
    (uint16 bit patterns here) goes through int16 so that DLPack and .view(bfloat16) are both plain."""
    if dtype == "bfloat16":
        return torch.from_dlpack(a.view("int16")).view(torch.bfloat16)
    return torch.from_dlpack(a)


def torch_inputs(torch, inputs, shape: Shape, repeat_kv: int = 1):
    """Our copies -> torch q [B,H,1,D], k/v [B,KVH*repeat,L,D] (transposed/copied once, outside any
    timing)."""
    def conv(a):
        return as_torch(torch, a, shape.dtype)

    out = []
    for q, k, v in inputs:
        tk, tv = (conv(x).transpose(1, 2).contiguous() for x in (k, v))
        if repeat_kv > 1:
            tk, tv = tk.repeat_interleave(repeat_kv, dim=1), tv.repeat_interleave(repeat_kv, dim=1)
        out.append((conv(q).unsqueeze(2), tk, tv))
    return out


def bench_torch(torch, cp, method: Method, shape: Shape, B, L, inputs, n_inner, repeats, budget_bytes, l2) -> dict:
    """torch SDPA with one backend; enable_gqa=True, else KV heads repeated outside the timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = getattr(SDPBackend, TORCH_BACKEND_ENUM[method.backend])
    cp.cuda.Device().synchronize()
    G = shape.heads // shape.kv_heads
    attempts = [(True, 1)] + ([(False, G)] if G > 1 else [])
    errors = []
    for gqa, rep in attempts:
        n = copies_for(kv_bytes(shape, B, L) * rep, l2, budget_bytes) if rep > 1 else len(inputs)
        if n == 0:
            errors.append(f"repeated KV does not fit {fmt_bytes(budget_bytes)}")
            continue
        try:
            tins = torch_inputs(torch, inputs[:n], shape, rep)
            kw = {"enable_gqa": True} if gqa else {}
            with sdpa_kernel(backend):
                fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, **kw) for q, k, v in tins]
                fns[0]()
                torch.cuda.synchronize()
                us, mode = time_torch_graph(torch, fns, n_inner, repeats)
            note = "enable_gqa" if gqa else f"KV repeated x{rep} outside timing (reads {rep}x bytes)"
            return {"us": us, "timing": mode, "note": note}
        except Exception as exc:
            errors.append(f"{'enable_gqa' if gqa else 'repeat_kv'}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        finally:
            tins = fns = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return {"us": None, "note": "skipped: " + "; ".join(errors)}


FLASHINFER_WORKSPACE_BYTES = 128 << 20     # the float workspace FlashInfer's docs recommend
FLASHINFER_CHECK_TOLERANCE = 2e-2          # relative L2 error of its output against reference_decode
# why FlashInfer could not plan at the first point of this process (its JIT build or import broken):
# later points skip it instead of paying a failing build each
_flashinfer_broken = {"planned": False, "why": None}


def bf16_to_float32(xp, bits):
    """uint16 bf16 bit patterns -> float32 values (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def reference_decode(xp, q, k, v, b: int, dtype: str):
    """Exact decode attention of sequence b in float32: q [B, H, D], k/v [B, L, KVH, D] (storage
    dtype `dtype`, xp arrays) -> o [H, D]; GQA groups of H / KVH consecutive query heads."""
    f32 = (lambda a: bf16_to_float32(xp, a)) if dtype == "bfloat16" else (lambda a: a.astype(xp.float32))
    H, D = q.shape[1:]
    KVH = k.shape[2]
    qb = f32(q[b]).reshape(KVH, H // KVH, D)
    s = xp.einsum("kgd,lkd->kgl", qb, f32(k[b])) / math.sqrt(D)
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return xp.einsum("kgl,lkd->kgd", p, f32(v[b])).reshape(H, D)


def relative_error(xp, got, want) -> float:
    return float(xp.linalg.norm((got - want).ravel()) / xp.linalg.norm(want.ravel()))


def flashinfer_decode(torch, flashinfer, shape: Shape, layout: PagedLayout, device):
    """A planned BatchDecodeWithPagedKVCacheWrapper (FlashInfer 0.6.13's API) for our cache seen as
    `layout`: NHD pages, tensor cores, no soft cap / window / RoPE, scale 1/sqrt(D). plan() copies
    the page table to the host (a sync), so it runs here, once, outside any timing."""
    tdt = torch.bfloat16 if shape.dtype == "bfloat16" else getattr(torch, shape.dtype)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)   # zeroed: first use
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)

    def table(a):
        return torch.from_numpy(a).to(device)

    wrapper.plan(table(layout.indptr()), table(layout.indices()), table(layout.last_page_len()),
                 shape.heads, shape.kv_heads, shape.head_dim, layout.page_rows,
                 q_data_type=tdt, kv_data_type=tdt)
    return wrapper


def bench_flashinfer(torch, flashinfer, cp, shape: Shape, B, L, inputs, n_inner, repeats, pdl=False) -> dict:
    """FlashInfer batch decode over the rotating inputs, our [B, L, KVH, D] cache seen as B*ceil(L/16)
    pages of 16 rows (PagedLayout), timed as ours are (time_torch_graph: a graph of n_inner run()s,
    eager if capture fails). Its output on the first copy is checked against reference_decode for
    the first and last sequence (a wrong page table would time garbage) before any timing."""
    if _flashinfer_broken["why"]:
        return {"us": None, "note": f"skipped: FlashInfer did not plan at this run's first point ({_flashinfer_broken['why']})"}
    layout = PagedLayout(B, L)
    device = torch.device("cuda", cp.cuda.Device().id)
    wrapper = None
    try:
        try:
            wrapper = flashinfer_decode(torch, flashinfer, shape, layout, device)
        except Exception as exc:
            if not _flashinfer_broken["planned"]:
                _flashinfer_broken["why"] = _exc_line(exc, 80)
            raise
        _flashinfer_broken["planned"] = True
        pages = [(as_torch(torch, q, shape.dtype), as_torch(torch, paged_cache(cp, k, layout), shape.dtype),
                  as_torch(torch, paged_cache(cp, v, layout), shape.dtype)) for q, k, v in inputs]
        out = torch.empty((B, shape.heads, shape.head_dim), dtype=pages[0][0].dtype, device=device)

        def call(q, k, v):
            return wrapper.run(q, (k, v), out=out, enable_pdl=pdl)

        call(*pages[0])
        torch.cuda.synchronize()
        got = cp.from_dlpack(out.view(torch.int16) if shape.dtype == "bfloat16" else out)
        got = bf16_to_float32(cp, got.view(cp.uint16)) if shape.dtype == "bfloat16" else got.astype(cp.float32)
        q0, k0, v0 = inputs[0]
        err = max(relative_error(cp, got[b], reference_decode(cp, q0, k0, v0, b, shape.dtype)) for b in {0, B - 1})
        if not err <= FLASHINFER_CHECK_TOLERANCE:
            return {"us": None, "check_error": err,
                    "note": f"failed: output differs from the exact reference (relative error {err:.3g})"}
        fns = [lambda q=q, k=k, v=v: call(q, k, v) for q, k, v in pages]
        us, mode = time_torch_graph(torch, fns, n_inner, repeats)
        view = "a free view" if layout.free_view else f"K/V copied to {layout.capacity}-row capacity outside timing"
        return {"us": us, "timing": mode, "check_error": err,
                "note": f"flashinfer {getattr(flashinfer, '__version__', '?')}: {layout.pages_per_seq} pages of "
                        f"{layout.page_rows} rows per sequence ({view}), tensor cores, pdl {'on' if pdl else 'off'}"}
    except Exception as exc:
        import traceback
        _log(f"flashinfer B={B} L={L}: {traceback.format_exc()}")     # a JIT build's whole log
        return {"us": None, "note": f"failed: {_exc_line(exc)}"}
    finally:
        wrapper = pages = out = fns = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def bench_config(cp, torch, flashinfer, shape, B, L, methods, *, l2, budget_bytes, n_inner, repeats,
                 pdl=False) -> list[dict]:
    """All methods of one (shape, B, L) on the same rotating inputs."""
    base = {"shape": shape.name, "B": B, "L": L}
    n = copies_for(kv_bytes(shape, B, L), l2, budget_bytes)
    if n == 0:
        return [dict(base, method=m.name, external=m.external, bytes=None, us=None,
                     note=f"skipped: K+V {fmt_bytes(kv_bytes(shape, B, L))} > --mem-gb") for m in methods]
    inputs = make_inputs(cp, shape, B, L, n)
    n_inner = n * math.ceil(n_inner / n)       # every copy equally often in one graph
    rows = []
    for m in methods:
        row = dict(base, method=m.name, external=m.external, copies=n, inner=n_inner)
        try:
            if m.kind in ("dense", "santa"):
                row.update(bench_ours(cp, m, shape, B, L, inputs, n_inner, repeats))
            elif m.kind == "torch" and torch is not None:
                row.update(bench_torch(torch, cp, m, shape, B, L, inputs, n_inner, repeats, budget_bytes, l2))
            elif m.kind == "flashinfer" and flashinfer is not None and torch is not None:
                row.update(bench_flashinfer(torch, flashinfer, cp, shape, B, L, inputs, n_inner, repeats, pdl))
            else:
                row.update(us=None, note=f"skipped: {m.kind} not importable")
        except Exception as exc:
            row.update(us=None, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        have_rows = m.kind != "santa" or row.get("rows_read") is not None
        row["bytes"] = attention_bytes(m, shape, B, L, row.get("rows_read")) if have_rows else None
        if row.get("timing", "graph") != "graph":
            row["note"] = ((row.get("note") or "") + " " + row["timing"]).strip()
        rows.append(row)
    del inputs
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    return rows


def plot_rows(rows, path):
    """PNG of kernel rows (after add_derived): per (shape, B) a column of two panels against context,
    latency (µs) on top and speedup over our dense ("x our dense") below. Needs matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        _log("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    panels = sorted({(r["shape"], r["B"]) for r in rows})
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 7), squeeze=False, sharex="col")
    for col, (shape, B) in enumerate(panels):
        latency, speedup = axes[0][col], axes[1][col]
        for m in dict.fromkeys(r["method"] for r in rows):
            mine = sorted((r for r in rows if (r["shape"], r["B"], r["method"]) == (shape, B, m) and r.get("us")),
                          key=lambda r: r["L"])
            if not mine:
                continue
            contexts = [r["L"] for r in mine]
            line, = latency.plot(contexts, [r["us"] for r in mine], marker="o", label=m)
            if m != "dense" and all(r.get("x_dense") for r in mine):     # a method keeps its colour
                speedup.plot(contexts, [r["x_dense"] for r in mine], marker="o", label=m, color=line.get_color())
        latency.set(xscale="log", yscale="log", ylabel="µs", title=f"{shape} B={B}")
        latency.legend(fontsize=6)
        speedup.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        speedup.set(xscale="log", xlabel="context", ylabel="x our dense")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    _log(f"plot written to {path}")


# ---- click ---------------------------------------------------------------------------------------
@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """Benchmarks: decode-attention kernels and end-to-end decode (GPU, CuPy)."""


@bench.command("kernels")
@click.option("--batch", default="1,4,16", show_default=True, help="Comma-separated batch sizes.")
@click.option("--context", default="8k,32k,128k", show_default=True, help="Comma-separated context lengths (k = 1024).")
@click.option("--shape", "shapes", default="llama8b", show_default=True, help=f"Comma-separated: {', '.join(SHAPES)}.")
@click.option("--methods", default=None, help="Comma-separated methods (dense, santa-<budget>-<sampler>-<S>, "
              "torch-<flash|cudnn|efficient>, flashinfer). Default: dense, santa-global-systematic-256, "
              "santa-fixed-systematic-2048, torch SDPA backends and flashinfer when importable.")
@click.option("--full", is_flag=True, help="The whole method grid (3 budgets x 3 samplers x S in 128/256/512/2048).")
@click.option("--quick", is_flag=True, help="llama8b, batch 1 and 16, context 32k, dense / two santa / torch "
                                           "flash+cudnn / flashinfer.")
@click.option("--repeats", type=click.IntRange(min=3), default=30, show_default=True, help="Timed graph replays (median).")
@click.option("--inner", type=click.IntRange(min=1), default=20, show_default=True, help="Launches per captured graph.")
@click.option("--mem-gb", type=click.FloatRange(min=1), default=20.0, show_default=True,
              help="Budget for the rotating K/V copies of one configuration (torch copies come on top).")
@click.option("--no-ceiling", is_flag=True, help="Skip the streaming-read / copy ceiling measurement.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path, help="PNG plot (needs matplotlib).")
@click.option("--pdl", is_flag=True, help="Launch our kernels with programmatic dependent launch "
                                         "(kernels.set_programmatic_launch; sm_90+): each call overlaps the previous.")
def kernels_command(batch, context, shapes, methods, full, quick, repeats, inner, mem_gb, no_ceiling, pdl,
                    json_path, markdown_path, plot_path):
    """Decode-attention kernels vs our dense and external dense baselines."""
    if full and quick:
        raise click.UsageError("--full and --quick exclude each other")
    shape_list = parse_list(shapes, "shape", parse_shape)
    batches, contexts = parse_list(batch, "batch"), parse_list(context, "context")
    if quick:
        shape_list, batches, contexts = [SHAPES[s] for s in QUICK["shapes"]], list(QUICK["batches"]), list(QUICK["contexts"])
    names = parse_list(methods, "methods", str) if methods else None
    for n in names or ():
        parse_method(n)                   # argument errors before touching the GPU
    cp = _cupy()
    torch, flashinfer = _optional_torch(), _optional_flashinfer()
    method_objs = method_list(names, full=full, quick=quick, have_torch=torch is not None,
                              have_flashinfer=flashinfer is not None and torch is not None)
    meta = dict(run_metadata("kernels"), **gpu_metadata(cp, torch),
                timing=f"CUDA graph of >= {inner} launches over rotating inputs (>= {L2_FACTOR}x L2), "
                       f"median of {repeats} replays")
    meta["flashinfer"] = getattr(flashinfer, "__version__", None) if flashinfer else None
    ceiling = None
    if not no_ceiling:
        _log("measuring the streaming-read and copy ceilings ...")
        ceiling = measure_ceiling(cp)
    grid = expand_grid(shape_list, batches, contexts)
    rows = []
    from santa_cupy import kernels
    meta["programmatic_launch"] = kernels.set_programmatic_launch(pdl)
    try:
        with click.progressbar(grid, label="kernels", file=sys.stderr,
                               item_show_func=lambda c: c and f"{c[0].name} B={c[1]} L={fmt_context(c[2])}") as bar:
            for shape, B, L in bar:
                rows += bench_config(cp, torch, flashinfer, shape, B, L, method_objs, l2=meta["l2_bytes"],
                                     budget_bytes=int(mem_gb * 1e9), n_inner=inner, repeats=repeats, pdl=pdl)
    finally:
        kernels.set_programmatic_launch(False)
    add_derived(rows, ceiling and ceiling["read_tbps"])
    write_outputs(meta, ceiling, rows, kernel_table(rows), json_path=json_path, markdown_path=markdown_path)
    if plot_path:
        plot_rows(rows, plot_path)


def stage_rows(cp, shape, B, L, method: Method, *, l2, budget_bytes, n_inner, repeats) -> list[dict]:
    """µs of each pipeline stage of one of our methods alone (DecodePlan.stage_launchers), on the
    same rotating inputs as `kernels`, plus the whole call for comparison."""
    n = copies_for(kv_bytes(shape, B, L), l2, budget_bytes)
    if n == 0:
        raise click.UsageError(f"K+V {fmt_bytes(kv_bytes(shape, B, L))} > --mem-gb")
    inputs = make_inputs(cp, shape, B, L, n)
    n_inner = n * math.ceil(n_inner / n)
    plan = our_plan(method, shape, B, L)
    lengths = cp.full((B,), L, dtype=cp.int32)
    whole = [lambda q=q, k=k, v=v: plan.run(q, k, v, lengths, validate=False) for q, k, v in inputs]
    us, _ = time_cupy_graph(cp, whole, n_inner, repeats)
    rows = [{"stage": "whole call", "us": us}]
    per_copy = [plan.stage_launchers(q, k, v, lengths) for q, k, v in inputs]
    for name in per_copy[0]:
        fns = [stages[name] for stages in per_copy]
        us, _ = time_cupy_graph(cp, fns, n_inner, repeats)
        rows.append({"stage": name, "us": us})
    total = sum(r["us"] for r in rows[1:])
    for r in rows:
        r["share"] = r["us"] / total if total else None
    return rows


def stage_table(title: str, rows: list[dict]) -> str:
    lines = [f"### {title}", "", "| stage | µs | share of the sum of stages |", "|---|---|---|"]
    for r in rows:
        share = "-" if r["stage"] == "whole call" or r["share"] is None else f"{100 * r['share']:.0f}%"
        lines.append(f"| {r['stage']} | {r['us']:.1f} | {share} |")
    return "\n".join(lines) + "\n"


@bench.command("stages")
@click.option("--batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--context", default="32k", show_default=True)
@click.option("--shape", "shape_name", default="llama8b", show_default=True, help=f"One of: {', '.join(SHAPES)}.")
@click.option("--methods", default="dense,santa-global-systematic-256-always,santa-global-systematic-256-block,"
              "santa-fixed-systematic-2048-always",
              show_default=True, help="Comma-separated methods of ours.")
@click.option("--repeats", type=click.IntRange(min=3), default=20, show_default=True)
@click.option("--inner", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--mem-gb", type=click.FloatRange(min=1), default=20.0, show_default=True)
def stages_command(batch, context, shape_name, methods, repeats, inner, mem_gb):
    """Time each stage of our kernels' pipelines alone (where the time goes)."""
    shape = parse_shape(shape_name)
    L = parse_size(context)
    method_objs = [parse_method(n) for n in parse_list(methods, "methods", str)]
    for m in method_objs:
        if m.external:
            raise click.BadParameter(f"{m.name} is not one of ours", param_hint="--methods")
    cp = _cupy()
    l2 = gpu_metadata(cp, None)["l2_bytes"]
    for m in method_objs:
        rows = stage_rows(cp, shape, batch, L, m, l2=l2, budget_bytes=int(mem_gb * 1e9), n_inner=inner,
                          repeats=repeats)
        click.echo(stage_table(f"{m.name}, {shape.name}, B={batch}, L={fmt_context(L)}", rows))


# =================================== end to end ==================================================
@dataclass(frozen=True)
class ModelShape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


LLAMA8B_MODEL = ModelShape()
E2E_ITEMSIZE = 2  # fp16 weights and KV cache (cuBLAS fp16 GEMMs; CuPy has no bf16 matmul)


def weight_shapes(m: ModelShape) -> dict[str, tuple[int, int]]:
    """The decode step's weight matrices [N, K] (llama_min's fused QKV and gate/up layout)."""
    d, HD, KD, I = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.intermediate
    return {"qkv": (HD + 2 * KD, d), "o": (d, HD), "gate_up": (2 * I, d), "down": (d, I), "lm_head": (m.vocab, d)}


def e2e_bytes(m: ModelShape, B: int, L: int) -> dict:
    """Byte floor of one decode step: every weight read once (layers + final norm + lm_head; one
    embedding row per sequence), and K + V of every layer at length L."""
    d, KD = m.hidden, m.kv_heads * m.head_dim
    shapes = weight_shapes(m)
    per_layer = sum(N * K for name, (N, K) in shapes.items() if name != "lm_head") * E2E_ITEMSIZE + 2 * d * 4
    weights = m.layers * per_layer + math.prod(shapes["lm_head"]) * E2E_ITEMSIZE + d * 4 + B * d * E2E_ITEMSIZE
    kv = m.layers * 2 * B * L * KD * E2E_ITEMSIZE
    return {"weights": weights, "kv": kv, "total": weights + kv}


def e2e_memory(m: ModelShape, B: int, L_max: int) -> int:
    """Device memory of the random model: weights incl. embedding, KV cache, rotary tables."""
    return (e2e_bytes(m, B, L_max)["total"] + m.vocab * m.hidden * E2E_ITEMSIZE
            + L_max * m.head_dim * 4)


def e2e_derived(rows: list[dict], ceiling_tbps: float | None, floor_bytes: int) -> list[dict]:
    dense = next((r["ms"] for r in rows if r["method"] == "dense" and r.get("ms")), None)
    for r in rows:
        ms = r.get("ms")
        r["tok_s"] = r["B"] * 1000.0 / ms if ms else None
        r["floor_ms"] = floor_bytes / (ceiling_tbps * 1e12) * 1e3 if ceiling_tbps else None
        r["pct_floor"] = 100.0 * r["floor_ms"] / ms if ms and r["floor_ms"] else None
        r["x_dense"] = dense / ms if ms and dense else None
    return rows


def random_llama(cp, m: ModelShape, B: int, L: int, L_max: int, page_size: int | None = None):
    """-> (llama_min LlamaModel, KVCache): the e2e model when no --model is given. Random fp16
    weights generated on the GPU (no download), unit norms, and a cache of random fp16 K/V
    holding L tokens of every sequence (no prefill; paged with page_size: see _fill_random_kv).
    The decode step is llama_min's own."""
    from llama_min.config import LlamaConfig
    from llama_min.model import LlamaModel

    cfg = LlamaConfig(hidden_size=m.hidden, intermediate_size=m.intermediate, num_hidden_layers=m.layers,
                      num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
                      rms_norm_eps=m.eps, rope_theta=m.rope_theta, rope_scaling=None, max_position_embeddings=L_max,
                      vocab_size=m.vocab, tie_word_embeddings=False, bos_token_id=None,
                      source="bench e2e (random weights)")
    d, shapes = m.hidden, weight_shapes(m)

    def w(name):
        rows, cols = shapes[name]
        return random_array(cp, (rows, cols), "float16", scale=1.0 / math.sqrt(cols))

    layers = [{"attn_norm": cp.ones((d,), cp.float32), "wqkv": w("qkv"), "wo": w("o"),
               "mlp_norm": cp.ones((d,), cp.float32), "w_gu": w("gate_up"), "w_down": w("down")}
              for _ in range(m.layers)]
    weights = {"embed": w("lm_head"), "lm_head": w("lm_head"),       # embed: [vocab, d], as lm_head
               "norm": cp.ones((d,), cp.float32), "layers": layers}
    model = LlamaModel(cfg, weights, cp, "gpu", "float16", "float16")
    cache = e2e_cache(model, B, L_max, page_size)
    _fill_random_kv(cp, model, cache, L)
    return model, cache


E2E_PAGE_SEED = 0      # the paged cache's page order: a shuffled pool, as a serving stack's after churn


def e2e_cache(model, B: int, L_max: int, page_size: int | None):
    """The e2e cache: contiguous, or paged (pages of page_size rows from a pool in shuffled order,
    so every sequence's block table is a random, non-contiguous list of pages)."""
    if page_size is None:
        return model.new_cache(B, L_max)
    return model.new_cache(B, L_max, page_size=page_size, page_seed=E2E_PAGE_SEED)


def _fill_random_kv(cp, model, cache, L):
    """Random K/V in every layer of the cache (never zeros: a paged cache's whole page pool), which
    then holds L tokens (paged: their pages reserved, in the pool's shuffled order)."""
    cache.reserve(L)
    for layer in range(len(cache.k)):
        for kv in (cache.k[layer], cache.v[layer]):
            kv[...] = random_array(cp, kv.shape, model.kv_dtype).view(kv.dtype)
    cache.lengths[...] = L
    cache.length = L


PRODUCT_METHODS = ("cublas", "gemv", "gemv-rows")      # gemv = decoder_ops v2 "split", gemv-rows = v1


def _product_fn(method, x, w, y, cublas):
    """One weight product y (float32) += x @ w.T by method (the residual update's form), for
    time_cupy_graph; cublas: a llama_min _CublasGemm."""
    if method == "cublas":
        return lambda: cublas(x, w, accumulate_into=y)
    from santa_cupy import decoder_ops
    kernel = "split" if method == "gemv" else "rows"
    return lambda: decoder_ops.gemv(x, w, out=y, accumulate=True, kernel=kernel)


def time_steps(cp, run, stream, steps, warmup):
    """Median and min ms of single decode steps (each timed with its own events)."""
    for _ in range(warmup):
        run()
    times = []
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(steps):
        start.record(stream)
        run()
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return statistics.median(times), min(times)


def _e2e_rows(cp, model, cache, L, steps, warmup, methods, gemv=None, graph=True, programmatic=True):
    """Time llama_min's decode step for each method over the same weights and cache, reset to
    L tokens before each method: a CUDA graph (GraphDecoder) replayed, or eager model.decode()."""
    from llama_min.model import AttentionConfig, GraphDecoder

    B = cache.batch
    rows = []
    for m in methods:
        cache.lengths[...] = L
        cache.length, cache.step = L, 0
        att = AttentionConfig(method=m.kind, **({} if m.kind == "dense" else    # santa at every length:
                              dict(samples=m.samples, sampler=m.sampler, budget=m.budget, santa_min_length=0)))
        tokens = cp.ones((B,), cp.int32)
        if graph:
            gd = GraphDecoder(model, cache, att, gemv=gemv, programmatic_launch=programmatic)
            run, stream, plan = (lambda: gd.replay(tokens)), gd.stream, gd.plan
        else:
            gd, stream = None, cp.cuda.get_current_stream()
            model.decode(tokens, cache, att)                       # builds the cached plan
            run, plan = (lambda: model.decode(tokens, cache, att)), cache.plans.get(att)
        ms, ms_min = time_steps(cp, run, stream, steps, warmup)
        row = {"method": m.name, "B": B, "L": L, "ms": ms, "ms_min": ms_min, "timing": "graph" if graph else "eager",
               "programmatic": gd is not None and gd.programmatic_launch}
        if m.kind == "santa" and plan is not None:
            last_len = int(cache.lengths[0])       # the last step attended over this many rows
            row["rows_frac"] = float(plan.info().rows_read.sum()) / (B * model.KVH * last_len)
        rows.append(row)
        if gd is not None:
            gd.close()
        cp.cuda.Device().synchronize()
    return rows


def _token_count(text: str) -> int:
    if not text.isdigit():
        raise click.BadParameter(f"token counts must be integers, got {text!r}", param_hint="--tokens")
    return int(text)


@bench.command("products")
@click.option("--tokens", default="1,2,4", show_default=True, help="Comma-separated token counts (rows of x).")
@click.option("--methods", default=",".join(PRODUCT_METHODS), show_default=True,
              help=f"Comma-separated, of: {', '.join(PRODUCT_METHODS)}.")
@click.option("--repeats", type=click.IntRange(min=3), default=30, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
def products_command(tokens, methods, repeats, json_path, markdown_path):
    """The decode step's weight products (Llama-3.1-8B shapes, fp16, float32 out), cuBLAS vs gemv.cu:
    µs, TB/s and % of the streaming-read ceiling, every method on the same rotating weights."""
    token_list = parse_list(tokens, "tokens", _token_count)
    method_list = parse_list(methods, "methods", str)
    bad = [m for m in method_list if m not in PRODUCT_METHODS]
    if bad:
        raise click.BadParameter(f"unknown method(s) {bad}; choose from {PRODUCT_METHODS}", param_hint="--methods")
    from santa_cupy import decoder_ops
    if not token_list or min(token_list) < 1 or max(token_list) > decoder_ops.GEMV_TOKENS[-1]:
        raise click.BadParameter(f"token counts must be in 1..{decoder_ops.GEMV_TOKENS[-1]}", param_hint="--tokens")
    cp = _cupy()
    meta = dict(run_metadata("products"), **gpu_metadata(cp))
    _log("measuring the streaming-read ceiling ...")
    ceiling = measure_ceiling(cp)
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    from llama_min.model import _CublasGemm
    cublas = _CublasGemm()
    rows = []
    shapes = weight_shapes(LLAMA8B_MODEL)
    with click.progressbar(list(shapes.items()), label="products", file=sys.stderr) as bar:
        for name, (N, K) in bar:
            copies = max(2, -(-3 * l2 // (N * K * 2)))              # rotate over > 3x L2
            ws = [random_array(cp, (N, K), "float16", scale=1.0 / math.sqrt(K)) for _ in range(copies)]
            for n in token_list:
                x = random_array(cp, (n, K), "float16")
                y = cp.zeros((n, N), cp.float32)
                for method in method_list:
                    fns = [_product_fn(method, x, w, y, cublas) for w in ws]
                    us, mode = time_cupy_graph(cp, fns, n_inner=max(len(fns), 8), repeats=repeats)
                    nbytes = N * K * 2 + n * K * 2 + n * N * 4
                    rows.append({"product": name, "N": N, "K": K, "tokens": n, "method": method, "us": us,
                                 "bytes": nbytes, "tbps": nbytes / us / 1e6, "timing": mode})
            del ws
    base = {(r["product"], r["tokens"]): r["us"] for r in rows if r["method"] == "cublas"}
    lines = ["| product | N x K | tokens | method | µs | TB/s | % ceiling | x cuBLAS |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        r["pct_ceiling"] = 100.0 * r["tbps"] / ceiling["read_tbps"] if ceiling.get("read_tbps") else None
        b = base.get((r["product"], r["tokens"]))
        r["x_cublas"] = b / r["us"] if b else None
        lines.append(f"| {r['product']} | {r['N']} x {r['K']} | {r['tokens']} | {r['method']} | {r['us']:.1f} | "
                     f"{r['tbps']:.2f} | {r['pct_ceiling']:.0f}% | "
                     + (f"{r['x_cublas']:.2f}x |" if r["x_cublas"] else "- |"))
    meta["timing"] = f"CUDA graph over rotating weight copies (> 3x L2), median of {repeats} replays"
    write_outputs(meta, ceiling, rows, "\n".join(lines) + "\n", json_path=json_path, markdown_path=markdown_path)


@bench.command("e2e")
@click.option("--context", default="32k", show_default=True, help="Tokens already in the KV cache (k = 1024).")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed decode steps (median).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed graph replays first.")
@click.option("--methods", default="dense,santa-global-systematic-256", show_default=True,
              help="Comma-separated: dense, santa-<budget>-<sampler>-<S>.")
@click.option("--layers", type=click.IntRange(min=1), default=LLAMA8B_MODEL.layers, show_default=True,
              help="Layers of the random model (fewer for a smaller GPU).")
@click.option("--model", "model_path", type=click.Path(exists=True), default=None,
              help="A checkpoint directory (llama_min); default: Llama-3.1-8B-shaped random weights.")
@click.option("--no-graph", is_flag=True, help="Time eager steps instead of a captured CUDA graph.")
@click.option("--products", "products", type=click.Choice(["auto", "gemv", "cublas"]), default="auto",
              show_default=True, help="Weight products: GraphDecoder's default (gemv.cu at batch 1, cuBLAS "
                                      "beyond), gemv.cu up to batch 4, or cuBLAS only. Needs the graph.")
@click.option("--pdl/--no-pdl", default=True, show_default=True,
              help="Capture santa-cupy's kernels with programmatic dependent launch (GraphDecoder's default on "
                   "sm_90+), or plainly.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(KV_CACHE_LAYOUTS), default="contiguous", show_default=True,
              help="KV cache storage: contiguous, or paged (a shuffled page pool and block table, NHD).")
@click.option("--page-size", type=click.IntRange(1, 256), default=None,
              help="Rows per page of --kv-cache paged (1..256; default 16).")
@click.option("--mem-gb", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Refuse above this.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
def e2e_command(context, batch, steps, warmup, methods, layers, model_path, no_graph, products, pdl, kv_cache,
                page_size, mem_gb, json_path, markdown_path):
    """Whole-model decode latency (ms/token, tokens/s), dense vs SANTA attention."""
    L = parse_size(context, "context")
    page_size = kv_cache_page_size(kv_cache, page_size)
    method_objs = [parse_method(n) for n in parse_list(methods, "methods", str)]
    bad = [m.name for m in method_objs if m.external]
    if bad:
        raise click.BadParameter(f"e2e runs our kernels only, not {', '.join(bad)}", param_hint="--methods")
    shape = ModelShape(layers=layers)
    L_max = L + steps + warmup + 8
    if products != "auto" and no_graph:
        raise click.UsageError("--products needs the captured graph (drop --no-graph)")
    gemv = {"auto": None, "gemv": True, "cublas": False}[products]
    if model_path is None and e2e_memory(shape, batch, L_max) > mem_gb * 1e9:
        raise click.UsageError(f"the random model at batch {batch}, context {L} needs "
                               f"{fmt_bytes(e2e_memory(shape, batch, L_max))} > --mem-gb {mem_gb}; "
                               "use fewer --layers, a smaller --batch/--context or a larger --mem-gb")
    cp = _cupy()
    meta = dict(run_metadata("e2e"), **gpu_metadata(cp))
    _log("measuring the streaming-read ceiling ...")
    ceiling = measure_ceiling(cp)
    if model_path is not None:
        from llama_min.model import LlamaModel

        _log(f"loading {model_path} ...")
        model = LlamaModel.from_pretrained(model_path, device="gpu")
        cfg = model.cfg
        cache = e2e_cache(model, batch, L_max, page_size)
        _fill_random_kv(cp, model, cache, L)
        shape = ModelShape(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                           kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                           intermediate=cfg.intermediate_size, vocab=cfg.vocab_size)
        meta["model"] = str(model_path)
        note = "random KV, no prefill"
    else:
        meta["model"] = f"random Llama-3.1-8B-shaped, fp16 weights and KV, {asdict(shape)}"
        _log(f"generating random weights and KV cache ({fmt_bytes(e2e_memory(shape, batch, L_max))}) ...")
        model, cache = random_llama(cp, shape, batch, L, L_max, page_size)
        note = "random weights, random KV, no prefill"
    meta["kv_cache"] = kv_cache_report(page_size)
    meta["decode_step"] = "llama_min (fused RMSNorm / rotary + K/V append / SiLU kernels, residual adds in the products)"
    meta["weight_products"] = {"auto": "santa-cupy gemv at batch 1, else cuBLAS", "gemv": "santa-cupy gemv",
                               "cublas": "cuBLAS"}[products] if not no_graph else "CuPy matmul (eager)"
    rows = _e2e_rows(cp, model, cache, L, steps, warmup, method_objs, gemv=gemv, graph=not no_graph,
                     programmatic=pdl)
    meta["programmatic_launch"] = bool(pdl and not no_graph and rows and rows[0].get("programmatic"))
    if page_size is not None:
        note += f", paged KV (pages of {page_size} rows, shuffled block table)"
    for r in rows:
        r["note"] = note
    floor = e2e_bytes(shape, batch, L)
    meta["byte_floor"] = floor
    meta["byte_floor_text"] = (f"weights {fmt_bytes(floor['weights'])} + KV {fmt_bytes(floor['kv'])} at context "
                               f"{L} = {fmt_bytes(floor['total'])} per step")
    meta["timing"] = f"median of {steps} single-step replays after {warmup} warm-up replays"
    e2e_derived(rows, ceiling["read_tbps"], floor["total"])
    write_outputs(meta, ceiling, rows, e2e_table(rows), json_path=json_path, markdown_path=markdown_path)


if __name__ == "__main__":
    bench()

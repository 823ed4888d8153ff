"""Loading the CUDA kernels of cuda/ through CuPy ``RawModule``, and launching them.

One source of truth for the compiled variants: a module is one (dtype, head_dim, group) and holds
the kernels for every block_n of ``spec.BLOCK_NS``; ``instance_names`` lists the template names
NVRTC instantiates for it (per role: dense or santa<BN>), ``CI_CONFIGS`` the (dtype, head_dim,
group) CI compiles, every role, for every architecture. The source
handed to NVRTC is the concatenation of the headers and kernel files with their ``#include``
lines removed, so CuPy's cache key (the source string) changes whenever any header changes.
This module imports without CuPy and without a GPU (``build_source`` is what CI compiles).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from santa_cupy import kernel_args, spec

# Order matters: headers before the kernels that use them.
SOURCE_FILES = (
    "common.cuh", "tile.cuh", "stream.cuh", "async_copy.cuh", "mma.cuh", "gather_mma.cuh", "merge.cuh",
    "santa_sample.cuh",
    "santa_gather.cuh",
    "decode_dense.cu", "santa_score.cu",
    "santa_score_keys.cu",   # after santa_score.cu (write_tile_stash)
    "santa_prefix.cu", "santa_tile.cu",
    "santa_one_pass.cu",     # after santa_tile.cu (load_slice, warp_list_rows)
    "merge.cu",
)
STORAGE_TYPE = {"float32": "float", "float16": "f16_t", "bfloat16": "bf16_t"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
GROUPS = tuple(range(1, spec.MAX_G + 1))
# Every dtype x head_dim at the common group sizes, plus every group size at one shape.
CI_CONFIGS = tuple(itertools.product(STORAGE_TYPE, spec.HEAD_DIMS, (1, 4, 8))) + tuple(
    ("bfloat16", 128, g) for g in GROUPS if g not in (1, 4, 8))
# SANTA_CUPY_LINEINFO=1: line tables in the kernels, for Nsight Compute's source view (tools/ncu_sass.sh)
NVRTC_OPTIONS = ("-std=c++17",) + (("-lineinfo",) if os.environ.get("SANTA_CUPY_LINEINFO") == "1" else ())

THREADS = 128       # SC_NTHREADS
CHUNK = 8           # SC_CHUNK
PREFIX_THREADS = 256
MERGE_THREADS = 256
HEAD_DRAW_BYTES = 48  # sizeof(HeadDraw)
ACC_COPIES = 8        # SC_ACC_COPIES (merge.cuh): copies of santa_tile_warp's accumulators
BUDGET_CODE = {"fixed": 0, "global": 1, "largest_remainder": 2}
SAMPLER_CODE = {"iid": 0, "stratified": 1, "systematic": 2}
MODE_CODE = {"fused": 0, "sample": 1, "gather": 2}
MERGE_DENSE, MERGE_FIXED, MERGE_SUM = 0, 1, 2


def kernel_dir() -> Path:
    """cuda/ in a source checkout, or the copy installed as package data (santa_cupy/cuda_src)."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda"):
        if (candidate / "common.cuh").is_file():
            return candidate
    raise FileNotFoundError(f"santa-cupy kernel sources not found next to {here}")


@functools.lru_cache(maxsize=None)
def build_source(files: tuple[str, ...] = SOURCE_FILES) -> str:
    """Kernel sources as one translation unit, includes inlined, with a content hash on top
    (default: the attention kernels)."""
    parts = []
    for name in files:
        text = (kernel_dir() / name).read_text()
        text = re.sub(r'^\s*#\s*include\s+"[^"]+"\s*$', "", text, flags=re.M)
        text = re.sub(r"^\s*#\s*pragma\s+once\s*$", "", text, flags=re.M)
        parts.append(f"// ---- {name} ----\n{text}")
    body = "\n".join(parts)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return f"// santa-cupy kernels, sources sha256 {digest}\n{body}"


def instance_names(dtype_name: str, head_dim: int, group: int, role: str) -> dict[str, str]:
    """Template instances (NVRTC name expressions) of one module, by kernel.

    A module is one (dtype, head_dim, group) and one role: "dense" (split-KV decode + merge) or
    "santa<BN>" (score, tile, prefix, merge for tiles of BN rows), so that a call compiles only
    what it launches.
    """
    t, d, g = STORAGE_TYPE[dtype_name], head_dim, group
    names = {"merge": f"santa_merge<{t}, {d}, 4>", "merge_wide": f"santa_merge<{t}, {d}, 8>",
             "advance": "santa_advance_step"}
    if role == "dense":
        names["dense"] = f"decode_dense_partial<{t}, {d}, {g}>"
        if mma_supported(dtype_name, head_dim):
            names["dense_mma"] = f"decode_dense_mma<{t}, {d}, {g}>"
            names["dense_mma_blocked"] = f"decode_dense_mma_blocked<{t}, {d}, {g}>"   # a blocked K
        return names
    bn = int(role.removeprefix("santa"))
    names.update(score=f"santa_score<{t}, {d}, {bn}, {g}>", tile=f"santa_tile<{t}, {d}, {bn}, {g}>",
                 prefix="santa_prefix")
    if mma_supported(dtype_name, head_dim):
        names["score_mma"] = f"santa_score_mma<{t}, {d}, {bn}, {g}, {SCORE_SPAN}>"
        names["score_mma_span1"] = f"santa_score_mma<{t}, {d}, {bn}, {g}, 1>"   # pages of 16, 48 rows
    if key_sampling_supported(dtype_name, head_dim):     # block key sampling's pass 1 (key_pass.py)
        names["key_blocks"] = f"santa_key_blocks<{t}>"
        names["score_keys"] = f"santa_score_keys<{t}, {d}, {bn}, {g}>"
        if mma_supported(dtype_name, head_dim):          # the tensor-core pass (G <= 16: GROUPS)
            for fb in spec.KEY_BLOCKS:                   # one instance a key block (a template constant)
                names[f"score_keys_mma_fb{fb}"] = f"santa_score_keys_mma<{t}, {d}, {bn}, {g}, {fb}>"
    if group <= WARP_TILE_MAX_G and mma_supported(dtype_name, head_dim):   # they follow / use the mma scores
        names["one_pass"] = f"santa_one_pass<{t}, {d}, {bn}, {g}>"          # the one-pass budget's kernel
        for name, gather in TILE_WARP_GATHERS.items():      # kGather of santa_tile_warp; kFinish
            names[name] = f"santa_tile_warp<{t}, {d}, {bn}, {g}, {gather}, false>"
            names[name + "_finish"] = f"santa_tile_warp<{t}, {d}, {bn}, {g}, {gather}, true>"
    return names


def roles() -> tuple[str, ...]:
    """The module roles: "dense", then "santa<BN>" for every block_n of spec.BLOCK_NS."""
    return ("dense",) + tuple(f"santa{bn}" for bn in spec.BLOCK_NS)


def source_for(dtype_name: str, head_dim: int, group: int, role: str) -> tuple[str, list[str]]:
    """(source, name expressions) of one module; the names are appended to the source text so
    that each module has its own CuPy cache entry."""
    names = list(instance_names(dtype_name, head_dim, group, role).values())
    return build_source() + "\n// instances: " + "; ".join(names) + "\n", names


# ---- shared-memory sizes (mirror the layouts documented in each .cu file) ---------------------
def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def row_groups(head_dim: int) -> int:
    """Rows a 128-thread block streams at once at this head_dim (CHUNK elements a thread)."""
    return THREADS // (head_dim // CHUNK)


MMA_DTYPES, MMA_HEAD_DIMS = ("float16", "bfloat16"), (64, 128)   # decode_dense_mma's instances


def mma_supported(dtype_name, head_dim) -> bool:
    """Whether the tensor-core dense kernel (v4) has an instance for this dtype and head_dim."""
    return dtype_name in MMA_DTYPES and head_dim in MMA_HEAD_DIMS


# santa_score_mma's SPAN: 16-key steps a K register buffer holds (santa_score.cu). A step must lie
# in one page of a paged cache, so pages of a size not a multiple of 16 * SCORE_SPAN rows take the
# one-step instance (score_mma_span1).
SCORE_SPAN = 2


def score_span(page_size) -> int:
    """santa_score_mma's SPAN for a cache of this page_size (None: contiguous)."""
    return SCORE_SPAN if page_size is None or page_size % (16 * SCORE_SPAN) == 0 else 1


KEY_SAMPLING_DTYPES, KEY_SAMPLING_HEAD_DIMS = ("float16", "bfloat16"), (64, 128)   # santa_score_keys' instances
# (D / key_block <= 8 blocks: SC_KEY_MAX_BLOCKS, santa_key_blocks' registers)
KEY_RULE_CODE = {"uniform": 0, "qmax": 1, "qrms": 2}     # santa_key_blocks' rule ("qkvar": NumPy only)
KEY_COMBINE_CODE = {"mean": 0, "union": 1}


def key_sampling_supported(dtype_name, head_dim) -> bool:
    """Whether block key sampling (santa_key_blocks + santa_score_keys) has an instance for this
    dtype and head_dim."""
    return dtype_name in KEY_SAMPLING_DTYPES and head_dim in KEY_SAMPLING_HEAD_DIMS


def dense_smem_bytes(dtype_name, head_dim, group, kernel="stream") -> int:
    """v2: the row-group combine; v4: the combine of the block's THREADS // 32 warps."""
    if kernel == "mma":
        warps = THREADS // 32
        return 4 * (warps * group * head_dim + 2 * warps * group)
    rg = row_groups(head_dim)
    return 4 * (rg * group * head_dim + 2 * rg * group)


# santa pass 2's warp kernel santa_tile_warp (the choice among the kernels: santa_cupy/kernel_choice.py)
GATHER_PIPE, GATHER_MMA = 0, 1   # SC_GATHER_* (santa_tile.cu): kGather
TILE_WARP_GATHERS = {"tile_warp": GATHER_PIPE, "tile_warp_mma": GATHER_MMA}
WARP_TILE_MAX_G = 8
GATHER_STAGE_BYTES = 4096    # SC_GATHER_STAGE_BYTES (gather_mma.cuh): staged V rows per warp


def warp_tile_supported(sampler, group) -> bool:
    """santa_tile_warp covers the systematic sampler at G <= 8, every budget (the fixed budget then
    takes the two-pass route: score pass, prefix, warp pass 2)."""
    return sampler == "systematic" and group <= WARP_TILE_MAX_G


def expected_rows_per_tile(group, samples, block_n, max_length) -> float:
    """Selected rows of a tile at a uniform-ish distribution: G heads x S samples spread over
    max_length / BN tiles (an upper bound of the distinct rows; peaked distributions select fewer)."""
    return min(block_n, group * samples * block_n / max(max_length, 1))


def tile_warp_smem_bytes(block_n, group, head_dim, mma=False) -> int:
    """santa_tile_warp: per warp cnt [G][BN] i32 | rows [BN] i32 | sums [G][D] f32 | GATHER_STAGE_BYTES
    of staged 16-bit V rows (+ "warp", the pipelined gather: the pending tile's counts [G][stage rows] f32)."""
    per_warp = 4 * (group * block_n + block_n + group * head_dim) + GATHER_STAGE_BYTES
    if not mma:
        per_warp += 4 * group * (GATHER_STAGE_BYTES // (2 * head_dim))
    return (THREADS // 32) * per_warp


def one_pass_supported(sampler, group, dtype_name, head_dim) -> bool:
    """santa_one_pass (the one-pass budget on the GPU): systematic, G <= 8, fp16/bf16 at D 64/128."""
    return warp_tile_supported(sampler, group) and mma_supported(dtype_name, head_dim)


def one_pass_smem_bytes(block_n, group, head_dim, dtype_name="bfloat16") -> int:
    """santa_one_pass: per warp sc [G][BN] f32 | rows [BN] i32 | sums [G][D] f32 | staged rows'
    coefficients [G][kStage] f32, then per warp GATHER_STAGE_BYTES of staged V rows."""
    stage_rows = GATHER_STAGE_BYTES // (head_dim * ITEMSIZE[dtype_name])
    return (THREADS // 32) * (4 * (group * block_n + block_n + group * head_dim + group * stage_rows)
                              + GATHER_STAGE_BYTES)


def tile_smem_bytes(dtype_name, head_dim, block_n, group) -> int:
    """santa_tile's dynamic shared memory (the layout documented in santa_tile.cu)."""
    rg = row_groups(head_dim)
    n = 4 * (2 * group * block_n + rg * group * head_dim + rg * group + block_n + 4 + 2 * group)
    return _round16(n) + _round16(group * HEAD_DRAW_BYTES)


@dataclass
class KernelSet:
    """The kernels of one configuration (those of the other method are None)."""
    merge: object
    merge_wide: object
    advance: object
    dense: object = None
    dense_mma: object = None
    dense_mma_blocked: object = None
    score: object = None
    score_mma: object = None
    score_mma_span1: object = None
    tile: object = None
    tile_warp: object = None
    tile_warp_mma: object = None
    tile_warp_finish: object = None
    tile_warp_mma_finish: object = None
    one_pass: object = None
    prefix: object = None
    key_blocks: object = None
    score_keys: object = None
    score_keys_mma_fb16: object = None
    score_keys_mma_fb32: object = None


@functools.lru_cache(maxsize=None)
def _module(dtype_name: str, head_dim: int, group: int, role: str):
    import cupy

    source, names = source_for(dtype_name, head_dim, group, role)
    return cupy.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=names)


# kernel_args' checks of every launch: id(kernel) -> (kernel, its Signature); the kernel is held so
# that its id stays its own
_SIGNATURES: dict[int, tuple] = {}


def register_kernel(kernel, source: str, instance: str):
    """Check every launch(kernel, ...) against the declaration of ``instance`` (a name expression)
    in ``source`` (kernel_args); returns the kernel."""
    _SIGNATURES[id(kernel)] = (kernel, kernel_args.signature_of(source, instance))
    return kernel


@functools.lru_cache(maxsize=None)
def get_kernels(dtype_name: str, head_dim: int, group: int, block_n: int, method: str) -> KernelSet:
    """Compile (or fetch from CuPy's cache) the kernels of one configuration, once per process
    (plans share them). Needs CuPy + a GPU."""
    if dtype_name not in STORAGE_TYPE or head_dim not in spec.HEAD_DIMS or group not in GROUPS \
            or block_n not in spec.BLOCK_NS:
        raise ValueError(f"no kernel instance for dtype={dtype_name!r}, head_dim={head_dim}, group={group}, "
                         f"block_n={block_n}; supported: dtypes {tuple(STORAGE_TYPE)}, head_dim "
                         f"{spec.HEAD_DIMS}, group 1..{spec.MAX_G}, block_n {spec.BLOCK_NS}")
    role = "dense" if method == "dense" else f"santa{block_n}"
    module = _module(dtype_name, head_dim, group, role)
    names = instance_names(dtype_name, head_dim, group, role)
    source = build_source()
    return KernelSet(**{key: register_kernel(module.get_function(name), source, name) for key, name in names.items()})


# ---- programmatic dependent launch (common.cuh: pdl_wait / pdl_launch_dependents) -----------------
# Every kernel of cuda/ waits for its predecessor before it reads anything, so any launch may let it
# start early. CuPy launches without launch attributes, so these go through the driver's
# cuLaunchKernelEx (ctypes) with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):      # CUlaunchAttribute: id, pad to 8, 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):         # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


def _initial_programmatic_mode():
    """SANTA_CUPY_PDL: "auto" (default), "1" / "on" or "0" / "off" -> None, True or False."""
    value = os.environ.get("SANTA_CUPY_PDL", "auto").strip().lower()
    modes = {"auto": None, "1": True, "on": True, "0": False, "off": False}
    if value not in modes:
        raise ValueError(f"SANTA_CUPY_PDL={value!r}: use auto, on (1) or off (0)")
    return modes[value]


# on: True (always), False (never) or None (automatic: while the current stream captures a graph)
_programmatic = {"on": _initial_programmatic_mode(), "launch": None, "attr": None}


def programmatic_launch() -> bool | None:
    """The process-wide programmatic-launch mode (set_programmatic_launch): True, False, or None
    (automatic: launches captured into a CUDA graph on sm_90+ use it, eager launches do not)."""
    return _programmatic["on"]


def programmatic_launch_available() -> bool:
    """Whether this device takes programmatic dependent launch (sm_90 and later); loads the
    driver's cuLaunchKernelEx the first time."""
    if _programmatic["launch"] is None:
        import cupy

        if int(cupy.cuda.Device().compute_capability) < 90:
            return False
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
        fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value[0] = 1                          # programmaticStreamSerializationAllowed
        _programmatic.update(launch=fn, attr=attr)
    return True


def set_programmatic_launch(on: bool | None) -> bool | None:
    """From now on launch santa-cupy's kernels (attention and decoder) with programmatic dependent
    launch (each may be scheduled while the previous kernel in the stream finishes, and waits for
    it on the device; sm_90 and later): True always, False never, None (the default, or
    SANTA_CUPY_PDL=auto|on|off at import) while the current stream captures a CUDA graph, where
    the launches' host cost (cuLaunchKernelEx through ctypes) is paid once. A plan whose kernel
    choice sets ``programmatic`` follows that instead. -> the mode now in force (True only where
    the device has it)."""
    if on is not None and not isinstance(on, bool):
        raise TypeError(f"set_programmatic_launch takes True, False or None, got {on!r}")
    if on and not programmatic_launch_available():
        on = False
    _programmatic["on"] = on
    return on


def _capturing() -> bool:
    """Whether the current stream is capturing a CUDA graph."""
    try:
        import cupy

        return bool(cupy.cuda.get_current_stream().is_capturing())
    except Exception:                  # no device, or the legacy stream beside a capturing one
        return False


def launches_programmatically(programmatic=None) -> bool:
    """Whether kernels.launch would use programmatic dependent launch now, given a plan's choice
    ``programmatic`` (None: the process-wide mode)."""
    mode = _programmatic["on"] if programmatic is None else programmatic
    if mode is None:
        mode = _capturing()
    # True from SANTA_CUPY_PDL needs the device checked (and the driver's entry point loaded) here
    return bool(mode) and programmatic_launch_available()


def _c_arg(a):
    """A kernel argument as cuLaunchKernelEx wants it: a device array -> its pointer, a NumPy
    scalar -> the C value of its type (what CuPy's own launch does with the same arguments)."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)     # cupy.ndarray
    if ptr is not None:
        return ctypes.c_void_p(ptr)
    for np_type, c_type in ((np.int32, ctypes.c_int32), (np.int64, ctypes.c_int64), (np.uint64, ctypes.c_uint64),
                            (np.uint32, ctypes.c_uint32), (np.float32, ctypes.c_float), (np.float64, ctypes.c_double)):
        if isinstance(a, np_type):
            return c_type(a.item())
    raise TypeError(f"no C type for kernel argument {type(a).__name__}")


def launch(kernel, grid, args, shared_mem: int = 0, threads: int = THREADS, programmatic=None, check=True):
    """Launch on the current stream with enough dynamic shared memory (raising the limit if needed);
    with programmatic dependent launch when ``programmatic`` (True only where
    programmatic_launch_available()), or, None, as the process-wide mode says
    (launches_programmatically: by default while the stream captures a graph). The arguments
    of a registered kernel (register_kernel: every kernel of santa_cupy and llama_min) are checked
    against its C declaration first (kernel_args.check: a TypeError, nothing launched), unless
    ``check`` is False (a caller that checked the same launch site's argument types before)."""
    entry = _SIGNATURES.get(id(kernel)) if check else None
    if entry is not None:
        kernel_args.check(entry[1], args)
    if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    if not launches_programmatically(programmatic):
        kernel(tuple(int(x) for x in grid), (threads,), tuple(args), shared_mem=shared_mem)
        return
    import cupy

    values = [_c_arg(a) for a in args]
    params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
    grid3 = (tuple(int(g) for g in grid) + (1, 1))[:3]
    cfg = _LaunchConfig((ctypes.c_uint * 3)(*grid3), (ctypes.c_uint * 3)(threads, 1, 1), shared_mem,
                        cupy.cuda.get_current_stream().ptr, ctypes.pointer(_programmatic["attr"]), 1)
    function = getattr(kernel, "kernel", kernel)   # RawKernel -> its cupy.cuda.function.Function
    status = _programmatic["launch"](ctypes.byref(cfg), function.ptr, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")


# Never slower than exact (DecodePlan's santa_min_length="auto"). Dense takes about a fixed
# latency plus its bytes; santa (every length) a larger fixed cost (more launches, dependent round
# trips) plus one per sequence (pass 2 gathers S * G V rows a (sequence, KV head) whatever its
# length), and saves about a
# V row per row at the streaming rate. Santa pays from
#   n >= (SANTA_FIXED_COST_S + B * SANTA_PER_SEQUENCE_COST_S) * bandwidth / (B * KVH * D * itemsize),
# the costs in peak-bandwidth seconds. Fitted by tools/fit_min_length.py to the crossovers of one
# bench run (H100 at 3.35 TB/s, llama8b bf16, 8750e5c, santa at every length against dense at
# B = 1, 4, 16 x 4k-128k, linear between the measured lengths; docs/results/h100_8750e5c): at
# S = 256 15.8k tokens at B = 1 and 5.9k at B = 4 (8.2 us + 1.7 us a sequence; B = 16 then 3.6k,
# santa measured faster from 4k); at S = 2048 (the fixed budget) 27.8k, 15.0k and 13.6k (least
# squares: 7.7 us + 8.0 us a sequence). On the H200 the model gives 23-24k / 9k / 5k at S = 256;
# its measured 1ee9110 / 280c700 times put the B = 1 crossover near 24k. Both costs linear in S
# through the two fits:
SANTA_COST_SAMPLES = 256            # the S of SANTA_FIXED_COST_S and SANTA_PER_SEQUENCE_COST_S
SANTA_FIXED_COST_S = 8.2e-6
SANTA_PER_SEQUENCE_COST_S = 1.7e-6
SANTA_FIXED_COST_PER_SAMPLE_S = -0.3e-9
SANTA_PER_SEQUENCE_COST_PER_SAMPLE_S = 3.5e-9
DEFAULT_BANDWIDTH = 4.8e12          # bytes/s (H200) where the device does not report its memory
# The block pass 2 (santa_tile: iid / stratified samplers, G > 8, fp32, D 256) works through every
# tile of every sequence, so its cost grows with the length faster than the V rows it saves: on the
# H100 (llama8b, B = 1 and 16 x 8k / 32k / 128k; docs/results/h100_129dbf0_exact_throughout) iid
# and stratified were 0.53-0.99x dense at every point, the fused fixed pass (S = 2048) 0.60-1.01x
# but at B = 16 128k (1.15x). "auto" runs such plans exact at every length.
BLOCK_PASS_MIN_LENGTH = 2**31 - 1


def device_bandwidth(device_attributes) -> float:
    """Peak DRAM bandwidth (bytes/s) from the device's memory clock (kHz) and bus width (bits),
    double data rate; DEFAULT_BANDWIDTH without them."""
    clock, width = device_attributes.get("MemoryClockRate"), device_attributes.get("GlobalMemoryBusWidth")
    if not clock or not width:
        return DEFAULT_BANDWIDTH
    return 2.0 * clock * 1e3 * width / 8


DEFAULT_L2_BYTES = 60 << 20          # the H200's L2, where the device does not report its own


def device_l2_bytes(device_attributes) -> int:
    """The device's L2 cache size in bytes (DEFAULT_L2_BYTES where it does not report it)."""
    return int(device_attributes.get("L2CacheSize") or DEFAULT_L2_BYTES)


def santa_min_length(batch, kv_heads, head_dim, itemsize, bandwidth, samples=SANTA_COST_SAMPLES) -> int:
    """The sequence length from which santa with `samples` samples a head is faster than dense
    (module comment above)."""
    extra = samples - SANTA_COST_SAMPLES
    fixed = max(0.0, SANTA_FIXED_COST_S + extra * SANTA_FIXED_COST_PER_SAMPLE_S)
    per_sequence = max(0.0, SANTA_PER_SEQUENCE_COST_S + extra * SANTA_PER_SEQUENCE_COST_PER_SAMPLE_S)
    cost = fixed + batch * per_sequence
    return max(1, math.ceil(cost * bandwidth / (batch * kv_heads * head_dim * itemsize)))


def resident_blocks(kernel, threads: int = THREADS, shared_mem: int = 0, device_attributes=None) -> int:
    """Blocks of ``kernel`` that one SM holds at once, limited by registers, shared memory and
    threads (the occupancy calculator's arithmetic; registers are allocated per warp in units of
    256). Falls back to 4 when the kernel does not report its register count."""
    attrs = device_attributes or {}
    regs = getattr(kernel, "num_regs", None)
    if not isinstance(regs, int) or regs <= 0:
        return 4
    warps = -(-threads // 32)
    regs_per_warp = -(-regs * 32 // 256) * 256
    by_regs = attrs.get("MaxRegistersPerMultiprocessor", 65536) // (regs_per_warp * warps)
    static = getattr(kernel, "shared_size_bytes", 0)
    static = static if isinstance(static, int) else 0
    smem = shared_mem + static + 1024                       # + the driver's 1 KiB per block
    by_smem = attrs.get("MaxSharedMemoryPerMultiprocessor", 228 * 1024) // smem
    by_threads = attrs.get("MaxThreadsPerMultiProcessor", 2048) // threads
    return max(1, min(by_regs, by_smem, by_threads, 32))


def wave_fitted_parts(groups: int, max_parts: int, slots: int, tolerance: float = 0.95) -> int:
    """Parts per group (1..max_parts) so that groups * parts blocks fill whole waves of ``slots``
    resident blocks: the fewest parts whose wave efficiency, blocks / (waves * slots), is within
    ``tolerance`` of the best. (A grid of 1.03 waves runs two full block times for 1.03 of work.)"""
    def efficiency(p):
        blocks = groups * p
        return blocks / (-(-blocks // slots) * slots)
    best = max(efficiency(p) for p in range(1, max_parts + 1))
    return next(p for p in range(1, max_parts + 1) if efficiency(p) >= tolerance * best)


def run_length(tiles: int, groups: int, slots: int, *, runs_per_block: int, overhead: float = 0.5,
               max_tiles: int | None = None) -> int:
    """Tiles a run for kernels where one warp (or block) takes a run of c consecutive tiles of a
    group, ``runs_per_block`` runs a block: the c in 1..min(tiles, max_tiles) minimising
    waves(c) * (c + overhead), waves(c) = ceil(groups * ceil(ceil(tiles / c) / runs_per_block) /
    slots), with ``overhead`` a run's fixed cost in tile times. Blocks of equal work run in whole
    waves, so one wave of long runs beats 12.4 waves of single tiles, which beats 1.07 waves of
    long runs. Ties: the smaller c."""
    def cost(c):
        blocks = groups * -(-(-(-tiles // c)) // runs_per_block)
        return -(-blocks // slots) * (c + overhead)
    top = max(1, tiles if max_tiles is None else min(tiles, max_tiles))
    return min(range(1, top + 1), key=lambda c: (cost(c), c))


def tiles_per_warp(tiles: int, groups: int, slots: int, overhead: float = 0.5) -> int:
    """run_length of santa_score_mma and santa_tile_warp (one warp a run, 4 warps a block)."""
    return run_length(tiles, groups, slots, runs_per_block=THREADS // 32, overhead=overhead)


i32, i64, u64, f32, f64 = np.int32, np.int64, np.uint64, np.float32, np.float64

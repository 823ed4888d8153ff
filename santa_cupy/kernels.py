"""Loading the CUDA kernels of cuda/ through CuPy ``RawModule``, and launching them.

One source of truth for the compiled variants: ``CONFIGS`` lists every (dtype, head_dim, block_n)
instance; ``instance_names`` turns one into the template names NVRTC instantiates. The source
handed to NVRTC is the concatenation of the headers and kernel files with their ``#include``
lines removed, so CuPy's cache key (the source string) changes whenever any header changes.
This module imports without CuPy and without a GPU (``build_source`` is what CI compiles).
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from santa_cupy import spec

# Order matters: headers before the kernels that use them.
SOURCE_FILES = (
    "common.cuh", "tile.cuh", "santa_sample.cuh", "santa_gather.cuh",
    "decode_dense.cu", "santa_score.cu", "santa_prefix.cu", "santa_tile.cu", "merge.cu",
)
STORAGE_TYPE = {"float32": "float", "float16": "f16_t", "bfloat16": "bf16_t"}
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
CONFIGS = tuple(itertools.product(STORAGE_TYPE, spec.HEAD_DIMS, spec.BLOCK_NS))
NVRTC_OPTIONS = ("-std=c++17",)

THREADS = 128       # SC_NTHREADS
CHUNK = 8           # SC_CHUNK
PAD = 8             # SC_PAD
PREFIX_THREADS = 256
HEAD_DRAW_BYTES = 48  # sizeof(HeadDraw)
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
def build_source() -> str:
    """All kernel sources as one translation unit, includes inlined, with a content hash on top."""
    parts = []
    for name in SOURCE_FILES:
        text = (kernel_dir() / name).read_text()
        text = re.sub(r'^\s*#\s*include\s+"[^"]+"\s*$', "", text, flags=re.M)
        text = re.sub(r"^\s*#\s*pragma\s+once\s*$", "", text, flags=re.M)
        parts.append(f"// ---- {name} ----\n{text}")
    body = "\n".join(parts)
    digest = hashlib.sha256(body.encode()).hexdigest()[:16]
    return f"// santa-cupy kernels, sources sha256 {digest}\n{body}"


def instance_names(dtype_name: str, head_dim: int, block_n: int) -> dict[str, str]:
    """Template instances (NVRTC name expressions) of one configuration, by role."""
    t = STORAGE_TYPE[dtype_name]
    return {
        "dense": f"decode_dense_partial<{t}, {head_dim}, {block_n}>",
        "score": f"santa_score<{t}, {head_dim}, {block_n}>",
        "tile": f"santa_tile<{t}, {head_dim}, {block_n}>",
        "merge": f"santa_merge<{t}, {head_dim}>",
        "prefix": "santa_prefix",
        "advance": "santa_advance_step",
    }


def source_for(dtype_name: str, head_dim: int, block_n: int) -> tuple[str, list[str]]:
    """(source, name expressions) for one configuration; the names are part of the source text so
    that each configuration has its own CuPy cache entry."""
    names = list(instance_names(dtype_name, head_dim, block_n).values())
    return build_source() + "\n// instances: " + "; ".join(names) + "\n", names


# ---- shared-memory sizes (mirror the layouts documented in each .cu file) ---------------------
def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def row_groups(head_dim: int) -> int:
    return THREADS // (head_dim // CHUNK)


def dense_smem_bytes(dtype_name, head_dim, block_n, group) -> int:
    tiles = 2 * block_n * (head_dim + PAD) * ITEMSIZE[dtype_name]
    floats = group * head_dim + group * block_n + row_groups(head_dim) * group * head_dim + 5 * group
    return tiles + 4 * floats


def score_smem_bytes(dtype_name, head_dim, block_n, group) -> int:
    tile = block_n * (head_dim + PAD) * ITEMSIZE[dtype_name]
    return tile + 4 * (group * head_dim + group * block_n + 2 * group)


def tile_smem_bytes(dtype_name, head_dim, block_n, group, budget) -> int:
    rg = row_groups(head_dim)
    n = 4 * (2 * group * block_n + rg * group * head_dim + rg * group + block_n + 4 + 2 * group)
    n = _round16(n) + _round16(group * HEAD_DRAW_BYTES)
    if budget == "fixed":
        n += block_n * (head_dim + PAD) * ITEMSIZE[dtype_name] + 4 * group * head_dim
    return n


@dataclass
class KernelSet:
    dense: object
    score: object
    tile: object
    merge: object
    prefix: object
    advance: object


@functools.lru_cache(maxsize=None)
def get_kernels(dtype_name: str, head_dim: int, block_n: int) -> KernelSet:
    """Compile (or fetch from CuPy's cache) the kernels of one configuration. Needs CuPy + a GPU."""
    import cupy

    if (dtype_name, head_dim, block_n) not in CONFIGS:
        raise ValueError(f"no kernel instance for dtype={dtype_name!r}, head_dim={head_dim}, "
                         f"block_n={block_n}; supported: {CONFIGS}")
    source, names = source_for(dtype_name, head_dim, block_n)
    module = cupy.RawModule(code=source, options=NVRTC_OPTIONS, name_expressions=names)
    roles = instance_names(dtype_name, head_dim, block_n)
    return KernelSet(**{role: module.get_function(name) for role, name in roles.items()})


def launch(kernel, grid, args, shared_mem: int = 0, threads: int = THREADS):
    """Launch on the current stream with enough dynamic shared memory (raising the limit if needed)."""
    if shared_mem > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    kernel(tuple(int(x) for x in grid), (threads,), tuple(args), shared_mem=shared_mem)


i32, i64, u64, f32, f64 = np.int32, np.int64, np.uint64, np.float32, np.float64

"""Fill CuPy's on-disk kernel cache for every CI configuration, compiling in parallel processes.

A fresh GPU machine compiles each (dtype, head_dim, group, role) module on first use (about 40 s
each on the H200 machine's CPUs, one at a time in a test session); this compiles them all at once
first (120 modules: ~5 minutes on 16 cores). Needs CuPy and a GPU. `--config` limits it to the
modules of some configurations, e.g. the llama8b bench shape's three (bfloat16,128,4); `--root`
compiles another checkout's kernels (tools/ab_bench.sh's trees).

    python tools/warm_kernel_cache.py [--jobs 16] [--config bfloat16,128,4 ...] [--root DIR]
"""

import argparse
import importlib
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _kernels(root):
    """santa_cupy.kernels of the checkout at root."""
    sys.path.insert(0, str(root))
    return importlib.import_module("santa_cupy.kernels")


def _compile(job):
    import cupy

    root, dtype, d, g, role = job
    kernels = _kernels(root)
    source, names = kernels.source_for(dtype, d, g, role)
    module = cupy.RawModule(code=source, options=kernels.NVRTC_OPTIONS, name_expressions=names)
    module.get_function(names[0])          # forces compilation (and the cache write)
    return job


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    ap.add_argument("--config", action="append", default=None, metavar="DTYPE,HEAD_DIM,GROUP",
                    help="only this configuration's modules (repeatable; default: kernels.CI_CONFIGS)")
    ap.add_argument("--root", type=Path, default=HERE, help="the checkout whose kernels to compile (default: this one)")
    args = ap.parse_args()
    root = args.root.resolve()
    if not (root / "santa_cupy" / "kernels.py").is_file():
        ap.error(f"--root {args.root}: no santa_cupy/kernels.py there")
    kernels = _kernels(root)
    configs = kernels.CI_CONFIGS
    if args.config:
        try:
            configs = [(dtype, int(d), int(g)) for dtype, d, g in (c.split(",") for c in args.config)]
        except ValueError:
            ap.error(f"--config takes dtype,head_dim,group (e.g. bfloat16,128,4), got {args.config}")
    jobs = [(str(root), *cfg, role) for cfg in configs for role in kernels.roles()]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for _ in pool.imap_unordered(_compile, jobs):
            pass
    print(f"compiled {len(jobs)} kernel modules in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

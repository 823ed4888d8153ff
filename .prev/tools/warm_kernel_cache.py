"""Fill CuPy's on-disk kernel cache for every CI configuration, compiling in parallel processes.

A fresh GPU machine compiles each (dtype, head_dim, group, role) module on first use (1-2 s each,
one at a time in a test session); this compiles them all at once first. Needs CuPy and a GPU.

    python tools/warm_kernel_cache.py [--jobs 16]
"""

import argparse
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy import kernels  # noqa: E402


def _compile(job):
    import cupy

    dtype, d, g, role = job
    source, names = kernels.source_for(dtype, d, g, role)
    module = cupy.RawModule(code=source, options=kernels.NVRTC_OPTIONS, name_expressions=names)
    module.get_function(names[0])          # forces compilation (and the cache write)
    return job


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 4)
    args = ap.parse_args()
    jobs = [(*cfg, role) for cfg in kernels.CI_CONFIGS for role in kernels.roles()]
    t0 = time.time()
    with mp.get_context("spawn").Pool(args.jobs) as pool:
        for _ in pool.imap_unordered(_compile, jobs):
            pass
    print(f"compiled {len(jobs)} kernel modules in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Compile every kernel instance through NVRTC (the runtime's compiler) for several GPU archs.

No GPU needed: this is what CI runs so that a kernel that does not compile never lands. It uses
the same source text and name expressions as santa_cupy.kernels (what CuPy's RawModule gets) and
prints ptxas's register / spill report per kernel.

    python tools/compile_kernels.py [--arch 80 89 90] [--config bfloat16,128,64] [--verbose]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import re
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_min import ops as decoder_ops  # noqa: E402
from santa_cupy import kernels  # noqa: E402


def find_nvrtc() -> str:
    """libnvrtc from the nvidia-cuda-nvrtc wheel, CUDA_PATH, or /usr/local/cuda."""
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # pip install nvidia-cuda-nvrtc-cu12
        for root in pkg.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libnvrtc.so*")))
    except ImportError:
        pass
    for root in (os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += sorted(glob.glob(os.path.join(root, "lib64", "libnvrtc.so*")))
    candidates = [c for c in candidates if "builtins" not in c and ".alt." not in c]
    if not candidates:
        sys.exit("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12, or set CUDA_PATH")
    return candidates[0]


class Nvrtc:
    def __init__(self, path: str):
        self.lib = ctypes.CDLL(path)
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def _check(self, status: int, what: str, log: str = ""):
        if status != 0:
            msg = self.lib.nvrtcGetErrorString(status).decode()
            raise RuntimeError(f"{what}: {msg}\n{log}")

    def compile(self, source: str, names: list[str], options: list[str]) -> str:
        """Compile to machine code; returns the log. Raises on failure."""
        prog = ctypes.c_void_p()
        self._check(self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"santa.cu",
                                                0, None, None), "nvrtcCreateProgram")
        try:
            for name in names:
                self._check(self.lib.nvrtcAddNameExpression(prog, name.encode()), f"add {name}")
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            status = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            buf = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetProgramLog(prog, buf)
            log = buf.value.decode(errors="replace")
            self._check(status, "nvrtcCompileProgram", log)
            return log
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def summarize(log: str) -> list[str]:
    """ptxas lines: 'Function properties' / 'Used N registers' per kernel, spills flagged."""
    lines, current = [], None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            current = m.group(1)
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m and current:
            spill = " SPILLS" if int(m.group(2)) or int(m.group(3)) else ""
            lines.append(f"    {current[:60]:60s} stack {m.group(1)} B, spill st {m.group(2)} ld {m.group(3)}{spill}")
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            lines.append(f"    {current[:60]:60s} {m.group(1)} registers")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", nargs="+", default=["80", "89", "90"])
    ap.add_argument("--config", action="append", help="dtype,head_dim,group (default: kernels.CI_CONFIGS)")
    ap.add_argument("--verbose", action="store_true", help="print the register/spill report")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    configs = kernels.CI_CONFIGS
    if args.config:
        configs = [(c.split(",")[0], int(c.split(",")[1]), int(c.split(",")[2])) for c in args.config]
    nvrtc = Nvrtc(find_nvrtc())
    jobs = [((*cfg, role), arch) for cfg in configs for role in kernels.roles() for arch in args.arch]
    if not args.config:                 # the decoder's own kernels (one module: gemv.cu + decoder.cu)
        jobs += [(("-", 0, 0, "decoder"), arch) for arch in args.arch]

    def run(job):
        (dtype, d, g, role), arch = job
        if role == "decoder":
            source, names = decoder_ops.source()
        else:
            source, names = kernels.source_for(dtype, d, g, role)
        opts = list(kernels.NVRTC_OPTIONS) + [f"--gpu-architecture=sm_{arch}", "--ptxas-options=-v"]
        t0 = time.time()
        try:
            log = nvrtc.compile(source, names, opts)
            return job, True, log, time.time() - t0
        except RuntimeError as exc:
            return job, False, str(exc), time.time() - t0

    failures = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for (cfg, arch), ok, log, secs in pool.map(run, jobs):
            print(f"sm_{arch} {cfg[0]:9s} D={cfg[1]:3d} G={cfg[2]:2d} {cfg[3]:9s}: {'ok' if ok else 'FAILED'} ({secs:.1f} s)")
            if not ok:
                failures += 1
                print(log)
            elif args.verbose or "SPILLS" in "\n".join(summarize(log)):
                print("\n".join(summarize(log)))
    print(f"{len(jobs) - failures}/{len(jobs)} kernel builds compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

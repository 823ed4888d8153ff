"""The plan's dynamic shared memory against what the kernels themselves touch (marker gpu).

Each case runs one plan in a child process under compute-sanitizer's memcheck: with the plan's
sizes no kernel may touch shared memory outside its allocation (the sizes suffice); with one
kernel's size cut by 256 bytes memcheck must report an out-of-bounds __shared__ access in that
kernel (the kernel uses the end of what the plan gives it, so the check has teeth and the size is
not padding). test_plan_host.test_shared_memory_bytes_by_the_kernels_layout checks the same
shapes' byte counts on the CPU. Skipped where compute-sanitizer is missing or refuses the device
(it does under gVisor).
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu_util import requires_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

ROOT = Path(__file__).resolve().parent.parent
SHRINK = 256          # > the 128-byte allocation unit, so that the cut allocation really ends sooner
# CuPy's own probing calls that fail by design are not this test's errors: kernel accesses only
MEMCHECK = ["--tool", "memcheck", "--report-api-errors", "no"]

CHILD = r"""
import json, sys
import numpy as np
import cupy
import santa_cupy
from santa_cupy import kernels
from tests.gpu_util import make_plan, random_inputs, to_gpu

options, target, shrink = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
q, k, v, lens = random_inputs(np.random.default_rng(4), 2, 8, 2, 128, 3000, [3000, 17], "bfloat16", peak=0.5)
plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, dtype="bfloat16",
                 samples=1024, santa_min_length=0, **options)
fields = {id(getattr(plan.kernels, f)): f for f in vars(plan.kernels) if getattr(plan.kernels, f) is not None}
real_launch, seen = kernels.launch, []

def launch(kernel, grid, args, shared_mem=0, threads=kernels.THREADS, **options):   # options: kernels.launch's
    field = fields.get(id(kernel), "?")
    if shared_mem and field.startswith(target):
        shared_mem -= shrink
    seen.append((field, shared_mem))
    real_launch(kernel, grid, args, shared_mem=shared_mem, threads=threads, **options)

kernels.launch = launch
plan.run(*to_gpu(q, k, v, lens))
cupy.cuda.Device().synchronize()
print("LAUNCHED", json.dumps(seen))
"""

# (plan options, the KernelSet field(s) of the kernel with dynamic shared memory, its name, cut it?)
CASES = [
    (dict(method="dense", dense_kernel="stream"), "dense", "decode_dense_partial", True),
    (dict(method="dense", dense_kernel="mma"), "dense_mma", "decode_dense_mma", True),
    (dict(method="santa", budget="fixed", block_n=64, tile_kernel="block", score_kernel="stream"), "tile",
     "santa_tile", False),
    # "warp": the last bytes (a pipelined tile's counts) are written only by light tiles: not cut
    (dict(method="santa", block_n=128, tile_kernel="warp"), "tile_warp", "santa_tile_warp", False),
    (dict(method="santa", block_n=128, tile_kernel="warp_mma"), "tile_warp_mma", "santa_tile_warp", False),
    (dict(method="santa", budget="one_pass", block_n=64), "one_pass", "santa_one_pass", False),
]


def _sanitizer():
    return shutil.which("compute-sanitizer") or next(
        (str(p) for p in sorted(Path("/usr/local").glob("cuda*/bin/compute-sanitizer")) if p.is_file()), None)


@pytest.fixture(scope="module")
def memcheck():
    exe = _sanitizer()
    if exe is None:
        pytest.skip("compute-sanitizer not found")
    probe = subprocess.run([exe, *MEMCHECK, sys.executable, "-c",
                            "import cupy; assert int((cupy.arange(4) + 1).sum()) == 10"],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    out = probe.stdout + probe.stderr
    if probe.returncode != 0 or "ERROR SUMMARY: 0 errors" not in out:
        pytest.skip(f"compute-sanitizer does not run here: {out.strip().splitlines()[:3]}")

    def run(options, target, shrink):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        res = subprocess.run([exe, *MEMCHECK, "--print-limit", "20", sys.executable, "-c", CHILD,
                              json.dumps(options), target, str(shrink)],
                             capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        out = res.stdout + res.stderr
        m = re.search(r"ERROR SUMMARY: (\d+) error", out)
        launched = re.search(r"^LAUNCHED (.*)$", out, re.M)
        return (int(m.group(1)) if m else None), (json.loads(launched.group(1)) if launched else None), out
    return run


@pytest.mark.parametrize("options,target,name,cut", CASES, ids=[c[1] for c in CASES])
def test_plan_shared_memory_fits_the_kernel(memcheck, options, target, name, cut):
    import cupy
    import numpy as np

    from tests.gpu_util import make_plan, random_inputs, to_gpu

    # compile here first (CuPy's kernel cache), so the child under the sanitizer only loads
    q, k, v, lens = random_inputs(np.random.default_rng(4), 2, 8, 2, 128, 3000, [3000, 17], "bfloat16")
    make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, dtype="bfloat16",
              samples=1024, santa_min_length=0, **options).run(*to_gpu(q, k, v, lens))
    cupy.cuda.Device().synchronize()

    errors, launched, out = memcheck(options, target, 0)
    assert launched is not None, out[-3000:]
    assert any(f.startswith(target) and smem > 0 for f, smem in launched), launched
    assert errors == 0, f"with the plan's sizes {launched}:\n{out[-3000:]}"
    if cut:
        errors, launched, out = memcheck(options, target, SHRINK)
        assert errors, f"{name} with {SHRINK} bytes less shared memory: no error ({launched})"
        assert re.search(r"Invalid __shared__ (read|write)", out) and name in out, out[-3000:]

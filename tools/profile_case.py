"""One decode-attention configuration run a few times, for `ncu` (Nsight Compute).

    ncu --clock-control none --section SpeedOfLight python3 tools/profile_case.py dense 1 32768
    python3 tools/profile_case.py santa-global-systematic-256 16 32768 [--kernel stream] [--tiles-per-warp 1]
    python3 tools/profile_case.py santa-fixed-systematic-2048 16 32768 --tile-kernel warp_mma
    python3 tools/profile_case.py santa-global-systematic-256 1 32768 --kernel stream
    python3 tools/profile_case.py santa-global-systematic-256 1 32768 --always   (no dense fallback)
    ncu --profile-from-start off ... tools/profile_case.py torch-cudnn 16 32768   (torch SDPA on a contiguous
      [B, KVH, L, D] copy; only its runs are profiled)

Llama-3.1-8B shapes (H=32, KVH=8, D=128; `--shape smollm2`: H=9, KVH=3, D=64), bf16, random K/V;
runs the plan `--runs` times."""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402

from santa_cupy import AttentionSetting, DecodePlan, spec  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("method", help="dense, santa-<budget>-<sampler>-<S> or torch-<flash|cudnn> (the baseline)")
ap.add_argument("batch", type=int)
ap.add_argument("context", type=int)
ap.add_argument("--kernel", default="auto", help="dense and the santa score pass: auto|stream|mma")
ap.add_argument("--tile-kernel", default="auto", help="santa pass 2: auto|block|warp|warp_mma")
ap.add_argument("--tiles-per-warp", type=int, default=None, help="santa v4 kernels: tiles per warp (default: fitted)")
ap.add_argument("--runs", type=int, default=3)
ap.add_argument("--always", action="store_true", help="santa at every length (santa_min_length=0; else the "
                "plan's crossover may run the case exact)")
ap.add_argument("--shape", default="llama8b", choices=("llama8b", "smollm2"))
a = ap.parse_args()

H, KVH, D = (32, 8, 128) if a.shape == "llama8b" else (9, 3, 64)
B, L = a.batch, a.context
rs = cupy.random.RandomState(0)
q = spec.from_float32(rs.standard_normal((B, H, D), dtype=cupy.float32), "bfloat16", cupy)
k = spec.from_float32(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32) * 0.5, "bfloat16", cupy)
v = spec.from_float32(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32), "bfloat16", cupy)
lengths = cupy.full((B,), L, cupy.int32)
kind = a.kernel
if a.method.startswith("torch-"):                  # the baseline, on a contiguous [B, KVH, L, D] copy
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[a.method[6:]]
    tq, tk, tv = (torch.from_dlpack(x).view(torch.bfloat16) for x in (q, k, v))
    tq, tk, tv = tq[:, :, None, :], tk.transpose(1, 2).contiguous(), tv.transpose(1, 2).contiguous()
    with sdpa_kernel(backend):
        F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)      # warm-up, outside the profile
        torch.cuda.synchronize()
        torch.cuda.profiler.start()        # ncu --profile-from-start off sees only the SDPA runs
        for _ in range(a.runs):
            F.scaled_dot_product_attention(tq, tk, tv, enable_gqa=True)
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    print("profile case done:", a.method, B, L)
    sys.exit(0)
if a.method == "dense":
    plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16",
                      method="dense", _kernels=KernelChoice(dense_kernel=kind))
else:
    plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16",
                      setting=AttentionSetting.parse(a.method).replace(  # santa-<budget>-<sampler>-<S>
                          **({"santa_min_length": 0} if a.always else {})),
                      _kernels=KernelChoice(score_kernel=kind, tile_kernel=a.tile_kernel,
                                            tiles_per_warp=a.tiles_per_warp))
    print(f"score {plan.score_kernel} x{plan.score_tpw}, pass 2 {plan.tile_kernel} x{plan.tile_tpw}, "
          f"santa from {plan.santa_from} rows")
for _ in range(a.runs):
    plan.run(q, k, v, lengths)
cupy.cuda.Device().synchronize()
print("profile case done:", a.method, B, L, kind)

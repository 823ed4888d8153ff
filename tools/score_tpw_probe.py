"""Probe: the santa score pass alone (santa_score_mma) at forced run lengths (tiles a warp), to see
whether a one-wave grid of long runs (the plan's fit) or more, shorter runs stream K faster.

    python tools/score_tpw_probe.py [--cases 16x32768 4x32768 1x32768] [--tpw 0 1 2 4 8 16]   (0: the plan's)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy import AttentionSetting, DecodePlan  # noqa: E402
from santa_cupy.cli.bench.timing import event_median_us  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["16x32768", "4x32768", "1x32768", "16x131072"])
    ap.add_argument("--tpw", type=int, nargs="+", default=[0, 1, 2, 4, 8, 16])
    ap.add_argument("--dense-cases", nargs="+", default=["1x8192", "1x32768", "4x8192", "16x8192"])
    ap.add_argument("--splits", type=int, nargs="+", default=[0, 16, 32, 48, 64, 96, 128])
    a = ap.parse_args()
    import cupy

    H, KVH, D = 32, 8, 128
    setting = AttentionSetting(method="santa", budget="global", sampler="systematic", samples=256)
    bf16 = lambda x: (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # noqa: E731
    for case in a.cases:
        B, L = map(int, case.split("x"))
        rs = cupy.random.default_rng(B * L)
        q = bf16(rs.standard_normal((B, H, D), dtype=cupy.float32))
        k = bf16(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32) * 0.5)
        v = k
        lengths = cupy.full((B,), L, cupy.int32)
        row = []
        for tpw in a.tpw:
            choice = KernelChoice(tiles_per_warp=tpw or None)
            p = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16",
                           setting=setting, santa_min_length=0, _kernels=choice)
            p.run(q, k, v, lengths)
            score = p.stage_launchers(q, k, v, lengths)["score"]
            us = event_median_us(cupy, score, cupy.cuda.get_current_stream(), repeats=20, warmup=3, inner=5)
            row.append(f"tpw {tpw or f'auto={p.score_tpw}'}: {us:.1f}")
            del p
        print(f"B={B} L={L} score pass us: " + " | ".join(row), flush=True)
    for case in a.dense_cases:                  # our dense at forced splits a KV group (whole call)
        B, L = map(int, case.split("x"))
        rs = cupy.random.default_rng(B * L)
        q = bf16(rs.standard_normal((B, H, D), dtype=cupy.float32))
        k = bf16(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32) * 0.5)
        lengths = cupy.full((B,), L, cupy.int32)
        row = []
        for n in a.splits:
            p = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16",
                           setting=AttentionSetting(method="dense"), _kernels=KernelChoice(dense_splits=n or None))
            us = event_median_us(cupy, lambda: p.run(q, k, k, lengths, validate=False), cupy.cuda.get_current_stream(),
                                 repeats=20, warmup=3, inner=5)
            row.append(f"splits {n or 'auto'}={p.P_max}x{p.part_rows}: {us:.1f}")
        print(f"dense B={B} L={L} us: " + " | ".join(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

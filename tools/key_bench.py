"""Time the K pass of block key sampling against the standard-layout score pass (GPU, CuPy events).

    python tools/key_bench.py [--batch 16 --heads 32 --kv-heads 8 --head-dim 128 --length 32768
                               --dtype bfloat16 --key-block 16 --budgets 1.0 0.75 0.5 0.25 --reps 20]

The blocked pass (santa_key_blocks + santa_score_keys or santa_score_keys_mma, --kernels, on K in key_layout="blocked", rule
"uniform": every block has pi = budget) at each budget, and beside it the score pass a plan runs
today on the standard layout (santa_score_mma, the automatic choice, and santa_score, the FMA
pass the blocked kernel is built like). Each line: µs per pass, K bytes read (measured from the
blocks the draws selected), TB/s, and for the blocked pass the fraction of the proportional saving
achieved, (t_1 - t_f) / (t_1 (1 - f)) with t_1 the time at budget 1 and f the fraction read
(issue #17's target: >= 0.85); also the score kernel alone on the same draws (eager, with its
own saving) and santa_key_blocks' time alone in a CUDA graph (the draws: latency, not bytes; eager
launches of it timed the host, 15-35 us). Writes stash and tile stats to scratch buffers; nothing else runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy import AttentionSetting, key_layout, kernels  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402
from santa_cupy.key_pass import KeyScorePass  # noqa: E402
from santa_cupy.plan import STORAGE_DTYPE, DecodePlan  # noqa: E402
from santa_cupy.cli.bench.timing import event_median_us, time_cupy_graph  # noqa: E402


def time_us(cupy, fn, reps, warmup=3):
    """Mean µs per call of fn over reps back-to-back calls between two CUDA events."""
    return event_median_us(cupy, fn, cupy.cuda.get_current_stream(), repeats=1, warmup=warmup, inner=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--length", type=int, default=32768)
    ap.add_argument("--dtype", default="bfloat16", choices=kernels.KEY_SAMPLING_DTYPES)
    ap.add_argument("--key-block", type=int, default=16, choices=(16, 32))
    ap.add_argument("--block-n", type=int, default=128)
    ap.add_argument("--budgets", type=float, nargs="+", default=[1.0, 0.75, 0.5, 0.25])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--kernels", nargs="+", default=["stream", "mma"], choices=("stream", "mma"),
                    help="the blocked pass's score kernels: santa_score_keys (FMA), santa_score_keys_mma")
    ap.add_argument("--rule", default="uniform", choices=("uniform", "qmax", "qrms"),
                    help="the blocks' inclusion rule (uniform: pi = budget, no search; qmax / qrms: "
                         "santa_key_blocks bisects for the budget)")
    args = ap.parse_args()
    import cupy

    B, H, KVH, D, L, FB = args.batch, args.heads, args.kv_heads, args.head_dim, args.length, args.key_block
    itemsize = kernels.ITEMSIZE[args.dtype]
    storage = STORAGE_DTYPE[args.dtype]
    rs = cupy.random.default_rng(0)
    as_storage = (lambda x: (x.view(cupy.uint32) >> 16).astype(cupy.uint16)) if args.dtype == "bfloat16" \
        else (lambda x: x.astype(cupy.float16))
    q = as_storage(rs.standard_normal((B, H, D), dtype=cupy.float32))
    k = as_storage(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32))
    assert q.dtype == storage
    kb = key_layout.to_blocked(k, FB)
    lengths = cupy.full((B,), L, cupy.int32)
    step = cupy.zeros((1,), cupy.int64)
    scale = 1.0 / np.sqrt(D)
    T_max = -(-L // args.block_n)
    scores = cupy.empty((B, H, L), cupy.float32)
    part_s = cupy.empty((B, H, T_max, 4), cupy.float32)
    k_bytes = B * L * KVH * D * itemsize
    print(f"B={B} H={H} KVH={KVH} D={D} L={L} {args.dtype} FB={FB} block_n={args.block_n}: K = {k_bytes / 1e6:.1f} MB")
    print(f"{'pass':44s} {'us':>9s} {'K MB read':>10s} {'TB/s':>6s} {'fraction':>8s} {'saving':>7s}")

    for name, choice in (("standard: santa_score_mma (the plan's today)", KernelChoice(score_kernel="mma")),
                         ("standard: santa_score (FMA)", KernelChoice(score_kernel="stream", tile_kernel="block"))):
        plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype=args.dtype,
                          setting=AttentionSetting(block_n=args.block_n, santa_min_length=0), _kernels=choice)
        pages = plan._page_args(None, k)
        us = time_us(cupy, lambda: plan._score(q, k, lengths, pages), args.reps)
        print(f"{name:44s} {us:9.1f} {k_bytes / 1e6:10.1f} {k_bytes / us / 1e6:6.2f} {1.0:8.3f}")

    for kernel in args.kernels:
        bench_blocked(cupy, kernel, args, q, kb, lengths, step, scale, scores, part_s, k_bytes)
    return 0


def bench_blocked(cupy, kernel, args, q, kb, lengths, step, scale, scores, part_s, k_bytes):
    """The blocked key pass with score kernel ``kernel`` at each of args.budgets."""
    B, H, KVH, D, L, FB = args.batch, args.heads, args.kv_heads, args.head_dim, args.length, args.key_block
    t_full = None
    for budget in args.budgets:
        setting = AttentionSetting(block_n=args.block_n, key_sampling="bernoulli_block", key_block=FB,
                                   key_budget=budget, key_rule=args.rule)
        kp = KeyScorePass(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype=args.dtype,
                          block_n=args.block_n, setting=setting, scale=scale, score_kernel=kernel)
        us = time_us(cupy, lambda: kp.launch(q, kb, lengths, step, 0, scores, part_s), args.reps)
        # the score kernel alone on the same draws, and santa_key_blocks alone: a launch of a few
        # microseconds, so in a CUDA graph (eager launches time the host)
        us_scores = time_us(cupy, lambda: kp.launch_scores(q, kb, lengths, scores, part_s), args.reps)
        us_blocks = time_cupy_graph(cupy, [lambda: kp.launch_blocks(q, step, 0)], 20, 15)[0]
        fraction = float(kp.blocks_read.sum().get()) / (B * KVH * kp.C)
        read = k_bytes * fraction
        if budget == 1.0:
            t_full, t_full_scores = us, us_scores
        saving = saving_scores = ""
        if t_full is not None and fraction < 1.0:
            saving = f"{(t_full - us) / (t_full * (1.0 - fraction)):7.2f}"
            saving_scores = f", saving {(t_full_scores - us_scores) / (t_full_scores * (1.0 - fraction)):.2f}"
        print(f"{'blocked ' + kernel + ', budget ' + format(budget, 'g'):44s} {us:9.1f} {read / 1e6:10.1f} "
              f"{read / us / 1e6:6.2f} {fraction:8.3f} {saving}   (score kernel alone {us_scores:.1f} us"
              f"{saving_scores}; santa_key_blocks alone {us_blocks:.1f} us, "
              f"{kp.tiles_per_block} tiles a {'warp' if kernel == 'mma' else 'block'})")
    if t_full is None:
        print("(no budget 1.0 in --budgets: the saving needs its time)")


if __name__ == "__main__":
    sys.exit(main())

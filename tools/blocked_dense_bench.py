"""Time dense attention on a feature-blocked K against the standard layout (GPU, CuPy events).

    python tools/blocked_dense_bench.py [--batches 1 16 --lengths 8192 32768 --heads 32 --kv-heads 8
                                         --head-dim 128 --dtype bfloat16 --key-blocks 16 32 --reps 50
                                         --rounds 5]

For each batch B and length L (every sequence L long, the llama8b shape by default): a dense
DecodePlan on K [B, L, KVH, D] (decode_dense_mma) and one with key_layout="blocked" on
to_blocked(K, FB) [B, KVH, D / FB, L, FB] (decode_dense_mma_blocked) for each FB, V the same
array. Each line: µs per plan.run (the whole dense step: split-KV kernel and, above 32 splits a
KV group, santa_merge), the blocked / standard ratio (issue #17's target: <= 1.03), the plans'
splits (rows a split, splits a group: alike for the two unless the kernels' occupancy differs),
and whether the blocked output equals the standard one bit for bit. The plans run alternately,
``rounds`` rounds of ``reps`` calls each, and the median round counts, so clock and thermal drift
hit both alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy import DecodePlan, kernels, key_layout  # noqa: E402
from santa_cupy.cli.bench.timing import event_median_us  # noqa: E402


def time_us(cupy, fn, reps, warmup=0):
    """Mean µs per call of fn over reps back-to-back calls between two CUDA events."""
    return event_median_us(cupy, fn, cupy.cuda.get_current_stream(), repeats=1, warmup=warmup, inner=reps)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128, choices=kernels.MMA_HEAD_DIMS)
    ap.add_argument("--dtype", default="bfloat16", choices=kernels.MMA_DTYPES)
    ap.add_argument("--key-blocks", type=int, nargs="+", default=[16, 32], choices=(16, 32))
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    import cupy

    H, KVH, D = args.heads, args.kv_heads, args.head_dim
    as_storage = (lambda x: (x.view(cupy.uint32) >> 16).astype(cupy.uint16)) if args.dtype == "bfloat16" \
        else (lambda x: x.astype(cupy.float16))
    print(f"H={H} KVH={KVH} D={D} {args.dtype}, {args.rounds} rounds of {args.reps} runs (median round)")
    print(f"{'B':>3s} {'L':>6s} {'FB':>3s} {'standard us':>11s} {'blocked us':>10s} {'ratio':>6s} "
          f"{'splits std':>12s} {'splits blk':>12s} {'bitwise':>7s}")
    for B in args.batches:
        for L in args.lengths:
            rs = cupy.random.default_rng(B * L)
            q = as_storage(rs.standard_normal((B, H, D), dtype=cupy.float32))
            k = as_storage(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32))
            v = as_storage(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32))
            lengths = cupy.full((B,), L, cupy.int32)
            shape = dict(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype=args.dtype, method="dense")
            standard = DecodePlan(**shape)
            for FB in args.key_blocks:
                kb = key_layout.to_blocked(k, FB)
                blocked = DecodePlan(**shape, key_layout="blocked", key_block=FB)
                o_std = standard.run(q, k, v, lengths).copy()
                o_blk = blocked.run(q, kb, v, lengths).copy()
                same = bool((o_std == o_blk).all())
                runs = {"std": lambda: standard.run(q, k, v, lengths, validate=False),
                        "blk": lambda: blocked.run(q, kb, v, lengths, validate=False)}
                for fn in runs.values():                  # warm-up
                    time_us(cupy, fn, 3)
                times = {name: [] for name in runs}
                for _ in range(args.rounds):
                    for name, fn in runs.items():
                        times[name].append(time_us(cupy, fn, args.reps))
                t_std, t_blk = (statistics.median(times[n]) for n in ("std", "blk"))
                split = lambda p: f"{p.part_rows}x{p.P_max}"  # noqa: E731
                print(f"{B:3d} {L:6d} {FB:3d} {t_std:11.1f} {t_blk:10.1f} {t_blk / t_std:6.3f} "
                      f"{split(standard):>12s} {split(blocked):>12s} {str(same):>7s}")
                del kb, blocked
            del k, v, standard
            cupy.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())

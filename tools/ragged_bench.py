"""Ragged batches against the uniform batch that reads the same rows (issue 18's balance target).

    python tools/ragged_bench.py [--lengths 131072,1024x15] [--methods dense,santa-global-systematic-256]

For each method (santa_cupy.cli.bench.methods' names): the ragged batch (lengths as given, L_max = the longest), the
uniform batch of as many sequences reading the same rows in total (each sum / B rows), and the
longest sequence alone at batch 1; µs from santa_cupy.cli.bench.timing's CUDA-graph timer over rotating inputs.
Prints a Markdown table with ragged / uniform (the target: at most 1.15x).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy.cli import bench  # noqa: E402


def parse_lengths(text: str) -> list[int]:
    out = []
    for part in text.split(","):
        n, _, times = part.partition("x")
        out += [bench.methods.parse_size(n)] * (int(times) if times else 1)
    return out


def time_method(cp, method, shape, lengths, copies, repeats=20, inner=20, always=False):
    B, L = len(lengths), max(lengths)
    inputs = bench.kernels.make_inputs(cp, shape, B, L, copies)
    options = dict(santa_min_length=0) if always and method.kind == "santa" else {}
    plan = bench.kernels.our_plan(method, shape, B, L, **options)
    lens = cp.asarray(lengths, dtype=cp.int32)
    fns = [lambda q=q, k=k, v=v: plan.run(q, k, v, lens, validate=False) for q, k, v in inputs]
    us, _ = bench.timing.time_cupy_graph(cp, fns, inner, repeats)
    return us


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="131072,1024x15")
    ap.add_argument("--methods", default="dense,santa-global-systematic-256,santa-global-systematic-256-always")
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--copies", type=int, default=3)
    ap.add_argument("--always", action="store_true",
                    help="santa at every length (santa_min_length=0) for every santa method, e.g. with -warpmma")
    args = ap.parse_args()
    cp = bench.gpu._cupy()
    shape = bench.methods.parse_shape(args.shape)
    lengths = parse_lengths(args.lengths)
    B = len(lengths)
    uniform = [-(-sum(lengths) // B)] * B
    print(f"ragged {args.lengths} (B={B}, {sum(lengths)} rows) vs uniform {B} x {uniform[0]}; {shape}")
    print("| method | ragged µs | uniform µs | ragged / uniform | longest alone (B=1) µs | ragged / alone |")
    print("|---|---|---|---|---|---|")
    for name in args.methods.split(","):
        m = bench.methods.parse_method(name)
        r = time_method(cp, m, shape, lengths, args.copies, always=args.always)
        u = time_method(cp, m, shape, uniform, args.copies, always=args.always)
        a = time_method(cp, m, shape, [max(lengths)], args.copies, always=args.always)
        print(f"| {name} | {r:.1f} | {u:.1f} | {r / u:.2f}x | {a:.1f} | {r / a:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

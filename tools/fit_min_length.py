"""Fit santa_min_length's costs (santa_cupy/kernels.py) to the crossovers of a bench run.

    PYTHONPATH=. python3 tools/fit_min_length.py run.json [more.json ...] [--bandwidth 4.8e12]

Reads `bench kernels --json` files holding our `dense` and SANTA at every length
(`santa-global-systematic-256-always`, `santa-fixed-systematic-2048-always`) at several lengths
for each batch, all of one shape. For each batch and S it finds the length where SANTA becomes
faster than dense (linear in the two methods' time difference between the measured lengths on
either side; below the shortest length measured where SANTA is faster everywhere: then that
batch does not enter the fit). The kernels.py model says SANTA pays from

    n = (fixed + B * per_sequence) * bandwidth / (B * KVH * D * itemsize)

so each crossover gives fixed + B * per_sequence in peak-bandwidth seconds; a least-squares line
over the batches gives both costs (clipped at 0) for each S, and the two S give the costs' slopes
per sample. It prints the crossovers, the fit, and kernels.py's constants for it.
"""
import argparse
import json
import sys
from collections import defaultdict

import numpy as np

from santa_cupy import kernels
from santa_cupy.cli.bench.methods import ITEMSIZE, SHAPES

FIXED_S = 2048                             # S of the bench's fixed-budget rows: the second fit
SAMPLES = {f"santa-global-systematic-{kernels.SANTA_COST_SAMPLES}-always": kernels.SANTA_COST_SAMPLES,
           f"santa-fixed-systematic-{FIXED_S}-always": FIXED_S}


def crossover(lengths, dense_us, santa_us):
    """The length where santa_us - dense_us changes sign from + to -, linear between the
    measured lengths; None where SANTA is faster at the shortest length, inf where never."""
    diff = np.asarray(santa_us) - np.asarray(dense_us)
    if diff[0] < 0:
        return None
    for i in range(1, len(diff)):
        if diff[i] < 0:
            l0, l1 = lengths[i - 1], lengths[i]
            return l0 + (l1 - l0) * diff[i - 1] / (diff[i - 1] - diff[i])
    return float("inf")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("json", nargs="+")
    ap.add_argument("--bandwidth", type=float, default=kernels.DEFAULT_BANDWIDTH,
                    help="peak DRAM bytes/s of the card that ran the bench (kernels.device_bandwidth)")
    args = ap.parse_args(argv)
    times = defaultdict(dict)                 # (shape, B, method) -> {L: us}
    for path in args.json:
        for r in json.load(open(path))["rows"]:
            if r.get("us") and (r["method"] == "dense" or r["method"] in SAMPLES):
                times[(r["shape"], r["B"], r["method"])][r["L"]] = r["us"]
    fits = {}
    for method, S in SAMPLES.items():
        points = []                            # (B, fixed + B * per_sequence in seconds)
        for (shape, B, m), santa in sorted(times.items()):
            if m != method or (shape, B, "dense") not in times:
                continue
            dense = times[(shape, B, "dense")]
            lengths = sorted(set(santa) & set(dense))
            n = crossover(lengths, [dense[L] for L in lengths], [santa[L] for L in lengths])
            cfg = SHAPES[shape]
            row_bytes = cfg.kv_heads * cfg.head_dim * ITEMSIZE[cfg.dtype]
            shown = "below %d" % lengths[0] if n is None else "never" if n == float("inf") else "%.1fk" % (n / 1024)
            print(f"S={S} B={B} ({shape}): crossover {shown}  lengths {[L // 1024 for L in lengths]}k")
            if n is not None and n != float("inf"):
                points.append((B, n * B * row_bytes / args.bandwidth))
        if len(points) >= 2:
            A = np.array([[1.0, B] for B, _ in points])
            fixed, per_seq = np.linalg.lstsq(A, np.array([c for _, c in points]), rcond=None)[0]
            fixed, per_seq = max(fixed, 0.0), max(per_seq, 0.0)
            fits[S] = (fixed, per_seq)
            print(f"S={S}: fixed {fixed * 1e6:.2f} us + {per_seq * 1e6:.2f} us a sequence")
        else:
            print(f"S={S}: fewer than two crossovers inside the measured lengths, no fit")
    S0 = kernels.SANTA_COST_SAMPLES
    if S0 in fits and FIXED_S in fits:
        (f0, p0), (f1, p1) = fits[S0], fits[FIXED_S]
        print("\nkernels.py:")
        print(f"SANTA_FIXED_COST_S = {f0 * 1e6:.1f}e-6")
        print(f"SANTA_PER_SEQUENCE_COST_S = {p0 * 1e6:.1f}e-6")
        print(f"SANTA_FIXED_COST_PER_SAMPLE_S = {(f1 - f0) / (FIXED_S - S0) * 1e9:.1f}e-9")
        print(f"SANTA_PER_SEQUENCE_COST_PER_SAMPLE_S = {(p1 - p0) / (FIXED_S - S0) * 1e9:.1f}e-9")
    return 0


if __name__ == "__main__":
    sys.exit(main())

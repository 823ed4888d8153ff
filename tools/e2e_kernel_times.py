"""Per-kernel GPU time of one e2e decode step, from an Nsight Compute CSV (gpu__time_duration).

    ncu --clock-control none --csv --metrics gpu__time_duration.sum python3 bench.py e2e --layers 2 ... > k.csv
    python3 tools/e2e_kernel_times.py k.csv --layers 2

Kernels are grouped by name; a step is counted by rope_append or gemv_rope launches / layers
(every step launches one of them once a layer), so the table is µs per decode step, whatever warm-up ran. The sum is
the GPU time with no gaps between kernels; the step's measured time minus it is launch overhead.
"""

import argparse
import csv
import collections
import re


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("csv")
    ap.add_argument("--layers", type=int, required=True)
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"')]
    total = collections.defaultdict(float)
    count = collections.Counter()
    for row in csv.DictReader(lines):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", row["Kernel Name"])[:70]
        unit = row.get("Metric Unit", "ns")
        value = float(row["Metric Value"].replace(",", ""))
        total[name] += value * {"ns": 1e-3, "us": 1.0, "usecond": 1.0, "nsecond": 1e-3, "ms": 1e3, "msecond": 1e3}.get(unit, 1e-3)
        count[name] += 1
    steps = sum(c for n, c in count.items() if re.match(r"(void )?(rope_append|gemv_rope)\b", n))
    steps = max(1, steps // args.layers)
    print(f"{steps} decode steps seen; µs per step (GPU time, no gaps)")
    print("| kernel | launches/step | µs/step |\n|---|---|---|")
    step_sum = 0.0
    for name, t in sorted(total.items(), key=lambda kv: -kv[1]):
        if "stream_read" in name:
            continue                      # the bench's own ceiling measurement
        step_sum += t / steps
        print(f"| {name} | {count[name] / steps:.1f} | {t / steps:.1f} |")
    print(f"| sum | {sum(c for n, c in count.items() if 'stream_read' not in n) / steps:.0f} | {step_sum:.1f} |")


if __name__ == "__main__":
    main()

"""The reference tables of docs/BENCHMARKS.md from one tools/grid_run.sh call's results.

    python tools/grid_tables.py DIR        (DIR: the unpacked grid.tgz, its kernels_*.json and e2e_b*.md)

Prints, in BENCHMARKS.md's format: the kernel grid (every method and peer, "x best peer" = the
fastest of cuDNN, FA2 and FlashInfer at the point over ours), and the measured column of issue
15's targets (SANTA's default against the fastest of our dense and the peers; e2e against dense).
A point or method the call did not reach prints "-".
"""

from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy.cli.bench.methods import PEERS  # method -> column label

OURS = {"default": "santa-global-systematic-256", "always": "santa-global-systematic-256-always",
        "fixed": "santa-fixed-systematic-2048-always"}
TARGETS = [((1, 8192), 1.0), ((1, 32768), 1.5), ((1, 131072), 1.7), ((4, 32768), 1.65),
           ((16, 32768), 1.75), ((16, 131072), 1.8)]
E2E_TARGETS = [(16, 1.45), (1, 1.07)]


def load_rows(folder: Path) -> dict:
    """{(B, L): {method: row}} from every kernels_*.json but the key-sampling rows' file."""
    points: dict = {}
    for path in sorted(glob.glob(str(folder / "kernels_*.json"))):
        if Path(path).name == "kernels_keys.json":
            continue
        for row in json.loads(Path(path).read_text())["rows"]:
            points.setdefault((row["B"], row["L"]), {})[row["method"]] = row
    return points


def cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['us']:.1f}" + (" (exact)" if row.get("exact") else "")


def ratio(row: dict | None) -> str:
    """bench's own "x best peer" of a row (the fastest peer's time / ours)."""
    return "-" if row is None or row.get("x_peer") is None else f"{row['x_peer']:.2f}x"


def kernel_grid(points: dict) -> list[str]:
    head = ("| B | L | dense | " + " | ".join(PEERS.values()) + " | SANTA default | SANTA every length | "
            "fixed S=2048 every length | SANTA default x best peer | every length x best peer | fixed x best peer |")
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for (B, L), rows in sorted(points.items()):
        ours = [rows.get(OURS[k]) for k in ("default", "always", "fixed")]
        cells = [cell(rows.get("dense"))] + [cell(rows.get(p)) for p in PEERS] + [cell(r) for r in ours]
        cells += [ratio(r) for r in ours]
        lines.append(f"| {B} | {L // 1024}k | " + " | ".join(cells) + " |")
    return lines


def e2e_speedups(folder: Path) -> dict:
    """{B: SANTA's default "x dense"} from e2e_b<B>.md's table (the column bench e2e computed)."""
    out = {}
    for path in glob.glob(str(folder / "e2e_b*.md")):
        batch = int(re.search(r"e2e_b(\d+)", path).group(1))
        for line in Path(path).read_text().splitlines():
            cols = [c.strip() for c in line.strip().strip("|").split("|")]
            if cols[0] == OURS["default"] and len(cols) > 7:
                out[batch] = cols[7]
    return out


def target_rows(points: dict, e2e: dict) -> list[str]:
    lines = ["| point | target | measured (SANTA default x the fastest of our dense and the peers) |", "|---|---|---|"]
    for (B, L), target in TARGETS:
        default = points.get((B, L), {}).get(OURS["default"])
        # against the fastest of our dense and the peers: the smaller of bench's two speed-ups
        speedups = [default[k] for k in ("x_dense", "x_peer") if default and default.get(k) is not None]
        measured = f"{min(speedups):.2f}x" if speedups else "-"
        if default is not None and default.get("exact"):
            measured += " (runs exact)"
        lines.append(f"| B={B}, {L // 1024}k | >= {target}x | {measured} |")
    for B, target in E2E_TARGETS:
        measured = f"{e2e[B]} dense" if B in e2e else "-"
        lines.append(f"| e2e 8B, B={B}, 32k | >= {target}x | {measured} |")
    return lines


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    folder = Path(sys.argv[1])
    points = load_rows(folder)
    if not points:
        sys.exit(f"no kernels_*.json rows in {folder}")
    print("\n".join(kernel_grid(points)))
    print()
    print("\n".join(target_rows(points, e2e_speedups(folder))))
    return 0


if __name__ == "__main__":
    sys.exit(main())

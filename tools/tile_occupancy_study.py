"""How many tiles the global systematic comb reaches, on the default model and on random data (CPU).

    PYTHONPATH=. python tools/tile_occupancy_study.py [--contexts 2048,6144] [--steps 8] [--samples 256]

Pass 2 (cuda/santa_tile.cu, santa_tile_warp) walks every tile of a KV group. A tile whose heads
draw no comb point costs only its planning; a head without a point in a tile costs no stash read
and no counts (since a0c885c); each head with a point costs its stash scores, exp, scan and comb.
This tool counts, for the default budget (global, systematic, S samples, tiles of 128 rows):

- head-tiles with a point / all head-tiles: the counts work pass 2 does now;
- tiles with a point in any head of their group / all tiles: the tiles pass 2 cannot skip;
- head-tiles with a point / (G x tiles with any point): the share of the counts work that remained
  after a0c885c's per-head skip (before it, every head of such a tile was counted).

Real attention: q of every layer at each of `steps` teacher-forced decode steps after a dense
prefill of `context` tokens (tools/one_pass_guess_study.py capture), counts from
santa_cupy.reference.sample_counts with the library's RNG (seed 0). Random data: q, K ~ N(0, 1)
at the same shapes (scores ~ N(0, 1), as `bench kernels`), one draw per (layer, step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tools"))

import one_pass_guess_study as opg  # noqa: E402  (capture: decode-time q, K, V of the default model)
from santa_cupy import reference  # noqa: E402

BN = 128


def occupancy(q, k, n, samples, step, layer):
    """(head-tiles with a point, tiles with any point, G, tiles) of one (layer, step): q [H, D],
    k [>= n, KVH, D]."""
    H = q.shape[0]
    KVH = k.shape[1]
    counts = reference.sample_counts(q[None], k[None, :n], np.array([n]), samples=samples,
                                     step=step, layer=layer, block_n=BN)[0]  # [H, n]
    hit = reference.tile_draws(counts, BN) > 0                               # [H, T]
    group_hit = hit.reshape(KVH, H // KVH, -1).any(1)                        # [KVH, T]
    return int(hit.sum()), int(group_hit.sum()), H // KVH, group_hit.size


def summarize(rows):
    head_hits = sum(r[0] for r in rows)
    tile_hits = sum(r[1] for r in rows)
    G = rows[0][2]
    tiles = sum(r[3] for r in rows)
    return {"head_tiles_with_point": head_hits / (G * tiles),
            "tiles_with_point": tile_hits / tiles,
            "counts_work_after_skip": head_hits / (G * tile_hits)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,6144")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--cache-dir", default=None, help="keep captured inputs here (npz) for reruns")
    ap.add_argument("--json", default=os.path.join(ROOT, "docs/results/tile_occupancy_cpu.json"))
    a = ap.parse_args()
    out = {"samples": a.samples, "block_n": BN, "steps": a.steps, "contexts": {}}
    rs = np.random.default_rng(0)
    for context in (int(c) for c in a.contexts.split(",")):
        q, k, _ = opg.capture(context, a.steps, a.cache_dir)                 # q [steps, layers, H, D]
        real, rand = [], []
        for t in range(a.steps):
            n = context + t + 1
            for li in range(q.shape[1]):
                real.append(occupancy(q[t, li], k[li], n, a.samples, t, li))
                qr = rs.standard_normal(q[t, li].shape)                     # scores ~ N(0, 1) after
                kr = rs.standard_normal((n,) + k.shape[2:])                  # the 1/sqrt(D) scale
                rand.append(occupancy(qr, kr, n, a.samples, t, li))
        out["contexts"][context] = {"model": summarize(real), "random": summarize(rand),
                                    "tiles_per_head": -(-context // BN)}
        print(context, json.dumps(out["contexts"][context]), flush=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

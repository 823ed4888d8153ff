"""Probe: SANTA over a batch split into chunks whose score passes run one after another while the
previous chunk's prefix, pass 2 and merge run beside them on a second stream (timing only: the
chunks' RNG keys are chunk-local here, so their draws differ from the whole plan's).

    python tools/pipeline_probe.py [--batches 4 16 --lengths 32768 --chunks 1 2 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy import AttentionSetting, DecodePlan  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    import cupy

    H, KVH, D = 32, 8, 128
    setting = AttentionSetting(method="santa", budget="global", sampler="systematic", samples=256)
    bf16 = lambda x: (x.view(cupy.uint32) >> 16).astype(cupy.uint16)  # noqa: E731
    streams = [cupy.cuda.Stream(non_blocking=True) for _ in range(2)]
    for B in a.batches:
        for L in a.lengths:
            rs = cupy.random.default_rng(B * L)
            q = bf16(rs.standard_normal((B, H, D), dtype=cupy.float32))
            k = bf16(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32) * 0.5)
            v = bf16(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32))
            lengths = cupy.full((B,), L, cupy.int32)
            out = cupy.empty((B, H, D), cupy.uint16)
            runs = {}
            for n in a.chunks:
                if B % n:
                    continue
                c = B // n
                plans, stages = [], []
                for i in range(n):
                    sl = slice(i * c, (i + 1) * c)
                    p = DecodePlan(batch=c, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16",
                                   setting=setting, santa_min_length=0)
                    p.run(q[sl], k[sl], v[sl], lengths[sl], out=out[sl])
                    st = p.stage_launchers(q[sl], k[sl], v[sl], lengths[sl])
                    plans.append(p)
                    stages.append(list(st.values()))
                print(B, L, n, "stages:", list(st.keys()), flush=True)

                def run(stages=stages):
                    main = cupy.cuda.get_current_stream()
                    start = main.record()
                    prev = start
                    ends = []
                    for i, st in enumerate(stages):
                        s = streams[i % 2]
                        s.wait_event(prev)
                        if ends and i >= 2:
                            s.wait_event(ends[i - 2])     # the stream's own order
                        with s:
                            st[0]()                        # score
                            prev = s.record()
                            for f in st[1:]:
                                f()
                            ends.append(s.record())
                    for e in ends:
                        main.wait_event(e)
                runs[n] = run
            times = {n: [] for n in runs}
            for fn in runs.values():
                for _ in range(3):
                    fn()
            for _ in range(a.rounds):
                for n, fn in runs.items():
                    s0 = cupy.cuda.get_current_stream()
                    e0 = s0.record()
                    for _ in range(a.reps):
                        fn()
                    e1 = s0.record()
                    e1.synchronize()
                    times[n].append(cupy.cuda.get_elapsed_time(e0, e1) * 1000 / a.reps)
            for n in runs:
                print(f"B={B} L={L} chunks={n}: {statistics.median(times[n]):.1f} us "
                      f"(rounds {', '.join(f'{t:.1f}' for t in times[n])})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

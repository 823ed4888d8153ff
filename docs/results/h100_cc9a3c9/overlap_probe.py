"""Probe (docs/results/h100_cc9a3c9, run from the repository root with PYTHONPATH=.): the score pass
and the warp pass 2 alone with fewer blocks an SM (dynamic shared memory padded, run lengths refitted),
then a score pass at one block an SM beside another plan's pass 2 on a second stream: how their rates
scale with warps an SM, for a warp-specialised score + pass-2 kernel. Reaches into DecodePlan's
private fields (_score_warp_kernel, _warp_smem, score_tpw, tile_tpw) on purpose."""
import cupy as cp
from santa_cupy import kernels
from santa_cupy.cli.bench.kernels import make_inputs, our_plan
from santa_cupy.cli.bench.methods import parse_method
from santa_cupy.cli.bench.timing import time_cupy_graph
from santa_cupy.cli.bench.accounting import copies_for
from santa_cupy.cli.bench.kernels import parse_shape

shape = parse_shape("llama8b")
SMS = cp.cuda.Device().attributes["MultiProcessorCount"]
SMEM_SM = cp.cuda.Device().attributes["MaxSharedMemoryPerMultiprocessor"]
method = parse_method("santa-global-systematic-256-always")
for B, L in ((1, 32768), (4, 32768), (16, 32768), (1, 131072)):
    kvb = 2 * B * L * shape.kv_heads * shape.head_dim * 2
    n = copies_for(kvb, 50 << 20, 60 << 30)
    inputs = make_inputs(cp, shape, B, L, n)
    lengths = cp.full((B,), L, dtype=cp.int32)
    plan = our_plan(method, shape, B, L)
    for q, k, v in inputs:
        plan.run(q, k, v, lengths, validate=False)
    kern, smem0 = plan._score_warp_kernel
    tpw0, wsm0, ttpw0 = plan.score_tpw, plan._warp_smem, plan.tile_tpw
    res = []
    for blocks in (2, 1):                      # score pass blocks an SM
        smem = 0 if blocks == 2 else SMEM_SM // 2 + 4096
        plan._score_warp_kernel = (kern, smem)
        plan.score_tpw = kernels.tiles_per_warp(plan.T_max, B * plan.KVH, blocks * SMS)
        st = [plan.stage_launchers(q, k, v, lengths)["score"] for q, k, v in inputs]
        us, mode = time_cupy_graph(cp, st, 2 * n, 15)
        res.append(f"score {blocks}blk/SM c={plan.score_tpw}: {us:.1f}")
    plan._score_warp_kernel, plan.score_tpw = (kern, smem0), tpw0
    for blocks in (4, 2, 1):                   # pass 2 blocks an SM
        smem = wsm0 if blocks == 4 else SMEM_SM // blocks - 2048
        plan._warp_smem = smem
        plan.tile_tpw = kernels.tiles_per_warp(plan.T_max, B * plan.KVH, blocks * SMS)
        for q, k, v in inputs:
            plan.run(q, k, v, lengths, validate=False)
        st = [plan.stage_launchers(q, k, v, lengths)["sample + gather + finish (warp)"] for q, k, v in inputs]
        us, mode = time_cupy_graph(cp, st, 2 * n, 15)
        res.append(f"pass2 {blocks}blk/SM c={plan.tile_tpw}: {us:.1f}")
    plan._warp_smem, plan.tile_tpw = wsm0, ttpw0
    print(f"B={B} L={L} ({mode}): " + "; ".join(res), flush=True)


# ---- overlap emulation: score pass (1 block an SM) on one stream beside pass 2 (the rest of the
# SM's shared memory) of another plan on a second stream
def timed(jobs, N):
    """jobs: [(stream, fn)]; µs per iteration of N iterations of every job, all streams at once."""
    cp.cuda.Device().synchronize()
    s0 = jobs[0][0]
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(s0)
    for s, _ in jobs[1:]:
        s.wait_event(start)
    for _ in range(N):
        for s, fn in jobs:
            with s:
                fn()
    for s, _ in jobs[1:]:
        e = cp.cuda.Event(); e.record(s); s0.wait_event(e)
    end.record(s0)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1000 / N


for B, L in ((16, 32768), (16, 131072), (4, 131072)):
    q, k, v = make_inputs(cp, shape, B, L, 1)[0]
    q2, k2, v2 = make_inputs(cp, shape, B, L, 1)[0]
    lengths = cp.full((B,), L, dtype=cp.int32)
    pa, pb = our_plan(method, shape, B, L), our_plan(method, shape, B, L)
    pa.run(q, k, v, lengths, validate=False); pb.run(q2, k2, v2, lengths, validate=False)
    kern, _ = pa._score_warp_kernel
    sc_smem = SMEM_SM // 2 + 4096
    pa._score_warp_kernel = (kern, sc_smem)
    pa.score_tpw = kernels.tiles_per_warp(pa.T_max, B * pa.KVH, SMS)
    p2_smem = SMEM_SM - sc_smem - 6 * 1024
    pb._warp_smem = p2_smem
    pb.tile_tpw = kernels.tiles_per_warp(pb.T_max, B * pb.KVH, SMS)
    pb.run(q2, k2, v2, lengths, validate=False)
    score = pa.stage_launchers(q, k, v, lengths)["score"]
    p2 = pb.stage_launchers(q2, k2, v2, lengths)["sample + gather + finish (warp)"]
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    N = 6
    timed([(s1, score), (s2, p2)], 2)
    a = timed([(s1, score)], N)
    b_ = timed([(s2, p2)], N)
    both = timed([(s1, score), (s2, p2)], N)
    print(f"overlap B={B} L={L}: score 1blk/SM c={pa.score_tpw} {a:.1f} us; pass2 smem {p2_smem >> 10} KB "
          f"c={pb.tile_tpw} {b_:.1f} us; both at once {both:.1f} us (sum {a + b_:.1f})", flush=True)
    del pa, pb, q, k, v, q2, k2, v2
    cp.get_default_memory_pool().free_all_blocks()

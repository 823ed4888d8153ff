"""What limits the dense kernel at one (B, L): side-by-side timings in one process (GPU).

    python3 tools/dense_probe.py [--case 1,32k --case 16,32k ...] [--no-torch]

For each case (llama8b shapes, bf16, rotating copies >= 3x L2 as in `bench kernels`), in µs:
  * the streaming read (santa_cupy.cli.bench.timing's stream_read) of exactly the K+V bytes, by launch shape: the
    floor of a read that size (ramp and tail included), not the 2 GiB rotating-buffer ceiling;
  * our dense call, plain and with programmatic launch, and its stages alone (split-KV, merge);
  * the merge in the kernel's last block against santa_merge after it (the plan's
    KernelChoice(self_merge_max_splits=...) raised or 0);
  * our dense on a head-major copy (each KV head its own sequence: K/V rows contiguous per head);
  * torch SDPA cuDNN / flash on a contiguous [B, KVH, L, D] copy and on a zero-copy strided view of
    our [B, L, KVH, D] cache (skipped without torch).
Markdown rows on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from santa_cupy.cli import bench  # noqa: E402
from santa_cupy import DecodePlan  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402

def timed(cp, fns, inner=20, repeats=30) -> float:
    return bench.timing.time_cupy_graph(cp, fns, inner, repeats)[0]


def dense_plan(shape, B, L, **choice):
    """A dense plan, ``choice`` the KernelChoice fields it forces."""
    return DecodePlan(batch=B, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_length=L, dtype=shape.dtype, method="dense", _kernels=KernelChoice(**choice))


def plan_calls(plan, inputs, lengths):
    return [lambda q=q, k=k, v=v: plan.run(q, k, v, lengths, validate=False) for q, k, v in inputs]


def ours(cp, shape, B, L, inputs) -> dict:
    lengths = cp.full((B,), L, cp.int32)
    rows = {}
    for pdl in (False, True):
        rows["ours" + (" (programmatic launch)" if pdl else "")] = timed(
            cp, plan_calls(dense_plan(shape, B, L, programmatic=pdl), inputs, lengths))
    plan = dense_plan(shape, B, L)
    plan.run(*inputs[0], lengths)
    stages = [plan.stage_launchers(q, k, v, lengths) for q, k, v in inputs]
    for name in stages[0]:
        rows[f"  stage: {name}"] = timed(cp, [s[name] for s in stages])
    for merges_itself in (True, False):
        p = dense_plan(shape, B, L, self_merge_max_splits=1 << 30 if merges_itself else 0)
        what = "merge in the last block" if merges_itself else "santa_merge after it"
        rows[f"  {p.P_max} splits a group, {what}"] = timed(cp, plan_calls(p, inputs, lengths))
    return rows


def head_major(cp, shape, B, L, inputs) -> dict:
    """Each KV head as its own sequence: q [B*KVH, G, D], K/V [B*KVH, L, 1, D] (contiguous rows)."""
    KVH, G, D = shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim

    def per_head(a):
        return a.reshape(B, L, KVH, D).transpose(0, 2, 1, 3).copy().reshape(B * KVH, L, 1, D)

    copies = [(q.reshape(B * KVH, G, D), per_head(k), per_head(v)) for q, k, v in inputs]
    plan = DecodePlan(batch=B * KVH, heads=G, kv_heads=1, head_dim=D, max_length=L, dtype=shape.dtype,
                      method="dense")
    return {"ours on a head-major copy": timed(cp, plan_calls(plan, copies, cp.full((B * KVH,), L, cp.int32)))}


def stream_reads(cp, nbytes, copies) -> dict:
    times = bench.timing.stream_read_us(cp, nbytes, copies, inner=20, repeats=30)
    return {f"streaming read of the same bytes, {per_sm} x {threads} a SM": us for (per_sm, threads), us in times.items()}


def torch_rows(torch, shape, inputs) -> dict:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def as_torch(a):
        return torch.from_dlpack(a.view("int16")).view(torch.bfloat16)

    rows = {}
    for backend in ("cudnn", "flash"):
        for layout in ("contiguous [B, KVH, L, D]", "view of [B, L, KVH, D]"):
            args = []
            for q, k, v in inputs:
                tk, tv = (as_torch(a).transpose(1, 2) for a in (k, v))
                if layout.startswith("contiguous"):
                    tk, tv = tk.contiguous(), tv.contiguous()
                args.append((as_torch(q).unsqueeze(2), tk, tv))
            name = f"torch {backend}, {layout}"
            try:
                with sdpa_kernel(getattr(SDPBackend, bench.peers.TORCH_BACKEND_ENUM[backend])):
                    fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
                           for q, k, v in args]
                    fns[0]()
                    rows[name] = bench.timing.time_torch_graph(torch, fns, 20, 30)[0]
            except Exception as exc:                 # a backend that refuses the case
                rows[name] = f"skipped: {type(exc).__name__}: {str(exc).splitlines()[0][:100] if str(exc) else ''}"
            args = fns = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="B,L (L with k = 1024), e.g. 1,32k; repeatable "
                                                    "(default: 1,8k 1,32k 1,128k 4,128k 16,32k)")
    ap.add_argument("--no-torch", action="store_true")
    a = ap.parse_args()
    cases = [(int(c.split(",")[0]), bench.methods.parse_size(c.split(",")[1])) for c in a.case] if a.case else \
        [(1, 8192), (1, 32768), (1, 131072), (4, 131072), (16, 32768)]
    cp = bench.gpu._cupy()
    torch = None if a.no_torch else bench.gpu._optional_torch()
    shape = bench.methods.SHAPES["llama8b"]
    l2 = bench.gpu.gpu_metadata(cp, None)["l2_bytes"]
    ceiling = bench.timing.measure_ceiling(cp)["read_tbps"]
    print(f"streaming read ceiling (bench.timing.measure_ceiling): {ceiling:.2f} TB/s")
    for B, L in cases:
        nbytes = bench.accounting.kv_bytes(shape, B, L)
        copies = bench.accounting.copies_for(nbytes, l2, int(20e9))
        inputs = bench.kernels.make_inputs(cp, shape, B, L, copies)
        rows = ours(cp, shape, B, L, inputs) | head_major(cp, shape, B, L, inputs) | stream_reads(cp, nbytes, copies)
        if torch is not None:
            rows |= torch_rows(torch, shape, inputs)
        print(f"\n### B={B} L={bench.report.fmt_context(L)}: K+V {bench.report.fmt_bytes(nbytes)}, {copies} copies, "
              f"{nbytes / ceiling / 1e6:.1f} µs at the ceiling\n\n| | µs | % of the ceiling |\n|---|---|---|")
        for name, us in rows.items():
            cells = f"{us:.2f} | {100 * nbytes / (us * 1e-6) / 1e12 / ceiling:.0f}%" if isinstance(us, float) else f"{us} | -"
            print(f"| {name} | {cells} |", flush=True)
        del inputs
        cp.get_default_memory_pool().free_all_blocks()
    return 0


if __name__ == "__main__":
    sys.exit(main())

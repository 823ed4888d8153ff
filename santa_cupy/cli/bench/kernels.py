"""``bench kernels`` and ``bench stages``: decode attention alone, one DecodePlan per (shape, batch,
context, method) on rotating random inputs, beside the peers at the same point.
"""

from __future__ import annotations

import math
import sys

import click

from llama_min.commands import check_output_path
from santa_cupy.cli.bench.accounting import add_derived, attention_bytes, copies_for, kv_bytes
from santa_cupy.cli.bench.gpu import _cupy, _optional_flashinfer, _optional_torch, gpu_metadata, random_array
from santa_cupy.cli.bench.methods import L2_FACTOR, Method, QUICK, SHAPES, Shape, expand_grid, method_list, parse_list, parse_method, parse_shape, parse_size
from santa_cupy.cli.bench.paged import PAGE_ROWS, PagedLayout, paged_cache
from santa_cupy.cli.bench.peers import bench_flashinfer, bench_torch
from santa_cupy.cli.bench.report import _log, fmt_bytes, fmt_context, kernel_table, plot_rows, run_metadata, stage_table, write_outputs
from santa_cupy.cli.bench.timing import measure_ceiling, time_cupy_graph


def make_inputs(cp, shape: Shape, B: int, L: int, n: int) -> list[tuple]:
    """n rotating copies of (q [B,H,D], k [B,L,KVH,D], v [B,L,KVH,D]) of random normal data."""
    out = []
    for _ in range(n):
        q = random_array(cp, (B, shape.heads, shape.head_dim), shape.dtype)
        k = random_array(cp, (B, L, shape.kv_heads, shape.head_dim), shape.dtype)
        v = random_array(cp, (B, L, shape.kv_heads, shape.head_dim), shape.dtype)
        out.append((q, k, v))
    return out


def our_plan(method: Method, shape: Shape, B: int, L: int, *, programmatic=None, **options):
    """The DecodePlan of one of our methods: its attention setting (``options``: setting fields
    that override it, e.g. santa_min_length=0) and the kernel choice its suffix names;
    ``programmatic``: the plan's programmatic-launch mode (KernelChoice.programmatic)."""
    import dataclasses

    from santa_cupy import DecodePlan

    paged = dict(page_size=PAGE_ROWS) if method.paged else {}
    if method.key_layout != "standard":
        paged["key_layout"] = method.key_layout
    choice = dataclasses.replace(method.kernel_choice(), programmatic=programmatic)
    return DecodePlan(batch=B, heads=shape.heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                      max_length=L, dtype=shape.dtype, setting=method.plan_setting().replace(**options),
                      _kernels=choice, **paged)


def bench_ours(cp, method: Method, shape: Shape, B: int, L: int, inputs, n_inner, repeats, pdl=False) -> dict:
    """One DecodePlan; plan.run(q, k, v, lengths, validate=False) over the rotating inputs. The RNG
    step is NOT advanced inside the timed graph (each input copy draws its own samples anyway).
    pdl: the plan launches with programmatic dependent launch."""
    plan = our_plan(method, shape, B, L, programmatic=pdl)
    lengths = cp.full((B,), L, dtype=cp.int32)
    table = None
    if method.paged:                             # the caches as pages (a free view when L % PAGE_ROWS == 0)
        import numpy as np
        layout = PagedLayout(B, L)
        ids = layout.indices()
        if method.backend == "shuffled":
            ids = np.random.default_rng(0).permutation(ids).astype(np.int32)
        table = cp.asarray(ids.reshape(B, layout.pages_per_seq))
        inputs = [(q, paged_cache(cp, k, layout), paged_cache(cp, v, layout)) for q, k, v in inputs]
        plan.run(*inputs[0], lengths, block_table=table)           # validated once
    if method.key_layout == "blocked":           # K feature-blocked (a copy of each input's K)
        from santa_cupy.key_layout import to_blocked
        inputs = [(q, to_blocked(k, method.key_block), v) for q, k, v in inputs]
        plan.run(*inputs[0], lengths)
    fns = [lambda q=q, k=k, v=v: plan.run(q, k, v, lengths, validate=False, block_table=table) for q, k, v in inputs]
    us, mode = time_cupy_graph(cp, fns, n_inner, repeats)
    rows_read, key_fraction, exact = None, None, False
    if method.kind == "santa":
        q, k, v = inputs[0]
        plan.run(q, k, v, lengths, validate=False, block_table=table)
        info = plan.info()
        rows_read = int(info.rows_read.sum())     # int() syncs the default stream
        if info.key_fraction is not None:          # equal lengths: the mean over (b, KV head)
            key_fraction = float(info.key_fraction.mean())
        exact = bool(info.dense_fallback.all())   # below the plan's santa_min_length
    row = {"us": us, "timing": mode, "rows_read": rows_read, "key_fraction": key_fraction, "exact": exact,
           "rows_frac": rows_read / (B * L * shape.kv_heads) if rows_read is not None else 1.0}
    if exact:
        row["note"] = "ran exact (below santa_min_length)"
    return row



def bench_config(cp, torch, flashinfer, shape, B, L, methods, *, l2, budget_bytes, n_inner, repeats,
                 pdl=False) -> list[dict]:
    """All methods of one (shape, B, L) on the same rotating inputs."""
    base = {"shape": shape.name, "B": B, "L": L}
    n = copies_for(kv_bytes(shape, B, L), l2, budget_bytes)
    if n == 0:
        return [dict(base, method=m.name, external=m.external, bytes=None, us=None,
                     note=f"skipped: K+V {fmt_bytes(kv_bytes(shape, B, L))} > --mem-gb") for m in methods]
    inputs = make_inputs(cp, shape, B, L, n)
    n_inner = n * math.ceil(n_inner / n)       # every copy equally often in one graph
    rows = []
    for m in methods:
        row = dict(base, method=m.name, external=m.external, copies=n, inner=n_inner)
        try:
            if m.kind in ("dense", "santa"):
                row.update(bench_ours(cp, m, shape, B, L, inputs, n_inner, repeats, pdl))
            elif m.kind == "torch" and torch is not None:
                row.update(bench_torch(torch, cp, m, shape, B, L, inputs, n_inner, repeats, budget_bytes, l2))
            elif m.kind == "flashinfer" and flashinfer is not None and torch is not None:
                row.update(bench_flashinfer(torch, flashinfer, cp, shape, B, L, inputs, n_inner, repeats, pdl))
            else:
                row.update(us=None, note=f"skipped: {m.kind} not importable")
        except Exception as exc:
            row.update(us=None, note=f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
        have_rows = m.kind != "santa" or row.get("rows_read") is not None
        row["bytes"] = attention_bytes(m, shape, B, L, row.get("rows_read"), row.get("key_fraction"),
                                       row.get("exact", False)) if have_rows else None
        if row.get("timing", "graph") != "graph":
            row["note"] = ((row.get("note") or "") + " " + row["timing"]).strip()
        rows.append(row)
    del inputs
    cp.cuda.Device().synchronize()
    cp.get_default_memory_pool().free_all_blocks()
    return rows



@click.command("kernels")
@click.option("--batch", default="1,4,16", show_default=True, help="Comma-separated batch sizes.")
@click.option("--context", default="8k,32k,128k", show_default=True, help="Comma-separated context lengths (k = 1024).")
@click.option("--shape", "shapes", default="llama8b", show_default=True, help=f"Comma-separated: {', '.join(SHAPES)}.")
@click.option("--methods", default=None, help="Comma-separated methods (dense, santa-<budget>-<sampler>-<S>, "
              "torch-<flash|cudnn|efficient>, flashinfer). Default: dense, santa-global-systematic-256, "
              "santa-fixed-systematic-2048, torch SDPA backends and flashinfer when importable.")
@click.option("--full", is_flag=True, help="The whole method grid (3 budgets x 3 samplers x S in 128/256/512/2048).")
@click.option("--quick", is_flag=True, help="llama8b, batch 1 and 16, context 32k, dense / two santa / torch "
                                           "flash+cudnn / flashinfer.")
@click.option("--repeats", type=click.IntRange(min=3), default=30, show_default=True, help="Timed graph replays (median).")
@click.option("--inner", type=click.IntRange(min=1), default=20, show_default=True, help="Launches per captured graph.")
@click.option("--mem-gb", type=click.FloatRange(min=1), default=20.0, show_default=True,
              help="Budget for the rotating K/V copies of one configuration (torch copies come on top).")
@click.option("--no-ceiling", is_flag=True, help="Skip the streaming-read / copy ceiling measurement.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path, help="PNG plot (needs matplotlib).")
@click.option("--pdl/--no-pdl", default=None,
              help="Launch our kernels (and FlashInfer) with programmatic dependent launch, each call "
                   "overlapping the previous, or plainly.  [default: as the plans do in a CUDA graph: "
                   "programmatic on sm_90+]")
def kernels_command(batch, context, shapes, methods, full, quick, repeats, inner, mem_gb, no_ceiling, pdl,
                    json_path, markdown_path, plot_path):
    """Decode-attention kernels vs our dense and external dense baselines."""
    if full and quick:
        raise click.UsageError("--full and --quick exclude each other")
    shape_list = parse_list(shapes, "shape", parse_shape)
    batches, contexts = parse_list(batch, "batch"), parse_list(context, "context")
    if quick:
        shape_list, batches, contexts = [SHAPES[s] for s in QUICK["shapes"]], list(QUICK["batches"]), list(QUICK["contexts"])
    names = parse_list(methods, "methods", str) if methods else None
    for n in names or ():
        parse_method(n)                   # argument errors before touching the GPU
    cp = _cupy()
    torch, flashinfer = _optional_torch(), _optional_flashinfer()
    method_objs = method_list(names, full=full, quick=quick, have_torch=torch is not None,
                              have_flashinfer=flashinfer is not None and torch is not None)
    meta = dict(run_metadata("kernels"), **gpu_metadata(cp, torch),
                timing=f"CUDA graph of >= {inner} launches over rotating inputs (>= {L2_FACTOR}x L2), "
                       f"median of {repeats} replays")
    meta["flashinfer"] = getattr(flashinfer, "__version__", None) if flashinfer else None
    ceiling = None
    if not no_ceiling:
        _log("measuring the streaming-read and copy ceilings ...")
        ceiling = measure_ceiling(cp)
    grid = expand_grid(shape_list, batches, contexts)
    rows = []
    from santa_cupy import kernels
    try:
        available = kernels.programmatic_launch_available()
    except Exception:                  # no device (the CLI's tests)
        available = False
    # every timed call is captured in a graph, where a plan's automatic mode launches programmatically
    meta["programmatic_launch"] = available and pdl is not False
    with click.progressbar(grid, label="kernels", file=sys.stderr,
                           item_show_func=lambda c: c and f"{c[0].name} B={c[1]} L={fmt_context(c[2])}") as bar:
        for shape, B, L in bar:
            rows += bench_config(cp, torch, flashinfer, shape, B, L, method_objs, l2=meta["l2_bytes"],
                                 budget_bytes=int(mem_gb * 1e9), n_inner=inner, repeats=repeats,
                                 pdl=meta["programmatic_launch"])
    add_derived(rows, ceiling and ceiling["read_tbps"])
    write_outputs(meta, ceiling, rows, kernel_table(rows), json_path=json_path, markdown_path=markdown_path)
    if plot_path:
        plot_rows(rows, plot_path)


def stage_rows(cp, shape, B, L, method: Method, *, l2, budget_bytes, n_inner, repeats) -> list[dict]:
    """µs of each pipeline stage of one of our methods alone (DecodePlan.stage_launchers), on the
    same rotating inputs as `kernels`, plus the whole call for comparison."""
    n = copies_for(kv_bytes(shape, B, L), l2, budget_bytes)
    if n == 0:
        raise click.UsageError(f"K+V {fmt_bytes(kv_bytes(shape, B, L))} > --mem-gb")
    inputs = make_inputs(cp, shape, B, L, n)
    n_inner = n * math.ceil(n_inner / n)
    plan = our_plan(method, shape, B, L)
    lengths = cp.full((B,), L, dtype=cp.int32)
    whole = [lambda q=q, k=k, v=v: plan.run(q, k, v, lengths, validate=False) for q, k, v in inputs]
    us, _ = time_cupy_graph(cp, whole, n_inner, repeats)
    rows = [{"stage": "whole call", "us": us}]
    per_copy = [plan.stage_launchers(q, k, v, lengths) for q, k, v in inputs]
    for name in per_copy[0]:
        fns = [stages[name] for stages in per_copy]
        us, _ = time_cupy_graph(cp, fns, n_inner, repeats)
        rows.append({"stage": name, "us": us})
    total = sum(r["us"] for r in rows[1:])
    for r in rows:
        r["share"] = r["us"] / total if total else None
    return rows



@click.command("stages")
@click.option("--batch", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--context", default="32k", show_default=True)
@click.option("--shape", "shape_name", default="llama8b", show_default=True, help=f"One of: {', '.join(SHAPES)}.")
@click.option("--methods", default="dense,santa-global-systematic-256-always,santa-global-systematic-256-block,"
              "santa-fixed-systematic-2048-always",
              show_default=True, help="Comma-separated methods of ours.")
@click.option("--repeats", type=click.IntRange(min=3), default=20, show_default=True)
@click.option("--inner", type=click.IntRange(min=1), default=10, show_default=True)
@click.option("--mem-gb", type=click.FloatRange(min=1), default=20.0, show_default=True)
def stages_command(batch, context, shape_name, methods, repeats, inner, mem_gb):
    """Time each stage of our kernels' pipelines alone (where the time goes)."""
    shape = parse_shape(shape_name)
    L = parse_size(context)
    method_objs = [parse_method(n) for n in parse_list(methods, "methods", str)]
    for m in method_objs:
        if m.external:
            raise click.BadParameter(f"{m.name} is not one of ours", param_hint="--methods")
    cp = _cupy()
    l2 = gpu_metadata(cp, None)["l2_bytes"]
    for m in method_objs:
        rows = stage_rows(cp, shape, batch, L, m, l2=l2, budget_bytes=int(mem_gb * 1e9), n_inner=inner,
                          repeats=repeats)
        click.echo(stage_table(f"{m.name}, {shape.name}, B={batch}, L={fmt_context(L)}", rows))


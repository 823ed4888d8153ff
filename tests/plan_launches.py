"""A grid of DecodePlans and the launches each makes on the host (tests/test_plan_host.py's stand-in
cupy): the recorded baseline of tests/test_plan_launches.py, so that a change to the plan's
structure shows whether any launch (kernel, grid, block, arguments, shared memory) moved.

GRID entries: (name, shape keywords, setting keywords, kernel-choice keywords, paged layout or None).
Regenerate the baseline (only after a deliberate launch change) with
``python -m tests.plan_launches > tests/data/plan_launches.json``.
"""

import json

import numpy as np

S = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300)
L3 = dict(S, max_length=3000)
GRID = [
    ("dense-auto", S, dict(method="dense"), {}, None),
    ("dense-stream", S, dict(method="dense"), dict(dense_kernel="stream"), None),
    ("dense-mma", S, dict(method="dense"), dict(dense_kernel="mma"), None),
    ("dense-p3", dict(S, max_length=1000), dict(method="dense"), dict(dense_splits=3), None),
    ("dense-p48", L3, dict(method="dense"), dict(dense_splits=48), None),
    ("dense-long", dict(S, max_length=60000), dict(method="dense"), {}, None),
    ("dense-fp32-d256", dict(S, head_dim=256), dict(method="dense", dtype="float32"), {}, None),
    ("dense-paged-nhd", L3, dict(method="dense"), {}, "NHD"),
    ("santa-auto", L3, {}, {}, None),
    ("santa-auto-300", S, {}, {}, None),
    ("santa-always", L3, dict(santa_min_length=0), {}, None),
    ("santa-min1000", L3, dict(santa_min_length=1000), {}, None),
    ("santa-lr", L3, dict(budget="largest_remainder", santa_min_length=0), {}, None),
    ("santa-fixed-small", L3, dict(budget="fixed", santa_min_length=0), {}, None),
    ("santa-fixed-small-auto", L3, dict(budget="fixed"), {}, None),      # below its crossover: exact
    ("santa-fixed-big", dict(S, max_length=70000), dict(budget="fixed", santa_min_length=0), {}, None),
    ("santa-fixed-warp", L3, dict(budget="fixed", santa_min_length=0), dict(tile_kernel="warp", tiles_per_warp=5),
     None),
    ("santa-warp", L3, dict(samples=64, santa_min_length=0), dict(tile_kernel="warp"), None),
    ("santa-warpmma", L3, dict(samples=64, santa_min_length=0), dict(tile_kernel="warp_mma"), None),
    ("santa-block", L3, dict(santa_min_length=0), dict(tile_kernel="block"), None),
    ("santa-tpw3", L3, dict(santa_min_length=0), dict(tiles_per_warp=3), None),
    ("santa-tpw1", L3, {}, dict(tiles_per_warp=1), None),
    ("santa-score-stream", L3, dict(santa_min_length=0), dict(score_kernel="stream"), None),
    ("santa-iid", L3, dict(sampler="iid", budget="largest_remainder", santa_min_length=0), {}, None),
    ("santa-iid-auto", L3, dict(sampler="iid", budget="largest_remainder"), {}, None),   # below its crossover: exact
    ("santa-stratified-fixed", L3, dict(sampler="stratified", budget="fixed", samples=32, santa_min_length=0), {},
     None),
    ("santa-bn64", L3, dict(block_n=64, seed=7, step=3), {}, None),
    ("santa-g16", dict(L3, heads=32), dict(santa_min_length=0), {}, None),
    ("santa-many-groups", dict(L3, heads=64, kv_heads=32), dict(santa_min_length=0), dict(tiles_per_warp=3), None),
    ("santa-d64-fp16", dict(L3, head_dim=64), dict(dtype="float16", samples=128), {}, None),
    ("santa-d256-fp32", dict(L3, head_dim=256), dict(dtype="float32", santa_min_length=0), {}, None),
    ("santa-scale", L3, dict(scale=0.25, santa_min_length=0), {}, None),
    ("santa-one-pass", L3, dict(budget="one_pass", santa_min_length=0), {}, None),
    ("santa-one-pass-tpw2", L3, dict(budget="one_pass", santa_min_length=0), dict(tiles_per_warp=2), None),
    ("santa-paged-nhd", L3, dict(santa_min_length=0), {}, "NHD"),
    ("santa-paged-hnd", L3, {}, {}, "HND"),
    ("santa-paged-block", L3, dict(budget="fixed", santa_min_length=0), dict(tile_kernel="block"), "HND"),
]
PAGE = 16


def inputs(shape, dtype, layout):
    from tests.test_plan_host import FakeArray
    B, H, KVH, D, L = (shape[k] for k in ("batch", "heads", "kv_heads", "head_dim", "max_length"))
    storage = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32}[dtype]
    q = np.ones((B, H, D), storage).view(FakeArray)
    table = None
    if layout is None:
        k = np.zeros((B, L, KVH, D), storage).view(FakeArray)
    else:
        pages = -(-L // PAGE)
        pool = (B * pages, PAGE, KVH, D) if layout == "NHD" else (B * pages, KVH, PAGE, D)
        k = np.zeros(pool, storage).view(FakeArray)
        table = np.arange(B * pages, dtype=np.int32).reshape(B, pages).view(FakeArray)
    v = k.copy().view(FakeArray)
    lengths = np.array([L] + [max(1, L // (b + 3)) for b in range(1, B)], np.int32).view(FakeArray)
    return q, k, v, lengths, table


def _encode(arg, ids):
    if isinstance(arg, np.ndarray) and arg.ndim >= 0 and not isinstance(arg, np.generic):
        key = id(arg)
        ids.setdefault(key, len(ids))
        return ["array", ids[key], list(arg.shape), str(arg.dtype)]
    return [type(arg).__name__, repr(arg.item() if hasattr(arg, "item") else arg)]


def record(make_plan, log):
    """{name: {"attrs": ..., "launches": [...]}} for every GRID entry; make_plan(shape, setting
    keywords, kernel keywords, page_size, layout) -> a DecodePlan; log: the fixture's list."""
    out = {}
    for name, shape, setting, choice, layout in GRID:
        dtype = setting.get("dtype", "bfloat16")
        q, k, v, lengths, table = inputs(shape, dtype, layout)
        log.clear()
        plan = make_plan(shape, setting, choice, PAGE if layout else None, layout or "NHD")
        extra = {} if table is None else {"block_table": table}
        hint = {}
        if setting.get("budget") == "one_pass":
            hint = {"lse_hint": np.zeros((shape["batch"], shape["heads"]), np.float32).view(type(q))}
        plan.run(q, k, v, lengths, layer=2, validate=False, **extra, **hint)
        plan.advance()
        for launch in plan.stage_launchers(q, k, v, lengths, layer=1, **extra).values():
            launch()
        if setting.get("method", "santa") == "santa" and setting.get("budget") != "one_pass":
            counts = plan.sample_counts(q, k, lengths, layer=3, **extra)
            plan.run_from_counts(q, k, v, lengths, counts, **extra)
        ids = {}
        for buf in ("out", "lse", "spread", "rows_read", "part_o", "part_s"):   # name the plan's buffers first
            ids.setdefault(id(getattr(plan, buf)), len(ids))
        attrs = {a: repr(getattr(plan, a, None)) for a in (
            "dense_kernel", "score_kernel", "tile_kernel", "score_tpw", "tile_tpw", "P_max", "santa_from",
            "atomic_finish", "dense_merges_itself", "two_pass", "block_n", "T_max")}
        out[name] = {"attrs": attrs, "launches": [
            [kname, [int(x) for x in grid], [int(x) for x in block], [_encode(a, ids) for a in args], int(smem)]
            for kname, grid, block, args, smem in log]}
    return out


PER_PLAN = ("dtype", "scale", "step")          # DecodePlan's own keywords among GRID's setting keywords


def make_plan(shape, setting, choice, page_size, layout):
    from santa_cupy import AttentionSetting, DecodePlan
    from santa_cupy.kernel_choice import KernelChoice
    own = {k: v for k, v in setting.items() if k in PER_PLAN}
    fields = {k: v for k, v in setting.items() if k not in PER_PLAN}
    return DecodePlan(**shape, **own, setting=AttentionSetting(**fields), page_size=page_size, page_layout=layout,
                      _kernels=KernelChoice(**choice))


def _main():
    import sys

    from tests import test_plan_host

    class _MonkeyPatch:            # what the launches fixture uses of pytest's
        def setitem(self, d, k, v):
            d[k] = v

        def setattr(self, o, k, v):
            setattr(o, k, v)

    log = test_plan_host.launches.__wrapped__(_MonkeyPatch())
    recorded = record(make_plan, log)
    lines = []
    for name, entry in recorded.items():       # a launch a line: diffs name the launch that moved
        launches = ",\n  ".join(json.dumps(x) for x in entry["launches"])
        lines.append(f'{json.dumps(name)}: {{"attrs": {json.dumps(entry["attrs"])},\n "launches": [\n  {launches}]}}')
    sys.stdout.write("{\n" + ",\n".join(lines) + "\n}\n")


if __name__ == "__main__":
    _main()

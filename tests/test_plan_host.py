"""DecodePlan's host side without a GPU: a stand-in `cupy` module and recording kernels.

Checks, for every method / budget / dense kernel, which kernels a call launches, in which order,
with how many arguments (against the parameter lists parsed from cuda/*.cu), with which argument
kinds (device pointer vs scalar), and with how much dynamic shared memory. This is what a typo in
attention.py would break first; the GPU tests check the numbers.
"""

import re
import sys
import types

import numpy as np
import pytest

from santa_cupy import kernel_choice, kernels, key_layout, spec
from tests.gpu_util import make_plan


class FakeArray(np.ndarray):
    """A NumPy array that santa-cupy takes for a CuPy one (by its type's module)."""


FakeArray.__module__ = "cupy"


def _fake_cupy():
    mod = types.ModuleType("cupy")
    for name in ("int32", "int64", "float32", "float64", "uint8", "uint16", "uint32", "float16"):
        setattr(mod, name, getattr(np, name))
    mod.ndarray = FakeArray
    mod.empty = lambda shape, dtype=np.float32: np.empty(shape, dtype).view(FakeArray)
    mod.zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype).view(FakeArray)
    mod.full = lambda shape, value, dtype=np.float32: np.full(shape, value, dtype).view(FakeArray)
    mod.asarray = lambda x: np.asarray(x).view(FakeArray)
    mod.ones = lambda shape, dtype=np.float32: np.ones(shape, dtype).view(FakeArray)
    mod.broadcast_to = lambda x, shape: np.broadcast_to(x, shape).view(FakeArray)
    device = types.SimpleNamespace(attributes={"MultiProcessorCount": 132})
    mod.cuda = types.SimpleNamespace(Device=lambda *a: device)
    return mod


SCALAR_TYPES = {"int": np.int32, "i64": np.int64, "u64": np.uint64, "float": np.float32, "double": np.float64}


def _kernel_signatures():
    """{kernel name: [(parameter name, numpy scalar type or None for a pointer)]} from cuda/*.cu."""
    source = kernels.build_source()
    sigs = {}
    for m in re.finditer(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(([^)]*)\)", source):
        params = []
        for p in (p.strip() for p in m.group(2).split(",") if p.strip()):
            words = p.replace("*", " * ").split()
            params.append((words[-1], None if "*" in words else SCALAR_TYPES[words[-2]]))
        sigs[m.group(1)] = params
    return sigs


def _kernel_params():
    return {name: [p for p, _ in sig] for name, sig in _kernel_signatures().items()}


class RecordingKernel:
    def __init__(self, name, log):
        self.name, self.log = name, log
        self.max_dynamic_shared_size_bytes = 48 * 1024

    def __call__(self, grid, block, args, shared_mem=0):
        self.log.append((self.name, grid, block, args, shared_mem))


@pytest.fixture
def launches(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy())
    log = []

    def fake_get_kernels(dtype_name, head_dim, group, block_n, method):
        role = "dense" if method == "dense" else f"santa{block_n}"
        names = kernels.instance_names(dtype_name, head_dim, group, role)
        source = kernels.build_source()      # every recorded launch is checked against the C declarations
        return kernels.KernelSet(**{key: kernels.register_kernel(RecordingKernel(name.split("<")[0], log), source, name)
                                    for key, name in names.items()})

    monkeypatch.setattr(kernels, "get_kernels", fake_get_kernels)
    return log


def _inputs(B=2, H=8, KVH=2, D=128, L=300, dtype=np.uint16):
    rng = np.random.default_rng(0)
    q = rng.integers(0, 2**14, (B, H, D)).astype(dtype).view(FakeArray)
    k = rng.integers(0, 2**14, (B, L, KVH, D)).astype(dtype).view(FakeArray)
    v = rng.integers(0, 2**14, (B, L, KVH, D)).astype(dtype).view(FakeArray)
    lengths = np.array([L, 17], np.int32).view(FakeArray)
    return q, k, v, lengths


CASES = [("dense", "global", "stream", ["decode_dense_partial", "santa_merge"]),
         ("dense", "global", "mma", ["decode_dense_mma"]),           # merges in its last block per group
         ("dense", "global", "auto", ["decode_dense_mma"]),
         # the warp pipeline: score pass, prefix, the warp pass 2 writes o (no merge)
         ("santa", "global", "mma", ["santa_score_mma", "santa_prefix", "santa_tile_warp"]),
         ("santa", "global", "auto", ["santa_score_mma", "santa_prefix", "santa_tile_warp"]),
         ("santa", "largest_remainder", "auto", ["santa_score_mma", "santa_prefix", "santa_tile_warp"]),
         # without the tensor-core score pass: the block pass 2 and santa_merge
         ("santa", "fixed", "stream", ["santa_tile", "santa_merge"]),      # a small cache: the fused pass
         ("santa", "global", "stream", ["santa_score", "santa_prefix", "santa_tile", "santa_merge"]),
         ("santa", "largest_remainder", "stream", ["santa_score", "santa_prefix", "santa_tile", "santa_merge"])]


def test_dense_self_merge_rule(launches):
    """v4 dense merges in its last block per KV group up to DENSE_SELF_MERGE_MAX_SPLITS splits a
    group; above, santa_merge follows it (and the kernel's self_merge flag is 0)."""
    params = _kernel_params()["decode_dense_mma"]
    for L, merges in ((300, True), (60000, False)):
        q, k, v, lengths = _inputs(L=L)
        launches.clear()
        plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=L, method="dense")
        plan.run(q, k, v, lengths)
        assert plan.dense_merges_itself == merges == (plan.P_max <= kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS)
        assert [name for name, *_ in launches] == ["decode_dense_mma"] + ([] if merges else ["santa_merge"])
        args = launches[0][3]
        assert int(args[params.index("self_merge")]) == merges
        assert args[params.index("merge_counters")].size == (4 if merges else 1)


def test_forced_dense_splits(launches):
    """make_plan(dense_splits=N): N splits a KV group of whole 16-row steps (fewer where rounding
    makes the last ones empty), launched as such; the self-merge rule follows the count."""
    for L, n, rows, splits in ((32768, 64, 512, 64), (1000, 3, 336, 3), (100, 64, 16, 7)):
        q, k, v, lengths = _inputs(L=L)
        launches.clear()
        plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=L, method="dense", dense_splits=n)
        assert (plan.part_rows, plan.P_max) == (rows, splits)
        assert plan.dense_merges_itself == (splits <= kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS)
        plan.run(q, k, v, lengths)
        assert launches[0][1] == (2, plan.dense_pairs) and plan.dense_pairs == 2 * splits   # KV heads x pairs
    for bad in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="dense_splits"):
            make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300, method="dense", dense_splits=bad)


@pytest.mark.parametrize("method,budget,dense_kernel,expected", CASES)
def test_run_launch_sequence(launches, method, budget, dense_kernel, expected):
    q, k, v, lengths = _inputs()
    tile = dense_kernel == "block"                    # the column names the tile kernel instead
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300, method=method, budget=budget,
                     dense_kernel=dense_kernel if method == "dense" else "stream",
                     score_kernel=dense_kernel if method == "santa" and not tile else "stream",
                     tile_kernel="block" if tile else "auto", santa_min_length=0)
    if not tile:
        assert (plan.dense_kernel if method == "dense" else plan.score_kernel) == \
            ("mma" if dense_kernel == "auto" else dense_kernel)
    out = plan.run(q, k, v, lengths)
    assert out is plan.out
    assert [name for name, *_ in launches] == expected
    sigs = _kernel_signatures()
    for name, grid, block, args, smem in launches:
        assert len(args) == len(sigs[name]), f"{name}: {len(args)} arguments for {sigs[name]}"
        for arg, (param, scalar) in zip(args, sigs[name]):
            if scalar is None:
                assert isinstance(arg, np.ndarray), f"{name}({param}): pointer expected, got {type(arg)}"
            else:
                assert type(arg) is scalar, f"{name}({param}): {scalar.__name__} expected, got {type(arg)}"
        assert all(int(x) >= 1 for x in grid) and block[0] in (1, kernels.THREADS, kernels.PREFIX_THREADS, kernels.MERGE_THREADS)
        assert smem <= 227 * 1024
    first = launches[0]
    assert first[3][0] is q and first[3][1] is k                      # q, k_cache lead every stage


def test_standalone_stages_launch(launches):
    q, k, v, lengths = _inputs()
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300, samples=32)
    counts = plan.sample_counts(q, k, lengths)
    assert counts.shape == (2, 8, 300) and counts.dtype == np.int32
    plan.run_from_counts(q, k, v, lengths, counts)
    names = [name for name, *_ in launches]
    # the stages on their own use the block kernel's sample and gather modes (not the warp pass 2)
    assert names == ["santa_score_mma", "santa_prefix", "santa_tile"] * 2 + ["santa_merge"]
    at = _kernel_params()["santa_tile"].index("mode")
    modes = [args[at] for name, _, _, args, _ in launches if name == "santa_tile"]
    assert [int(m) for m in modes] == [kernels.MODE_CODE["sample"], kernels.MODE_CODE["gather"]]
    assert plan.exact_throughout         # its run would take no sequence; the stages take them all
    with pytest.raises(ValueError, match="counts"):
        plan.run_from_counts(q, k, v, lengths, counts.astype(np.int64).view(FakeArray))


def test_plan_rejects_bad_out_and_mismatched_inputs(launches):
    q, k, v, lengths = _inputs()
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300)
    with pytest.raises(ValueError, match="out must be"):
        plan.run(q, k, v, lengths, out=np.empty((2, 8, 64), np.uint16).view(FakeArray))
    with pytest.raises(ValueError, match="do not match the plan"):
        plan.run(*_inputs(H=4))
    with pytest.raises(ValueError, match="dense_kernel"):
        make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300, dense_kernel="fast")
    assert launches == []


def test_every_kernel_instance_has_a_definition():
    params = _kernel_params()
    for dtype, d, g in kernels.CI_CONFIGS[:3]:
        for role in kernels.roles():
            for name in kernels.instance_names(dtype, d, g, role).values():
                assert name.split("<")[0] in params
    assert spec.MAX_G == max(kernels.GROUPS)


def test_stage_launchers_cover_the_pipeline(launches):
    q, k, v, lengths = _inputs()
    for method, budget in (("dense", "global"), ("santa", "global"), ("santa", "fixed")):
        plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=300, method=method,
                         budget=budget)
        launches.clear()
        plan.run(q, k, v, lengths)
        full = [name for name, *_ in launches]
        launches.clear()
        for launch in plan.stage_launchers(q, k, v, lengths).values():
            launch()
        assert [name for name, *_ in launches] == full


def test_dense_kernel_auto_and_mma_limits(launches):
    kw = dict(batch=2, heads=8, kv_heads=2, max_length=300, method="dense")
    assert make_plan(head_dim=128, dtype="bfloat16", **kw).dense_kernel == "mma"
    assert make_plan(head_dim=64, dtype="float16", **kw).dense_kernel == "mma"
    assert make_plan(head_dim=256, dtype="bfloat16", **kw).dense_kernel == "stream"
    assert make_plan(head_dim=128, dtype="float32", **kw).dense_kernel == "stream"
    with pytest.raises(ValueError, match="dense_kernel='mma' needs"):
        make_plan(head_dim=256, dtype="bfloat16", dense_kernel="mma", **kw)
    kw["method"] = "santa"
    assert make_plan(head_dim=64, dtype="bfloat16", **kw).score_kernel == "mma"
    assert make_plan(head_dim=128, dtype="float32", **kw).score_kernel == "stream"
    with pytest.raises(ValueError, match="score_kernel='mma' needs"):
        make_plan(head_dim=128, dtype="float32", score_kernel="mma", **kw)


@pytest.mark.parametrize("groups,max_parts,slots,want", [
    (8, 128, 528, 63),      # B=1 x KVH=8: the fewest splits within 5% of a full wave (504 of 528)
    (32, 128, 528, 16),     # B=4: 16 splits (512 blocks), never 17 (544 = 1.03 waves)
    (128, 128, 528, 4),     # B=16: 4 splits, 512 blocks, not 5 (640 = 1.21 waves)
    (128, 2, 528, 2),       # capped by the rows a split must have
    (1056, 50, 528, 1),     # two full waves of groups already: one part each
])
def test_wave_fitted_parts(groups, max_parts, slots, want):
    got = kernels.wave_fitted_parts(groups, max_parts, slots)
    assert got == want
    blocks = groups * got
    waves = -(-blocks // slots)
    assert blocks / (waves * slots) >= 0.95 * max(groups * p / (-(-groups * p // slots) * slots)
                                                  for p in range(1, max_parts + 1))


def test_resident_blocks_arithmetic():
    k = types.SimpleNamespace(num_regs=128, shared_size_bytes=0)
    assert kernels.resident_blocks(k, 128, 16 * 1024) == 4            # registers: 65536 / (128 * 128)
    assert kernels.resident_blocks(types.SimpleNamespace(num_regs=64), 128, 21 * 1024) == 8
    assert kernels.resident_blocks(types.SimpleNamespace(num_regs=32), 128, 100 * 1024) == 2   # shared memory
    assert kernels.resident_blocks(types.SimpleNamespace(num_regs=16), 128, 0) == 16           # threads
    assert kernels.resident_blocks(object(), 128, 0) == 4                                     # unknown: fallback


def test_tile_kernel_choice(launches):
    kw = dict(batch=2, kv_heads=2, head_dim=128, max_length=30000)
    assert make_plan(heads=8, **kw).tile_kernel == "warp"                  # 4.4 expected rows per tile
    assert make_plan(heads=8, sampler="iid", **kw).tile_kernel == "block"
    # the fixed budget: two-pass through the stash above 64 MB of K + V, one fused pass below where
    # the plan runs santa at every length (the fused pass has no dense fallback)
    big = dict(kw, batch=3)                                                  # 3 * 30000 * 2 * 128 * 2 * 2 = 92 MB
    fixed = make_plan(heads=8, budget="fixed", **big)
    assert (fixed.tile_kernel, fixed.two_pass) == ("warp", True)
    small = make_plan(heads=8, budget="fixed", santa_min_length=0, **kw)    # 61 MB
    assert (small.tile_kernel, small.two_pass) == ("block", False)
    for min_length in ("auto", 5000):                                       # the warp pipeline and its fallback
        small = make_plan(heads=8, budget="fixed", santa_min_length=min_length, **kw)
        assert (small.tile_kernel, small.two_pass) == ("warp", True) and small._dense_plan is not None
    assert make_plan(heads=8, budget="fixed", tile_kernel="warp", **kw).two_pass
    # on tensor cores where a tile is expected to select >= 16 rows (fp16/bf16 at D 64/128):
    # G * S * BN / L_max = 4 * 938 * 128 / 30000 = 16.008 rows
    assert make_plan(heads=8, samples=937, **kw).tile_kernel == "warp"         # 15.99 rows
    assert make_plan(heads=8, samples=938, **kw).tile_kernel == "warp_mma"
    assert make_plan(heads=8, budget="fixed", samples=2048, **big).tile_kernel == "warp_mma"
    # without the tensor-core score pass (float32, head_dim 256) no warp pass 2: it needs that pass's prefix
    assert make_plan(heads=8, budget="fixed", samples=2048, dtype="float32", **big).tile_kernel == "block"
    assert make_plan(heads=8, score_kernel="stream", **kw).tile_kernel == "block"
    assert make_plan(heads=8, samples=2048, tile_kernel="warp", **kw).tile_kernel == "warp"
    with pytest.raises(ValueError, match="tile_kernel='warp_mma' needs .*tensor-core score pass"):
        make_plan(heads=8, dtype="float32", tile_kernel="warp_mma", **kw)
    with pytest.raises(ValueError, match="tile_kernel='warp_mma' needs"):
        make_plan(heads=8, sampler="iid", tile_kernel="warp_mma", **kw)
    fixed_block = make_plan(heads=8, budget="fixed", tile_kernel="block", **kw)   # one fused pass
    assert (fixed_block.two_pass, fixed_block.scores.size) == (False, 1)
    assert make_plan(heads=8, budget="fixed", sampler="iid", **kw).tile_kernel == "block"
    assert make_plan(heads=8, budget="fixed", dtype="float32", **big).tile_kernel == "block"
    assert make_plan(heads=32, **kw).tile_kernel == "block"                 # G = 16 > 8
    with pytest.raises(ValueError, match="tile_kernel='warp' needs"):
        make_plan(heads=8, sampler="stratified", tile_kernel="warp", **kw)
    for gone in ("grid", "warp_smem", "warp_staged", "warp_pipe"):            # the pipelined gather is "warp"
        with pytest.raises(ValueError, match="tile_kernel"):
            make_plan(heads=8, tile_kernel=gone, **kw)


@pytest.mark.parametrize("tiles,groups,slots,want", [
    (256, 128, 660, 13),    # B=16, 32k: one wave of 640 blocks, not 12.4 waves of single tiles
    (256, 8, 660, 1),       # B=1: 512 blocks already fit one wave
    (256, 32, 660, 4),      # B=4: 512 blocks, one wave
    (1, 1, 660, 1),
])
def test_tiles_per_warp(tiles, groups, slots, want):
    got = kernels.tiles_per_warp(tiles, groups, slots)
    assert got == want
    blocks = groups * -(-(-(-tiles // got)) // 4)
    assert -(-tiles // got) * got >= tiles and blocks <= slots * -(-blocks // slots)


def test_runs_of_tiles_launch(launches):
    q, k, v, lengths = _inputs(L=3000)
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, tiles_per_warp=3,
                     santa_min_length=0)
    assert (plan.score_tpw, plan.tile_tpw, plan.T_max) == (3, 3, 24)
    plan.run(q, k, v, lengths)
    by_name = {name: (grid, args) for name, grid, _, args, _ in launches}
    params = _kernel_params()
    for name in ("santa_score_mma", "santa_tile_warp"):
        grid, args = by_name[name]
        assert grid == (2, 6)                                  # 2 KV heads x ceil(2 * 24 / (4 * 3)) + 2 blocks
        assert int(args[params[name].index("tiles_per_warp")]) == 3
    assert list(by_name) == ["santa_score_mma", "santa_prefix", "santa_tile_warp"]   # o from the warp pass 2
    smem = [s for name, _, _, _, s in launches if name == "santa_tile_warp"]
    assert plan.tile_kernel == "warp_mma"                      # 4 * 256 * 128 / 3000 = 44 rows per tile
    assert smem == [34816]                    # the staged layout (test_shared_memory_bytes_by_the_kernels_layout)
    auto = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000)
    assert auto.score_tpw >= 1 and auto.tile_tpw >= 1
    block = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, tile_kernel="block")
    assert block.tile_tpw == 1                                 # the block pass 2 writes a partial per tile
    for bad in (0, -1, 2.5, True, "3"):
        with pytest.raises(ValueError, match="tiles_per_warp"):
            make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, tiles_per_warp=bad)


# Dynamic shared memory of every kernel that takes some, for one shape each (bf16, head_dim 128,
# G = 4, 128 threads = 4 warps), as bytes summed by hand from the pointer arithmetic of the kernel's
# own code (not from kernels.py's *_smem_bytes, which the plan calls): a layout change in a .cu file
# that the plan does not follow, or the other way round, fails here. (tests/test_gpu_shared_memory.py
# runs the kernels with these sizes under compute-sanitizer, where the device allows it.)
SMEM_BY_LAYOUT = [
    # decode_dense.cu DenseState::write_partials: acc_s [kRG][G][D] f32, m_s, l_s [kRG][G] f32;
    # kRG = 128 threads / (D / 8 lanes a row) = 8: 4 * (8*4*128 + 2*8*4)
    (dict(method="dense", dense_kernel="stream"), "decode_dense_partial", 16640),
    # decode_dense_mma: acc_s [kWarps][G][D] | m_s [kWarps][G] | l_s [kWarps][G] f32: 4 * (4*4*128 + 2*4*4)
    (dict(method="dense", dense_kernel="mma"), "decode_dense_mma", 8320),
    # santa_tile.cu santa_tile (block_n 64): cum [G][BN] f32 | cnt [G][BN] i32 | acc [kRG][G][D] f32 |
    # m2p [kRG][G] | rows [BN] | warp_tot [4] | m, l [G] = 4 * (256 + 256 + 4096 + 32 + 64 + 4 + 8) =
    # 18864 (16-byte aligned already), then draws [G] HeadDraw (48 bytes: u64, 2 double, 3 float, 3 int)
    (dict(method="santa", budget="fixed", block_n=64, tile_kernel="block", score_kernel="stream"),
     "santa_tile", 18864 + 4 * 48),
    # santa_tile_warp (block_n 128): cnt [G][BN] + rows [BN] i32 a warp, then sums [G][D] f32 a
    # warp, then a warp's SC_GATHER_STAGE_BYTES (4096 / (128 dims * 2 bytes) = 16 rows of V):
    # 4 warps * 4 * (4*128 + 128) + 4 warps * 4 * (4*128) + 4 warps * 16 * 128 * 2 ("warp_mma");
    (dict(method="santa", block_n=128, tile_kernel="warp_mma"), "santa_tile_warp", 18432 + 16384),
    # ... "warp" (the pipelined gather): + the pending tile's counts coef [G][16 rows] f32 a warp
    (dict(method="santa", block_n=128, tile_kernel="warp"), "santa_tile_warp", 18432 + 16384 + 4 * 4 * 16 * 4),
    # santa_one_pass.cu (block_n 64): kWarpFloats = G*BN + BN + G*D + G*kStage = 256 + 64 + 512 + 64
    # floats a warp (sc, rows, sums, coef_st), then a warp's kStage = 16 rows of V (4096 bytes)
    (dict(method="santa", budget="one_pass", block_n=64), "santa_one_pass", 4 * 4 * 896 + 4 * 4096),
]


@pytest.mark.parametrize("options,kernel,want", SMEM_BY_LAYOUT,
                         ids=[f"{k}-{o.get('tile_kernel', o.get('dense_kernel', o.get('budget')))}"
                              for o, k, _ in SMEM_BY_LAYOUT])
def test_shared_memory_bytes_by_the_kernels_layout(launches, options, kernel, want):
    q, k, v, lengths = _inputs(L=3000)
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=0, **options)
    plan.run(q, k, v, lengths)
    got = {smem for name, _, _, _, smem in launches if name == kernel}
    assert got == {want}, f"{kernel}: {got} bytes launched, its layout needs {want}"
    for name, _, _, _, smem in launches:                 # every other launch: static shared memory only
        if name != kernel:
            assert smem == 0, (name, smem)


def _cuda_defines():
    """{macro: int} of every `#define SC_NAME <integer>` in the kernel sources."""
    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"^\s*#\s*define\s+(SC_\w+)\s+(-?\d+)\b", kernels.build_source(), re.M)}


def _struct_size(source, name):
    """sizeof(struct name) by the C layout rules (each member aligned to its size, the struct to
    its largest member), from the member declarations in the source."""
    body = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", source, re.S).group(1)
    sizes = {"u64": 8, "i64": 8, "double": 8, "float": 4, "int": 4, "u32": 4, "unsigned": 4}
    offset, align = 0, 1
    for decl in re.findall(r"^\s*(\w+)\s+(\w+)\s*;", re.sub(r"//.*", "", body), re.M):
        size = sizes[decl[0]]
        offset = -(-offset // size) * size + size
        align = max(align, size)
    return -(-offset // align) * align


def test_layout_constants_are_the_kernels():
    """The constants kernels.py sizes shared memory and grids with are the kernels' own #defines
    and struct (not a second copy that can drift): block size, chunk, the staged gather's bytes,
    HeadDraw, the accumulator copies, the gather, merge, budget and sampler codes."""
    d = _cuda_defines()
    assert (kernels.THREADS, kernels.CHUNK) == (d["SC_NTHREADS"], d["SC_CHUNK"]) == (128, 8)
    assert kernels.GATHER_STAGE_BYTES == d["SC_GATHER_STAGE_BYTES"]
    assert key_layout.KEY_PAGE_ROWS == d["SC_KEY_PAGE_ROWS"]
    assert kernels.ACC_COPIES == d["SC_ACC_COPIES"]
    assert kernels.MERGE_THREADS == d["SC_MERGE_THREADS"]
    assert kernels.HEAD_DRAW_BYTES == _struct_size(kernels.build_source(), "HeadDraw") == 48
    assert (kernels.GATHER_PIPE, kernels.GATHER_MMA) == (d["SC_GATHER_PIPE"], d["SC_GATHER_MMA"])
    assert (kernels.MERGE_DENSE, kernels.MERGE_FIXED, kernels.MERGE_SUM) == \
        (d["SC_MERGE_DENSE"], d["SC_MERGE_FIXED"], d["SC_MERGE_SUM"])
    assert kernels.BUDGET_CODE == {"fixed": d["SC_BUDGET_FIXED"], "global": d["SC_BUDGET_GLOBAL"],
                                   "largest_remainder": d["SC_BUDGET_LR"]}
    assert kernels.SAMPLER_CODE == {"iid": d["SC_SAMPLER_IID"], "stratified": d["SC_SAMPLER_STRATIFIED"],
                                    "systematic": d["SC_SAMPLER_SYSTEMATIC"]}
    assert kernels.MODE_CODE == {"fused": d["SC_MODE_FUSED"], "sample": d["SC_MODE_SAMPLE"],
                                 "gather": d["SC_MODE_GATHER"]}


def test_fixed_warp_launch(launches):
    """The fixed budget on the warp pass 2: the score pass and its prefix first (the prefix gives the
    tile weights), runs of tiles like the other budgets, the pre-weighted sums finished by the last
    warp (no merge launch)."""
    q, k, v, lengths = _inputs(L=3000)
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="fixed",
                     tile_kernel="warp", tiles_per_warp=5, santa_min_length=0)
    assert (plan.tile_tpw, plan.score_tpw) == (5, 5)
    plan.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == ["santa_score_mma", "santa_prefix", "santa_tile_warp"]
    params = _kernel_params()
    by_name = {name: (grid, args) for name, grid, _, args, _ in launches}
    grid, args = by_name["santa_tile_warp"]
    assert grid == (2, 5)                                      # 2 KV heads x ceil(2 * 24 / (4 * 5)) + 2 blocks
    assert int(args[params["santa_tile_warp"].index("budget")]) == kernels.BUDGET_CODE["fixed"]
    _, pargs = by_name["santa_prefix"]
    assert int(pargs[params["santa_prefix"].index("budget_lr")]) == 0


def test_fixed_budget_default_runs_exact_below_its_crossover(launches):
    """santa_min_length "auto" on a cache small enough for the fused fixed pass: the warp pipeline,
    whose dense fallback takes every sequence when none can reach santa_from (S = 2048: tens of
    thousands of tokens), so the plan launches the exact kernel alone; santa at every length keeps
    the fused pass."""
    q, k, v, lengths = _inputs(L=3000)
    kw = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="fixed", samples=2048)
    plan = make_plan(**kw)
    assert plan.santa_from > plan.L_max
    plan.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == ["decode_dense_mma"]
    assert plan.info().dense_fallback.tolist() == [True, True]
    launches.clear()
    make_plan(**kw, santa_min_length=0).run(q, k, v, lengths)
    assert [name for name, *_ in launches] == ["santa_tile", "santa_merge"]


def test_launch_structs_match_the_driver_abi():
    """kernels.launch's ctypes mirrors of CUlaunchConfig / CUlaunchAttribute (cuda.h, 64-bit): a
    wrong size or offset would hand cuLaunchKernelEx garbage."""
    import ctypes
    from santa_cupy import kernels
    assert ctypes.sizeof(kernels._LaunchAttribute) == 72                  # id, pad to 8, 64-byte union
    assert kernels._LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(kernels._LaunchConfig) == 56
    offsets = {name: getattr(kernels._LaunchConfig, name).offset
               for name in ("shared_mem", "stream", "attrs", "num_attrs")}
    assert offsets == {"shared_mem": 24, "stream": 32, "attrs": 40, "num_attrs": 48}
    assert kernels._c_arg(np.int32(7)).value == 7 and isinstance(kernels._c_arg(np.float32(0.5)), ctypes.c_float)
    with pytest.raises(TypeError, match="no C type"):
        kernels._c_arg(7)


def test_short_sequences_run_dense(launches):
    """santa_min_length: sequences shorter run decode_dense_mma (a dense sub-plan writing into the
    santa plan's outputs, its splits sized for the longest such sequence), the santa kernels skip
    them; "auto" derives the length from the shape and the device's bandwidth; a cache shorter than
    it makes the plan dense throughout (one launch)."""
    params = _kernel_params()
    q, k, v, lengths = _inputs(L=3000)
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=1000)
    plan.run(q, k, v, lengths)
    # the dense fallback last: it asks whether any sequence is its own before its PDL wait, while pass 2 runs
    assert [name for name, *_ in launches] == ["santa_score_mma", "santa_prefix", "santa_tile_warp", "decode_dense_mma"]
    by_name = {name: args for name, _, _, args, _ in launches}
    for name in by_name:
        assert int(by_name[name][params[name].index("santa_from")]) == 1000
    dense = plan._dense_plan
    assert dense.out is plan.out and dense.lse is plan.lse and dense.rows_read is plan.rows_read
    assert dense.part_rows * dense.P_max >= 999 and dense.P_max <= kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS
    assert by_name["decode_dense_mma"][params["decode_dense_mma"].index("self_merge")] == 1
    # auto: 8.2 us + 1.7 us a sequence at the device's bandwidth (the stand-in reports none: 4.8 TB/s)
    # over B * KVH * D * 2 bytes
    auto = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000)
    assert auto.santa_from == kernels.santa_min_length(2, 2, 128, 2, 4.8e12) == 54375
    launches.clear()
    auto.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == ["decode_dense_mma"]          # L_max < santa_from: dense only
    # ... as a dense plan's kernel (SC_ALL_DENSE), which reads no length before its PDL wait
    assert int(launches[0][3][params["decode_dense_mma"].index("santa_from")]) == 2 ** 31 - 1
    assert kernels.santa_min_length(1, 8, 128, 2, 4.8e12) == 23204          # llama8b shape, B = 1
    assert kernels.santa_min_length(16, 8, 128, 2, 4.8e12) == 5186
    # more samples a head, more pass-2 work: a later crossover (S = 2048, the fixed budget's
    # default, measured ~28k / ~15k / ~14k tokens at B = 1 / 4 / 16 on the H100 at 3.35 TB/s)
    assert [kernels.santa_min_length(B, 8, 128, 2, 3.352e12, samples=2048) for B in (1, 4, 16)] == [25590, 16184, 13832]
    crossovers = [kernels.santa_min_length(4, 8, 128, 2, 4.8e12, samples=S) for S in (1, 64, 256, 1024, 1 << 16)]
    assert crossovers == sorted(crossovers) and crossovers[0] >= 1
    many = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, samples=2048)
    assert many.santa_from == kernels.santa_min_length(2, 2, 128, 2, 4.8e12, samples=2048) > auto.santa_from
    assert abs(kernels.device_bandwidth({"MemoryClockRate": 3_201_000, "GlobalMemoryBusWidth": 6144}) - 4.917e12) < 1e9
    # the dense plan's kernel takes every sequence
    dplan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, method="dense")
    launches.clear()
    dplan.run(q, k, v, lengths)
    assert int(launches[0][3][params["decode_dense_mma"].index("santa_from")]) == 2**31 - 1
    for bad in (-1, 2.5, "never", True):          # the setting's check: TypeError for a non-integer
        with pytest.raises((TypeError, ValueError), match="santa_min_length"):
            make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=bad)


# Santa plans without a per-sequence fallback: (shape keywords, setting keywords, the santa
# kernels they launch at every length)
WHOLE_BATCH_ROUTES = [
    (dict(), dict(sampler="iid", budget="largest_remainder"), ["santa_score_mma", "santa_prefix", "santa_tile"]),
    (dict(heads=32), dict(), ["santa_score_mma", "santa_prefix", "santa_tile"]),                  # G = 16
    (dict(head_dim=256, dtype="float32"), dict(), ["santa_score", "santa_prefix", "santa_tile"]),
    (dict(), dict(budget="one_pass"), ["santa_one_pass"]),
    (dict(), dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.5, key_rule="qrms"),
     ["santa_key_blocks", "santa_score_keys_mma", "santa_prefix", "santa_tile_warp"]),
]


@pytest.mark.parametrize("shape, setting, santa_kernels", WHOLE_BATCH_ROUTES)
def test_whole_batch_routes_run_exact_below_the_crossover(launches, shape, setting, santa_kernels):
    """Never slower than exact where a plan cannot mix per sequence (block pass 2, one_pass, key
    sampling): "auto" runs the dense plan's launches alone when max_length is below the crossover
    (kernels.santa_min_length; the block pass 2 at every length), santa throughout above it; an
    explicit santa_min_length above max_length is exact throughout, one in 2..max_length a
    ValueError; 0 is santa at every length."""
    kw = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, dtype="bfloat16")
    kw.update(shape)
    B, H, KVH, D, L = (kw[k] for k in ("batch", "heads", "kv_heads", "head_dim", "max_length"))
    storage = np.float32 if kw["dtype"] == "float32" else np.uint16
    q, k, v, lengths = _inputs(B=B, H=H, KVH=KVH, D=D, L=L, dtype=storage)
    if "key_sampling" in setting:
        k = key_layout.to_blocked(np.asarray(k), setting["key_block"]).view(FakeArray)
        kw["key_layout"] = "blocked"
    dense = make_plan(**kw, method="dense")
    dense.run(q, k, v, lengths)
    dense_launches = [name for name, *_ in launches]
    launches.clear()
    plan = make_plan(**kw, **setting)
    assert plan.exact_throughout and plan.santa_from > L
    plan.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == dense_launches
    info = plan.info()
    assert info.dense_fallback.tolist() == [True] * B
    assert info.rows_read.tolist() == [[int(n)] * KVH for n in lengths]
    keys = "key_sampling" in setting
    assert info.key_fraction.tolist() == [[1.0] * KVH] * B if keys else info.key_fraction is None
    launches.clear()
    plan = make_plan(**kw, **setting, santa_min_length=L + 1)
    assert plan.exact_throughout
    plan.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == dense_launches
    for always in (0, 1):
        launches.clear()
        plan = make_plan(**kw, **setting, santa_min_length=always)
        assert not plan.exact_throughout and plan.santa_from == 0       # (1: the same)
        plan.run(q, k, v, lengths)
        assert [name for name, *_ in launches if name not in ("santa_merge",)] == santa_kernels
    with pytest.raises(ValueError, match=f"santa_min_length={L}: this plan runs santa or dense for the whole batch"):
        make_plan(**kw, **setting, santa_min_length=L)
    # above the crossover "auto" samples every sequence, the short one too; the block pass 2 has
    # none (kernels.BLOCK_PASS_MIN_LENGTH: measured slower than dense everywhere)
    long = dict(kw, batch=16, max_length=60000)
    assert kernels.santa_min_length(16, KVH, D, kernels.ITEMSIZE[kw["dtype"]], 4.8e12) < 60000
    plan = make_plan(**long, **setting)
    if "santa_tile" in santa_kernels:
        assert plan.exact_throughout and plan.santa_from == kernels.BLOCK_PASS_MIN_LENGTH
    else:
        assert plan.santa_from == 0 and not plan.exact_throughout and plan._dense_plan is None


def test_exact_throughout_merges_many_splits(launches):
    """A warp plan whose cache is below its crossover runs as the dense plan of its shape, merge
    included: splits past DENSE_SELF_MERGE_MAX_SPLITS (B = 1, 16k: 61 with the stand-in's 528
    resident blocks) are merged by santa_merge (the dense fallback alone left them unmerged)."""
    kw = dict(batch=1, heads=32, kv_heads=8, head_dim=128, max_length=16384)
    q, k, v, _ = _inputs(B=1, H=32, KVH=8, D=128, L=16384)
    lengths = np.array([16384], np.int32).view(FakeArray)
    dense = make_plan(**kw, method="dense")
    assert dense.P_max > kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS and not dense.dense_merges_itself
    dense.run(q, k, v, lengths)
    want = [(name, grid) for name, grid, *_ in launches]
    launches.clear()
    plan = make_plan(**kw)
    assert plan.exact_throughout and plan._warp
    plan.run(q, k, v, lengths)
    assert [(name, grid) for name, grid, *_ in launches] == want == [
        ("decode_dense_mma", want[0][1]), ("santa_merge", want[1][1])]
    assert list(plan.stage_launchers(q, k, v, lengths)) == ["dense split-KV (mma)", "merge"]


def test_stash_in_l2_by_the_stash_bytes(launches):
    """The warp pipeline keeps its stash in the L2 (K evict-first in santa_score_mma, the stash
    dropped by santa_tile_warp: both kernels get the flag) up to stash_l2_max_bytes of stash
    [B, H, L_max] float32 (automatic: kernel_choice.STASH_L2_FRACTION of the device's L2); 0 turns
    it off; dense plans never."""
    params = _kernel_params()
    q, k, v, lengths = _inputs(L=3000)
    stash = 2 * 8 * 3000 * 4
    for limit, want in ((None, 1), (stash, 1), (stash - 1, 0), (0, 0)):
        launches.clear()
        kw = {} if limit is None else {"stash_l2_max_bytes": limit}
        plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=0, **kw)
        assert plan.scores.nbytes == stash <= kernel_choice.STASH_L2_FRACTION * kernels.DEFAULT_L2_BYTES
        assert plan.stash_in_l2 == want
        plan.run(q, k, v, lengths)
        by_name = {name: args for name, _, _, args, _ in launches}
        for name in ("santa_score_mma", "santa_tile_warp"):
            assert int(by_name[name][params[name].index("stash_in_l2")]) == want
    assert make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, method="dense").stash_in_l2 == 0
    big = make_plan(batch=64, heads=32, kv_heads=8, head_dim=128, max_length=8192, santa_min_length=0)
    assert big.scores.nbytes > kernel_choice.STASH_L2_FRACTION * kernels.DEFAULT_L2_BYTES and big.stash_in_l2 == 0
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="stash_l2_max_bytes"):
            make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, stash_l2_max_bytes=bad)


def test_score_steps_lie_in_one_page(launches):
    """santa_score_mma reads K in steps of kernels.SCORE_SPAN 16-key pieces, one page-table lookup a
    step, so a step must lie in one page: contiguous caches and pages of a multiple of 32 rows take
    that instance, pages of 16 or 48 rows (or any size not a multiple of 32) the one-piece one."""
    assert kernels.SCORE_SPAN == 2
    names = kernels.instance_names("bfloat16", 128, 4, "santa128")
    assert names["score_mma"] == "santa_score_mma<bf16_t, 128, 128, 4, 2>"
    assert names["score_mma_span1"] == "santa_score_mma<bf16_t, 128, 128, 4, 1>"
    for page_size, span in ((None, 2), (32, 2), (64, 2), (256, 2), (16, 1), (48, 1), (8, 1), (100, 1)):
        assert kernels.score_span(page_size) == span
        plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, santa_min_length=0,
                         page_size=page_size)
        want = plan.kernels.score_mma if span == 2 else plan.kernels.score_mma_span1
        assert plan._score_warp_kernel[0] is want


def test_many_groups_finish_from_block_partials(launches):
    """Above kernel_choice.FINISH_MAX_GROUPS (sequence, KV head) groups the warp pass 2 finishes from
    its blocks' partials (the kFinish false instance), no merge launch."""
    params = _kernel_params()
    q, k, v, lengths = _inputs(B=2, H=64, KVH=32, L=3000)
    lengths = np.array([3000, 17], np.int32).view(FakeArray)
    plan = make_plan(batch=2, heads=64, kv_heads=32, head_dim=128, max_length=3000, santa_min_length=0,
                     tiles_per_warp=3)
    assert not plan.atomic_finish
    plan.run(q, k, v, lengths)
    by_name = {name: args for name, _, _, args, _ in launches}
    assert list(by_name) == ["santa_score_mma", "santa_prefix", "santa_tile_warp"]
    assert plan._warp_kernel is plan.kernels.tile_warp_mma                  # the block-partial instance
    assert plan.kernels.tile_warp_mma_finish is not plan.kernels.tile_warp_mma
    assert int(by_name["santa_tile_warp"][params["santa_tile_warp"].index("tiles_per_warp")]) == 3


def test_one_pass_launches(launches):
    """budget="one_pass": santa_one_pass (its signature's arguments; the plan's lse as the default
    hint, a given one otherwise) then santa_merge over runs of one_tpw tiles, kind dense."""
    q, k, v, lengths = _inputs(L=3000)
    plan = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="one_pass",
                     santa_min_length=0)                          # (santa at L = 3000)
    assert np.isnan(plan.lse).all()                               # the first call takes every row
    plan.run(q, k, v, lengths)
    assert [name for name, *_ in launches] == ["santa_one_pass", "santa_merge"]   # one fill (host-side here)
    assert np.shares_memory(plan.rows_read, plan._one_pass_counts) and np.shares_memory(plan.drawn,
                                                                                        plan._one_pass_counts)
    sigs = _kernel_signatures()
    for name, grid, block, args, smem in launches:
        assert len(args) == len(sigs[name])
        for arg, (param, scalar) in zip(args, sigs[name]):
            assert (isinstance(arg, np.ndarray) if scalar is None else type(arg) is scalar), (name, param)
    params = [p for p, _ in sigs["santa_one_pass"]]
    args = launches[0][3]
    assert args[params.index("lse_hint")] is plan.lse and int(args[params.index("tiles_per_warp")]) == plan.one_tpw
    assert launches[0][4] == kernels.one_pass_smem_bytes(plan.block_n, 4, 128, "bfloat16")
    merge = [p for p, _ in sigs["santa_merge"]]
    margs = launches[1][3]
    assert int(margs[merge.index("kind")]) == kernels.MERGE_DENSE
    assert int(margs[merge.index("part_rows")]) == plan.one_tpw * plan.block_n
    hint = np.zeros((2, 8), np.float32).view(FakeArray)
    launches.clear()
    plan.run(q, k, v, lengths, lse_hint=hint)
    assert launches[0][3][params.index("lse_hint")] is hint
    with pytest.raises(ValueError, match="lse_hint"):
        plan.run(q, k, v, lengths, lse_hint=np.zeros((2, 7), np.float32).view(FakeArray))
    with pytest.raises(ValueError, match="one_pass"):
        plan.sample_counts(q, k, lengths)
    with pytest.raises(ValueError, match="systematic"):
        make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="one_pass", sampler="iid")
    other = make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000)
    with pytest.raises(ValueError, match="lse_hint is for"):
        other.run(q, k, v, lengths, lse_hint=hint)
    for bad, what in ((dict(tile_kernel="warp"), "tile_kernel"), (dict(score_kernel="stream"), "score_kernel"),
                      (dict(santa_min_length=500), "santa or dense for the whole batch")):
        with pytest.raises(ValueError, match=what):
            make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="one_pass", **bad)
    assert make_plan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=3000, budget="one_pass",
                     santa_min_length=0).santa_from == 0

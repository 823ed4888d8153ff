"""Which kernels a DecodePlan launches: internal (not part of the public API).

A plan derives its kernels from the shape, the attention setting and the device
(``resolve``); ``KernelChoice`` holds what may be forced instead — the kernel of each stage, the
runs of tiles per warp, the dense split count — and the thresholds of the automatic choice. The
defaults are what the plan does on its own; bench (santa_cupy/cli/bench: the method suffixes
-stream, -mma, -block, -tpw1, -warp, -warpmma, -p<N>) and the tests pass a KernelChoice through
``DecodePlan(..., _kernels=KernelChoice(...))``, so no module constant is patched from outside.
None of this changes the estimator: every choice gives the same distribution of outputs.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from santa_cupy import kernels, spec

DENSE_KERNELS = ("auto", "stream", "mma")   # v2 decode_dense_partial (generic), v4 decode_dense_mma
# santa pass 1: santa_score (v2, FMA: the generic fallback) or santa_score_mma (v4, tensor cores)
SCORE_KERNELS = ("auto", "stream", "mma")
# pass 2: santa_tile (a block per tile) or v4 santa_tile_warp (one warp per run of tiles), which
# gathers a tile's selected V rows through shared memory, a light tile's rows in flight over the
# next tile's counts ("warp"), or staged and on tensor cores ("warp_mma": fp16/bf16 at D 64/128)
TILE_KERNELS = ("auto", "block", "warp", "warp_mma")

# decode_dense_mma merges in its own last block per KV group up to this many splits a group; above,
# santa_merge runs after it. 32 = a warp's lanes: merge.cuh's warp_merge_dense_head merges a head's
# up to 32 partials with every load in flight at once, a warp per head (H200:
# B=1 32k 40.5 -> 38.5 us, 8k 17.9 -> 16.0, 128k 128.1 -> 125.8). More splits the kernel merges a
# head at a time with the whole block (block_merge_dense_head, 32 splits a warp and round trip),
# which measured slower than santa_merge's launch (SmolLM2 B=1, 3 groups of 121 splits,
# 32k 15.0 -> 15.6 us, 128k 33.7 -> 34.3), so the plan keeps the cap at 32.
DENSE_SELF_MERGE_MAX_SPLITS = 32
MMA_MIN_ROWS = 16            # "auto" gathers on tensor cores from this many expected rows per tile
# "auto", budget fixed, santa at every length (santa_min_length 0 or 1; resolve): the one fused
# pass (santa_tile: 2 launches, not 4) up to this much K + V; H200: fused faster at 25-34 MB,
# two-pass faster from 101 MB
FUSED_FIXED_MAX_KV_BYTES = 64 << 20
# santa_tile_warp's two finishes (kFinish), both by the last block of each (sequence, KV head): the
# blocks add their sums into accumulators (atomics) up to this many groups, each with many blocks,
# or store block partials that the last block sums (deterministic). H200, llama8b (8 KV heads),
# SANTA at every length, docs/results/h200_02b13db: B=1 (8 groups, 64 blocks a group at 32k)
# atomics 27.0 / 39.0 / 92.4 us at 8k / 32k / 128k against partials 27.3 / 39.9 / 95.3; B=4 (32
# groups) partials 41.5 / 99.6 / 337.0 against 43.3 / 99.6 / 337.5; B=16 equal within 0.5 us.
FINISH_MAX_GROUPS = 8
# The warp pipeline's score stash [B, H, L_max] float32 kept in the L2 up to this fraction of the
# device's L2: santa_score_mma reads K with an evict-first L2 policy and santa_tile_warp drops the
# stash's lines once read (discard.global.L2), so the stash need not reach DRAM either way. H200
# (60 MiB L2), llama8b bf16, S=256 global, one call, against the same loads under an evict-normal
# policy: B=1 32k (4 MB of stash) 38.5 vs 42.2 us, B=1 128k and B=4 32k (17 MB) 91.1 / 99.6 vs
# 99.7 / 107.2; B=4 128k and B=16 32k (67 MB) 347.1 / 390.5 vs 341.8 / 383.2, where the K stream
# evicts the stash anyway. The hinted loads themselves cost 3-5% there against plain ones
# (another call: 325.8 / 366.9), so above the fraction the score pass reads K plainly and pass 2
# drops nothing (docs/results/h200_9603329).
STASH_L2_FRACTION = 0.5


@dataclass(frozen=True)
class KernelChoice:
    """Forced kernels and the thresholds of the automatic choice (internal; defaults = automatic).

    dense_kernel: "auto" | "stream" (v2, FMA: the generic fallback) | "mma" (v4, tensor cores;
        fp16/bf16 at head_dim 64/128); "auto": v4 where it has an instance, else v2.
    score_kernel: santa pass 1, the same three choices.
    tile_kernel: santa pass 2, "auto" | "block" (a 128-thread block per tile) | "warp" (v4, one
        warp per run of tiles: systematic sampler, G <= 8, every budget; rows staged through shared
        memory, a light tile's rows in flight while the next tile's counts run) | "warp_mma"
        (staged, then added on tensor cores); "auto": a warp kernel where it applies (not for the
        fixed budget on a small cache at every length), on tensor cores where a tile is expected
        to select many rows.
    tiles_per_warp: None (fitted to the occupancy) or the run length of the one-warp-per-run
        kernels (score pass, warp pass 2, one pass), and of the one-block-per-run santa_score_keys
        (block key sampling's score pass).
    dense_splits: None (whole waves of resident blocks) or the dense kernel's splits a KV group.
    self_merge_max_splits: the dense kernel merges in its last block up to this many splits.
    fused_fixed_max_kv_bytes: "auto", budget fixed, santa_min_length 0 or 1: the one fused pass up
        to this much K + V.
    mma_min_rows: "auto" gathers on tensor cores from this many expected rows per tile.
    finish_max_groups: the warp pass 2 finishes through atomics up to this many (sequence, KV head)
        groups, above by block partials.
    stash_l2_max_bytes: the warp pipeline keeps its score stash in the L2 (K read evict-first, the
        stash dropped once pass 2 has read it: plan.scores is then undefined after a run) up to
        this many stash bytes; None: STASH_L2_FRACTION of the device's L2; 0: never (the stash
        stays readable, e.g. for tests).
    merge_wide: santa_merge with 8 partials in flight per warp (True) or 4 (False); None: 8 where
        its (H, B) grid is at most one wave of SMs (latency-bound), else 4 (fewer registers).
    programmatic: launch with programmatic dependent launch (sm_90+; where unavailable the plan
        launches plainly), plainly (False), or None: as the process-wide
        ``kernels.set_programmatic_launch`` says at each launch.
    """

    dense_kernel: str = "auto"
    score_kernel: str = "auto"
    tile_kernel: str = "auto"
    tiles_per_warp: int | None = None
    dense_splits: int | None = None
    self_merge_max_splits: int = DENSE_SELF_MERGE_MAX_SPLITS
    fused_fixed_max_kv_bytes: int = FUSED_FIXED_MAX_KV_BYTES
    mma_min_rows: float = MMA_MIN_ROWS
    finish_max_groups: int = FINISH_MAX_GROUPS
    merge_wide: bool | None = None
    programmatic: bool | None = None
    stash_l2_max_bytes: int | None = None

    def __post_init__(self):
        spec.check_choice("dense_kernel", self.dense_kernel, DENSE_KERNELS)
        spec.check_choice("score_kernel", self.score_kernel, SCORE_KERNELS)
        spec.check_choice("tile_kernel", self.tile_kernel, TILE_KERNELS)
        # (name, least value, None allowed: automatic)
        for name, low, automatic in (("tiles_per_warp", 1, True), ("dense_splits", 1, True),
                                     ("self_merge_max_splits", 0, False), ("fused_fixed_max_kv_bytes", 0, False),
                                     ("finish_max_groups", 0, False), ("stash_l2_max_bytes", 0, True)):
            value = getattr(self, name)
            if automatic and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
                what = "None (automatic) or an integer" if automatic else "an integer"
                raise ValueError(f"{name} must be {what} >= {low}, got {value!r}")
        for name in ("merge_wide", "programmatic"):
            value = getattr(self, name)
            if not (value is None or isinstance(value, bool)):
                raise ValueError(f"{name} must be None, True or False, got {value!r}")


@dataclass(frozen=True)
class ResolvedKernels:
    """The kernel of each stage a plan launches (resolve's answer)."""

    dense_kernel: str     # "stream" | "mma"
    score_kernel: str     # "stream" | "mma"
    tile_kernel: str      # "block" | "warp" | "warp_mma" | "one_pass"


def resolve_kernel_choice(what, choice, dtype_name, head_dim) -> str:
    """``what`` = "dense_kernel" | "score_kernel": "auto" -> "mma" where it exists, else "stream";
    an explicit "mma" must exist."""
    if choice == "auto":
        return "mma" if kernels.mma_supported(dtype_name, head_dim) else "stream"
    if choice == "mma" and not kernels.mma_supported(dtype_name, head_dim):
        raise ValueError(f"{what}={choice!r} needs dtype in {kernels.MMA_DTYPES} and head_dim in "
                         f"{kernels.MMA_HEAD_DIMS}, got dtype={dtype_name!r}, head_dim={head_dim}")
    return choice


def resolve_tile_kernel(choice, sampler, group, rows_per_tile=0.0, budget="global", kv_bytes=0,
                        mma_ok=False, *, every_length=True, fused_fixed_max_kv_bytes=FUSED_FIXED_MAX_KV_BYTES,
                        mma_min_rows=MMA_MIN_ROWS) -> str:
    """"auto" -> "block" where santa_tile_warp does not apply or for the fixed budget on a small
    cache at every length (every_length: the plan samples every sequence; kv_bytes <=
    fused_fixed_max_kv_bytes: its one fused pass has fewer launches, but no dense fallback); else
    by the rows a tile is expected to select: "warp_mma" from mma_min_rows, "warp" below.
    santa_tile_warp follows the tensor-core score pass (mma_ok: that pass runs). An explicit warp
    choice must apply."""
    ok = kernels.warp_tile_supported(sampler, group) and mma_ok
    fused_fixed = budget == "fixed" and every_length and kv_bytes <= fused_fixed_max_kv_bytes
    if choice == "auto":
        if not ok or fused_fixed:
            return "block"
        if mma_ok and rows_per_tile >= mma_min_rows:
            return "warp_mma"
        return "warp"
    if choice in ("warp", "warp_mma") and not ok:
        raise ValueError(f"tile_kernel={choice!r} needs sampler='systematic', heads // kv_heads <= "
                         f"{kernels.WARP_TILE_MAX_G} and the tensor-core score pass (dtype in {kernels.MMA_DTYPES}, "
                         f"head_dim in {kernels.MMA_HEAD_DIMS}, score_kernel 'auto' or 'mma'), got "
                         f"sampler={sampler!r}, group={group}")
    return choice


def resolve(choice: KernelChoice, setting, *, batch, kv_heads, group, head_dim, max_length, dtype,
            block_n) -> ResolvedKernels:
    """The kernels of a plan of this shape and setting (santa_cupy.AttentionSetting), ``choice``
    forcing some. Pure arithmetic (no device): the occupancy fits (runs of tiles, dense splits)
    are the plan's, from the compiled kernels' registers and the device's attributes."""
    dense = resolve_kernel_choice("dense_kernel", choice.dense_kernel, dtype, head_dim)
    score = resolve_kernel_choice("score_kernel", choice.score_kernel, dtype, head_dim)
    if setting.one_pass:
        if not kernels.one_pass_supported(setting.sampler, group, dtype, head_dim):
            raise ValueError(f"budget {spec.ONE_PASS!r} on the GPU needs sampler='systematic', heads // kv_heads "
                             f"<= {kernels.WARP_TILE_MAX_G}, dtype in {kernels.MMA_DTYPES} and head_dim in "
                             f"{kernels.MMA_HEAD_DIMS}, got sampler={setting.sampler!r}, group={group}, "
                             f"dtype={dtype!r}, head_dim={head_dim}")
        if choice.tile_kernel != "auto" or choice.score_kernel not in ("auto", "mma"):
            raise ValueError(f"budget {spec.ONE_PASS!r} has one kernel (santa_one_pass): tile_kernel must be "
                             f"'auto' and score_kernel 'auto' or 'mma', got tile_kernel={choice.tile_kernel!r}, "
                             f"score_kernel={choice.score_kernel!r}")
        return ResolvedKernels(dense, score, "one_pass")
    rows = kernels.expected_rows_per_tile(group, setting.samples, block_n, max_length)
    kv_bytes = 2 * batch * max_length * kv_heads * head_dim * kernels.ITEMSIZE[dtype]
    # The fused fixed pass has no dense fallback: "auto" takes it only for a plan that runs santa at
    # every length. Under santa_min_length "auto" its caches (<= 64 MB of K + V: batch 1 up to 16k
    # tokens of the 8B shape) lie below the fixed budget's crossover, where the warp pipeline's
    # fallback runs them exact (H100: fused 31.4 / 32.2 / 37.8 us against dense 14.4 / 20.0 / 30.7
    # at batch 1, 4k / 8k / 16k, S = 2048).
    tile = resolve_tile_kernel(choice.tile_kernel, setting.sampler, group, rows, setting.budget, kv_bytes,
                               score == "mma", every_length=setting.santa_min_length in (0, 1),
                               fused_fixed_max_kv_bytes=choice.fused_fixed_max_kv_bytes,
                               mma_min_rows=choice.mma_min_rows)
    return ResolvedKernels(dense, score, tile)

"""The public entry points: ``decode_attention`` (one call) and ``DecodePlan`` (repeated calls).

NumPy inputs run the float64 reference (santa_cupy.reference); CuPy inputs (or any GPU array that
speaks DLPack / ``__cuda_array_interface__``) run the CUDA kernels of cuda/ through a DecodePlan.

GPU pipeline per call (all on the current stream, no host sync, graph-capturable):
  dense:  decode_dense_mma (split-KV; with <= 32 splits a KV group its last block merges, else
          -> santa_merge), or decode_dense_partial (split-KV, fp32 / D 256) -> santa_merge
  santa, warp pipeline (systematic sampler, G <= 8, fp16/bf16 at D 64/128; every budget; the default):
        [decode_dense_mma for the sequences shorter than santa_from: the dense fallback]
        -> santa_score_mma (stash + tile stats) -> santa_prefix (cdf, lse) -> santa_tile_warp
        (sample + gather; with few KV groups its last block per group writes o) [-> santa_merge]
  santa, block pass 2 (other samplers, G > 8, fp32, D 256):
        global / largest_remainder: santa_score -> santa_prefix -> santa_tile -> santa_merge
        fixed: santa_tile (score + sample + gather fused, one pass) -> santa_merge
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from santa_cupy import interop, kernels, paged, reference, spec

STORAGE_DTYPE = {name: dtype for dtype, name in spec.DTYPE_NAMES.items()}   # "bfloat16" -> uint16
_INT32_MAX = 2**31 - 1
MAX_GRID_Y = 65535                   # CUDA's grid y limit: the (sequence, split) pairs or runs a KV head


@dataclass
class AttentionInfo:
    """Diagnostics of one call (arrays of the input's array library).

    lse [B, H] float32: log-sum-exp of the scaled scores.
    rows_read [B, KVH] int32: distinct V rows read (union over the GQA group); dense: lengths.
    spread [B, H] float32: estimated standard error of o, RMS over the D coordinates (0 for dense).
    counts [B, H, L_max] int32 sample counts (NumPy path, or GPU with ``return_counts``); else None.
    dense_fallback [B] bool: the sequences that ran the exact kernel (method dense: all; santa: those
    shorter than the plan's santa_min_length).
    samples_drawn [B, H] int32: rows each head took (budget one_pass: a random number, about
    samples * exp(lse - lse_hint)); ``samples`` for the other budgets; None for dense.
    """

    lse: Any
    rows_read: Any
    spread: Any
    counts: Any = None
    dense_fallback: Any = None
    samples_drawn: Any = None


@interop.accepts_stream
def decode_attention(q, k_cache, v_cache, lengths, *, method="santa", samples=256, sampler="systematic",
                     budget="global", seed=0, step=0, layer=0, scale=None, block_n=None,
                     return_info=False, return_counts=False, santa_min_length="auto", out=None,
                     lse_hint=None, block_table=None, page_layout="NHD", head_offset=0):
    """One decode step of attention for every sequence and head.

    q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D] (C-contiguous); lengths [B] (1..L_max).
    dtypes: float16, bfloat16 (as uint16 bit patterns) or float32, the same for q, k and v; the
    output o [B, H, D] has that dtype. ``method`` "dense" is exact; "santa" samples ``samples``
    value rows per head (``sampler`` iid | stratified | systematic, ``budget`` fixed | global |
    largest_remainder), reproducibly from (seed, step, layer). Returns o, or (o, AttentionInfo).
    On the GPU, sequences shorter than ``santa_min_length`` run the exact kernel, where it is
    faster ("auto": the crossover of DecodePlan; 0: santa for every sequence); the NumPy
    reference always runs the estimator it was asked for. NaN/inf in q is a ValueError; NaN or
    +inf among a head's scores (NaN/inf in K within the length) makes that head's output NaN.
    ``budget="one_pass"`` (santa_cupy/one_pass.py: rows taken with probability
    min(1, S exp(s - r)), one pass over the cache) needs ``lse_hint`` r [B, H] float32, an array of
    q's library: a guess of each head's log-sum-exp (any deterministic one keeps o unbiased; it
    sets the rows read, about S exp(lse - r)); ``info.samples_drawn`` says how many.
    ``out``: a C-contiguous [B, H, D] array of the output dtype (CuPy or any zero-copy GPU array
    for GPU inputs, NumPy for NumPy inputs) that o is written into and returned as.
    ``block_table`` [B, max_pages] integer: k_cache and v_cache are page pools instead
    (santa_cupy/paged.py), ``page_layout`` "NHD" [num_pages, page_size, KVH, D] (FlashInfer's and
    vLLM's) or "HND" [num_pages, KVH, page_size, D]; row j of sequence b is slot j % page_size of
    page block_table[b, j // page_size]. Pages may be shared, shuffled and partly filled; the
    outputs equal the contiguous call's on the gathered cache (L_max = max_pages * page_size).
    A bad table (a page id out of range, too few pages for a length) is a ValueError naming its
    first bad entry.
    ``head_offset``: the global index of q's first head, the head index of the RNG key of head 0
    (tensor parallelism: a rank holding heads h0 .. h0 + H - 1 of a model passes h0 and draws the
    samples the whole model's heads draw; 0 otherwise).
    """
    q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
    out = interop.as_out(out)
    if block_n is None:                  # 0 or False is a bad value, not "the default"
        block_n = spec.default_block_n(method, q.shape[-1] if getattr(q, "ndim", 0) == 3 else None)
    pages = None                          # (layout, page_size, table as int64 NumPy) of a paged call
    if block_table is not None:
        block_table = interop.as_array(block_table, "block_table")
        spec.check_choice("page_layout", page_layout, paged.LAYOUTS)
        num_pages, page_size, _, _ = paged.page_shape(k_cache, page_layout)
        if getattr(block_table, "ndim", 0) != 2:
            raise ValueError(f"block_table must be a 2-D integer array [B, max_pages], got {spec.describe(block_table)}")
        table = paged.validate_block_table(block_table, lengths, num_pages, page_size)   # names the bad entry
        shape = spec.validate_decode_inputs(q, k_cache, v_cache, lengths, method=method, samples=samples,
                                            sampler=sampler, budget=budget, scale=scale, block_n=block_n,
                                            page_layout=page_layout, max_length=block_table.shape[1] * page_size)
        pages = (page_layout, page_size, table)
    else:
        shape = spec.validate_decode_inputs(q, k_cache, v_cache, lengths, method=method, samples=samples,
                                            sampler=sampler, budget=budget, scale=scale, block_n=block_n)
    _check_int("seed", seed, 0, 2**64 - 1)
    _check_int("step", step, 0, 2**63 - 1)
    _check_int("layer", layer, 0, 2**31 - 1)          # the kernels take it as a C int
    _check_int("head_offset", head_offset, 0, _INT32_MAX - shape.H)
    if not (isinstance(santa_min_length, str) and santa_min_length == "auto"):   # the NumPy path too
        _check_int("santa_min_length", santa_min_length, 0, _INT32_MAX, what="'auto' or an integer")
    one_pass = method == "santa" and budget == spec.ONE_PASS
    if one_pass:
        if lse_hint is None:
            raise ValueError(f"budget {spec.ONE_PASS!r} needs lse_hint, a [B, H] = {(shape.B, shape.H)} float32 guess "
                             "of each head's log-sum-exp (e.g. info.lse of the previous step)")
        hint = interop.as_array(lse_hint, "lse_hint")
        if spec.is_cupy_array(hint) != spec.is_cupy_array(q) or getattr(hint, "shape", None) != (shape.B, shape.H):
            raise ValueError(f"lse_hint must be a [B, H] = {(shape.B, shape.H)} array of q's library, got "
                             f"{spec.describe(hint)}")
        if not bool(spec.array_module(hint).isfinite(hint).all()):    # as the reference (a plan takes NaN: exact)
            raise ValueError("lse_hint must be finite (a NaN or inf guess says nothing about the rows to read)")
    elif lse_hint is not None:
        raise ValueError(f"lse_hint is for budget {spec.ONE_PASS!r}, got budget {budget!r}")
    if not spec.is_cupy_array(q):
        if out is not None and spec.is_cupy_array(out):
            raise ValueError(f"out must be a NumPy array for NumPy inputs, got {spec.describe(out)}")
        if pages is not None:             # the reference on the gathered contiguous cache
            layout, _, table = pages
            k_cache = paged.gather_pages(k_cache, table, lengths, shape.L_max, layout)
            v_cache = paged.gather_pages(v_cache, table, lengths, shape.L_max, layout)
        if one_pass:
            result = _one_pass_reference_call(q, k_cache, v_cache, lengths, shape, samples, hint, seed, step, layer,
                                              block_n, return_info, head_offset)
        else:
            result = _reference_call(q, k_cache, v_cache, lengths, shape, method, samples, sampler, budget,
                                     seed, step, layer, block_n, return_info, head_offset)
        return result if out is None else _into_numpy_out(result, out, return_info)
    plan = DecodePlan(batch=shape.B, heads=shape.H, kv_heads=shape.KVH, head_dim=shape.D,
                      max_length=shape.L_max, dtype=shape.dtype_name, method=method, samples=samples,
                      sampler=sampler, budget=budget, seed=seed, scale=shape.scale, block_n=block_n,
                      step=step, santa_min_length=santa_min_length,
                      page_size=None if pages is None else pages[1], page_layout=page_layout,
                      head_offset=head_offset)
    import cupy
    table = None if pages is None else cupy.ascontiguousarray(block_table, dtype=cupy.int32)
    hint = cupy.ascontiguousarray(hint, dtype=cupy.float32) if one_pass else None
    o = plan.run(q, k_cache, v_cache, lengths, layer=layer, out=out, validate=False, lse_hint=hint,
                 block_table=table)
    if not (return_info or return_counts):
        return o
    info = plan.info()
    if return_counts and method == "santa" and not one_pass:
        info.counts = plan.sample_counts(q, k_cache, lengths, layer=layer, block_table=table)
    return o, info


def _into_numpy_out(result, out, return_info):
    """The NumPy path's o copied into the caller's ``out`` (checked like the GPU path's)."""
    o = result[0] if return_info else result
    if not isinstance(out, np.ndarray) or out.shape != o.shape or out.dtype != o.dtype \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous numpy array of shape {o.shape} and dtype "
                         f"{o.dtype}, got {spec.describe(out)}")
    out[...] = o
    return (out, result[1]) if return_info else out


def _check_int(name, value, lo, hi, what="an integer"):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _reference_call(q, k_cache, v_cache, lengths, shape, method, samples, sampler, budget, seed, step,
                    layer, block_n, return_info, head_offset=0):
    out_dtype = shape.dtype_name
    if method == "dense":
        o, lse = reference.dense_attention(q, k_cache, v_cache, lengths, shape.scale)
        info = AttentionInfo(lse=lse.astype(np.float32),
                             rows_read=np.repeat(np.asarray(lengths, np.int32)[:, None], shape.KVH, axis=1),
                             spread=np.zeros((shape.B, shape.H), np.float32), dense_fallback=np.ones(shape.B, bool))
    else:
        o, lse, rows_read, spread, counts = reference.santa_attention(
            q, k_cache, v_cache, lengths, samples=samples, sampler=sampler, budget=budget, seed=seed,
            step=step, layer=layer, scale=shape.scale, block_n=block_n, head_offset=head_offset)
        info = AttentionInfo(lse=lse.astype(np.float32), rows_read=rows_read,
                             spread=spread.astype(np.float32), counts=counts, dense_fallback=np.zeros(shape.B, bool))
    o = o if out_dtype == "float64" else spec.from_float32(o.astype(np.float32), out_dtype, np)
    return (o, info) if return_info else o


def _one_pass_reference_call(q, k_cache, v_cache, lengths, shape, samples, hint, seed, step, layer, block_n,
                             return_info, head_offset=0):
    from santa_cupy import one_pass

    o, op = one_pass.one_pass_attention(q, k_cache, v_cache, lengths, samples=samples,
                                        lse_hint=np.asarray(hint, np.float64), seed=seed, step=step, layer=layer,
                                        scale=shape.scale, block_n=block_n, head_offset=head_offset)
    out_dtype = shape.dtype_name
    o = o if out_dtype == "float64" else spec.from_float32(o.astype(np.float32), out_dtype, np)
    if not return_info:
        return o
    info = AttentionInfo(lse=op.lse.astype(np.float32), rows_read=op.rows_read.astype(np.int32),
                         spread=np.zeros((shape.B, shape.H), np.float32), dense_fallback=np.zeros(shape.B, bool),
                         samples_drawn=op.selected.sum(-1).astype(np.int32))
    return o, info


def _import_cupy():
    try:
        import cupy
    except ImportError:
        raise ModuleNotFoundError(
            "DecodePlan runs the CUDA kernels and needs CuPy (pip install 'santa-cupy[cuda12]' or "
            "'santa-cupy[cuda13]'); on the CPU, call santa_cupy.decode_attention with NumPy arrays") from None
    return cupy


class DecodePlan:
    """Preallocated workspaces and kernels for repeated decode-attention calls of one shape on the GPU.

    ``run`` allocates nothing, never syncs with the host and can be captured in a CUDA graph. The
    RNG step lives on the device (``plan.step``, int64 [1]); ``advance()`` adds one there, so a graph
    that ends with ``advance()`` draws fresh samples on every replay. One plan serves every layer of a
    model (``layer`` is a field of the RNG counter); outputs are overwritten by the next ``run``.
    ``head_offset``: the global index of the plan's first query head in the RNG keys (a
    tensor-parallel rank's first head; 0 otherwise), see ``decode_attention``.
    """

    def __init__(self, *, batch, heads, kv_heads, head_dim, max_length, dtype="bfloat16", method="santa",
                 samples=256, sampler="systematic", budget="global", seed=0, scale=None, block_n=None, step=0,
                 dense_kernel="auto", score_kernel="auto", tile_kernel="auto", tiles_per_warp=None,
                 dense_splits=None, santa_min_length="auto", page_size=None, page_layout="NHD", head_offset=0,
                 _dense_rows=None):
        cupy = _import_cupy()

        spec.check_choice("method", method, spec.METHODS)
        spec.check_choice("sampler", sampler, spec.SAMPLERS)
        spec.check_choice("budget", budget, spec.DECODE_BUDGETS)
        spec.check_samples(samples)
        if heads % kv_heads or not 1 <= heads // kv_heads <= spec.MAX_G:
            raise ValueError(f"heads must be a multiple of kv_heads with heads // kv_heads in 1..{spec.MAX_G}, "
                             f"got heads={heads}, kv_heads={kv_heads}")
        if head_dim not in spec.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {spec.HEAD_DIMS}, got {head_dim}")
        if dtype not in spec.GPU_DTYPES:
            raise ValueError(f"dtype must be one of {spec.GPU_DTYPES}, got {dtype!r}")
        self.B, self.H, self.KVH, self.D, self.L_max = batch, heads, kv_heads, head_dim, max_length
        _check_int("head_offset", head_offset, 0, _INT32_MAX - heads)     # the kernels' C int
        self.head_offset = int(head_offset)
        # a paged cache (santa_cupy/paged.py): run() then takes page pools and a block_table
        spec.check_choice("page_layout", page_layout, paged.LAYOUTS)
        if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer))
                                      or not 1 <= page_size <= paged.MAX_PAGE_SIZE):
            raise ValueError(f"page_size must be None (a contiguous cache) or an integer in 1..{paged.MAX_PAGE_SIZE}, "
                             f"got {page_size!r}")
        self.page_size = None if page_size is None else int(page_size)
        self.page_layout = page_layout
        self.G = heads // kv_heads
        spec.check_choice("dense_kernel", dense_kernel, kernels.DENSE_KERNELS)
        # "stream" (v2, FMA: the generic fallback) | "mma" (v4, tensor cores); "auto": v4 where it
        # has an instance (fp16/bf16, D 64/128), else v2
        self.dense_kernel = kernels.resolve_kernel_choice("dense_kernel", dense_kernel, dtype, head_dim)
        spec.check_choice("score_kernel", score_kernel, kernels.SCORE_KERNELS)
        # santa pass 1: "stream" (v2) | "mma" (v4, tensor cores); "auto" as for dense
        self.score_kernel = kernels.resolve_kernel_choice("score_kernel", score_kernel, dtype, head_dim)
        spec.check_choice("tile_kernel", tile_kernel, kernels.TILE_KERNELS)
        # santa pass 2 (fused run): "block" (a 128-thread block per tile) | "warp" (v4, one warp per
        # run of tiles: systematic sampler, G <= 8, every budget; rows staged through shared memory,
        # a light tile's rows in flight while the next tile's counts run) | "warp_mma" (staged, then
        # added on tensor cores; fp16/bf16 at D 64/128); "auto": a warp kernel where it applies
        # (not for the fixed budget on a small cache), on tensor cores where a tile is expected to
        # select many rows
        self.block_n = block_n or spec.default_block_n(method, head_dim)
        spec.check_block_n(self.block_n)
        rows = kernels.expected_rows_per_tile(heads // kv_heads, samples, self.block_n, max_length)
        kv_bytes = 2 * batch * max_length * kv_heads * head_dim * kernels.ITEMSIZE[dtype]
        # the one-pass budget: its own kernel (santa_one_pass) and santa_merge
        self.one_pass = method == "santa" and budget == spec.ONE_PASS
        if self.one_pass:
            if not kernels.one_pass_supported(sampler, heads // kv_heads, dtype, head_dim):
                raise ValueError(f"budget {spec.ONE_PASS!r} on the GPU needs sampler='systematic', heads // kv_heads "
                                 f"<= {kernels.WARP_TILE_MAX_G}, dtype in {kernels.MMA_DTYPES} and head_dim in "
                                 f"{kernels.MMA_HEAD_DIMS}, got sampler={sampler!r}, group={heads // kv_heads}, "
                                 f"dtype={dtype!r}, head_dim={head_dim}")
            if tile_kernel != "auto" or score_kernel not in ("auto", "mma"):
                raise ValueError(f"budget {spec.ONE_PASS!r} has one kernel (santa_one_pass): tile_kernel must be "
                                 f"'auto' and score_kernel 'auto' or 'mma', got tile_kernel={tile_kernel!r}, "
                                 f"score_kernel={score_kernel!r}")
            self.tile_kernel = "one_pass"
        else:
            self.tile_kernel = kernels.resolve_tile_kernel(tile_kernel, sampler, heads // kv_heads, rows, budget,
                                                           kv_bytes, self.score_kernel == "mma")
        self.dtype, self.method, self.samples = dtype, method, int(samples)
        self.sampler, self.budget, self.seed = sampler, budget, int(seed)
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        self.kernels = kernels.get_kernels(dtype, head_dim, self.G, self.block_n, method)
        self._dense_fn = {"stream": self.kernels.dense,
                          "mma": self.kernels.dense_mma}.get(self.dense_kernel)   # the split-KV kernel
        # the merge: 8 partials in flight per warp where its (H, B) grid is at most one wave of SMs
        # (latency-bound), else 4 (fewer registers, two blocks per SM)
        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._merge_fn = self.kernels.merge_wide if heads * batch <= sms else self.kernels.merge
        self.step = cupy.full((1,), int(step), dtype=cupy.int64)
        self.T_max = -(-max_length // self.block_n)
        if tiles_per_warp is not None and (isinstance(tiles_per_warp, bool) or not isinstance(tiles_per_warp, int)
                                           or tiles_per_warp < 1):
            raise ValueError(f"tiles_per_warp must be None (automatic) or an integer >= 1, got {tiles_per_warp!r}")
        if dense_splits is not None and (isinstance(dense_splits, bool) or not isinstance(dense_splits, int)
                                         or dense_splits < 1):
            raise ValueError(f"dense_splits must be None (automatic) or an integer >= 1, got {dense_splits!r}")
        self._forced_dense_splits = dense_splits
        self._dense_rows = _dense_rows or max_length        # the longest sequence the dense kernel takes
        # Tiles per warp of the v4 score pass and the warp pass 2 (one warp per run of tiles):
        # None = fitted to the occupancy (kernels.tiles_per_warp), an int forces it for both.
        self.score_tpw = self.tile_tpw = 1
        # a score pass (stash + tile stats) and the prefix first: every santa plan but the fixed
        # budget on the block kernel, which scores its tiles itself
        self._warp = method == "santa" and self.tile_kernel in ("warp", "warp_mma")
        two_pass = self.two_pass = method == "santa" and (budget != "fixed" or self._warp) and not self.one_pass
        # (kernel, dynamic shared memory) of the one-warp-per-run kernels, resolved once: the v4
        # score pass (static shared memory only) and the warp pass 2 (its gather)
        self._score_warp_kernel = (self.kernels.score_mma, 0)
        # santa_tile_warp's two finishes (kFinish: o written by its last block, or run partials):
        # finishing in the kernel (atomics, last block) measured faster for few KV groups (B=1: 11.5
        # vs 7.4 + 5.9 us with santa_merge), slower for many (B=16 32k: 86 vs 69 + 9 us), so above
        # kernels.FINISH_MAX_GROUPS the runs write partials and santa_merge follows.
        self.finish_in_kernel = self._warp and batch * kv_heads <= kernels.FINISH_MAX_GROUPS
        self._warp_kernels = ({finish: getattr(self.kernels, "tile_" + self.tile_kernel + ("_finish" if finish else ""))
                               for finish in (False, True)} if self._warp else None)
        self._warp_kernel = self._warp_kernels[self.finish_in_kernel] if self._warp else None
        self._warp_smem = kernels.tile_warp_smem_bytes(self.block_n, self.G, head_dim,
                                                       mma=self.tile_kernel == "warp_mma")
        # how santa_merge combines the fused run's partials
        if self.one_pass:                    # run partials relative to their max, like dense splits
            self._merge_kind = kernels.MERGE_DENSE
        elif budget != "fixed":
            self._merge_kind = kernels.MERGE_SUM
        else:
            self._merge_kind = kernels.MERGE_WEIGHTED if self._warp else kernels.MERGE_FIXED
        self.dense_merges_itself = False
        if method == "dense":
            self.part_rows, self.P_max, self.split_target, self.dense_pairs = self._dense_splits()
            # v4 dense merges in its own last block per KV group (one launch) where a group has few
            # splits; a counter per (b, KV head), zero between launches
            self.dense_merges_itself = (self.dense_kernel == "mma"
                                        and self.P_max <= kernels.DENSE_SELF_MERGE_MAX_SPLITS)
        else:
            self.P_max = self.T_max
            if self.score_kernel == "mma" and two_pass:
                self.score_tpw = tiles_per_warp or self._tiles_per_warp(*self._score_warp_kernel)
            if self._warp:
                self.tile_tpw = tiles_per_warp or self._tiles_per_warp(self._warp_kernel, self._warp_smem)
            if self.one_pass:
                self._one_pass_smem = kernels.one_pass_smem_bytes(self.block_n, self.G, head_dim, dtype)
                self.one_tpw = tiles_per_warp or self._tiles_per_warp(self.kernels.one_pass, self._one_pass_smem)
        self.merge_counters = cupy.zeros((batch * kv_heads if self.dense_merges_itself else 1,), cupy.uint32)
        # tiles summed per partial: the warp pass 2 writes one per run, the block kernel one per tile
        self.merge_stride = self.tile_tpw if self._warp else 1
        B, H, P, D = batch, heads, self.P_max, head_dim
        self.part_o = cupy.empty((B, H, P, D), cupy.float32)
        self.part_s = cupy.empty((B, H, P, 4), cupy.float32)
        self.scores = cupy.empty((B, H, max_length) if two_pass else (1,), cupy.float32)
        self.cdf = cupy.empty((B, H, self.T_max) if two_pass else (1,), cupy.float64)
        self.alloc = cupy.empty((B, H, self.T_max) if budget == "largest_remainder" else (1,), cupy.int32)
        if not self.one_pass:                # one_pass: a view of its counters (below)
            self.rows_read = cupy.zeros((B, kv_heads), cupy.int32)
        # The warp pipeline (score pass, prefix, warp pass 2): santa_tile_warp's last block per
        # (b, KV head) writes o from the accumulators acc [ACC_COPIES, B*H*D + B*H] (its blocks add
        # into copy blockIdx.x % ACC_COPIES: fewer atomics on each address) and zeroes them; its
        # arrival counters go back to 0. No call fills anything (santa_prefix zeroes rows_read).
        if self._warp:
            self.arrive = cupy.zeros((batch * kv_heads,), cupy.uint32)
            self.acc = cupy.zeros((kernels.ACC_COPIES, B * H * (D + 1)), cupy.float32)
        self.out = cupy.empty((B, H, D), STORAGE_DTYPE[dtype])
        # one_pass: the default lse_hint is the plan's previous lse (NaN before the first call: every
        # row taken, the exact output)
        self.lse = cupy.full((B, H), np.nan, cupy.float32) if self.one_pass else cupy.empty((B, H), cupy.float32)
        # drawn [B, H]: rows each head took (one_pass: counted by the kernel, beside rows_read in one
        # buffer, so one fill clears both; the other budgets: S, a constant)
        if self.one_pass:
            self._one_pass_counts = cupy.zeros((B * kv_heads + B * H,), cupy.int32)
            self.rows_read = self._one_pass_counts[:B * kv_heads].reshape(B, kv_heads)
            self.drawn = self._one_pass_counts[B * kv_heads:].reshape(B, H)
        else:
            self.drawn = cupy.full((B, H), self.samples, cupy.int32) if method == "santa" else None
        self.spread = cupy.empty((B, H), cupy.float32)
        self._lengths = None         # int32 copy of lengths when the caller's are not int32
        self._last_lengths = None
        self._no_counts = cupy.zeros((1,), cupy.int32)
        self._no_table = cupy.zeros((1,), cupy.int32)      # a contiguous plan's block_table argument
        # Never slower than exact: sequences shorter than santa_from run the dense kernel (a dense
        # sub-plan sharing this plan's outputs), the santa kernels skip them; a dense plan's
        # kernel takes every sequence.
        self.santa_from = _INT32_MAX if method == "dense" else self._santa_from(santa_min_length)
        self._dense_plan = None
        if method == "santa" and self.santa_from > 1:
            self._dense_plan = DecodePlan(
                batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_length=max_length, dtype=dtype,
                method="dense", scale=self.scale, _dense_rows=min(max_length, self.santa_from - 1))
            self._dense_plan.santa_from = self.santa_from
            self._dense_plan.out, self._dense_plan.lse = self.out, self.lse
            self._dense_plan.spread, self._dense_plan.rows_read = self.spread, self.rows_read

    def _santa_from(self, santa_min_length):
        """The length from which a sequence runs santa (shorter ones run dense): "auto" derives it
        from the shape and the device (kernels.santa_min_length), an integer >= 0 sets it (0 or 1:
        santa for every sequence, e.g. to study the estimator at short lengths). Only the two-launch
        pipeline (warp pass 2) mixes the two per sequence; other santa plans run santa throughout."""
        if santa_min_length == "auto":
            if not self._warp:
                return 0
            import cupy
            return kernels.santa_min_length(self.B, self.KVH, self.D, kernels.ITEMSIZE[self.dtype],
                                            kernels.device_bandwidth(cupy.cuda.Device().attributes))
        if isinstance(santa_min_length, bool) or not isinstance(santa_min_length, (int, np.integer)) \
                or santa_min_length < 0:
            raise ValueError(f"santa_min_length must be 'auto' or an integer >= 0, got {santa_min_length!r}")
        if santa_min_length > 1 and self.one_pass:
            raise ValueError(f"santa_min_length={santa_min_length}: budget {spec.ONE_PASS!r} has no dense fallback "
                             "(use 'auto', 0 or 1)")
        if santa_min_length > 1 and not self._warp:
            raise ValueError(f"santa_min_length={santa_min_length} needs the two-launch santa pipeline (systematic "
                             f"sampler, heads // kv_heads <= {kernels.WARP_TILE_MAX_G}, fp16/bf16 at head_dim 64/128), "
                             f"got tile_kernel={self.tile_kernel!r}")
        return int(santa_min_length)

    def _tiles_per_warp(self, kernel, smem):
        """kernels.tiles_per_warp for a one-warp-per-tile-run kernel at this plan's grid."""
        import cupy

        attrs = cupy.cuda.Device().attributes
        slots = kernels.resident_blocks(kernel, kernels.THREADS, smem, attrs) * attrs["MultiProcessorCount"]
        return kernels.tiles_per_warp(self.T_max, self.B * self.KVH, slots)

    def _dense_splits(self):
        """(part_rows, P_max, split_target, pairs) of the dense kernel.

        A batch of equal lengths (the longest the kernel handles: L_max, or a santa plan's dense
        fallback's) takes ``splits`` splits of ``part_rows`` rows a sequence: whole waves of resident
        blocks over B * KVH * splits, splits of >= 256 rows (kernels.wave_fitted_parts), or
        DecodePlan(dense_splits=N); rows a multiple of 16, so at most that many splits. The kernel
        balances other lengths on the device (cuda/common.cuh dense_split): split_target = B *
        splits blocks a KV head shared in proportion to the lengths, at most P_max splits a
        sequence (the workspaces' count: up to the self-merge's cap when the split is automatic,
        ``splits`` when forced); the grid has ``pairs`` blocks a KV head, enough for any lengths."""
        longest = self._dense_rows
        splits = self._forced_dense_splits or self._wave_fitted_dense_splits()
        if longest < self.L_max:             # a santa plan's fallback: it must merge in its last block
            splits = min(splits, kernels.DENSE_SELF_MERGE_MAX_SPLITS)
        rows = -(-longest // splits)
        rows = -(-rows // 16) * 16           # whole 16-row steps (the mma kernel's step per warp)
        splits = -(-longest // rows)
        target = self.B * splits
        P_max = splits if self._forced_dense_splits else min(
            target, max(splits, kernels.DENSE_SELF_MERGE_MAX_SPLITS), -(-longest // 16))
        return rows, P_max, target, min(target + self.B, self.B * P_max)

    def _wave_fitted_dense_splits(self):
        import cupy

        attrs = cupy.cuda.Device().attributes
        smem = kernels.dense_smem_bytes(self.dtype, self.D, self.G, self.dense_kernel)
        slots = kernels.resident_blocks(self._dense_fn, kernels.THREADS, smem, attrs) * attrs["MultiProcessorCount"]
        return kernels.wave_fitted_parts(self.B * self.KVH, max(1, -(-self._dense_rows // 256)), slots)

    # ---- launches ---------------------------------------------------------------------------
    @interop.accepts_stream
    def run(self, q, k_cache, v_cache, lengths, *, layer=0, out=None, validate=True, lse_hint=None,
            block_table=None):
        """o [B, H, D] for this step (written into ``out`` or the plan's own buffer).

        A plan with ``page_size`` takes page pools k_cache, v_cache ([num_pages, page_size, KVH, D]
        for page_layout "NHD", [num_pages, KVH, page_size, D] for "HND") and ``block_table``
        [B, max_pages] int32 (C-contiguous, on the device): row j of sequence b is slot
        j % page_size of page block_table[b, j // page_size]; lengths <= max_length. ``validate``
        checks the table too (a host sync: page ids in range, enough pages for each length; a
        ValueError names block_table and the first bad entry); without it a bad table reads
        wrong memory.

        A sequence of length 0 gets o = 0, lse = -inf, spread = 0, rows_read = 0 on every route; NaN
        or inf in q or K makes that sequence's heads (of the KV group) NaN.
        lse_hint (budget "one_pass" only): the normaliser guess r [B, H] float32 (a CuPy array), any
        deterministic function of the inputs (e.g. this layer's lse at the previous step,
        ``info().lse``); None: the plan's own lse of its previous call (NaN before the first: the
        exact output). About ``samples * exp(lse - r)`` rows are read per head."""
        q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
        pages = self._page_args(block_table, k_cache)
        if validate:
            self._validate(q, k_cache, v_cache, lengths, block_table)
        lengths = self._int32_lengths(lengths)
        self._last_lengths = lengths
        out = self._output(out)
        if self.method == "dense":
            self._dense(q, k_cache, v_cache, lengths, out, pages)
            if not self.dense_merges_itself:
                self._merge(lengths, out, kernels.MERGE_DENSE, self.part_rows, split_target=self.split_target)
            return out
        if self.one_pass:
            self._one_pass(q, k_cache, v_cache, lengths, layer, self._lse_hint(lse_hint), pages)
            self._merge(lengths, out, kernels.MERGE_DENSE, self.one_tpw * self.block_n)
            return out
        if lse_hint is not None:
            raise ValueError(f"lse_hint is for budget {spec.ONE_PASS!r}, this plan's is {self.budget!r}")
        if self._warp:                       # score, prefix, then sample + gather + finish
            if self._dense_plan is not None:   # the short sequences (all of them when L_max < santa_from)
                self._dense_plan._dense(q, k_cache, v_cache, lengths, out, pages)
                if self.santa_from > self.L_max:
                    return out
            self._score_and_prefix(q, k_cache, lengths, pages, santa_from=self.santa_from)
            self._tile_warp(v_cache, lengths, layer, out, pages)
            if not self.finish_in_kernel:
                self._merge(lengths, out, self._merge_kind, self.block_n, self.merge_stride)
            return out
        self.rows_read.fill(0)
        if self.two_pass:
            self._score_and_prefix(q, k_cache, lengths, pages)
        self._tile(q, k_cache, v_cache, lengths, layer, "fused", self._no_counts, pages)
        self._merge(lengths, out, self._merge_kind, self.block_n, self.merge_stride)
        return out

    def _validate(self, q, k_cache, v_cache, lengths, block_table):
        """The inputs' shapes and dtypes against the plan's (no data read), and a paged plan's block
        table (a host sync)."""
        layout = self.page_layout if self.page_size is not None else None
        shape = spec.validate_decode_inputs(q, k_cache, v_cache, lengths, method=self.method,
                                            samples=self.samples, sampler=self.sampler, budget=self.budget,
                                            scale=self.scale, block_n=self.block_n, check_lengths=False,
                                            check_finite=False, page_layout=layout, max_length=self.L_max)
        got = (shape.B, shape.H, shape.KVH, shape.D, shape.L_max, shape.dtype_name)
        want = (self.B, self.H, self.KVH, self.D, self.L_max, self.dtype)
        if got != want:
            raise ValueError(f"inputs (B, H, KVH, D, L_max, dtype)={got} do not match the plan's {want}")
        if layout is not None:
            num_pages, page_size, _, _ = paged.page_shape(k_cache, layout)
            if page_size != self.page_size:
                raise ValueError(f"k_cache pages hold {page_size} rows, the plan's page_size is {self.page_size}")
            paged.validate_block_table(block_table, lengths, num_pages, page_size, self.L_max)

    def _page_args(self, block_table, k_cache):
        """The kernels' last four arguments (block_table, page_size, table_stride, page_hnd); page_size
        0 and a placeholder table for a contiguous plan."""
        import cupy

        if self.page_size is None:
            if block_table is not None:
                raise ValueError("block_table is for a plan made with page_size (a paged cache); this plan's cache "
                                 "is contiguous [B, L_max, KVH, D]")
            return (self._no_table, kernels.i32(0), kernels.i32(0), kernels.i32(0))
        block_table = interop.as_array(block_table, "block_table")
        if not isinstance(block_table, cupy.ndarray) or block_table.dtype != cupy.int32 or block_table.ndim != 2 \
                or block_table.shape[0] != self.B or not block_table.flags.c_contiguous:
            raise ValueError(f"block_table must be a C-contiguous cupy int32 array [B={self.B}, max_pages] (this plan "
                             f"has page_size {self.page_size}), got {spec.describe(block_table)}")
        return (block_table, kernels.i32(self.page_size), kernels.i32(block_table.shape[1]),
                kernels.i32(self.page_layout == "HND"))

    def stage_launchers(self, q, k_cache, v_cache, lengths, *, layer=0, block_table=None):
        """{stage name: zero-argument callable launching just that stage} in pipeline order, for
        timing stages one by one (bench stages). Each reads what the previous stages of the last
        full ``run`` left in the workspaces, so call ``run`` once first."""
        q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
        pages = self._page_args(block_table, k_cache)
        lengths = self._int32_lengths(lengths)
        if self.method == "dense":
            split = lambda: self._dense(q, k_cache, v_cache, lengths, self.out, pages)   # noqa: E731
            if self.dense_merges_itself:
                return {f"dense split-KV + merge ({self.dense_kernel})": split}
            return {f"dense split-KV ({self.dense_kernel})": split,
                    "merge": lambda: self._merge(lengths, self.out, kernels.MERGE_DENSE, self.part_rows,
                                                 split_target=self.split_target)}
        stages = {}
        if self.one_pass:
            stages["one pass (score + sample + gather)"] = lambda: self._one_pass(q, k_cache, v_cache, lengths, layer,
                                                                                self.lse, pages)
            stages["merge"] = lambda: self._merge(lengths, self.out, kernels.MERGE_DENSE, self.one_tpw * self.block_n)
            return stages
        if self._warp:
            if self._dense_plan is not None:
                stages["dense (sequences shorter than santa_from)"] = lambda: self._dense_plan._dense(
                    q, k_cache, v_cache, lengths, self.out, pages)
                if self.santa_from > self.L_max:
                    return stages
            stages["score"] = lambda: self._score(q, k_cache, lengths, pages, self.santa_from)
            stages["prefix"] = lambda: self._prefix(lengths, santa_from=self.santa_from)
            if self.finish_in_kernel:
                stages["sample + gather + finish (warp)"] = lambda: self._tile_warp(v_cache, lengths, layer, self.out,
                                                                                    pages)
            else:
                stages["sample + gather (warp)"] = lambda: self._tile_warp(v_cache, lengths, layer, self.out, pages)
                stages["merge"] = lambda: self._merge(lengths, self.out, self._merge_kind, self.block_n,
                                                      self.merge_stride)
            return stages
        if self.two_pass:
            stages["score + prefix"] = lambda: self._score_and_prefix(q, k_cache, lengths, pages)
        stages[f"tile (sample + gather, {self.tile_kernel})"] = lambda: self._tile(
            q, k_cache, v_cache, lengths, layer, "fused", self._no_counts, pages)
        stages["merge"] = lambda: self._merge(lengths, self.out, self._merge_kind, self.block_n, self.merge_stride)
        return stages

    def _output(self, out):
        """The plan's own output buffer, or a caller's after checking it can take o [B, H, D]."""
        if out is None:
            return self.out
        out = interop.as_out(out)            # torch / JAX GPU arrays: a zero-copy CuPy view
        if not spec.is_cupy_array(out) or out.shape != self.out.shape or out.dtype != self.out.dtype \
                or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous cupy array of shape {self.out.shape} and dtype "
                             f"{self.out.dtype}, got {spec.describe(out)}")
        return out

    def _no_counts_for_one_pass(self, what):
        if self.one_pass:
            raise ValueError(f"{what} is for the budgets with sample counts, not {spec.ONE_PASS!r}")

    @interop.accepts_stream
    def run_from_counts(self, q, k_cache, v_cache, lengths, counts, *, out=None, block_table=None):
        """The gather-add and merge stages alone: o from given sample counts [B, H, L_max] int32.

        For the global / largest_remainder budgets o = (1/S) sum_j c_j V_j; for fixed the tile-weighted
        form with S_t = max(1, S // T). Counts past a sequence's length are ignored.
        """
        import cupy

        self._no_counts_for_one_pass("run_from_counts")
        q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
        pages = self._page_args(block_table, k_cache)
        if not isinstance(counts, cupy.ndarray) or counts.dtype != cupy.int32 or \
                counts.shape != (self.B, self.H, self.L_max) or not counts.flags.c_contiguous:
            raise ValueError(f"counts must be a C-contiguous cupy int32 array of shape "
                             f"{(self.B, self.H, self.L_max)}, got {type(counts).__name__} "
                             f"{getattr(counts, 'dtype', '?')} {getattr(counts, 'shape', '?')}")
        lengths = self._int32_lengths(lengths)
        self._last_lengths = lengths
        out = self._output(out)
        self.rows_read.fill(0)
        if self.two_pass:
            self._score_and_prefix(q, k_cache, lengths, pages)
        self._tile(q, k_cache, v_cache, lengths, 0, "gather", counts, pages)
        self._merge(lengths, out, kernels.MERGE_FIXED if self.budget == "fixed" else kernels.MERGE_SUM,
                    self.block_n)
        return out

    def _dense(self, q, k_cache, v_cache, lengths, out, pages):
        """The split-KV kernel; v4 also merges (its last block per KV group), given the counters.
        pages: _page_args."""
        i32, i64, f32 = kernels.i32, kernels.i64, kernels.f32
        args = (q, k_cache, v_cache, lengths, f32(self.scale), i32(self.split_target), i32(self.B), i32(self.H),
                i32(self.KVH), i64(self.L_max), self.part_o, self.part_s, i32(self.P_max))
        if self.dense_kernel == "mma":
            args += (i32(self.dense_merges_itself), self.merge_counters, out, self.lse, self.spread,
                     i32(self.santa_from), self.rows_read)
        kernels.launch(self._dense_fn, (self.KVH, self.dense_pairs), args + pages,
                       kernels.dense_smem_bytes(self.dtype, self.D, self.G, self.dense_kernel))

    def _score_and_prefix(self, q, k_cache, lengths, pages, rows_read=None, santa_from=0):
        """The score pass (stash and tile stats), then santa_prefix (the comb's cdf, lse, rows_read
        zeroed; the Hamilton allocation for the largest remainder budget). santa_from: the warp
        pipeline's dense fallback (shorter sequences skipped); rows_read: a scratch buffer for the
        standalone stages, so as not to clear the last run's."""
        self._score(q, k_cache, lengths, pages, santa_from)
        self._prefix(lengths, rows_read, santa_from)

    def _score(self, q, k_cache, lengths, pages, santa_from=0):
        i32, i64, f32 = kernels.i32, kernels.i64, kernels.f32
        common = (q, k_cache, lengths, f32(self.scale), i32(self.H), i32(self.KVH), i64(self.L_max), i32(self.T_max))
        if self.score_kernel == "stream":
            kernels.launch(self.kernels.score, (self.T_max, self.KVH, self.B), (*common, self.scores, self.part_s, *pages))
        else:                                            # mma: one warp per run of score_tpw tiles
            kernel, smem = self._score_warp_kernel
            kernels.launch(kernel, (self.KVH, self._run_blocks(self.score_tpw)),
                           (*common, i32(self.score_tpw), i32(self.B), self.scores, self.part_s, i32(santa_from),
                            *pages), smem)

    def _prefix(self, lengths, rows_read=None, santa_from=0):
        i32, i64 = kernels.i32, kernels.i64
        kernels.launch(self.kernels.prefix, (self.H, self.B),
                       (self.part_s, lengths, i64(self.L_max), i32(self.H), i32(self.block_n), i32(self.T_max),
                        i32(self.samples), i32(self.budget == "largest_remainder"), self.cdf, self.alloc, self.lse,
                        self.rows_read if rows_read is None else rows_read, i32(self.G), i32(santa_from)),
                       threads=kernels.PREFIX_THREADS)

    def _tile_warp(self, v_cache, lengths, layer, out, pages):
        """santa_tile_warp: one warp per run of tile_tpw tiles samples and gathers; with
        finish_in_kernel the last block of each (b, KV head) writes o and spread, else the runs'
        partials are santa_merge's."""
        i32, i64, u64 = kernels.i32, kernels.i64, kernels.u64
        kernels.launch(self._warp_kernels[self.finish_in_kernel], (self.KVH, self._run_blocks(self.tile_tpw)),
                       (v_cache, lengths, i32(self.H), i32(self.KVH), i64(self.L_max), i32(self.T_max),
                        i32(self.tile_tpw), i32(self.B), i32(kernels.BUDGET_CODE[self.budget]), i32(self.samples),
                        u64(self.seed), self.step, i32(layer), i32(self.head_offset), self.scores, self.cdf,
                        self.alloc, self.part_s, self.part_o, self.acc, self.arrive,
                        self.rows_read, out, self.lse, self.spread,
                        i32(self.santa_from), *pages), self._warp_smem)

    def _lse_hint(self, lse_hint):
        import cupy

        if lse_hint is None:
            return self.lse
        if not isinstance(lse_hint, cupy.ndarray) or lse_hint.dtype != cupy.float32 or \
                lse_hint.shape != (self.B, self.H) or not lse_hint.flags.c_contiguous:
            raise ValueError(f"lse_hint must be a C-contiguous cupy float32 array of shape {(self.B, self.H)}, "
                             f"got {spec.describe(lse_hint)}")
        return lse_hint

    def _one_pass(self, q, k_cache, v_cache, lengths, layer, hint, pages):
        """santa_one_pass: score, take rows by the hint's inclusion probabilities, gather; one
        partial per run of one_tpw tiles (santa_merge follows)."""
        i32, i64, u64, f32 = kernels.i32, kernels.i64, kernels.u64, kernels.f32
        self._one_pass_counts.fill(0)                    # rows_read and drawn
        kernels.launch(self.kernels.one_pass, (self._warp_blocks(self.one_tpw), self.KVH, self.B),
                       (q, k_cache, v_cache, lengths, f32(self.scale), i32(self.H), i32(self.KVH), i64(self.L_max),
                        i32(self.T_max), i32(self.one_tpw), i32(self.samples), u64(self.seed), self.step, i32(layer),
                        i32(self.head_offset), hint, self.part_o, self.part_s, i32(self.P_max), self.rows_read,
                        self.drawn, *pages),
                       self._one_pass_smem)

    def _tile(self, q, k_cache, v_cache, lengths, layer, mode, counts, pages):
        K, i32, i64, u64, f32 = self.kernels, kernels.i32, kernels.i64, kernels.u64, kernels.f32
        rows_read = self.rows_read
        kernels.launch(K.tile, (self.T_max, self.KVH, self.B),
                       (q, k_cache, v_cache, lengths, f32(self.scale), i32(self.H), i32(self.KVH),
                        i64(self.L_max), i32(self.T_max), i32(kernels.BUDGET_CODE[self.budget]),
                        i32(kernels.SAMPLER_CODE[self.sampler]), i32(self.samples),
                        i32(kernels.MODE_CODE[mode]), i32(not self.two_pass), u64(self.seed), self.step, i32(layer),
                        i32(self.head_offset), self.scores,
                        self.cdf, self.alloc, self.part_s, self.part_o, counts, rows_read, *pages),
                       kernels.tile_smem_bytes(self.dtype, self.D, self.block_n, self.G))

    def _warp_blocks(self, tpw):
        """Blocks (of THREADS // 32 warps) over the runs of tpw tiles of one (sequence, KV head)."""
        return -(-(-(-self.T_max // tpw)) // (kernels.THREADS // 32))

    def _run_blocks(self, tpw):
        """Grid x of santa_score_mma and santa_tile_warp: blocks of the batch's runs a KV head, whose
        run length the kernels fit to the lengths (cuda/common.cuh run_block; tpw = the plan's for
        full sequences): at most ceil(B * T_max / (4 tpw)) + B, the grid's y (at most 65535)."""
        blocks = -(-self.B * self.T_max // (kernels.THREADS // 32 * tpw)) + self.B
        if blocks > MAX_GRID_Y:
            raise ValueError(f"batch {self.B} x {self.T_max} tiles in runs of {tpw} need {blocks} blocks a KV head, "
                             f"more than a grid's {MAX_GRID_Y}: use a larger tiles_per_warp or block_n")
        return blocks

    def _merge(self, lengths, out, kind, part_rows, o_stride=1, split_target=0):
        """o_stride: tiles summed per partial (the warp pass 2 writes one per run of tiles);
        split_target > 0: a dense plan's splits (part_rows per sequence from the lengths, as the
        dense kernel split them)."""
        i32 = kernels.i32
        kernels.launch(self._merge_fn, (self.H, self.B),
                       (self.part_o, self.part_s, lengths, kernels.i64(self.L_max), i32(self.H), i32(part_rows),
                        i32(split_target), i32(self.P_max), i32(o_stride), i32(kind), i32(self.samples), out, self.lse, self.spread,
                        i32(self.santa_from if self.method == "santa" else 0)), threads=kernels.MERGE_THREADS)

    def _int32_lengths(self, lengths):
        import cupy

        if lengths.dtype == cupy.int32:
            return lengths
        if self._lengths is None:
            self._lengths = cupy.empty((self.B,), cupy.int32)
        self._lengths[...] = lengths        # a device-side cast, no host sync
        return self._lengths

    @interop.accepts_stream
    def advance(self, n=1):
        """Advance the device step counter (capturable: a graph ending with this draws new samples)."""
        for _ in range(n):
            kernels.launch(self.kernels.advance, (1,), (self.step,), threads=1)

    def info(self) -> AttentionInfo:
        """Diagnostics of the last run (views of the plan's buffers)."""
        if self.method == "dense":
            import cupy
            rows = cupy.broadcast_to(self._last_lengths[:, None], (self.B, self.KVH))
            return AttentionInfo(lse=self.lse, rows_read=rows, spread=self.spread,
                                 dense_fallback=cupy.ones((self.B,), bool))
        return AttentionInfo(lse=self.lse, rows_read=self.rows_read, spread=self.spread,
                             dense_fallback=self._last_lengths < self.santa_from, samples_drawn=self.drawn)

    @interop.accepts_stream
    def sample_counts(self, q, k_cache, lengths, *, layer=0, block_table=None):
        """Counts [B, H, L_max] int32 from the standalone sample stage (rows past a length are 0).

        Re-runs the score stage, so the stash and stats match the last ``run`` for the same inputs.
        """
        import cupy

        self._no_counts_for_one_pass("sample_counts")
        q, k_cache, lengths = interop.as_arrays(q, k_cache, lengths, names=("q", "k_cache", "lengths"))
        pages = self._page_args(block_table, k_cache)
        lengths = self._int32_lengths(lengths)
        counts = cupy.zeros((self.B, self.H, self.L_max), cupy.int32)
        if self.two_pass:                  # the stash the fused run samples from
            self._score_and_prefix(q, k_cache, lengths, pages, rows_read=cupy.zeros(self.rows_read.shape, cupy.int32))
        self._tile(q, k_cache, k_cache, lengths, layer, "sample", counts, pages)
        return counts

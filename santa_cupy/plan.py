"""``DecodePlan``: preallocated workspaces and kernels for repeated decode-attention calls on the GPU.

GPU pipeline per call (all on the current stream, no host sync, graph-capturable):
  dense:  decode_dense_mma (split-KV; with <= 32 splits a KV group its last block merges, else
          -> santa_merge), or decode_dense_partial (split-KV, fp32 / D 256) -> santa_merge;
          on a blocked K (key_layout="blocked", no key sampling) decode_dense_mma_blocked, the
          same kernel addressing K feature-blocked (fp16 / bf16 at D 64 / 128)
  santa, warp pipeline (systematic sampler, G <= 8, fp16/bf16 at D 64/128; every budget; the default):
        santa_score_mma (stash + tile stats) -> santa_prefix (cdf, lse) -> santa_tile_warp
        (sample + gather; the last block per (sequence, KV head) writes o: no merge launch)
        [-> decode_dense_mma for the sequences shorter than santa_from: the dense fallback, last,
        so that under programmatic launch it learns whether it has any while pass 2 runs];
        where the stash fits in half the L2 (stash_in_l2) the score pass reads K evict-first and
        santa_tile_warp drops the stash once read, so ``scores`` is undefined after such a run
  santa, block pass 2 (other samplers, G > 8, fp32, D 256):
        global / largest_remainder: santa_score -> santa_prefix -> santa_tile -> santa_merge
        fixed: santa_tile (score + sample + gather fused, one pass) -> santa_merge
  santa, budget one_pass: santa_one_pass (score + sample + gather) -> santa_merge
  santa with block key sampling (key_layout="blocked", santa_cupy/key_pass.py): santa_key_blocks
        (pi, draws, weights per KV group) -> santa_score_keys_mma (the stash and tile stats from
        the selected K blocks only, tensor cores) -> the warp pipeline's santa_prefix ->
        santa_tile_warp where it applies, else the block pass 2 -> santa_merge; with
        score_kernel "stream" santa_score_keys (FMA) and the block pass 2.
  santa below its crossover (max_length < santa_from, ``exact_throughout``): the dense plan of its
        shape alone (key sampling: decode_dense_mma_blocked). Only the warp pipeline without key
        sampling mixes santa and dense per sequence; the other santa plans run one or the other.

Which kernels: santa_cupy/kernel_choice.py (derived from the shape, the setting and the device;
overridden by bench and tests through the internal ``_kernels`` argument). The launches:
santa_cupy/_launches.py.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from santa_cupy import interop, kernel_choice, kernels, key_pass, paged, spec
from santa_cupy._launches import _PlanLaunches
from santa_cupy._plan_sizing import _PlanSizing
from santa_cupy.info import AttentionInfo
from santa_cupy.kernel_choice import KernelChoice, resolve
from santa_cupy.setting import AttentionSetting

STORAGE_DTYPE = {name: dtype for dtype, name in spec.DTYPE_NAMES.items()}   # "bfloat16" -> uint16
_INT32_MAX = 2**31 - 1


def _import_cupy():
    try:
        import cupy
    except ImportError:
        raise ModuleNotFoundError(
            "DecodePlan runs the CUDA kernels and needs CuPy (pip install 'santa-cupy[cuda12]' or "
            "'santa-cupy[cuda13]'); on the CPU, call santa_cupy.decode_attention with NumPy arrays") from None
    return cupy


class DecodePlan(_PlanLaunches, _PlanSizing):
    """Preallocated workspaces and kernels for repeated decode-attention calls of one shape on the GPU.

    ``run`` allocates nothing, never syncs with the host and can be captured in a CUDA graph. The
    RNG step lives on the device (``plan.step``, int64 [1]); ``advance()`` adds one there, so a graph
    that ends with ``advance()`` draws fresh samples on every replay. One plan serves every layer of a
    model (``layer`` is a field of the RNG counter); outputs are overwritten by the next ``run``.

    Parameters
    ----------
    batch, heads, kv_heads, head_dim, max_length : int
        B, H, KVH, D and L_max: q is [B, H, D], the caches [B, L_max, KVH, D]; H a multiple of KVH
        with G = H // KVH in 1..16, D in (64, 128, 256).
    dtype : str
        "float16" | "bfloat16" (uint16 bit patterns) | "float32": q, k, v and o.
    setting : AttentionSetting or str or None
        The estimator (santa_cupy.AttentionSetting or its name, e.g. "systematic/global/S=256");
        None: ``AttentionSetting()``.
    scale : float or None
        Score scale; None: 1 / sqrt(D).
    step : int
        Initial value of the device step counter (an RNG key besides seed and layer).
    page_size : int or None
        None: contiguous caches. An int in 1..``paged.MAX_PAGE_SIZE``: ``run`` takes page pools
        and a block table (santa_cupy/paged.py), pages of ``page_layout`` "NHD" | "HND".
    head_offset : int
        The global index of the plan's first query head in the RNG keys (a tensor-parallel rank's
        first head; 0 otherwise), see ``decode_attention``.
    key_layout : str
        "standard": k_cache [B, L_max, KVH, D]; "blocked": [B, KVH, NP, C, P, FB]
        (santa_cupy.key_layout.to_blocked, FB = the setting's key_block, 16 | 32), the layout of
        block key sampling (key_sampling "bernoulli_block", santa_cupy/key_pass.py: method santa,
        rules uniform | qmax | qrms, fp16 / bf16 at head_dim 64 / 128, contiguous caches), which
        then reads only the K blocks its draws select; without key sampling, method "dense" reads
        it (exact attention, fp16 / bf16 at head_dim 64 / 128, contiguous caches:
        ``DecodePlan(..., method="dense", key_layout="blocked", key_block=32)``). V keeps the
        standard layout.
    **setting_fields
        method, samples, sampler, budget, seed, block_n, santa_min_length: change those fields of
        ``setting`` (``DecodePlan(..., samples=64)``).

    Attributes
    ----------
    out : [B, H, D] of dtype; lse, spread : [B, H] float32; rows_read : [B, KVH] int32
        The last run's outputs (``info()`` gathers them); step : [1] int64, the device step.
    key_pass : santa_cupy.key_pass.KeyScorePass or None
        With key sampling: its workspaces (key_weight, key_pi [B, KVH, C] float32, blocks_read
        [B, KVH] int32: the K blocks of each row the last run read).
    setting : AttentionSetting
        The plan's estimator; also method, samples, sampler, budget, seed, block_n, santa_from.

    Kernel selection is internal (santa_cupy/kernel_choice.py): the plan derives it from the
    shape, the setting and the device; ``_kernels=KernelChoice(...)`` forces it (bench, tests).
    """

    def __init__(self, *, batch, heads, kv_heads, head_dim, max_length, dtype="bfloat16", setting=None, scale=None,
                 step=0, page_size=None, page_layout="NHD", head_offset=0, key_layout="standard", _kernels=None,
                 _dense_rows=None, **setting_fields):
        cupy = _import_cupy()
        if isinstance(head_offset, bool) or not isinstance(head_offset, (int, np.integer)) \
                or not 0 <= head_offset <= 2**31 - 1 - heads:                      # the kernels' C int
            raise ValueError(f"head_offset must be an integer in [0, 2**31 - 1 - heads], got {head_offset!r}")
        self.head_offset = int(head_offset)

        setting = AttentionSetting.from_fields(setting, **setting_fields)
        choice = KernelChoice() if _kernels is None else _kernels
        if not isinstance(choice, KernelChoice):
            raise TypeError(f"_kernels must be a santa_cupy.kernel_choice.KernelChoice, got {type(choice).__name__}")
        self.key_layout = key_pass.key_layout_choice(setting, key_layout, page_size, dtype=dtype, head_dim=head_dim,
                                            group=heads // kv_heads if kv_heads and heads % kv_heads == 0 else 1,
                                            head_offset=self.head_offset, dense_kernel=choice.dense_kernel)
        self.key_block = setting.key_block if self.key_layout == "blocked" else None   # FB of a blocked K
        self.setting, self._choice = setting, choice
        self._checked_kernels = set()        # kernels whose launch arguments _launch has checked
        method, samples, sampler, budget = setting.method, setting.samples, setting.sampler, setting.budget
        if heads % kv_heads or not 1 <= heads // kv_heads <= spec.MAX_G:
            raise ValueError(f"heads must be a multiple of kv_heads with heads // kv_heads in 1..{spec.MAX_G}, "
                             f"got heads={heads}, kv_heads={kv_heads}")
        if head_dim not in spec.HEAD_DIMS:
            raise ValueError(f"head_dim must be one of {spec.HEAD_DIMS}, got {head_dim}")
        if dtype not in spec.GPU_DTYPES:
            raise ValueError(f"dtype must be one of {spec.GPU_DTYPES}, got {dtype!r}")
        self.B, self.H, self.KVH, self.D, self.L_max = batch, heads, kv_heads, head_dim, max_length
        # a paged cache (santa_cupy/paged.py): run() then takes page pools and a block_table
        spec.check_choice("page_layout", page_layout, paged.LAYOUTS)
        if page_size is not None and (isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer))
                                      or not 1 <= page_size <= paged.MAX_PAGE_SIZE):
            raise ValueError(f"page_size must be None (a contiguous cache) or an integer in 1..{paged.MAX_PAGE_SIZE}, "
                             f"got {page_size!r}")
        self.page_size = None if page_size is None else int(page_size)
        self.page_layout = page_layout
        self.G = heads // kv_heads
        self.block_n = setting.resolved_block_n(head_dim)
        self.one_pass = setting.one_pass     # the one-pass budget: its own kernel (santa_one_pass) and santa_merge
        chosen = resolve(choice, setting, batch=batch, kv_heads=kv_heads, group=self.G, head_dim=head_dim,
                         max_length=max_length, dtype=dtype, block_n=self.block_n)
        self.dense_kernel, self.score_kernel, self.tile_kernel = chosen.dense_kernel, chosen.score_kernel, \
            chosen.tile_kernel
        # programmatic dependent launch: the choice's (where the device has it), or the process switch's
        self._programmatic = choice.programmatic and kernels.programmatic_launch_available() \
            if choice.programmatic is not None else None
        self.dtype, self.method, self.samples = dtype, method, samples
        self.sampler, self.budget, self.seed = sampler, budget, setting.seed
        self.scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
        tiles_per_warp = choice.tiles_per_warp
        self.kernels = kernels.get_kernels(dtype, head_dim, self.G, self.block_n, method)
        self._dense_fn = {"stream": self.kernels.dense,       # the split-KV kernel
                          "mma": self.kernels.dense_mma_blocked if self.key_block else self.kernels.dense_mma,
                          }.get(self.dense_kernel)
        # the merge: 8 partials in flight per warp where its (H, B) grid is at most one wave of SMs
        # (latency-bound), else 4 (fewer registers, two blocks per SM)
        wide = choice.merge_wide
        if wide is None:
            wide = heads * batch <= cupy.cuda.Device().attributes["MultiProcessorCount"]
        self._merge_fn = self.kernels.merge_wide if wide else self.kernels.merge
        self.step = cupy.full((1,), int(step), dtype=cupy.int64)
        self.T_max = -(-max_length // self.block_n)
        self._forced_dense_splits = choice.dense_splits
        self._dense_rows = _dense_rows or max_length        # the longest sequence the dense kernel takes
        # Tiles per warp of the v4 score pass and the warp pass 2 (one warp per run of tiles):
        # None = fitted to the occupancy (kernels.tiles_per_warp), an int forces it for both.
        self.score_tpw = self.tile_tpw = 1
        # a score pass (stash + tile stats) and the prefix first: every santa plan but the fixed
        # budget on the block kernel, which scores its tiles itself
        self._warp = method == "santa" and self.tile_kernel in ("warp", "warp_mma")
        # (key sampling: its score pass for every budget, santa_tile never scores K itself)
        two_pass = self.two_pass = method == "santa" and (budget != "fixed" or self._warp or setting.key_sampled) \
            and not self.one_pass
        # (kernel, dynamic shared memory) of the one-warp-per-run kernels, resolved once: the v4
        # score pass (static shared memory only) and the warp pass 2 (its gather)
        self._score_warp_kernel = (self.kernels.score_mma if kernels.score_span(self.page_size) == kernels.SCORE_SPAN
                                   else self.kernels.score_mma_span1, 0)
        # santa_tile_warp's two finishes (kFinish), both by the last block of a (sequence, KV head):
        # the blocks' sums added into accumulators (atomics) up to finish_max_groups groups, else
        # stored as block partials that the last block sums
        self.atomic_finish = self._warp and batch * kv_heads <= choice.finish_max_groups
        finish = "_finish" if self.atomic_finish else ""
        self._warp_kernel = getattr(self.kernels, "tile_" + self.tile_kernel + finish) if self._warp else None
        self._warp_smem = kernels.tile_warp_smem_bytes(self.block_n, self.G, head_dim,
                                                       mma=self.tile_kernel == "warp_mma")
        # how santa_merge combines the partials of the block pass 2 (the warp pass 2 finishes itself)
        if self.one_pass:                    # run partials relative to their max, like dense splits
            self._merge_kind = kernels.MERGE_DENSE
        else:
            self._merge_kind = kernels.MERGE_FIXED if budget == "fixed" else kernels.MERGE_SUM
        self.dense_merges_itself = False
        if method == "dense":
            self.part_rows, self.P_max, self.split_target, self.dense_pairs = self._dense_splits()
            # v4 dense merges in its own last block per KV group (one launch) where a group has few
            # splits; a counter per (b, KV head), zero between launches
            self.dense_merges_itself = (self.dense_kernel == "mma"
                                        and self.P_max <= choice.self_merge_max_splits)
        else:
            self.P_max = self.T_max
            if self.score_kernel == "mma" and two_pass and not setting.key_sampled:   # (the key pass fits its own)
                self.score_tpw = tiles_per_warp or self._tiles_per_warp(*self._score_warp_kernel)
            if self._warp:
                self.tile_tpw = tiles_per_warp or self._tiles_per_warp(self._warp_kernel, self._warp_smem)
            if self.one_pass:
                self._one_pass_smem = kernels.one_pass_smem_bytes(self.block_n, self.G, head_dim, dtype)
                self.one_tpw = tiles_per_warp or self._tiles_per_warp(self.kernels.one_pass, self._one_pass_smem)
        self.merge_counters = cupy.zeros((batch * kv_heads if self.dense_merges_itself else 1,), cupy.uint32)
        B, H, P, D = batch, heads, self.P_max, head_dim
        self.part_o = cupy.empty((B, H, P, D), cupy.float32)
        self.part_s = cupy.empty((B, H, P, 4), cupy.float32)
        self.scores = cupy.empty((B, H, max_length) if two_pass else (1,), cupy.float32)
        # the warp pipeline's stash kept in the L2 (santa_score_mma reads K evict-first, santa_tile_warp
        # drops the stash's lines once read) where it fits: kernel_choice.STASH_L2_FRACTION
        limit = choice.stash_l2_max_bytes
        if limit is None:
            limit = int(kernel_choice.STASH_L2_FRACTION * kernels.device_l2_bytes(cupy.cuda.Device().attributes))
        self.stash_in_l2 = int(self._warp and two_pass and self.scores.nbytes <= limit)
        self.cdf = cupy.empty((B, H, self.T_max) if two_pass else (1,), cupy.float64)
        self.alloc = cupy.empty((B, H, self.T_max) if budget == "largest_remainder" else (1,), cupy.int32)
        if not self.one_pass:                # one_pass: a view of its counters (below)
            self.rows_read = cupy.zeros((B, kv_heads), cupy.int32)
        # The warp pipeline (score pass, prefix, warp pass 2): santa_tile_warp's last block per
        # (b, KV head) writes o, with atomic_finish from the accumulators acc [ACC_COPIES, B*H*D +
        # B*H] (its blocks add into copy blockIdx.x % ACC_COPIES: fewer atomics on each address),
        # which it zeroes, else from its blocks' partials in part_o / part_s; its arrival counters
        # go back to 0. No call fills anything (santa_prefix zeroes rows_read).
        if self._warp:
            self.arrive = cupy.zeros((batch * kv_heads,), cupy.uint32)
            self.acc = cupy.zeros((kernels.ACC_COPIES, B * H * (D + 1)) if self.atomic_finish else (1,),
                                  cupy.float32)
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
        self.key_pass = key_pass.KeyScorePass(
            batch=B, heads=H, kv_heads=kv_heads, head_dim=D, max_length=max_length, dtype=dtype,
            block_n=self.block_n, setting=setting, scale=self.scale, head_offset=self.head_offset,
            tiles_per_block=choice.tiles_per_warp, score_kernel=self.score_kernel) if setting.key_sampled else None
        self._lengths = None         # int32 copy of lengths when the caller's are not int32
        self._last_lengths = None
        self._no_counts = cupy.zeros((1,), cupy.int32)
        self._no_table = cupy.zeros((1,), cupy.int32)      # a contiguous plan's block_table argument
        # Never slower than exact: sequences shorter than santa_from run the dense kernel (a dense
        # sub-plan sharing this plan's outputs), the santa kernels skip them; a dense plan's
        # kernel takes every sequence. Where none can reach santa_from (L_max < santa_from) the
        # plan runs as that dense plan, merge included (``exact_throughout``).
        self.santa_from = _INT32_MAX if method == "dense" else self._santa_from(setting.santa_min_length)
        self.exact_throughout = method == "santa" and self.santa_from > max_length
        self._dense_plan = None
        if method == "santa" and self.santa_from > 1:
            # the fallback's kernels are its own automatic ones (the thresholds and launch mode are
            # this plan's), on this plan's K layout
            fallback = dataclasses.replace(choice, dense_kernel="auto", score_kernel="auto", tile_kernel="auto",
                                           tiles_per_warp=None, dense_splits=None, merge_wide=None)
            dense = AttentionSetting(method="dense", key_block=self.key_block) if self.key_block \
                else AttentionSetting(method="dense")
            self._dense_plan = DecodePlan(
                batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, max_length=max_length, dtype=dtype,
                setting=dense, scale=self.scale, key_layout=self.key_layout, _kernels=fallback,
                _dense_rows=min(max_length, self.santa_from - 1))
            # a fallback (some sequences reach santa_from) runs after pass 2, reads lengths before
            # its PDL wait (common.cuh, dense_fallback_wait) and merges in its last block (its
            # splits capped: _dense_splits); exact throughout, it is a dense plan's kernel
            self._dense_plan.santa_from = _INT32_MAX if self.exact_throughout else self.santa_from
            self._dense_plan.out, self._dense_plan.lse = self.out, self.lse
            self._dense_plan.spread, self._dense_plan.rows_read = self.spread, self.rows_read

    @interop.accepts_stream
    def run(self, q, k_cache, v_cache, lengths, *, layer=0, out=None, validate=True, lse_hint=None,
            block_table=None):
        """One decode step: o for every sequence and head.

        Parameters
        ----------
        q : [B, H, D] of the plan's dtype, C-contiguous (CuPy, or any zero-copy GPU array)
        k_cache, v_cache : [B, L_max, KVH, D] of the plan's dtype, C-contiguous
            A plan with ``page_size``: page pools [num_pages, page_size, KVH, D] (page_layout
            "NHD") or [num_pages, KVH, page_size, D] ("HND").
        lengths : [B] integer (int32 avoids a device-side cast), 0..L_max
            A sequence of length 0 gets o = 0, lse = -inf, spread = 0, rows_read = 0.
        layer : int
            The RNG's layer key (one plan serves every layer of a model).
        out : [B, H, D] of the plan's dtype, C-contiguous, or None
            Where o goes; None: the plan's own ``out`` (overwritten by the next run).
        validate : bool
            Check the inputs' shapes and dtypes against the plan's (no data read) and a paged
            plan's block table (a host sync: page ids in range, enough pages for each length; a
            ValueError names block_table and its first bad entry). Without it a bad table reads
            wrong memory.
        lse_hint : [B, H] float32 CuPy array, or None
            Budget "one_pass" only: the normaliser guess r, any deterministic function of the
            inputs (e.g. this layer's ``info().lse`` of the previous step); None: the plan's own
            lse of its previous run (NaN before the first: the exact output). About
            ``samples * exp(lse - r)`` rows are read per head.
        block_table : [B, max_pages] int32 CuPy array, C-contiguous (paged plans only)
            Row j of sequence b is slot j % page_size of page block_table[b, j // page_size].

        Returns
        -------
        o : [B, H, D] of the plan's dtype
            ``out`` or the plan's buffer; lse, spread and rows_read are in the plan's buffers
            (``info()``). NaN or inf in q or K makes that sequence's heads (of the KV group) NaN.
        """
        q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
        pages = self._page_args(block_table, k_cache)
        if validate:
            self._validate(q, k_cache, v_cache, lengths, block_table)
        lengths = self._int32_lengths(lengths)
        self._last_lengths = lengths
        out = self._output(out)
        if self.method == "dense":
            self._exact(q, k_cache, v_cache, lengths, out, pages)
            return out
        hint = self._lse_hint(lse_hint) if self.one_pass else None
        if lse_hint is not None and not self.one_pass:
            raise ValueError(f"lse_hint is for budget {spec.ONE_PASS!r}, this plan's is {self.budget!r}")
        if self.exact_throughout:            # every sequence is shorter than santa_from
            self._dense_plan._exact(q, k_cache, v_cache, lengths, out, pages)
            return out
        if self.one_pass:
            self._one_pass(q, k_cache, v_cache, lengths, layer, hint, pages)
            self._merge(lengths, out, kernels.MERGE_DENSE, self.one_tpw * self.block_n)
            return out
        if self._warp:                       # score, prefix, sample + gather + finish, then the short sequences
            self._score_and_prefix(q, k_cache, lengths, pages, santa_from=self.santa_from, layer=layer)
            self._tile_warp(v_cache, lengths, layer, out, pages)
            if self._dense_plan is not None:
                self._dense_plan._dense(q, k_cache, v_cache, lengths, out, pages)
            return out
        self.rows_read.fill(0)
        if self.two_pass:
            self._score_and_prefix(q, k_cache, lengths, pages, layer=layer)
        self._tile(q, k_cache, v_cache, lengths, layer, "fused", self._no_counts, pages)
        self._merge(lengths, out, self._merge_kind, self.block_n)
        return out

    def _validate(self, q, k_cache, v_cache, lengths, block_table):
        """The inputs' shapes and dtypes against the plan's (no data read), and a paged plan's block
        table (a host sync)."""
        layout = self.page_layout if self.page_size is not None else None
        if self.key_block:                   # blocked K: V stands in for K in the standard checks
            key_pass.validate_blocked_keys(k_cache, batch=self.B, kv_heads=self.KVH, head_dim=self.D,
                                           max_length=self.L_max, key_block=self.key_block, dtype=self.dtype)
            k_cache = v_cache
        else:
            key_pass.check_standard_keys(k_cache)
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

    def _no_counts_for_one_pass(self, what):
        if self.one_pass:
            raise ValueError(f"{what} is for the budgets with sample counts, not {spec.ONE_PASS!r}")

    @interop.accepts_stream
    def run_from_counts(self, q, k_cache, v_cache, lengths, counts, *, out=None, block_table=None, layer=0):
        """The gather-add and merge stages alone: o from given sample counts.

        Parameters
        ----------
        q, k_cache, v_cache, lengths, block_table : as for ``run``
        counts : [B, H, L_max] int32 CuPy array, C-contiguous
            Samples of each row; those past a sequence's length are ignored.
        out : [B, H, D] of the plan's dtype, or None (the plan's buffer)
        layer : int
            The RNG's layer key of the score pass's key-sampling draws (plans with key sampling:
            the layer of the ``run`` whose scores the counts belong to).

        Returns
        -------
        o : [B, H, D] of the plan's dtype
            For the global / largest_remainder budgets o = (1/S) sum_j c_j V_j; for fixed the
            tile-weighted form with S_t = max(1, S // T). Not for budget one_pass.
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
            self._score_and_prefix(q, k_cache, lengths, pages, layer=layer)
        self._tile(q, k_cache, v_cache, lengths, 0, "gather", counts, pages)
        self._merge(lengths, out, kernels.MERGE_FIXED if self.budget == "fixed" else kernels.MERGE_SUM,
                    self.block_n)
        return out

    @interop.accepts_stream
    def advance(self, n=1):
        """Add ``n`` to the device step counter ``step`` ([1] int64), on the device: capturable, so
        a CUDA graph ending with this draws new samples on every replay."""
        for _ in range(n):
            self._launch(self.kernels.advance, (1,), (self.step,), threads=1)

    def info(self) -> AttentionInfo:
        """Diagnostics of the last run: an AttentionInfo of views of the plan's buffers (lse,
        spread [B, H] float32, rows_read [B, KVH] int32, dense_fallback [B] bool, samples_drawn
        [B, H] int32 or None), overwritten by the next run; counts is None (``sample_counts``);
        key_fraction [B, KVH] float32 with key sampling (a new array: the fraction of each K row's
        blocks the last run read), else None."""
        if self.method == "dense" or self.exact_throughout:
            import cupy
            rows = cupy.broadcast_to(self._last_lengths[:, None], (self.B, self.KVH))
            if self.method == "dense":
                return AttentionInfo(lse=self.lse, rows_read=rows, spread=self.spread,
                                     dense_fallback=cupy.ones((self.B,), bool))
            # exact throughout: every row of every head, all of K
            drawn = cupy.broadcast_to(self._last_lengths[:, None], (self.B, self.H)) if self.one_pass else self.drawn
            keys = None if self.key_pass is None else cupy.ones((self.B, self.KVH), cupy.float32)
            return AttentionInfo(lse=self.lse, rows_read=rows, spread=self.spread,
                                 dense_fallback=cupy.ones((self.B,), bool), samples_drawn=drawn, key_fraction=keys)
        return AttentionInfo(lse=self.lse, rows_read=self.rows_read, spread=self.spread,
                             dense_fallback=self._last_lengths < self.santa_from, samples_drawn=self.drawn,
                             key_fraction=None if self.key_pass is None else self.key_pass.key_fraction())

    @interop.accepts_stream
    def sample_counts(self, q, k_cache, lengths, *, layer=0, block_table=None):
        """The sample counts of the standalone sample stage.

        Parameters: q, k_cache, lengths, layer, block_table as for ``run``.
        Returns: counts [B, H, L_max] int32, a new CuPy array (rows past a length are 0). Re-runs
        the score stage, so the stash and stats match the last ``run`` for the same inputs. Not
        for budget one_pass.
        """
        import cupy

        self._no_counts_for_one_pass("sample_counts")
        q, k_cache, lengths = interop.as_arrays(q, k_cache, lengths, names=("q", "k_cache", "lengths"))
        pages = self._page_args(block_table, k_cache)
        lengths = self._int32_lengths(lengths)
        counts = cupy.zeros((self.B, self.H, self.L_max), cupy.int32)
        if self.two_pass:                  # the stash the fused run samples from
            self._score_and_prefix(q, k_cache, lengths, pages, rows_read=cupy.zeros(self.rows_read.shape, cupy.int32),
                                   layer=layer)
        self._tile(q, k_cache, k_cache, lengths, layer, "sample", counts, pages)
        return counts


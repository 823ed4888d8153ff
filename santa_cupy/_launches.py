"""DecodePlan's launches, one method per kernel (a mixin of santa_cupy.plan.DecodePlan).

Each method launches one kernel of cuda/ with the plan's workspaces and the argument order of the
kernel's parameter list (tests/test_plan_host.py checks the count and kinds against cuda/*.cu,
tests/test_plan_launches.py every value against a recorded baseline). ``pages`` is the kernels'
last four arguments (DecodePlan._page_args). Nothing here allocates or syncs with the host.
"""

from __future__ import annotations

from santa_cupy import interop, kernels, spec

MAX_GRID_Y = 65535                   # CUDA's grid y limit: the (sequence, split) pairs or runs a KV head


class _PlanLaunches:
    """The kernel launches of a DecodePlan (its attributes: santa_cupy/plan.py)."""

    def _launch(self, kernel, grid, args, shared_mem=0, threads=kernels.THREADS):
        """kernels.launch with this plan's programmatic-launch choice (KernelChoice.programmatic).
        The arguments are checked against the kernel's C declaration at the plan's first launch
        of each kernel only: later runs pass the plan's own buffers and scalars of the same types
        again (and inputs whose dtypes the plan validated), so the ~5 µs a launch of the check
        stays off the steady state (eager decode, the JAX callback)."""
        first = id(kernel) not in self._checked_kernels
        kernels.launch(kernel, grid, args, shared_mem, threads, programmatic=self._programmatic, check=first)
        self._checked_kernels.add(id(kernel))

    def stage_launchers(self, q, k_cache, v_cache, lengths, *, layer=0, block_table=None):
        """The pipeline's stages one by one, for timing them (bench stages).

        Parameters: q, k_cache, v_cache, lengths, layer, block_table as for ``run``.
        Returns: {stage name: a zero-argument callable launching just that stage}, in pipeline
        order. Each stage reads what the previous stages of the last full ``run`` left in the
        workspaces, so call ``run`` once first; outputs go to the plan's own buffers."""
        q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
        pages = self._page_args(block_table, k_cache)
        lengths = self._int32_lengths(lengths)
        if self.method == "dense" or self.exact_throughout:
            return self._exact_stages(q, k_cache, v_cache, lengths, pages)
        stages = {}
        if self.one_pass:
            stages["one pass (score + sample + gather)"] = lambda: self._one_pass(q, k_cache, v_cache, lengths, layer,
                                                                                self.lse, pages)
            stages["merge"] = lambda: self._merge(lengths, self.out, kernels.MERGE_DENSE, self.one_tpw * self.block_n)
            return stages
        if self._warp:
            stages["score"] = lambda: self._score(q, k_cache, lengths, pages, self.santa_from, layer)
            stages["prefix"] = lambda: self._prefix(lengths, santa_from=self.santa_from)
            stages["sample + gather + finish (warp)"] = lambda: self._tile_warp(v_cache, lengths, layer,
                                                                                self.out, pages)
            if self._dense_plan is not None:
                stages["dense (sequences shorter than santa_from)"] = lambda: self._dense_plan._dense(
                    q, k_cache, v_cache, lengths, self.out, pages)
            return stages
        if self.two_pass:
            stages["score + prefix"] = lambda: self._score_and_prefix(q, k_cache, lengths, pages, layer=layer)
        stages[f"tile (sample + gather, {self.tile_kernel})"] = lambda: self._tile(
            q, k_cache, v_cache, lengths, layer, "fused", self._no_counts, pages)
        stages["merge"] = lambda: self._merge(lengths, self.out, self._merge_kind, self.block_n)
        return stages

    def _exact_stages(self, q, k_cache, v_cache, lengths, pages):
        """stage_launchers of a dense plan, or of a santa plan that runs exact throughout (its
        dense sub-plan's kernels into this plan's outputs)."""
        plan = self if self.method == "dense" else self._dense_plan
        split = lambda: plan._dense(q, k_cache, v_cache, lengths, self.out, pages)   # noqa: E731
        if plan.dense_merges_itself:
            return {f"dense split-KV + merge ({plan.dense_kernel})": split}
        return {f"dense split-KV ({plan.dense_kernel})": split,
                "merge": lambda: plan._merge(lengths, self.out, kernels.MERGE_DENSE, plan.part_rows,
                                             split_target=plan.split_target)}

    def _exact(self, q, k_cache, v_cache, lengths, out, pages):
        """A dense plan's run: the split-KV kernel, then santa_merge where it does not merge itself."""
        self._dense(q, k_cache, v_cache, lengths, out, pages)
        if not self.dense_merges_itself:
            self._merge(lengths, out, kernels.MERGE_DENSE, self.part_rows, split_target=self.split_target)

    def _dense(self, q, k_cache, v_cache, lengths, out, pages):
        """The split-KV kernel; v4 also merges (its last block per KV group), given the counters.
        pages: _page_args; a blocked K (decode_dense_mma_blocked, contiguous) takes key_block in
        their place."""
        i32, i64, f32 = kernels.i32, kernels.i64, kernels.f32
        args = (q, k_cache, v_cache, lengths, f32(self.scale), i32(self.split_target), i32(self.B), i32(self.H),
                i32(self.KVH), i64(self.L_max), self.part_o, self.part_s, i32(self.P_max))
        if self.dense_kernel == "mma":
            args += (i32(self.dense_merges_itself), self.merge_counters, out, self.lse, self.spread,
                     i32(self.santa_from), self.rows_read)
        tail = (i32(self.key_block),) if self.key_block else pages
        self._launch(self._dense_fn, (self.KVH, self.dense_pairs), args + tail,
                       kernels.dense_smem_bytes(self.dtype, self.D, self.G, self.dense_kernel))

    def _score_and_prefix(self, q, k_cache, lengths, pages, rows_read=None, santa_from=0, layer=0):
        """The score pass (stash and tile stats), then santa_prefix (the comb's cdf, lse, rows_read
        zeroed; the Hamilton allocation for the largest remainder budget). santa_from: the warp
        pipeline's dense fallback (shorter sequences skipped); rows_read: a scratch buffer for the
        standalone stages, so as not to clear the last run's; layer: the key-sampling draws' RNG key."""
        self._score(q, k_cache, lengths, pages, santa_from, layer)
        self._prefix(lengths, rows_read, santa_from)

    def _score(self, q, k_cache, lengths, pages, santa_from=0, layer=0):
        """santa_score / santa_score_mma, or with key sampling santa_key_blocks + santa_score_keys on
        the blocked K (key_pass.KeyScorePass: the same stash and tile stats)."""
        if self.key_pass is not None:
            self.key_pass.launch(q, k_cache, lengths, self.step, layer, self.scores, self.part_s, launch=self._launch)
            return
        i32, i64, f32 = kernels.i32, kernels.i64, kernels.f32
        common = (q, k_cache, lengths, f32(self.scale), i32(self.H), i32(self.KVH), i64(self.L_max), i32(self.T_max))
        if self.score_kernel == "stream":
            self._launch(self.kernels.score, (self.T_max, self.KVH, self.B), (*common, self.scores, self.part_s, *pages))
        else:                                            # mma: one warp per run of score_tpw tiles
            kernel, smem = self._score_warp_kernel
            self._launch(kernel, (self.KVH, self._run_blocks(self.score_tpw)),
                           (*common, i32(self.score_tpw), i32(self.B), self.scores, self.part_s, i32(santa_from),
                            i32(self.stash_in_l2), *pages), smem)

    def _prefix(self, lengths, rows_read=None, santa_from=0):
        i32, i64 = kernels.i32, kernels.i64
        self._launch(self.kernels.prefix, (self.H, self.B),
                       (self.part_s, lengths, i64(self.L_max), i32(self.H), i32(self.block_n), i32(self.T_max),
                        i32(self.samples), i32(self.budget == "largest_remainder"), self.cdf, self.alloc, self.lse,
                        self.rows_read if rows_read is None else rows_read, i32(self.G), i32(santa_from)),
                       threads=kernels.PREFIX_THREADS)

    def _tile_warp(self, v_cache, lengths, layer, out, pages):
        """santa_tile_warp: one warp per run of tile_tpw tiles samples and gathers; with
        the last block of each (b, KV head) writes o and spread, from accumulators the blocks add
        into (atomic_finish) or from the blocks' partials."""
        i32, i64, u64 = kernels.i32, kernels.i64, kernels.u64
        self._launch(self._warp_kernel, (self.KVH, self._run_blocks(self.tile_tpw)),
                       (v_cache, lengths, i32(self.H), i32(self.KVH), i64(self.L_max), i32(self.T_max),
                        i32(self.tile_tpw), i32(self.B), i32(kernels.BUDGET_CODE[self.budget]), i32(self.samples),
                        u64(self.seed), self.step, i32(layer), i32(self.head_offset), self.scores, self.cdf,
                        self.alloc, self.part_s, self.part_o, self.acc, self.arrive,
                        self.rows_read, out, self.lse, self.spread,
                        i32(self.santa_from), i32(self.stash_in_l2), *pages), self._warp_smem)

    def _one_pass(self, q, k_cache, v_cache, lengths, layer, hint, pages):
        """santa_one_pass: score, take rows by the hint's inclusion probabilities, gather; one
        partial per run of one_tpw tiles (santa_merge follows)."""
        i32, i64, u64, f32 = kernels.i32, kernels.i64, kernels.u64, kernels.f32
        self._one_pass_counts.fill(0)                    # rows_read and drawn
        self._launch(self.kernels.one_pass, (self._warp_blocks(self.one_tpw), self.KVH, self.B),
                       (q, k_cache, v_cache, lengths, f32(self.scale), i32(self.H), i32(self.KVH), i64(self.L_max),
                        i32(self.T_max), i32(self.one_tpw), i32(self.samples), u64(self.seed), self.step, i32(layer),
                        i32(self.head_offset), hint, self.part_o, self.part_s, i32(self.P_max), self.rows_read,
                        self.drawn, *pages),
                       self._one_pass_smem)

    def _tile(self, q, k_cache, v_cache, lengths, layer, mode, counts, pages):
        K, i32, i64, u64, f32 = self.kernels, kernels.i32, kernels.i64, kernels.u64, kernels.f32
        rows_read = self.rows_read
        self._launch(K.tile, (self.T_max, self.KVH, self.B),
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

    def _merge(self, lengths, out, kind, part_rows, split_target=0):
        """split_target > 0: a dense plan's splits (part_rows per sequence from the lengths, as the
        dense kernel split them). It merges every sequence: no plan that merges runs beside a dense
        fallback (the warp pass 2, the only route that mixes, finishes itself; the fallback merges in
        its own last block; the standalone stages run none)."""
        i32 = kernels.i32
        self._launch(self._merge_fn, (self.H, self.B),
                     (self.part_o, self.part_s, lengths, kernels.i64(self.L_max), i32(self.H), i32(part_rows),
                      i32(split_target), i32(self.P_max), i32(kind), i32(self.samples), out, self.lse, self.spread),
                     threads=kernels.MERGE_THREADS)

    # ---- the launches' arguments ---------------------------------------------------------------
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

    def _lse_hint(self, lse_hint):
        import cupy

        if lse_hint is None:
            return self.lse
        if not isinstance(lse_hint, cupy.ndarray) or lse_hint.dtype != cupy.float32 or \
                lse_hint.shape != (self.B, self.H) or not lse_hint.flags.c_contiguous:
            raise ValueError(f"lse_hint must be a C-contiguous cupy float32 array of shape {(self.B, self.H)}, "
                             f"got {spec.describe(lse_hint)}")
        return lse_hint

    def _int32_lengths(self, lengths):
        import cupy

        if lengths.dtype == cupy.int32:
            return lengths
        if self._lengths is None:
            self._lengths = cupy.empty((self.B,), cupy.int32)
        self._lengths[...] = lengths        # a device-side cast, no host sync
        return self._lengths

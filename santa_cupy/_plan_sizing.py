"""DecodePlan's sizing: the dense fallback's length, tiles per warp of the warp kernels and the
dense kernel's splits, from the plan's shape, its kernel choice and the device (a mixin of
santa_cupy.plan.DecodePlan; its attributes are the plan's)."""

from __future__ import annotations

from santa_cupy import kernels


class _PlanSizing:
    def _santa_from(self, santa_min_length):
        """The length from which a sequence runs santa (shorter ones run dense): "auto" derives it
        from the shape and the device (kernels.santa_min_length), an integer >= 0 sets it (0 or 1:
        santa for every sequence, e.g. to study the estimator at short lengths). Only the two-launch
        pipeline (warp pass 2) without key sampling mixes the two per sequence; the other santa
        plans run dense throughout where max_length < santa_from (the crossover under "auto"; the
        block pass 2's is every length, kernels.BLOCK_PASS_MIN_LENGTH), and santa throughout
        otherwise (an explicit 1 < santa_min_length <= max_length: ValueError)."""
        mixes = self._warp and not self.setting.key_sampled   # a blocked K: no per-sequence fallback
        if santa_min_length == "auto" and self.tile_kernel == "block":
            crossover = kernels.BLOCK_PASS_MIN_LENGTH     # measured slower than dense (kernels.py)
        elif santa_min_length == "auto":
            import cupy
            crossover = kernels.santa_min_length(self.B, self.KVH, self.D, kernels.ITEMSIZE[self.dtype],
                                                 kernels.device_bandwidth(cupy.cuda.Device().attributes),
                                                 self.samples)
        else:
            crossover = int(santa_min_length)
        if mixes or crossover > self.L_max:
            return crossover
        if santa_min_length == "auto" or crossover <= 1:
            return 0
        raise ValueError(f"santa_min_length={santa_min_length}: this plan runs santa or dense for the whole batch "
                         f"(only the two-launch santa pipeline without key sampling mixes them per sequence: "
                         f"systematic sampler, heads // kv_heads <= {kernels.WARP_TILE_MAX_G}, fp16/bf16 at head_dim "
                         f"64/128; got tile_kernel={self.tile_kernel!r}, budget={self.budget!r}, key_sampling="
                         f"{self.setting.key_sampling!r}): use 'auto', 0, 1 or a length above max_length="
                         f"{self.L_max}")

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
        KernelChoice(dense_splits=N); rows a multiple of 16, so at most that many splits. The kernel
        balances other lengths on the device (cuda/common.cuh dense_split): split_target = B *
        splits blocks a KV head shared in proportion to the lengths, at most P_max splits a
        sequence (the workspaces' count: up to the self-merge's cap when the split is automatic,
        ``splits`` when forced); the grid has ``pairs`` blocks a KV head, enough for any lengths."""
        longest = self._dense_rows
        splits = self._forced_dense_splits or self._wave_fitted_dense_splits()
        if longest < self.L_max:             # a santa plan's fallback: it must merge in its last block
            splits = min(splits, self._choice.self_merge_max_splits)
        rows = -(-longest // splits)
        rows = -(-rows // 16) * 16           # whole 16-row steps (the mma kernel's step per warp)
        splits = -(-longest // rows)
        target = self.B * splits
        P_max = splits if self._forced_dense_splits else min(
            target, max(splits, self._choice.self_merge_max_splits), -(-longest // 16))
        return rows, P_max, target, min(target + self.B, self.B * P_max)

    def _wave_fitted_dense_splits(self):
        import cupy

        attrs = cupy.cuda.Device().attributes
        smem = kernels.dense_smem_bytes(self.dtype, self.D, self.G, self.dense_kernel)
        slots = kernels.resident_blocks(self._dense_fn, kernels.THREADS, smem, attrs) * attrs["MultiProcessorCount"]
        return kernels.wave_fitted_parts(self.B * self.KVH, max(1, -(-self._dense_rows // 256)), slots)

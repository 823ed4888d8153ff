"""Block key sampling's score pass on the GPU: santa_key_blocks + santa_score_keys_mma (tensor
cores, the automatic choice) or santa_score_keys (FMA) (cuda/santa_score_keys.cu) on a
feature-blocked K (santa_cupy/key_layout.py).

``KeyScorePass`` holds the pass's workspaces for one shape and setting and launches its two
kernels; what it writes is santa_score's stash and tile stats, so DecodePlan runs its usual pass
2 after it (the warp pipeline after the mma pass, the block one after the FMA pass). ``gpu_key_scores`` is
santa_cupy.key_scores on CuPy inputs. The estimator is the NumPy reference's
(santa_cupy/key_sampling.py, key_sampling "bernoulli_block"): the same pi, masks and weights bit
for bit, scores in float32.

K bytes of blocks no draw selected are never read: a NaN or inf there does not reach the scores
(the reference, which multiplies them by a zero weight, gives NaN).

``key_layout_choice`` holds a plan's key-layout checks, also those of dense attention on a
blocked K (no key sampling: decode_dense_mma_blocked, cuda/decode_dense.cu; check_dense_blocked).

Supported: key_sampling "bernoulli_block", rules "uniform" | "qmax" | "qrms" (not "qkvar", which
needs statistics of K the cache does not keep), both combines, R 1..256, FB 16 | 32, fp16 / bf16
at head_dim 64 / 128, contiguous caches (no paged blocked layout).
"""

from __future__ import annotations

import numpy as np

from santa_cupy import kernels, spec
from santa_cupy import key_layout as _key_layout
from santa_cupy import kernel_choice as _kernel_choice

__all__ = ["KeyScorePass", "check_gpu_key_setting", "check_blocked_setting", "validate_blocked_keys", "gpu_key_scores", "fit_tiles_per_block",
           "key_layout_choice", "check_dense_blocked", "check_standard_keys", "balanced_tiles_per_warp"]

BLOCKED_ONLY = ("key sampling on the GPU reads K in the feature-blocked layout: pass key_layout='blocked' and K "
                "from santa_cupy.key_layout.to_blocked(k, key_block) ([B, KVH, NP, C, P, FB]); V keeps the standard "
                "layout")


def check_gpu_key_setting(setting, *, dtype, head_dim, group, head_offset=0):
    """NotImplementedError / ValueError unless the GPU runs this key-sampling setting
    (santa_cupy.AttentionSetting with key_sampled) at this dtype, head_dim and group."""
    if setting.key_sampling != "bernoulli_block":
        raise NotImplementedError(f"key_sampling={setting.key_sampling!r} runs on the NumPy reference only; the GPU "
                                  "has key_sampling='bernoulli_block'")
    if setting.key_rule not in kernels.KEY_RULE_CODE:
        raise NotImplementedError(f"key_rule={setting.key_rule!r} runs on the NumPy reference only (it needs the "
                                  f"variance of K per feature); the GPU has key_rule in {tuple(kernels.KEY_RULE_CODE)}")
    if not kernels.key_sampling_supported(dtype, head_dim):
        raise NotImplementedError(f"block key sampling on the GPU needs dtype in {kernels.KEY_SAMPLING_DTYPES} and "
                                  f"head_dim in {kernels.KEY_SAMPLING_HEAD_DIMS}, got dtype={dtype!r}, "
                                  f"head_dim={head_dim}")
    if head_offset % group:
        raise ValueError(f"key sampling keys its draws by KV group: head_offset must be a multiple of "
                         f"heads // kv_heads = {group}, got {head_offset}")


def validate_blocked_keys(kb, *, batch, kv_heads, head_dim, max_length, key_block, dtype):
    """kb must be a C-contiguous CuPy array [B, KVH, NP, C, P, FB] of the storage dtype
    (key_layout.to_blocked of a [B, L_max, KVH, D] K); ValueError / TypeError naming what is off."""
    want = _key_layout.blocked_shape((batch, max_length, kv_heads, head_dim), key_block)
    if not spec.is_cupy_array(kb) or getattr(kb, "ndim", 0) != 6:
        raise ValueError(f"k_cache must be the blocked layout [B, KVH, NP, C, P, FB] = {want} as a cupy array "
                         f"(santa_cupy.key_layout.to_blocked), got {spec.describe(kb)}")
    if tuple(kb.shape) != want:
        raise ValueError(f"k_cache (blocked) must have shape [B, KVH, NP, C, P, FB] = {want} (FB = key_block "
                         f"{key_block}, L_max = {max_length} in pages of {_key_layout.KEY_PAGE_ROWS}), got "
                         f"{tuple(kb.shape)}")
    if spec.DTYPE_NAMES.get(np.dtype(kb.dtype)) != dtype:
        raise TypeError(f"k_cache dtype {kb.dtype} must be q's ({dtype})")
    if not kb.flags.c_contiguous:
        raise ValueError(f"k_cache (blocked) must be C-contiguous, got strides {tuple(kb.strides)}")


class KeyScorePass:
    """Workspaces and launches of the block key-sampled score pass for one shape and setting.

    Parameters: batch, heads, kv_heads, head_dim, max_length (B, H, KVH, D, L_max); dtype
    "float16" | "bfloat16"; block_n (rows per tile); setting (an AttentionSetting with
    key_sampling "bernoulli_block"); scale; head_offset (a multiple of G: the draws of KV head g
    use the group stream of g + head_offset // G).

    score_kernel: "auto" | "stream" | "mma" (kernel_choice.resolve_kernel_choice: "auto" is "mma"
    where it exists): santa_score_keys (FMA; one block a run of tiles) or santa_score_keys_mma
    (tensor cores; one warp a run, 4 a block).
    tiles_per_block: that run's tiles (the block's, or with "mma" the warp's); None: fitted
    (fit_tiles_per_block, kernels.tiles_per_warp).
    Attributes (overwritten by each launch): key_weight [B, KVH, C] float32 (each block's
    Horvitz-Thompson weight, 0 where no draw read it), key_pi [B, KVH, C] float32 (pi_c),
    blocks_read [B, KVH] int32 (blocks of each K row read).
    """

    def __init__(self, *, batch, heads, kv_heads, head_dim, max_length, dtype, block_n, setting, scale,
                 head_offset=0, tiles_per_block=None, score_kernel="auto"):
        import cupy

        group = heads // kv_heads
        check_gpu_key_setting(setting, dtype=dtype, head_dim=head_dim, group=group, head_offset=head_offset)
        self.B, self.H, self.KVH, self.D, self.L_max = batch, heads, kv_heads, head_dim, max_length
        self.dtype, self.block_n, self.scale = dtype, block_n, float(scale)
        self.FB = setting.key_block
        self.C = head_dim // self.FB
        self.T_max = -(-max_length // block_n)
        self.kv_offset = head_offset // group
        self.rule = kernels.KEY_RULE_CODE[setting.key_rule]
        self.combine = kernels.KEY_COMBINE_CODE[setting.key_combine]
        self.R, self.budget, self.seed = setting.key_draws, setting.key_budget, setting.seed
        self.kernels = kernels.get_kernels(dtype, head_dim, group, block_n, "santa")
        spec.check_choice("score_kernel", score_kernel, _kernel_choice.SCORE_KERNELS)
        self.score_kernel = _kernel_choice.resolve_kernel_choice("score_kernel", score_kernel, dtype, head_dim)
        # santa_score_keys_mma: one instance a key block (FB a template constant)
        self._score = getattr(self.kernels, f"score_keys_mma_fb{self.FB}") if self.score_kernel == "mma" \
            else self.kernels.score_keys
        attrs = cupy.cuda.Device().attributes
        slots = kernels.resident_blocks(self._score, kernels.THREADS, 0, attrs) * attrs["MultiProcessorCount"]
        if tiles_per_block:
            self.tiles_per_block = int(tiles_per_block)
        elif self.score_kernel == "mma":
            self.tiles_per_block = balanced_tiles_per_warp(self.T_max, batch * kv_heads, slots)
        else:
            self.tiles_per_block = fit_tiles_per_block(self.T_max, batch * kv_heads, slots)
        # grid x: runs of tiles_per_block tiles, one a block (stream) or one a warp (mma)
        run = self.tiles_per_block * (kernels.THREADS // 32 if self.score_kernel == "mma" else 1)
        self._grid_x = -(-self.T_max // run)
        self.key_weight = cupy.zeros((batch, kv_heads, self.C), cupy.float32)
        self.key_pi = cupy.zeros((batch, kv_heads, self.C), cupy.float32)
        self.blocks_read = cupy.zeros((batch, kv_heads), cupy.int32)
        # santa_score_keys_mma's launch order (santa_key_blocks: heaviest group first; identity
        # until the first launch_blocks), each group's class, and the sort's arrival counter
        self.group_order = cupy.asarray(np.arange(batch * kv_heads, dtype=np.int32))
        self.group_class = cupy.zeros((batch * kv_heads,), cupy.int32)
        self._arrive = cupy.zeros((1,), cupy.uint32)

    def launch(self, q, kb, lengths, step, layer, scores, part_s, launch=kernels.launch):
        """The two kernels on the current stream: q [B, H, D], kb [B, KVH, NP, C, P, FB] (storage
        dtype), lengths [B] int32, step [1] int64 (device), layer int -> scores [B, H, L_max] float32
        (rows j < lengths[b]) and part_s [B, H, T_max, 4] float32 (tiles of the lengths).
        ``launch``: kernels.launch or a plan's own (same arguments)."""
        self.launch_blocks(q, step, layer, launch)
        self.launch_scores(q, kb, lengths, scores, part_s, launch)

    def launch_blocks(self, q, step, layer, launch=kernels.launch):
        """santa_key_blocks alone: key_weight, key_pi, blocks_read from q and the RNG keys, and
        group_order (the groups by read 32-feature groups, descending, then b * KVH + g)."""
        i32, u64, f64 = kernels.i32, kernels.u64, kernels.f64
        launch(self.kernels.key_blocks, (self.KVH, self.B),
               (q, i32(self.H), i32(self.KVH), i32(self.D), i32(self.FB), i32(self.rule), i32(self.R),
                f64(self.budget), i32(self.combine), u64(self.seed), step, i32(layer), i32(self.kv_offset),
                self.key_weight, self.key_pi, self.blocks_read, self.group_class, self.group_order, self._arrive),
               threads=32)

    def launch_scores(self, q, kb, lengths, scores, part_s, launch=kernels.launch):
        """santa_score_keys(_mma) alone, on the blocks of the last launch_blocks."""
        i32, i64, f32 = kernels.i32, kernels.i64, kernels.f32
        # the mma pass: FB its instance's, and its launch order; the FMA pass: FB an argument
        extra = (self.key_weight, self.group_order) if self.score_kernel == "mma" else (i32(self.FB), self.key_weight)
        launch(self._score, (self._grid_x, self.KVH, self.B),
               (q, kb, lengths, f32(self.scale), i32(self.H), i32(self.KVH), i64(self.L_max), i32(self.T_max),
                i32(self.tiles_per_block), *extra, scores, part_s))

    def key_fraction(self):
        """[B, KVH] float32 (a new CuPy array): the fraction of each K row's blocks read by the last
        launch, i.e. of its bytes (blocks are equal runs)."""
        return self.blocks_read.astype(np.float32) / np.float32(self.C)


MAX_TILES_PER_BLOCK = 8


def fit_tiles_per_block(tiles, groups, slots, overhead=0.5, max_tiles=MAX_TILES_PER_BLOCK) -> int:
    """Tiles per block of santa_score_keys: one block per run of c tiles of a (sequence, KV head),
    ``groups`` of them, ``slots`` resident blocks; kernels.run_length with one run a block and at
    most ``max_tiles`` (``overhead``: a block's prologue, the read list and weighted q)."""
    return kernels.run_length(tiles, groups, slots, runs_per_block=1, overhead=overhead, max_tiles=max_tiles)


KEY_RUN_WAVES = 4


def balanced_tiles_per_warp(tiles, groups, slots, waves=KEY_RUN_WAVES) -> int:
    """Tiles a warp of santa_score_keys_mma: kernels.tiles_per_warp (one wave of long runs for
    equal work), but short enough for ``waves`` waves of blocks. A group's cost follows the
    blocks its draws read (compact runs when one or two feature groups hold them), so in one wave
    the kernel takes as long as its most-read group (H200, B=16 32k, a quarter of K read: 216 us
    at 16 tiles a warp, where the average group's bytes take a third of that); with several waves
    the block scheduler evens them out."""
    fit = kernels.tiles_per_warp(tiles, groups, slots)
    even = -(-tiles * groups // (waves * slots * (kernels.THREADS // 32)))
    return max(1, min(fit, even))


def gpu_key_scores(q, kb, lengths, setting, *, step=0, layer=0, scale=None):
    """santa_cupy.key_scores on CuPy inputs (key_layout="blocked"): (scores [B, H, L_max] float32,
    -inf at positions >= lengths[b]; a KeySamplingInfo of CuPy arrays: group_fraction [B, KVH]
    float64 measured from the blocks read, expected_group_fraction, read [B, KVH, C] bool, prob
    = pi [B, KVH, C] float32, weight [B, KVH, C] float32, selected None; key_fraction a float, a
    host sync). q [B, H, D] fp16 / bf16, kb [B, KVH, NP, C, P, FB] (key_layout.to_blocked; L_max
    = NP * P, its rows rounded up to whole pages), lengths [B] integer in 1..L_max."""
    import cupy

    from santa_cupy.key_sampling import KeySamplingInfo

    if getattr(q, "ndim", 0) != 3 or getattr(kb, "ndim", 0) != 6 or getattr(lengths, "ndim", 0) != 1:
        raise ValueError(f"q must be [B, H, D], k_cache (blocked) [B, KVH, NP, C, P, FB], lengths [B]; got q "
                         f"{spec.describe(q)}, k_cache {spec.describe(kb)}, lengths {spec.describe(lengths)}")
    B, H, D = q.shape
    KVH, L_max = kb.shape[1], _key_layout.blocked_rows(kb.shape)
    spec._check_heads(H, KVH, D)
    dtype = spec.DTYPE_NAMES.get(np.dtype(q.dtype))
    check_gpu_key_setting(setting, dtype=dtype, head_dim=D, group=H // KVH)
    validate_blocked_keys(kb, batch=B, kv_heads=KVH, head_dim=D, max_length=L_max, key_block=setting.key_block,
                          dtype=dtype)
    if not q.flags.c_contiguous or tuple(lengths.shape) != (B,) or np.dtype(lengths.dtype).kind not in "iu":
        raise ValueError(f"q must be C-contiguous and lengths an integer [B={B}] array, got q {spec.describe(q)}, "
                         f"lengths {spec.describe(lengths)}")
    spec._check_length_values(lengths, L_max)
    scale = spec._resolve_scale(scale, D)
    block_n = setting.resolved_block_n(D)
    kp = KeyScorePass(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_max, dtype=dtype, block_n=block_n,
                      setting=setting, scale=scale)
    scores = cupy.full((B, H, L_max), -np.inf, cupy.float32)
    part_s = cupy.empty((B, H, kp.T_max, 4), cupy.float32)
    lens = cupy.ascontiguousarray(lengths, dtype=cupy.int32)
    kp.launch(q, kb, lens, cupy.full((1,), int(step), cupy.int64), int(layer), scores, part_s)
    group_fraction = kp.blocks_read.astype(cupy.float64) / kp.C
    n = lens.astype(cupy.float64).reshape(B, 1)
    pi = kp.key_pi.astype(cupy.float64)
    info = KeySamplingInfo(
        key_fraction=float((group_fraction * n).sum() / (n.sum() * KVH)),
        group_fraction=group_fraction,
        expected_group_fraction=(1.0 - (1.0 - pi) ** kp.R).mean(axis=-1),
        read=kp.key_weight > 0,
        feature_fraction=group_fraction,
        selected=None,
        prob=kp.key_pi,
        weight=kp.key_weight,
    )
    return scores, info


def check_blocked_setting(setting, paged=False):
    """ValueError unless ``setting`` reads a blocked K: block key sampling ("bernoulli_block"), or
    method "dense" without key sampling; never a paged cache. The one rule for decode_attention
    (both paths) and DecodePlan."""
    if setting.key_sampling != "bernoulli_block" and (setting.key_sampled or setting.method != "dense"):
        raise ValueError(f"key_layout='blocked' is read by block key sampling (it needs key_sampling='bernoulli_block') "
                         f"and by the dense kernel (method 'dense' without key sampling); the setting {str(setting)!r} "
                         "has neither: pass a standard [B, L_max, KVH, D] K (santa_cupy.key_layout.from_blocked)")
    if paged:
        raise ValueError("key_layout='blocked' has no paged form: pass a contiguous cache (no block_table, "
                         "page_size=None)")


def key_layout_choice(setting, key_layout, page_size, *, dtype, head_dim, group, head_offset=0, dense_kernel="auto"):
    """The plan's key layout, checked against its setting: key sampling on the GPU needs
    "blocked" (NotImplementedError saying so for "standard"); without key sampling "blocked" is
    method "dense" on the tensor-core kernel (check_dense_blocked, ValueError otherwise); a paged
    cache has no blocked form (ValueError); the GPU's limits of key sampling
    (key_pass.check_gpu_key_setting). dense_kernel: the plan's KernelChoice.dense_kernel."""
    key_layout = _check_key_layout(key_layout)
    if not setting.key_sampled:
        if key_layout == "blocked":
            check_dense_blocked(setting, dtype=dtype, head_dim=head_dim, page_size=page_size,
                                dense_kernel=dense_kernel)
        return key_layout
    if setting.method != "santa":
        raise NotImplementedError(f"key sampling on the GPU runs with method 'santa' (its value stage reads the "
                                  f"score pass's stash), got {setting.method!r}; method 'dense' with key sampling "
                                  "runs on the NumPy reference")
    check_gpu_key_setting(setting, dtype=dtype, head_dim=head_dim, group=group, head_offset=head_offset)
    if key_layout != "blocked":
        raise NotImplementedError(f"{BLOCKED_ONLY} (setting {setting})")
    check_blocked_setting(setting, paged=page_size is not None)
    return key_layout


def check_dense_blocked(setting, *, dtype, head_dim, page_size, dense_kernel="auto"):
    """ValueError unless the GPU runs ``setting`` (no key sampling) on a blocked K: method "dense"
    on the tensor-core kernel (decode_dense_mma_blocked: dtype and head_dim of
    kernels.mma_supported, dense_kernel "auto" | "mma") with a contiguous cache."""
    check_blocked_setting(setting, paged=page_size is not None)
    if not kernels.mma_supported(dtype, head_dim) or dense_kernel == "stream":
        raise ValueError(f"dense attention on a blocked K runs on the tensor-core kernel only: dtype in "
                         f"{kernels.MMA_DTYPES}, head_dim in {kernels.MMA_HEAD_DIMS}, dense_kernel 'auto' or 'mma'; "
                         f"got dtype={dtype!r}, head_dim={head_dim}, dense_kernel={dense_kernel!r} (pass a standard "
                         "[B, L_max, KVH, D] K: santa_cupy.key_layout.from_blocked)")


def _check_key_layout(value):
    return _key_layout.check_key_layout(value)


def check_standard_keys(k_cache):
    """A rank-6 K given to a plan or call without key_layout='blocked': ValueError saying so."""
    if getattr(k_cache, "ndim", 0) == 6:
        raise ValueError(f"k_cache has rank 6, the blocked key layout [B, KVH, NP, C, P, FB] "
                         f"({spec.describe(k_cache)}): pass key_layout='blocked' (with key_sampling='bernoulli_block' "
                         "or method 'dense'), or a standard [B, L_max, KVH, D] K")

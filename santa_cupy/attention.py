"""``decode_attention``: one decode step of attention in one call (NumPy or GPU arrays).

NumPy inputs run the float64 reference (santa_cupy.reference); CuPy inputs (or any GPU array that
speaks DLPack / ``__cuda_array_interface__``) run the CUDA kernels of cuda/ through a DecodePlan
(santa_cupy/plan.py), reused from a small cache across calls of one shape and setting.
"""

from __future__ import annotations

import collections
import threading

import numpy as np

from santa_cupy import interop, key_layout as key_layouts, key_pass, paged, reference, spec
from santa_cupy.info import AttentionInfo
from santa_cupy.key_pass import check_standard_keys
from santa_cupy.plan import DecodePlan
from santa_cupy.setting import AttentionSetting

__all__ = ["AttentionInfo", "DecodePlan", "clear_plan_cache", "decode_attention", "key_scores"]



@interop.accepts_stream
def decode_attention(q, k_cache, v_cache, lengths, setting=None, *, step=0, layer=0, scale=None, return_info=False,
                     return_counts=False, out=None, lse_hint=None, block_table=None, page_layout="NHD",
                     head_offset=0, key_layout="standard", **setting_fields):
    """One decode step of attention for every sequence and head.

    Parameters
    ----------
    q : [B, H, D]
        The queries; float16, bfloat16 (as uint16 bit patterns) or float32 (NumPy: also float64),
        the dtype of k and v. H a multiple of KVH, G = H // KVH in 1..16, D in (64, 128, 256).
    k_cache, v_cache : [B, L_max, KVH, D], C-contiguous
        The caches (or page pools, with ``block_table``).
    lengths : [B] integer
        Rows of each sequence, 1..L_max.
    setting : AttentionSetting or str or None
        The estimator (santa_cupy.AttentionSetting or its name, e.g. "dense",
        "systematic/global/S=256"); None: ``AttentionSetting()`` (santa, systematic, global, 256).
    **setting_fields
        method, samples, sampler, budget, seed, block_n, santa_min_length and the key-sampling
        fields (key_sampling, key_draws, key_block, key_budget, key_variance, key_rule,
        key_combine): change those fields of ``setting`` (``decode_attention(q, k, v, lengths,
        method="dense")``, ``decode_attention(..., key_sampling="bernoulli_block", key_budget=0.75)``).
    step, layer : int
        The RNG keys of this call besides the setting's seed (0..2**63-1, 0..2**31-1).
    scale : float or None
        Score scale; None: 1 / sqrt(D).
    return_info, return_counts : bool
        Return (o, AttentionInfo); with return_counts also the sample counts (GPU: a second pass).
    out : [B, H, D] of q's dtype, C-contiguous, or None
        Written and returned as o (CuPy or any zero-copy GPU array for GPU inputs, NumPy for NumPy).
    lse_hint : [B, H] float32 of q's library
        Budget "one_pass" only (santa_cupy/one_pass.py: rows taken with probability
        min(1, S exp(s - r)), one pass over the cache): a guess r of each head's log-sum-exp (any
        deterministic one keeps o unbiased; it sets the rows read, about S exp(lse - r));
        ``info.samples_drawn`` says how many.
    block_table : [B, max_pages] integer or None
        k_cache and v_cache are page pools instead (santa_cupy/paged.py), ``page_layout`` "NHD"
        [num_pages, page_size, KVH, D] (FlashInfer's and vLLM's) or "HND" [num_pages, KVH,
        page_size, D]; row j of sequence b is slot j % page_size of page block_table[b, j //
        page_size]. Pages may be shared, shuffled and partly filled; the outputs equal the
        contiguous call's on the gathered cache (L_max = max_pages * page_size). A bad table (a
        page id out of range, too few pages for a length) is a ValueError naming its first bad entry.
    head_offset : int
        The global index of q's first head: the head index of the RNG key of head 0 (tensor
        parallelism: a rank holding heads h0 .. h0 + H - 1 of a model passes h0 and draws the
        samples the whole model's heads draw); 0 otherwise.
    key_layout : str
        "standard" (k_cache [B, L_max, KVH, D]) or "blocked": k_cache is [B, KVH, NP, C, P, FB]
        (santa_cupy.key_layout.to_blocked), the layout block key sampling needs on the GPU
        (FB = key_block), which method "dense" without key sampling reads too (exact attention;
        FB = k_cache.shape[5]; on the GPU fp16 / bf16 at D 64 / 128); NumPy inputs take it as well
        (converted back for the reference). A rank-6 k_cache without key_layout="blocked" is a
        ValueError, and so is "blocked" without key_sampling="bernoulli_block" or method "dense",
        or with a block_table.

    Returns
    -------
    o : [B, H, D] of q's dtype
        An array the caller owns (``out`` if given), of q's array library.
    info : AttentionInfo, with return_info or return_counts
        Arrays the caller owns.

    Method "dense" is exact; "santa" samples ``samples`` value rows per head (``sampler`` iid |
    stratified | systematic, ``budget`` fixed | global | largest_remainder | one_pass),
    reproducibly from (seed, step, layer). On the GPU, sequences shorter than ``santa_min_length``
    run the exact kernel, where it is faster ("auto": the crossover of DecodePlan; 0: santa for
    every sequence; routes that cannot mix per sequence run exact throughout where L_max is below
    it); the NumPy reference always runs the estimator it was asked for. NaN/inf in q is a
    ValueError; NaN or +inf among a head's scores (NaN/inf in K within the length) makes that
    head's output NaN.

    Key sampling (``key_sampling`` "bernoulli" | "bernoulli_block", santa_cupy.key_sampling): the
    scores are estimated from part of K (keyed by (seed, step, layer) on their own RNG stream),
    then the value stage of ``method`` runs on them (dense: the exact softmax of the estimated
    scores; santa: SANTA sampling from them); ``info.lse`` is the estimated scores' and
    ``info.key_fraction`` the fraction of K read. NumPy inputs run every estimator in float64. On
    the GPU: "bernoulli_block" with method santa, rules uniform | qmax | qrms, fp16 / bf16 at head
    dim 64 / 128, K in key_layout="blocked" (santa_cupy/key_pass.py: the reference's blocks,
    scores in float32, only the selected K blocks read); other key-sampling settings, or a
    standard-layout K, raise NotImplementedError.

    On the GPU the call checks the lengths on the host (a sync) and reuses a DecodePlan from a
    cache of PLAN_CACHE_SIZE (keyed by device, stream, shape, dtype, scale, setting, paged
    layout; ``clear_plan_cache()`` frees them); o and info are copied out of the plan's buffers,
    so results of earlier calls stay valid. For a loop of calls without the checks and copies, or
    a CUDA graph, use a DecodePlan.
    """
    q, k_cache, v_cache, lengths = interop.as_arrays(q, k_cache, v_cache, lengths)
    out = interop.as_out(out)
    setting = AttentionSetting.from_fields(setting, **setting_fields)      # validates the fields
    blocked_k = None                      # the GPU's blocked K (k_cache then stands for its standard shape)
    if _blocked_keys(k_cache, v_cache, setting, key_layout, block_table):
        if not setting.key_sampled and getattr(k_cache, "ndim", 0) == 6 and k_cache.shape[5] in spec.KEY_BLOCKS:
            setting = setting.replace(key_block=int(k_cache.shape[5]))     # dense: the blocked K's own FB
        if spec.is_cupy_array(q):
            blocked_k, k_cache = k_cache, v_cache
        else:
            k_cache = key_layouts.from_blocked(k_cache, v_cache.shape[1])
    elif setting.key_sampled and spec.is_cupy_array(q):
        raise NotImplementedError(key_pass.BLOCKED_ONLY)
    method, samples, sampler, budget, seed = setting.method, setting.samples, setting.sampler, setting.budget, \
        setting.seed
    block_n = setting.resolved_block_n(q.shape[-1] if getattr(q, "ndim", 0) == 3 else None)
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
    if blocked_k is not None:
        key_pass.validate_blocked_keys(blocked_k, batch=shape.B, kv_heads=shape.KVH, head_dim=shape.D,
                                       max_length=shape.L_max, key_block=setting.key_block, dtype=shape.dtype_name)
        k_cache = blocked_k
    _check_int("step", step, 0, 2**63 - 1)
    _check_int("layer", layer, 0, 2**31 - 1)          # the kernels take it as a C int
    _check_int("head_offset", head_offset, 0, 2**31 - 1 - shape.H)
    one_pass = setting.one_pass
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
        if setting.key_sampled:
            result = _key_sampled_reference_call(q, k_cache, v_cache, lengths, shape, setting, step, layer, block_n,
                                                 return_info)
        elif one_pass:
            result = _one_pass_reference_call(q, k_cache, v_cache, lengths, shape, samples, hint, seed, step, layer,
                                              block_n, return_info, head_offset)
        else:
            result = _reference_call(q, k_cache, v_cache, lengths, shape, method, samples, sampler, budget,
                                     seed, step, layer, block_n, return_info, head_offset)
        return result if out is None else _into_numpy_out(result, out, return_info)
    import cupy
    table = None if pages is None else cupy.ascontiguousarray(block_table, dtype=cupy.int32)
    hint = cupy.ascontiguousarray(hint, dtype=cupy.float32) if one_pass else None
    key = (cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr, shape.B, shape.H, shape.KVH, shape.D,
           shape.L_max, shape.dtype_name, shape.scale, setting, None if pages is None else pages[1], page_layout,
           head_offset, key_layout)
    with _plans.lock:                     # one caller at a time on a cached plan's workspaces
        plan = _plans.get(key, lambda: DecodePlan(
            batch=shape.B, heads=shape.H, kv_heads=shape.KVH, head_dim=shape.D, max_length=shape.L_max,
            dtype=shape.dtype_name, setting=setting, scale=shape.scale, step=step,
            page_size=None if pages is None else pages[1], page_layout=page_layout, head_offset=head_offset,
            key_layout=key_layout))
        plan.step.fill(step)              # the plan's device step counter (a cached plan's is the last call's)
        o = plan.run(q, k_cache, v_cache, lengths, layer=layer, out=out, validate=False, lse_hint=hint,
                     block_table=table)
        if out is None:                   # the next call with this key overwrites the plan's buffers
            o = o.copy()
        if not (return_info or return_counts):
            return o
        info = _owned(plan.info())
        if return_counts and method == "santa" and not one_pass:
            info.counts = plan.sample_counts(q, k_cache, lengths, layer=layer, block_table=table)
    return o, info


def key_scores(q, k_cache, lengths, setting=None, *, step=0, layer=0, scale=None, out_dtype=np.float32,
               key_layout="standard", **setting_fields):
    """The estimated scaled scores of a key-sampling setting: [B, H, L_max] ``out_dtype`` (float32
    by default, or float64; -inf at positions >= lengths[b]) and the KeySamplingInfo
    (santa_cupy.key_sampling: ``key_fraction``, the pieces read, the inclusion probabilities).

    NumPy inputs as decode_attention's (q [B, H, D], k_cache [B, L_max, KVH, D], lengths [B]);
    ``setting`` an AttentionSetting or its name (None: the defaults), ``setting_fields`` change its
    fields (``key_scores(q, k, lengths, key_sampling="bernoulli", key_draws=8)``); only the
    key-sampling fields and the seed matter here (key_sampling "none": the exact scores). The
    random numbers are decode_attention's for the same setting, step and layer, so these are the
    scores its key-sampled call attends over. For tests and for one's own estimators on the
    scores.

    ``key_layout`` "blocked": k_cache is [B, KVH, NP, C, P, FB] (santa_cupy.key_layout.to_blocked),
    and the scores have its NP * P rows (L_max rounded up to whole pages; -inf past lengths as
    ever). CuPy inputs need it and run the GPU's score pass (santa_cupy/key_pass.py: key_sampling
    "bernoulli_block", rules uniform | qmax | qrms, fp16 / bf16, head dim 64 / 128): scores
    [B, H, L_max] float32 CuPy (the plan's stash; -inf past lengths) and a KeySamplingInfo of CuPy
    arrays (pi, the blocks read and their weights bit for bit the reference's; ``selected`` None);
    out_dtype must then be float32."""
    from santa_cupy import key_sampling

    setting = AttentionSetting.from_fields(setting, **setting_fields)
    key_layouts.check_key_layout(key_layout)
    if spec.is_cupy_array(q):
        if key_layout != "blocked":
            raise NotImplementedError(key_pass.BLOCKED_ONLY)
        if np.dtype(out_dtype) != np.float32:
            raise ValueError(f"the GPU's key scores are float32, got out_dtype={out_dtype!r}")
        return key_pass.gpu_key_scores(q, k_cache, lengths, setting, step=step, layer=layer, scale=scale)
    if key_layout == "blocked":
        k_cache = key_layouts.from_blocked(k_cache)
    else:
        check_standard_keys(k_cache)
    return key_sampling.key_scores(q, k_cache, lengths, seed=setting.seed, step=step, layer=layer, scale=scale,
                                   out_dtype=out_dtype, **setting.key_options)


class _PlanCache:
    """decode_attention's plans, least recently used last out: keyed by the device, the stream,
    the shape, dtype, scale, setting and paged layout (``clear_plan_cache`` empties it)."""

    def __init__(self, size):
        self.size, self.plans, self.lock = size, collections.OrderedDict(), threading.RLock()

    def get(self, key, make):
        plan = self.plans.pop(key, None)
        if plan is None:
            plan = make()
        self.plans[key] = plan
        while len(self.plans) > self.size:
            self.plans.popitem(last=False)
        return plan

    def clear(self):
        with self.lock:
            self.plans.clear()


PLAN_CACHE_SIZE = 8
_plans = _PlanCache(PLAN_CACHE_SIZE)


def clear_plan_cache() -> None:
    """Drop the DecodePlans that ``decode_attention`` keeps for reuse (up to PLAN_CACHE_SIZE, one
    per device, stream, shape, dtype, scale, setting and paged layout), freeing their workspaces
    (to CuPy's memory pool)."""
    _plans.clear()


def _blocked_keys(k_cache, v_cache, setting, key_layout, block_table) -> bool:
    """Whether k_cache is in the blocked layout (key_layout "blocked"), after the checks: a rank-6
    K without it, "blocked" without block key sampling or method "dense" (no key sampling), or
    with a block table: ValueError."""
    key_layouts.check_key_layout(key_layout)
    if key_layout == "standard":
        check_standard_keys(k_cache)
        return False
    key_pass.check_blocked_setting(setting, paged=block_table is not None)
    return True


def _owned(info: AttentionInfo) -> AttentionInfo:
    """Copies of a plan's info() views (a cached plan's buffers are the next call's)."""
    def copy(x):
        import cupy
        return None if x is None else cupy.array(x, copy=True)
    return AttentionInfo(lse=copy(info.lse), rows_read=copy(info.rows_read), spread=copy(info.spread),
                         counts=info.counts, dense_fallback=copy(info.dense_fallback),
                         samples_drawn=copy(info.samples_drawn),
                         key_fraction=copy(info.key_fraction) if info.key_fraction is not None else
                         _gpu_all_of_k(info.rows_read.shape))


def _gpu_all_of_k(shape):
    """info.key_fraction of a GPU call (no key sampling there): ones [B, KVH] float32."""
    import cupy
    return cupy.ones(shape, dtype=cupy.float32)


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


def _all_of_k(shape):
    """info.key_fraction without key sampling: every K byte read."""
    return np.ones((shape.B, shape.KVH), np.float32)


def _reference_call(q, k_cache, v_cache, lengths, shape, method, samples, sampler, budget, seed, step,
                    layer, block_n, return_info, head_offset=0):
    out_dtype = shape.dtype_name
    if method == "dense":
        o, lse = reference.dense_attention(q, k_cache, v_cache, lengths, shape.scale)
        info = AttentionInfo(lse=lse.astype(np.float32),
                             rows_read=np.repeat(np.asarray(lengths, np.int32)[:, None], shape.KVH, axis=1),
                             spread=np.zeros((shape.B, shape.H), np.float32), dense_fallback=np.ones(shape.B, bool),
                             key_fraction=_all_of_k(shape))
    else:
        o, lse, rows_read, spread, counts = reference.santa_attention(
            q, k_cache, v_cache, lengths, samples=samples, sampler=sampler, budget=budget, seed=seed,
            step=step, layer=layer, scale=shape.scale, block_n=block_n, head_offset=head_offset)
        info = AttentionInfo(lse=lse.astype(np.float32), rows_read=rows_read,
                             spread=spread.astype(np.float32), counts=counts, dense_fallback=np.zeros(shape.B, bool),
                             key_fraction=_all_of_k(shape))
    o = o if out_dtype == "float64" else spec.from_float32(o.astype(np.float32), out_dtype, np)
    return (o, info) if return_info else o


def _key_sampled_reference_call(q, k_cache, v_cache, lengths, shape, setting, step, layer, block_n, return_info):
    """Key sampling on the reference (santa_cupy.key_sampling.key_sampled_attention): the value
    stage of setting.method on the estimated scores."""
    from santa_cupy import key_sampling

    dense = setting.method == "dense"
    o, lse, ks, counts, spread = key_sampling.key_sampled_attention(
        q, k_cache, v_cache, lengths, value="dense" if dense else "santa", samples=setting.samples,
        sampler=setting.sampler, budget=setting.budget, block_n=block_n, seed=setting.seed, step=step, layer=layer,
        scale=shape.scale, return_spread=True, **setting.key_options)
    out_dtype = shape.dtype_name
    o = o if out_dtype == "float64" else spec.from_float32(o.astype(np.float32), out_dtype, np)
    if not return_info:
        return o
    B, KVH, G = shape.B, shape.KVH, shape.G
    if dense:
        rows_read = np.repeat(np.asarray(lengths, np.int32)[:, None], KVH, axis=1)
    else:
        rows_read = (counts.reshape(B, KVH, G, -1) > 0).any(axis=2).sum(axis=-1).astype(np.int32)
    info = AttentionInfo(lse=lse.astype(np.float32), rows_read=rows_read, spread=spread.astype(np.float32),
                         counts=counts, dense_fallback=np.full(B, dense),
                         key_fraction=ks.group_fraction.astype(np.float32))
    return o, info


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
                         samples_drawn=op.selected.sum(-1).astype(np.int32), key_fraction=_all_of_k(shape))
    return o, info



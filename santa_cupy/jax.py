"""santa-cupy's decode attention inside ``jax.jit``, on JAX GPU arrays, without copies.

    import jax, jax.numpy as jnp
    from santa_cupy import jax as santa_jax

    @jax.jit
    def step_fn(q, k_cache, v_cache, lengths, step):
        return santa_jax.decode_attention(q, k_cache, v_cache, lengths, step, samples=256)

Mechanism: ``jax.experimental.buffer_callback.buffer_callback`` (JAX >= 0.7; checked against
0.11). XLA lowers it to a custom call whose handler, at run time, calls a Python function with the
operands' and results' device buffers and an execution context whose ``stream`` property is XLA's
CUDA stream. That function wraps the buffers as CuPy arrays (raw pointers, no copy, no sync) and
launches santa-cupy's kernels on XLA's stream through a cached ``DecodePlan`` writing straight into
the result buffer. It needs no compiled extension, so santa-cupy stays a pure-Python, torch-free
wheel; the XLA FFI proper (``jax.ffi.ffi_call``) would need a C++ handler built per CUDA / jaxlib
version. The price is a Python call per execution (a few tens of µs of host time, overlapped with
the GPU work of earlier steps since nothing synchronises).

Importing this module does not import JAX or CuPy; calling ``decode_attention`` without them is a
ModuleNotFoundError saying what to install. ``import santa_cupy`` never imports this module.
"""

from __future__ import annotations

import math
import threading

import numpy as np

from santa_cupy import spec
from santa_cupy.setting import AttentionSetting

_PLANS = {}                      # (device id, shape, dtype, settings) -> DecodePlan
_PLANS_LOCK = threading.Lock()
_STORAGE = {"float16": np.dtype(np.float16), "bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32)}
_MEMCPY_D2D = 3                  # cudaMemcpyDeviceToDevice


def _import_jax():
    try:
        import jax                       # absolute import: the real JAX, not this module
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as exc:
        raise ModuleNotFoundError(
            "santa_cupy.jax needs JAX with CUDA (pip install 'jax[cuda13]' or 'jax[cuda12]', JAX >= 0.7 "
            f"for jax.experimental.buffer_callback): {exc}") from None
    return jax, buffer_callback


def _import_cupy():
    try:
        import cupy
    except ImportError:
        raise ModuleNotFoundError(
            "santa_cupy.jax launches santa-cupy's CUDA kernels through CuPy (pip install "
            "'santa-cupy[cuda13]' or 'santa-cupy[cuda12]')") from None
    return cupy


def decode_attention(q, k_cache, v_cache, lengths, step, *, setting=None, layer=0, scale=None, return_lse=False,
                     command_buffer=False, block_table=None, page_layout="NHD", **setting_fields):
    """One decode step of attention on JAX GPU arrays; traceable (``jax.jit``), no copies, no host sync.

    q [B, H, D]; k_cache, v_cache [B, L_max, KVH, D]; lengths [B] int32 (other integer dtypes are
    cast), each sequence's valid rows (1..L_max, not checked under jit: 0 gives o = 0).
    Paged caches: ``block_table`` [B, max_pages] int32 (a traced operand, like lengths) with page
    pools k_cache, v_cache [num_pages, page_size, KVH, D] (``page_layout="NHD"``, FlashInfer's
    and vLLM's) or [num_pages, KVH, page_size, D] ("HND"): row j of sequence b is slot
    j % page_size of page block_table[b, j // page_size]; L_max = max_pages * page_size. Under
    jit the table is not validated (an id out of range reads out of bounds): validate it with
    ``santa_cupy.paged.validate_block_table`` where it is built.
    dtypes: jnp.float16, jnp.bfloat16 (bit-cast to uint16 for the kernels and back, free) or
    jnp.float32, the same for q, k and v.
    step: the RNG step as a JAX integer scalar (shape () or (1,); int32/uint32 or, with x64,
    int64/uint64), an operand of the jitted computation, so a function traced once draws fresh
    samples for each step it is given; it is copied into the plan's device counter on XLA's stream
    (a 4-byte step is read as unsigned: steps 0..2^32-1).
    setting: a santa_cupy.AttentionSetting or its name (None: the default), ``setting_fields``
    (method, samples, sampler, budget, seed, block_n, santa_min_length) changing its fields; the
    budgets with a second pass only (not one_pass). The setting and the other keywords are static
    (changing them retraces) and mean what they mean for ``santa_cupy.decode_attention``: same
    (seed, step, layer) give the same samples as the eager CuPy call. Returns o [B, H, D] in q's dtype, or (o, lse [B, H] float32) with ``return_lse``.

    One DecodePlan per (device, shapes, dtype, settings) is built on the first execution (kernels
    compiled then) and reused; not differentiable; not batched under ``jax.vmap``.
    ``command_buffer`` (off by default): let XLA record the callback's launches into its command
    buffer (``buffer_callback(..., command_buffer_compatible=True)``), so the Python body runs when
    XLA records, not at every execution (measured on the H200: the same outputs, fresh samples per
    step, no faster at B=16 32k).
    """
    jax, buffer_callback = _import_jax()
    _import_cupy()
    jnp = jax.numpy
    dtype_name = _dtype_name(jnp, q, k_cache, v_cache)
    page_size = None
    if block_table is None:
        B, H, KVH, D, L_max = _check_shapes(q, k_cache, v_cache, lengths)
    else:
        B, H, KVH, D, L_max, page_size = _check_paged_shapes(q, k_cache, v_cache, lengths, block_table,
                                                             page_layout)
        if block_table.dtype != jnp.int32:
            block_table = block_table.astype(jnp.int32)
    setting = AttentionSetting.from_fields(setting, **setting_fields)        # its checks
    spec.check_choice("budget", setting.budget, spec.BUDGETS)                # no one_pass here (yet)
    setting = setting.replace(block_n=setting.resolved_block_n(D))
    _check_static_int("layer", layer, 0, 2**31 - 1)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    step = _step_operand(jnp, step)
    if lengths.dtype != jnp.int32:
        lengths = lengths.astype(jnp.int32)
    if dtype_name == "bfloat16":
        q, k_cache, v_cache = (jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (q, k_cache, v_cache))
    key = (B, H, KVH, D, L_max, dtype_name, setting, scale, np.dtype(step.dtype).itemsize, page_size, page_layout)
    results = [jax.ShapeDtypeStruct((B, H, D), _STORAGE[dtype_name])]
    if return_lse:
        results.append(jax.ShapeDtypeStruct((B, H), np.float32))

    def callback(ctx, outs, *bufs):          # q, k, v, lengths, step (, block_table)
        _run_plan(ctx, outs, bufs, key, int(layer))

    operands = (q, k_cache, v_cache, lengths, step) + (() if block_table is None else (block_table,))
    outs = buffer_callback(callback, results, command_buffer_compatible=bool(command_buffer))(*operands)
    o = outs[0]
    if dtype_name == "bfloat16":
        o = jax.lax.bitcast_convert_type(o, jnp.bfloat16)
    return (o, outs[1]) if return_lse else o


def _dtype_name(jnp, q, k_cache, v_cache):
    names = {jnp.dtype(jnp.float16): "float16", jnp.dtype(jnp.bfloat16): "bfloat16",
             jnp.dtype(jnp.float32): "float32"}
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be a JAX array, got {type(x).__name__}")
        if jnp.dtype(x.dtype) not in names:
            raise ValueError(f"{name} must be float16, bfloat16 or float32, got {x.dtype}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache and v_cache must share one dtype, got {q.dtype}, {k_cache.dtype}, "
                         f"{v_cache.dtype}")
    return names[jnp.dtype(q.dtype)]


def _check_shapes(q, k_cache, v_cache, lengths):
    if len(q.shape) != 3:
        raise ValueError(f"q must be [B, H, D], got shape {tuple(q.shape)}")
    B, H, D = q.shape
    if len(k_cache.shape) != 4 or k_cache.shape[0] != B or k_cache.shape[3] != D:
        raise ValueError(f"k_cache must be [B, L_max, KVH, D] = [{B}, L_max, KVH, {D}], got shape "
                         f"{tuple(k_cache.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, got {tuple(v_cache.shape)}")
    if not hasattr(lengths, "shape") or tuple(lengths.shape) != (B,) or \
            not np.issubdtype(np.dtype(lengths.dtype), np.integer):
        raise ValueError(f"lengths must be an integer array of shape ({B},), got "
                         f"{getattr(lengths, 'dtype', type(lengths).__name__)} {getattr(lengths, 'shape', '')}")
    L_max, KVH = k_cache.shape[1], k_cache.shape[2]
    if B < 1 or H < 1 or L_max < 1 or KVH < 1:
        raise ValueError(f"empty shapes are not supported: B={B}, H={H}, L_max={L_max}, KVH={KVH}")
    if D not in spec.HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {spec.HEAD_DIMS}, got {D}")
    if H % KVH or not 1 <= H // KVH <= spec.MAX_G:
        raise ValueError(f"heads must be a multiple of kv_heads with heads // kv_heads in 1..{spec.MAX_G}, "
                         f"got heads={H}, kv_heads={KVH}")
    return int(B), int(H), int(KVH), int(D), int(L_max)


def _check_paged_shapes(q, k_cache, v_cache, lengths, block_table, page_layout):
    """(B, H, KVH, D, L_max, page_size) of a paged call: the block table's shape here (a traced
    operand: its values are not read), every other check spec's for page pools (the eager path's)."""
    spec.check_choice("page_layout", page_layout, spec.PAGE_LAYOUTS)
    B = q.shape[0] if len(q.shape) == 3 else None
    if not hasattr(block_table, "shape") or len(block_table.shape) != 2 or block_table.shape[0] != B or \
            block_table.shape[1] < 1 or not np.issubdtype(np.dtype(block_table.dtype), np.integer):
        raise ValueError(f"block_table must be an integer array [B, max_pages] = [{B}, max_pages], got "
                         f"{spec.describe(block_table)}")
    page_size = spec.page_shape(k_cache, page_layout)[1]
    B, H, KVH, _, D, L_max = spec._check_page_shapes(q, k_cache, v_cache, lengths, page_layout,
                                                     int(block_table.shape[1]) * page_size)
    return int(B), int(H), int(KVH), int(D), L_max, int(page_size)


def _check_static_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a Python integer (static under jit), got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def _step_operand(jnp, step):
    """The step as a 0-d integer array of 4 or 8 bytes (a Python int becomes int32)."""
    step = jnp.asarray(step)
    if not np.issubdtype(np.dtype(step.dtype), np.integer):
        raise TypeError(f"step must be an integer scalar array (the RNG step), got dtype {step.dtype}")
    if step.size != 1 or step.ndim > 1:
        raise ValueError(f"step must be a scalar (shape () or (1,)), got shape {tuple(step.shape)}")
    step = step.reshape(())
    if np.dtype(step.dtype).itemsize not in (4, 8):
        step = step.astype(jnp.int32)
    return step


def _stream_of(ctx):
    stream = ctx.stream                  # a read-only property in jaxlib (ExecutionContext.stream)
    return int(stream() if callable(stream) else stream)


def _view(cupy, buf, device):
    """A CuPy array over an XLA buffer (raw pointer, shape, dtype; row-major as XLA's custom calls get
    them). Not through cupy.asarray: no stream handling, no pointer query."""
    ptr = buf.__cuda_array_interface__["data"][0]
    dtype = np.dtype(buf.dtype)
    shape = tuple(buf.shape)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    mem = cupy.cuda.UnownedMemory(ptr, nbytes, buf, device)
    return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, 0))


def _plan_for(cupy, key, device):
    plan = _PLANS.get((device,) + key)
    if plan is not None:
        return plan
    from santa_cupy.plan import DecodePlan

    (B, H, KVH, D, L_max, dtype_name, setting, scale, _, page_size, page_layout) = key
    with _PLANS_LOCK:
        plan = _PLANS.get((device,) + key)
        if plan is None:
            # built on XLA's stream (the caller's scope), so its buffers' initialisation is ordered
            # before the first run
            plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_max, dtype=dtype_name,
                              setting=setting, scale=scale, step=0, page_size=page_size, page_layout=page_layout)
            _PLANS[(device,) + key] = plan
    return plan


def _run_plan(ctx, outs, bufs, key, layer):
    """The buffer callback's body: on XLA's stream, copy the step into the plan's counter, run the
    plan into the result buffer (and copy lse out)."""
    cupy = _import_cupy()
    stage = ctx.stage() if callable(ctx.stage) else ctx.stage
    if getattr(stage, "name", "EXECUTE") != "EXECUTE":
        return
    try:
        q_ptr = bufs[0].__cuda_array_interface__["data"][0]
    except Exception as exc:             # a CPU buffer: JAX is not running this on a CUDA GPU
        raise RuntimeError(f"santa_cupy.jax.decode_attention runs on CUDA GPUs only; its operands are "
                           f"not CUDA buffers ({exc})") from exc
    stream_ptr = _stream_of(ctx)
    device = cupy.cuda.runtime.pointerGetAttributes(q_ptr).device
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(stream_ptr):
        plan = _plan_for(cupy, key, device)
        q, k, v, lengths = (_view(cupy, b, device) for b in bufs[:4])
        step_buf = bufs[4]
        step_bytes = np.dtype(step_buf.dtype).itemsize
        # plan.step is int64 [1], its high word 0 from the start: a 4-byte step fills the low word
        # (little-endian), an 8-byte one the whole
        cupy.cuda.runtime.memcpyAsync(plan.step.data.ptr, step_buf.__cuda_array_interface__["data"][0],
                                      step_bytes, _MEMCPY_D2D, stream_ptr)
        o = _view(cupy, outs[0], device)
        table = _view(cupy, bufs[5], device) if len(bufs) > 5 else None
        plan.run(q, k, v, lengths, layer=layer, out=o, validate=False, block_table=table)
        if len(outs) > 1:
            lse_ptr = outs[1].__cuda_array_interface__["data"][0]
            cupy.cuda.runtime.memcpyAsync(lse_ptr, plan.lse.data.ptr, plan.lse.nbytes, _MEMCPY_D2D, stream_ptr)


def clear_plans():
    """Drop the cached plans (their GPU workspaces go back to CuPy's pool)."""
    with _PLANS_LOCK:
        _PLANS.clear()

"""The decoder's own kernels (cuda/gemv.cu, cuda/decoder.cu, cuda/sample_tokens.cu), for llama_min's
GPU decode step and ``bench e2e``: weight products for a few tokens, the small steps between them
(RMSNorm, rotary + K/V append, SiLU * up) as one launch each, or the last two inside the product
before them (gemv_rope, gemv_glu), and the next token from the logits (sample_tokens).

One module holds every instance (``instance_names``); CI compiles it for every architecture
(tools/compile_kernels.py). All functions take CuPy arrays, launch on the current stream and never
synchronise with the host, so a decode step built from them can be captured as a CUDA graph.
bfloat16 travels as uint16 bits (the ``kv_dtype`` argument says so). CPU references:
llama_min/reference.py (weight_product, rms_norm, rope_append, silu_mul) and
llama_min/sampling.py (sample_reference).
"""

from __future__ import annotations

import functools

import numpy as np

from santa_cupy.kernels import NVRTC_OPTIONS, STORAGE_TYPE, build_source, launch, register_kernel
from santa_cupy.spec import KEY_BLOCKS
from santa_cupy.kernels import THREADS as GEMV_THREADS      # gemv.cu blocks: SC_NTHREADS

SOURCE_FILES = ("common.cuh", "decoder_math.cuh", "gemv.cu", "decoder.cu", "sample_tokens.cu")
THREADS = 256                    # SC_DECODER_THREADS (decoder.cu)
RMS_THREADS = 1024               # SC_RMS_THREADS
SAMPLE_THREADS = 1024            # SC_SAMPLE_THREADS (sample_tokens.cu)
GEMV_DTYPES = ("float16", "bfloat16")
GEMV_TOKENS = (1, 2, 4)          # gemv instances by NB: n tokens take the smallest NB >= n
# llama_min's default: gemv for one token, cuBLAS beyond (bench products, H200: gemv 1.00-1.22x
# cuBLAS at 1 token on every 8B matrix; 0.85-1.05x at 2; 0.68-0.83x at 4).
GEMV_AUTO_TOKENS = 1
GEMV_ROWS = 2                    # SC_GEMV_ROWS: rows per warp (v1 "rows") / per block (v2 "split")
GEMV_KERNELS = {"split": "gemv_split", "rows": "gemv_rows"}     # v2 (default), v1
GEMV_ROWS_PER_BLOCK = {"split": GEMV_ROWS, "rows": (GEMV_THREADS // 32) * GEMV_ROWS}
PRODUCT_DTYPES = ("float32", "float16")          # a weight product's output (matmul dtype, or f32)
KV_DTYPES = tuple(STORAGE_TYPE)                  # float32, float16, bfloat16
SILU_BLOCKS_PER_SM = 2           # silu_mul's grid, grid-stride beyond
MAX_PAGE_SIZE = 256              # paged caches (rope_append, gemv_rope): page sizes 1..256, as santa_cupy.paged


@functools.lru_cache(maxsize=None)
def instance_names() -> dict[tuple, str]:
    """Every template instance of the module, by key: (gemv kernel, dtype, nb), ("gemv_rope", dtype, kv, nb),
    ("gemv_glu", dtype, nb), ("rms_norm", out), ("rope_append", product, kv), ("silu_mul", product, out),
    ("sample_tokens", "float32") (the logits' dtype: one instance)."""
    t = STORAGE_TYPE
    names = {(k, d, nb): f"{fn}<{t[d]}, {nb}>" for k, fn in GEMV_KERNELS.items() for d in GEMV_DTYPES
             for nb in GEMV_TOKENS}
    names |= {("gemv_rope", d, kv, nb): f"gemv_rope<{t[d]}, {t[kv]}, {nb}>" for d in GEMV_DTYPES
              for kv in GEMV_DTYPES for nb in GEMV_TOKENS}
    names |= {("gemv_glu", d, nb): f"gemv_glu<{t[d]}, {t[d]}, {nb}>" for d in GEMV_DTYPES for nb in GEMV_TOKENS}
    names |= {("rms_norm", o): f"rms_norm<{t[o]}>" for o in PRODUCT_DTYPES}
    names |= {("rope_append", p, kv): f"rope_append<{t[p]}, {t[kv]}>" for p in PRODUCT_DTYPES for kv in KV_DTYPES}
    names |= {("silu_mul", p, o): f"silu_mul<{t[p]}, {t[o]}>" for p in PRODUCT_DTYPES for o in PRODUCT_DTYPES}
    names[("sample_tokens", "float32")] = "sample_tokens<float>"
    return names


def source() -> tuple[str, list[str]]:
    """(source text, name expressions): what NVRTC compiles, here and in CI."""
    names = list(instance_names().values())
    return build_source(SOURCE_FILES) + "\n// instances: " + "; ".join(names) + "\n", names


@functools.lru_cache(maxsize=None)
def _module():
    import cupy

    text, names = source()
    return cupy.RawModule(code=text, options=NVRTC_OPTIONS, name_expressions=names)


@functools.lru_cache(maxsize=None)
def _kernel(key: tuple):
    """One instance (cached: no module lookups per decode step), its launches checked against its
    C declaration (santa_cupy.kernels.register_kernel)."""
    name = instance_names()[key]
    return register_kernel(_module().get_function(name), source()[0], name)


@functools.lru_cache(maxsize=None)
def _sm_count() -> int:
    import cupy

    return cupy.cuda.Device().attributes["MultiProcessorCount"]


def _dtype_name(a, kv_dtype: str | None = None) -> str:
    if a.dtype == np.uint16 and kv_dtype == "bfloat16":
        return "bfloat16"
    name = np.dtype(a.dtype).name
    if name not in STORAGE_TYPE or (kv_dtype is not None and name != kv_dtype):
        raise ValueError(f"array of dtype {a.dtype} where {kv_dtype or 'float32/float16'} was expected")
    return name


def _check_out(out, shape, dtype, what):
    import cupy

    if out is None:
        return cupy.empty(shape, dtype)
    if (not isinstance(out, cupy.ndarray) or out.dtype != dtype or out.shape != tuple(shape)
            or not out.flags.c_contiguous):
        raise ValueError(f"{what} needs out as a C-contiguous {np.dtype(dtype).name} cupy array of shape "
                         f"{tuple(shape)}, got {type(out).__name__} {getattr(out, 'dtype', '?')} "
                         f"{getattr(out, 'shape', '?')}")
    return out


def gemv(x, w, out=None, accumulate=False, kernel="split"):
    """y [n, N] float32 = x [n, K] @ w [N, K].T (or out += that, accumulate=True) for 16-bit x, w
    (C-contiguous and 16-byte aligned, one dtype: float16, or bfloat16 as uint16 bits),
    n <= max(GEMV_TOKENS), K % 8 == 0. kernel: a key of GEMV_KERNELS (v2 "split", v1 "rows")."""
    import cupy

    dtype_name, nb = _gemv_operands(x, w, "gemv")
    n, K = x.shape
    N = w.shape[0]
    if accumulate and out is None:
        raise ValueError("gemv: accumulate=True needs out (the array to add to)")
    if kernel not in GEMV_KERNELS:
        raise ValueError(f"gemv: kernel must be one of {tuple(GEMV_KERNELS)}, got {kernel!r}")
    y = _check_out(out, (n, N), cupy.float32, "gemv")
    launch(_kernel((kernel, dtype_name, nb)), (-(-N // GEMV_ROWS_PER_BLOCK[kernel]),),
           (w, x, y, np.int32(N), np.int32(K), np.int32(n), np.int32(bool(accumulate))), threads=GEMV_THREADS)
    return y


def _gemv_operands(x, w, what: str):
    """(dtype name, NB instance) of a gemv product x [n, K] @ w [N, K].T, or ValueError."""
    n, K = x.shape
    if x.dtype != w.dtype or w.dtype.itemsize != 2 or w.ndim != 2 or w.shape[1] != K or K % 8 \
            or not 1 <= n <= GEMV_TOKENS[-1] or not (x.flags.c_contiguous and w.flags.c_contiguous) \
            or x.data.ptr % 16 or w.data.ptr % 16:
        raise ValueError(f"{what} needs C-contiguous, 16-byte aligned 16-bit x [n <= {GEMV_TOKENS[-1]}, K] and "
                         f"w [N, K] of one dtype with K % 8 == 0, got x {x.dtype} {x.shape}, w {w.dtype} {w.shape}")
    return ("float16" if w.dtype == np.float16 else "bfloat16"), next(b for b in GEMV_TOKENS if b >= n)


def _rope_operands_ok(n, kv_heads, cos, sin, pos, k_cache, v_cache, block_table=None, key_block=None) -> bool:
    """The rotary + K/V append's operands for n tokens: C-contiguous caches of one dtype (D even),
    [n, L_max, kv_heads, D], or page pools [num_pages, page_size, kv_heads, D] (page_size 1..256)
    with block_table [n, max_pages] int32 C-contiguous, or with key_block FB (16 | 32, no table) a
    feature-blocked k_cache [n, kv_heads, NP, D / FB, P, FB] (key_layout.blocked_shape) beside v_cache [n, L_max, kv_heads, D];
    cos and sin [P, D/2] float32, pos [n] int32."""
    import cupy

    from santa_cupy.key_layout import blocked_shape

    D = v_cache.shape[-1]
    if key_block is not None:
        cache_ok = (block_table is None and key_block in KEY_BLOCKS and v_cache.ndim == 4 and v_cache.shape[0] == n
                    and D % key_block == 0 and k_cache.shape == blocked_shape(v_cache.shape, key_block))
        k_shape = v_cache.shape
    elif block_table is None:
        cache_ok = k_cache.ndim == 4 and k_cache.shape[0] == n and v_cache.shape == k_cache.shape
        k_shape = k_cache.shape
    else:
        cache_ok = (k_cache.ndim == 4 and 1 <= k_cache.shape[1] <= MAX_PAGE_SIZE and isinstance(block_table, cupy.ndarray)
                    and block_table.dtype == cupy.int32 and block_table.ndim == 2 and block_table.shape[0] == n
                    and block_table.shape[1] >= 1 and block_table.flags.c_contiguous
                    and v_cache.shape == k_cache.shape)
        k_shape = k_cache.shape
    return (cache_ok and D % 2 == 0 and k_shape[2] == kv_heads
            and v_cache.dtype == k_cache.dtype and cos.ndim == 2 and cos.shape[1] == D // 2
            and sin.shape == cos.shape and cos.dtype == cupy.float32 and sin.dtype == cupy.float32
            and pos.shape == (n,) and pos.dtype == cupy.int32
            and all(a.flags.c_contiguous for a in (cos, sin, pos, k_cache, v_cache)))


def _rope_operands_seen(cos, pos, k_cache, v_cache, heads, kv_heads, block_table=None, key_block=None) -> str:
    """What _rope_operands_ok was given, for the error message."""
    table = "" if block_table is None else (f", block_table {getattr(block_table, 'dtype', type(block_table).__name__)} "
                                            f"{getattr(block_table, 'shape', '?')}")
    blocked = "" if key_block is None else f", key_block {key_block!r}"
    return (f"k {k_cache.dtype} {k_cache.shape}, v {v_cache.shape}, cos {cos.dtype} {cos.shape}, "
            f"pos {pos.dtype} {pos.shape}{table}{blocked} (H={heads}, KVH={kv_heads})")


_CACHE_FORMS = ("caches [n, L_max, KVH, D] (or page pools [num_pages, page_size, KVH, D] with block_table "
                "[n, max_pages] int32, or with key_block FB a blocked k_cache [n, KVH, NP, D / FB, P, FB])")


def _cache_address(v_cache, block_table, pos, key_block=None) -> tuple:
    """The kernels' row-address arguments (L_max, block_table, max_pages, page_size, key_block):
    contiguous caches [n, L_max, KVH, D] with page_size 0 (the table argument, never read then, is
    pos: a device array the call has anyway, no allocation), K feature-blocked where key_block is
    given (else 0), or page pools [num_pages, page_size, KVH, D] with the table (decoder_math.cuh
    kv_cache_row, blocked_key_at)."""
    if block_table is None:
        return np.int64(v_cache.shape[1]), pos, np.int32(0), np.int32(0), np.int32(key_block or 0)
    return np.int64(0), block_table, np.int32(block_table.shape[1]), np.int32(v_cache.shape[1]), np.int32(0)


def gemv_rope(x, w, cos, sin, pos, k_cache, v_cache, heads: int, kv_heads: int, kv_dtype: str, q_out=None,
              block_table=None, key_block=None):
    """The QKV product and the rotary + K/V append in one launch: what gemv(x, w) followed by
    rope_append(y, ...) does, bit for bit, without the float32 product in between.

    x [n, K] and w [(heads + 2 kv_heads) D, K] as for gemv; cos, sin, pos, the caches (float16, or
    bfloat16 as uint16 bits: kv_dtype; contiguous, page pools with block_table, or K blocked with
    key_block) and q_out as for rope_append -> q [n, heads, D]."""
    dtype_name, nb = _gemv_operands(x, w, "gemv_rope")
    n = x.shape[0]
    D = v_cache.shape[-1]
    kv = _dtype_name(k_cache, kv_dtype)
    ok = (kv in GEMV_DTYPES and w.shape[0] == (heads + 2 * kv_heads) * D
          and _rope_operands_ok(n, kv_heads, cos, sin, pos, k_cache, v_cache, block_table, key_block))
    if not ok:
        raise ValueError(f"gemv_rope needs w [(H + 2 KVH) D, K], {_CACHE_FORMS} of float16/bfloat16 "
                         f"({kv_dtype}), cos/sin [P, D/2] float32, pos [n] int32; got w {w.shape}, "
                         + _rope_operands_seen(cos, pos, k_cache, v_cache, heads, kv_heads, block_table, key_block))
    q = _check_out(q_out, (n, heads, D), k_cache.dtype, "gemv_rope")
    launch(_kernel(("gemv_rope", dtype_name, kv, nb)), (w.shape[0] // 2,),
           (w, x, np.int32(x.shape[1]), np.int32(n), cos, sin, pos, q, k_cache, v_cache, np.int32(heads),
            np.int32(kv_heads), np.int32(D), *_cache_address(v_cache, block_table, pos, key_block)),
           threads=GEMV_THREADS)
    return q


def gemv_glu(x, w, out=None):
    """The gate/up product and SiLU * up in one launch: what silu_mul(gemv(x, w), w.dtype) does, bit
    for bit, without the float32 product in between. x [n, K], w [2 I, K] (gate rows, then up rows)
    as for gemv -> a [n, I] of w's dtype."""
    dtype_name, nb = _gemv_operands(x, w, "gemv_glu")
    if w.shape[0] % 2:
        raise ValueError(f"gemv_glu needs w [2 I, K] (gate rows, then up rows), got w {w.shape}")
    n, I = x.shape[0], w.shape[0] // 2
    a = _check_out(out, (n, I), w.dtype, "gemv_glu")
    launch(_kernel(("gemv_glu", dtype_name, nb)), (I,), (w, x, a, np.int32(I), np.int32(x.shape[1]), np.int32(n)),
           threads=GEMV_THREADS)
    return a


def rms_norm(x, w, eps: float, out_dtype, out=None):
    """x [N, d] float32, w [d] float32 -> x / sqrt(mean(x^2) + eps) * w as [N, d] out_dtype
    (float32 or float16)."""
    import cupy

    N, d = x.shape
    if x.dtype != cupy.float32 or w.dtype != cupy.float32 or w.shape != (d,) or not (
            x.flags.c_contiguous and w.flags.c_contiguous):
        raise ValueError(f"rms_norm needs C-contiguous float32 x [N, d] and w [d], got x {x.dtype} {x.shape}, "
                         f"w {w.dtype} {w.shape}")
    o = np.dtype(out_dtype).name
    if o not in PRODUCT_DTYPES:
        raise ValueError(f"rms_norm: out_dtype must be one of {PRODUCT_DTYPES}, got {o}")
    y = _check_out(out, (N, d), o, "rms_norm")
    launch(_kernel(("rms_norm", o)), (N,), (x, w, y, np.int32(d), np.float32(eps)), threads=RMS_THREADS)
    return y


def rope_append(qkv, cos, sin, pos, k_cache, v_cache, heads: int, kv_heads: int, kv_dtype: str, q_out=None,
                block_table=None, key_block=None):
    """The decode step's rotary + K/V append for one token per sequence.

    qkv [N, (heads + 2 kv_heads) D] (float32 or float16: q, k, v heads in that order),
    cos, sin [P, D/2] float32, pos [N] int32 (each token's position = its cache row, < L_max),
    k_cache, v_cache [N, L_max, kv_heads, D] of kv_dtype -> q [N, heads, D] of kv_dtype (rotated);
    the rotated k and the v are written into row pos[n] of the caches.

    Paged caches: k_cache, v_cache page pools [num_pages, page_size, kv_heads, D] (NHD) and
    block_table [N, max_pages] int32 (a C-contiguous CuPy array: sequence n's page ids in order);
    row pos[n] is slot pos[n] % page_size of page block_table[n, pos[n] // page_size]. That page
    must be in the table (not checked: the entries live on the device).

    key_block FB (16 | 32; contiguous caches only): k_cache is feature-blocked, [N, kv_heads,
    NP, D / FB, P, FB] (santa_cupy.key_layout.to_blocked of the standard K), v_cache as above."""
    N = qkv.shape[0]
    D = v_cache.shape[-1]
    p = np.dtype(qkv.dtype).name
    kv = _dtype_name(k_cache, kv_dtype)
    ok = (p in PRODUCT_DTYPES and qkv.ndim == 2 and qkv.shape[1] == (heads + 2 * kv_heads) * D
          and qkv.flags.c_contiguous
          and _rope_operands_ok(N, kv_heads, cos, sin, pos, k_cache, v_cache, block_table, key_block))
    if not ok:
        raise ValueError(f"rope_append needs C-contiguous qkv [N, (H + 2 KVH) D] (float32/float16), "
                         f"{_CACHE_FORMS} of {kv_dtype}, cos/sin [P, D/2] float32, pos [N] int32; got qkv "
                         f"{qkv.dtype} {qkv.shape}, "
                         + _rope_operands_seen(cos, pos, k_cache, v_cache, heads, kv_heads, block_table, key_block))
    q = _check_out(q_out, (N, heads, D), k_cache.dtype, "rope_append")
    pairs = (heads + 2 * kv_heads) * D // 2
    launch(_kernel(("rope_append", p, kv)), (N, -(-pairs // THREADS)),
           (qkv, cos, sin, pos, q, k_cache, v_cache, np.int32(heads), np.int32(kv_heads), np.int32(D),
            *_cache_address(v_cache, block_table, pos, key_block)), threads=THREADS)
    return q


def silu_mul(gu, out_dtype, out=None):
    """gu [N, 2 I] (float32 or float16: gate, then up) -> silu(gate) * up as [N, I] out_dtype."""
    p, o = np.dtype(gu.dtype).name, np.dtype(out_dtype).name
    if p not in PRODUCT_DTYPES or o not in PRODUCT_DTYPES or gu.ndim != 2 or gu.shape[1] % 2 \
            or not gu.flags.c_contiguous:
        raise ValueError(f"silu_mul needs C-contiguous gu [N, 2 I] (float32/float16) and out_dtype in "
                         f"{PRODUCT_DTYPES}, got gu {gu.dtype} {gu.shape}, out_dtype {o}")
    N, I = gu.shape[0], gu.shape[1] // 2
    a = _check_out(out, (N, I), o, "silu_mul")
    total = N * I
    blocks = max(1, min(SILU_BLOCKS_PER_SM * _sm_count(), -(-total // THREADS)))
    launch(_kernel(("silu_mul", p, o)), (blocks,), (gu, a, np.int32(I), np.int64(total)), threads=THREADS)
    return a


def sample_tokens(logits, seen, use_seen: bool, mark: bool, penalty, step, seed: int, greedy: bool, inv_t, top_k: int,
                  top_p_q: int, out=None):
    """The next token of every sequence (llama_min/sampling.py's contract, bit for bit with its
    sample_reference): logits [B, V] float32 (C-contiguous, V < 2^24), seen [B, V] uint8 (read where
    use_seen: the repetition penalty's tokens, penalty float32; with mark the chosen tokens are
    marked; else any uint8 array), step int64 [1] (the RNG step, read on the device), seed, greedy,
    inv_t (float32(1 / temperature)), top_k (0: off), top_p_q (top_p * 2^32, >= 2^32: off) ->
    out [B] int32. One block a sequence; nothing read back to the host."""
    import cupy

    from llama_min.sampling import MAX_VOCAB
    if logits.dtype != cupy.float32 or logits.ndim != 2 or not logits.flags.c_contiguous \
            or not 1 <= logits.shape[1] <= MAX_VOCAB:
        raise ValueError(f"sample_tokens needs C-contiguous float32 logits [B, V] with V <= {MAX_VOCAB}, got "
                         f"{logits.dtype} {logits.shape}")
    B, V = logits.shape
    if use_seen and (seen.dtype != cupy.uint8 or seen.shape != (B, V) or not seen.flags.c_contiguous):
        raise ValueError(f"sample_tokens needs seen as a C-contiguous uint8 [{B}, {V}] array, got {seen.dtype} "
                         f"{seen.shape}")
    if step.dtype != cupy.int64 or step.size < 1:
        raise ValueError(f"sample_tokens needs step as an int64 device array, got {step.dtype} {step.shape}")
    y = _check_out(out, (B,), cupy.int32, "sample_tokens")
    launch(_kernel(("sample_tokens", "float32")), (B,),
           (logits, np.int32(V), seen, np.int32(bool(use_seen)), np.int32(bool(mark)), np.float32(penalty), step,
            np.uint64(int(seed) & ((1 << 64) - 1)), np.int32(bool(greedy)), np.float32(inv_t), np.int32(top_k),
            np.uint64(min(int(top_p_q), 1 << 32)), y), threads=SAMPLE_THREADS)
    return y


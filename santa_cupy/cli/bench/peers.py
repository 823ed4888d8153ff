"""The external dense baselines: torch SDPA (flash / cudnn / efficient backends) and FlashInfer's
paged decode (checked against a float32 reference before it is timed).
"""

from __future__ import annotations

import math

from santa_cupy.cli.bench.accounting import copies_for, kv_bytes
from santa_cupy.cli.bench.methods import Method, Shape
from santa_cupy.cli.bench.paged import PagedLayout, paged_cache
from santa_cupy.cli.bench.report import _exc_line, _log, fmt_bytes
from santa_cupy.cli.bench.timing import time_torch_graph


TORCH_BACKEND_ENUM = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def as_torch(torch, a, dtype: str):
    """A CuPy array of storage dtype `dtype` as a torch tensor over the same memory (no copy). bf16
    (uint16 bit patterns here) goes through int16 so that DLPack and .view(bfloat16) are both plain."""
    if dtype == "bfloat16":
        return torch.from_dlpack(a.view("int16")).view(torch.bfloat16)
    return torch.from_dlpack(a)


def torch_inputs(torch, inputs, shape: Shape, repeat_kv: int = 1):
    """Our copies -> torch q [B,H,1,D], k/v [B,KVH*repeat,L,D] (transposed/copied once, outside any
    timing)."""
    def conv(a):
        return as_torch(torch, a, shape.dtype)

    out = []
    for q, k, v in inputs:
        tk, tv = (conv(x).transpose(1, 2).contiguous() for x in (k, v))
        if repeat_kv > 1:
            tk, tv = tk.repeat_interleave(repeat_kv, dim=1), tv.repeat_interleave(repeat_kv, dim=1)
        out.append((conv(q).unsqueeze(2), tk, tv))
    return out


def bench_torch(torch, cp, method: Method, shape: Shape, B, L, inputs, n_inner, repeats, budget_bytes, l2) -> dict:
    """torch SDPA with one backend; enable_gqa=True, else KV heads repeated outside the timing."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    backend = getattr(SDPBackend, TORCH_BACKEND_ENUM[method.backend])
    cp.cuda.Device().synchronize()
    G = shape.heads // shape.kv_heads
    attempts = [(True, 1)] + ([(False, G)] if G > 1 else [])
    errors = []
    for gqa, rep in attempts:
        n = copies_for(kv_bytes(shape, B, L) * rep, l2, budget_bytes) if rep > 1 else len(inputs)
        if n == 0:
            errors.append(f"repeated KV does not fit {fmt_bytes(budget_bytes)}")
            continue
        try:
            tins = torch_inputs(torch, inputs[:n], shape, rep)
            kw = {"enable_gqa": True} if gqa else {}
            with sdpa_kernel(backend):
                fns = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, **kw) for q, k, v in tins]
                fns[0]()
                torch.cuda.synchronize()
                us, mode = time_torch_graph(torch, fns, n_inner, repeats)
            note = "enable_gqa" if gqa else f"KV repeated x{rep} outside timing (reads {rep}x bytes)"
            return {"us": us, "timing": mode, "note": note}
        except Exception as exc:
            errors.append(f"{'enable_gqa' if gqa else 'repeat_kv'}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
        finally:
            tins = fns = None
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    return {"us": None, "note": "skipped: " + "; ".join(errors)}


FLASHINFER_WORKSPACE_BYTES = 128 << 20     # the float workspace FlashInfer's docs recommend
FLASHINFER_CHECK_TOLERANCE = 2e-2          # relative L2 error of its output against reference_decode
# why FlashInfer could not plan at the first point of this process (its JIT build or import broken):
# later points skip it instead of paying a failing build each
_flashinfer_broken = {"planned": False, "why": None}


def bf16_to_float32(xp, bits):
    """uint16 bf16 bit patterns -> float32 values (exact)."""
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def reference_decode(xp, q, k, v, b: int, dtype: str):
    """Exact decode attention of sequence b in float32: q [B, H, D], k/v [B, L, KVH, D] (storage
    dtype `dtype`, xp arrays) -> o [H, D]; GQA groups of H / KVH consecutive query heads."""
    f32 = (lambda a: bf16_to_float32(xp, a)) if dtype == "bfloat16" else (lambda a: a.astype(xp.float32))
    H, D = q.shape[1:]
    KVH = k.shape[2]
    qb = f32(q[b]).reshape(KVH, H // KVH, D)
    s = xp.einsum("kgd,lkd->kgl", qb, f32(k[b])) / math.sqrt(D)
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return xp.einsum("kgl,lkd->kgd", p, f32(v[b])).reshape(H, D)


def relative_error(xp, got, want) -> float:
    return float(xp.linalg.norm((got - want).ravel()) / xp.linalg.norm(want.ravel()))


def flashinfer_decode(torch, flashinfer, shape: Shape, layout: PagedLayout, device):
    """A planned BatchDecodeWithPagedKVCacheWrapper (FlashInfer 0.6.13's API) for our cache seen as
    `layout`: NHD pages, tensor cores, no soft cap / window / RoPE, scale 1/sqrt(D). plan() copies
    the page table to the host (a sync), so it runs here, once, outside any timing."""
    tdt = torch.bfloat16 if shape.dtype == "bfloat16" else getattr(torch, shape.dtype)
    workspace = torch.zeros(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)   # zeroed: first use
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)

    def table(a):
        return torch.from_numpy(a).to(device)

    wrapper.plan(table(layout.indptr()), table(layout.indices()), table(layout.last_page_len()),
                 shape.heads, shape.kv_heads, shape.head_dim, layout.page_rows,
                 q_data_type=tdt, kv_data_type=tdt)
    return wrapper


def bench_flashinfer(torch, flashinfer, cp, shape: Shape, B, L, inputs, n_inner, repeats, pdl=False) -> dict:
    """FlashInfer batch decode over the rotating inputs, our [B, L, KVH, D] cache seen as B*ceil(L/16)
    pages of 16 rows (PagedLayout), timed as ours are (time_torch_graph: a graph of n_inner run()s,
    eager if capture fails). Its output on the first copy is checked against reference_decode for
    the first and last sequence (a wrong page table would time garbage) before any timing."""
    if _flashinfer_broken["why"]:
        return {"us": None, "note": f"skipped: FlashInfer did not plan at this run's first point ({_flashinfer_broken['why']})"}
    layout = PagedLayout(B, L)
    device = torch.device("cuda", cp.cuda.Device().id)
    wrapper = None
    try:
        try:
            wrapper = flashinfer_decode(torch, flashinfer, shape, layout, device)
        except Exception as exc:
            if not _flashinfer_broken["planned"]:
                _flashinfer_broken["why"] = _exc_line(exc, 80)
            raise
        _flashinfer_broken["planned"] = True
        pages = [(as_torch(torch, q, shape.dtype), as_torch(torch, paged_cache(cp, k, layout), shape.dtype),
                  as_torch(torch, paged_cache(cp, v, layout), shape.dtype)) for q, k, v in inputs]
        out = torch.empty((B, shape.heads, shape.head_dim), dtype=pages[0][0].dtype, device=device)

        def call(q, k, v):
            return wrapper.run(q, (k, v), out=out, enable_pdl=pdl)

        pdl_refused = ""
        try:
            call(*pages[0])
            torch.cuda.synchronize()
        except Exception as exc:             # a build without PDL: time it plainly, and say so
            if not pdl:
                raise
            pdl, pdl_refused = False, f" (enable_pdl failed: {_exc_line(exc, 60)})"
            call(*pages[0])
            torch.cuda.synchronize()
        got = cp.from_dlpack(out.view(torch.int16) if shape.dtype == "bfloat16" else out)
        got = bf16_to_float32(cp, got.view(cp.uint16)) if shape.dtype == "bfloat16" else got.astype(cp.float32)
        q0, k0, v0 = inputs[0]
        err = max(relative_error(cp, got[b], reference_decode(cp, q0, k0, v0, b, shape.dtype)) for b in {0, B - 1})
        if not err <= FLASHINFER_CHECK_TOLERANCE:
            return {"us": None, "check_error": err,
                    "note": f"failed: output differs from the exact reference (relative error {err:.3g})"}
        fns = [lambda q=q, k=k, v=v: call(q, k, v) for q, k, v in pages]
        us, mode = time_torch_graph(torch, fns, n_inner, repeats)
        view = "a free view" if layout.free_view else f"K/V copied to {layout.capacity}-row capacity outside timing"
        return {"us": us, "timing": mode, "check_error": err,
                "note": f"flashinfer {getattr(flashinfer, '__version__', '?')}: {layout.pages_per_seq} pages of "
                        f"{layout.page_rows} rows per sequence ({view}), tensor cores, pdl {'on' if pdl else 'off'}{pdl_refused}"}
    except Exception as exc:
        import traceback
        _log(f"flashinfer B={B} L={L}: {traceback.format_exc()}")     # a JIT build's whole log
        return {"us": None, "note": f"failed: {_exc_line(exc)}"}
    finally:
        wrapper = pages = out = fns = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


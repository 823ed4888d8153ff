"""The GPU stack of the benchmarks: CuPy (required), torch and FlashInfer (optional), the device's
metadata, and random device arrays of a benchmark dtype.
"""

from __future__ import annotations

import click

from santa_cupy.kernels import DEFAULT_L2_BYTES


def _cupy():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy
    except Exception as exc:  # ImportError, or no driver/device
        raise click.ClickException(f"the benchmarks need CuPy and a CUDA GPU ({type(exc).__name__}: {exc})")


def _optional_torch():
    try:
        import torch
        return torch if torch.cuda.is_available() else None
    except Exception:
        return None


def _optional_flashinfer():
    try:
        import flashinfer
        return flashinfer
    except Exception:
        return None


def gpu_metadata(cp, torch=None) -> dict:
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    return {"gpu": name, "cupy": cp.__version__, "torch": getattr(torch, "__version__", None),
            "l2_bytes": int(props.get("l2CacheSize", 0)) or DEFAULT_L2_BYTES,
            "sms": int(props["multiProcessorCount"])}



def random_array(cp, shape, dtype, scale=1.0, chunk=1 << 27):
    """Random normal values (never zeros) of a storage dtype: bfloat16 -> uint16 bit patterns
    (float32 truncated), float16, float32. Generated in chunks to bound the float32 temporary."""
    out = cp.empty(shape, dtype=cp.uint16 if dtype == "bfloat16" else dtype)
    flat = out.reshape(-1)
    for i in range(0, flat.size, chunk):
        x = cp.random.standard_normal(min(chunk, flat.size - i), dtype=cp.float32)
        if scale != 1.0:
            x *= scale
        flat[i:i + x.size] = (x.view(cp.uint32) >> 16).astype(cp.uint16) if dtype == "bfloat16" else x.astype(dtype)
    return out


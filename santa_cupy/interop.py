"""Accepting GPU arrays from other libraries without copies.

NumPy and CuPy arrays pass through unchanged. Any other object that is a GPU array is wrapped as a
CuPy array sharing its memory: through ``__cuda_array_interface__`` (Numba, PyTorch, ...) or DLPack
(``__dlpack__``: PyTorch, JAX, ...). bfloat16 travels as uint16 bit patterns in santa-cupy; pass a
torch bf16 tensor as ``t.view(torch.uint16)`` (or ``torch.int16``), a JAX one as
``jax.lax.bitcast_convert_type(x, jnp.uint16)``.

Streams: every GPU entry point takes ``stream=`` (``accepts_stream``): a ``cupy.cuda.Stream`` /
``ExternalStream``, a ``torch.cuda.Stream`` (anything with an integer ``cuda_stream``) or a raw
``cudaStream_t`` as an int. Its kernels are launched on that stream (CuPy's current stream is
switched for the duration of the call), nothing is synchronised.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np


def as_array(x, name="array"):
    """x as a NumPy or CuPy array (zero-copy for foreign GPU arrays); other objects unchanged."""
    if isinstance(x, np.ndarray) or type(x).__module__.split(".")[0] == "cupy":
        return x
    if hasattr(x, "__cuda_array_interface__") or hasattr(x, "__dlpack__"):
        try:
            import cupy
        except ImportError:
            raise TypeError(f"{name} must be a numpy.ndarray (CuPy is not installed, so a "
                            f"{type(x).__module__}.{type(x).__name__} cannot be viewed as a GPU array); "
                            f"pass numpy.asarray({name}) for the NumPy path") from None

        try:
            if hasattr(x, "__cuda_array_interface__"):
                return cupy.asarray(x)
            return cupy.from_dlpack(x)
        except (TypeError, ValueError, BufferError, RuntimeError) as exc:
            dtype = getattr(x, "dtype", "?")
            raise TypeError(f"{name}: cannot view {type(x).__module__}.{type(x).__name__} (dtype {dtype}) as a "
                            f"CuPy array without a copy ({exc}); bfloat16 must be passed as a uint16/int16 "
                            "view of the same memory") from exc
    return x


def as_arrays(*arrays, names=("q", "k_cache", "v_cache", "lengths")):
    """as_array over several arguments; int16 views of bf16 become uint16 views (free)."""
    out = []
    for x, name in zip(arrays, names):
        a = as_array(x, name)
        if name != "lengths" and getattr(a, "dtype", None) == np.int16:
            a = a.view(np.uint16)
        out.append(a)
    return tuple(out)


def as_out(out):
    """A caller's output buffer as a CuPy/NumPy array sharing its memory (None stays None);
    an int16 view of bf16 becomes the uint16 view santa-cupy writes."""
    if out is None:
        return None
    a = as_array(out, "out")
    if getattr(a, "dtype", None) == np.int16:
        a = a.view(np.uint16)
    return a


def check_stream(stream):
    """Validate a ``stream=`` argument without importing CuPy -> ("none" | "cupy" | "ptr", value).

    None; a CuPy stream object (``cupy.cuda.Stream``, ``ExternalStream``, ``Stream.null``); an
    object with an integer ``cuda_stream`` attribute (``torch.cuda.Stream``); an int >= 0 that is
    a ``cudaStream_t`` (0: the legacy default stream). Anything else is a TypeError naming
    ``stream``, a negative int a ValueError."""
    if stream is None:
        return "none", None
    if type(stream).__module__.split(".")[0] == "cupy" and hasattr(stream, "ptr"):
        return "cupy", stream
    ptr = getattr(stream, "cuda_stream", stream)      # torch.cuda.Stream -> its cudaStream_t
    if isinstance(ptr, bool) or not isinstance(ptr, (int, np.integer)):
        raise TypeError("stream must be None, a cupy.cuda.Stream / ExternalStream, a torch.cuda.Stream "
                        f"(or any object with an int .cuda_stream) or an int cudaStream_t, got "
                        f"{type(stream).__module__}.{type(stream).__name__} {stream!r}")
    if int(ptr) < 0:
        raise ValueError(f"stream: a cudaStream_t pointer is >= 0, got {int(ptr)}")
    return "ptr", int(ptr)


def stream_scope(stream):
    """A context manager making ``stream`` CuPy's current stream (a no-op for None)."""
    kind, value = check_stream(stream)
    if kind == "none":
        return contextlib.nullcontext()
    if kind == "cupy":
        return value
    try:
        import cupy
    except ImportError:
        raise ModuleNotFoundError("stream= selects a CUDA stream for the GPU kernels and needs CuPy "
                                  "(pip install 'santa-cupy[cuda12]' or 'santa-cupy[cuda13]')") from None
    return cupy.cuda.ExternalStream(value)


def accepts_stream(fn):
    """Decorator: ``fn`` gains a keyword ``stream=None`` and runs with that stream current (see
    ``check_stream`` for what it may be), so every kernel it launches goes there. The wrapped
    body is unchanged; the signature shown by ``inspect`` includes ``stream``."""
    @functools.wraps(fn)
    def wrapper(*args, stream=None, **kwargs):
        if stream is None:
            return fn(*args, **kwargs)
        with stream_scope(stream):
            return fn(*args, **kwargs)

    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
    params.insert(at, inspect.Parameter("stream", inspect.Parameter.KEYWORD_ONLY, default=None))
    wrapper.__signature__ = sig.replace(parameters=params)
    if wrapper.__doc__:
        lines = [ln for ln in wrapper.__doc__.splitlines()[1:] if ln.strip()]
        indent = min((len(ln) - len(ln.lstrip()) for ln in lines), default=4)
        wrapper.__doc__ = wrapper.__doc__.rstrip() + "\n\n" + " " * indent + (
            "``stream``: the CUDA stream to launch on (a cupy or torch stream, or an int cudaStream_t; "
            "default: CuPy's current stream).\n")
    return wrapper

"""Accepting GPU arrays from other libraries without copies.

NumPy and CuPy arrays pass through unchanged. Any other object that is a GPU array is wrapped as a
CuPy array sharing its memory: through ``__cuda_array_interface__`` (Numba, PyTorch, ...) or DLPack
(``__dlpack__``: PyTorch, JAX, ...). bfloat16 travels as uint16 bit patterns in santa-cupy; pass a
torch bf16 tensor as ``t.view(torch.uint16)`` (or ``torch.int16``), a JAX one as
``jax.lax.bitcast_convert_type(x, jnp.uint16)``.
"""

from __future__ import annotations

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

"""Kernel arguments checked on the host against the kernels' own C declarations.

A kernel of cuda/ takes up to ~30 positional arguments; CuPy passes each as the C type of its
NumPy type, so an np.int64 where the kernel declares ``int`` (or an int32 array where it declares
``const i64*``) shifts every later argument and corrupts memory silently. The one source of truth
for each kernel's parameters is its declaration in the .cu file. This module parses those
declarations (``template <...> __global__ void name(...)``) once per source text, resolves the
template's type parameters from the instance's name expression (``santa_tile_warp<bf16_t, 128,
...>``), and checks every launch's arguments against the result before the launch
(``kernels.launch``): the count, each scalar's exact NumPy type, each pointer's array dtype. A
mismatch is a TypeError naming the kernel, the parameter and both types.

    sig = signature_of(source, "santa_merge<bf16_t, 128, 4>")
    check(sig, args)                      # raises TypeError on the first mismatch
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import numpy as np

# C scalar types of the kernels' parameters -> the NumPy scalar type that CuPy passes as that type
SCALARS = {"int": np.int32, "unsigned": np.uint32, "i64": np.int64, "u64": np.uint64, "float": np.float32,
           "double": np.float64}
# pointee types -> the dtype of the array passed for the pointer (bf16 travels as uint16 bits;
# float4 arrays are float32 arrays whose last axis holds the 4 components)
POINTEES = {"bf16_t": np.uint16, "f16_t": np.float16, "float": np.float32, "double": np.float64, "int": np.int32,
            "unsigned": np.uint32, "i64": np.int64, "u64": np.uint64, "unsigned char": np.uint8, "float4": np.float32}

_SCALAR_TYPES = frozenset(SCALARS.values()) | {np.uint16, np.float16, np.uint8}   # never a pointer's argument
_KERNEL = re.compile(r"(?:template\s*<(?P<tparams>[^>]*)>\s*)?__global__\s+void\s+"
                     r"(?:__launch_bounds__\((?:[^()]|\([^()]*\))*\)\s*)?(?P<name>\w+)\s*\((?P<params>[^)]*)\)")


@dataclass(frozen=True)
class Param:
    """One kernel parameter: its name, whether it is a pointer, and the NumPy type its argument must
    have (the scalar type, or the array dtype for a pointer)."""

    name: str
    c_type: str
    pointer: bool
    numpy_type: type


@dataclass(frozen=True)
class Signature:
    kernel: str                          # the instance, e.g. "santa_merge<bf16_t, 128, 4>"
    params: tuple[Param, ...]

    @functools.cached_property
    def expected(self) -> tuple[tuple, tuple]:
        """What check()'s per-launch path compares: ((index, NumPy scalar type) of the scalars,
        (index, np.dtype) of the pointers)."""
        return (tuple((i, p.numpy_type) for i, p in enumerate(self.params) if not p.pointer),
                tuple((i, np.dtype(p.numpy_type)) for i, p in enumerate(self.params) if p.pointer))


def _split_args(text: str) -> list[str]:
    """Template arguments split at top-level commas ("bf16_t, 128, 4" -> three)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        depth += ch == "<"
        depth -= ch == ">"
        cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


@functools.lru_cache(maxsize=None)
def declarations(source: str) -> dict[str, tuple[tuple[str, ...], tuple[tuple[str, str], ...]]]:
    """{kernel name: (its template parameters (a type parameter's name, None for a value one),
    ((C type, parameter name), ...))} of every __global__ function in the source (qualifiers such
    as __restrict__ dropped, const kept)."""
    out = {}
    for m in _KERNEL.finditer(source):
        # every template parameter's name, None for a non-type one (int D ...): its position
        # matches the instance's template argument
        tparams = tuple(p.split()[-1] if p.split()[0] in ("typename", "class") else None
                        for p in _split_args(m.group("tparams") or ""))
        params = []
        for p in (p.strip() for p in m.group("params").split(",") if p.strip()):
            words = p.replace("*", " * ").replace("__restrict__", " ").split()
            params.append((" ".join(words[:-1]), words[-1]))
        out[m.group("name")] = (tparams, tuple(params))
    return out


@functools.lru_cache(maxsize=None)
def signature_of(source: str, instance: str) -> Signature:
    """The parameters of one kernel instance (its name expression), template types resolved."""
    name, _, rest = instance.partition("<")
    decls = declarations(source)
    if name not in decls:
        raise KeyError(f"no __global__ declaration of {name!r} in the kernel source")
    tparams, params = decls[name]
    targs = _split_args(rest[:-1]) if rest else []
    if len(targs) != len(tparams):
        raise KeyError(f"{instance}: {len(targs)} template arguments for {len(tparams)} parameters")
    types = {t: arg for t, arg in zip(tparams, targs) if t is not None}
    out = []
    for c_type, pname in params:
        pointer = "*" in c_type
        base = " ".join(w for w in c_type.replace("*", " ").split() if w != "const")
        base = types.get(base, base)
        table = POINTEES if pointer else SCALARS
        if base not in table:
            raise KeyError(f"{instance}: parameter {pname} has C type {c_type!r} ({base!r}), which has no NumPy "
                           f"counterpart here")
        out.append(Param(pname, c_type, pointer, table[base]))
    return Signature(instance, tuple(out))


def _describe(a) -> str:
    dtype = getattr(a, "dtype", None)
    kind = "array" if hasattr(a, "shape") and getattr(a, "ndim", 0) >= 0 and not np.isscalar(a) else "scalar"
    return f"{type(a).__module__.split('.')[0]}.{type(a).__name__} {kind}" + (f" of {dtype}" if dtype is not None else "")


def check(sig: Signature, args) -> None:
    """TypeError unless args match sig: as many arguments as parameters; a scalar parameter takes
    exactly its NumPy scalar type; a pointer takes an array (anything with .dtype and a shape,
    not a NumPy scalar) of its dtype."""
    if len(args) != len(sig.params):
        raise TypeError(f"{sig.kernel}: {len(args)} arguments for {len(sig.params)} parameters "
                        f"({', '.join(p.name for p in sig.params)})")
    # the per-launch path (every eager call): one identity or dtype comparison an argument
    scalars, pointers = sig.expected
    try:
        if all(type(args[i]) is t for i, t in scalars) and \
                all(args[i].dtype == d and type(args[i]) not in _SCALAR_TYPES for i, d in pointers):
            return
    except AttributeError:                                    # a pointer argument without a dtype
        pass
    for i, (p, a) in enumerate(zip(sig.params, args)):      # a mismatch: find and name it
        if p.pointer:
            ok = not isinstance(a, np.generic) and hasattr(a, "shape") and getattr(a, "dtype", None) == p.numpy_type
        else:
            ok = type(a) is p.numpy_type
        if not ok:
            want = f"an array of {np.dtype(p.numpy_type).name}" if p.pointer else f"np.{p.numpy_type.__name__}"
            raise TypeError(f"{sig.kernel}: argument {i} ({p.name}, C type {p.c_type}) needs {want}, got "
                            f"{_describe(a)}")

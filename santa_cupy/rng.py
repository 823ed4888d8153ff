"""Counter-based, stateless random numbers shared bit-for-bit with cuda/common.cuh.

Every uniform is a pure function of (seed, step, layer, b, h, tile, k). All arithmetic is on
unsigned 64-bit integers and wraps modulo 2**64::

    mix64(z):  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
               z = (z ^ (z >> 27)) * 0x94D049BB133111EB
               return z ^ (z >> 31)                        (the SplitMix64 finaliser)

    head_key(seed, step, layer, b, h):
        x = mix64(seed ^ 0x9E3779B97F4A7C15)
        x = mix64(x ^ step)
        x = mix64(x ^ ((layer << 32) | b))
        return mix64(x ^ (h << 32))

    uniform(key, tile, k) = float32(mix64(mix64(key ^ tile) ^ k) >> 40) * 2**-24   in [0, 1)

``tile`` is the tile index for tile-local draws, or GLOBAL_TILE = 0xFFFFFFFF for draws on the
global comb; ``k`` is the draw index. The float32 value is exact (a 24-bit integer times 2**-24).

Score-stage (key) sampling, santa_cupy.key_sampling, has a stream of its own: the tile field is
KEY_SAMPLING_TILE = 0xFFFFFFFE (value-stage tiles never reach it) and ``k`` packs (draw r, piece i)::

    key_sampling_uniform(seed, step, layer, b, unit, r, i)
        = uniform(head_key(seed, step, layer, b, unit), KEY_SAMPLING_TILE, (r << 32) | i)

``unit`` is the query head h for a per-head stream, or GROUP_UNIT | g (GROUP_UNIT = 0x80000000) for
the stream shared by the heads of KV group g (common random numbers); ``i`` is a feature index
(per-feature Bernoulli) or a block index (block sampling).

Inputs may be Python ints or NumPy integer arrays (they broadcast); Python ints are taken modulo
2**64, so a negative seed is its two's complement.
"""

from __future__ import annotations

import numpy as np

from santa_cupy.spec import GLOBAL_TILE

_MASK64 = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_S27, _S30, _S31, _S32, _S40 = (np.uint64(s) for s in (27, 30, 31, 32, 40))

KEY_SAMPLING_TILE = 0xFFFFFFFE  # tile field of the score-stage (key sampling) stream
GROUP_UNIT = 0x80000000  # head field of a KV group's shared stream: GROUP_UNIT | g

__all__ = [
    "GLOBAL_TILE", "KEY_SAMPLING_TILE", "GROUP_UNIT", "as_u64", "mix64", "head_key", "uniform",
    "key_sampling_uniform",
]


def as_u64(x):
    """Python int / integer array -> np.uint64 (scalar or array), modulo 2**64."""
    if isinstance(x, (int, np.integer)):
        return np.uint64(int(x) & _MASK64)
    arr = np.asarray(x)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"RNG counters must be integers, got dtype {arr.dtype}")
    return arr.astype(np.uint64)  # two's complement for negative int64, like C's cast


def mix64(z):
    """SplitMix64 finaliser on uint64 (wrapping multiply)."""
    z = as_u64(z)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> _S30)) * _M1
        z = (z ^ (z >> _S27)) * _M2
    return z ^ (z >> _S31)


def head_key(seed, step, layer, b, h):
    """Key of one (sequence b, query head h) at a decode step and layer; b and h may be arrays."""
    x = mix64(as_u64(seed) ^ _GOLDEN)
    x = mix64(x ^ as_u64(step))
    x = mix64(x ^ ((as_u64(layer) << _S32) | as_u64(b)))
    return mix64(x ^ (as_u64(h) << _S32))


def uniform(key, tile, k):
    """float32 uniform in [0, 1) with 24 random bits, for draw k of a tile (broadcasting)."""
    bits = mix64(mix64(as_u64(key) ^ as_u64(tile)) ^ as_u64(k)) >> _S40
    return np.asarray(bits).astype(np.float32) * np.float32(2.0**-24)


def key_sampling_uniform(seed, step, layer, b, unit, r, i):
    """float32 uniform of the key-sampling stream (module docstring); every argument broadcasts.

    unit: head h (per-head stream) or GROUP_UNIT | g (KV group g's shared stream); r: draw index
    (< 2**32); i: feature or block index (< 2**32).
    """
    key = head_key(seed, step, layer, b, unit)
    return uniform(key, KEY_SAMPLING_TILE, (as_u64(r) << _S32) | as_u64(i))

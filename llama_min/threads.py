"""How many BLAS threads the CPU decoder uses, chosen per phase (through threadpoolctl).

* decode (one token: matrix-vector products, ~1 MFLOP each): 1 thread. Splitting a product this
  small over threads gains little when every core is free and loses tenfold when another process
  keeps a core busy, because OpenBLAS's threads wait for each other at every product
  (SmolLM2-135M on 2 cores, one kept busy: ~10 -> ~20 tokens/s with 1 thread).
* prefill of chunks of >= PREFILL_MIN_TOKENS tokens (matrix-matrix products): every core this
  process may run on; shorter chunks are matrix-vector-like and get 1 thread, as decode. Measured
  on 2 cores with another process's job running: 64 tokens 0.37-0.58 s with 2 threads against
  0.61-0.83 s with 1; a 15-token prompt 0.14 s with 1 thread against 1.1 s with 2.

Override: ``SANTA_CUPY_BLAS_THREADS=N`` uses N threads in both phases. A thread count the user set
for the BLAS library itself (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``, ``MKL_NUM_THREADS``,
...) is respected: then nothing here changes it.
"""

from __future__ import annotations

import contextlib
import os

ENV = "SANTA_CUPY_BLAS_THREADS"
# Variables with which a user configures the BLAS library's threads directly.
LIBRARY_ENVS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS", "GOTO_NUM_THREADS")
PHASES = ("decode", "prefill")
PREFILL_MIN_TOKENS = 64

_controller = None


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def parse_override(value: str) -> int:
    """SANTA_CUPY_BLAS_THREADS's value -> a thread count >= 1, or ValueError naming the variable."""
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV} must be a positive integer, got {value!r}")
    return n


def choose(phase: str, tokens: int = 1, environ=None) -> int | None:
    """BLAS threads for `phase` ("decode" | "prefill") of products over `tokens` rows (a prefill
    chunk's length); None: leave the library as the user configured it."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    environ = os.environ if environ is None else environ
    if environ.get(ENV):
        return parse_override(environ[ENV])
    if any(environ.get(name) for name in LIBRARY_ENVS):
        return None
    if phase == "prefill" and tokens >= PREFILL_MIN_TOKENS:
        return available_cores()
    return 1


def _blas_controller():
    """threadpoolctl's controller of the BLAS libraries loaded so far (made once, after NumPy)."""
    global _controller
    if _controller is None:
        import numpy  # noqa: F401  (loads NumPy's BLAS, so that the controller finds it)
        from threadpoolctl import ThreadpoolController
        _controller = ThreadpoolController().select(user_api="blas")
    return _controller


@contextlib.contextmanager
def blas_threads(phase: str, tokens: int = 1):
    """Run the block with choose(phase, tokens) BLAS threads; the previous counts come back after."""
    n = choose(phase, tokens)
    if n is None:
        yield None
        return
    with _blas_controller().limit(limits=n):
        yield n

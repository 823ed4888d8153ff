"""Row-major weight products through cuBLAS, called with ctypes (CuPy refuses its own cuBLAS calls
during stream capture, so the decoder's CUDA graph needs a binding of its own).
"""

from __future__ import annotations

import numpy as np


class CublasGemm:
    """Row-major out = x @ w.T through cuBLAS called with ctypes on a private handle that follows
    CuPy's current stream, with a user workspace (no allocation inside cuBLAS), so it can run in
    stream capture.
    x [N, K] and w [M, K] C-contiguous, same dtype (float16 or float32); fp32 accumulation; the
    output float32 or w's dtype."""

    _CUDA_TYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2}   # CUDA_R_32F, CUDA_R_16F
    _COMPUTE_32F, _OP_N, _OP_T, _ALGO_DEFAULT = 68, 0, 1, -1
    WORKSPACE = 32 << 20

    def __init__(self):
        import ctypes
        import cupy
        self._ct, self._cp = ctypes, cupy
        self.lib = ctypes.CDLL(self._find_lib())
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self._stream = None
        self.workspace = cupy.empty((self.WORKSPACE,), cupy.uint8)
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(self.WORKSPACE)), "cublasSetWorkspace")
        self.one, self.zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _find_lib():
        import cupy
        cupy.cuda.device.get_cublas_handle()          # makes CuPy load its libcublas
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                name = path.rsplit("/", 1)[-1]
                if name.startswith("libcublas.so"):
                    return path
        import ctypes.util
        found = ctypes.util.find_library("cublas")
        if found is None:
            raise RuntimeError("llama_min.cublas: cannot locate libcublas")
        return found

    def _check(self, status, what):
        if status != 0:
            raise RuntimeError(f"{what} failed with cuBLAS status {status}")

    def __call__(self, x, w, accumulate_into=None, out_dtype=None):
        """out [N, M] = x [N, K] @ w [M, K].T of w's dtype or out_dtype (float32, or w's dtype), or
        accumulate_into (float32 [N, M]) += that product (beta = 1)."""
        cp, ct = self._cp, self._ct
        stream = cp.cuda.get_current_stream().ptr
        if stream != self._stream:
            self._check(self.lib.cublasSetStream_v2(self.handle, ct.c_void_p(stream)), "cublasSetStream")
            self._stream = stream
        N, K = x.shape
        M = w.shape[0]
        if x.dtype != w.dtype or not (x.flags.c_contiguous and w.flags.c_contiguous):
            x = cp.ascontiguousarray(x, dtype=w.dtype)
        if accumulate_into is not None:
            out, beta = accumulate_into, self.one
            if out.dtype != cp.float32 or out.shape != (N, M) or not out.flags.c_contiguous:
                raise ValueError(f"accumulate_into must be a C-contiguous float32 [{N}, {M}] array, "
                                 f"got {out.dtype} {out.shape}")
        else:
            out, beta = cp.empty((N, M), w.dtype if out_dtype is None else out_dtype), self.zero
        t, t_out = self._CUDA_TYPE[np.dtype(w.dtype)], self._CUDA_TYPE[np.dtype(out.dtype)]
        # column-major view: out^T [M, N] = op_T(w as [K, M]) @ x^T [K, N]
        st = self.lib.cublasGemmEx(
            self.handle, self._OP_T, self._OP_N, ct.c_int(M), ct.c_int(N), ct.c_int(K),
            ct.byref(self.one), ct.c_void_p(w.data.ptr), t, ct.c_int(K),
            ct.c_void_p(x.data.ptr), t, ct.c_int(K), ct.byref(beta),
            ct.c_void_p(out.data.ptr), t_out, ct.c_int(M), self._COMPUTE_32F, self._ALGO_DEFAULT)
        self._check(st, "cublasGemmEx")
        return out

    def close(self):
        """Destroy the cuBLAS handle (idempotent). Every handle holds device memory of its own:
        an evaluation that builds thousands of GraphDecoders runs out without this."""
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = self._ct.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:       # interpreter shutdown: the library may already be gone
            pass

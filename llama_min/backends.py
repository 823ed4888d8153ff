"""The decode step's operations on one device: the Backend interface and its three forms.

LlamaModel.decode_step is written once over a Backend; which one runs is chosen where the model or
the decoder is built, never detected from the objects at hand:

- NumpyBackend: the CPU (NumPy array expressions, BLAS through NumPy's matmul);
- CublasBackend: the GPU, weight products through cuBLAS (llama_min.cublas, usable in stream
  capture), RMSNorm, rotary + K/V append and SiLU * up one kernel each (llama_min.ops), the
  residual adds inside the products (cuBLAS beta = 1);
- GemvBackend: CublasBackend with the products of up to `max_tokens` tokens through gemv.cu
  (float32 out, the residual add in the same launch), and, with fuse_epilogues, the rotary + K/V
  append and SiLU * up in the QKV and gate/up products' launches (gemv_rope, gemv_glu; bit-identical
  to the separate launches). What GraphDecoder uses at batch 1 by default.

Every method takes and returns arrays of the backend's array module; shapes: B batch (tokens),
d hidden, H / KVH query / KV heads, D head dim, I intermediate. The residual stream x is float32;
`mm` is the model's matmul dtype, `kv` its KV-cache storage dtype (bfloat16 as uint16 bits).
"""

from __future__ import annotations

import numpy as np


class Backend:
    """What one decode step needs (LlamaModel.decode_step) and the prefill's products (linear)."""

    name = "abstract"

    def __init__(self, model):
        self.model = model

    def linear(self, x, w, out_dtype=None):
        """x [N, K] @ w [M, K].T -> [N, M] of w's dtype (or out_dtype; gemv products: float32)."""
        raise NotImplementedError

    def linear_add(self, x, w, into):
        """into [N, M] float32 += x [N, K] @ w [M, K].T (the residual add); returns into."""
        raise NotImplementedError

    def embed(self, w, tokens):
        """tokens [B] int32 -> the residual stream's start, rows of the embedding w [V, d] as a new
        [B, d] float32 array (a tensor-parallel backend looks up its vocabulary slice and sums)."""
        return w[tokens].astype(np.float32)

    def logits(self, h, w):
        """The lm-head: h [B, d] (matmul dtype) @ w [V, d].T -> logits [B, V] float32 (a
        tensor-parallel backend gathers its ranks' vocabulary slices)."""
        return self.linear(h, w, out_dtype=np.float32)

    def rms_norm(self, x, w):
        """x [B, d] float32, w [d] float32 -> RMSNorm(x) * w as [B, d] of the matmul dtype."""
        raise NotImplementedError

    def token_rows(self, cache, pos):
        """Where the new token's K/V rows go (computed once a step, used by every layer)."""
        raise NotImplementedError

    def qkv_rope_append(self, h, w, cache, layer, pos, rows):
        """h [B, d] (matmul dtype) -> q [B, H, D] (KV dtype, rotated); the rotated k and the v are
        written into row pos[b] of the layer's cache (rows: token_rows(cache, pos))."""
        raise NotImplementedError

    def kv_view(self, cache, layer, n):
        """(k, v) of the layer as the attention takes them (n: rows attended, the same for every
        sequence). CPU: cache.read (contiguous [B, >= n, KVH, D], K in the standard layout); GPU:
        the storage itself (contiguous caches, K blocked where cache.key_block is set, or page
        pools with cache.block_table)."""
        raise NotImplementedError

    def attention_out(self, o):
        """Attention output o [B, H, D] (KV dtype) -> [B, H * D] of the matmul dtype."""
        raise NotImplementedError

    def glu(self, h, w):
        """h [B, d] (matmul dtype), w [2 I, d] (gate rows, then up rows) -> silu(gate) * up [B, I]
        of the matmul dtype."""
        raise NotImplementedError

    def close(self):
        """Release what the backend holds (cuBLAS handles); idempotent."""


class NumpyBackend(Backend):
    """The CPU: NumPy expressions, each rounded as the model's prefill rounds them."""

    name = "numpy"

    def linear(self, x, w, out_dtype=None):
        y = x @ w.T
        return y if out_dtype is None else y.astype(out_dtype, copy=False)

    def linear_add(self, x, w, into):
        into += (x @ w.T).astype(np.float32, copy=False)
        return into

    def rms_norm(self, x, w):
        m = self.model
        return m._rmsnorm(x, w).astype(m.mm_dtype)

    def token_rows(self, cache, pos):
        return cache.token_index(pos)

    def qkv_rope_append(self, h, w, cache, layer, pos, rows):
        m = self.model
        B, H, KVH, D = h.shape[0], m.H, m.KVH, m.D
        qkv = self.linear(h, w).astype(np.float32, copy=False)                # [B, (H+2KVH)D]
        cos, sin = m.cos[pos][:, None, :], m.sin[pos][:, None, :]             # [B, 1, D/2]
        q = m._rope(qkv[:, :H * D].reshape(B, H, D), cos, sin)
        k = m._rope(qkv[:, H * D:(H + KVH) * D].reshape(B, KVH, D), cos, sin)
        v = qkv[:, (H + KVH) * D:].reshape(B, KVH, D)
        cache.write_token(layer, rows, m._to_kv(k), m._to_kv(v))
        return m._to_kv(q)

    def kv_view(self, cache, layer, n):
        return cache.read(layer, n)

    def attention_out(self, o):
        m = self.model
        return m._from_kv(o, np.float32).reshape(o.shape[0], -1).astype(m.mm_dtype)

    def glu(self, h, w):
        m = self.model
        gu = self.linear(h, w).astype(np.float32, copy=False)                 # [B, 2I]
        I = gu.shape[1] // 2
        g = gu[:, :I]
        return (g * (0.5 * (1.0 + np.tanh(0.5 * g))) * gu[:, I:]).astype(m.mm_dtype)   # silu(gate) * up


class CublasBackend(Backend):
    """The GPU: cuBLAS products on a private handle (llama_min.cublas.CublasGemm, made at the first
    product, or given) and the decoder's kernels (llama_min.ops). No host synchronisation anywhere,
    so a step over it can be captured as a CUDA graph."""

    name = "cublas"

    def __init__(self, model, cublas=None):
        super().__init__(model)
        self._cublas = cublas

    @property
    def cublas(self):
        if self._cublas is None:
            from llama_min.cublas import CublasGemm
            self._cublas = CublasGemm()
        return self._cublas

    def linear(self, x, w, out_dtype=None):
        return self.cublas(x, w, out_dtype=out_dtype)

    def linear_add(self, x, w, into):
        return self.cublas(x, w, accumulate_into=into)

    def rms_norm(self, x, w):
        from llama_min import ops
        m = self.model
        return ops.rms_norm(x, w, m.cfg.rms_norm_eps, m.mm_dtype)

    def token_rows(self, cache, pos):
        return None                                  # the kernels write at pos themselves

    def _rope_args(self, cache, layer, pos):
        m = self.model
        return (m.cos, m.sin, pos, cache.k[layer], cache.v[layer], m.H, m.KVH, m.kv_dtype)

    def qkv_rope_append(self, h, w, cache, layer, pos, rows):
        from llama_min import ops
        return ops.rope_append(self.linear(h, w), *self._rope_args(cache, layer, pos),
                               block_table=cache.block_table, key_block=cache.key_block)

    def kv_view(self, cache, layer, n):
        return cache.k[layer], cache.v[layer]

    def attention_out(self, o):
        m = self.model
        o = o.reshape(o.shape[0], -1)
        return o if m.kv_dtype == m.mm_dtype.name else m._from_kv(o, m.mm_dtype)

    def glu(self, h, w):
        from llama_min import ops
        return ops.silu_mul(self.linear(h, w), self.model.mm_dtype)

    def close(self):
        if self._cublas is not None:
            self._cublas.close()


class GemvBackend(CublasBackend):
    """CublasBackend with the products of up to max_tokens tokens with 16-bit weights through
    gemv.cu (llama_min.ops.gemv: float32 out, the residual add in the same launch); with
    fuse_epilogues (the default) the rotary + K/V append and SiLU * up ride in the QKV and gate/up
    products' launches (ops.gemv_rope, ops.gemv_glu). Products gemv does not take (more tokens,
    float32 weights, K % 8 != 0) go to cuBLAS."""

    name = "gemv"
    fuse_epilogues = True

    def __init__(self, model, max_tokens: int, cublas=None):
        super().__init__(model, cublas)
        self.max_tokens = int(max_tokens)

    def _fits(self, x, w) -> bool:
        return (x.shape[0] <= self.max_tokens and w.dtype == np.float16 and x.dtype == w.dtype
                and w.shape[1] % 8 == 0 and x.flags.c_contiguous and x.data.ptr % 16 == 0)

    def linear(self, x, w, out_dtype=None):
        from llama_min import ops
        if self._fits(x, w):
            return ops.gemv(x, w)
        return super().linear(x, w, out_dtype)

    def linear_add(self, x, w, into):
        from llama_min import ops
        if self._fits(x, w):
            return ops.gemv(x, w, out=into, accumulate=True)
        return super().linear_add(x, w, into)

    def qkv_rope_append(self, h, w, cache, layer, pos, rows):
        from llama_min import ops
        if self.fuse_epilogues and self._fits(h, w) and self.model.kv_dtype in ops.GEMV_DTYPES:
            return ops.gemv_rope(h, w, *self._rope_args(cache, layer, pos), block_table=cache.block_table,
                                 key_block=cache.key_block)
        return super().qkv_rope_append(h, w, cache, layer, pos, rows)

    def glu(self, h, w):
        from llama_min import ops
        if self.fuse_epilogues and self._fits(h, w) and self.model.mm_dtype == w.dtype:
            return ops.gemv_glu(h, w)
        return super().glu(h, w)


def gpu_backend(model, batch: int, gemv: bool | None = None) -> CublasBackend:
    """The GPU backend of a decoder of `batch` sequences with a cuBLAS handle of its own: gemv.cu's
    products up to ops.GEMV_AUTO_TOKENS tokens (gemv None: where it measured faster), up to the
    largest gemv instance (True), or never (False)."""
    from llama_min import ops
    tokens = {None: ops.GEMV_AUTO_TOKENS, True: ops.GEMV_TOKENS[-1], False: 0}[gemv]
    from llama_min.cublas import CublasGemm
    cublas = CublasGemm()
    return GemvBackend(model, tokens, cublas) if batch <= tokens else CublasBackend(model, cublas)

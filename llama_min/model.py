"""A minimal Llama decoder on NumPy (CPU) or CuPy (GPU): the weights, the prefill, and one decode
step written once over a Backend (llama_min.backends: NumPy; CuPy with cuBLAS; CuPy with gemv.cu).

Shapes: B batch, T tokens, d hidden, H query heads, KVH KV heads, G = H // KVH, D head dim,
I intermediate, V vocab, L_max cache capacity.

- Residual stream in float32; matmuls in `model.mm_dtype` (float32, or float16 on GPU);
  KV cache / decode attention in `model.kv_dtype` ("float32" | "float16" | "bfloat16", the
  latter stored as uint16 bits as in santa_cupy).
- KV cache (llama_min.kv_cache): contiguous [B, L_max, KVH, D] per layer, or paged (page pools and
  one block table; `new_cache(..., page_size=16)`), behind one KVCache interface.
- Prefill: dense causal attention of each chunk (CHUNK tokens) against the cache.
- Decode (`decode`, `_decode_core`): one token per sequence; attention through
  `santa_cupy.decode_attention` / `DecodePlan` (CPU + method="dense" uses the float32 NumPy dense
  decode below, so the CPU path does not depend on santa_cupy), observable or replaceable per
  layer through an attention hook (`AttentionHook`). On the GPU the step does no host
  synchronisation: positions are the device array `cache.lengths`, so `GraphDecoder`
  (llama_min.graph) captures it as a CUDA graph.
"""

from __future__ import annotations

import contextlib
import functools
import pathlib
from typing import Callable, Protocol

import numpy as np

from llama_min import threads
from llama_min.backends import Backend, CublasBackend, NumpyBackend
from llama_min.config import LlamaConfig, load_config
from llama_min.kv_cache import KVCache, PageAllocator, PagedKVCache
from llama_min.weights import LAYER_WEIGHT_NAMES, WEIGHT_NAMES, Checkpoint, expected_shapes
from santa_cupy.setting import AttentionSetting

__all__ = ["CHUNK", "DENSE", "DTYPE_PLAN", "AttentionHook", "AttentionSetting", "KVCache", "LlamaModel",
           "PageAllocator", "PagedKVCache", "rope_inv_freq"]

CHUNK = 512  # prefill chunk length (tokens)

# (device, requested dtype) -> (matmul dtype, KV-cache dtype name). None = the device default.
# CuPy has no bf16 GEMM: "bfloat16" keeps bf16 in the KV cache / attention and float32 matmuls.
DTYPE_PLAN = {
    ("cpu", None): ("float32", "float32"),
    ("cpu", "float32"): ("float32", "float32"),
    ("cpu", "float16"): ("float32", "float16"),
    ("cpu", "bfloat16"): ("float32", "bfloat16"),
    ("gpu", None): ("float16", "float16"),
    ("gpu", "float32"): ("float32", "float32"),
    ("gpu", "float16"): ("float16", "float16"),
    ("gpu", "bfloat16"): ("float32", "bfloat16"),
}


# The decoder's default attention: exact. Any santa_cupy.AttentionSetting (the one setting type of
# santa_cupy, its CLI, bench and eval) selects the decode attention; on the CPU budget one_pass uses
# as a layer's hint its exact lse at the previous decode step.
DENSE = AttentionSetting(method="dense")


def _import_cupy():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as e:  # ImportError, CUDARuntimeError, ...
        raise RuntimeError(f"device='gpu' needs CuPy and a CUDA GPU ({type(e).__name__}: {e})") from None
    return cupy


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """[D/2] float64 inverse frequencies, with Llama 3.1 ('llama3') scaling if configured."""
    D = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    factor, lo, hi, old = (rs[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                            "original_max_position_embeddings"))
    wavelen = 2 * np.pi / inv
    smooth = np.clip((old / wavelen - lo) / (hi - lo), 0.0, 1.0)  # 0: long waves, 1: short waves
    return (1 - smooth) * inv / factor + smooth * inv


class LlamaModel:
    def __init__(self, cfg: LlamaConfig, weights: dict, xp, device: str, mm_dtype: str, kv_dtype: str):
        self.cfg, self.w, self.xp, self.device = cfg, weights, xp, device
        self.mm_dtype = np.dtype(mm_dtype)
        self.kv_dtype = kv_dtype
        self._kv_storage = np.dtype(np.uint16 if kv_dtype == "bfloat16" else kv_dtype)
        self.H, self.KVH, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.KVH
        # the global index of this model's first query head in SANTA's RNG keys: 0, or a
        # tensor-parallel rank's first head (llama_min.tensor_parallel), so its samples are the whole model's
        self.head_offset = 0
        self.scale = 1.0 / np.sqrt(self.D)
        ang = np.arange(cfg.max_position_embeddings, dtype=np.float64)[:, None] * rope_inv_freq(cfg)
        self.cos = xp.asarray(np.cos(ang).astype(np.float32))   # [P, D/2]
        self.sin = xp.asarray(np.sin(ang).astype(np.float32))
        # the products and small steps of the prefill and of decode(): chosen here, once
        self.backend: Backend = NumpyBackend(self) if xp is np else CublasBackend(self)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_pretrained(cls, path, device: str = "cpu", dtype: str | None = None) -> "LlamaModel":
        if (device, dtype) not in DTYPE_PLAN:
            raise ValueError(f"unsupported device/dtype: device={device!r} (cpu|gpu), "
                             f"dtype={dtype!r} (None|float32|float16|bfloat16)")
        xp = _import_cupy() if device == "gpu" else np
        mm_dtype, kv_dtype = DTYPE_PLAN[(device, dtype)]
        path = pathlib.Path(path)
        cfg = load_config(path)
        ckpt = Checkpoint(path)
        glob_shapes, layer_shapes = expected_shapes(cfg)
        mm = np.dtype(mm_dtype)

        def get(name, shape):          # -> NumPy array (bf16 widened), shape-checked
            return ckpt.get(name, shape)

        def up(a, dt):                 # -> device array of dtype dt
            return xp.asarray(np.ascontiguousarray(a, dtype=dt))

        w = {"embed": up(get(WEIGHT_NAMES["embed"], glob_shapes["embed"]), mm),
             "norm": up(get(WEIGHT_NAMES["norm"], glob_shapes["norm"]), np.float32)}
        if cfg.tie_word_embeddings or WEIGHT_NAMES["lm_head"] not in ckpt:
            w["lm_head"] = w["embed"]
        else:
            w["lm_head"] = up(get(WEIGHT_NAMES["lm_head"], glob_shapes["lm_head"]), mm)
        layers = []
        for i in range(cfg.num_hidden_layers):
            t = {k: get(n.format(i=i), layer_shapes[k]) for k, n in LAYER_WEIGHT_NAMES.items()}
            layers.append({
                "attn_norm": up(t["attn_norm"], np.float32),
                "wqkv": up(np.concatenate([t["wq"], t["wk"], t["wv"]], 0), mm),   # [(H+2KVH)D, d]
                "wo": up(t["wo"], mm),                                              # [d, HD]
                "mlp_norm": up(t["mlp_norm"], np.float32),
                "w_gu": up(np.concatenate([t["w_gate"], t["w_up"]], 0), mm),      # [2I, d]
                "w_down": up(t["w_down"], mm),                                      # [d, I]
            })
        w["layers"] = layers
        return cls(cfg, w, xp, device, mm_dtype, kv_dtype)

    def new_cache(self, batch: int = 1, max_len: int | None = None, *, page_size: int | None = None,
                  num_pages: int | None = None, page_seed: int | None = None, key_block: int | None = None) -> KVCache:
        """A KV cache for `batch` sequences of up to `max_len` tokens: contiguous (page_size None), or
        paged (PagedKVCache: pages of page_size rows, 1..256, from a pool of num_pages, default enough
        for every sequence at max_len; page_seed shuffles the pool's order). key_block FB (16 | 32,
        contiguous only): K stored feature-blocked (KVCache; on the GPU the decode attention is then
        santa_cupy's dense kernel on that layout, method "dense" only)."""
        P = self.cfg.max_position_embeddings
        max_len = P if max_len is None else int(max_len)
        if not 1 <= max_len <= P:
            raise ValueError(f"max_len must be in 1..{P} (max_position_embeddings), got {max_len}")
        args = (self.xp, self.cfg.num_hidden_layers, int(batch), max_len, self.KVH, self.D, self._kv_storage)
        if page_size is None:
            if num_pages is not None or page_seed is not None:
                raise ValueError("num_pages and page_seed need a paged cache (page_size)")
            return KVCache(*args, key_block=key_block)
        if key_block is not None:
            raise ValueError("key_block (a feature-blocked K) has no paged form: give page_size or key_block, not both")
        return PagedKVCache(*args, page_size=page_size, num_pages=num_pages, page_seed=page_seed)

    # ------------------------------------------------------------------ small pieces

    def _to_kv(self, x):
        """float array -> KV storage dtype (bf16: round to nearest even, as uint16 bits)."""
        xp = self.xp
        if self.kv_dtype != "bfloat16":
            return x.astype(self._kv_storage, copy=False)
        bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
        return ((bits + (xp.uint32(0x7FFF) + ((bits >> 16) & 1))) >> 16).astype(xp.uint16)

    def _from_kv(self, x, dtype):
        """KV storage -> float array of `dtype`."""
        xp = self.xp
        if self.kv_dtype == "bfloat16":
            x = (x.astype(xp.uint32) << 16).view(xp.float32)
        return x.astype(dtype, copy=False)

    def _rmsnorm(self, x, w):                       # x [N, d] f32 -> f32
        xp = self.xp
        return x * (1.0 / xp.sqrt((x * x).mean(-1, keepdims=True) + self.cfg.rms_norm_eps)) * w

    @staticmethod
    def _rope(x, cos, sin):                         # x [..., D]; cos/sin broadcast to [..., D/2]
        h = x.shape[-1] // 2
        x1, x2 = x[..., :h], x[..., h:]
        out = x.copy()                              # rotate_half convention (HF Llama)
        out[..., :h] = x1 * cos - x2 * sin
        out[..., h:] = x2 * cos + x1 * sin
        return out

    def _qkv(self, lw, x, cos, sin):
        """x [N, d] f32, cos/sin [N, 1, D/2] -> q [N,H,D], k [N,KVH,D] (f32, rotated), v [N,KVH,D]."""
        N, H, KVH, D = x.shape[0], self.H, self.KVH, self.D
        h = self._rmsnorm(x, lw["attn_norm"]).astype(self.mm_dtype)
        qkv = self._linear(h, lw["wqkv"]).astype(np.float32, copy=False)     # [N, (H+2KVH)D]
        q = qkv[:, :H * D].reshape(N, H, D)
        k = qkv[:, H * D:(H + KVH) * D].reshape(N, KVH, D)
        v = qkv[:, (H + KVH) * D:].reshape(N, KVH, D)
        return self._rope(q, cos, sin), self._rope(k, cos, sin), v

    def _out_mlp(self, lw, x, o):
        """Residual update: x [N,d] f32, attention output o [N, H*D] -> x after o_proj and MLP."""
        xp, mm = self.xp, self.mm_dtype
        x = x + self._row_linear(o.astype(mm), lw["wo"])
        h = self._rmsnorm(x, lw["mlp_norm"]).astype(mm)
        gu = self._linear(h, lw["w_gu"]).astype(np.float32, copy=False)       # [N, 2I]
        I = gu.shape[1] // 2
        g = gu[:, :I]
        a = g * (0.5 * (1.0 + xp.tanh(0.5 * g))) * gu[:, I:]           # silu(gate) * up
        return x + self._row_linear(a.astype(mm), lw["w_down"])

    def _row_linear(self, x, w):
        """The prefill's O and down products as float32 [N, d] (what a tensor-parallel rank sums
        over its ranks: llama_min.tensor_parallel)."""
        return self._linear(x, w).astype(np.float32, copy=False)

    def _embed(self, ids):                          # ids [N] -> [N, d] f32 (a tensor-parallel rank: summed)
        return self.w["embed"][ids].astype(np.float32)

    def _head(self, x):                             # x [N, d] f32 -> logits [N, V] f32
        h = self._rmsnorm(x, self.w["norm"]).astype(self.mm_dtype)
        return self._lm_head(h)

    def _lm_head(self, h):                          # h [N, d] mm -> [N, V] f32 (a tensor-parallel rank: gathered)
        return self._linear(h, self.w["lm_head"]).astype(np.float32, copy=False)

    def _linear(self, x, w, out_dtype=None):
        """x [N, K] @ w [N_out, K].T -> [N, N_out] of w's dtype (or out_dtype): the prefill's
        products, through the model's backend (NumPy, or cuBLAS on the GPU)."""
        return self.backend.linear(x, w, out_dtype)

    # ------------------------------------------------------------------ prefill

    def _forward_chunk(self, ids, cache: KVCache, start: int):
        """ids [B, T] device ints at positions start.. -> final hidden [B*T, d] f32; fills the cache."""
        xp = self.xp
        B, T = ids.shape
        H, KVH, G, D = self.H, self.KVH, self.G, self.D
        L = start + T
        x = self._embed(ids.reshape(-1))                                    # [B*T, d] f32
        cos = xp.tile(self.cos[start:L], (B, 1))[:, None, :]               # [B*T, 1, D/2]
        sin = xp.tile(self.sin[start:L], (B, 1))[:, None, :]
        qpos = xp.arange(start, L)[:, None]
        bias = xp.where(xp.arange(L)[None, :] <= qpos, 0.0, -np.inf).astype(np.float32)  # [T, L]
        cdt = self.mm_dtype
        for li, lw in enumerate(self.w["layers"]):
            q, k, v = self._qkv(lw, x, cos, sin)
            cache.write_rows(li, start, self._to_kv(k.reshape(B, T, KVH, D)), self._to_kv(v.reshape(B, T, KVH, D)))
            kc, vc = cache.read(li, L)
            kk = self._from_kv(kc[:, :L], cdt)                                 # [B, L, KVH, D]
            vv = self._from_kv(vc[:, :L], cdt)
            qg = xp.ascontiguousarray((q * np.float32(self.scale)).reshape(B, T, KVH, G, D)
                                      .transpose(0, 2, 3, 1, 4), dtype=cdt)     # [B, KVH, G, T, D]
            kt = xp.ascontiguousarray(kk.transpose(0, 2, 3, 1))[:, :, None]   # [B, KVH, 1, D, L]
            vt = xp.ascontiguousarray(vv.transpose(0, 2, 1, 3))[:, :, None]   # [B, KVH, 1, L, D]
            s = (qg @ kt).astype(np.float32) + bias                            # [B, KVH, G, T, L]
            s = xp.exp(s - s.max(-1, keepdims=True))
            p = (s / s.sum(-1, keepdims=True)).astype(cdt)
            o = (p @ vt).transpose(0, 3, 1, 2, 4).reshape(B * T, H * D)       # [B*T, H*D]
            x = self._out_mlp(lw, x, o)
        return x

    def _check_ids(self, token_ids):
        xp = self.xp
        if isinstance(token_ids, np.ndarray) or isinstance(token_ids, (list, tuple)):
            ids = np.asarray(token_ids)
            if ids.dtype.kind not in "iu":
                raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
            if ids.size and (ids.min() < 0 or ids.max() >= self.cfg.vocab_size):
                raise ValueError(f"token ids must be in 0..{self.cfg.vocab_size - 1}, "
                                 f"got range {ids.min()}..{ids.max()}")
            return xp.asarray(ids.astype(np.int32))
        return token_ids.astype(xp.int32)

    def prefill(self, token_ids, cache: KVCache, chunk: int = CHUNK, progress=None):
        """token_ids [B, T] -> logits of the last position [B, V] float32 (array of model.xp).

        Appends the T tokens after the cache's current length (causal, in chunks of `chunk`);
        `progress(done, T)` is called after every chunk."""
        ids = self._check_ids(token_ids)
        if ids.ndim != 2 or ids.shape[0] != cache.batch or ids.shape[1] < 1:
            raise ValueError(f"token_ids must be [B={cache.batch}, T>=1], got shape {tuple(ids.shape)}")
        B, T = ids.shape
        start = cache.length
        if start + T > cache.max_len:
            raise ValueError(f"prompt of {T} tokens after {start} cached does not fit the cache "
                             f"(max_len {cache.max_len})")
        cache.reserve(start + T)                                              # paged: the prompt's pages
        with self._blas_threads("prefill", min(T, chunk)):
            for c0 in range(0, T, chunk):
                ids_c = ids[:, c0:c0 + chunk]
                x = self._forward_chunk(ids_c, cache, start + c0)
                cache.length = start + c0 + ids_c.shape[1]
                if progress is not None:
                    progress(c0 + ids_c.shape[1], T)
        cache.lengths[...] = cache.length
        last = x.reshape(B, -1, x.shape[-1])[:, -1]                           # [B, d]
        return self._head(last)

    def logits_all(self, token_ids, chunk: int = CHUNK):
        """Teacher forcing: token_ids [T] -> logits [T, V] float32 at every position."""
        ids = self._check_ids(token_ids).reshape(1, -1)
        T = ids.shape[1]
        cache = self.new_cache(1, T)
        out = self.xp.empty((T, self.cfg.vocab_size), np.float32)
        with self._blas_threads("prefill", min(T, chunk)):
            for c0 in range(0, T, chunk):
                x = self._forward_chunk(ids[:, c0:c0 + chunk], cache, c0)
                out[c0:c0 + x.shape[0]] = self._head(x)
        return out

    def _blas_threads(self, phase, tokens=1):
        """CPU: the BLAS thread count of the phase and chunk (llama_min.threads); GPU: nothing."""
        return threads.blas_threads(phase, tokens) if self.xp is np else contextlib.nullcontext()

    # ------------------------------------------------------------------ decode

    def decode(self, tokens, cache: KVCache, attention: AttentionSetting = DENSE,
               attention_hook: AttentionHook | None = None):
        """One decode step: tokens [B] -> logits [B, V] float32 (array of model.xp).
        attention_hook (AttentionHook): observes or replaces every layer's attention."""
        if cache.length < 1:
            raise ValueError("decode needs a prefilled cache (call prefill first)")
        if cache.length >= cache.max_len:
            raise ValueError(f"KV cache is full (max_len {cache.max_len})")
        tokens = self._check_ids(tokens).reshape(-1)
        if tokens.shape[0] != cache.batch:
            raise ValueError(f"tokens must be [B={cache.batch}], got shape {tuple(tokens.shape)}")
        cache.reserve(cache.length + 1)                                       # paged: a new page at a boundary
        attn = _hooked(self._eager_attention(attention, cache), attention_hook)
        with self._blas_threads("decode"):
            logits = self._decode_core(tokens, cache, attn)
        cache.advance()
        return logits

    def _eager_attention(self, att: AttentionSetting, cache: KVCache):
        """-> attn(layer, q [B,H,D] kv-dtype, k_cache, v_cache, lengths [B]) -> [B,H,D].

        CPU: dense = the float32 NumPy decode below, santa = santa_cupy.cpu_attention (the same
        estimator as the float64 reference, in float32), key sampling = _key_sampled_decode_np (the
        float64 reference of santa_cupy.key_sampling; on the GPU the plan's key pass, with a cache
        made with key_block). GPU: a santa_cupy.DecodePlan kept on the cache (decode_attention would build a
        plan and check lengths on the host, a sync, at every call); its device step counter is
        set to cache.step by a device-side fill, so the step stays free of host syncs."""
        if att.key_sampled and self.xp is np:      # score-stage sampling: the float64 reference
            return self._key_sampled_decode_np(att, cache)
        if att.method == "dense" and self.xp is np:
            n = cache.length + 1
            return lambda li, q, kc, vc, lens: self._dense_decode_np(q, kc, vc, lens, n)
        if self.xp is np:
            return self._santa_decode_np(att, cache)
        plan = cache.plans.get(att)
        if plan is None:
            plan = cache.plans[att] = self.make_plan(att, cache)
        plan.step.fill(cache.step)
        # the plan was built for this model's shapes: skip run()'s per-call input checks
        kw = cache.attention_kwargs                # paged: block_table
        if not att.key_sampled:
            return lambda li, q, kc, vc, lens: plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)
        tally = cache.__dict__.setdefault("key_read", [0.0, 0])

        def attn_keys(li, q, kc, vc, lens):        # the K fraction adds up on the device (no sync)
            o = plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)
            tally[0] = tally[0] + plan.key_pass.key_fraction().mean()
            tally[1] += 1
            return o
        return attn_keys

    def make_plan(self, att: AttentionSetting, cache: KVCache):
        """A santa_cupy.DecodePlan for this model's shapes and the cache (GPU only)."""
        import santa_cupy
        if att.key_sampled and cache.key_block is None:
            raise ValueError(_KEY_SAMPLING_BLOCKED_ONLY)
        if att.budget == santa_cupy.spec.ONE_PASS:
            raise ValueError("budget 'one_pass' in llama_min runs on the CPU for now (the GPU decoder would need "
                             "a hint per layer: santa_cupy.DecodePlan.run(lse_hint=...))")
        paged = dict(page_size=cache.page_size, page_layout="NHD") if cache.paged else {}
        if cache.key_block is not None:            # K feature-blocked: the plan reads that layout
            att = att.replace(key_block=cache.key_block)
        return santa_cupy.DecodePlan(
            batch=cache.batch, heads=self.H, kv_heads=self.KVH, head_dim=self.D, max_length=cache.max_len,
            dtype=self.kv_dtype, setting=att, scale=float(self.scale), step=cache.step,
            head_offset=self.head_offset, key_layout=cache.key_layout, **paged)

    def _santa_decode_np(self, att: AttentionSetting, cache: KVCache):
        """-> attn(...) of SANTA at decode step cache.step through santa_cupy.cpu_attention (float32),
        or, budget one_pass, its float64 reference (santa_cupy.one_pass) with each layer's hint the
        exact lse of its previous step (kept on the cache; the first step uses the exact lse)."""
        from santa_cupy import cpu_attention, one_pass, spec
        block_n = att.block_n or spec.default_block_n("santa", self.D)
        step = cache.step
        if att.budget == spec.ONE_PASS:
            def attn_one_pass(li, q, kc, vc, lens):
                o, info = one_pass.one_pass_attention(
                    q, kc, vc, lens, samples=att.samples, lse_hint=cache.lse_hints.get(li), seed=att.seed,
                    step=step, layer=li, scale=float(self.scale), block_n=block_n, head_offset=self.head_offset)
                cache.lse_hints[li] = info.lse
                cache.rows_taken += int(info.selected.sum())
                return self._to_kv(o.astype(np.float32))
            return attn_one_pass

        def attn(li, q, kc, vc, lens):
            o = cpu_attention.santa_attention(
                q, kc, vc, lens, samples=att.samples, sampler=att.sampler, budget=att.budget,
                seed=att.seed, step=step, layer=li, scale=float(self.scale), block_n=block_n,
                head_offset=self.head_offset)
            return self._to_kv(o)
        return attn

    def _key_sampled_decode_np(self, att: AttentionSetting, cache: KVCache):
        """-> attn(...) of a key-sampling setting at decode step cache.step: santa_cupy.key_sampling's
        float64 reference (key_sampled_attention; the value stage of att.method on the estimated
        scores), each layer's random numbers keyed by (att.seed, cache.step, layer) as SANTA's, so
        it equals santa_cupy.decode_attention(q, k, v, lengths, att, step=cache.step, layer=layer).
        The fraction of K each call reads adds up on the cache: cache.key_read = [sum of the
        calls' key_fraction, calls] (the mean: their ratio; see key_read_fraction)."""
        from santa_cupy import key_sampling, spec
        block_n = att.block_n or spec.default_block_n("santa", self.D)
        step, value = cache.step, ("dense" if att.method == "dense" else "santa")
        tally = cache.__dict__.setdefault("key_read", [0.0, 0])

        def attn(li, q, kc, vc, lens):
            o, _, info, _ = key_sampling.key_sampled_attention(
                q, np.ascontiguousarray(kc), np.ascontiguousarray(vc), lens, value=value, samples=att.samples,
                sampler=att.sampler, budget=att.budget, block_n=block_n, seed=att.seed, step=step, layer=li,
                scale=float(self.scale), **att.key_options)
            tally[0] += info.key_fraction
            tally[1] += 1
            return self._to_kv(o.astype(np.float32))
        return attn

    def _dense_decode_np(self, q, kc, vc, lens, n):
        """Float32 NumPy dense decode over the first n cache rows (rows >= lens[b] masked)."""
        B, KVH, G, D = q.shape[0], self.KVH, self.G, self.D
        qg = self._from_kv(q, np.float32).reshape(B, KVH, G, D)
        kk = self._from_kv(kc[:, :n], np.float32).transpose(0, 2, 3, 1)        # [B, KVH, D, n]
        vv = self._from_kv(vc[:, :n], np.float32).transpose(0, 2, 1, 3)        # [B, KVH, n, D]
        s = (qg @ kk) * np.float32(self.scale)                                  # [B, KVH, G, n]
        s = np.where(np.arange(n)[None, None, None, :] < lens[:, None, None, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        o = (s / s.sum(-1, keepdims=True)) @ vv                                 # [B, KVH, G, D]
        return self._to_kv(o.reshape(B, KVH * G, D))

    def _decode_core(self, tokens, cache: KVCache, attn, backend: Backend | None = None):
        """The decode step, once for every backend: tokens [B] int32 (array of model.xp) -> logits
        [B, V] float32. Reads positions from cache.lengths (on the GPU a device array: no host sync),
        writes K/V at those positions (their pages reserved by the caller), advances nothing.
        attn(layer, q, k, v, lengths) -> o [B, H, D] (KV dtype) is the attention of every layer
        (k, v: backend.kv_view). backend: the model's own, or a decoder's (GraphDecoder)."""
        be = self.backend if backend is None else backend
        pos = cache.lengths                                   # [B] int32: the new token's row
        lens = pos + 1
        n = cache.length + 1                                  # rows attended (all sequences alike)
        x = be.embed(self.w["embed"], tokens)                 # [B, d] f32 residual stream (a copy)
        rows = be.token_rows(cache, pos)                      # where the new token's K/V go
        for li, lw in enumerate(self.w["layers"]):
            q = be.qkv_rope_append(be.rms_norm(x, lw["attn_norm"]), lw["wqkv"], cache, li, pos, rows)
            kc, vc = be.kv_view(cache, li, n)
            o = attn(li, q, kc, vc, lens)                     # [B, H, D] KV dtype
            be.linear_add(be.attention_out(o), lw["wo"], x)
            be.linear_add(be.glu(be.rms_norm(x, lw["mlp_norm"]), lw["w_gu"]), lw["w_down"], x)
        return be.logits(be.rms_norm(x, self.w["norm"]), self.w["lm_head"])


_KEY_SAMPLING_BLOCKED_ONLY = ("key sampling (AttentionSetting.key_sampling) on the GPU reads a feature-blocked K: "
                              "make the cache with model.new_cache(..., key_block=FB), FB the setting's key_block")


def key_read_fraction(cache: KVCache) -> float:
    """Mean fraction of K read by the key-sampled decode calls on this cache since it was made
    (every layer and eager step, CPU or GPU; a GraphDecoder's replays are not counted; 1.0 when
    none ran: all of K is read). KVCache.reset keeps the tally."""
    total, calls = getattr(cache, "key_read", (0.0, 0))
    return float(total / calls) if calls else 1.0


def _hooked(attn, hook):
    """attn(layer, q, k, v, lengths) routed through an AttentionHook (None: attn itself)."""
    if hook is None:
        return attn
    return lambda li, q, kc, vc, lens: hook(li, q, kc, vc, lens, functools.partial(attn, li))


class AttentionHook(Protocol):
    """Observes or replaces the decode attention of every layer (LlamaModel.decode(attention_hook=),
    GraphDecoder(attention_hook=)):

        hook(layer, q, k_cache, v_cache, lengths, attend) -> o

    layer: int; q [B, H, D] of the KV dtype (rotated); k_cache, v_cache: the layer's cache as the
    attention takes it (CPU: [B, >= n, KVH, D] whose first lengths[b] rows are sequence b's; GPU:
    the storage, contiguous [B, L_max, KVH, D] or page pools with cache.block_table, a cache with
    key_block: K blocked [B, KVH, NP, D / FB, P, FB], santa_cupy's key_layout "blocked"); lengths [B]
    int32 (the new token included); attend(q, k_cache, v_cache, lengths) -> o [B, H, D] is the
    configured attention of that layer. Return o of that shape and dtype: attend's to observe,
    another to replace it. The arrays are live (the cache is written by later steps; copy what you
    keep). Inside a GraphDecoder the hook runs once, at capture: it must only enqueue device work."""

    def __call__(self, layer: int, q, k_cache, v_cache, lengths, attend: Callable) -> object: ...


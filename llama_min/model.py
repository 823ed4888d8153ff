"""A minimal Llama decoder on NumPy (CPU) or CuPy (GPU), one code path with `xp` (but the GPU's
decode step, `_decode_core_gpu`, which does the same math in ~10 launches a layer).

Shapes: B batch, T tokens, d hidden, H query heads, KVH KV heads, G = H // KVH, D head dim,
I intermediate, V vocab, L_max cache capacity.

- Residual stream in float32; matmuls in `model.mm_dtype` (float32, or float16 on GPU);
  KV cache / decode attention in `model.kv_dtype` ("float32" | "float16" | "bfloat16", the
  latter stored as uint16 bit patterns as in santa_cupy).
- KV cache: contiguous [B, L_max, KVH, D] per layer, or paged (page pools [num_pages, page_size,
  KVH, D] and one block table; `new_cache(..., page_size=16)`), behind one KVCache interface.
- Prefill: dense causal attention of each chunk (CHUNK tokens) against the cache.
- Decode: one token per sequence; attention through `santa_cupy.decode_attention`
  (CPU + method="dense" uses the float32 NumPy dense decode below, so the CPU path does not depend
  on santa_cupy). The GPU step does no host synchronisation: positions are the device array
  `cache.lengths`, so `GraphDecoder` can capture it as a CUDA graph. Its RMSNorm, rotary + K/V
  append and SiLU * up are santa_cupy.decoder_ops kernels, the residual adds happen inside the
  weight products (cuBLAS beta = 1, or gemv.cu's accumulate at batch 1 in GraphDecoder, where
  rotary + K/V append and SiLU * up also ride in the QKV and gate/up products' launches).
"""

from __future__ import annotations

import contextlib
import pathlib
from dataclasses import asdict, dataclass

import numpy as np

from llama_min import threads
from llama_min.config import LlamaConfig, load_config
from llama_min.weights import LAYER_WEIGHT_NAMES, WEIGHT_NAMES, Checkpoint, expected_shapes

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


@dataclass(frozen=True)
class AttentionConfig:
    """Decode attention settings (passed through to santa_cupy.decode_attention)."""

    method: str = "dense"        # "dense" | "santa"
    samples: int = 256
    sampler: str = "systematic"  # "iid" | "stratified" | "systematic"
    budget: str = "global"       # "fixed" | "global" | "largest_remainder" | "one_pass" (CPU: the
    #                              hint of a layer is its exact lse at the previous decode step)
    seed: int = 0
    block_n: int | None = None   # None: santa_cupy's default for the method and head dim
    # GPU: sequences shorter than this decode with exact attention where it is faster ("auto": the
    # plan's crossover for the shape and device; 0: santa at every length, e.g. for accuracy studies)
    santa_min_length: int | str = "auto"

    def __post_init__(self):
        if self.method not in ("dense", "santa"):
            raise ValueError(f"attention method must be 'dense' or 'santa', got {self.method!r}")

    def as_dict(self) -> dict:
        return asdict(self)


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


class KVCache:
    """Preallocated KV cache, one type with two storage forms (``new_cache(..., page_size=...)``):

    - contiguous (this class, page_size None): k[l], v[l] are [B, L_max, KVH, D] (santa_cupy layout);
    - paged (PagedKVCache): k[l], v[l] are page pools [num_pages, page_size, KVH, D] (NHD, FlashInfer's
      and vLLM's layout) and one block table [B, max_pages] int32 (device array on GPU) maps every
      sequence's rows to pages for all layers; a host-side allocator hands out pages as sequences grow.

    `lengths` [B] int32 (device array on GPU) = tokens stored per sequence; `length` is its host
    mirror (all rows are equal); `step` counts decode steps (the SANTA RNG step).
    The model reads and writes through reserve / write_rows / token_index + write_token / read
    and passes attention_kwargs to santa_cupy, so both forms share one code path."""

    page_size = None                                  # contiguous
    block_table = None

    def __init__(self, xp, n_layers, batch, max_len, kvh, head_dim, storage_dtype):
        shape = self._storage_shape(batch, max_len, kvh, head_dim)
        self.xp = xp
        self.k = [xp.zeros(shape, storage_dtype) for _ in range(n_layers)]
        self.v = [xp.zeros(shape, storage_dtype) for _ in range(n_layers)]
        self.lengths = xp.zeros((batch,), xp.int32)
        self._row_ids = xp.arange(batch)              # token_index's sequence ids
        self.plans = {}                               # AttentionConfig -> santa_cupy.DecodePlan (GPU)
        self.lse_hints = {}                           # budget one_pass: layer -> [B, H] lse of the last step
        self.rows_taken = 0                           # budget one_pass: rows taken, summed over steps, layers, heads
        self.length = 0
        self.step = 0
        self.batch, self.max_len = batch, max_len

    @staticmethod
    def _storage_shape(batch, max_len, kvh, head_dim):
        return (batch, max_len, kvh, head_dim)

    @property
    def paged(self) -> bool:
        return self.page_size is not None

    @property
    def attention_kwargs(self) -> dict:
        """What santa_cupy's decode_attention / DecodePlan.run need besides q, k, v, lengths."""
        return {}

    def reserve(self, length: int):
        """Make room for `length` tokens in every sequence (paged: allocate the pages they need)."""
        if length > self.max_len:
            raise ValueError(f"KV cache is full (max_len {self.max_len}): {length} tokens do not fit")

    def write_rows(self, layer: int, start: int, k, v):
        """Prefill: k, v [B, T, KVH, D] (storage dtype) into rows start .. start + T - 1 of every sequence."""
        end = start + k.shape[1]
        self.k[layer][:, start:end] = k
        self.v[layer][:, start:end] = v

    def token_index(self, pos):
        """Where row pos[b] of every sequence b lives (pos [B] ints), for write_token: computed once
        a decode step, used by every layer."""
        return self._row_ids, pos

    def write_token(self, layer: int, index, k, v):
        """Decode (array path): k, v [B, KVH, D] into the rows of token_index(pos)."""
        self.k[layer][index] = k
        self.v[layer][index] = v

    def read(self, layer: int, n: int):
        """(k, v) [B, >= n, KVH, D] whose first n rows are every sequence's rows 0 .. n - 1 (contiguous:
        the cache arrays themselves; paged: the sequences' pages gathered)."""
        return self.k[layer], self.v[layer]

    def reset(self):
        self.lengths[...] = 0
        self.length = 0
        self.step = 0
        self.lse_hints.clear()
        self.rows_taken = 0


class PageAllocator:
    """Host-side free list of a page pool's ids 0 .. num_pages - 1. alloc hands out ids in the
    pool's order (ascending, or a random permutation given a seed); release takes them back, to
    be handed out again first."""

    def __init__(self, num_pages: int, seed: int | None = None):
        order = np.arange(num_pages) if seed is None else np.random.default_rng(seed).permutation(num_pages)
        self.num_pages = int(num_pages)
        self._free = [int(p) for p in order[::-1]]    # a stack: the next page is the last entry

    @property
    def free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"KV cache page pool exhausted: {n} more pages needed, {len(self._free)} of "
                             f"{self.num_pages} free (give new_cache a larger num_pages)")
        out = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return out

    def release(self, pages):
        self._free.extend(int(p) for p in reversed(list(pages)))


class PagedKVCache(KVCache):
    """KVCache on a page pool (see KVCache): k[l], v[l] [num_pages, page_size, KVH, D] (NHD);
    block_table [B, max_pages] int32, max_pages = ceil(max_len / page_size), a device array on
    GPU whose address never changes (GraphDecoder's graph reads it; new pages are written into it
    in place); `table` is its host mirror and `pages_held` [B] the pages each sequence holds.
    Row j of sequence b is slot j % page_size of page block_table[b, j // page_size]; entries past
    a sequence's pages are 0 (never read).

    Pages are allocated lazily by reserve(length) (prefill, and each decode step that crosses a
    page boundary), page by page round the batch, so sequences' pages interleave; num_pages
    defaults to B * max_pages (never exhausted), fewer gives a clear error when the pool runs out;
    page_seed shuffles the pool's order (tests, bench). reset() returns every page."""

    def __init__(self, xp, n_layers, batch, max_len, kvh, head_dim, storage_dtype, *, page_size=16,
                 num_pages=None, page_seed=None):
        from santa_cupy.paged import MAX_PAGE_SIZE
        if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) \
                or not 1 <= page_size <= MAX_PAGE_SIZE:
            raise ValueError(f"page_size must be an integer in 1..{MAX_PAGE_SIZE}, got {page_size!r}")
        self.page_size = int(page_size)
        self.max_pages = -(-int(max_len) // self.page_size)
        self.num_pages = int(batch) * self.max_pages if num_pages is None else int(num_pages)
        if self.num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        super().__init__(xp, n_layers, batch, max_len, kvh, head_dim, storage_dtype)
        self.allocator = PageAllocator(self.num_pages, page_seed)
        self.table = np.zeros((batch, self.max_pages), np.int32)
        self.block_table = self.table if xp is np else xp.zeros((batch, self.max_pages), xp.int32)
        self.pages_held = np.zeros(batch, np.int64)
        self._run_start = None                       # read()'s view: first page of batch 1's ascending run
        self._held_min = 0                           # min(pages_held), a host int for the per-step checks
        flat = lambda pool: pool.reshape((-1,) + pool.shape[2:])      # noqa: E731  [num_pages * page_size, KVH, D]
        self._flat_k, self._flat_v = [flat(a) for a in self.k], [flat(a) for a in self.v]

    def _storage_shape(self, batch, max_len, kvh, head_dim):
        return (self.num_pages, self.page_size, kvh, head_dim)

    @property
    def attention_kwargs(self) -> dict:
        return {"block_table": self.block_table}

    def reserve(self, length: int):
        super().reserve(length)
        need = -(-int(length) // self.page_size)
        if need <= self._held_min:
            return
        short = int(np.maximum(need - self.pages_held, 0).sum())
        if short > self.allocator.free:
            raise ValueError(f"KV cache page pool exhausted: {length} tokens in each of {self.batch} sequences need "
                             f"{short} more pages of {self.page_size} rows, {self.allocator.free} of "
                             f"{self.num_pages} free (give new_cache a larger num_pages)")
        for j in range(int(self.pages_held.min()), need):          # page by page round the batch
            for b in np.nonzero(self.pages_held <= j)[0]:
                self.table[b, j] = self.allocator.alloc(1)[0]
                self.pages_held[b] = j + 1
        self._table_changed()

    def _upload(self):
        """The host table into the device block table, in place, ordered on the current stream."""
        if self.block_table is not self.table:
            self.block_table.set(self.table, stream=self.xp.cuda.get_current_stream())

    def _pool_rows(self, b_rows, positions):
        """Rows of the pools seen as [num_pages * page_size, KVH, D] holding rows `positions` (host
        ints) of sequences b_rows: page * page_size + slot; ValueError where a page is not held."""
        positions = np.asarray(positions, np.int64)
        page = positions // self.page_size
        if np.any(page >= self.pages_held[b_rows]):
            raise ValueError(f"KV cache rows up to {int(positions.max())} are not in the block table "
                             f"(reserve them first)")
        return self.table[b_rows, page].astype(np.int64) * self.page_size + positions % self.page_size

    def write_rows(self, layer: int, start: int, k, v):
        B, T = k.shape[:2]
        rows = self._pool_rows(np.arange(B)[:, None], np.arange(start, start + T)[None, :])   # [B, T]
        self.write_token(layer, self.xp.asarray(rows), k, v)

    def token_index(self, pos):
        """pos [B] host ints (the CPU decode step; the GPU one appends in rope_append) -> pool rows."""
        return self._pool_rows(np.arange(pos.shape[0]), pos)

    def write_token(self, layer: int, index, k, v):
        self._flat_k[layer][index] = k                  # views of the pools: written in place
        self._flat_v[layer][index] = v

    def read(self, layer: int, n: int):
        """(k, v) [B, used pages * page_size, KVH, D]: a view of the pools where the sequence's pages
        are one ascending run (batch 1, the allocator's order: generate's case), else the pages
        gathered (a copy; ~33 µs a layer and array at 1k rows of SmolLM2-135M on the CPU)."""
        used = -(-int(n) // self.page_size)
        if used > self._held_min:
            raise ValueError(f"KV cache rows up to {n - 1} are not in the block table (reserve them first)")
        shape = (self.batch, used * self.page_size) + self.k[layer].shape[2:]
        if self._run_start is not None:                                 # pages run_start .. + used - 1
            run = slice(self._run_start, self._run_start + used)
            return self.k[layer][run].reshape(shape), self.v[layer][run].reshape(shape)
        ids = self.block_table[:, :used]                                # [B, used]
        return self.k[layer][ids].reshape(shape), self.v[layer][ids].reshape(shape)

    def _table_changed(self):
        """After the host table changed: its run (batch 1, pages ascending by one) and the upload."""
        self._held_min = int(self.pages_held.min())
        held = int(self.pages_held[0])
        row = self.table[0, :held]
        ascending = self.batch == 1 and held > 0 and bool(np.all(np.diff(row) == 1))
        self._run_start = int(row[0]) if ascending else None
        self._upload()

    def reset(self):
        super().reset()
        for b in range(self.batch - 1, -1, -1):
            self.allocator.release(self.table[b, :self.pages_held[b]])
        self.table[...] = 0
        self.pages_held[...] = 0
        self._table_changed()


class LlamaModel:
    def __init__(self, cfg: LlamaConfig, weights: dict, xp, device: str, mm_dtype: str, kv_dtype: str):
        self.cfg, self.w, self.xp, self.device = cfg, weights, xp, device
        self.mm_dtype = np.dtype(mm_dtype)
        self.kv_dtype = kv_dtype
        self._kv_storage = np.dtype(np.uint16 if kv_dtype == "bfloat16" else kv_dtype)
        self.H, self.KVH, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.G = self.H // self.KVH
        self.scale = 1.0 / np.sqrt(self.D)
        ang = np.arange(cfg.max_position_embeddings, dtype=np.float64)[:, None] * rope_inv_freq(cfg)
        self.cos = xp.asarray(np.cos(ang).astype(np.float32))   # [P, D/2]
        self.sin = xp.asarray(np.sin(ang).astype(np.float32))
        self._gemm = None          # set by GraphDecoder while warming up / capturing
        self._eager_gemm = None    # GPU: a _CublasGemm of our own, made at the first product

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
                  num_pages: int | None = None, page_seed: int | None = None) -> KVCache:
        """A KV cache for `batch` sequences of up to `max_len` tokens: contiguous (page_size None), or
        paged (PagedKVCache: pages of page_size rows, 1..256, from a pool of num_pages, default enough
        for every sequence at max_len; page_seed shuffles the pool's order)."""
        P = self.cfg.max_position_embeddings
        max_len = P if max_len is None else int(max_len)
        if not 1 <= max_len <= P:
            raise ValueError(f"max_len must be in 1..{P} (max_position_embeddings), got {max_len}")
        args = (self.xp, self.cfg.num_hidden_layers, int(batch), max_len, self.KVH, self.D, self._kv_storage)
        if page_size is None:
            if num_pages is not None or page_seed is not None:
                raise ValueError("num_pages and page_seed need a paged cache (page_size)")
            return KVCache(*args)
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
        x = x + self._linear(o.astype(mm), lw["wo"]).astype(np.float32, copy=False)
        h = self._rmsnorm(x, lw["mlp_norm"]).astype(mm)
        gu = self._linear(h, lw["w_gu"]).astype(np.float32, copy=False)       # [N, 2I]
        I = gu.shape[1] // 2
        g = gu[:, :I]
        a = g * (0.5 * (1.0 + xp.tanh(0.5 * g))) * gu[:, I:]           # silu(gate) * up
        return x + self._linear(a.astype(mm), lw["w_down"]).astype(np.float32, copy=False)

    def _head(self, x):                             # x [N, d] f32 -> logits [N, V] f32
        h = self._rmsnorm(x, self.w["norm"]).astype(self.mm_dtype)
        return self._linear(h, self.w["lm_head"]).astype(np.float32, copy=False)

    def _linear(self, x, w, accumulate_into=None, out_dtype=None):
        """x [N, K] @ w[N_out, K].T -> [N, N_out] of w's dtype (or out_dtype); with accumulate_into
        (a float32 [N, N_out] array, the residual stream) the product is added to it instead.
        On the GPU: cuBLAS through ctypes (CuPy refuses cuBLAS calls during stream capture), or
        GraphDecoder's weight products (cuBLAS or gemv.cu) while it warms up and captures."""
        gemm = self._gemm
        if gemm is None and self.xp is not np:      # the same cuBLAS calls as in the graph
            if self._eager_gemm is None:
                self._eager_gemm = _CublasGemm()
            gemm = self._eager_gemm
        if gemm is not None:
            return gemm(x, w, accumulate_into=accumulate_into, out_dtype=out_dtype)
        y = x @ w.T
        if accumulate_into is not None:
            accumulate_into += y
            return accumulate_into
        return y if out_dtype is None else y.astype(out_dtype, copy=False)

    # ------------------------------------------------------------------ prefill

    def _forward_chunk(self, ids, cache: KVCache, start: int):
        """ids [B, T] device ints at positions start.. -> final hidden [B*T, d] f32; fills the cache."""
        xp = self.xp
        B, T = ids.shape
        H, KVH, G, D = self.H, self.KVH, self.G, self.D
        L = start + T
        x = self.w["embed"][ids.reshape(-1)].astype(np.float32)           # [B*T, d]
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

    def decode(self, tokens, cache: KVCache, attention: AttentionConfig = AttentionConfig()):
        """One decode step: tokens [B] -> logits [B, V] float32 (array of model.xp)."""
        if cache.length < 1:
            raise ValueError("decode needs a prefilled cache (call prefill first)")
        if cache.length >= cache.max_len:
            raise ValueError(f"KV cache is full (max_len {cache.max_len})")
        tokens = self._check_ids(tokens).reshape(-1)
        if tokens.shape[0] != cache.batch:
            raise ValueError(f"tokens must be [B={cache.batch}], got shape {tuple(tokens.shape)}")
        cache.reserve(cache.length + 1)                                       # paged: a new page at a boundary
        attn = self._eager_attention(attention, cache)
        with self._blas_threads("decode"):
            logits = self._decode_core(tokens, cache, attn)
        cache.lengths += 1
        cache.length += 1
        cache.step += 1
        return logits

    def _eager_attention(self, att: AttentionConfig, cache: KVCache):
        """-> attn(layer, q [B,H,D] kv-dtype, k_cache, v_cache, lengths [B]) -> [B,H,D].

        CPU: dense = the float32 NumPy decode below, santa = santa_cupy.cpu_attention (the same
        estimator as the float64 reference, in float32). GPU: a santa_cupy.DecodePlan kept on the cache (decode_attention would build a
        plan and check lengths on the host, a sync, at every call); its device step counter is
        set to cache.step by a device-side fill, so the step stays free of host syncs."""
        if att.method == "dense" and self.xp is np:
            n = cache.length + 1
            return lambda li, q, kc, vc, lens: self._dense_decode_np(q, kc, vc, lens, n)
        if self.xp is np:
            return self._santa_decode_np(att, cache)
        import santa_cupy
        if self.xp is not np and hasattr(santa_cupy, "DecodePlan"):
            plan = cache.plans.get(att)
            if plan is None:
                plan = cache.plans[att] = self.make_plan(att, cache)
            plan.step.fill(cache.step)
            # the plan was built for this model's shapes: skip run()'s per-call input checks
            kw = cache.attention_kwargs                # paged: block_table
            return lambda li, q, kc, vc, lens: plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)
        step = cache.step
        kw = dict(cache.attention_kwargs, page_layout="NHD") if cache.paged else {}

        def attn(li, q, kc, vc, lens):
            return santa_cupy.decode_attention(
                q, kc, vc, lens, method=att.method, samples=att.samples, sampler=att.sampler,
                budget=att.budget, seed=att.seed, step=step, layer=li, block_n=att.block_n, **kw)
        return attn

    def make_plan(self, att: AttentionConfig, cache: KVCache):
        """A santa_cupy.DecodePlan for this model's shapes and the cache (GPU only)."""
        import santa_cupy
        if att.budget == santa_cupy.spec.ONE_PASS:
            raise ValueError("budget 'one_pass' in llama_min runs on the CPU for now (the GPU decoder would need "
                             "a hint per layer: santa_cupy.DecodePlan.run(lse_hint=...))")
        paged = dict(page_size=cache.page_size, page_layout="NHD") if cache.paged else {}
        return santa_cupy.DecodePlan(
            batch=cache.batch, heads=self.H, kv_heads=self.KVH, head_dim=self.D,
            max_length=cache.max_len, dtype=self.kv_dtype, method=att.method, samples=att.samples,
            sampler=att.sampler, budget=att.budget, seed=att.seed, scale=float(self.scale),
            block_n=att.block_n, step=cache.step, santa_min_length=att.santa_min_length, **paged)

    def _santa_decode_np(self, att: AttentionConfig, cache: KVCache):
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
                    step=step, layer=li, scale=float(self.scale), block_n=block_n)
                cache.lse_hints[li] = info.lse
                cache.rows_taken += int(info.selected.sum())
                return self._to_kv(o.astype(np.float32))
            return attn_one_pass

        def attn(li, q, kc, vc, lens):
            o = cpu_attention.santa_attention(
                q, kc, vc, lens, samples=att.samples, sampler=att.sampler, budget=att.budget,
                seed=att.seed, step=step, layer=li, scale=float(self.scale), block_n=block_n)
            return self._to_kv(o)
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

    def _decode_core(self, tokens, cache: KVCache, attn):
        """tokens [B] device int32 -> logits [B, V] f32. Reads positions from cache.lengths on
        device (no host sync); writes K/V at those positions (their pages reserved by the caller);
        does not advance anything."""
        if self.xp is not np:
            return self._decode_core_gpu(tokens, cache, attn)
        B = tokens.shape[0]
        H, D = self.H, self.D
        pos = cache.lengths                                   # [B] int32
        lens = pos + 1
        x = self.w["embed"][tokens].astype(np.float32)       # [B, d]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]    # [B, 1, D/2]
        n = cache.length + 1                                  # rows attended (all sequences alike)
        at = cache.token_index(pos)                           # where the new token's K/V go
        for li, lw in enumerate(self.w["layers"]):
            q, k, v = self._qkv(lw, x, cos, sin)             # [B,H,D], [B,KVH,D], [B,KVH,D]
            cache.write_token(li, at, self._to_kv(k), self._to_kv(v))
            kc, vc = cache.read(li, n)                        # [B, >= n, KVH, D]
            o = attn(li, self._to_kv(q), kc, vc, lens)
            x = self._out_mlp(lw, x, self._from_kv(o, np.float32).reshape(B, H * D))
        return self._head(x)

    def _decode_core_gpu(self, tokens, cache: KVCache, attn):
        """The same step on the GPU with ~10 launches a layer instead of ~60: RMSNorm, rotary + K/V
        append and SiLU * up are one kernel each (santa_cupy.decoder_ops), and the residual adds
        happen inside the weight products (accumulate_into). Where GraphDecoder's products are
        gemv.cu's (_GemvFirst), the rotary + K/V append and SiLU * up ride in the QKV and gate/up
        products' launches (bit-identical): 8 launches a layer."""
        from santa_cupy import decoder_ops as ops
        B, H, KVH, D = tokens.shape[0], self.H, self.KVH, self.D
        mm, eps = self.mm_dtype, self.cfg.rms_norm_eps
        pos = cache.lengths                                   # [B] int32: the new token's row
        lens = pos + 1
        x = self.w["embed"][tokens].astype(np.float32)       # [B, d] f32 residual stream
        fused = self._gemm if hasattr(self._gemm, "product_rope") else None   # gemv.cu's epilogues
        for li, lw in enumerate(self.w["layers"]):
            h = ops.rms_norm(x, lw["attn_norm"], eps, mm)
            rope = (self.cos, self.sin, pos, cache.k[li], cache.v[li], H, KVH, self.kv_dtype)
            table = cache.block_table                         # paged: the page pools' block table, else None
            q = fused.product_rope(h, lw["wqkv"], *rope, table) if fused else None   # [B, H, D] KV dtype
            if q is None:
                q = ops.rope_append(self._linear(h, lw["wqkv"]), *rope, block_table=table)   # via qkv [B, (H+2KVH)D]
            o = attn(li, q, cache.k[li], cache.v[li], lens).reshape(B, H * D)           # KV dtype
            o = o if self.kv_dtype == mm.name else self._from_kv(o, mm)
            self._linear(o, lw["wo"], accumulate_into=x)
            h = ops.rms_norm(x, lw["mlp_norm"], eps, mm)
            a = fused.product_glu(h, lw["w_gu"], mm) if fused else None                # [B, I] mm
            if a is None:
                a = ops.silu_mul(self._linear(h, lw["w_gu"]), mm)                        # via gu [B, 2I]
            self._linear(a, lw["w_down"], accumulate_into=x)
        return self._linear(ops.rms_norm(x, self.w["norm"], eps, mm), self.w["lm_head"], out_dtype=np.float32)


class _CublasGemm:
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
            raise RuntimeError("GraphDecoder: cannot locate libcublas")
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


class _GemvFirst:
    """Weight products of <= max_tokens tokens with float16 weights through santa_cupy's gemv.cu
    (float32 out, accumulate_into added in the same launch); everything else through cuBLAS."""

    def __init__(self, cublas: _CublasGemm, max_tokens: int):
        from santa_cupy import decoder_ops
        self.cublas, self.ops, self.max_tokens = cublas, decoder_ops, max_tokens

    def _fits(self, x, w) -> bool:
        return (x.shape[0] <= self.max_tokens and w.dtype == np.float16 and x.dtype == w.dtype
                and w.shape[1] % 8 == 0 and x.flags.c_contiguous and x.data.ptr % 16 == 0)

    def __call__(self, x, w, accumulate_into=None, out_dtype=None):
        if self._fits(x, w):
            return self.ops.gemv(x, w, out=accumulate_into, accumulate=accumulate_into is not None)
        return self.cublas(x, w, accumulate_into=accumulate_into, out_dtype=out_dtype)

    def product_rope(self, x, w, cos, sin, pos, k_cache, v_cache, heads, kv_heads, kv_dtype, block_table=None):
        """q [n, heads, D] from the QKV product with the rotary + K/V append in the same launch
        (decoder_ops.gemv_rope; paged caches with block_table), or None where gemv does not take it
        (the caller falls back)."""
        if not self._fits(x, w) or kv_dtype not in self.ops.GEMV_DTYPES:
            return None
        return self.ops.gemv_rope(x, w, cos, sin, pos, k_cache, v_cache, heads, kv_heads, kv_dtype,
                                  block_table=block_table)

    def product_glu(self, x, w, out_dtype):
        """silu(gate) * up [n, I] from the gate/up product in one launch (decoder_ops.gemv_glu), or
        None where gemv does not take it."""
        if not self._fits(x, w) or np.dtype(out_dtype) != w.dtype:
            return None
        return self.ops.gemv_glu(x, w)

    def close(self):
        self.cublas.close()


class GraphDecoder:
    """One GPU decode step captured as a CUDA graph (cupy.cuda.Graph).

        gd = GraphDecoder(model, cache, attention)    # after model.prefill(...)
        logits = gd.replay(tokens)                    # [B, V] f32, a static buffer (overwritten)

    gemv: the weight products through santa_cupy's gemv.cu instead of cuBLAS for batches of up to
    decoder_ops.GEMV_AUTO_TOKENS (None, the default: where it measured faster), up to 4 (True),
    or never (False). programmatic_launch: capture every santa-cupy kernel with programmatic
    dependent launch, so each is scheduled while the one before it finishes (None, the default: on
    where the GPU has it, sm_90+; bit-identical results either way; cuBLAS calls stay plain).
    Static buffers: the token input and the logits output. Positions/lengths (cache.lengths) and,
    through santa_cupy.DecodePlan, the SANTA step counter advance on device inside the graph.
    A paged cache's block table is read by the graph at a fixed address: replay() reserves the
    next token's page on the host first and writes it into the table in place, on the graph's stream.
    Temporaries come from a private memory pool kept alive with the graph, so no other allocation
    can reuse addresses the graph writes to."""

    def __init__(self, model: LlamaModel, cache: KVCache, attention: AttentionConfig = AttentionConfig(),
                 gemv: bool | None = None, programmatic_launch: bool | None = None):
        if model.xp is np:
            raise RuntimeError("GraphDecoder needs a model loaded with device='gpu'")
        if cache.length < 1:
            raise ValueError("GraphDecoder needs a prefilled cache")
        if cache.length >= cache.max_len:
            raise ValueError(f"KV cache is full (max_len {cache.max_len})")
        import cupy
        import santa_cupy
        self.model, self.cache, self.attention = model, cache, attention
        # A blocking (non-default) stream: work on the legacy default stream, e.g. cupy.asnumpy
        # of the logits or the next token upload, waits for the replayed graph implicitly.
        self.stream = cupy.cuda.Stream(non_blocking=False)
        self.pool = cupy.cuda.MemoryPool()
        att = attention
        self.plan = None
        if hasattr(santa_cupy, "DecodePlan"):
            self.plan = model.make_plan(att, cache)   # its own device step counter
            kw = cache.attention_kwargs                # paged: block_table, whose address the graph keeps
            attn = lambda li, q, kc, vc, lens: self.plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)  # noqa: E731
        elif att.method == "dense":
            attn = model._eager_attention(att, cache)
        else:
            raise RuntimeError("GraphDecoder with method='santa' needs santa_cupy.DecodePlan "
                               "(a device step counter); use model.decode() instead")
        self.gemm = _CublasGemm()                  # CuPy refuses its own cuBLAS calls in capture
        from santa_cupy import decoder_ops
        gemv_tokens = {None: decoder_ops.GEMV_AUTO_TOKENS, True: decoder_ops.GEMV_TOKENS[-1], False: 0}[gemv]
        if cache.batch <= gemv_tokens:             # gemv.cu instead of cuBLAS
            self.gemm = _GemvFirst(self.gemm, gemv_tokens)
        model._gemm = self.gemm
        from santa_cupy import kernels
        was_programmatic = kernels.programmatic_launch()
        self.programmatic_launch = kernels.set_programmatic_launch(programmatic_launch is not False)
        try:
            with cupy.cuda.using_allocator(self.pool.malloc), self.stream:
                cache.reserve(cache.length + 1)          # paged: the page the warm-up and first replay write
                self.tokens = cupy.zeros((cache.batch,), cupy.int32)
                # Warm-up (compiles kernels, fills the private pool); writes K/V at the current
                # position, which the first replay overwrites; nothing advances.
                model._decode_core(self.tokens, cache, attn)
                self.stream.synchronize()
                self.stream.begin_capture()
                try:
                    self.logits = model._decode_core(self.tokens, cache, attn)
                    cache.lengths += 1                   # on device, inside the graph
                    if self.plan is not None:
                        self.plan.advance()              # device step counter
                finally:
                    self.graph = self.stream.end_capture()
            self.stream.synchronize()
        finally:
            model._gemm = None
            kernels.set_programmatic_launch(was_programmatic)

    def close(self):
        """Release the graph, its memory pool and the cuBLAS handle (also on garbage collection)."""
        self.gemm.close()
        self.graph = self.pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def replay(self, tokens):
        """tokens [B] (host or device ints) -> logits [B, V] float32 (static device buffer)."""
        import cupy
        c = self.cache
        if c.length >= c.max_len:
            raise ValueError(f"KV cache is full (max_len {c.max_len})")
        with self.stream:
            c.reserve(c.length + 1)             # paged: a new page at a boundary, into the table in place
            if isinstance(tokens, cupy.ndarray):
                self.tokens[...] = tokens.astype(cupy.int32).reshape(-1)
            else:
                self.tokens.set(np.asarray(tokens, dtype=np.int32).reshape(-1))
            self.graph.launch(self.stream)
        c.length += 1
        c.step += 1
        return self.logits

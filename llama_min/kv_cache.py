"""The decoder's KV cache: contiguous (KVCache) or paged (PagedKVCache on a PageAllocator's pool).

One interface for both forms (reserve / write_rows / token_index + write_token / read), so the
decode step and the prefill have one code path. `lengths` [B] int32 (a device array on the GPU) is
what every kernel reads: the new token's row and the attended length.
"""

from __future__ import annotations

import numpy as np


class KVCache:
    """Preallocated KV cache, one type with two storage forms (``new_cache(..., page_size=...)``):

    - contiguous (this class, page_size None): k[l], v[l] are [B, L_max, KVH, D] (santa_cupy layout),
      or with key_block FB (16 | 32) k[l] feature-blocked [B, KVH, NP, D / FB, P, FB]
      (santa_cupy.key_layout: key_layout "blocked", what the dense kernel reads on the GPU), v[l] as before;
    - paged (PagedKVCache): k[l], v[l] are page pools [num_pages, page_size, KVH, D] (NHD, FlashInfer's
      and vLLM's layout) and one block table [B, max_pages] int32 (device array on GPU) maps every
      sequence's rows to pages for all layers; a host-side allocator hands out pages as sequences grow.

    `lengths` [B] int32 (device array on GPU) = tokens stored per sequence; `length` is its host
    mirror (all rows are equal); `step` counts decode steps (the SANTA RNG step).
    The model reads and writes through reserve / write_rows / token_index + write_token / read
    and passes attention_kwargs to santa_cupy, so both forms share one code path; read gives K in
    the standard layout whatever the storage (a blocked K: a copy of its first n rows)."""

    page_size = None                                  # contiguous
    block_table = None

    def __init__(self, xp, n_layers, batch, max_len, kvh, head_dim, storage_dtype, *, key_block=None):
        from santa_cupy.key_layout import blocked_shape
        shape = k_shape = self._storage_shape(batch, max_len, kvh, head_dim)
        self.key_block = None
        if key_block is not None:
            k_shape = blocked_shape(shape, key_block)  # ValueError for an FB not in 16 | 32, a D not its multiple
            self.key_block = k_shape[-1]
        self.xp = xp
        self.k = [xp.zeros(k_shape, storage_dtype) for _ in range(n_layers)]
        self.v = [xp.zeros(shape, storage_dtype) for _ in range(n_layers)]
        self.lengths = xp.zeros((batch,), xp.int32)
        self._row_ids = xp.arange(batch)              # token_index's sequence ids
        self.plans = {}                               # AttentionSetting -> santa_cupy.DecodePlan (GPU)
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
    def key_layout(self) -> str:
        """santa_cupy's name of k[l]'s layout: "blocked" with key_block, else "standard"."""
        return "standard" if self.key_block is None else "blocked"

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
        from santa_cupy.key_layout import write_rows
        end = start + k.shape[1]
        if self.key_block is None:
            self.k[layer][:, start:end] = k
        else:
            write_rows(self.k[layer], start, k)
        self.v[layer][:, start:end] = v

    def token_index(self, pos):
        """Where row pos[b] of every sequence b lives (pos [B] ints), for write_token: computed once
        a decode step, used by every layer."""
        return self._row_ids, pos

    def write_token(self, layer: int, index, k, v):
        """Decode (array path): k, v [B, KVH, D] into the rows of token_index(pos)."""
        if self.key_block is None:
            self.k[layer][index] = k
        else:                                          # row pos[b] of sequence b's page pos[b] // P
            from santa_cupy.key_layout import write_token
            write_token(self.k[layer], *index, k)
        self.v[layer][index] = v

    def read(self, layer: int, n: int):
        """(k, v) [B, >= n, KVH, D] whose first n rows are every sequence's rows 0 .. n - 1 (contiguous:
        the cache arrays themselves, or with a blocked K its first n rows converted (a copy) and
        a view of V's; paged: the sequences' pages gathered)."""
        if self.key_block is not None:
            from santa_cupy.key_layout import from_blocked
            return from_blocked(self.k[layer], n), self.v[layer][:, :n]
        return self.k[layer], self.v[layer]

    def advance(self, on_device: bool = True):
        """After a decode step: lengths += 1 on the device (on_device; GraphDecoder's graph does it
        itself) and the host's count of the steps taken (`length`, `step`: what the host needs
        without reading the device, for reserve() and the capacity checks)."""
        if on_device:
            self.lengths += 1
        self.length += 1
        self.step += 1

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
        super().__init__(xp, n_layers, batch, max_len, kvh, head_dim, storage_dtype)   # K standard: no paged blocked form
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

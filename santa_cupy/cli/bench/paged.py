"""Our contiguous KV cache seen as FlashInfer's paged cache: the page layout and the pages (a view
or a padded copy). Pure Python / array-module agnostic.
"""

from __future__ import annotations

from dataclasses import dataclass


PAGE_ROWS = 16          # FlashInfer's page size here: a realistic one (one page of L rows runs ~30x slower)


@dataclass(frozen=True)
class PagedLayout:
    """Our cache [B, L, KVH, D] as FlashInfer's paged cache ("NHD": [pages, page_rows, KVH, D]).

    Sequence b owns pages b*P .. b*P + P - 1 (P = pages_per_seq = ceil(L / page_rows)); its last page
    holds last_page_len rows. Each sequence takes `capacity` = P * page_rows rows: when that is L the
    pages are a free view of the contiguous cache, else the cache is copied (outside the timing) into
    a padded one whose rows beyond L no page reads."""

    batch: int
    length: int
    page_rows: int = PAGE_ROWS

    @property
    def pages_per_seq(self) -> int:
        return -(-self.length // self.page_rows)

    @property
    def capacity(self) -> int:
        return self.pages_per_seq * self.page_rows

    @property
    def free_view(self) -> bool:
        return self.capacity == self.length

    def indptr(self):
        """kv_indptr [B + 1] (int32): sequence b's pages are indices[indptr[b]:indptr[b + 1]]."""
        import numpy as np
        P = self.pages_per_seq
        return np.arange(0, self.batch * P + 1, P, dtype=np.int32)

    def indices(self):
        """kv_indices [B * P] (int32): the pages in cache order."""
        import numpy as np
        return np.arange(self.batch * self.pages_per_seq, dtype=np.int32)

    def last_page_len(self):
        """kv_last_page_len [B] (int32), each in 1..page_rows."""
        import numpy as np
        return np.full(self.batch, self.length - (self.pages_per_seq - 1) * self.page_rows, dtype=np.int32)


def paged_cache(xp, cache, layout: PagedLayout):
    """cache [B, L, KVH, D] (an xp array) -> its pages [B * P, page_rows, KVH, D]: a view of `cache`
    when layout.free_view, else a copy of it into a zero-padded [B, capacity, KVH, D]."""
    B, L, KVH, D = cache.shape
    if (B, L) != (layout.batch, layout.length):
        raise ValueError(f"cache of {B} x {L} rows does not match the layout's {layout.batch} x {layout.length}")
    if not layout.free_view:
        padded = xp.zeros((B, layout.capacity, KVH, D), dtype=cache.dtype)
        padded[:, :L] = cache
        cache = padded
    return cache.reshape(B * layout.pages_per_seq, layout.page_rows, KVH, D)


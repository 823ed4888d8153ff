"""santa-cupy on a paged KV cache (vLLM's / FlashInfer's "NHD" layout), pages allocated as sequences grow.

    python examples/paged_example.py

A pool k_pages, v_pages [num_pages, PAGE, KVH, D] (bf16 as uint16 bits) shared by the batch, a
block table [B, max_pages] int32 of page ids, pages handed out from a free list in shuffled order
as each sequence grows. Checks that SANTA and dense on the pages equal the same calls on the
contiguous cache the pages hold, and that a bad table is refused with a message naming it.
"""

import cupy as cp
import numpy as np

import santa_cupy

B, H, KVH, D, PAGE, MAX_PAGES = 3, 32, 8, 128, 16, 256       # up to 4096 tokens a sequence


def bf16(x):
    bits = x.astype(cp.float32).view(cp.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(cp.uint16)


class PagePool:
    """A free list of page ids and a block table that grows with each sequence."""

    def __init__(self, num_pages, rng):
        self.free = list(rng.permutation(num_pages))
        self.table = np.full((B, MAX_PAGES), -1, np.int32)
        self.used = [0] * B

    def grow(self, b, length):
        """Give sequence b enough pages for `length` tokens; the new page ids."""
        need = -(-length // PAGE)
        new = []
        while self.used[b] < need:
            self.table[b, self.used[b]] = page = self.free.pop()
            self.used[b] += 1
            new.append(page)
        return new


def main():
    rng = np.random.default_rng(0)
    pool = PagePool(num_pages=B * MAX_PAGES, rng=rng)
    k_pages = cp.zeros((B * MAX_PAGES, PAGE, KVH, D), cp.uint16)
    v_pages = cp.zeros_like(k_pages)
    lengths = np.array([3000, 517, 40], np.int32)
    crng = cp.random.default_rng(1)
    for b, n in enumerate(lengths):              # "prefill": write each sequence's tokens into its pages
        pool.grow(b, int(n))
        rows = np.arange(n)
        pages, slots = pool.table[b, rows // PAGE], rows % PAGE
        k_pages[pages, slots] = bf16(crng.standard_normal((int(n), KVH, D), dtype=cp.float32))
        v_pages[pages, slots] = bf16(crng.standard_normal((int(n), KVH, D), dtype=cp.float32))
    q = bf16(crng.standard_normal((B, H, D), dtype=cp.float32) * 2.0)
    table, lens = cp.asarray(pool.table), cp.asarray(lengths)

    plan = santa_cupy.DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=MAX_PAGES * PAGE,
                                 dtype="bfloat16", samples=256, seed=3, santa_min_length=0, page_size=PAGE)
    o = plan.run(q, k_pages, v_pages, lens, block_table=table).copy()
    dense = santa_cupy.decode_attention(q, k_pages, v_pages, lens, method="dense", block_table=table)

    # the same calls on the contiguous cache the pages hold
    rows = np.arange(MAX_PAGES * PAGE)
    k = k_pages[cp.asarray(pool.table[:, rows // PAGE].clip(0)), cp.asarray(rows % PAGE)]
    v = v_pages[cp.asarray(pool.table[:, rows // PAGE].clip(0)), cp.asarray(rows % PAGE)]
    ref = santa_cupy.DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=MAX_PAGES * PAGE,
                                dtype="bfloat16", samples=256, seed=3, santa_min_length=0)
    assert cp.array_equal(o, ref.run(q, k, v, lens)), "santa on pages != santa on the contiguous cache"
    assert cp.array_equal(dense, santa_cupy.decode_attention(q, k, v, lens, method="dense"))
    print(f"pages of {PAGE} rows, {sum(pool.used)} of {B * MAX_PAGES} in use; santa and dense equal the "
          f"contiguous calls bit for bit; rows read {plan.info().rows_read.get().tolist()}")

    bad = pool.table.copy()
    bad[1, 2] = 10**6
    try:
        plan.run(q, k_pages, v_pages, lens, block_table=cp.asarray(bad))
    except ValueError as exc:
        print(f"bad table refused: {exc}")
    else:
        raise AssertionError("a bad block table was accepted")
    print("ok")


if __name__ == "__main__":
    main()

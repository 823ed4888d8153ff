"""A small workload for `compute-sanitizer --tool racecheck` (shared-memory hazards): one call of each
production kernel route (dense mma self-merging, santa's warp pipeline finishing in the kernel and
through santa_merge with each gather, the dense fallback, the block pass 2; on a feature-blocked K
the dense kernel and block key sampling's santa_key_blocks + santa_score_keys)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402

from santa_cupy import DecodePlan, key_layout, spec  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402

rng = np.random.default_rng(1)
B, H, KVH, D, L = 3, 8, 2, 128, 700
lengths = cupy.asarray(np.array([700, 1, 300], np.int32))
q, k, v = (cupy.asarray(spec.from_float32(rng.standard_normal(s).astype(np.float32), "bfloat16", np))
           for s in ((B, H, D), (B, L, KVH, D), (B, L, KVH, D)))
kw = dict(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=64)
DecodePlan(method="dense", **kw).run(q, k, v, lengths)
for budget in ("global", "fixed"):
    for tile in ("warp", "warp_mma"):
        for finish in (True, False):     # B * KVH = 6 groups: finishing in the kernel unless the cap is 0
            choice = KernelChoice(tile_kernel=tile, finish_max_groups=B * KVH if finish else 0)
            plan = DecodePlan(budget=budget, santa_min_length=0, _kernels=choice, **kw)
            assert plan.atomic_finish == finish
            plan.run(q, k, v, lengths)
DecodePlan(santa_min_length=200, **kw).run(q, k, v, lengths)
DecodePlan(sampler="iid", **kw).run(q, k, v, lengths)
for FB in (16, 32):
    kb = key_layout.to_blocked(k, FB)
    DecodePlan(method="dense", key_block=FB, key_layout="blocked", **kw).run(q, kb, v, lengths)
    for score_kernel in ("stream", "mma"):
        DecodePlan(santa_min_length=0, key_layout="blocked", key_sampling="bernoulli_block", key_block=FB,
                   key_budget=0.5, key_rule="qrms", key_draws=2, _kernels=KernelChoice(score_kernel=score_kernel),
                   **kw).run(q, kb, v, lengths)
cupy.cuda.Device().synchronize()
print("racecheck case done")

"""throwaway: memcheck/racecheck on the rolled score steps (BN 128, D 128: SPAN 1 paged, key pass)."""
import sys
from pathlib import Path
import numpy as np
sys.path.insert(0, str(Path(__file__).resolve().parent))
import cupy
from santa_cupy import DecodePlan, decode_attention, spec, key_layout
rng = np.random.default_rng(1)
B, H, KVH, D, L = 3, 32, 8, 128, 700
lens = np.array([1, 333, 700], np.int32)
f = lambda s: cupy.asarray(spec.from_float32(rng.standard_normal(s).astype(np.float32), "bfloat16", np))
q, k, v = f((B, H, D)), f((B, L, KVH, D)), f((B, L, KVH, D))
lengths = cupy.asarray(lens)
P = 16
pages = -(-L // P)
perm = rng.permutation(B * pages).astype(np.int32)
table = cupy.asarray(perm.reshape(B, pages))
kp = cupy.zeros((B * pages, P, KVH, D), k.dtype); vp = cupy.zeros_like(kp)
kf = cupy.zeros((B, pages * P, KVH, D), k.dtype); kf[:, :L] = k
vf = cupy.zeros_like(kf); vf[:, :L] = v
kp[table.ravel()] = kf.reshape(B * pages, P, KVH, D); vp[table.ravel()] = vf.reshape(B * pages, P, KVH, D)
for budget in ("global", "fixed"):
    decode_attention(q, kp, vp, lengths, block_table=table, samples=64, budget=budget, block_n=128, santa_min_length=0)
for FB in (16, 32):
    kb = key_layout.to_blocked(k, FB)
    for kb_budget in (1.0, 0.6, 0.25):
        decode_attention(q, kb, v, lengths, samples=64, block_n=128, key_layout="blocked",
                         key_sampling="bernoulli_block", key_block=FB, key_budget=kb_budget, key_rule="qrms")
cupy.cuda.Device().synchronize()
print("sanitize case done")

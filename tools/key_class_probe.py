"""santa_score_keys_mma alone on fixed read patterns (GPU): which groups read what, not how many.

    python tools/key_class_probe.py [FB]        (FB 16 | 32, default 32)

B=16, 32k, llama8b, bf16, K in the blocked layout. Each line writes fixed key weights into a
KeyScorePass's key_weight (every (sequence, KV head) reading its first N 32-feature groups) and
times the score kernel alone (CUDA events): every group reading the same count (the pass's time
against its bytes, one run of the kernel for all), then a mix of counts as the uniform rule's
draws give at a quarter of K, interleaved and sorted heaviest or lightest first in launch order,
then the real draws. The score kernel's launch order (KeyScorePass.group_order) is the identity
until the last line's santa_key_blocks sorts it heaviest first (290ed05), so the sorted lines lay
the classes out by id instead. Its output at 5105f8e: docs/results/h200_5105f8e/key_class_fb32.txt
(H200) and docs/results/h100_247459e/ (H100); before 290ed05: docs/results/h200_d59c4a3/.
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import numpy as np
import cupy
from santa_cupy import AttentionSetting, key_layout
from santa_cupy.key_pass import KeyScorePass
from santa_cupy.cli.bench.timing import event_median_us

B, H, KVH, D, L, FB = 16, 32, 8, 128, 32768, int(sys.argv[1]) if len(sys.argv) > 1 else 32
C = D // FB
rs = cupy.random.default_rng(0)
bf = lambda x: (x.view(cupy.uint32) >> 16).astype(cupy.uint16)
q = bf(rs.standard_normal((B, H, D), dtype=cupy.float32))
k = bf(rs.standard_normal((B, L, KVH, D), dtype=cupy.float32))
kb = key_layout.to_blocked(k, FB)
del k
lengths = cupy.full((B,), L, cupy.int32)
step = cupy.zeros((1,), cupy.int64)
T = L // 128
scores = cupy.empty((B, H, L), cupy.float32)
part_s = cupy.empty((B, H, T, 4), cupy.float32)
setting = AttentionSetting(block_n=128, key_sampling="bernoulli_block", key_block=FB, key_budget=0.25, key_rule="uniform")
kp = KeyScorePass(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16", block_n=128,
                  setting=setting, scale=1 / np.sqrt(D), score_kernel="mma")
t = lambda: event_median_us(cupy, lambda: kp.launch_scores(q, kb, lengths, scores, part_s),
                            cupy.cuda.get_current_stream(), repeats=5, warmup=3, inner=10)
def groups_mask(ngroups):      # read the first ngroups 32-feature groups
    w = np.zeros(C, np.float32)
    per = 32 // FB
    w[:ngroups * per] = 1.0
    return w
def run(name, classes):        # classes [B, KVH] -> number of 32-feature groups read
    w = np.stack([groups_mask(int(c)) for c in np.asarray(classes).ravel()]).reshape(B, KVH, C)
    kp.key_weight[...] = cupy.asarray(w)
    us = t()
    frac = float((w != 0).mean())
    print(f"{name:52s} {us:8.1f} us  K read {frac:.3f}", flush=True)
    return us
full = run("all 4 groups (generic)", np.full((B, KVH), 4))
for ng in (3, 2, 1, 0):       # 0: no K read, the stash's zeros alone (stash_zero_scores)
    us = run(f"all {ng} groups", np.full((B, KVH), ng))
    f = ng / 4
    print(f"   saving share {(full - us) / (full * (1 - f)):.2f}")
rng = np.random.default_rng(1)
mix = rng.binomial(4, 0.25, size=(B, KVH))       # as uniform 0.25 at FB 32
print("mix histogram", np.bincount(mix.ravel(), minlength=5))
run("binomial(4, 1/4) classes, interleaved", mix)
srt = np.sort(mix.ravel())[::-1].reshape(B, KVH)  # heavy first in launch order (b-major)
run("same classes, heavy first (launch order)", srt)
run("same classes, light first (launch order)", np.sort(mix.ravel()).reshape(B, KVH))
run("half 1 / half 2 groups interleaved", (np.arange(B * KVH).reshape(B, KVH) % 2) + 1)
run("half 1 / half 2 groups sorted", (np.arange(B * KVH).reshape(B, KVH) >= B * KVH // 2) + 1)
run("half 1 / half 0 interleaved", (np.arange(B * KVH).reshape(B, KVH) % 2))
# the real draw at 0.25
kp.launch_blocks(q, step, 0)
us = t()
print(f"{'uniform rule draws at 0.25 (as key_bench)':52s} {us:8.1f} us  K read {float((kp.key_weight != 0).mean()):.3f}")
print("tiles_per_warp", kp.tiles_per_block, "grid_x", kp._grid_x)

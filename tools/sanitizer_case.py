"""A small decode-attention workload for `compute-sanitizer --tool memcheck` (every method/budget)."""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import cupy  # noqa: E402

from santa_cupy import DecodePlan, decode_attention, spec  # noqa: E402
from santa_cupy.kernel_choice import KernelChoice  # noqa: E402

rng = np.random.default_rng(0)
B, H, KVH, D, L = 3, 8, 2, 64, 200
lengths = np.array([1, 63, 200], np.int32)
q = spec.from_float32(rng.standard_normal((B, H, D)).astype(np.float32), "bfloat16", np)
k = spec.from_float32(rng.standard_normal((B, L, KVH, D)).astype(np.float32), "bfloat16", np)
v = spec.from_float32(rng.standard_normal((B, L, KVH, D)).astype(np.float32), "bfloat16", np)
q, k, v, lengths = (cupy.asarray(a) for a in (q, k, v, lengths))
decode_attention(q, k, v, lengths, method="dense")
for kind in ("stream", "mma"):
    DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, method="dense",
               _kernels=KernelChoice(dense_kernel=kind)).run(q, k, v, lengths)
for budget in spec.BUDGETS:
    for sampler in spec.SAMPLERS:
        plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40,
                          sampler=sampler, budget=budget, block_n=64, santa_min_length=0)
        plan.run(q, k, v, lengths)
        plan.run_from_counts(q, k, v, lengths, plan.sample_counts(q, k, lengths))
        for runs in (2, 3):                   # one warp per run of tiles (score pass, warp pass 2)
            # auto (the pipelined gather here, or the block pass 2), the pipelined and the
            # tensor-core gathers, finishing in the kernel and through santa_merge
            sys_only = (lambda kind: kind if sampler == "systematic" else "auto")
            for tile in ("auto", sys_only("warp"), sys_only("warp_mma")):
                for finish in (True, False):      # finish_max_groups 0: the runs' partials and santa_merge
                    choice = KernelChoice(tiles_per_warp=runs, tile_kernel=tile,
                                          **({} if finish else {"finish_max_groups": 0}))
                    p = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40,
                                   sampler=sampler, budget=budget, block_n=64, santa_min_length=0, _kernels=choice)
                    p.run(q, k, v, lengths)
        DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, sampler=sampler,
                   budget=budget, block_n=64, _kernels=KernelChoice(score_kernel="stream")).run(q, k, v, lengths)
        DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, sampler=sampler,
                   budget=budget, block_n=64, _kernels=KernelChoice(tile_kernel="block")).run(q, k, v, lengths)
# the one-pass budget: its first call (NaN hint: every row), a hint, runs of 1 and 3 tiles
for runs in (1, 3):
    p = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, budget="one_pass",
                   block_n=64, _kernels=KernelChoice(tiles_per_warp=runs))
    p.run(q, k, v, lengths)
    p.run(q, k, v, lengths)
# paged caches (shuffled pages, page sizes on and off the 16-key step path, both layouts) and a
# santa plan with a dense fallback (the balanced dense split over the short sequences only)
for page_size, layout in ((16, "NHD"), (24, "HND"), (1, "NHD")):
    need = -(-lengths.get() // page_size)
    ids = rng.permutation(int(need.sum()) + 2).astype(np.int32)
    table = np.full((B, int(need.max()) + 1), -1, np.int32)
    at = 0
    for b_, n_ in enumerate(need):
        table[b_, :n_] = ids[at:at + n_]
        at += n_
    shape = (len(ids), page_size, KVH, D) if layout == "NHD" else (len(ids), KVH, page_size, D)
    kp = cupy.asarray(spec.from_float32(rng.standard_normal(shape).astype(np.float32), "bfloat16", np))
    vp = cupy.asarray(spec.from_float32(rng.standard_normal(shape).astype(np.float32), "bfloat16", np))
    gt = cupy.asarray(table)
    for kw in (dict(method="dense"), dict(samples=40, santa_min_length=0, block_n=64),
               dict(samples=40, budget="fixed", santa_min_length=0, block_n=64),
               dict(samples=40, sampler="iid", santa_min_length=0, block_n=64)):
        decode_attention(q, kp, vp, lengths, block_table=gt, page_layout=layout, **kw)
    decode_attention(q, kp, vp, lengths, block_table=gt, page_layout=layout, samples=40, budget="one_pass",
                     block_n=64, lse_hint=cupy.zeros((B, H), cupy.float32))
DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, block_n=64,
           santa_min_length=100).run(q, k, v, lengths)
# block key sampling on the blocked K (santa_key_blocks + santa_score_keys): FB 16 / 32, both
# combines, every budget, runs of 1 and several tiles a block (decode_attention's plan and key_scores)
from santa_cupy import key_layout, key_scores  # noqa: E402
for FB, combine in ((16, "mean"), (32, "union")):
    kb = key_layout.to_blocked(k, FB)
    for budget in spec.BUDGETS:
        decode_attention(q, kb, v, lengths, samples=40, budget=budget, block_n=64, key_layout="blocked",
                         key_sampling="bernoulli_block", key_block=FB, key_budget=0.5, key_rule="qrms",
                         key_draws=2, key_combine=combine)
    key_scores(q, kb, lengths, key_sampling="bernoulli_block", key_block=FB, key_budget=0.3, key_rule="qmax",
               key_layout="blocked")
    for score_kernel, runs in (("stream", 2), ("mma", 3)):   # the FMA pass; the tensor-core one in long runs
        DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, block_n=64,
                   key_layout="blocked", key_sampling="bernoulli_block", key_block=FB, key_budget=0.5,
                   key_rule="qrms", _kernels=KernelChoice(score_kernel=score_kernel, tiles_per_warp=runs)
                   ).run(q, kb, v, lengths)
# the decoder's kernels: gemv (3 tokens, K not a multiple of the warp stride) and decoder.cu
from llama_min import ops as decoder_ops  # noqa: E402
x16 = cupy.asarray(rng.standard_normal((3, 264)).astype(np.float16))
w16 = cupy.asarray(rng.standard_normal((37, 264)).astype(np.float16))
y = decoder_ops.gemv(x16, w16)
decoder_ops.gemv(x16, w16, out=y, accumulate=True)
xr = cupy.asarray(rng.standard_normal((B, 257)).astype(np.float32))
decoder_ops.rms_norm(xr, cupy.ones(257, cupy.float32), 1e-6, cupy.float16)
decoder_ops.silu_mul(cupy.asarray(rng.standard_normal((B, 2 * 99)).astype(np.float16)), cupy.float16)
table = cupy.asarray(rng.standard_normal((L, D // 2)).astype(np.float32))
qkv = cupy.asarray(rng.standard_normal((B, (H + 2 * KVH) * D)).astype(np.float32))
decoder_ops.rope_append(qkv, table, table, cupy.asarray(np.array([0, L - 1, 5], np.int32)), k, v, H, KVH, "bfloat16")
wqkv = cupy.asarray(rng.standard_normal(((H + 2 * KVH) * D, 264)).astype(np.float16))
decoder_ops.gemv_rope(x16, wqkv, table, table, cupy.asarray(np.array([L - 1, 0, 7], np.int32)), k, v, H, KVH,
                      "bfloat16")
decoder_ops.gemv_glu(x16, cupy.asarray(rng.standard_normal((2 * 99, 264)).astype(np.float16)))
# the token sampler (sample_tokens.cu): every mode, ties split at the top-k / top-p cutoffs (rounded logits)
from llama_min.sampling import SamplingConfig, TokenSampler  # noqa: E402
for cfg in (SamplingConfig(greedy=True, repetition_penalty=1.2),
            SamplingConfig(greedy=False, top_k=40, top_p=0.9, seed=1, repetition_penalty=1.3)):
    TokenSampler(cupy, cfg, B, 1003, context=[[1, 2]] * B)(
        cupy.asarray(np.round(rng.standard_normal((B, 1003)) * 2).astype(np.float32)))
# everything again with programmatic dependent launch (sm_90+: kernels start before their predecessor ends):
# the plans' own choice, then the process-wide switch (decode_attention's plans and the decoder's kernels)
from santa_cupy import kernels  # noqa: E402
for budget in spec.BUDGETS:
    DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, samples=40, budget=budget,
               block_n=64, _kernels=KernelChoice(programmatic=True)).run(q, k, v, lengths)
if kernels.set_programmatic_launch(True):
    decode_attention(q, k, v, lengths, method="dense")
    decoder_ops.gemv(x16, w16, out=y, accumulate=True)
    decoder_ops.rope_append(qkv, table, table, cupy.asarray(np.array([3, 0, L - 1], np.int32)), k, v, H, KVH,
                            "bfloat16")
    decoder_ops.gemv_rope(x16, wqkv, table, table, cupy.asarray(np.array([0, L - 1, 2], np.int32)), k, v, H, KVH,
                          "bfloat16")
    kernels.set_programmatic_launch(False)
cupy.cuda.Device().synchronize()
print("sanitizer case done")

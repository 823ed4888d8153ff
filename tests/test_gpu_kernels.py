"""GPU kernels against the NumPy reference (marker gpu; skipped without CuPy and a GPU).

Awkward sizes: lengths 1, BN-1, BN+1, odd, and one 100k sequence; every G in {1, 3, 4, 8};
D 64/128/256; fp16/bf16 (fp32 too). Outputs are poisoned with NaN before each call. Dense outputs
are checked per (b, h) and element against the float64 reference rounded to the storage dtype
(gpu_util.dense_error_bound), on inputs with a planted spike at row length - 1.
"""

import itertools

import numpy as np
import pytest

import santa_cupy
from santa_cupy import kernel_choice, kernels, reference, spec
from tests.gpu_util import (DENSE_TOL, as_float32, assert_dense_matches, dense_error_bound, make_plan, random_inputs,
                            rel_l2, requires_gpu, stable_seed, to_gpu)

pytestmark = [pytest.mark.gpu, requires_gpu]


# These tests study the kernels at every length: santa for every sequence (no dense fallback).
def DecodePlan(**kw):  # noqa: N802
    """santa at every length unless told; kernel-choice keywords as the plan's _kernels override."""
    return make_plan(**{"santa_min_length": 0, **kw})


def decode_attention(*args, **kw):
    return santa_cupy.decode_attention(*args, **{"santa_min_length": 0, **kw})

GROUPS = (1, 3, 4, 8)
DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")


def _lengths(block_n):
    return [1, block_n - 1, block_n + 1, 3 * block_n + 17]


def _poisoned_plan(**kw):
    import cupy
    plan = DecodePlan(**kw)
    plan.out.view(cupy.uint8).fill(0xFF)                    # all-ones bits: NaN in every dtype
    plan.lse.fill(cupy.nan)
    plan.spread.fill(cupy.nan)
    return plan




@pytest.mark.parametrize("kernel", ["stream", "mma"])
@pytest.mark.parametrize("dtype,D,G", list(itertools.product(DTYPES, DIMS, GROUPS)))
def test_dense_matches_reference(dtype, D, G, kernel):
    from santa_cupy import kernels
    if kernel == "mma" and not kernels.mma_supported(dtype, D):
        pytest.skip("no tensor-core instance for this dtype / head_dim")
    rng = np.random.default_rng(stable_seed(dtype, D, G))
    KVH = 2
    block_n = 64
    lengths = _lengths(block_n)
    B, L_max = len(lengths), max(lengths) + 5
    q, k, v, lens = random_inputs(rng, B, G * KVH, KVH, D, L_max, lengths, dtype, spike=True)
    ref = dense_error_bound(q, k, v, lens, dtype)
    plan = _poisoned_plan(batch=B, heads=G * KVH, kv_heads=KVH, head_dim=D, max_length=L_max, dtype=dtype,
                          method="dense", block_n=block_n, dense_kernel=kernel)
    assert_dense_matches(plan.run(*to_gpu(q, k, v, lens)), ref)
    assert np.allclose(plan.lse.get(), ref.lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("G", [12, 16])
def test_dense_mma_two_row_halves(G):
    """G > 8 fills rows 8..15 of the tensor-core tile: every head must still match."""
    rng = np.random.default_rng(G)
    lengths = [1, 15, 17, 300]
    q, k, v, lens = random_inputs(rng, 4, 2 * G, 2, 128, 305, lengths, "float16", spike=True)
    ref = dense_error_bound(q, k, v, lens, "float16")
    plan = _poisoned_plan(batch=4, heads=2 * G, kv_heads=2, head_dim=128, max_length=305, dtype="float16",
                          method="dense", dense_kernel="mma")
    assert_dense_matches(plan.run(*to_gpu(q, k, v, lens)), ref)
    assert np.allclose(plan.lse.get(), ref.lse, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("L_max,splits", [(2000, None), (8000, 31)])
def test_dense_merges_in_its_last_block(L_max, splits):
    """v4 dense merges in the last block of each KV group to finish (one launch, where a group has
    <= 32 splits; a few, and 30 whose partials all load at once): right for lengths that leave most
    splits empty or fill them all, its counters back at zero after every call, and the same from a
    captured graph replayed over new lengths. (Above 32 splits santa_merge runs after it:
    test_dense_long_context_100k; the kernel's own merge of more: the next test.)"""
    import cupy
    rng = np.random.default_rng(5)
    plan = _poisoned_plan(batch=3, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16",
                          method="dense", dense_splits=splits)
    assert plan.dense_merges_itself and 2 < plan.P_max <= kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS
    assert splits is None or plan.P_max > 16
    q, k, v, _ = random_inputs(rng, 3, 8, 2, 128, L_max, [L_max] * 3, "bfloat16", spike=True)
    qg, kg, vg = to_gpu(q, k, v)
    lengths = cupy.zeros((3,), cupy.int32)

    def check(lens):                                 # the spike: row L_max - 1, in full sequences
        ref = dense_error_bound(q, k, v, np.asarray(lens, np.int32), "bfloat16")
        assert_dense_matches(plan.out, ref, what=str(lens), spike=[n == L_max for n in lens])
        assert np.allclose(plan.lse.get(), ref.lse, atol=1e-3, rtol=1e-4)
        assert not plan.merge_counters.get().any(), "merge counters not reset"

    for lens in ([1, L_max, 257], [L_max, 2, L_max - 1]):
        lengths[...] = cupy.asarray(lens, cupy.int32)
        plan.run(qg, kg, vg, lengths, validate=False)
        check(lens)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.run(qg, kg, vg, lengths, validate=False)
        graph = stream.end_capture()
    for lens in ([300, 3000, 1], [L_max, L_max, L_max]):
        lengths.set(np.asarray(lens, np.int32), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        check(lens)


@pytest.mark.parametrize("D,heads", [(128, 8), (64, 6)])
def test_dense_self_merge_over_several_rounds(D, heads):
    """With the cap raised (as tools/dense_probe.py does), the kernel merges more than 32 splits a
    group itself, the whole block per head (merge.cuh block_merge_dense_head): 250 splits in two
    rounds of 32 a warp, folding the rounds. Still the reference; counters reset."""
    rng = np.random.default_rng(D)
    L_max, lengths = 20000, [20000, 5000, 1]
    q, k, v, lens = random_inputs(rng, 3, heads, 2, D, L_max, lengths, "bfloat16", spike=True)
    plan = _poisoned_plan(batch=3, heads=heads, kv_heads=2, head_dim=D, max_length=L_max, dtype="bfloat16",
                          method="dense", dense_splits=300, self_merge_max_splits=1 << 30)
    assert plan.dense_merges_itself and plan.P_max > 4 * 32
    ref = dense_error_bound(q, k, v, lens, "bfloat16")
    assert_dense_matches(plan.run(*to_gpu(q, k, v, lens)), ref)
    assert np.allclose(plan.lse.get(), ref.lse, atol=1e-3, rtol=1e-4)
    assert not plan.merge_counters.get().any(), "merge counters not reset"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_dense_long_context_100k(dtype):
    rng = np.random.default_rng(7)
    lengths = [100_000, 99_999 - 64]
    q, k, v, lens = random_inputs(rng, 2, 32, 8, 128, 100_003, lengths, dtype, spike=True)
    ref = dense_error_bound(q, k, v, lens, dtype)
    args = to_gpu(q, k, v, lens)
    assert_dense_matches(decode_attention(*args, method="dense"), ref, what="auto")
    # more splits than the self-merge takes: v4 + santa_merge
    plan = DecodePlan(batch=2, heads=32, kv_heads=8, head_dim=128, max_length=100_003, dtype=dtype,
                      method="dense", dense_splits=48)
    assert not plan.dense_merges_itself and plan.P_max > kernel_choice.DENSE_SELF_MERGE_MAX_SPLITS
    assert_dense_matches(plan.run(*args), ref, what="48 splits + santa_merge")
    plan = DecodePlan(batch=2, heads=32, kv_heads=8, head_dim=128, max_length=100_003, dtype=dtype,
                      method="dense", dense_kernel="stream")
    assert_dense_matches(plan.run(*args), ref, what="stream")


SAMPLING = list(itertools.product(spec.BUDGETS, spec.SAMPLERS))


def _count_mismatch(gpu, ref):
    """Total |difference| of counts: comb points that moved to another row (boundary flips) x 2."""
    return int(np.abs(gpu.astype(np.int64) - ref).sum())


@pytest.mark.parametrize("budget,sampler", SAMPLING)
@pytest.mark.parametrize("G,D,dtype", [(1, 64, "bfloat16"), (3, 128, "float16"), (4, 128, "bfloat16"),
                                       (8, 256, "float32")])
def test_santa_counts_and_output_match_reference(budget, sampler, G, D, dtype):
    rng = np.random.default_rng(stable_seed(budget, sampler, G, D))
    KVH, block_n, S = 2, 64, 96
    lengths = _lengths(block_n)
    B, L_max = len(lengths), max(lengths) + 3
    H = G * KVH
    q, k, v, lens = random_inputs(rng, B, H, KVH, D, L_max, lengths, dtype, peak=2.0)
    kw = dict(samples=S, sampler=sampler, budget=budget, seed=1234, step=5, layer=3, block_n=block_n)
    ref_counts = reference.sample_counts(q, k, lens, **{k_: v_ for k_, v_ in kw.items()})
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    o, info = decode_attention(qg, kg, vg, lg, method="santa", return_info=True, return_counts=True, **kw)
    counts = info.counts.get()
    total = int(ref_counts.sum())
    flips = _count_mismatch(counts, ref_counts)
    print(f"{budget}/{sampler} G={G} D={D}: {flips} count differences out of {total} samples")
    assert flips <= max(2, total // 500), f"{flips} count differences (comb-boundary flips) of {total}"
    if budget != "fixed":                                      # exactly S samples per head
        assert (counts.sum(-1) == S).all()
    # the output is the reference estimator applied to the GPU's own counts
    scores = reference.head_scores(q, k, lens)
    v64 = reference.to_float64(v)
    o = as_float32(o)
    for b, n in enumerate(lengths):
        cg = counts[b, :, :n].reshape(KVH, G, n)
        want, want_spread = reference.estimate(cg, scores[b, :, :n].reshape(KVH, G, n),
                                               v64[b, :n].transpose(1, 0, 2)[:, None],
                                               samples=S, budget=budget, block_n=block_n)
        assert rel_l2(o[b], want.reshape(H, D)) < DENSE_TOL[dtype] + 1e-4
        assert np.allclose(info.spread.get()[b], want_spread.reshape(H), rtol=2e-2, atol=1e-4)
        assert (info.rows_read.get()[b] == (cg > 0).any(axis=1).sum(-1)).all()


@pytest.mark.parametrize("budget,sampler,dtype,tile_kernel,tpw", [
    ("global", "systematic", "float32", "auto", None), ("global", "stratified", "float32", "auto", None),
    ("global", "iid", "float32", "auto", None), ("fixed", "systematic", "float32", "auto", None),
    ("fixed", "iid", "float32", "auto", None),
    ("global", "systematic", "float16", "auto", 2),            # v4: tensor-core scores, warp pass 2, runs
    ("global", "systematic", "float16", "warp", 1),
    ("fixed", "systematic", "float16", "warp", 1), ("fixed", "systematic", "float16", "warp", 2),   # two-pass
    ("fixed", "systematic", "float16", "warp_mma", 2), ("global", "systematic", "float16", "warp_mma", 1),
    ("fixed", "systematic", "float32", "block", None),                                              # one fused pass
    ("fixed", "systematic", "bfloat16", "warp_mma", 1), ("global", "systematic", "bfloat16", "warp_mma", 2)])
def test_santa_unbiased_over_steps_on_gpu(budget, sampler, dtype, tile_kernel, tpw):
    """Mean over 600 device steps within 4 standard errors of exact attention, per coordinate."""
    import cupy
    rng = np.random.default_rng(11)
    lengths = [300]
    q, k, v, lens = random_inputs(rng, 1, 4, 1, 64, 300, lengths, dtype, peak=1.5)
    exact, _ = reference.dense_attention(q, k, v, lens)
    plan = DecodePlan(batch=1, heads=4, kv_heads=1, head_dim=64, max_length=300, dtype=dtype, samples=16,
                      sampler=sampler, budget=budget, seed=99, block_n=64, tile_kernel=tile_kernel,
                      tiles_per_warp=tpw)
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    runs = []
    for _ in range(600):
        runs.append(plan.run(qg, kg, vg, lg, validate=False).copy())
        plan.advance()
    est = as_float32(cupy.stack(runs)).astype(np.float64)     # [600, 1, 4, 64] (bf16: from its bits)
    mean, se = est.mean(0), est.std(0, ddof=1) / np.sqrt(len(runs))
    z = np.abs(mean - exact) / np.maximum(se, 1e-12)
    assert np.mean(z < 4) > 0.995, f"max z {z.max():.1f}"
    assert len({r.get().tobytes() for r in runs[:10]}) > 1, "steps drew identical samples"


@pytest.mark.parametrize("score_kernel", ["mma", "stream"])
def test_comb_unbiased_at_max_samples_on_gpu(score_kernel):
    """The in-tile systematic comb at spec.MAX_SAMPLES on the GPU (issue 15: float32 arithmetic
    quantises comb points at large S; tests/test_comb_precision.py is the reference's): a heavy
    row of ~half the mass in tile 0, the rest spread over 200 rows (2 tiles, the second partial).
    Over 400 steps each row's mean count is within 4.5 standard errors of S p (p: the softmax of
    the kernel's own stash, in float64; a row's count is floor(S p) or ceil(S p)), and every step
    draws exactly S."""
    import cupy
    S, L, steps = spec.MAX_SAMPLES, 200, 400
    gen = np.random.default_rng(5)
    q = np.zeros((1, 1, 64), np.float32)
    q[0, 0, 0] = 8.0                                  # scale 1/8: scores = k[:, 0]
    k = np.zeros((1, L, 1, 64), np.float32)
    k[0, :, 0, 0] = gen.normal(0, 1.0, L)
    k[0, 45, 0, 0] = 6.0
    v = gen.standard_normal((1, L, 1, 64)).astype(np.float32)
    qg, kg, vg, lg = to_gpu(q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), np.array([L], np.int32))
    plan = DecodePlan(batch=1, heads=1, kv_heads=1, head_dim=64, max_length=L, dtype="float16", samples=S,
                      seed=7, block_n=128, score_kernel=score_kernel)
    counts = []
    for _ in range(steps):
        counts.append(plan.sample_counts(qg, kg, lg)[0, 0])
        plan.advance()
    counts = cupy.stack(counts).get().astype(np.float64)         # [steps, L]
    assert (counts.sum(-1) == S).all()
    s = plan.scores.get()[0, 0].astype(np.float64)
    p = np.exp(s - s.max())
    p /= p.sum()
    assert 0.3 < p.max() < 0.7
    frac = S * p - np.floor(S * p)
    se = np.sqrt(np.maximum(frac * (1 - frac), 1.0 / steps) / steps)
    z = np.abs(counts.mean(0) - S * p) / se
    assert z.max() < 4.5, f"row {z.argmax()}: z {z.max():.1f}"


def _skip_without_mma_gather(warp_kernel, dtype, D):
    if warp_kernel.startswith("warp") and not kernels.mma_supported(dtype, D):
        pytest.skip("the warp pass 2 follows the tensor-core score pass: fp16/bf16 at head_dim 64/128 only")


def _block_vs_warp(budget, G, D, dtype, block_n, warp_kernel, tpw, seed, samples=96):
    """The fused run of the block pass 2 and of a warp pass 2 on the same inputs (4 sequences of
    lengths 1, BN-1, BN+1, 9 BN + 7; 2 KV heads; 96 samples unless told; poisoned workspaces). Returns
    (lengths, L_max, args, {kernel: (plan, o, rows_read, spread, lse)})."""
    rng = np.random.default_rng(seed)
    lengths = [1, block_n - 1, block_n + 1, 9 * block_n + 7]
    L_max = max(lengths) + 3
    q, k, v, lens = random_inputs(rng, 4, 2 * G, 2, D, L_max, lengths, dtype, peak=2.0)
    args = to_gpu(q, k, v, lens)
    res = {}
    for kernel in ("block", warp_kernel):
        plan = _poisoned_plan(batch=4, heads=2 * G, kv_heads=2, head_dim=D, max_length=L_max, dtype=dtype,
                              samples=samples, budget=budget, seed=17, step=4, block_n=block_n, tile_kernel=kernel,
                              tiles_per_warp=None if kernel == "block" else tpw)
        o = as_float32(plan.run(*args, layer=2))
        assert np.isfinite(o).all(), "output not fully written"
        res[kernel] = (plan, o, plan.rows_read.get(), plan.spread.get(), plan.lse.get())
    return lengths, L_max, args, res


@pytest.mark.parametrize("warp_kernel", ["warp", "warp_mma"])
@pytest.mark.parametrize("G,D,dtype,block_n,tpw", [(1, 64, "bfloat16", 64, 1), (3, 64, "float16", 128, 2),
                                                   (4, 128, "bfloat16", 128, 3), (8, 128, "float16", 64, 1),
                                                   (5, 256, "float32", 64, 2)])
def test_fixed_warp_matches_block_tile(G, D, dtype, block_n, tpw, warp_kernel):
    """The fixed budget through the stash (score pass, prefix, santa_tile_warp with pre-weighted
    run sums, merge kind weighted) against its one fused block kernel: the same comb counts except
    for boundary flips (the score pass sums in another order: tensor cores, or the v2 FMA kernel
    at float32), so rows read agree but for a few and >= 90% of the (sequence, head) outputs and
    spreads agree to rounding; lse agrees. Lengths 1, BN-1, BN+1 and 9 BN + 7 (runs cut short)."""
    import cupy
    _skip_without_mma_gather(warp_kernel, dtype, D)
    lengths, L_max, args, res = _block_vs_warp("fixed", G, D, dtype, block_n, warp_kernel, tpw, G * D + block_n + 7)
    # the standalone stages of a two-pass plan sample from the same stash: the counts the fused
    # run used (S_t per tile and head, its rows), and its output from them
    plan, o, rows_read = res[warp_kernel][:3]
    counts = plan.sample_counts(args[0], args[1], args[3], layer=2).get()
    for b, n in enumerate(lengths):
        n_tiles = -(-n // block_n)
        assert (counts[b].sum(-1) == max(1, 96 // n_tiles) * n_tiles).all()
    rows = (counts.reshape(4, 2, G, L_max) > 0).any(axis=2).sum(-1)
    assert np.array_equal(rows, rows_read)
    again = as_float32(plan.run_from_counts(*args, cupy.asarray(counts)))
    assert rel_l2(again, o) < max(DENSE_TOL[dtype], 1e-5)
    (_, ob, rb, sb, lb), (_, ow, rw, sw, lw) = res["block"], res[warp_kernel]
    flips = int(np.abs(rw.astype(np.int64) - rb).sum())
    assert flips <= max(2, int(rb.sum()) // 200), f"rows read differ by {flips} of {int(rb.sum())}"
    per_row = np.linalg.norm(ow - ob, axis=-1) / np.maximum(np.linalg.norm(ob, axis=-1), 1e-6)   # [B, H]
    same = per_row < 1e-2
    assert same.mean() >= 0.9, f"{(~same).sum()} of {same.size} head outputs differ (max {per_row.max():.3g})"
    assert np.allclose(sw[same], sb[same], rtol=2e-2, atol=1e-4)
    assert np.allclose(lw, lb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method,budget", [("dense", "global"), ("santa", "global"), ("santa", "fixed")])
def test_merge_unrolls_agree(method, budget):
    """santa_merge with 4 and with 8 partials in flight per warp (the plan picks by grid size):
    the same output to float32 summation order, the same lse and spread."""
    rng = np.random.default_rng(8)
    q, k, v, lens = random_inputs(rng, 3, 8, 2, 128, 3000, [3000, 1, 1500], "bfloat16")
    args = to_gpu(q, k, v, lens)
    res = []
    for wide in (True, False):
        plan = DecodePlan(batch=3, heads=8, kv_heads=2, head_dim=128, max_length=3000, dtype="bfloat16",
                          method=method, budget=budget, samples=256, seed=2, tile_kernel="block", merge_wide=wide)
        assert plan._merge_fn is (plan.kernels.merge_wide if wide else plan.kernels.merge)
        o = as_float32(plan.run(*args))
        res.append((o, plan.lse.get(), plan.spread.get()))
    (o8, l8, s8), (o4, l4, s4) = res
    assert rel_l2(o4, o8) < 2e-3                # bf16 outputs: order-of-summation flips of 1 ulp only
    assert np.allclose(l4, l8, rtol=1e-6, atol=1e-5) and np.allclose(s4, s8, rtol=1e-3, atol=1e-6)


def test_graph_replay_draws_new_samples():
    import cupy
    rng = np.random.default_rng(3)
    q, k, v, lens = random_inputs(rng, 2, 8, 2, 128, 700, [700, 333], "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=700, dtype="bfloat16",
                      samples=32, seed=5)
    plan.run(qg, kg, vg, lg, validate=False)                  # compile + warm up outside capture
    cupy.cuda.Device().synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        plan.run(qg, kg, vg, lg, validate=False)
        plan.advance()
        graph = stream.end_capture()
    plan.step.fill(0)
    outs = []
    for _ in range(3):
        graph.launch(stream)
        stream.synchronize()
        outs.append(plan.out.get().copy())
    assert not np.array_equal(outs[0], outs[1]) and not np.array_equal(outs[1], outs[2])
    assert int(plan.step.get()[0]) == 3
    for step, got in enumerate(outs):                          # replay == eager call at that step
        eager = decode_attention(qg, kg, vg, lg, samples=32, seed=5, step=step).get()
        assert np.array_equal(got, eager)


def test_gpu_rejects_bad_lengths_and_mixed_arrays():
    rng = np.random.default_rng(0)
    q, k, v, lens = random_inputs(rng, 1, 4, 2, 64, 50, [50], "float16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    with pytest.raises(ValueError, match="lengths"):
        decode_attention(qg, kg, vg, lg + 1)
    with pytest.raises(TypeError):
        decode_attention(qg, k, vg, lg)
    with pytest.raises(ValueError, match="q"):
        bad = qg.copy()
        bad[0, 0, 0] = np.nan
        decode_attention(bad, kg, vg, lg)


@pytest.mark.parametrize("G", range(1, spec.MAX_G + 1))
def test_every_group_size(G):
    """Each G in 1..MAX_G has its own kernel instance: dense and santa against the reference."""
    rng = np.random.default_rng(G)
    lengths = [1, 130, 257]
    q, k, v, lens = random_inputs(rng, 3, 2 * G, 2, 128, 260, lengths, "bfloat16", spike=True)
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    assert_dense_matches(decode_attention(qg, kg, vg, lg, method="dense"), dense_error_bound(q, k, v, lens, "bfloat16"))
    kw = dict(samples=64, seed=G, block_n=128)
    o, info = decode_attention(qg, kg, vg, lg, return_info=True, return_counts=True, **kw)
    ref_counts = reference.sample_counts(q, k, lens, **kw)
    assert _count_mismatch(info.counts.get(), ref_counts) <= 2


@pytest.mark.parametrize("budget", spec.BUDGETS)
def test_standalone_sample_then_gather_equals_fused(budget):
    """sample stage -> counts -> gather-add + merge stages reproduce the fused pass bit for bit."""
    rng = np.random.default_rng(21)
    q, k, v, lens = random_inputs(rng, 2, 8, 2, 128, 500, [500, 129], "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=500, dtype="bfloat16",
                      samples=64, budget=budget, seed=3, block_n=64, tile_kernel="block")
    fused = plan.run(qg, kg, vg, lg).copy()
    counts = plan.sample_counts(qg, kg, lg)
    staged = plan.run_from_counts(qg, kg, vg, lg, counts)
    assert np.array_equal(fused.get(), staged.get())
    if budget != "fixed":               # the warp pass 2 (default): same counts, other summation order
        warp = DecodePlan(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=500, dtype="bfloat16",
                          samples=64, budget=budget, seed=3, block_n=64)
        assert warp.tile_kernel in ("warp", "warp_mma")
        got = as_float32(warp.run(qg, kg, vg, lg))
        assert rel_l2(got, as_float32(staged)) < 4e-3
        assert np.array_equal(warp.rows_read.get(), plan.rows_read.get())


@pytest.mark.parametrize("budget", ["global", "largest_remainder"])
@pytest.mark.parametrize("G,D,dtype,block_n", [(1, 64, "bfloat16", 64), (3, 128, "float16", 128),
                                               (4, 128, "bfloat16", 128), (8, 256, "float32", 64),
                                               (5, 64, "float16", 64)])
@pytest.mark.parametrize("warp_kernel", ["warp", "warp_mma"])
def test_warp_tile_matches_block_tile(budget, G, D, dtype, block_n, warp_kernel):
    """Pass 2 with one warp per run of tiles (rows staged through shared memory, light tiles a
    tile ahead, heavy ones kRows at a time; 96 samples select up to ~60 rows a tile here): the same
    counts as the block kernel (rows_read and the spread agree), the output up to float32
    summation order."""
    _skip_without_mma_gather(warp_kernel, dtype, D)
    # runs of 3 tiles, cut short at 10 tiles
    _, _, args, res = _block_vs_warp(budget, G, D, dtype, block_n, warp_kernel, 3, G * D + block_n)
    if G > 1:   # some tiles hold comb points of some heads only: the warp pass 2 skips the others
        q, k, _, lens = (a.get() for a in args)
        counts = reference.sample_counts(q, k, lens, samples=96, budget=budget, seed=17, step=4, layer=2,
                                         block_n=block_n)
        drawn = reference.tile_draws(counts, block_n)                         # [B, H, T]
        heads_hit = (drawn.reshape(4, 2, G, -1) > 0).sum(2)                    # [B, KVH, T]
        assert ((heads_hit > 0) & (heads_hit < G)).any(), "no tile with points in some heads only"
    (_, ob, rb, sb, lb), (_, ow, rw, sw, lw) = res["block"], res[warp_kernel]
    assert np.array_equal(rb, rw), "distinct rows read differ (different counts)"
    assert rel_l2(ow, ob) < max(DENSE_TOL[dtype], 1e-5)
    # spread = sqrt(max(0, m2/S - |o|^2) / S / D): where one row takes every sample (length 1) the
    # two terms cancel and the spread is float32 rounding noise (~3e-5 here, 0 or not depending on
    # the summation order), hence the same tolerance as against the reference estimator
    assert np.allclose(sw, sb, rtol=2e-2, atol=1e-4)
    assert np.allclose(lw, lb, rtol=1e-6, atol=1e-6)   # the prefix's float64 lse vs the merge's float32


@pytest.mark.parametrize("G,D,dtype,block_n,limit", [(4, 128, "bfloat16", 128, 256), (3, 64, "float16", 64, 2048)])
def test_mma_gather_counts_beyond_its_limit(G, D, dtype, block_n, limit):
    """The warp_mma gather runs on tensor cores only where the counts are exact in the 16-bit type
    (<= 256 in bf16, <= 2048 in f16: a head drawing at most that many points in the tile); other
    tiles take the staged FMA gather. 5000 samples: the length-1 tile draws them all, the long sequence's
    tiles ~500 each (under the f16 limit, over the bf16 one), so a run mixes both paths. Against the
    block pass 2: the same rows, the output up to float32 summation order."""
    _, _, args, res = _block_vs_warp("global", G, D, dtype, block_n, "warp_mma", 3, G + D, samples=5000)
    plan = res["warp_mma"][0]
    counts = plan.sample_counts(args[0], args[1], args[3], layer=2).get()
    drawn = reference.tile_draws(counts, block_n)
    assert drawn.max() > limit and ((drawn > 0) & (drawn <= limit)).any(), "both gather paths are exercised"
    (_, ob, rb, sb, lb), (_, ow, rw, sw, lw) = res["block"], res["warp_mma"]
    assert np.array_equal(rb, rw)
    assert rel_l2(ow, ob) < max(DENSE_TOL[dtype], 1e-5)
    assert np.allclose(sw, sb, rtol=2e-2, atol=1e-4)
    assert np.allclose(lw, lb, rtol=1e-6, atol=1e-6)   # the prefix's float64 lse vs the merge's float32


@pytest.mark.parametrize("budget", ["global", "largest_remainder"])
@pytest.mark.parametrize("G,D,dtype,block_n,tpw", [(1, 64, "bfloat16", 64, 3), (3, 64, "float16", 128, 2),
                                                   (4, 128, "bfloat16", 128, 4), (12, 128, "float16", 64, 5),
                                                   (5, 128, "float16", 64, 16)])
def test_runs_of_tiles_match_single_tiles(budget, G, D, dtype, block_n, tpw):
    """One warp per run of tpw tiles (score pass and warp pass 2): the same
    stash and tile stats bit for bit, the same counts (rows read), the output and spread up to
    float32 summation order. Lengths cut runs short and leave runs without any tile."""
    rng = np.random.default_rng(G * D + block_n + tpw)
    lengths = [1, block_n - 1, block_n + 1, 9 * block_n + 7, 2 * tpw * block_n]
    L_max = max(lengths) + 3
    q, k, v, lens = random_inputs(rng, 5, 2 * G, 2, D, L_max, lengths, dtype, peak=2.0)
    args = to_gpu(q, k, v, lens)
    res = {}
    for runs in (1, tpw):
        plan = _poisoned_plan(batch=5, heads=2 * G, kv_heads=2, head_dim=D, max_length=L_max, dtype=dtype,
                              samples=96, budget=budget, seed=23, step=2, block_n=block_n, tiles_per_warp=runs,
                              stash_l2_max_bytes=0)   # the stash stays readable after the run
        assert plan.score_tpw == runs and plan.tile_tpw == (runs if G <= 8 else 1)
        plan.scores.fill(np.nan)
        o = as_float32(plan.run(*args, layer=1))
        assert np.isfinite(o).all(), "output not fully written"
        res[runs] = (o, plan.rows_read.get(), plan.spread.get(), plan.lse.get(), plan.scores.get(),
                     plan.part_s.get()[..., :2])
    (o1, r1, s1, l1, sc1, st1), (o2, r2, s2, l2, sc2, st2) = res[1], res[tpw]
    for j, n in enumerate(lengths):
        assert np.array_equal(sc1[j, :, :n], sc2[j, :, :n]), "score stash differs"
        tiles = -(-n // block_n)
        assert np.array_equal(st1[j, :, :tiles], st2[j, :, :tiles]), "tile stats differ"
    assert np.array_equal(r1, r2), "distinct rows read differ (different counts)"
    assert rel_l2(o2, o1) < max(DENSE_TOL[dtype], 1e-5)
    assert np.allclose(s2, s1, rtol=2e-2, atol=1e-4)
    assert np.allclose(l2, l1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("budget", ["global", "fixed"])
@pytest.mark.parametrize("G,D,dtype,block_n", [(4, 128, "bfloat16", 128), (3, 64, "float16", 64)])
def test_stash_in_l2_changes_no_bit(budget, G, D, dtype, block_n):
    """The stash kept in the L2 (K read evict-first, the stash lines dropped by pass 2 once read)
    against the stash left to DRAM: the same output, lse, spread and rows read, bit for bit, over
    three steps; lengths whose stash rows end inside a 128-byte line (odd L_max) and tiles shorter
    than a line. Only the plan whose stash is dropped may leave plan.scores undefined."""
    rng = np.random.default_rng(G * D + block_n + len(budget))
    lengths = [1, 31, block_n + 1, 6 * block_n + 29]
    L_max = max(lengths) + 3
    q, k, v, lens = random_inputs(rng, 4, 2 * G, 2, D, L_max, lengths, dtype, peak=2.0)
    args = to_gpu(q, k, v, lens)
    res = {}
    for limit in (0, None):
        plan = DecodePlan(batch=4, heads=2 * G, kv_heads=2, head_dim=D, max_length=L_max, dtype=dtype,
                          samples=48 if budget == "global" else 4 * 48, budget=budget, seed=5,
                          block_n=block_n, tile_kernel="warp", stash_l2_max_bytes=limit)
        assert plan.stash_in_l2 == (limit is None)
        outs = []
        for _ in range(3):
            o = as_float32(plan.run(*args))
            outs.append((o, plan.lse.get(), plan.spread.get(), plan.rows_read.get()))
            plan.advance()
        res[limit] = outs
    for a, b in zip(res[0], res[None]):
        for x, y in zip(a, b):
            assert np.array_equal(x, y, equal_nan=True)


@pytest.mark.parametrize("budget", ["global", "largest_remainder"])
def test_prefix_matches_reference_across_chunks(budget):
    """santa_prefix against reference.global_prefix on the plan's own tile stats: the cdf and lse to
    float64 rounding (the kernel scans in another order than the reference's sequential cumsum), the
    last C exactly 1, and the Hamilton allocation summing to S. Sequences of many scan chunks
    (santa_prefix scans 256 tiles a round; block_n 64: up to 2500 tiles), a whole number of chunks
    and one tile more, a partial last tile, and a single tile."""
    rng = np.random.default_rng(17 + len(budget))
    block_n, S = 64, 256
    lengths = [64 * 2500 - 5, 64 * 1024, 64 * 1024 + 1, 7]
    L_max = max(lengths)
    B, G, KVH, D = len(lengths), 2, 1, 64
    q, k, v, lens = random_inputs(rng, B, G * KVH, KVH, D, L_max, lengths, "float16", peak=3.0)
    plan = DecodePlan(batch=B, heads=G * KVH, kv_heads=KVH, head_dim=D, max_length=L_max, dtype="float16",
                      samples=S, budget=budget, seed=3, block_n=block_n, santa_min_length=0)
    plan.run(*to_gpu(q, k, v, lens))
    part_s, cdf, lse, alloc = plan.part_s.get(), plan.cdf.get(), plan.lse.get(), plan.alloc.get()
    for b, n in enumerate(lengths):
        tiles = -(-n // block_n)
        m, l = part_s[b, :, :tiles, 0], part_s[b, :, :tiles, 1]
        ref = reference.global_prefix(m, l, samples=S if budget == "largest_remainder" else None)
        np.testing.assert_allclose(cdf[b, :, :tiles], ref.C, rtol=1e-12, atol=1e-15)
        assert (cdf[b, :, tiles - 1] == 1.0).all()
        assert np.all(np.diff(cdf[b, :, :tiles], axis=-1) >= 0)
        np.testing.assert_allclose(lse[b], (ref.m_star + np.log(ref.Z)).astype(np.float32), rtol=1e-6)
        if budget == "largest_remainder":
            assert (alloc[b, :, :tiles].sum(-1) == S).all()
            assert np.abs(alloc[b, :, :tiles] - ref.S_lr).sum() <= 2 * G   # remainder ties decided by the last bits


@pytest.mark.parametrize("G,D,dtype,block_n", [(1, 64, "bfloat16", 64), (4, 128, "bfloat16", 128),
                                               (3, 64, "float16", 128), (12, 128, "float16", 64)])
def test_score_v4_matches_v2(G, D, dtype, block_n):
    """The tensor-core score pass: the same stash and tile stats as v2 up to float32 summation order
    (odd L_max exercises the unaligned stash rows)."""
    rng = np.random.default_rng(G * D + block_n)
    lengths = [1, block_n - 1, block_n + 1, 7 * block_n + 5]
    L_max = max(lengths) + 4
    q, k, v, lens = random_inputs(rng, 4, 2 * G, 2, D, L_max, lengths, dtype)
    args = to_gpu(q, k, v, lens)
    outs = []
    for kernel in ("stream", "mma"):
        plan = DecodePlan(batch=4, heads=2 * G, kv_heads=2, head_dim=D, max_length=L_max, dtype=dtype,
                          samples=64, budget="global", block_n=block_n, score_kernel=kernel,
                          stash_l2_max_bytes=0)       # the stash stays readable after the run
        plan.scores.fill(np.nan)
        plan.run(*args)
        outs.append((plan.scores.get(), plan.part_s.get()))
    for j, n in enumerate(lengths):
        a, b = outs[0][0][j, :, :n], outs[1][0][j, :, :n]
        assert np.isfinite(b).all(), "stash not fully written"
        assert np.allclose(a, b, rtol=1e-5, atol=1e-5), "score stash differs"
        tiles = -(-n // block_n)
        sa, sb = outs[0][1][j, :, :tiles, :2], outs[1][1][j, :, :tiles, :2]
        assert np.allclose(sa, sb, rtol=1e-4, atol=1e-5), "tile stats differ"


@pytest.mark.parametrize("options", [
    dict(method="dense", max_length=2000),                                 # dense that merges itself
    dict(method="dense", max_length=40_000),                               # + santa_merge after it
    dict(method="santa", budget="global", max_length=9000),                # score, prefix, warp tile, merge
    # the length-1 sequence runs the dense fallback, after pass 2, asking before its wait
    dict(method="santa", budget="global", max_length=9000, santa_min_length=100),
    dict(method="santa", budget="fixed", samples=2048, max_length=20_000, tile_kernel="warp_mma"),
    dict(method="santa", budget="largest_remainder", sampler="iid", max_length=9000, tile_kernel="block",
         score_kernel="stream"),
], ids=["dense-self-merge", "dense-merge", "global", "global-fallback", "fixed-mma", "lr-block-stream"])
def test_programmatic_launch_is_bit_identical(options):
    """KernelChoice(programmatic=True): every launch may start while the one before it
    finishes; each kernel waits (griddepcontrol.wait) before reading. Two decode steps captured in
    one graph (the second depends on the first's advance), replayed twice: the same bits as plain
    (the warp pass 2 adds its runs with float atomics, in any order: there the same lse bits and o
    to the last bit of a few elements)."""
    import cupy
    rng = np.random.default_rng(21)
    B, H, KVH, D = 3, 32, 8, 128
    L_max = options.pop("max_length")
    q, k, v, lens = to_gpu(*random_inputs(rng, B, H, KVH, D, L_max, [L_max, L_max - 77, 1], "bfloat16"))

    mode = kernels.programmatic_launch()

    def run(programmatic):
        try:
            plan = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L_max, dtype="bfloat16",
                              programmatic=programmatic, **options)
            assert plan._programmatic == programmatic and kernels.programmatic_launch() == mode
            plan.run(q, k, v, lens, validate=False)              # compile outside the capture
            cupy.cuda.Device().synchronize()
            stream = cupy.cuda.Stream(non_blocking=True)
            outs = []
            with stream:
                stream.begin_capture()
                for _ in range(2):
                    plan.run(q, k, v, lens, validate=False)
                    plan.advance()
                graph = stream.end_capture()
                for _ in range(2):
                    graph.launch(stream)
                    outs += [plan.out.get(), plan.lse.get()]
            return outs
        finally:
            kernels.set_programmatic_launch(mode)

    atomics = options.get("method") == "santa" and options.get("tile_kernel", "auto") != "block"
    for i, (got, want) in enumerate(zip(run(True), run(False))):
        if atomics and i % 2 == 0:                               # o
            assert rel_l2(as_float32(got), as_float32(want)) < 1e-3
        else:
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("D,heads", [(128, 16), (64, 12)])
@pytest.mark.parametrize("splits", [1, 5, 64, 200])
def test_dense_forced_splits_match_reference(splits, D, heads):
    """DecodePlan(dense_splits=N) (bench's dense-p<N>): one split, a few (self-merge), many (more
    than rows allow at the short length: empty splits) against the float64 reference. One split
    walks a warp through ~20 steps, several turns of the mma kernel's register ring at either D."""
    rng = np.random.default_rng(splits)
    L_max, lengths = 5003, [5003, 1, 2777]
    q, k, v, lens = random_inputs(rng, 3, heads, 4, D, L_max, lengths, "bfloat16", spike=True)
    plan = DecodePlan(batch=3, heads=heads, kv_heads=4, head_dim=D, max_length=L_max, dtype="bfloat16",
                      method="dense", dense_splits=splits)
    assert_dense_matches(plan.run(*to_gpu(q, k, v, lens)), dense_error_bound(q, k, v, lens, "bfloat16"))


@pytest.mark.parametrize("KVH", [2, 16])          # the warp pass 2 finishing o itself / santa_merge after it
def test_ragged_batch_splits_follow_the_lengths(KVH):
    """One long sequence among short ones in a cache of larger capacity: the dense kernel's split
    and the warp kernels' run length come from the lengths on the device (cuda/common.cuh
    dense_split, run_block). Dense matches the reference; santa's runs (c < tiles_per_warp here)
    give the same rows and output as single-tile runs; a graph replayed over new lengths follows."""
    import cupy
    rng = np.random.default_rng(KVH)
    lengths = [9000, 130, 1, 700, 0, 64]
    L_max, G, D = 12000, 4, 128
    q, k, v, lens = random_inputs(rng, 6, G * KVH, KVH, D, L_max, lengths, "bfloat16", peak=2.0, spike=True)
    args = to_gpu(q, k, v, lens)
    dense = santa_cupy.DecodePlan(batch=6, heads=G * KVH, kv_heads=KVH, head_dim=D, max_length=L_max, method="dense")
    o = dense.run(*args)
    assert_dense_matches(o, dense_error_bound(q, k, v, lens, "bfloat16"))
    assert not as_float32(o)[lens == 0].any()                  # an empty sequence: o = 0
    res = []
    for tpw in (8, 1):                 # 8: the kernels take c = ceil(8 * 81 tiles / (6 * 94)) = 2
        plan = _poisoned_plan(batch=6, heads=G * KVH, kv_heads=KVH, head_dim=D, max_length=L_max, samples=128,
                              santa_min_length=0, seed=3, tiles_per_warp=tpw)
        assert plan.tile_tpw == tpw
        res.append((as_float32(plan.run(*args)), plan.rows_read.get()))
    assert np.array_equal(res[0][1], res[1][1])
    assert rel_l2(res[0][0], res[1][0]) < 1e-5
    # a captured dense graph over other lengths: the split follows them
    qg, kg, vg, lg = args
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        dense.run(qg, kg, vg, lg, validate=False)
        graph = stream.end_capture()
    for new in ([1, 11999, 5, 5, 5, 5], [3000] * 6):
        lg.set(np.asarray(new, np.int32), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert_dense_matches(dense.out, dense_error_bound(q, k, v, np.asarray(new, np.int32), "bfloat16"),
                             what=str(new), spike=False)

"""Block key sampling on the GPU (santa_key_blocks + santa_score_keys on a blocked K,
santa_cupy/key_pass.py) against the float64 NumPy reference (santa_cupy/key_sampling.py).

The score kernel is the automatic one (santa_score_keys_mma, tensor cores) except where a test
forces santa_score_keys (the FMA pass) beside it.
(a) pi, the blocks read and their Horvitz-Thompson weights bit for bit the reference's, at awkward
    sizes (B = 3, lengths 1, odd, past a tile), several budgets, rules, draws and both combines;
(b) the stash within a stated float32 bound of the reference's scores, reading no K byte of an
    unselected block (those runs, and the rows past each length, hold NaN);
(c) key_budget = 1: every block read with weight 1, the exact scores;
(d) the GPU's scores unbiased over seeds (z-test, Z_MAX standard errors);
(e) decode_attention with key sampling at S >> n against key_sampled_attention's exact softmax of
    the same estimated scores; info.key_fraction the reference's;
(f) the plan's workspace of blocks read equals the reference's; sample_counts / run_from_counts
    redraw the run's blocks;
runs of several tiles a block (forced) against the reference; the layout helpers on CuPy.
Three kernel modules (dtype, D, G, block_n), so that a cold NVRTC cache costs three compiles.
"""

import numpy as np
import pytest

import santa_cupy
from santa_cupy import AttentionSetting, DecodePlan, key_layout, key_sampling, reference, spec
from tests.gpu_util import as_float32, random_inputs, rel_l2, requires_gpu, to_gpu

pytestmark = [pytest.mark.gpu, requires_gpu]

# (dtype, D, G, block_n): the modules these tests compile
CONFIGS = [("bfloat16", 128, 4, 128), ("float16", 64, 1, 64), ("bfloat16", 64, 8, 128)]
F32_U = 2.0 ** -24
Z_MAX = 4.5
NAN_BITS = {"bfloat16": np.uint16(0x7FC0), "float16": np.float16(np.nan)}


def _case(dtype, D, G, block_n, lengths, seed=0, KVH=2):
    rng = np.random.default_rng(seed + D + G)
    L_max = max(lengths) + 5
    q, k, v, lens = random_inputs(rng, len(lengths), G * KVH, KVH, D, L_max, lengths, dtype, peak=1.5)
    q = spec.from_float32(spec.to_float32(q, np) * np.exp(rng.standard_normal(q.shape)).astype(np.float32),
                          dtype, np)                    # block magnitudes that differ: pi spread over (0, 1]
    return q, k, v, lens


def _setting(block_n, **keys):
    seed = keys.pop("seed", 3)
    fields = dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.5, key_rule="qrms", key_combine="mean",
                  key_draws=1)
    fields.update(keys)
    # santa at every length (the default runs these short caches exact)
    return AttentionSetting(method="santa", samples=64, seed=seed, block_n=block_n, santa_min_length=0, **fields)


def _reference(q, k, lens, setting, step, layer):
    return key_sampling.key_scores(q, k, lens, seed=setting.seed, step=step, layer=layer, out_dtype=np.float64,
                                   **setting.key_options)


def _gpu(q, k, lens, setting, step, layer, kb=None):
    """The GPU's scores [B, H, L_max] (the blocked K's rows past L_max, to its last page's end, -inf)."""
    kb = key_layout.to_blocked(k, setting.key_block) if kb is None else kb
    qg, kbg, lg = to_gpu(q, kb, lens)
    s, info = santa_cupy.key_scores(qg, kbg, lg, setting, step=step, layer=layer, key_layout="blocked")
    s = s.get()
    assert s.shape[-1] == key_layout.blocked_rows(kb.shape) and (s[..., k.shape[1]:] == -np.inf).all()
    return s[..., :k.shape[1]], info


def _poisoned_blocked(k, FB, lens, read, nan):
    """to_blocked(k, FB) with NaN bits in every K byte the kernel must not read: rows past each
    length and blocks no draw selected (read [B, KVH, C])."""
    kb = key_layout.to_blocked(k, FB)
    B, KVH, NP, C, P, _ = kb.shape
    row = np.arange(NP * P).reshape(NP, P)
    for b, n in enumerate(lens):
        kb[b].transpose(0, 2, 1, 3, 4)[:, :, row >= n] = nan       # [KVH, C, NP, P, FB]: rows past the length
        for g in range(KVH):
            kb[b, g][:, ~read[b, g]] = nan                         # [NP, C, P, FB]: blocks not selected
    return kb


def _score_bound(q, k, lens, weight, scale, FB):
    """|float32 stash - float64 reference| bound [B, H, L_max]: float32 rounding of the weights and
    of scale * w * q (3 u), then a dot product of <= D + 8 terms (2 (D + 8) u, x2 margin) of the
    weighted absolute terms A = scale sum_c w_c sum_{i in c} |q_i k_ji|."""
    B, H, D = q.shape
    KVH = k.shape[2]
    qa = np.abs(reference.to_float64(q)).reshape(B, KVH, H // KVH, D // FB, FB) * weight[:, :, None, :, None]
    ka = np.abs(reference.to_float64(k))                                     # [B, L, KVH, D]
    A = scale * np.einsum("bghcf,bjgcf->bghj", qa, ka.reshape(B, -1, KVH, D // FB, FB)).reshape(B, H, -1)
    return (2 * (2 * (D + 8) + 3) * F32_U) * A + 1e-30


def _assert_within_bound(got, want, bound, lens, finite=True):
    """Each sequence's stash rows j < n against the reference within the float32 bound (finite:
    also no NaN, which only a K byte the kernel must skip can bring where K is poisoned)."""
    for b, n in enumerate(lens):
        if finite:
            assert np.isfinite(got[b, :, :n]).all(), "the kernel read a NaN: a K byte it must skip"
        err = np.abs(got[b, :, :n] - want[b, :, :n])
        assert (err <= bound[b, :, :n]).all(), f"b={b}: worst {float((err / bound[b, :, :n]).max()):.3g} x bound"


def _assert_tile_stats(part_s, want, lens, block_n, exp_sum=False):
    """part_s [B, H, T, 4]: each tile's max (and with exp_sum its sum of exp(s - max)) as the
    reference's scores give them."""
    for b, n in enumerate(lens):
        for t in range(-(-n // block_n)):
            tile = want[b, :, t * block_n:min(n, (t + 1) * block_n)]
            m = tile.max(-1)
            assert np.allclose(part_s[b, :, t, 0], m, rtol=1e-5, atol=1e-4), (b, t)
            if exp_sum:
                assert np.allclose(part_s[b, :, t, 1], np.exp(tile - m[:, None]).sum(-1), rtol=1e-4), (b, t)


@pytest.mark.parametrize("dtype,D,G,block_n", CONFIGS)
# one draw (santa_key_blocks' closed form for pi) also at tied weights ("uniform") near a budget of
# 1, and at a budget on a float32 midpoint
@pytest.mark.parametrize("FB,R,budget,rule,combine", [(16, 1, 0.5, "qrms", "mean"), (32, 3, 0.3, "qmax", "union"),
                                                      (16, 2, 0.8, "uniform", "mean"), (16, 4, 0.25, "qmax", "mean"),
                                                      (32, 1, 0.9, "qrms", "union"), (32, 1, 0.99, "uniform", "mean"),
                                                      (16, 1, 0.5 + 2.0 ** -25, "qmax", "mean")])
def test_blocks_bit_identical_and_scores_within_bound(dtype, D, G, block_n, FB, R, budget, rule, combine):
    """(a) + (b): pi, read and weights bit for bit; scores within the float32 bound, with NaN in
    every K byte the kernel must not read."""
    lengths = [1, block_n + 3, 2 * block_n + 45]
    q, k, _, lens = _case(dtype, D, G, block_n, lengths, seed=R)
    setting = _setting(block_n, key_block=FB, key_draws=R, key_budget=budget, key_rule=rule, key_combine=combine)
    want, ref = _reference(q, k, lens, setting, step=11, layer=4)
    kb = _poisoned_blocked(k, FB, lens, ref.read, NAN_BITS[dtype])
    got, info = _gpu(q, k, lens, setting, step=11, layer=4, kb=kb)
    assert np.array_equal(info.prob.get(), ref.prob), "pi differs from the reference"
    assert np.array_equal(info.read.get(), ref.read), "blocks read differ from the reference"
    assert np.array_equal(info.weight.get(), ref.weight.astype(np.float32)), "HT weights differ"
    assert np.array_equal(info.group_fraction.get(), ref.group_fraction)
    assert info.key_fraction == pytest.approx(ref.key_fraction, rel=1e-12)
    bound = _score_bound(q, k, lens, ref.weight, 1.0 / np.sqrt(D), FB)
    for b, n in enumerate(lens):
        assert (got[b, :, n:] == -np.inf).all()
    _assert_within_bound(got, want, bound, lens)


@pytest.mark.parametrize("dtype,D,G,block_n", CONFIGS)
@pytest.mark.parametrize("FB", [16, 32])
def test_compact_runs_when_few_groups_are_read(dtype, D, G, block_n, FB):
    """santa_score_keys_mma's compact runs (CompactKeyRun: one or, at D 128, two of the D / 32
    feature groups hold a read block) and its run for groups that read no block (every score 0,
    written without reading K) beside its full run, over 24 (sequence, KV head) groups at a small
    uniform budget: every group count occurs, scores within the float32 bound with NaN in every K
    byte the kernel must not read (exactly 0 where a group reads nothing), tile maxima the
    reference's."""
    lengths = [3 * block_n + 5, 1, block_n, 2 * block_n - 3, 5 * block_n, 77]
    q, k, _, lens = _case(dtype, D, G, block_n, lengths, seed=FB + D, KVH=4)
    setting = _setting(block_n, key_block=FB, key_budget=2.0 * FB / D * 0.6, key_rule="uniform", key_draws=1)
    want, ref = _reference(q, k, lens, setting, step=3, layer=5)
    groups = ref.read.reshape(*ref.read.shape[:2], D // 32, 32 // FB).any(-1).sum(-1)     # [B, KVH]
    assert {0, 1, 2}.issubset(set(groups.ravel())) if D == 128 else 1 in set(groups.ravel()), groups
    kb = _poisoned_blocked(k, FB, lens, ref.read, NAN_BITS[dtype])
    got, info = _gpu(q, k, lens, setting, step=3, layer=5, kb=kb)
    assert np.array_equal(info.read.get(), ref.read)
    for b, g in zip(*np.nonzero(groups == 0)):                 # no block read: exact zeros
        assert (got[b, g * G:(g + 1) * G, :lens[b]] == 0).all(), f"b={b} g={g}: a group that reads nothing"
    bound = _score_bound(q, k, lens, ref.weight, 1.0 / np.sqrt(D), FB)
    _assert_within_bound(got, want, bound, lens)


@pytest.mark.parametrize("dtype,D,G,block_n", CONFIGS)
@pytest.mark.parametrize("rule,combine,R", [("uniform", "mean", 1), ("qrms", "union", 3)])
def test_full_budget_reads_everything_exactly(dtype, D, G, block_n, rule, combine, R):
    """(c) key_budget = 1: pi = 1, weight 1 on every block, the exact scores (float32 bound)."""
    lengths = [block_n - 1, 1, 3 * block_n + 17]
    q, k, _, lens = _case(dtype, D, G, block_n, lengths)
    setting = _setting(block_n, key_budget=1.0, key_rule=rule, key_combine=combine, key_draws=R)
    got, info = _gpu(q, k, lens, setting, step=0, layer=0)
    assert (info.prob.get() == 1).all() and (info.weight.get() == 1).all() and info.key_fraction == 1.0
    exact = reference.head_scores(q, k, lens)
    bound = _score_bound(q, k, lens, np.ones(info.weight.shape), 1.0 / np.sqrt(D), 16)
    for b, n in enumerate(lens):
        assert (np.abs(got[b, :, :n] - exact[b, :, :n]) <= bound[b, :, :n]).all()


@pytest.mark.parametrize("combine,R,rule", [("mean", 1, "qrms"), ("union", 3, "qmax"), ("mean", 2, "uniform")])
def test_gpu_scores_unbiased(combine, R, rule):
    """(d) N = SEEDS x REPLICAS realisations (the batch copies of one sequence draw independently):
    every score's mean within Z_MAX standard errors of the exact score; entries without spread
    (blocks always read) within the float32 bound."""
    dtype, D, G, block_n = CONFIGS[0]
    SEEDS, REPLICAS, L = 12, 256, 24
    q1, k1, _, lens1 = _case(dtype, D, G, block_n, [L], seed=5)
    q, k = np.repeat(q1, REPLICAS, 0), np.repeat(k1, REPLICAS, 0)
    lens = np.full(REPLICAS, L, np.int32)
    kb = key_layout.to_blocked(k, 16)
    qg, kbg, lg = to_gpu(q, kb, lens)
    runs = []
    for seed in range(SEEDS):
        setting = _setting(block_n, key_budget=0.4, key_rule=rule, key_combine=combine, key_draws=R, seed=seed)
        s, _ = santa_cupy.key_scores(qg, kbg, lg, setting, step=2, layer=1, key_layout="blocked")
        runs.append(s.get()[:, :, :L].astype(np.float64))
    samples = np.concatenate(runs)                              # [N, H, L]
    exact = reference.head_scores(q1, k1, lens1)[0, :, :L]
    err = np.abs(samples.mean(0) - exact)
    se = samples.std(0, ddof=1) / np.sqrt(samples.shape[0])
    tight = _score_bound(q1, k1, lens1, np.ones((1, q1.shape[1] // G, D // 16)), 1.0 / np.sqrt(D), 16)[0, :, :L]
    fixed = se < tight
    assert (err[fixed] <= 2 * tight[fixed]).all()
    z = float((err[~fixed] / se[~fixed]).max())
    print(f"{combine} R={R} {rule}: max z = {z:.2f} over {int((~fixed).sum())} entries")
    assert z < Z_MAX


@pytest.mark.parametrize("dtype,D,G,block_n", CONFIGS[:2])
@pytest.mark.parametrize("budget", ["global", "fixed"])
@pytest.mark.parametrize("score_kernel", ["auto", "stream"])
def test_decode_attention_matches_key_sampled_attention(dtype, D, G, block_n, budget, score_kernel):
    """(e) SANTA with S >> n rows on the GPU's estimated scores against the exact softmax of the
    reference's (the same blocks, weights within float32): key_fraction and lse too. auto: the
    tensor-core key pass and the warp pass 2 (decode_attention); stream: the FMA key pass and the
    block pass 2 (a plan forcing it)."""
    lengths = [40, 1, 97]
    q, k, v, lens = _case(dtype, D, G, block_n, lengths, seed=9)
    setting = _setting(block_n, key_budget=0.6, key_draws=2, key_combine="union").replace(
        samples=spec.MAX_SAMPLES, budget=budget, santa_min_length=0)
    o_ref, lse_ref, ks, _ = key_sampling.key_sampled_attention(
        q, k, v, lens, value="dense", seed=setting.seed, step=6, layer=2, **setting.key_options)
    qg, kbg, vg, lg = to_gpu(q, key_layout.to_blocked(k, 16), v, lens)
    if score_kernel == "auto":
        o, info = santa_cupy.decode_attention(qg, kbg, vg, lg, setting, step=6, layer=2, return_info=True,
                                              key_layout="blocked")
    else:
        from tests.gpu_util import make_plan
        B, H, _ = q.shape
        plan = make_plan(batch=B, heads=H, kv_heads=H // G, head_dim=D, max_length=k.shape[1], dtype=dtype,
                         setting=setting, step=6, key_layout="blocked", score_kernel="stream")
        assert (plan.key_pass.score_kernel, plan.tile_kernel) == ("stream", "block")
        o = plan.run(qg, kbg, vg, lg, layer=2)
        info = plan.info()
    assert np.array_equal(info.key_fraction.get(), ks.group_fraction.astype(np.float32))
    assert np.allclose(info.lse.get(), lse_ref, atol=2e-4, rtol=1e-5)
    # S = 65536 comb points over <= 97 rows: each row's weight within 1 / S, plus the output's rounding
    tol = {"bfloat16": 1e-2, "float16": 4e-3}[dtype]
    for b, n in enumerate(lengths):
        assert rel_l2(as_float32(o)[b], o_ref[b]) < tol, f"b={b} (n={n})"


@pytest.mark.parametrize("combine", ["mean", "union"])
def test_plan_workspace_counts_blocks_read(combine):
    """(f) DecodePlan(key_layout="blocked"): key_pass.blocks_read = the reference's blocks read per
    (b, g) at the plan's device step and layer; info().key_fraction = that / C; a second run after
    advance() draws again (the step key)."""
    dtype, D, G, block_n = CONFIGS[2]
    lengths = [300, 129, 1]
    q, k, v, lens = _case(dtype, D, G, block_n, lengths, seed=1)
    setting = _setting(block_n, key_budget=0.35, key_draws=2, key_combine=combine, key_rule="qmax")
    B, H, D_ = q.shape
    plan = DecodePlan(batch=B, heads=H, kv_heads=H // G, head_dim=D, max_length=k.shape[1], dtype=dtype,
                      setting=setting, step=8, key_layout="blocked")
    qg, kbg, vg, lg = to_gpu(q, key_layout.to_blocked(k, 16), v, lens)
    for step in (8, 9):
        o = as_float32(plan.run(qg, kbg, vg, lg, layer=3))
        _, ref = _reference(q, k, lens, setting, step=step, layer=3)
        assert np.array_equal(plan.key_pass.blocks_read.get(), ref.read.sum(-1))
        assert np.array_equal(plan.info().key_fraction.get(), ref.group_fraction.astype(np.float32))
        # the standalone stages redraw the same blocks (same step and layer): the run's counts and o
        counts = plan.sample_counts(qg, kbg, lg, layer=3)
        assert (counts.get().sum(-1) == setting.samples).all()
        again = as_float32(plan.run_from_counts(qg, kbg, vg, lg, counts, layer=3))
        assert rel_l2(again, o) < 1e-3
        plan.advance()


@pytest.mark.parametrize("runs", [2, 3])
@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("score_kernel", ["stream", "mma"])
def test_runs_of_tiles_a_block(runs, FB, score_kernel):
    """santa_score_keys (stream: runs of several tiles a block) and santa_score_keys_mma (mma: a
    run a warp, 4 a block) with forced runs (KernelChoice.tiles_per_warp; the fitted run is 1 at
    these sizes): the plan's stash and tile maxima against the reference, the register pipelines
    crossing tile boundaries, lengths ending inside a run."""
    from tests.gpu_util import make_plan
    dtype, D, G, block_n = CONFIGS[0]
    lengths = [5 * block_n + 3, 1, 2 * block_n, 3 * block_n - 7]
    q, k, v, lens = _case(dtype, D, G, block_n, lengths, seed=runs + FB)
    setting = _setting(block_n, key_block=FB, key_budget=0.55, key_draws=2, key_rule="qmax")
    B, H, _ = q.shape
    plan = make_plan(batch=B, heads=H, kv_heads=H // G, head_dim=D, max_length=k.shape[1], dtype=dtype,
                     setting=setting, key_layout="blocked", tiles_per_warp=runs, score_kernel=score_kernel,
                     stash_l2_max_bytes=0)            # the stash stays readable after the run
    assert plan.key_pass.tiles_per_block == runs and plan.key_pass.score_kernel == score_kernel
    plan.run(*to_gpu(q, key_layout.to_blocked(k, FB), v, lens), layer=1)
    want, ref = _reference(q, k, lens, setting, step=0, layer=1)
    got, part_s = plan.scores.get(), plan.part_s.get()
    bound = _score_bound(q, k, lens, ref.weight, 1.0 / np.sqrt(D), FB)
    _assert_within_bound(got, want, bound, lens, finite=False)
    _assert_tile_stats(part_s, want, lens, block_n)


@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("runs", [1, 2, 3])
def test_tile_stats_at_three_quarters_of_k(block_n, runs):
    """santa_score_keys_mma where most groups read three of their four 32-feature blocks (FB 32,
    D 128, uniform budget 3/4: the full-width run with one group's pieces off) beside groups that
    read two or four: runs of 1-3 tiles a warp, lengths ending inside a step, a tile and a run, NaN
    in every K byte the kernel must not read; the stash, and each tile's max and exp-sum, against
    the reference."""
    from tests.gpu_util import make_plan
    dtype, D, G, FB = "bfloat16", 128, 4, 32
    lengths = [5 * block_n + 3, 1, 2 * block_n, 3 * block_n - 7, 77, 16]
    q, k, v, lens = _case(dtype, D, G, block_n, lengths, seed=runs, KVH=4)
    setting = _setting(block_n, key_block=FB, key_budget=0.75, key_rule="uniform", key_draws=1)
    want, ref = _reference(q, k, lens, setting, step=0, layer=1)
    groups = ref.read.sum(-1)                                        # FB 32: a block is a feature group
    assert (groups == 3).sum() >= 4 and {2, 4}.issubset(set(groups.ravel())), groups
    B, H, _ = q.shape
    plan = make_plan(batch=B, heads=H, kv_heads=H // G, head_dim=D, max_length=k.shape[1], dtype=dtype,
                     setting=setting, key_layout="blocked", tiles_per_warp=runs, stash_l2_max_bytes=0)
    assert plan.key_pass.tiles_per_block == runs and plan.key_pass.score_kernel == "mma"
    plan.run(*to_gpu(q, _poisoned_blocked(k, FB, lens, ref.read, NAN_BITS[dtype]), v, lens), layer=1)
    got, part_s = plan.scores.get(), plan.part_s.get()
    bound = _score_bound(q, k, lens, ref.weight, 1.0 / np.sqrt(D), FB)
    _assert_within_bound(got, want, bound, lens)
    _assert_tile_stats(part_s, want, lens, block_n, exp_sum=True)


@pytest.mark.parametrize("FB,D", [(16, 128), (32, 128), (32, 64)])
def test_launch_order_heaviest_group_first(FB, D):
    """santa_key_blocks' group_order (santa_score_keys_mma's launch order): the (sequence, KV head)
    groups by the number of 32-feature groups holding a read block, descending, then by id, as
    NumPy sorts them from the blocks read; the same after a second launch (its arrival counter
    back at zero), over 37 x 5 groups (several rounds of the last warp's sort)."""
    import cupy
    from santa_cupy.key_pass import KeyScorePass
    B, KVH, G, L = 37, 5, 2, 300
    setting = _setting(64, key_block=FB, key_budget=0.3, key_rule="qmax", key_draws=1)
    q = spec.from_float32(np.random.default_rng(FB + D).standard_normal((B, KVH * G, D)).astype(np.float32),
                          "bfloat16", np)
    kp = KeyScorePass(batch=B, heads=KVH * G, kv_heads=KVH, head_dim=D, max_length=L, dtype="bfloat16", block_n=64,
                      setting=setting, scale=1.0 / np.sqrt(D))
    assert np.array_equal(kp.group_order.get(), np.arange(B * KVH))         # before any draw: identity
    qg = cupy.asarray(q)
    for step in (4, 5):
        kp.launch_blocks(qg, cupy.full((1,), step, cupy.int64), 0)
        read = (kp.key_weight.get() != 0).reshape(B * KVH, D // 32, 32 // FB).any(-1)
        classes = read.sum(-1)
        assert len(set(classes)) >= 3, classes
        want = np.argsort(-classes, kind="stable")
        assert np.array_equal(kp.group_order.get(), want), f"step {step}"
        assert np.array_equal(kp.group_class.get(), classes)
        assert kp._arrive.get()[0] == 0


@pytest.mark.parametrize("dtype,D,G,block_n", CONFIGS)
@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("runs", [1, 3])
def test_every_read_class_against_reference(dtype, D, G, block_n, FB, runs):
    """santa_score_keys_mma's instance for each key block on budgets where every class of reads
    occurs (none, compact runs, the full width), runs of 1 and 3 tiles a warp, lengths ending
    inside a step, a tile and a run, NaN in every K byte it must not read: the stash within the
    float32 bound of the reference, each tile's max and exp-sum the reference's."""
    import cupy
    from santa_cupy.key_pass import KeyScorePass
    lengths = [3 * block_n + 5, 1, block_n, 2 * block_n - 3, 5 * block_n, 77]
    q, k, _, lens = _case(dtype, D, G, block_n, lengths, seed=FB + runs, KVH=4)
    B, H, _ = q.shape
    for budget in (0.3, 0.75):
        setting = _setting(block_n, key_block=FB, key_budget=budget, key_rule="uniform", key_draws=1)
        want, ref = _reference(q, k, lens, setting, step=7, layer=2)
        classes = ref.read.reshape(B * (H // G), D // 32, 32 // FB).any(-1).sum(-1)
        assert len(set(classes)) >= 2, classes
        qg, kbg = to_gpu(q, _poisoned_blocked(k, FB, lens, ref.read, NAN_BITS[dtype]))
        L_max = key_layout.blocked_rows(kbg.shape)
        kp = KeyScorePass(batch=B, heads=H, kv_heads=H // G, head_dim=D, max_length=L_max, dtype=dtype,
                          block_n=block_n, setting=setting, scale=1.0 / np.sqrt(D), tiles_per_block=runs)
        assert kp.score_kernel == "mma" and kp._score is getattr(kp.kernels, f"score_keys_mma_fb{FB}")
        scores = cupy.full((B, H, L_max), np.nan, cupy.float32)
        part_s = cupy.full((B, H, kp.T_max, 4), np.nan, cupy.float32)
        kp.launch(qg, kbg, cupy.asarray(lens, dtype=cupy.int32), cupy.full((1,), 7, cupy.int64), 2, scores, part_s)
        assert np.array_equal(kp.key_weight.get(), ref.weight.astype(np.float32))
        got = scores.get()[..., :k.shape[1]]
        _assert_within_bound(got, want, _score_bound(q, k, lens, ref.weight, 1.0 / np.sqrt(D), FB), lens)
        _assert_tile_stats(part_s.get(), want, lens, block_n, exp_sum=True)


def test_layout_helpers_on_cupy():
    """key_layout.to_blocked / from_blocked on CuPy arrays: the NumPy helpers' result, CuPy out."""
    import cupy
    rs = np.random.default_rng(2)
    k = rs.integers(0, 2**16, (3, 37, 2, 64)).astype(np.uint16)
    kb = key_layout.to_blocked(cupy.asarray(k), 32)
    assert isinstance(kb, cupy.ndarray) and kb.flags.c_contiguous and kb.shape == (3, 2, 1, 2, 64, 32)
    assert np.array_equal(kb.get(), key_layout.to_blocked(k, 32))
    back = key_layout.from_blocked(kb, 37)
    assert isinstance(back, cupy.ndarray) and np.array_equal(back.get(), k)

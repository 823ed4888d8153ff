"""GPU contracts every kernel path keeps (marker gpu; skipped without CuPy and a GPU).

* a sequence of length 0 in a batch: o = 0, lse = -inf, spread = 0, rows_read = 0, whatever the
  output buffer held (dense and santa, every kernel route);
* NaN (or inf) in q or K: that sequence's output is NaN, the other sequences are untouched;
* the two-launch santa pipeline leaves its workspaces as it found them: repeated runs give the same
  counts (rows_read) and outputs equal up to the order of the float additions;
* santa_min_length: shorter sequences get the exact output, longer ones santa's, in one batch; a
  plan whose cache is below the crossover gives the dense plan's output bit for bit.
"""

import numpy as np
import pytest

from santa_cupy import spec
from tests.gpu_util import (as_float32, assert_dense_matches, dense_error_bound, make_plan, random_inputs, rel_l2,
                            requires_gpu, to_gpu)

pytestmark = [pytest.mark.gpu, requires_gpu]

# (options, what they select); the routes of a plan: dense self-merging / with santa_merge, santa
# two-launch (warp) pipeline for global / fixed / largest remainder, santa block pass 2 + merge
ROUTES = [
    dict(method="dense"),
    dict(method="dense", dense_kernel="stream"),
    dict(method="santa", budget="global"),
    dict(method="santa", budget="fixed", tile_kernel="warp"),
    dict(method="santa", budget="largest_remainder"),
    dict(method="santa", budget="global", sampler="iid"),
    dict(method="santa", budget="fixed", tile_kernel="block"),
    dict(method="santa", budget="global", santa_min_length=500),     # short sequences run dense
    dict(method="santa", budget="global", finish_max_groups=0),       # the warp pass 2 from block partials
    dict(method="santa", budget="fixed", tile_kernel="warp", finish_max_groups=0),
]




def _plan(L_max, **kw):
    import cupy
    kw = {"santa_min_length": 0, **kw}                       # santa at every length unless told
    plan = make_plan(batch=3, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16",
                     samples=64, seed=5, **kw)
    plan.out.view(cupy.uint8).fill(0xFF)                    # NaN in every dtype
    plan.lse.fill(cupy.nan)
    plan.spread.fill(cupy.nan)
    return plan


@pytest.mark.parametrize("options", ROUTES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_length_zero_gives_zero_output_and_minus_inf_lse(options):
    rng = np.random.default_rng(3)
    L_max = 700
    q, k, v, lens = random_inputs(rng, 3, 8, 2, 128, L_max, [700, 1, 300], "bfloat16")
    lens[1] = 0
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = _plan(L_max, **options)
    o = as_float32(plan.run(qg, kg, vg, lg))
    info = plan.info()
    assert np.array_equal(o[1], np.zeros_like(o[1]))
    assert np.all(np.isneginf(info.lse.get()[1]))
    assert np.array_equal(info.spread.get()[1], np.zeros(8, np.float32))
    assert np.array_equal(np.asarray(info.rows_read.get())[1], np.zeros(2))
    assert np.all(np.isfinite(o[[0, 2]])) and np.all(np.isfinite(info.lse.get()[[0, 2]]))
    # the other sequences as in a batch without the empty one
    ref = _plan(L_max, **options)
    lens2 = lens.copy()
    lens2[1] = 5
    o_ref = as_float32(ref.run(qg, kg, vg, to_gpu(lens2)[0]))
    assert rel_l2(o[[0, 2]], o_ref[[0, 2]]) < 1e-5


@pytest.mark.parametrize("where", ["q", "k", "k-only-row"])
@pytest.mark.parametrize("options", ROUTES, ids=lambda o: "-".join(f"{v}" for v in o.values()))
def test_nan_propagates_to_its_sequence_only(options, where):
    """k-only-row: a sequence of length 1 whose one key is NaN (every other score of its tiles is
    masked, so a max that drops NaN would leave m = -inf and o = 0; found by the GPU fuzz test)."""
    rng = np.random.default_rng(4)
    L_max = 900
    q, k, v, lens = random_inputs(rng, 3, 8, 2, 128, L_max, [900, 1 if where == "k-only-row" else 400, 257],
                                  "bfloat16")
    nan = spec.from_float32(np.array([np.nan], np.float32), "bfloat16", np)[0]
    if where == "q":
        q[1, 5, 7] = nan                                     # head 5: KV group 1
    elif where == "k-only-row":
        k[1, 0, 1, 9] = nan                                  # the sequence's one row, group 1
    else:
        k[1, 333, 1, 9] = nan                                # a row of group 1 inside the length
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = _plan(L_max, **options)
    o = as_float32(plan.run(qg, kg, vg, lg))
    assert np.all(np.isnan(o[1, 5])), "the NaN's head must be NaN, not a silent number"
    assert np.all(np.isfinite(o[[0, 2]]))
    assert np.all(np.isfinite(o[1, :4]))                     # KV group 0 of the same sequence


@pytest.mark.parametrize("budget", ["global", "fixed", "largest_remainder"])
def test_warp_pipeline_leaves_workspaces_clean(budget):
    """Counters back to 0 and accumulators to 0 after every call: three runs
    of the same step give the same rows_read and o (up to the atomics' order), a shorter batch in
    between changes nothing for the next."""
    rng = np.random.default_rng(8)
    L_max = 5000
    q, k, v, lens = random_inputs(rng, 3, 8, 2, 128, L_max, [5000, 129, 3001], "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = _plan(L_max, budget=budget, tile_kernel="warp" if budget == "fixed" else "auto")
    assert plan.tile_kernel.startswith("warp")
    first = as_float32(plan.run(qg, kg, vg, lg))
    rows = plan.rows_read.get().copy()
    lse = plan.lse.get().copy()
    short = lens.copy()
    short[:] = [17, 1, 64]
    plan.run(qg, kg, vg, to_gpu(short)[0])
    for _ in range(2):
        again = as_float32(plan.run(qg, kg, vg, lg))
        assert np.array_equal(plan.rows_read.get(), rows)
        assert np.array_equal(plan.lse.get(), lse)
        assert rel_l2(again, first) < 1e-4             # float atomics: bf16 flips of a few elements
    assert int(plan.arrive.get().sum()) == 0
    assert not plan.acc.get().any()


@pytest.mark.parametrize("budget", ["global", "fixed"])
def test_block_partial_finish_is_deterministic(budget):
    """The warp pass 2 finishing from block partials (many KV groups) sums them in block order: the
    same step run again, with another batch in between, writes the same bits."""
    rng = np.random.default_rng(9)
    L_max = 9000
    q, k, v, lens = random_inputs(rng, 3, 8, 2, 128, L_max, [9000, 129, 4097], "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    plan = _plan(L_max, budget=budget, tile_kernel="warp", finish_max_groups=0, tiles_per_warp=1)
    assert not plan.atomic_finish
    first = plan.run(qg, kg, vg, lg).get().copy()
    spread = plan.spread.get().copy()
    plan.run(qg, kg, vg, to_gpu(lens // 3)[0])
    assert np.array_equal(plan.run(qg, kg, vg, lg).get(), first)
    assert np.array_equal(plan.spread.get(), spread)
    assert int(plan.arrive.get().sum()) == 0


def test_short_sequences_run_dense_in_a_santa_plan():
    """santa_min_length=1000: sequences of 1..999 rows are exact (as a dense plan, rows_read their
    length), the others as a santa plan that runs santa everywhere (same counts)."""
    rng = np.random.default_rng(12)
    L_max = 3000
    lens_list = [3000, 999, 1000, 1, 2500, 0]
    q, k, v, lens = random_inputs(rng, 6, 8, 2, 128, L_max, lens_list, "bfloat16", spike=True)
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    kw = dict(batch=6, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16", samples=64, seed=9)
    mixed = make_plan(santa_min_length=1000, **kw)
    assert mixed.santa_from == 1000
    o = as_float32(mixed.run(qg, kg, vg, lg))
    rows, lse = mixed.rows_read.get(), mixed.lse.get()
    dense = make_plan(method="dense", **kw)
    od = as_float32(dense.run(qg, kg, vg, lg))
    santa = make_plan(santa_min_length=0, **kw)
    os_ = as_float32(santa.run(qg, kg, vg, lg))
    short = [1, 3, 5]
    long = [0, 2, 4]
    # each dense split is balanced over its own sequences (the fallback's: the short ones only), so
    # the float32 sums run in another order: a few bf16 roundings of o flip
    assert rel_l2(o[short], od[short]) < 5e-4
    assert_dense_matches(o[short], dense_error_bound(q[short], k[short], v[short], lens[short], "bfloat16"))
    assert np.array_equal(rows[short], np.repeat(lens[short][:, None], 2, axis=1))
    assert np.allclose(lse[short[:2]], dense.lse.get()[short[:2]], rtol=1e-6, atol=1e-6)
    assert np.all(np.isneginf(lse[5])) and not o[5].any()
    assert np.array_equal(rows[long], santa.rows_read.get()[long])
    assert rel_l2(o[long], os_[long]) < 1e-4
    assert np.allclose(lse[long], santa.lse.get()[long], rtol=1e-6, atol=1e-6)
    fallback = mixed.info().dense_fallback.get()
    assert fallback.tolist() == [False, True, False, True, False, True]


@pytest.mark.parametrize("options", [dict(), dict(sampler="iid"), dict(budget="one_pass"), dict(heads=32),
                                     dict(dtype="float16", budget="fixed", tile_kernel="block"),
                                     dict(key_sampling="bernoulli_block", key_block=16, key_budget=0.5,
                                          key_rule="qrms")],
                         ids=["warp", "iid", "one_pass", "g16", "fixed-block", "keys"])
def test_exact_throughout_below_the_crossover_is_the_dense_plan(options):
    """santa_min_length "auto" on a cache below the crossover (B = 1, 2 KV heads: ~60k tokens):
    every route, mixing per sequence or not, runs as the dense plan of its shape, bit for bit, on a
    poisoned output; at 12k tokens the dense kernel takes ~47 splits, past the 32 it merges itself,
    so santa_merge must follow it (a warp plan's fallback alone left o unwritten)."""
    import cupy
    options = dict(options)
    heads, dtype = options.pop("heads", 8), options.pop("dtype", "bfloat16")
    L_max = 12000
    rng = np.random.default_rng(31)
    q, k, v, lens = random_inputs(rng, 1, heads, 2, 128, L_max, [L_max - 5], dtype, spike=True)
    kw = dict(batch=1, heads=heads, kv_heads=2, head_dim=128, max_length=L_max, dtype=dtype)
    keys = "key_sampling" in options
    dense_kw, k_in = {}, k
    if keys:                                      # block key sampling: a blocked K, the blocked dense kernel
        from santa_cupy import key_layout
        kw["key_layout"], dense_kw = "blocked", dict(key_block=options["key_block"])
        k_in = key_layout.to_blocked(k, options["key_block"])
    qg, kg, vg, lg = to_gpu(q, k_in, v, lens)
    dense = make_plan(method="dense", **kw, **dense_kw)
    want = dense.run(qg, kg, vg, lg).copy()
    plan = make_plan(samples=64, seed=3, **kw, **options)
    assert plan.exact_throughout and plan.santa_from > L_max
    plan.out.view(cupy.uint8).fill(0xFF)
    plan.lse.fill(cupy.nan)
    o = plan.run(qg, kg, vg, lg)
    assert cupy.array_equal(o.view(cupy.uint8), want.view(cupy.uint8))
    assert cupy.array_equal(plan.lse, dense.lse)
    info = plan.info()
    assert info.dense_fallback.get().tolist() == [True]
    assert np.array_equal(info.rows_read.get(), [[L_max - 5] * 2])
    assert (info.key_fraction is not None) == keys and (not keys or bool((info.key_fraction == 1).all()))
    assert_dense_matches(as_float32(o), dense_error_bound(q, k, v, lens, dtype))


def test_stages_alone_take_every_sequence():
    """sample_counts -> run_from_counts on a plan that runs exact ("auto" below its crossover) or
    mixes (santa_min_length=1000): the stages alone run the estimator for every sequence, bit for
    bit a santa-at-every-length plan's (their merge once skipped the sequences shorter than
    santa_from, leaving the output unwritten)."""
    import cupy
    rng = np.random.default_rng(41)
    L_max = 3000
    q, k, v, lens = random_inputs(rng, 2, 8, 2, 128, L_max, [3000, 700], "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    kw = dict(batch=2, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16", samples=64, seed=4)
    santa = make_plan(santa_min_length=0, **kw)
    counts = santa.sample_counts(qg, kg, lg)
    want = santa.run_from_counts(qg, kg, vg, lg, counts).copy()
    for min_length in ("auto", 1000):
        plan = make_plan(santa_min_length=min_length, **kw)
        plan.out.view(cupy.uint8).fill(0xFF)
        got = plan.run_from_counts(qg, kg, vg, lg, counts)
        assert cupy.array_equal(got.view(cupy.uint8), want.view(cupy.uint8)), min_length


def test_dense_fallback_reads_lengths_a_warp_at_a_time():
    """The fallback's blocks first ask one warp whether any sequence is short (32 lengths a round
    trip, common.cuh any_dense_sequence): in a batch of 40 whose only short sequence is the 38th
    (past the first 32) it still runs exact, and in a batch without one every output is santa's."""
    rng = np.random.default_rng(21)
    L_max, B = 600, 40
    kw = dict(batch=B, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16", samples=64, seed=2)
    mixed = make_plan(santa_min_length=500, **kw)
    santa = make_plan(santa_min_length=0, **kw)
    for short in ([37], []):
        lens_list = [300 if i in short else L_max for i in range(B)]
        q, k, v, lens = random_inputs(rng, B, 8, 2, 128, L_max, lens_list, "bfloat16", spike=True)
        qg, kg, vg, lg = to_gpu(q, k, v, lens)
        o = as_float32(mixed.run(qg, kg, vg, lg))
        rows = mixed.rows_read.get()
        assert mixed.info().dense_fallback.get().tolist() == [i in short for i in range(B)]
        long = [i for i in range(B) if i not in short]
        os_ = as_float32(santa.run(qg, kg, vg, lg))
        assert rel_l2(o[long], os_[long]) < 1e-4
        assert np.array_equal(rows[long], santa.rows_read.get()[long])
        if short:                                   # exact: within the dense bound of the float64 reference
            assert_dense_matches(o[short], dense_error_bound(q[short], k[short], v[short], lens[short], "bfloat16"))
            assert np.array_equal(rows[short], np.full((1, 2), 300))


@pytest.mark.parametrize("budget", ["global", "fixed"])
def test_warp_finish_routes_agree(budget):
    """The warp pass 2's two finishes, through atomics (few KV groups) and from block partials
    (many): the same counts and rows read, o and spread up to the order of float additions, for
    the same setting with the route switched (KernelChoice.finish_max_groups); lengths 0 and 1 included."""
    rng = np.random.default_rng(13)
    L_max = 4000
    lens_list = [4000, 0, 1, 2049, 130]
    q, k, v, lens = random_inputs(rng, 5, 8, 2, 128, L_max, lens_list, "bfloat16")
    qg, kg, vg, lg = to_gpu(q, k, v, lens)
    res = []
    for finish in (True, False):                              # 10 groups: atomics up to a cap of 10
        plan = make_plan(batch=5, heads=8, kv_heads=2, head_dim=128, max_length=L_max, dtype="bfloat16",
                         samples=256, budget=budget, tile_kernel="warp", seed=4, santa_min_length=0,
                         finish_max_groups=10 if finish else 0)
        assert plan.atomic_finish == finish
        plan.out.fill(0x7FC0)
        o = as_float32(plan.run(qg, kg, vg, lg))
        res.append((o, plan.rows_read.get().copy(), plan.spread.get().copy(), plan.lse.get().copy()))
    (o1, r1, s1, l1), (o2, r2, s2, l2) = res
    assert np.array_equal(r1, r2)
    assert np.all(np.isfinite(o1)) and rel_l2(o2, o1) < 1e-4
    assert np.allclose(s1, s2, rtol=1e-3, atol=1e-6)
    assert np.allclose(l1[[0, 2, 3, 4]], l2[[0, 2, 3, 4]], rtol=1e-6, atol=1e-6) and np.all(np.isneginf(l2[1]))
    big = make_plan(batch=5, heads=64, kv_heads=8, head_dim=128, max_length=L_max, dtype="bfloat16")
    assert not big.atomic_finish                           # 40 groups > kernel_choice.FINISH_MAX_GROUPS

"""Block key sampling's GPU route on the host, without a GPU (test_plan_host's stand-in cupy and
recording kernels): which kernels a key-sampled plan launches and with which arguments (checked
against the C declarations of cuda/santa_score_keys.cu), and every refusal message of the API."""

import numpy as np
import pytest

import santa_cupy
from santa_cupy import AttentionSetting, DecodePlan, decode_attention, kernels, key_layout
from santa_cupy.kernel_choice import KernelChoice
from tests import test_plan_host
from tests.test_plan_host import FakeArray, launches  # noqa: F401  (the fixture)

B, H, KVH, D, L = 2, 8, 2, 128, 300
KEYS = "systematic/global/S=64/min_length=0/keys=block:FB=16,f=0.5,rule=qrms"   # (min_length: santa at L = 300)


def blocked_inputs(FB=16):
    q, k, v, lengths = test_plan_host._inputs(B=B, H=H, KVH=KVH, D=D, L=L)
    kb = key_layout.to_blocked(np.asarray(k), FB).view(FakeArray)
    return q, kb, v, lengths


def plan(setting=KEYS, **kw):
    return DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=kw.pop("head_dim", D), max_length=L, setting=setting,
                      key_layout=kw.pop("key_layout", "blocked"), **kw)


@pytest.mark.parametrize("budget", ["global", "largest_remainder", "fixed"])
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("score_kernel", ["auto", "stream"])
def test_key_sampled_plan_launches(launches, budget, block_n, score_kernel):
    """santa_key_blocks, santa_score_keys_mma (auto: tensor cores, 4 warps a block of runs) or
    santa_score_keys (stream: a block a run), then the block pass 2 after santa_score (prefix,
    tile reading the stash, merge), for every budget (fixed too: its tile kernel does not score)."""
    q, kb, v, lengths = blocked_inputs()
    setting = AttentionSetting.parse(KEYS).replace(budget=budget, block_n=block_n, key_draws=3,
                                                   key_combine="union")
    p = plan(setting, head_offset=4, _kernels=KernelChoice(score_kernel=score_kernel))
    mma = score_kernel == "auto"
    # after the tensor-core key pass the warp pass 2 (finishing in the kernel: 4 groups), except
    # the fixed budget on this small cache (the block kernel); after the FMA one the block pass 2
    warp = mma and budget != "fixed"
    assert (p.score_kernel, p.two_pass, p.santa_from) == ("mma" if mma else "stream", True, 0)
    assert p.key_pass.score_kernel == p.score_kernel and (p.tile_kernel == "block") == (not warp)
    p.step.fill(5)
    p.run(q, kb, v, lengths, layer=7)
    names = [name for name, *_ in launches]
    assert names == ["santa_key_blocks", "santa_score_keys_mma" if mma else "santa_score_keys", "santa_prefix"] \
        + (["santa_tile_warp"] if warp else ["santa_tile", "santa_merge"])
    blocks, score, _, tile = launches[:4]
    assert blocks[1] == (KVH, B) and blocks[2] == (32,)
    args = blocks[3]
    # (q, H, KVH, D, FB, rule, R, budget, combine, seed, step, layer, kv_offset, ...)
    assert [int(a) for a in args[1:8]] == [H, KVH, D, 16, kernels.KEY_RULE_CODE["qrms"], 3, 0]
    assert float(args[7]) == 0.5 and isinstance(args[7], np.float64)
    assert int(args[8]) == 1 and int(args[11]) == 7 and int(args[12]) == 4 // (H // KVH)
    tpb = p.key_pass.tiles_per_block
    run = tpb * (4 if mma else 1)                       # tiles a block: 4 warps' runs, or the block's
    assert score[1] == (-(-(-(-L // block_n)) // run), KVH, B) and score[3][1] is kb
    assert int(score[3][8]) == tpb
    if mma:                                             # FB: the instance's; the FMA pass's argument
        assert p.key_pass._score is p.key_pass.kernels.score_keys_mma_fb16 and score[3][9] is p.key_pass.key_weight
    else:
        assert int(score[3][9]) == 16
    assert score[3][-2] is p.scores and score[3][-1] is p.part_s
    tile_args = tile[3]
    if warp:                                            # the key pass's stash, every sequence santa
        # santa_from 0, then stash_in_l2 (the stash of this small plan kept in the L2), then the 4 page args
        assert tile_args[14] is p.scores and int(tile_args[-6]) == 0 and int(tile_args[-5]) == p.stash_in_l2 == 1
    else:
        assert int(tile_args[13]) == 0                  # own_scores 0: the stash of santa_score_keys
    info = p.info()
    assert info.key_fraction.shape == (B, KVH) and info.key_fraction.dtype == np.float32


@pytest.mark.parametrize("score_kernel,run", [("stream", 2), ("mma", 8)])
def test_forced_run_length(launches, score_kernel, run):
    """KernelChoice.tiles_per_warp: the tiles of a block's run (stream) or of each warp's (mma)."""
    p = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, setting=KEYS, key_layout="blocked",
                   _kernels=KernelChoice(tiles_per_warp=2, score_kernel=score_kernel))
    p.run(*blocked_inputs())
    score = launches[1]
    assert p.key_pass.tiles_per_block == 2 and int(score[3][8]) == 2 and score[1][0] == -(-(-(-L // 128)) // run)


def test_key_sampled_stage_launchers_and_sample_counts(launches):
    q, kb, v, lengths = blocked_inputs(32)
    p = plan(AttentionSetting.parse(KEYS).replace(key_block=32))
    p.run(q, kb, v, lengths, layer=2)
    full = [name for name, *_ in launches]
    launches.clear()
    for launch in p.stage_launchers(q, kb, v, lengths, layer=2).values():
        launch()
    assert [name for name, *_ in launches] == full
    assert int(launches[0][3][11]) == 2 and int(launches[0][3][4]) == 32
    launches.clear()
    counts = p.sample_counts(q, kb, lengths, layer=2)
    p.run_from_counts(q, kb, v, lengths, counts, layer=2)
    names = [name for name, *_ in launches]
    assert names[:2] == ["santa_key_blocks", "santa_score_keys_mma"] and names.count("santa_key_blocks") == 2
    assert all(int(a[11]) == 2 for name, _, _, a, _ in launches if name == "santa_key_blocks")


def test_gpu_refusals(launches):
    q, kb, v, lengths = blocked_inputs()
    _, k, _, _ = test_plan_host._inputs(B=B, H=H, KVH=KVH, D=D, L=L)
    with pytest.raises(NotImplementedError, match="key_layout='blocked'"):
        plan(key_layout="standard")
    with pytest.raises(ValueError, match="needs key_sampling='bernoulli_block'"):
        plan("systematic/global/S=64")
    with pytest.raises(ValueError, match="no paged form"):
        plan(page_size=16)
    with pytest.raises(NotImplementedError, match="method 'santa'"):
        plan("dense/keys=block:FB=16,f=0.5,rule=qmax")
    with pytest.raises(NotImplementedError, match="key_rule='qkvar'"):
        plan("systematic/global/S=64/keys=block:FB=16,f=0.5")
    with pytest.raises(NotImplementedError, match="'bernoulli_block'"):
        plan("systematic/global/S=64/keys=bernoulli:R=2")
    with pytest.raises(NotImplementedError, match="dtype in"):
        plan(dtype="float32")
    with pytest.raises(ValueError, match="multiple of heads // kv_heads"):
        plan(head_offset=3)
    with pytest.raises(ValueError, match="tile_kernel='warp' needs"):      # the warp pass 2 follows the mma pass
        DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, setting=KEYS, key_layout="blocked",
                   _kernels=KernelChoice(score_kernel="stream", tile_kernel="warp"))
    with pytest.raises(ValueError, match="santa or dense for the whole batch"):    # (no per-sequence fallback)
        plan(AttentionSetting.parse(KEYS).replace(santa_min_length=100))
    with pytest.raises(ValueError, match="key_layout must be one of"):
        plan(key_layout="HND")
    p = plan()
    with pytest.raises(ValueError, match=r"shape \[B, KVH, NP, C, P, FB\]"):
        p.run(q, key_layout.to_blocked(np.asarray(k), 32).view(FakeArray), v, lengths)
    with pytest.raises(ValueError, match="blocked layout"):
        p.run(q, k, v, lengths)
    standard = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, setting="systematic/global/S=64")
    with pytest.raises(ValueError, match="pass key_layout='blocked'"):
        standard.run(q, kb, v, lengths)
    assert not launches


def test_decode_attention_and_key_scores_refusals(launches):
    q, kb, v, lengths = blocked_inputs()
    _, k, _, _ = test_plan_host._inputs(B=B, H=H, KVH=KVH, D=D, L=L)
    santa_cupy.clear_plan_cache()
    with pytest.raises(ValueError, match="pass key_layout='blocked'"):
        decode_attention(q, kb, v, lengths, KEYS)
    with pytest.raises(ValueError, match="needs key_sampling='bernoulli_block'"):
        decode_attention(q, kb, v, lengths, "systematic/global/S=64", key_layout="blocked")
    with pytest.raises(NotImplementedError, match="key_layout='blocked'"):
        decode_attention(q, k, v, lengths, KEYS)
    with pytest.raises(NotImplementedError, match="key_layout='blocked'"):
        santa_cupy.key_scores(q, k, lengths, KEYS)
    with pytest.raises(ValueError, match="float32"):
        santa_cupy.key_scores(q, kb, lengths, KEYS, key_layout="blocked", out_dtype=np.float64)
    assert not launches and not santa_cupy.attention._plans.plans


def test_numpy_inputs_take_the_blocked_layout():
    """On NumPy the blocked K is converted back: the reference's outputs exactly."""
    rs = np.random.default_rng(1)
    q = rs.standard_normal((2, 4, 64)).astype(np.float32)
    k = rs.standard_normal((2, 40, 2, 64)).astype(np.float32)
    v = rs.standard_normal((2, 40, 2, 64)).astype(np.float32)
    lengths = np.array([40, 23])
    name = "systematic/global/S=64/keys=block:FB=32,f=0.5,R=2,rule=qmax"
    kb = key_layout.to_blocked(k, 32)
    o, info = decode_attention(q, k, v, lengths, name, step=3, return_info=True)
    ob, info_b = decode_attention(q, kb, v, lengths, name, step=3, return_info=True, key_layout="blocked")
    assert np.array_equal(o, ob) and np.array_equal(info.key_fraction, info_b.key_fraction)
    s, ks = santa_cupy.key_scores(q, k, lengths, name, step=3)
    sb, ks_b = santa_cupy.key_scores(q, kb, lengths, name, step=3, key_layout="blocked")
    assert sb.shape[-1] == key_layout.blocked_rows(kb.shape) == 64     # the blocked K's whole pages
    assert np.array_equal(s, sb[..., :40]) and np.all(sb[..., 40:] == -np.inf)
    assert np.array_equal(ks.weight, ks_b.weight)
    with pytest.raises(ValueError, match="pass key_layout='blocked'"):
        santa_cupy.key_scores(q, kb, lengths, name)


def test_tiles_per_block_fits_whole_waves():
    from santa_cupy.key_pass import fit_tiles_per_block as tiles_per_block
    assert tiles_per_block(256, 128, 660) == 4       # B=16 32k, 8 KV heads: 12.4 waves of 4-tile runs
    assert tiles_per_block(32, 8, 660) == 1          # a small grid keeps one tile a block
    assert tiles_per_block(1000, 1, 660) == 2        # one long sequence: one wave of 2-tile runs
    assert tiles_per_block(1, 1, 660) == 1
    assert all(1 <= tiles_per_block(t, g, 500) <= 8 for t in (1, 7, 300, 5000) for g in (1, 3, 128))


# ---- dense attention on a blocked K (no key sampling): decode_dense_mma_blocked ----------------

def _same_args(a, b):
    """Two plans' launch arguments alike: arrays of one shape and dtype (each plan has its own
    workspaces), scalars of one type and value."""
    def alike(x, y):
        if isinstance(x, np.ndarray):
            return isinstance(y, np.ndarray) and x.shape == y.shape and x.dtype == y.dtype
        return type(x) is type(y) and x == y
    return len(a) == len(b) and all(alike(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("FB", [16, 32])
@pytest.mark.parametrize("self_merge_max_splits", [32, 0])
def test_dense_plan_on_blocked_keys_launches_the_blocked_kernel(launches, FB, self_merge_max_splits):
    """A dense plan with key_layout="blocked" launches decode_dense_mma_blocked with the standard
    plan's arguments (the blocked K in k's place, key_block FB in the page arguments' place), and
    santa_merge after it exactly when the standard plan does."""
    q, kb, v, lengths = blocked_inputs(FB)
    _, k, _, _ = test_plan_host._inputs(B=B, H=H, KVH=KVH, D=D, L=L)
    choice = KernelChoice(dense_splits=5, self_merge_max_splits=self_merge_max_splits)
    p = plan("dense", key_block=FB, _kernels=choice)
    assert (p.key_layout, p.key_block, p.dense_kernel) == ("blocked", FB, "mma")
    p.run(q, kb, v, lengths)
    blocked = list(launches)
    launches.clear()
    DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, setting="dense", _kernels=choice).run(
        q, k, v, lengths)
    standard = list(launches)
    assert [n for n, *_ in blocked] == ["decode_dense_mma_blocked"] + ["santa_merge"] * (not self_merge_max_splits)
    assert [n for n, *_ in standard] == ["decode_dense_mma"] + ["santa_merge"] * (not self_merge_max_splits)
    (_, grid, block, args, smem), (_, grid_s, block_s, args_s, smem_s) = blocked[0], standard[0]
    assert (grid, block, smem) == (grid_s, block_s, smem_s)
    assert args[1] is kb and args[0] is q and args[2] is v
    assert _same_args(args[3:-1], args_s[3:-4])            # all but K and the layout's last arguments
    assert type(args[-1]) is np.int32 and int(args[-1]) == FB
    for (_, *rest), (_, *rest_s) in zip(blocked[1:], standard[1:]):      # the merge: the same launch
        assert rest[:2] == rest_s[:2] and rest[3] == rest_s[3] and _same_args(rest[2], rest_s[2])
    launches.clear()
    stages = p.stage_launchers(q, kb, v, lengths)
    for launch in stages.values():
        launch()
    assert [n for n, *_ in launches] == [n for n, *_ in blocked]


def test_dense_plan_on_blocked_keys_refusals(launches):
    q, kb, v, lengths = blocked_inputs(16)
    _, k, _, _ = test_plan_host._inputs(B=B, H=H, KVH=KVH, D=D, L=L)
    for kw in (dict(dtype="float32"), dict(head_dim=256), dict(head_dim=256, dtype="float16"),
               dict(_kernels=KernelChoice(dense_kernel="stream"))):
        with pytest.raises(ValueError, match="tensor-core kernel only"):
            plan("dense", **kw)
    with pytest.raises(ValueError, match="no paged form"):
        plan("dense", page_size=16)
    with pytest.raises(ValueError, match="method 'dense'"):
        plan("systematic/global/S=64")
    p = plan("dense")                                       # key_block 16
    with pytest.raises(ValueError, match=r"FB = key_block 16"):
        p.run(q, key_layout.to_blocked(np.asarray(k), 32).view(FakeArray), v, lengths)
    with pytest.raises(ValueError, match="blocked layout"):
        p.run(q, k, v, lengths)
    with pytest.raises(TypeError, match="dtype"):
        p.run(q, kb.astype(np.float16).view(FakeArray), v, lengths)
    with pytest.raises(ValueError, match="C-contiguous"):
        p.run(q, np.asfortranarray(np.asarray(kb)).view(FakeArray), v, lengths)
    dense = DecodePlan(batch=B, heads=H, kv_heads=KVH, head_dim=D, max_length=L, setting="dense")
    with pytest.raises(ValueError, match="pass key_layout='blocked'"):
        dense.run(q, kb, v, lengths)
    santa_cupy.clear_plan_cache()
    with pytest.raises(ValueError, match="method 'dense' without key sampling"):
        decode_attention(q, kb, v, lengths, "systematic/global/S=64", key_layout="blocked")
    with pytest.raises(ValueError, match="method 'dense' without key sampling"):
        decode_attention(q, kb, v, lengths, "dense/keys=bernoulli:R=2", key_layout="blocked")
    with pytest.raises(ValueError, match="no paged form"):
        decode_attention(q, kb, v, lengths, "dense", key_layout="blocked", block_table=np.zeros((B, 1), np.int32))
    assert not launches and not santa_cupy.attention._plans.plans


@pytest.mark.parametrize("FB", [16, 32])
def test_numpy_dense_on_a_blocked_key_is_the_reference(FB):
    """NumPy inputs: dense on a blocked K (its FB from the array) is the reference on the standard
    K, bit for bit; santa without key sampling refuses the blocked layout."""
    rs = np.random.default_rng(FB)
    q = rs.standard_normal((3, 4, 64)).astype(np.float32)
    k = rs.standard_normal((3, 37, 2, 64)).astype(np.float32)
    v = rs.standard_normal((3, 37, 2, 64)).astype(np.float32)
    lengths = np.array([37, 1, 20])
    o, info = decode_attention(q, k, v, lengths, "dense", return_info=True)
    ob, info_b = decode_attention(q, key_layout.to_blocked(k, FB), v, lengths, "dense", return_info=True,
                                  key_layout="blocked")
    assert np.array_equal(o, ob) and np.array_equal(info.lse, info_b.lse)
    with pytest.raises(ValueError, match="method 'dense' without key sampling"):
        decode_attention(q, key_layout.to_blocked(k, FB), v, lengths, "systematic/global/S=8", key_layout="blocked")


def test_balanced_tiles_per_warp():
    """santa_score_keys_mma's runs: the one-wave fit shortened to KEY_RUN_WAVES waves of blocks
    (B=16 32k on 132 SMs x 4 blocks: 16 -> 4 tiles a warp), never longer than the fit, at least 1."""
    from santa_cupy.key_pass import KEY_RUN_WAVES, balanced_tiles_per_warp
    slots = 132 * 4
    assert kernels.tiles_per_warp(256, 128, slots) == 16 and balanced_tiles_per_warp(256, 128, slots) == 4
    assert balanced_tiles_per_warp(1024, 128, slots) == 16        # 128k: the fit already fills 4 waves
    assert balanced_tiles_per_warp(256, 8, slots) == 1 and balanced_tiles_per_warp(3, 2, slots) == 1
    assert balanced_tiles_per_warp(256, 128, slots, waves=1) == 16 and KEY_RUN_WAVES == 4


@pytest.mark.parametrize("FB", [16, 32])
def test_score_instance_per_key_block(launches, FB):
    """The key pass launches santa_score_keys_mma's instance for its key block (the launch checked
    against the C declaration like every other); the FMA pass (stream) takes FB as an argument."""
    q, kb, v, lengths = blocked_inputs(FB)
    setting = AttentionSetting.parse(KEYS).replace(key_block=FB)
    p = plan(setting)
    assert p.key_pass._score is getattr(p.key_pass.kernels, f"score_keys_mma_fb{FB}")
    p.run(q, kb, v, lengths, layer=0)
    assert [name for name, *_ in launches][:2] == ["santa_key_blocks", "santa_score_keys_mma"]
    stream = plan(setting, _kernels=KernelChoice(score_kernel="stream"))
    assert stream.key_pass._score is stream.key_pass.kernels.score_keys
    before = len(launches)
    stream.run(q, kb, v, lengths, layer=0)
    assert [name for name, *_ in launches][before:before + 2] == ["santa_key_blocks", "santa_score_keys"]

"""Score-stage (key) sampling: unbiased estimates of the scaled scores s_j = scale * <q_h, K_j>
that read only part of K (Bernoulli qK^T, the paper's score-stage sampling). float64 NumPy reference.

Public entry points: an AttentionSetting with key_sampling "bernoulli" | "bernoulli_block" (name part
``/keys=...``, santa_cupy/setting.py) in ``santa_cupy.decode_attention`` on NumPy inputs (which runs
key_sampled_attention below), ``santa_cupy.key_scores`` (key_scores below, float32 by default) and
llama_min's CPU decoder. The GPU runs "bernoulli_block" (rules uniform | qmax | qrms) on a
feature-blocked K (santa_cupy/key_layout.py, santa_cupy/key_pass.py, cuda/santa_score_keys.cu):
the same pi, masks and weights as this reference, bit for bit, scores in float32.

Shapes: B sequences, H query heads, KVH KV heads, G = H // KVH heads per group (head h reads KV
head h // G), D head dim, L_max cache rows, R draws, FB features per block, C = D // FB blocks.

Estimators (``key_sampling``):

* ``"none"``: exact scores (reference.head_scores); every K byte is read.
* ``"bernoulli"`` (the paper's stochastic ternary query): per head ``alpha = max_i |q_i|``,
  ``p_i = |q_i| / alpha``, draw r includes feature i when ``u_{r,i} < p_i`` and uses
  ``q_hat_{r,i} = alpha * sign(q_i) * [u_{r,i} < p_i]``, so ``E[q_hat] = q``. The R draws are
  combined by ``key_combine``:
    - ``"mean"`` (paper): ``q_bar = (1/R) sum_r q_hat_r``;
    - ``"union"``: Horvitz-Thompson on the union of the draws, ``q_bar_i = q_i * [any draw
      includes i] / (1 - (1 - p_i)**R)``. This is the Rao-Blackwellisation of "mean" given which
      features were read: the same bytes, never more variance.
  ``key_crn=True`` gives the heads of a KV group common random numbers (one uniform per (r, i)
  shared by the group), so the group's union of features is the one of its largest p_i.
  K is only read in whole 32-byte sectors (``sector_features`` features, 16 for 2-byte storage):
  the fraction read is the fraction of sectors in which any head of the group, in any draw,
  selected a feature. The mask is the same for every position j.
* ``"bernoulli_block"``: blocks c of FB = ``key_block`` contiguous features; per KV group and draw
  one decision per block, ``I_{r,c} = [u_{r,c} < pi_c]``, shared by the whole group, with ``pi_c``
  from the group's block magnitudes (``block_probabilities``). Every head's block contribution
  ``q_h[c] . K_j[c]`` is weighted by Horvitz-Thompson: ``(1/R) sum_r I_{r,c} / pi_c`` ("mean") or
  ``[any_r I_{r,c}] / (1 - (1 - pi_c)**R)`` ("union"), so each head's score is unbiased. The
  fraction of K read is (blocks selected by any draw) / C.

Inclusion probabilities of the block estimator, ``pi_c = min(1, lam * w_c)`` with ``lam`` chosen
(float64; in closed form for one draw, by bisection for R > 1) so that the expected fraction of
blocks read, mean_c 1 - (1 - pi_c)**R, equals ``key_budget`` (or every block with w_c > 0 is taken
when the budget exceeds them). Rules for the block weight w_c of a group (``key_rule``):

    "uniform": 1                      (a control: every block pi = budget)
    "qmax":    max_h ||q_h[c]||_2
    "qrms":    sqrt(sum_h ||q_h[c]||_2^2)
    "qkvar":   sqrt(sum_h sum_{i in c} q_{h,i}^2 var_j(K_{j,i}))   (var over the valid positions)

"qkvar" is the minimiser of the HT variance of the position-centred scores under a diagonal model
of K: a constant shift of all of a head's scores leaves softmax unchanged, so only the spread of
q[c] . K_j[c] over j matters. A kernel would keep sum_j K_j and sum_j K_j^2 per (b, kv head,
feature) next to the cache (updated on append) instead of reading K for it.

Variance target (``key_variance``, "qkvar" only, replaces ``key_budget``): under the same model the
group's score variance is ``V = scale^2 sum_c w_c^2 v(pi_c)`` with v = (1/pi - 1)/R ("mean") or
1/(1 - (1 - pi)^R) - 1 ("union"); the fewest blocks read for V = G * key_variance (nats^2 per
head) is again pi_c = min(1, lam * w_c), now with lam set by that target
(``block_probabilities_for_variance``). Each group then reads what its own spread needs: layers
and heads whose blocks all matter read more, the others less.

Random numbers: rng.key_sampling_uniform (stream KEY_SAMPLING_TILE); per-head streams use unit=h,
group streams unit = rng.GROUP_UNIT | g. p_i is float32: ``float32(|q_i|) / float32(alpha)`` with q
rounded to float32 first; pi is rounded to float32 before the comparison and the 1/pi weight. A
kernel that uses the same float32 p (IEEE division) and the same float32 pi gets bit-identical masks.
For that the block probabilities are float64 arithmetic in one explicit order (the GPU kernel,
cuda/santa_score_keys.cu, follows it): ||q_h[c]||^2 sums the FB squares in feature order, "qrms"
sums those over the G heads in head order; the read fraction sums its C terms in block order and
divides by C; (1 - pi)^R is square-and-multiply (_int_power), never libm's pow; the bisection's
mid = 0.5 * (lo + hi), one draw's closed form (_one_draw_lam) and min(1, lam * w_c) are single
IEEE operations in a stated order.
(``u`` lies on the 2**-24 grid, so P(u < p) = ceil(p * 2**24) / 2**24: a bias below 6e-8 relative.)
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np

from santa_cupy import reference as ref
from santa_cupy import rng, spec

F32 = np.float32
F64 = np.float64

KEY_SAMPLINGS = spec.KEY_SAMPLINGS        # the option values live in spec (AttentionSetting checks them too)
KEY_BLOCKS = spec.KEY_BLOCKS
KEY_RULES = spec.KEY_RULES
KEY_COMBINES = spec.KEY_COMBINES
MAX_KEY_DRAWS = spec.MAX_KEY_DRAWS
VALUE_STAGES = ("dense", "santa")

__all__ = [
    "KEY_SAMPLINGS", "KEY_BLOCKS", "KEY_RULES", "KEY_COMBINES", "KeySamplingInfo", "key_scores",
    "bernoulli_uniforms", "block_uniforms", "key_feature_variance", "block_weights", "block_probabilities",
    "block_probabilities_for_variance", "expected_sector_fraction", "key_sampled_attention",
]


@dataclass(frozen=True)
class KeySamplingInfo:
    """What one key_scores call read.

    key_fraction: float, fraction of the K bytes of the valid rows that are read (groups weighted
        by their sequence's length).
    group_fraction [B, KVH] float64: fraction of the pieces (sectors or blocks) of a K row read.
    expected_group_fraction [B, KVH] float64: its expectation over the random numbers.
    read [B, KVH, P] bool: which of the P pieces of a K row are read (P = D / sector_features for
        "bernoulli", C for "bernoulli_block", one piece for "none").
    feature_fraction [B, KVH] float64: fraction of features used by any head of the group.
    selected: "bernoulli": [B, H, R, D] bool (draw r of head h includes feature i);
        "bernoulli_block": [B, KVH, R, C] bool; "none": None.
    prob: "bernoulli": p [B, H, D] float32; "bernoulli_block": pi [B, KVH, C] float32; else None.
    weight: "bernoulli_block": the Horvitz-Thompson weight of each block [B, KVH, C] (float64 here,
        float32 from the GPU; 0 for a block no draw read); else None.
    """

    key_fraction: float
    group_fraction: np.ndarray
    expected_group_fraction: np.ndarray
    read: np.ndarray
    feature_fraction: np.ndarray
    selected: np.ndarray | None = None
    prob: np.ndarray | None = None
    weight: np.ndarray | None = None


# ------------------------------------------------------------------------------ validation


def _check_int(name, value, lo, hi):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {int(value)}")


def _check_options(key_sampling, key_draws, key_block, key_budget, key_rule, key_combine, D, key_variance=None):
    """spec.check_key_options, then D a multiple of key_block."""
    spec.check_key_options(key_sampling, key_draws, key_block, key_budget, key_rule, key_combine, key_variance)
    if D % int(key_block):
        raise ValueError(f"head dim D={D} must be a multiple of key_block={key_block}")


def _validate(q, k_cache, lengths, scale, seed, step, layer):
    """Shapes / dtypes / lengths through spec (the K cache stands in for V) -> DecodeShape."""
    shape = spec.validate_decode_inputs(q, k_cache, k_cache, lengths, scale=scale)
    if spec.is_cupy_array(q):
        raise ValueError("key_scores is the NumPy reference: pass NumPy arrays")
    _check_int("seed", seed, 0, 2**64 - 1)
    _check_int("step", step, 0, 2**63 - 1)
    _check_int("layer", layer, 0, 2**32 - 1)
    return shape


# ------------------------------------------------------------------------------ random numbers


def bernoulli_uniforms(B, H, KVH, R, D, *, crn, seed, step, layer):
    """Uniforms [B, H, R, D] float32 of the per-feature estimator; with crn the G heads of a group
    get the same values (the group stream), else each head its own stream."""
    b = np.arange(B)[:, None, None, None]
    r = np.arange(R)[None, None, :, None]
    i = np.arange(D)[None, None, None, :]
    if crn:
        unit = (rng.GROUP_UNIT | np.arange(KVH))[None, :, None, None]
        u = rng.key_sampling_uniform(seed, step, layer, b, unit, r, i)  # [B, KVH, R, D]
        return np.repeat(u, H // KVH, axis=1)
    unit = np.arange(H)[None, :, None, None]
    return rng.key_sampling_uniform(seed, step, layer, b, unit, r, i)


def block_uniforms(B, KVH, R, C, *, seed, step, layer):
    """Uniforms [B, KVH, R, C] float32 of the block estimator (one per group, draw and block)."""
    b = np.arange(B)[:, None, None, None]
    unit = (rng.GROUP_UNIT | np.arange(KVH))[None, :, None, None]
    r = np.arange(R)[None, None, :, None]
    c = np.arange(C)[None, None, None, :]
    return rng.key_sampling_uniform(seed, step, layer, b, unit, r, c)


# ---------------------------------------------------------------------- block probabilities


def key_feature_variance(k_cache, lengths):
    """var_j K_{j,i} over the valid rows j < lengths[b]: [B, KVH, D] float64 (what "qkvar" needs)."""
    return np.stack([ref.to_float64(k_cache[b, : int(n)]).var(axis=0) for b, n in enumerate(lengths)])


def block_weights(q, kv_heads, key_block, rule, k_var=None):
    """Block weights w [B, KVH, C] float64 of one rule; q [B, H, D] (any float / bf16 dtype), its
    heads grouped G = H // kv_heads at a time; k_var [B, KVH, D] (key_feature_variance) for
    "qkvar"."""
    qf = ref.to_float64(q)
    B, H, D = qf.shape
    KVH = int(kv_heads)
    C = D // key_block
    qb = qf.reshape(B, KVH, H // KVH, C, key_block)  # [B, KVH, G, C, FB]
    if rule == "uniform":
        return np.ones((B, KVH, C))
    if rule == "qmax":
        return np.sqrt(_block_sq_norms(qb).max(axis=2))  # = max_h of the norms (sqrt is monotone)
    if rule == "qrms":
        return np.sqrt(_sum_in_order(_block_sq_norms(qb), axis=2))
    if rule == "qkvar":
        if k_var is None:
            raise ValueError('key_rule="qkvar" needs k_var [B, KVH, D]')
        kv = k_var.reshape(B, KVH, 1, C, key_block)
        return np.sqrt((qb * qb * kv).sum(axis=(2, 4)))
    raise ValueError(f"key_rule must be one of {KEY_RULES}, got {rule!r}")


def _sum_in_order(x, axis):
    """float64 sum over ``axis`` taken one term after the other in index order (NumPy's own sum
    is pairwise, in an order that depends on the memory layout): an order a kernel repeats."""
    x = np.moveaxis(np.asarray(x, dtype=F64), axis, -1)
    total = np.zeros(x.shape[:-1])
    for i in range(x.shape[-1]):
        total = total + x[..., i]
    return total


def _block_sq_norms(qb):
    """||q_h[c]||^2 [B, KVH, G, C] float64 of qb [B, KVH, G, C, FB]: the FB squares summed in
    feature order."""
    return _sum_in_order(qb * qb, axis=-1)


def _int_power(x, R):
    """x**R (float64, R >= 1 an int) by square-and-multiply from the lowest bit of R, the result
    starting at the first set bit: IEEE multiplications in an order a kernel repeats (NumPy's
    ``**`` calls libm's pow, which a GPU does not reproduce bit for bit)."""
    x = np.asarray(x, dtype=F64)
    result, base, r = None, x, int(R)
    while r:
        if r & 1:
            result = base if result is None else result * base
        r >>= 1
        if r:
            base = base * base
    return result


def _read_fraction(pi, R):
    """Expected fraction of blocks read by R independent draws: (1 / C) sum_c 1 - (1 - pi_c)^R,
    summed over c in order, the power by _int_power (the kernel's order: cuda/santa_score_keys.cu)."""
    return _sum_in_order(1.0 - _int_power(1.0 - pi, R), axis=-1) / pi.shape[-1]


def block_probabilities(w, budget, R=1, iterations=80):
    """Per-draw inclusion probabilities pi [..., C] float32: pi_c = min(1, lam * w_c) with lam [...]
    so that mean_c 1 - (1 - pi_c)^R = budget (all blocks with w_c > 0 get pi = 1 when that is not
    enough): in closed form for one draw (_one_draw_lam), by bisection (``iterations`` steps) for
    R > 1. Blocks with w_c = 0 have pi = 0: all their contributions are zero."""
    w = np.asarray(w, dtype=F64)
    positive = w > 0
    w_min = np.where(positive, w, np.inf).min(axis=-1, keepdims=True)  # [..., 1]
    lam_hi = np.where(np.isfinite(w_min), 1.0 / w_min, 0.0)  # every positive block at pi = 1
    pi_hi = np.minimum(1.0, lam_hi * w)
    reachable = _read_fraction(pi_hi, R) > budget  # else take every positive block
    if R == 1:
        lam = _one_draw_lam(w, budget)
    else:
        lo, lam = np.zeros_like(lam_hi), lam_hi
        for _ in range(iterations):
            mid = 0.5 * (lo + lam)
            over = _read_fraction(np.minimum(1.0, mid * w), R)[..., None] > budget
            lam, lo = np.where(over, mid, lam), np.where(over, lo, mid)
    pi = np.where(reachable[..., None], np.minimum(1.0, lam * w), pi_hi)
    return pi.astype(F32)


def _one_draw_lam(w, budget):
    """lam [..., 1] float64 with mean_c min(1, lam w_c) = budget (one draw), where that is
    reachable (fewer than C * budget blocks have w_c > 0 otherwise: block_probabilities then takes
    them all). Water-filling: with the weights sorted descending, ws_0 >= ws_1 >= ..., and the k
    largest capped at pi = 1, lam_k = (C budget - k) / tail_k, tail_k = ws_k + ... + ws_{C-1}
    summed from the smallest; the answer is the first k with lam_k ws_k <= 1 (then
    lam_k ws_{k-1} > 1: the k capped blocks are indeed capped). IEEE operations in the order
    santa_key_blocks repeats (cuda/santa_score_keys.cu, key_one_draw_lam): C budget is exact (C a
    power of two), tail sequential, one division and one product per k."""
    C = w.shape[-1]
    ws = -np.sort(-w, axis=-1)  # descending
    tail = np.cumsum(ws[..., ::-1], axis=-1)[..., ::-1]  # sequential sums from ws_{C-1}
    k = np.arange(C, dtype=F64)
    lam_k = (C * float(budget) - k) / np.where(ws > 0, tail, 1.0)
    ok = (ws > 0) & (lam_k * ws <= 1.0)
    first = np.argmax(ok, axis=-1)[..., None]  # no k at all only where unreachable (not used)
    return np.take_along_axis(lam_k, first, axis=-1)


def _block_variance(pi, A, R, combine):
    """Model variance sum_c A_c v(pi_c) (module docstring); blocks with A_c = 0 add nothing."""
    pi = np.where(A > 0, pi, 1.0)
    v = (1.0 / pi - 1.0) / R if combine == "mean" else 1.0 / (1.0 - (1.0 - pi) ** R) - 1.0
    return (A * v).sum(axis=-1)


def block_probabilities_for_variance(w, target, R=1, combine="mean", iterations=100):
    """pi [..., C] float32 = min(1, lam * w_c) with lam [...] the smallest (bisection on log lam) for
    which sum_c w_c^2 v(pi_c) <= target [...] (w already in score units, e.g. scale * qkvar
    weights). Blocks with w_c = 0 get pi = 0."""
    w = np.asarray(w, dtype=F64)
    A = w * w
    target = np.broadcast_to(np.asarray(target, dtype=F64), w.shape[:-1])
    positive = w > 0
    w_min = np.where(positive, w, np.inf).min(axis=-1, keepdims=True)
    hi = np.where(np.isfinite(w_min), np.log(1.0 / np.where(np.isfinite(w_min), w_min, 1.0)), 0.0)  # pi = 1
    lo = hi - 60.0  # pi ~ 1e-26 * w / w_min: far above any target
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        ok = _block_variance(np.minimum(1.0, np.exp(mid) * w), A, R, combine)[..., None] <= target[..., None]
        hi, lo = np.where(ok, mid, hi), np.where(ok, lo, mid)
    return np.minimum(1.0, np.exp(hi) * w).astype(F32)


def expected_sector_fraction(p, G, R, crn, sector_features):
    """Expected fraction of sectors read by the per-feature estimator: p [B, H, D] float32 ->
    [B, KVH] float64. A feature is missed by the group with probability prod_h (1 - p_h)^R
    (independent heads) or (1 - max_h p_h)^R (common random numbers); features are independent."""
    B, H, D = p.shape
    pg = p.astype(F64).reshape(B, H // G, G, D)
    missed = (1.0 - pg.max(axis=2)) ** R if crn else ((1.0 - pg) ** R).prod(axis=2)  # [B, KVH, D]
    sector_missed = missed.reshape(B, H // G, D // sector_features, sector_features).prod(axis=-1)
    return 1.0 - sector_missed.mean(axis=-1)


# ----------------------------------------------------------------------------- estimators


def _scores_from_query(q_bar, k_cache, lengths, scale):
    """scale * q_bar . K_j for q_bar [B, H, D] float64 -> [B, H, L_max], -inf past lengths."""
    return ref.head_scores(q_bar, ref.to_float64(k_cache), lengths, scale)


def _bernoulli(q, G, R, crn, combine, sector_features, seed, step, layer):
    """-> (q_bar [B, H, D] float64, selected [B, H, R, D], p [B, H, D] f32, read [B, KVH, P],
    feature_used [B, KVH, D], expected [B, KVH])."""
    B, H, D = q.shape
    q32 = spec.to_float32(q, np)
    a32 = np.abs(q32)
    alpha = a32.max(axis=-1, keepdims=True)  # [B, H, 1]
    p = np.where(alpha > 0, a32 / np.where(alpha > 0, alpha, F32(1)), F32(0)).astype(F32)
    u = bernoulli_uniforms(B, H, H // G, R, D, crn=crn, seed=seed, step=step, layer=layer)
    selected = u < p[:, :, None, :]  # [B, H, R, D]
    qf = ref.to_float64(q32)
    if combine == "mean":
        q_bar = alpha.astype(F64) * np.sign(qf) * selected.mean(axis=2)
    else:
        p_union = 1.0 - (1.0 - p.astype(F64)) ** R
        q_bar = np.where(selected.any(axis=2), qf / np.where(p_union > 0, p_union, 1.0), 0.0)
    feature_used = selected.any(axis=2).reshape(B, H // G, G, D).any(axis=2)  # [B, KVH, D]
    read = feature_used.reshape(B, H // G, D // sector_features, sector_features).any(axis=-1)
    expected = expected_sector_fraction(p, G, R, crn, sector_features)
    return q_bar, selected, p, read, feature_used, expected


def _bernoulli_block(q, k_cache, lengths, G, R, FB, budget, variance, rule, combine, k_var, scale, seed, step,
                     layer):
    """-> (q_bar [B, H, D] float64, selected [B, KVH, R, C], pi [B, KVH, C] f32, read [B, KVH, C],
    expected [B, KVH], weight [B, KVH, C] float64: each block's Horvitz-Thompson weight)."""
    B, H, D = q.shape
    KVH, C = H // G, D // FB
    if rule == "qkvar" and k_var is None:
        k_var = key_feature_variance(k_cache, lengths)
    w = block_weights(q, KVH, FB, rule, k_var)  # [B, KVH, C]
    if variance is None:
        pi = block_probabilities(w, budget, R)  # [B, KVH, C] f32
    else:
        pi = block_probabilities_for_variance(scale * w, G * variance, R, combine)
    u = block_uniforms(B, KVH, R, C, seed=seed, step=step, layer=layer)
    selected = u < pi[:, :, None, :]  # [B, KVH, R, C]
    pi64 = pi.astype(F64)
    safe = np.where(pi64 > 0, pi64, 1.0)
    if combine == "mean":
        weight = selected.mean(axis=2) / safe  # [B, KVH, C]
    else:
        p_union = 1.0 - _int_power(1.0 - pi64, R)
        weight = selected.any(axis=2) / np.where(p_union > 0, p_union, 1.0)
    qf = ref.to_float64(q).reshape(B, KVH, G, C, FB)
    q_bar = (qf * weight[:, :, None, :, None]).reshape(B, H, D)
    read = selected.any(axis=2)
    return q_bar, selected, pi, read, _read_fraction(pi64, R), weight


def key_scores(
    q,
    k_cache,
    lengths,
    *,
    key_sampling="bernoulli_block",
    key_draws=1,
    key_block=16,
    key_budget=0.75,
    key_variance=None,
    key_rule="qkvar",
    key_combine="mean",
    key_crn=True,
    sector_features=16,
    k_var=None,
    seed=0,
    step=0,
    layer=0,
    scale=None,
    out_dtype=np.float32,
):
    """Estimated scaled scores [B, H, L_max] (``out_dtype``, float32 or float64; -inf at positions
    >= lengths[b]) and a KeySamplingInfo.

    q [B, H, D]; k_cache [B, L_max, KVH, D] C-contiguous; lengths [B] in 1..L_max; the dtypes of
    santa_cupy (float16, bfloat16 as uint16, float32, float64). ``key_sampling``, ``key_draws`` (R),
    ``key_combine``, ``key_crn`` (per-feature only), ``key_block`` (FB, 16 | 32), ``key_budget``
    (expected fraction of blocks read, in (0, 1]), ``key_variance`` (None, or a target score
    variance in nats^2 per head that replaces key_budget; key_rule "qkvar" only) and ``key_rule`` as
    in the module docstring.
    ``sector_features``: features per 32-byte sector for the per-feature estimator's byte count
    (16: the GPU's 2-byte storage). ``k_var`` [B, KVH, D]: the per-feature variance of K over the
    valid rows for key_rule="qkvar" (None: computed from k_cache, key_feature_variance; a kernel
    would keep running sums of K and K^2 on append instead of reading K for it).
    Random numbers from (seed, step, layer, b, group or head).
    """
    shape = _validate(q, k_cache, lengths, scale, seed, step, layer)
    B, KVH, G, D = shape.B, shape.KVH, shape.G, shape.D
    _check_options(key_sampling, key_draws, key_block, key_budget, key_rule, key_combine, D, key_variance)
    if key_variance is not None:
        key_variance = float(key_variance)
    if not isinstance(key_crn, (bool, np.bool_)):
        raise ValueError(f"key_crn must be a bool, got {key_crn!r}")
    _check_int("sector_features", sector_features, 1, D)
    if D % int(sector_features):
        raise ValueError(f"head dim D={D} must be a multiple of sector_features={sector_features}")
    if np.dtype(out_dtype) not in (np.dtype(F32), np.dtype(F64)):
        raise ValueError(f"out_dtype must be float32 or float64, got {out_dtype!r}")
    if k_var is not None and np.shape(k_var) != (B, KVH, D):
        raise ValueError(f"k_var must have shape (B, KVH, D) = {(B, KVH, D)}, got {np.shape(k_var)}")
    R, FB = int(key_draws), int(key_block)
    selected = prob = weight = None
    if key_sampling == "none":
        q_bar = ref.to_float64(q)
        read = np.ones((B, KVH, 1), dtype=bool)
        feature_used = np.ones((B, KVH, D), dtype=bool)
        expected = np.ones((B, KVH))
    elif key_sampling == "bernoulli":
        q_bar, selected, prob, read, feature_used, expected = _bernoulli(
            q, G, R, bool(key_crn), key_combine, int(sector_features), seed, step, layer
        )
    else:
        q_bar, selected, prob, read, expected, weight = _bernoulli_block(
            q, k_cache, lengths, G, R, FB, float(key_budget), key_variance, key_rule, key_combine, k_var,
            shape.scale, seed, step, layer
        )
        feature_used = np.repeat(read, FB, axis=-1)
    scores = _scores_from_query(q_bar, k_cache, lengths, shape.scale).astype(out_dtype)
    group_fraction = read.mean(axis=-1)
    n = np.asarray(lengths, dtype=F64).reshape(B, 1)
    info = KeySamplingInfo(
        key_fraction=float((group_fraction * n).sum() / (n.sum() * KVH)),
        group_fraction=group_fraction,
        expected_group_fraction=expected,
        read=read,
        feature_fraction=feature_used.mean(axis=-1),
        selected=selected,
        prob=prob,
        weight=weight,
    )
    return scores, info


# ------------------------------------------------------------------------------ attention


def key_sampled_attention(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    value="dense",
    samples=256,
    sampler="systematic",
    budget="global",
    block_n=spec.DEFAULT_BLOCK_N,
    seed=0,
    step=0,
    layer=0,
    scale=None,
    return_spread=False,
    **key_options,
):
    """Decode attention on estimated scores (reference): o [B, H, D] float64, lse [B, H] float64 of
    the estimated scores, KeySamplingInfo, and the SANTA counts [B, H, L_max] (None for dense);
    with ``return_spread`` also the value stage's spread [B, H] float64 (the estimated standard
    error of o given the scores, RMS over D, as reference.santa_attention's; zeros for dense).

    ``key_options`` go to key_scores (key_sampling, key_draws, key_block, key_budget, key_variance, key_rule,
    key_combine, key_crn, sector_features, k_var). ``value`` "dense": o = softmax(s_hat) V exactly;
    "santa": the reference SANTA value stage (samples / sampler / budget / block_n) on s_hat, with
    the value-sampling keys of reference.santa_attention (rng.head_key streams, independent of the
    key-sampling stream). With key_sampling="none" both equal the reference's dense / SANTA output.
    """
    spec.check_choice("value", value, VALUE_STAGES)
    spec.validate_decode_inputs(q, k_cache, v_cache, lengths, samples=samples, sampler=sampler,
                                budget=budget, scale=scale, block_n=block_n)
    s, info = key_scores(q, k_cache, lengths, seed=seed, step=step, layer=layer, scale=scale,
                         out_dtype=F64, **key_options)
    B, H, D = q.shape
    KVH = k_cache.shape[2]
    G = H // KVH
    v = ref.to_float64(v_cache)
    o = np.zeros((B, H, D))
    lse = np.zeros((B, H))
    counts = None if value == "dense" else np.zeros(s.shape, dtype=np.int32)
    spread = np.zeros((B, H))
    for b in range(B):
        n = int(lengths[b])
        sb = s[b, :, :n]  # [H, n]
        vb = v[b, :n].transpose(1, 0, 2)[:, None]  # [KVH, 1, n, D]
        m = sb.max(axis=-1, keepdims=True)
        e = np.exp(sb - m)
        lse[b] = (m + np.log(e.sum(axis=-1, keepdims=True)))[:, 0]
        if value == "dense":
            p = (e / e.sum(axis=-1, keepdims=True)).reshape(KVH, G, 1, n)
            o[b] = (p @ vb)[:, :, 0].reshape(H, D)
            continue
        keys = rng.head_key(seed, step, layer, b, np.arange(H))
        c = ref.counts_from_scores(sb, keys, n, samples=samples, sampler=sampler, budget=budget, block_n=block_n)
        counts[b, :, :n] = c
        ob, sp = ref.estimate(c.reshape(KVH, G, n), sb.reshape(KVH, G, n), vb, samples=samples, budget=budget,
                              block_n=block_n)
        o[b] = ob.reshape(H, D)
        spread[b] = np.asarray(sp).reshape(H)
    return (o, lse, info, counts, spread) if return_spread else (o, lse, info, counts)

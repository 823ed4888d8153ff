"""The next token from the logits: greedy, temperature, top-k, top-p, repetition penalty.

One algorithm, two implementations that choose the same token bit for bit: the CUDA kernel
(cuda/sample_tokens.cu, through llama_min.ops.sample_tokens, the last launch of GraphDecoder's
captured step) and the NumPy reference below (sample_reference: the CPU decoder's sampler, and
the kernel's test oracle). TokenSampler runs the one that fits the array module.

The contract, for the float32 logits l [V] of sequence b (V < 2^24):

1. Repetition penalty p (float32): where seen[b, i], l_i <- l_i / p if l_i > 0 else l_i * p
   (float32 division / product, rounded).
2. Greedy (greedy, or temperature 0 or below 1 / float32 max, or top_k 1): the index of the largest
   l_i, ties to the lowest.
3. Else z_i = l_i * inv_t (inv_t = float32(1 / temperature); the product rounded to float32).
   Order: z descending, ties by index ascending (z compared as the float32 order key of z + 0,
   so -0 = +0). z_max = z of the first element in that order.
4. Weights (integers): w_i = 2^40 where z_i == z_max, else floor(exp32(z_i - z_max) * 2^40) where
   z_i - z_max >= -80, else 0. exp32 is a fixed float32 recipe (every product and sum rounded on
   its own, no FMA): n = rint(x * log2e), r = (x - n * ln2_hi) - n * ln2_lo, a degree-7 Taylor
   polynomial in r (Horner, coefficients float32(1/k!)), times 2^(n + 40) (EXP32_* below).
5. top_k (0 or >= V: off): keep the first top_k elements of the order.
6. top_p (1: off): q = floor(top_p * 2^32); W = the kept weight; keep the shortest prefix (in the
   order) of the kept elements whose weight reaches max(1, ceil(W * q / 2^32)).
7. The uniform: r = the top 32 bits of mix64(mix64(head_key(seed, step, TOKEN_LAYER, b, 0) ^
   TOKEN_TILE) ^ 0) (santa_cupy.rng's functions; TOKEN_LAYER = 2^32 - 1 and TOKEN_TILE =
   0xFFFFFFFD, a stream no attention draw uses); step = the sampler's step counter (the number of
   tokens it has sampled before, per sequence alike). target = floor(W_kept * r / 2^32).
8. The token: the smallest kept index i (ascending index order) at which the running sum of kept
   weights exceeds target.

Weights below 2^-40 of the best token's, and tokens more than 80 nats below it, are never drawn
(exp(-27.7) and exp(-80)): the distribution is otherwise the usual one to float32 accuracy.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from santa_cupy import rng

TOKEN_LAYER = 0xFFFFFFFF
TOKEN_TILE = 0xFFFFFFFD
WEIGHT_ONE = 1 << 40
MIN_EXPONENT = -80.0
MAX_VOCAB = (1 << 24) - 1
TOP_P_OFF = 1 << 32


def _f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


# exp32's constants (bit patterns, shared with sample_weight in cuda/sample_tokens.cu)
EXP32_LOG2E, EXP32_LN2_HI, EXP32_LN2_LO = _f32(0x3fb8aa3b), _f32(0x3f317200), _f32(0x35bfbe8e)
EXP32_POLY = tuple(_f32(b) for b in (0x39500d01, 0x3ab60b61, 0x3c088889, 0x3d2aaaab, 0x3e2aaaab,
                                     0x3f000000, 0x3f800000, 0x3f800000))    # 1/7!, 1/6!, ..., 1/1!, 1/0!


@dataclass(frozen=True)
class SamplingConfig:
    greedy: bool = True
    temperature: float = 1.0
    top_k: int = 0          # 0 = off
    top_p: float = 1.0      # 1.0 = off
    seed: int = 0
    repetition_penalty: float = 1.0   # 1.0 = off; > 1 discourages tokens already in the context

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class SamplerParams:
    """A SamplingConfig as the kernel and the reference take it (module docstring)."""

    greedy: bool
    inv_t: np.float32
    top_k: int              # 0: off
    top_p_q: int            # TOP_P_OFF: off
    penalty: np.float32     # 1: off
    seed: int

    @classmethod
    def from_config(cls, cfg: SamplingConfig, vocab: int) -> "SamplerParams":
        greedy = bool(cfg.greedy or cfg.temperature == 0 or cfg.top_k == 1)
        top_k = int(cfg.top_k) if 0 < cfg.top_k < vocab else 0
        top_p_q = TOP_P_OFF if cfg.top_p >= 1.0 else max(1, int(cfg.top_p * TOP_P_OFF))
        with np.errstate(over="ignore"):
            inv_t = np.float32(1.0 / cfg.temperature) if cfg.temperature > 0 else np.float32(1.0)
        if not np.isfinite(inv_t):            # a temperature below 1 / float32 max: greedy
            greedy, inv_t = True, np.float32(1.0)
        return cls(greedy, inv_t, top_k, top_p_q, np.float32(cfg.repetition_penalty), int(cfg.seed))

    @property
    def penalized(self) -> bool:
        return self.penalty != np.float32(1.0)


def order_key(z: np.ndarray) -> np.ndarray:
    """float32 -> uint32 keys ordered as the values (-0 as +0)."""
    b = (np.asarray(z, np.float32) + np.float32(0.0)).view(np.uint32)
    return np.where(b & np.uint32(0x80000000), ~b, b | np.uint32(0x80000000)).astype(np.uint32)


def weights(z: np.ndarray, zmax: np.float32) -> np.ndarray:
    """Step 4's integer weights [V] uint64 of z [V] float32."""
    z = np.asarray(z, np.float32) + np.float32(0.0)
    with np.errstate(invalid="ignore"):                  # -inf - -inf: not valid, weight 0
        x = z - np.float32(zmax)
        valid = x >= np.float32(MIN_EXPONENT)
    x = np.where(valid, x, np.float32(0.0))
    n = np.rint(x * EXP32_LOG2E)
    r = x - n * EXP32_LN2_HI
    r = r - n * EXP32_LN2_LO
    p = np.full_like(r, EXP32_POLY[0])
    for c in EXP32_POLY[1:]:
        p = p * r + c
    scale = ((n.astype(np.int32) + np.int32(127 + 40)) << np.int32(23)).view(np.float32)
    w = (p * scale).astype(np.uint64)
    w[~valid] = 0
    w[z == np.float32(zmax)] = WEIGHT_ONE
    return w


def token_uniform(seed: int, step: int, b) -> np.ndarray:
    """Step 7's 32-bit uniform(s) r (uint64 values < 2^32) of sequence(s) b."""
    key = rng.head_key(seed, step, TOKEN_LAYER, b, 0)
    return rng.mix64(rng.mix64(key ^ np.uint64(TOKEN_TILE)) ^ np.uint64(0)) >> np.uint64(32)


def penalized_logits(logits, seen, penalty) -> np.ndarray:
    """Step 1 on logits [..., V] with seen [..., V] (bool/uint8; None: unchanged), float32."""
    l = np.array(logits, np.float32)
    if seen is None:
        return l
    penalty = np.float32(penalty)
    m = np.asarray(seen).astype(bool)
    return np.where(m, np.where(l > np.float32(0.0), l / penalty, l * penalty), l).astype(np.float32)


def sample_row(l: np.ndarray, p: SamplerParams, step: int, b: int) -> int:
    """Steps 2-8 on one sequence's penalised logits l [V] float32."""
    V = l.shape[0]
    if p.greedy:
        return int(np.argmax(order_key(l)))
    z = (l * p.inv_t).astype(np.float32)
    key = order_key(z)
    imax = int(np.argmax(key))
    w = weights(z, z[imax])
    if p.top_k or p.top_p_q < TOP_P_OFF:
        order = np.lexsort((np.arange(V), -key.astype(np.int64)))       # key descending, index ascending
        if p.top_k:
            order = order[:p.top_k]
        if p.top_p_q < TOP_P_OFF:
            cum = np.cumsum(w[order], dtype=np.uint64)
            thr = max(1, -(-int(cum[-1]) * p.top_p_q // TOP_P_OFF))
            order = order[:int(np.searchsorted(cum, np.uint64(thr), side="left")) + 1]
        kept = np.zeros(V, bool)
        kept[order] = True
        w = np.where(kept, w, np.uint64(0))
    cum = np.cumsum(w, dtype=np.uint64)
    if cum[-1] == 0:                          # NaN logits only (z_max NaN): the kernel keeps the argmax
        return imax
    target = int(cum[-1]) * int(token_uniform(p.seed, step, b)) >> 32
    return int(np.searchsorted(cum, np.uint64(target), side="right"))


def sample_reference(logits, params: SamplerParams, step: int, seen=None) -> np.ndarray:
    """The tokens [B] int32 of logits [B, V] (float32) at sampler step `step`; seen [B, V] (the
    repetition penalty's tokens; None: none)."""
    l = np.asarray(logits, np.float32)
    if l.ndim != 2 or not 1 <= l.shape[1] <= MAX_VOCAB:
        raise ValueError(f"logits must be [B, V] with 1 <= V <= {MAX_VOCAB}, got shape {l.shape}")
    l = penalized_logits(l, seen if params.penalized else None, params.penalty)
    return np.array([sample_row(l[b], params, int(step), b) for b in range(l.shape[0])], np.int32)


class TokenSampler:
    """The sampler of B sequences on one array module: NumPy runs sample_reference, CuPy the kernel
    (llama_min.ops.sample_tokens) on the current stream, without host synchronisation (so it can
    end a captured step).

        s = TokenSampler(np, SamplingConfig(...), batch=1, vocab=V, context=[prompt_ids])
        tokens = s(logits)       # [B] int32 array of the module (s.out, overwritten by the next call)
        s.advance()              # the step counter, on the device

    State, all arrays of the module: `step` int64 [1] (the RNG step: advance() adds one, also inside
    a CUDA graph), `seen` uint8 [B, V] (the repetition penalty's tokens: the context given, then
    every token chosen with update=True; None without a penalty), `out` int32 [B]."""

    def __init__(self, xp, cfg: SamplingConfig, batch: int, vocab: int, context=None):
        if not 1 <= vocab <= MAX_VOCAB:
            raise ValueError(f"vocab must be in 1..{MAX_VOCAB}, got {vocab}")
        self.xp, self.cfg, self.batch, self.vocab = xp, cfg, int(batch), int(vocab)
        self.params = SamplerParams.from_config(cfg, vocab)
        self.step = xp.zeros((1,), xp.int64)
        self.out = xp.zeros((batch,), xp.int32)
        self.seen = None
        if self.params.penalized:
            seen = np.zeros((batch, vocab), np.uint8)
            for b, ids in enumerate(context or ()):
                seen[b, np.asarray(list(ids), np.int64)] = 1
            self.seen = xp.asarray(seen)
        self._dummy = None if self.seen is not None else xp.zeros((1,), xp.uint8)

    def __call__(self, logits, update: bool = True):
        """logits [B, V] float32 -> self.out (the tokens); update: mark them in `seen`."""
        if self.xp is np:
            self.out[...] = sample_reference(logits, self.params, int(self.step[0]), self.seen)
            if update and self.seen is not None:
                self.seen[np.arange(self.batch), self.out] = 1
            return self.out
        from llama_min import ops
        p = self.params
        seen = self.seen if self.seen is not None else self._dummy
        return ops.sample_tokens(logits, seen, self.seen is not None, update, p.penalty, self.step, p.seed,
                                 p.greedy, p.inv_t, p.top_k, p.top_p_q, out=self.out)

    def advance(self):
        self.step += 1

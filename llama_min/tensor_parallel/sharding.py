"""The sharding arithmetic of tensor parallelism (layout: the package docstring): ShardPlan and
shard_plan (which heads, intermediate and vocabulary rows a rank holds), the valid TP degrees,
one rank's weights (shard_weights), their shapes and its LlamaConfig."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


def valid_tp_degrees(heads: int, kv_heads: int, limit: int = 64) -> list[int]:
    """The TP degrees up to `limit` a model of these heads takes: divisors of kv_heads, and multiples
    of kv_heads that divide heads (the KV heads replicated)."""
    return [t for t in range(1, limit + 1)
            if (t <= kv_heads and kv_heads % t == 0) or (t > kv_heads and t % kv_heads == 0 and heads % t == 0)]


@dataclass(frozen=True)
class ShardPlan:
    """How one model splits over tp ranks (see the module docstring); build with shard_plan()."""

    tp: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    align: int = 1        # per-rank intermediate and vocab slices rounded up to a multiple of this

    @property
    def replicas(self) -> int:
        """Ranks sharing (computing) one KV head: 1 when tp divides the KV heads, tp / KVH above."""
        return max(1, self.tp // self.kv_heads)

    @property
    def heads_per_rank(self) -> int:
        return self.heads // self.tp

    @property
    def kv_heads_per_rank(self) -> int:
        return self.kv_heads // self.tp if self.tp <= self.kv_heads else 1

    @property
    def intermediate_per_rank(self) -> int:
        return _round_up(-(-self.intermediate // self.tp), self.align)

    @property
    def vocab_per_rank(self) -> int:
        return _round_up(-(-self.vocab // self.tp), self.align)

    def _check_rank(self, rank: int):
        if not 0 <= rank < self.tp:
            raise ValueError(f"rank must be in 0..{self.tp - 1}, got {rank}")

    def query_heads(self, rank: int) -> range:
        """The global query heads of a rank (h0 = start: its head_offset)."""
        self._check_rank(rank)
        n = self.heads_per_rank
        return range(rank * n, (rank + 1) * n)

    def kv_heads_of(self, rank: int) -> range:
        """The global KV heads of a rank (one, shared with replicas - 1 other ranks, when tp > KVH)."""
        self._check_rank(rank)
        if self.tp <= self.kv_heads:
            n = self.kv_heads_per_rank
            return range(rank * n, (rank + 1) * n)
        g = rank // self.replicas
        return range(g, g + 1)

    def _slice(self, rank, total, per_rank):
        self._check_rank(rank)
        lo = min(rank * per_rank, total)
        return lo, min(lo + per_rank, total)

    def intermediate_slice(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the real intermediate rows a rank holds (hi - lo <= intermediate_per_rank:
        the rest of its slice is zero padding)."""
        return self._slice(rank, self.intermediate, self.intermediate_per_rank)

    def vocab_slice(self, rank: int) -> tuple[int, int]:
        """[lo, hi) of the real vocabulary rows a rank holds (the rest of its slice: zero padding)."""
        return self._slice(rank, self.vocab, self.vocab_per_rank)


def shard_plan(cfg_or_dims, tp: int, align: int = 1) -> ShardPlan:
    """The ShardPlan of a LlamaConfig (or a dict/object with heads, kv_heads, head_dim, intermediate,
    vocab) over tp ranks; ValueError naming the valid degrees when tp does not fit the heads."""
    if hasattr(cfg_or_dims, "num_attention_heads"):
        c = cfg_or_dims
        dims = dict(heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                    intermediate=c.intermediate_size, vocab=c.vocab_size)
    elif isinstance(cfg_or_dims, dict):
        dims = {k: cfg_or_dims[k] for k in ("heads", "kv_heads", "head_dim", "intermediate", "vocab")}
    else:
        c = cfg_or_dims
        dims = dict(heads=c.heads, kv_heads=c.kv_heads, head_dim=c.head_dim, intermediate=c.intermediate,
                    vocab=c.vocab)
    if isinstance(tp, bool) or not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ValueError(f"the tensor-parallel degree must be an integer >= 1, got {tp!r}")
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or align < 1:
        raise ValueError(f"align must be an integer >= 1, got {align!r}")
    H, KVH = int(dims["heads"]), int(dims["kv_heads"])
    if KVH < 1 or H % KVH:
        raise ValueError(f"the query heads ({H}) must be a multiple of the KV heads ({KVH})")
    tp = int(tp)
    if tp <= KVH:
        if KVH % tp:
            raise ValueError(f"tp={tp} does not divide the {KVH} KV heads; valid degrees for {H} heads / {KVH} KV "
                             f"heads: {valid_tp_degrees(H, KVH)}")
    elif tp % KVH or H % tp:
        raise ValueError(f"tp={tp} exceeds the {KVH} KV heads: it must be a multiple of them that divides the "
                         f"{H} query heads (the KV heads replicated); valid degrees: {valid_tp_degrees(H, KVH)}")
    for k in ("head_dim", "intermediate", "vocab"):
        if int(dims[k]) < 1:
            raise ValueError(f"{k} must be >= 1, got {dims[k]}")
    return ShardPlan(tp=tp, heads=H, kv_heads=KVH, head_dim=int(dims["head_dim"]),
                     intermediate=int(dims["intermediate"]), vocab=int(dims["vocab"]), align=int(align))


def _xp_of(a):
    return np if isinstance(a, np.ndarray) else __import__("cupy")


def _rows_padded(xp, w, lo, hi, n):
    """Rows lo..hi of w [*, K] zero-padded to n rows."""
    out = xp.zeros((n,) + w.shape[1:], w.dtype)
    out[:hi - lo] = w[lo:hi]
    return out


def rank_weight_shapes(plan: ShardPlan, hidden: int) -> dict[str, tuple[int, int]]:
    """A rank's decode-step weight matrices [N, K] (the shard_weights layout): qkv, o, gate_up, down,
    lm_head (the same on every rank)."""
    D, Hr, KVr, Ir = plan.head_dim, plan.heads_per_rank, plan.kv_heads_per_rank, plan.intermediate_per_rank
    return {"qkv": ((Hr + 2 * KVr) * D, hidden), "o": (hidden, Hr * D), "gate_up": (2 * Ir, hidden),
            "down": (hidden, Ir), "lm_head": (plan.vocab_per_rank, hidden)}


def shard_weights(weights: dict, plan: ShardPlan, rank: int) -> dict:
    """One rank's weights (new arrays of the input's array module) from a LlamaModel's `w`:
    wqkv [(Hr + 2 KVHr) D, d] (its q, k, v rows), wo [d, Hr D] (its heads' columns), w_gu [2 Ir, d]
    (its gate rows, then the same up rows, zero-padded), w_down [d, Ir] (those columns, padded),
    embed / lm_head [Vr, d] (its vocabulary rows, padded; a tied lm_head stays the embedding),
    the norms as they are."""
    H, KVH, D, I = plan.heads, plan.kv_heads, plan.head_dim, plan.intermediate
    qh, kvh = plan.query_heads(rank), plan.kv_heads_of(rank)
    i_lo, i_hi = plan.intermediate_slice(rank)
    v_lo, v_hi = plan.vocab_slice(rank)
    Ir, Vr = plan.intermediate_per_rank, plan.vocab_per_rank
    layers = []
    for lw in weights["layers"]:
        xp = _xp_of(lw["wqkv"])
        wqkv = lw["wqkv"]
        q = wqkv[qh.start * D:qh.stop * D]
        k = wqkv[(H + kvh.start) * D:(H + kvh.stop) * D]
        v = wqkv[(H + KVH + kvh.start) * D:(H + KVH + kvh.stop) * D]
        gu = lw["w_gu"]
        wd = lw["w_down"]
        down = xp.zeros((wd.shape[0], Ir), wd.dtype)
        down[:, :i_hi - i_lo] = wd[:, i_lo:i_hi]
        layers.append({
            "attn_norm": lw["attn_norm"],
            "wqkv": xp.ascontiguousarray(xp.concatenate([q, k, v], 0)),
            "wo": xp.ascontiguousarray(lw["wo"][:, qh.start * D:qh.stop * D]),
            "mlp_norm": lw["mlp_norm"],
            "w_gu": xp.concatenate([_rows_padded(xp, gu, i_lo, i_hi, Ir), _rows_padded(xp, gu, I + i_lo, I + i_hi, Ir)], 0),
            "w_down": down,
        })
    xp = _xp_of(weights["embed"])
    embed = _rows_padded(xp, weights["embed"], v_lo, v_hi, Vr)
    tied = weights["lm_head"] is weights["embed"]
    lm_head = embed if tied else _rows_padded(xp, weights["lm_head"], v_lo, v_hi, Vr)
    return {"embed": embed, "lm_head": lm_head, "norm": weights["norm"], "layers": layers}


def rank_config(cfg, plan: ShardPlan):
    """The LlamaConfig of one rank's model: its heads, KV heads, intermediate and vocabulary slices."""
    return dataclasses.replace(cfg, num_attention_heads=plan.heads_per_rank,
                               num_key_value_heads=plan.kv_heads_per_rank,
                               intermediate_size=plan.intermediate_per_rank, vocab_size=plan.vocab_per_rank,
                               source=f"{cfg.source} (tensor-parallel shard of {plan.tp})")

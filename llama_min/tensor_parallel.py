"""Tensor-parallel decoding of a LlamaModel over N ranks (issue #22): the sharding arithmetic, the
weight shards, a Communicator (FakeCommunicator on the CPU, NcclCommunicator on CuPy's NCCL), the
Backend wrapper that puts the collectives into the one decode step, and the decoders.

Layout (Megatron-style; d hidden, H / KVH query / KV heads, D head dim, I intermediate, V vocab):

- attention: rank r holds query heads [r H/tp, (r+1) H/tp) and their KV heads. tp divides KVH:
  KV heads [r KVH/tp, (r+1) KVH/tp); tp a multiple of KVH (tp > KVH, H % tp == 0): the KV heads
  are replicated, rank r holds KV head r // (tp / KVH), computed on each of its tp / KVH ranks.
  The fused QKV product is column-parallel (the rank's q, k, v rows), the O product row-parallel
  (its heads' columns of wo): a partial [B, d] that is all-reduced.
- MLP: gate/up column-parallel (rank r's slice of the intermediate rows, gate and up alike, so
  SiLU(gate) * up stays local), down row-parallel (the slice's columns), all-reduced. When tp
  does not divide I the slices are padded with zero rows / columns (silu(0) * 0 = 0: no effect).
- embedding and lm-head split by vocabulary (slices of ceil(V / tp) rows, the last zero-padded):
  the embedding looks up the rank's slice (zeros for the other tokens) and is all-reduced (one
  rank contributes each row: exact); the lm-head's logit slices are all-gathered (or, greedy, a
  distributed argmax: ShardedBackend(lm_head="argmax")).

Two all-reduces a layer (after wo and after w_down) and one for the embedding, all inside the
one decode step `LlamaModel._decode_core`, through `ShardedBackend` (its linear_add: rank 0 adds
its partial product to the residual stream, the others write theirs over it, one in-place
all-reduce sums them; embed / logits are the Backend seams of the embedding and lm-head). The prefill is LlamaModel.prefill on every rank, chunked as ever,
its collectives in the model's _row_linear / _embed / _lm_head seams (RankModel). Each rank's model is a LlamaModel of the shard's shapes, its
`head_offset` the global index of its first query head: SANTA keys head h of the rank by
rng.head_key(..., head_offset + h), so a rank draws exactly what that head draws at TP=1
(santa_cupy's head_offset; the counts are rank-invariant given the attention inputs).

NCCL: every process that creates an NcclCommunicator gets NCCL_NVLS_ENABLE=0 (set before NCCL
initialises, unless already set): NVLink SHARP / multicast is never used (the lent machines'
NVLink multicast must stay off). One thread drives each GPU (NCCL's one-thread-per-rank model, no
group calls needed); the collectives run on the current stream, so a step is captured whole, all
its collectives included, as one CUDA graph per rank (TensorParallelGraphDecoder).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from dataclasses import dataclass

import numpy as np

from llama_min.backends import Backend

__all__ = ["ShardPlan", "shard_plan", "valid_tp_degrees", "shard_weights", "rank_config", "rank_model",
           "make_rank_model", "rank_models_on_gpus", "rank_weight_shapes",
           "Communicator", "FakeGroup", "FakeCommunicator", "NcclCommunicator", "ShardedBackend",
           "TensorParallelDecoder", "TensorParallelGraphDecoder", "run_ranks", "NCCL_ENV"]

NCCL_ENV = {"NCCL_NVLS_ENABLE": "0"}     # no NVLink SHARP / multicast, ever (set before NCCL initialises)


def _round_up(x: int, align: int) -> int:
    return -(-x // align) * align


# ---------------------------------------------------------------------------------- sharding arithmetic


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


def rank_model(model, plan: ShardPlan, rank: int, weights: dict | None = None):
    """A LlamaModel of one rank (on the model's device; on the GPU: the current device) from the
    whole model's weights (or the rank's own, `weights`, e.g. generated per rank). Its
    head_offset is the global index of its first query head; tp_plan / tp_rank say where it sits."""
    if weights is None:
        weights = shard_weights(model.w, plan, rank)
        if model.xp is not np:                      # the shards on the current device
            weights = _to_device(model.xp, weights)
    return make_rank_model(model.cfg, plan, rank, weights, model.xp, model.device, model.mm_dtype.name,
                           model.kv_dtype)


def rank_models_on_gpus(cfg, weights: dict, plan: ShardPlan, devices, mm_dtype: str = "float16",
                        kv_dtype: str = "float16") -> list:
    """Rank r's LlamaModel on GPU devices[r], from a whole model's weights (NumPy, or CuPy on any
    device): sharded, then copied to the rank's device (of mm_dtype; norms float32)."""
    import cupy

    mm = np.dtype(mm_dtype)
    models = []
    for r, dev in enumerate(devices):
        shard = shard_weights(weights, plan, r)
        with cupy.cuda.Device(dev):
            w = _to_device(cupy, shard)
            cast = lambda a: a if a.dtype == np.float32 and a.ndim == 1 else a.astype(mm, copy=False)   # noqa: E731
            w = {"embed": cast(w["embed"]), "norm": w["norm"], "lm_head": cast(w["lm_head"]),
                 "layers": [{k: cast(v) for k, v in lw.items()} for lw in w["layers"]]}
            if shard["lm_head"] is shard["embed"]:
                w["lm_head"] = w["embed"]
            models.append(make_rank_model(cfg, plan, r, w, cupy, "gpu", mm.name, kv_dtype))
    return models


def make_rank_model(cfg, plan: ShardPlan, rank: int, weights: dict, xp, device: str, mm_dtype: str, kv_dtype: str):
    """The RankModel of rank `rank` from its own weights (shard_weights' layout and shapes) and the
    whole model's config: rank_config's shapes, head_offset its first global query head."""
    return _rank_model_class()(rank_config(cfg, plan), weights, xp, device, mm_dtype, kv_dtype, plan=plan,
                               rank=rank)


def _vocab_embed(w, ids, lo, hi, comm):
    """Rows of the vocabulary slice [lo, hi) held in w for the token ids [N] (zeros for the others),
    summed over the ranks (one rank holds each id: exact) -> [N, d] float32."""
    xp = _xp_of(w)
    local = ids - lo
    inside = (local >= 0) & (local < hi - lo)
    rows = w[xp.where(inside, local, 0)].astype(np.float32)
    rows = xp.ascontiguousarray(xp.where(inside[:, None], rows, np.float32(0)))
    return comm.all_reduce_sum(rows)


def _gather_logits(local, comm, plan: ShardPlan):
    """Every rank's logit slice [N, Vr] float32 -> [N, V] in vocabulary order (padding dropped)."""
    xp = _xp_of(local)
    N, Vr = local.shape
    gathered = comm.all_gather(xp.ascontiguousarray(local))                 # [tp, N, Vr]
    return xp.ascontiguousarray(gathered.transpose(1, 0, 2).reshape(N, plan.tp * Vr)[:, :plan.vocab])


@functools.lru_cache(maxsize=None)
def _rank_model_class():
    from llama_min.model import LlamaModel

    class RankModel(LlamaModel):
        """One rank's LlamaModel: the shard's shapes (cfg), head_offset = its first global query
        head; with a communicator attached (`comm`, set by the decoders) its prefill all-reduces the
        O / down products and the embedding and gathers the logits (LlamaModel's _row_linear /
        _embed / _lm_head seams); token ids are checked against the whole vocabulary."""

        def __init__(self, cfg, weights, xp, device, mm_dtype, kv_dtype, *, plan: ShardPlan, rank: int):
            super().__init__(cfg, weights, xp, device, mm_dtype, kv_dtype)
            self.tp_plan, self.tp_rank, self.comm = plan, rank, None
            self.head_offset = plan.query_heads(rank).start
            self.vocab_lo, self.vocab_hi = plan.vocab_slice(rank)

        def _comm(self):
            if self.comm is None:
                raise RuntimeError("a tensor-parallel rank model needs its communicator (model.comm) for the "
                                   "prefill; run it through TensorParallelDecoder")
            return self.comm

        def _row_linear(self, x, w):
            return self._comm().all_reduce_sum(self._linear(x, w, np.float32).astype(np.float32, copy=False))

        def _embed(self, ids):
            return _vocab_embed(self.w["embed"], ids, self.vocab_lo, self.vocab_hi, self._comm())

        def _lm_head(self, h):
            return _gather_logits(self._linear(h, self.w["lm_head"], np.float32).astype(np.float32, copy=False),
                                  self._comm(), self.tp_plan)

        def _blas_threads(self, phase, tokens=1):
            return contextlib.nullcontext()        # threadpoolctl's limits are process-wide: not per rank

        def _check_ids(self, token_ids):
            V = self.tp_plan.vocab
            if isinstance(token_ids, (np.ndarray, list, tuple)):
                ids = np.asarray(token_ids)
                if ids.dtype.kind not in "iu":
                    raise TypeError(f"token ids must be integers, got dtype {ids.dtype}")
                if ids.size and (ids.min() < 0 or ids.max() >= V):
                    raise ValueError(f"token ids must be in 0..{V - 1}, got range {ids.min()}..{ids.max()}")
                return self.xp.asarray(ids.astype(np.int32))
            return token_ids.astype(self.xp.int32)

    return RankModel


def _to_device(cp, weights):
    """Every array of a weight dict copied to the current device (tied lm_head kept tied): NumPy
    arrays uploaded, CuPy arrays copied (ndarray.copy() allocates on the current device)."""
    up = lambda a: a.copy() if isinstance(a, cp.ndarray) else cp.asarray(a)    # noqa: E731
    out = {"embed": up(weights["embed"]), "norm": up(weights["norm"]),
           "layers": [{k: up(v) for k, v in lw.items()} for lw in weights["layers"]]}
    out["lm_head"] = out["embed"] if weights["lm_head"] is weights["embed"] else up(weights["lm_head"])
    return out


# ---------------------------------------------------------------------------------- communicators


class Communicator:
    """The collectives of one rank of a group of `size`. Arrays are the rank's (NumPy, or CuPy on
    its device); the GPU ones run on the current stream, so they can be captured in a graph."""

    rank: int = 0
    size: int = 1

    def all_reduce_sum(self, x):
        """x (C-contiguous) := the elementwise sum of every rank's x, in place; returns x. Every
        rank gets the same bits."""
        raise NotImplementedError

    def all_gather(self, x):
        """-> a new [size, *x.shape] array: every rank's x, in rank order."""
        raise NotImplementedError

    def barrier(self):
        """Returns once every rank has called it (GPU: and the current stream's work is done)."""
        raise NotImplementedError

    def close(self):
        """Release what the communicator holds; idempotent."""


class FakeGroup:
    """N FakeCommunicators in one process exchanging arrays (NumPy; or CuPy arrays of one GPU, for
    single-GPU tests of the GPU step without NCCL), one thread a rank (each collective waits for
    every rank). Sums run in rank order 0..N-1 on every rank, so results are
    reproducible and equal on every rank. `calls` counts collectives by kind (rank 0's), `bytes`
    the bytes rank 0 contributed; abort() breaks every waiting rank out (BrokenBarrierError)."""

    def __init__(self, size: int, timeout: float = 120.0):
        if size < 1:
            raise ValueError(f"group size must be >= 1, got {size}")
        self.size = int(size)
        self._barrier = threading.Barrier(self.size, timeout=timeout)
        self._slots = [None] * self.size
        self.calls = {"all_reduce": 0, "all_gather": 0, "barrier": 0}
        self.bytes = {"all_reduce": 0, "all_gather": 0}
        self.communicators = [FakeCommunicator(self, r) for r in range(self.size)]

    def __getitem__(self, rank) -> "FakeCommunicator":
        return self.communicators[rank]

    def __len__(self):
        return self.size

    def abort(self):
        self._barrier.abort()

    def reset(self):
        self._barrier.reset()

    def _exchange(self, rank, x, kind):
        self._slots[rank] = x.copy()
        if rank == 0:
            self.calls[kind] += 1
            self.bytes[kind] += self._slots[0].nbytes
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()                 # every rank has read the slots before they are reused
        return got


class FakeCommunicator(Communicator):
    """One rank of a FakeGroup (the CPU's communicator; NumPy arrays, or CuPy arrays of one device)."""

    def __init__(self, group: FakeGroup, rank: int):
        self.group, self.rank, self.size = group, rank, group.size

    def all_reduce_sum(self, x):
        parts = self.group._exchange(self.rank, x, "all_reduce")
        total = parts[0].copy()
        for p in parts[1:]:                  # rank order: the same bits on every rank
            total += p
        x[...] = total
        return x

    def all_gather(self, x):
        return _xp_of(x).stack(self.group._exchange(self.rank, x, "all_gather"))

    def barrier(self):
        if self.rank == 0:
            self.group.calls["barrier"] += 1
        self.group._barrier.wait()


def _nccl_environment():
    """NCCL_ENV into os.environ unless set (before the first communicator initialises NCCL);
    refuses NVLS turned on explicitly."""
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)
    if os.environ.get("NCCL_NVLS_ENABLE") != "0":
        raise RuntimeError(f"NCCL_NVLS_ENABLE={os.environ['NCCL_NVLS_ENABLE']!r}: llama_min's tensor parallelism "
                           "never uses NVLink multicast (NVLS); unset it or set it to 0")


class NcclCommunicator(Communicator):
    """One rank on one GPU through CuPy's NCCL binding (cupy.cuda.nccl.NcclCommunicator).

        comms = NcclCommunicator.create_all([0, 1, 2, 3])     # one process, one thread a GPU

    or, one process (or thread) a rank: uid = NcclCommunicator.unique_id() on rank 0, shared, then
    NcclCommunicator.from_unique_id(size, uid, rank, device). Collectives run on the current
    stream (capturable in a CUDA graph) on float32 / float16 / float64 / int32 arrays; in-place
    all-reduce. NCCL_NVLS_ENABLE=0 is set before NCCL initialises (module docstring)."""

    def __init__(self, comm, rank: int, size: int, device: int):
        self.comm, self.rank, self.size, self.device = comm, int(rank), int(size), int(device)
        self._flag = None

    @staticmethod
    def _nccl():
        _nccl_environment()
        from cupy.cuda import nccl
        if not nccl.available:
            raise RuntimeError("CuPy was built without NCCL (cupy.cuda.nccl.available is False)")
        return nccl

    @classmethod
    def create_all(cls, devices) -> list["NcclCommunicator"]:
        """Communicators of every device of this process (ncclCommInitAll); rank i on devices[i]."""
        nccl = cls._nccl()
        devices = [int(d) for d in devices]
        comms = nccl.NcclCommunicator.initAll(devices)
        return [cls(c, i, len(devices), d) for i, (c, d) in enumerate(zip(comms, devices))]

    @classmethod
    def unique_id(cls):
        return cls._nccl().get_unique_id()

    @classmethod
    def from_unique_id(cls, size: int, uid, rank: int, device: int) -> "NcclCommunicator":
        """Rank `rank` of `size` on `device` (ncclCommInitRank: blocks until every rank has joined,
        so call it from the rank's own thread or process)."""
        import cupy
        nccl = cls._nccl()
        with cupy.cuda.Device(device):
            return cls(nccl.NcclCommunicator(size, uid, rank), rank, size, device)

    def _dtype(self, x):
        nccl = self._nccl()
        table = {np.dtype(np.float32): nccl.NCCL_FLOAT32, np.dtype(np.float16): nccl.NCCL_FLOAT16,
                 np.dtype(np.float64): nccl.NCCL_FLOAT64, np.dtype(np.int32): nccl.NCCL_INT32}
        try:
            return table[np.dtype(x.dtype)]
        except KeyError:
            raise TypeError(f"NCCL collectives here take {sorted(str(k) for k in table)}, got {x.dtype}") from None

    def _check(self, x):
        import cupy
        if not isinstance(x, cupy.ndarray) or not x.flags.c_contiguous or x.device.id != self.device:
            raise ValueError(f"rank {self.rank}: a C-contiguous CuPy array on device {self.device} is needed, got "
                             f"{type(x).__name__} on device {getattr(getattr(x, 'device', None), 'id', '?')}")

    def all_reduce_sum(self, x):
        import cupy
        self._check(x)
        nccl = self._nccl()
        stream = cupy.cuda.get_current_stream()
        self.comm.allReduce(x.data.ptr, x.data.ptr, x.size, self._dtype(x), nccl.NCCL_SUM, stream.ptr)
        return x

    def all_gather(self, x):
        import cupy
        self._check(x)
        out = cupy.empty((self.size,) + x.shape, x.dtype)
        stream = cupy.cuda.get_current_stream()
        self.comm.allGather(x.data.ptr, out.data.ptr, x.size, self._dtype(x), stream.ptr)
        return out

    def barrier(self):
        import cupy
        with cupy.cuda.Device(self.device):
            if self._flag is None:
                self._flag = cupy.zeros((1,), cupy.float32)
            self.all_reduce_sum(self._flag)
            cupy.cuda.get_current_stream().synchronize()

    def close(self):
        if self.comm is not None:
            self.comm.destroy()
            self.comm = None


# ---------------------------------------------------------------------------------- the decode step's seams


class ShardedBackend(Backend):
    """A rank's Backend: the inner backend's products and kernels on the rank's shard, plus the
    collectives. linear_add (the O and down products, row-parallel): the residual plus rank 0's
    partial product, the other ranks' partials, summed by one in-place all-reduce into the
    residual; embed: the rank's vocabulary rows (zeros for tokens
    outside its slice), all-reduced; logits: the rank's slice of the lm-head, all-gathered into
    [B, V] (lm_head="gather"), or the greedy tokens [B] int32 by a distributed argmax
    (lm_head="argmax": every rank's (max, index) pair gathered, the lowest index on ties, as
    argmax over the whole vocabulary). Everything else is the inner backend's."""

    name = "tp"

    def __init__(self, inner: Backend, comm: Communicator, plan: ShardPlan, rank: int, lm_head: str = "gather"):
        super().__init__(inner.model)
        if lm_head not in ("gather", "argmax"):
            raise ValueError(f"lm_head must be 'gather' or 'argmax', got {lm_head!r}")
        if comm.size != plan.tp or comm.rank != rank:
            raise ValueError(f"communicator rank {comm.rank} of {comm.size} for rank {rank} of tp={plan.tp}")
        self.inner, self.comm, self.plan, self.rank, self.lm_head = inner, comm, plan, rank, lm_head
        self.vocab_lo, self.vocab_hi = plan.vocab_slice(rank)

    # the inner backend's own
    def linear(self, x, w, out_dtype=None):
        return self.inner.linear(x, w, out_dtype)

    def rms_norm(self, x, w):
        return self.inner.rms_norm(x, w)

    def token_rows(self, cache, pos):
        return self.inner.token_rows(cache, pos)

    def qkv_rope_append(self, h, w, cache, layer, pos, rows):
        return self.inner.qkv_rope_append(h, w, cache, layer, pos, rows)

    def kv_view(self, cache, layer, n):
        return self.inner.kv_view(cache, layer, n)

    def attention_out(self, o):
        return self.inner.attention_out(o)

    def glu(self, h, w):
        return self.inner.glu(h, w)

    def close(self):
        self.inner.close()

    # the collectives
    def linear_add(self, x, w, into):
        """into [B, d] (the residual) := into + the sum over ranks of x @ w.T: rank 0 adds its share
        to the residual as the inner backend does (gemv: in the product's launch), the other ranks
        overwrite into with theirs, then one in-place all-reduce (no scratch buffer, no add kernel;
        into is no longer needed by the step: its norm was taken before the product)."""
        if self.rank == 0:
            self.inner.linear_add(x, w, into)
        else:
            self._linear_into(x, w, into)
        return self.comm.all_reduce_sum(into)

    def _linear_into(self, x, w, into):
        """into := x @ w.T in float32 (gemv writes it in its launch; otherwise zeros, then added)."""
        fits = getattr(self.inner, "_fits", None)
        if fits is not None and fits(x, w):
            from llama_min import ops
            ops.gemv(x, w, out=into)
            return
        into.fill(0)
        self.inner.linear_add(x, w, into)

    def embed(self, w, tokens):
        return _vocab_embed(w, tokens, self.vocab_lo, self.vocab_hi, self.comm)

    def logits(self, h, w):
        local = self.inner.logits(h, w)                                     # [B, Vr] float32
        if self.lm_head == "argmax":
            return self._argmax(_xp_of(local), local)
        return _gather_logits(local, self.comm, self.plan)

    def _argmax(self, xp, local):
        n = self.vocab_hi - self.vocab_lo
        valid = local[:, :n] if n > 0 else xp.full((local.shape[0], 1), -np.inf, np.float32)
        idx = valid.argmax(-1)
        best = xp.take_along_axis(valid, idx[:, None], -1)[:, 0].astype(np.float64)
        pair = xp.ascontiguousarray(xp.stack([best, (idx + self.vocab_lo).astype(np.float64)], -1))   # [B, 2]
        g = self.comm.all_gather(pair)                                       # [tp, B, 2]
        winner = g[:, :, 0].argmax(0)                                       # first (lowest) rank on ties
        return xp.take_along_axis(g[:, :, 1], winner[None, :], 0)[0].astype(np.int32)


# ---------------------------------------------------------------------------------- running the ranks


def run_ranks(fn, n: int, abort=None):
    """fn(rank) on n threads at once (collectives wait for every rank) -> [result of each rank].
    The first exception is re-raised after every thread ended; abort() (e.g. FakeGroup.abort) is
    called on the first failure so that ranks waiting in a collective stop too."""
    results, errors = [None] * n, [None] * n

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:        # noqa: BLE001  (re-raised below, in the caller's thread)
            errors[r] = e
            if abort is not None:
                abort()

    if n == 1:
        body(0)
    else:
        threads = [threading.Thread(target=body, args=(r,), name=f"tp-rank-{r}", daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


class TensorParallelDecoder:
    """Eager tensor-parallel decoding: one rank model, cache and communicator a rank; each step runs
    LlamaModel._decode_core on every rank at once (one thread a rank) over a ShardedBackend.

        dec = TensorParallelDecoder.from_model(model, tp=4, batch=1, max_len=64)   # CPU: FakeGroup
        dec.prefill(prompt_ids)                   # LlamaModel.prefill on every rank (chunks)
        logits = dec.decode(tokens, attention)    # [B, V] float32, rank 0's (every rank has them)

    On the GPU build the rank models under their devices and pass NcclCommunicators (devices: the
    rank's device id each, used as the current device of its thread)."""

    def __init__(self, models, comms, caches, devices=None, lm_head: str = "gather", abort=None):
        self.models, self.comms, self.caches = list(models), list(comms), list(caches)
        self.tp = len(self.models)
        if not (len(self.comms) == len(self.caches) == self.tp):
            raise ValueError("one model, communicator and cache a rank")
        self.plan = self.models[0].tp_plan
        self.devices = devices
        self.abort = abort
        self.backends = [ShardedBackend(m.backend, c, self.plan, r, lm_head)
                         for r, (m, c) in enumerate(zip(self.models, self.comms))]
        for m, c in zip(self.models, self.comms):
            m.comm = c                                # the prefill's collectives

    @classmethod
    def from_model(cls, model, tp: int, batch: int = 1, max_len: int | None = None, lm_head: str = "gather",
                   align: int = 1, group: FakeGroup | None = None):
        """CPU: the rank models of a NumPy LlamaModel and a FakeGroup of tp ranks."""
        if model.xp is not np:
            raise ValueError("from_model builds the CPU decoder (FakeGroup); on the GPU use NcclCommunicator "
                             "(santa-cupy bench e2e --tp builds one)")
        plan = shard_plan(model.cfg, tp, align)
        group = group or FakeGroup(tp)
        models = [rank_model(model, plan, r) for r in range(tp)]
        caches = [m.new_cache(batch, max_len) for m in models]
        return cls(models, list(group.communicators), caches, lm_head=lm_head, abort=group.abort)

    def _on_ranks(self, fn):
        if self.devices is None:
            return run_ranks(fn, self.tp, self.abort)
        import cupy

        def on_device(r):
            with cupy.cuda.Device(self.devices[r]):
                return fn(r)
        return run_ranks(on_device, self.tp, self.abort)

    def _check_tokens(self, tokens):
        B = self.caches[0].batch
        t = np.asarray(tokens).reshape(-1) if not hasattr(tokens, "get") else tokens.get().reshape(-1)
        if t.shape[0] != B or t.dtype.kind not in "iu":
            raise ValueError(f"tokens must be [B={B}] integers, got {t.dtype} {t.shape}")
        if t.size and (t.min() < 0 or t.max() >= self.plan.vocab):
            raise ValueError(f"token ids must be in 0..{self.plan.vocab - 1}")
        return t.astype(np.int32)

    def decode(self, tokens, attention=None, attention_hook=None):
        """One step on every rank: tokens [B] -> rank 0's result ([B, V] float32 logits, or with
        lm_head="argmax" the greedy tokens [B] int32). attention_hook(rank, layer, q, k, v, lengths,
        attend) observes or replaces a rank's attention (its local heads)."""
        from llama_min.model import _hooked
        from santa_cupy import AttentionSetting

        attention = attention or AttentionSetting()
        t = self._check_tokens(tokens)
        for c in self.caches:
            if c.length >= c.max_len:
                raise ValueError(f"KV cache is full (max_len {c.max_len})")

        def step(r):
            m, cache = self.models[r], self.caches[r]
            cache.reserve(cache.length + 1)
            hook = None if attention_hook is None else (
                lambda li, q, k, v, lens, attend: attention_hook(r, li, q, k, v, lens, attend))
            attn = _hooked(m._eager_attention(attention, cache), hook)
            out = m._decode_core(m.xp.asarray(t), cache, attn, self.backends[r])
            cache.advance()
            return out
        return self._on_ranks(step)[0]

    def prefill(self, token_ids, chunk: int | None = None):
        """token_ids [B, T] appended on every rank (LlamaModel.prefill in chunks, its O / down
        products and embedding all-reduced, the logits gathered) -> the last position's logits
        [B, V] float32 (rank 0's)."""
        from llama_min.model import CHUNK

        ids = np.asarray(token_ids)
        return self._on_ranks(lambda r: self.models[r].prefill(ids, self.caches[r], chunk or CHUNK))[0]

    def prefill_by_decoding(self, token_ids):
        """token_ids [B, T] appended token by token (decode steps, exact attention; the SANTA step
        counter left where it was, as prefill leaves it) -> the last position's logits."""
        from santa_cupy import AttentionSetting

        ids = np.asarray(token_ids)
        if ids.ndim != 2 or ids.shape[0] != self.caches[0].batch or ids.shape[1] < 1:
            raise ValueError(f"token_ids must be [B={self.caches[0].batch}, T>=1], got shape {ids.shape}")
        steps = [c.step for c in self.caches]
        out = None
        for j in range(ids.shape[1]):
            out = self.decode(ids[:, j], AttentionSetting(method="dense"))
        for c, s in zip(self.caches, steps):
            c.step = s
        return out

    def close(self):
        for b in self.backends:
            b.close()


class TensorParallelGraphDecoder:
    """One decode step of every rank captured as one CUDA graph per rank (the NCCL all-reduces and
    the all-gather inside), replayed from the host thread: each rank's graph is launched on its
    stream under its device, the collectives synchronise the GPUs among themselves.

        dec = TensorParallelGraphDecoder(models, comms, caches, devices, attention)   # caches filled
        logits = dec.replay(tokens)        # rank 0's [B, V] float32 (a static buffer)

    Construction, per rank in its own thread: the backend (gpu_backend wrapped in a ShardedBackend),
    the rank's DecodePlan (head_offset: its first global head), a warm-up step (all ranks at once:
    compiles the kernels, fills the private pool, connects NCCL), then, after every rank's warm-up
    ended, the capture (thread-local capture mode; the garbage collector off meanwhile). Like
    GraphDecoder the graph advances the positions and the SANTA step counter itself."""

    def __init__(self, models, comms, caches, devices, attention=None, gemv=None, lm_head: str = "gather",
                 programmatic_launch: bool | None = None):
        import gc

        import cupy

        from llama_min.backends import gpu_backend
        from santa_cupy import AttentionSetting
        from santa_cupy import kernels

        self.models, self.comms, self.caches, self.devices = list(models), list(comms), list(caches), list(devices)
        self.tp = len(self.models)
        self.attention = attention or AttentionSetting()
        self.plan_tp = self.models[0].tp_plan
        for c in self.caches:
            if c.length < 1 or c.length >= c.max_len:
                raise ValueError("TensorParallelGraphDecoder needs filled caches with room for a step")
        n = self.tp
        self.streams, self.pools, self.plans = [None] * n, [None] * n, [None] * n
        self.backends, self.tokens, self.logits, self.graphs = [None] * n, [None] * n, [None] * n, [None] * n

        def setup_and_warm(r):
            m, cache = self.models[r], self.caches[r]
            self.streams[r] = cupy.cuda.Stream(non_blocking=False)
            self.pools[r] = cupy.cuda.MemoryPool()
            self.plans[r] = m.make_plan(self.attention, cache)
            self.backends[r] = ShardedBackend(gpu_backend(m, cache.batch, gemv), self.comms[r], self.plan_tp, r,
                                              lm_head)
            with cupy.cuda.using_allocator(self.pools[r].malloc), self.streams[r]:
                cache.reserve(cache.length + 1)
                self.tokens[r] = cupy.zeros((cache.batch,), cupy.int32)
                m._decode_core(self.tokens[r], cache, self._attn(r), self.backends[r])
            self.streams[r].synchronize()

        def capture(r):
            m, cache, stream = self.models[r], self.caches[r], self.streams[r]
            mode = getattr(cupy.cuda.runtime, "streamCaptureModeThreadLocal", None)
            with cupy.cuda.using_allocator(self.pools[r].malloc), stream:
                stream.begin_capture(*(() if mode is None else (mode,)))
                try:
                    self.logits[r] = m._decode_core(self.tokens[r], cache, self._attn(r), self.backends[r])
                    cache.lengths += 1
                    self.plans[r].advance()
                finally:
                    self.graphs[r] = stream.end_capture()
            stream.synchronize()

        # programmatic dependent launch of santa-cupy's kernels as GraphDecoder's (None: on where the
        # GPU has it); the flag is process-wide, so it is set once here for every rank's capture
        was_programmatic = kernels.programmatic_launch()
        with cupy.cuda.Device(self.devices[0]):
            self.programmatic_launch = kernels.set_programmatic_launch(programmatic_launch is not False)
        try:
            self._run(setup_and_warm)
            gc.collect()
            was_on = gc.isenabled()
            gc.disable()
            try:
                self._run(capture)
            finally:
                if was_on:
                    gc.enable()
        except BaseException:
            self.close()
            raise
        finally:
            kernels.set_programmatic_launch(was_programmatic)

    def _attn(self, r):
        plan, kw = self.plans[r], self.caches[r].attention_kwargs
        return lambda li, q, kc, vc, lens: plan.run(q, kc, vc, lens, layer=li, validate=False, **kw)

    def _run(self, fn):
        import cupy

        def on_device(r):
            with cupy.cuda.Device(self.devices[r]):
                return fn(r)
        return run_ranks(on_device, self.tp)

    def replay(self, tokens=None):
        """tokens [B] host ints (None: what the inputs hold) -> rank 0's logits (static buffer)."""
        import cupy
        for c in self.caches:
            if c.length >= c.max_len:
                raise ValueError(f"KV cache is full (max_len {c.max_len})")
        t = None if tokens is None else np.asarray(tokens, np.int32).reshape(-1)
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]), self.streams[r]:
                self.caches[r].reserve(self.caches[r].length + 1)
                if t is not None:
                    self.tokens[r].set(t, stream=self.streams[r])
                self.graphs[r].launch(self.streams[r])
        for c in self.caches:
            c.advance(on_device=False)
        return self.logits[0]

    def synchronize(self):
        import cupy
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]):
                self.streams[r].synchronize()

    def close(self):
        """Release the graphs, the private pools and the cuBLAS handles (each under its device)."""
        import cupy
        for r in range(self.tp):
            with cupy.cuda.Device(self.devices[r]):
                if self.backends[r] is not None:
                    self.backends[r].close()
                self.graphs[r] = None
                if self.pools[r] is not None:
                    self.pools[r].free_all_blocks()
        self.backends = [None] * self.tp

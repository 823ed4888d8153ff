"""The decode step's tensor-parallel seams: ShardedBackend (a rank's Backend: the inner backend's
products plus the all-reduces and the lm-head's all-gather or distributed argmax) and the
vocabulary-split embedding and logit gather it shares with the rank models' prefill."""

from __future__ import annotations

import numpy as np

from llama_min.backends import Backend
from llama_min.tensor_parallel.comms import Communicator
from llama_min.tensor_parallel.sharding import ShardPlan, _xp_of


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

"""The rank models: RankModel (one rank's LlamaModel: the shard's shapes, head_offset its first global
query head, its prefill's collectives) and the functions that build them, on the CPU, on the
current GPU, or one a GPU (rank_models_on_gpus)."""

from __future__ import annotations

import contextlib
import functools

import numpy as np

from llama_min.tensor_parallel.backend import _gather_logits, _vocab_embed
from llama_min.tensor_parallel.sharding import ShardPlan, rank_config, shard_weights


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

"""Tensor-parallel decoding of a LlamaModel over N ranks: the sharding arithmetic and the weight
shards (`sharding`), a Communicator (`comms`: FakeCommunicator on the CPU, NcclCommunicator on
CuPy's NCCL), the Backend wrapper that puts the collectives into the one decode step (`backend`),
the rank models (`ranks`) and the decoders (`decoders`). Every public name is re-exported here.

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

from llama_min.tensor_parallel.backend import ShardedBackend
from llama_min.tensor_parallel.comms import (NCCL_ENV, Communicator, FakeCommunicator, FakeGroup, NcclCommunicator,
                                             _nccl_environment)     # noqa: F401  (santa-cupy bench e2e's)
from llama_min.tensor_parallel.decoders import TensorParallelDecoder, TensorParallelGraphDecoder, run_ranks
from llama_min.tensor_parallel.ranks import make_rank_model, rank_model, rank_models_on_gpus
from llama_min.tensor_parallel.sharding import (ShardPlan, rank_config, rank_weight_shapes, shard_plan, shard_weights,
                                                valid_tp_degrees)

__all__ = ["ShardPlan", "shard_plan", "valid_tp_degrees", "shard_weights", "rank_config", "rank_model",
           "make_rank_model", "rank_models_on_gpus", "rank_weight_shapes",
           "Communicator", "FakeGroup", "FakeCommunicator", "NcclCommunicator", "ShardedBackend",
           "TensorParallelDecoder", "TensorParallelGraphDecoder", "run_ranks", "NCCL_ENV"]

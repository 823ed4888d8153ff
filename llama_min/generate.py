"""Token generation: prefill the prompt, then decode one token at a time with sampling.

    result = generate(model, prompt_ids, max_new_tokens=64, sampling=SamplingConfig(),
                      attention=DENSE, stop_ids=[2], on_token=print)

The tokens are chosen where the logits are (llama_min.sampling.TokenSampler: the NumPy reference on
the CPU, the kernel on the GPU, the same tokens for the same seed); with use_graph the sampler ends
the captured step and one int32 a token comes back to the host (for the stop tokens and the output).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from llama_min.model import DENSE, AttentionSetting, LlamaModel
from llama_min.sampling import SamplerParams, SamplingConfig, TokenSampler, sample_reference

__all__ = ["GenerationResult", "Sampler", "SamplingConfig", "generate", "penalize_repetition"]


@dataclass
class GenerationResult:
    prompt_tokens: list            # prompt token ids
    generated_tokens: list         # generated ids (a stop token that ended generation excluded)
    timings: dict = field(default_factory=dict)   # prefill_s, decode_s, tokens_per_s
    stop_reason: str = "length"    # "stop" (a stop id) | "length" (max_new_tokens or context)


class Sampler:
    """Host-side next-token choice for one sequence from logits [V] (NumPy): llama_min.sampling's
    algorithm (sample_reference, what the GPU's kernel draws too), its step advancing every call."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.step = 0

    def __call__(self, logits: np.ndarray, context=()) -> int:
        """The next token from logits [V]; `context` (token ids so far) for the repetition penalty."""
        l = np.asarray(logits, dtype=np.float32).reshape(1, -1)
        params = SamplerParams.from_config(self.cfg, l.shape[1])
        seen = None
        if params.penalized and len(context):
            seen = np.zeros(l.shape, np.uint8)
            seen[0, np.asarray(context, np.int64)] = 1
        tok = int(sample_reference(l, params, self.step, seen)[0])
        self.step += 1
        return tok


def penalize_repetition(logits: np.ndarray, context, penalty: float) -> np.ndarray:
    """CTRL's (and Hugging Face's) repetition penalty: the logit of every token in `context` is
    divided by `penalty` where positive, multiplied by it where negative. logits [V] float64 (the
    formula; the samplers apply it in float32: llama_min.sampling.penalized_logits)."""
    seen = np.unique(np.asarray(context, dtype=np.int64))
    out = logits.copy()
    z = out[seen]
    out[seen] = np.where(z > 0, z / penalty, z * penalty)
    return out


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _next(sampler: TokenSampler, logits) -> int:
    """Sample (on the logits' device), advance the sampler, bring the one token to the host."""
    tok = int(_host(sampler(logits))[0])
    sampler.advance()
    return tok


def _sync(model):
    if model.xp is not np:
        model.xp.cuda.get_current_stream().synchronize()


def generate(model: LlamaModel, prompt_ids, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
             attention: AttentionSetting = DENSE, stop_ids=(), on_token=None,
             use_graph: bool = False, on_prefill=None, page_size: int | None = None) -> GenerationResult:
    """Generate up to `max_new_tokens` after `prompt_ids` (a list of ints, batch 1).

    Stops early at a token in `stop_ids` (not included in the result) or when the context window
    (max_position_embeddings) is full. `on_token(id)` is called for every kept token.
    `use_graph` (GPU only) replays the decode step as a CUDA graph (GraphDecoder).
    `on_prefill(done, total)` is called before the prefill and after each of its chunks.
    `page_size` (1..256): a paged KV cache of pages of that many rows (KVCache's paged form);
    None: the contiguous cache.
    timings: prefill_s (prompt + first token's logits), decode_s (the decode steps),
    tokens_per_s = decode steps / decode_s (0 when there were none)."""
    prompt = [int(t) for t in prompt_ids]
    ctx = model.cfg.max_position_embeddings
    if not prompt:
        raise ValueError("the prompt is empty (need at least one token)")
    if len(prompt) >= ctx:
        raise ValueError(f"prompt has {len(prompt)} tokens; the context window is {ctx} "
                         f"(max_position_embeddings), which leaves no room to generate")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stop = {int(s) for s in stop_ids}
    n_new = min(max_new_tokens, ctx - len(prompt))
    out, reason = [], "length"
    if n_new == 0:
        return GenerationResult(prompt, out, {"prefill_s": 0.0, "decode_s": 0.0, "tokens_per_s": 0.0}, reason)

    cache = model.new_cache(1, len(prompt) + n_new, page_size=page_size)
    sampler = TokenSampler(model.xp, sampling, 1, model.cfg.vocab_size, context=[prompt])
    t0 = time.perf_counter()
    if on_prefill is not None:
        on_prefill(0, len(prompt))
    logits = model.prefill(np.asarray([prompt], dtype=np.int32), cache, progress=on_prefill)
    tok = _next(sampler, logits)
    t1 = time.perf_counter()
    graph = None
    steps = 0
    try:
        while True:
            if tok in stop:
                reason = "stop"
                break
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if len(out) >= n_new:
                break
            if use_graph and graph is None:
                from llama_min.graph import GraphDecoder
                graph = GraphDecoder(model, cache, attention, sampler=sampler)
                tok = int(graph.step([tok])[0])
            elif graph is not None:
                tok = int(graph.step()[0])          # the graph fed its own sample back
            else:
                tok = _next(sampler, model.decode(np.asarray([tok], dtype=np.int32), cache, attention))
            steps += 1
    finally:
        if graph is not None:
            graph.close()
    _sync(model)
    t2 = time.perf_counter()
    decode_s = t2 - t1
    timings = {"prefill_s": t1 - t0, "decode_s": decode_s,
               "tokens_per_s": steps / decode_s if steps and decode_s > 0 else 0.0}
    return GenerationResult(prompt, out, timings, reason)

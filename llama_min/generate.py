"""Token generation: prefill the prompt, then decode one token at a time with sampling.

    result = generate(model, prompt_ids, max_new_tokens=64, sampling=SamplingConfig(),
                      attention=AttentionConfig(), stop_ids=[2], on_token=print)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from llama_min.model import AttentionConfig, LlamaModel


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


@dataclass
class GenerationResult:
    prompt_tokens: list            # prompt token ids
    generated_tokens: list         # generated ids (a stop token that ended generation excluded)
    timings: dict = field(default_factory=dict)   # prefill_s, decode_s, tokens_per_s
    stop_reason: str = "length"    # "stop" (a stop id) | "length" (max_new_tokens or context)


class Sampler:
    """Host-side next-token choice from logits [V] float32 (NumPy)."""

    def __init__(self, cfg: SamplingConfig):
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)

    def __call__(self, logits: np.ndarray, context=()) -> int:
        """The next token from logits [V]; `context` (token ids so far) for the repetition penalty."""
        c = self.cfg
        logits = np.asarray(logits, dtype=np.float64)
        if c.repetition_penalty != 1.0 and len(context):
            logits = penalize_repetition(logits, context, c.repetition_penalty)
        if c.greedy or c.temperature == 0 or c.top_k == 1:
            return int(np.argmax(logits))
        z = logits / c.temperature
        order = np.argsort(-z, kind="stable")            # best first
        if c.top_k > 0:
            order = order[:c.top_k]
        zs = z[order]
        p = np.exp(zs - zs[0])
        p /= p.sum()
        if c.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), c.top_p) + 1)   # smallest prefix with mass >= top_p
            p = p[:keep] / p[:keep].sum()
            order = order[:keep]
        return int(order[self.rng.choice(len(p), p=p)])


def penalize_repetition(logits: np.ndarray, context, penalty: float) -> np.ndarray:
    """CTRL's (and Hugging Face's) repetition penalty: the logit of every token in `context` is
    divided by `penalty` where positive, multiplied by it where negative. logits [V] float64."""
    seen = np.unique(np.asarray(context, dtype=np.int64))
    out = logits.copy()
    z = out[seen]
    out[seen] = np.where(z > 0, z / penalty, z * penalty)
    return out


def _host(x) -> np.ndarray:
    return x.get() if hasattr(x, "get") and not isinstance(x, np.ndarray) else np.asarray(x)


def _sync(model):
    if model.xp is not np:
        model.xp.cuda.get_current_stream().synchronize()


def generate(model: LlamaModel, prompt_ids, *, max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(),
             attention: AttentionConfig = AttentionConfig(), stop_ids=(), on_token=None,
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
    sampler = Sampler(sampling)
    n_new = min(max_new_tokens, ctx - len(prompt))
    out, reason = [], "length"
    if n_new == 0:
        return GenerationResult(prompt, out, {"prefill_s": 0.0, "decode_s": 0.0, "tokens_per_s": 0.0}, reason)

    cache = model.new_cache(1, len(prompt) + n_new, page_size=page_size)
    t0 = time.perf_counter()
    if on_prefill is not None:
        on_prefill(0, len(prompt))
    logits = model.prefill(np.asarray([prompt], dtype=np.int32), cache, progress=on_prefill)
    tok = sampler(_host(logits)[0], prompt)
    t1 = time.perf_counter()
    graph = None
    steps = 0
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
            graph = GraphDecoder(model, cache, attention)
        if graph is not None:
            logits = graph.replay([tok])
        else:
            logits = model.decode(np.asarray([tok], dtype=np.int32), cache, attention)
        tok = sampler(_host(logits)[0], prompt + out if sampling.repetition_penalty != 1.0 else ())
        steps += 1
    _sync(model)
    t2 = time.perf_counter()
    decode_s = t2 - t1
    timings = {"prefill_s": t1 - t0, "decode_s": decode_s,
               "tokens_per_s": steps / decode_s if steps and decode_s > 0 else 0.0}
    return GenerationResult(prompt, out, timings, reason)

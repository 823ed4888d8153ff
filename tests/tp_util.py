"""A tiny random Llama in memory (no checkpoint) for the tensor-parallel tests."""

import numpy as np

from llama_min.config import LlamaConfig
from llama_min.model import LlamaModel


def random_config(H=8, KVH=8, D=16, d=48, inter=80, layers=2, vocab=61, max_pos=64, tie=False) -> LlamaConfig:
    return LlamaConfig(hidden_size=d, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=H,
                       num_key_value_heads=KVH, head_dim=D, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=max_pos, vocab_size=vocab,
                       tie_word_embeddings=tie, bos_token_id=None, source="tests (random weights)")


def random_weights(cfg: LlamaConfig, seed=0, xp=np, dtype=np.float32) -> dict:
    rng = np.random.default_rng(seed)
    H, KVH, D, d, I, V = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size,
                          cfg.intermediate_size, cfg.vocab_size)

    def w(rows, cols, scale=None):
        a = rng.standard_normal((rows, cols)) * (scale if scale is not None else 1.0 / np.sqrt(cols))
        return xp.asarray(a.astype(dtype))

    def norm():
        return xp.asarray((1.0 + 0.1 * rng.standard_normal(d)).astype(np.float32))

    layers = [{"attn_norm": norm(), "wqkv": w((H + 2 * KVH) * D, d, 2.0 / np.sqrt(d)), "wo": w(d, H * D),
               "mlp_norm": norm(), "w_gu": w(2 * I, d), "w_down": w(d, I)} for _ in range(cfg.num_hidden_layers)]
    embed = w(V, d, 1.0)
    return {"embed": embed, "lm_head": embed if cfg.tie_word_embeddings else w(V, d), "norm": norm(),
            "layers": layers}


def random_model(seed=0, **shape) -> LlamaModel:
    cfg = random_config(**shape)
    return LlamaModel(cfg, random_weights(cfg, seed), np, "cpu", "float32", "float32")

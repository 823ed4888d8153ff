"""llama_min: a minimal Llama-architecture decoder on NumPy (CPU) or CuPy (GPU).

    from llama_min import LlamaModel, AttentionSetting, SamplingConfig, generate
"""

from llama_min.config import LlamaConfig, load_config
from llama_min.model import DENSE, AttentionHook, AttentionSetting, KVCache, LlamaModel
from llama_min.generate import GenerationResult, SamplingConfig, generate
from llama_min.graph import GraphDecoder

__all__ = [
    "DENSE", "AttentionHook", "AttentionSetting", "GenerationResult", "GraphDecoder", "KVCache", "LlamaConfig",
    "LlamaModel", "SamplingConfig", "generate", "load_config",
]

"""llama_min: a minimal Llama-architecture decoder on NumPy (CPU) or CuPy (GPU).

    from llama_min import LlamaModel, AttentionConfig, SamplingConfig, generate
"""

from llama_min.config import LlamaConfig, load_config
from llama_min.model import AttentionConfig, GraphDecoder, KVCache, LlamaModel
from llama_min.generate import GenerationResult, SamplingConfig, generate

__all__ = [
    "AttentionConfig", "GenerationResult", "GraphDecoder", "KVCache", "LlamaConfig",
    "LlamaModel", "SamplingConfig", "generate", "load_config",
]

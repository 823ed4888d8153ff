"""santa-cupy: stochastic sparse decode attention (SANTA / S2ANTA) on CuPy, with a NumPy reference."""

from santa_cupy.attention import AttentionInfo, DecodePlan, decode_attention

__all__ = ["AttentionInfo", "DecodePlan", "decode_attention"]
__version__ = "0.1.0"

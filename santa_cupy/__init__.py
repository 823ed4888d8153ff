"""santa-cupy: stochastic sparse decode attention (SANTA / S2ANTA) on CuPy, with a NumPy reference.

The public API: ``decode_attention`` (one call), ``DecodePlan`` (repeated calls of one shape on the
GPU), ``AttentionSetting`` (the estimator both take), ``AttentionInfo`` (their diagnostics) and
``clear_plan_cache``; ``key_scores`` (the estimated scores of a key-sampling setting); the
blocked K layout of GPU key sampling: ``santa_cupy.key_layout``.
"""

from santa_cupy.attention import clear_plan_cache, decode_attention, key_scores
from santa_cupy.info import AttentionInfo
from santa_cupy.plan import DecodePlan
from santa_cupy.setting import AttentionSetting

__all__ = ["AttentionInfo", "AttentionSetting", "DecodePlan", "clear_plan_cache", "decode_attention", "key_scores"]
__version__ = "0.1.0"

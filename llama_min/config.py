"""LlamaConfig: the fields of a Hugging Face `config.json` that a Llama decoder needs.

One table (`_FIELDS`) lists every field we read, its default (REQUIRED = must be present) and its
type; `load_config(dir_or_file)` validates and returns a frozen `LlamaConfig`.
"""

from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field

REQUIRED = object()

# config.json key -> (default, type). The dataclass below has exactly these fields.
_FIELDS = {
    "hidden_size": (REQUIRED, int),
    "intermediate_size": (REQUIRED, int),
    "num_hidden_layers": (REQUIRED, int),
    "num_attention_heads": (REQUIRED, int),
    "num_key_value_heads": (None, int),         # None -> num_attention_heads (no GQA)
    "head_dim": (None, int),                    # None -> hidden_size // num_attention_heads
    "rms_norm_eps": (1e-6, float),
    "rope_theta": (10000.0, float),
    "rope_scaling": (None, dict),
    "max_position_embeddings": (2048, int),
    "vocab_size": (REQUIRED, int),
    "tie_word_embeddings": (False, bool),
    "bos_token_id": (None, int),
    "eos_token_id": (None, list),               # int or list in the file; always a list here
}

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM",)
SUPPORTED_MODEL_TYPES = ("llama",)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """config.json is missing, malformed, or describes a model llama_min cannot run."""


@dataclass(frozen=True)
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None                   # None, or {"rope_type": "llama3", factor, ...}
    max_position_embeddings: int
    vocab_size: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_id: list = field(default_factory=list)
    source: str = ""                            # the file it came from, for error messages

    @property
    def group_size(self) -> int:                # G = query heads per KV head
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "LlamaConfig":
        return _parse(raw, source)


def load_config(path) -> LlamaConfig:
    """Read `path` (a checkpoint directory or a config.json file)."""
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    return _parse(read_json_object(path, ConfigError), str(path))


def read_json_object(path, error=ValueError) -> dict:
    """The JSON object in file `path`; `error` (an exception class) with a one-line message naming
    the file when it is unreadable, not JSON or not an object."""
    try:
        raw = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise error(f"{path}: expected a JSON object at top level")
    return raw


def _err(source, key, msg):
    return ConfigError(f"{source}: field '{key}': {msg}")


def _parse(raw: dict, source: str) -> LlamaConfig:
    archs = raw.get("architectures")
    if archs is not None:
        if not isinstance(archs, list) or not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise _err(source, "architectures", f"{archs!r} is not supported (expected one of {list(SUPPORTED_ARCHITECTURES)})")
    mt = raw.get("model_type")
    if mt is not None and mt not in SUPPORTED_MODEL_TYPES:
        raise _err(source, "model_type", f"{mt!r} is not supported (expected 'llama')")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise _err(source, "hidden_act", f"{act!r} is not supported (expected 'silu')")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key):
            raise _err(source, key, "biases are not supported")

    vals = {}
    for key, (default, typ) in _FIELDS.items():
        v = raw.get(key, default)
        if v is REQUIRED:
            raise _err(source, key, "missing (required)")
        if v is None:
            vals[key] = None
            continue
        if typ is list:
            if isinstance(v, int) and not isinstance(v, bool):
                v = [v]
            if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise _err(source, key, f"expected an integer or a list of integers, got {v!r}")
        elif typ is float:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise _err(source, key, f"expected a number, got {v!r}")
            v = float(v)
        elif typ is int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise _err(source, key, f"expected an integer, got {v!r}")
        elif not isinstance(v, typ):
            raise _err(source, key, f"expected {typ.__name__}, got {v!r}")
        vals[key] = v

    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size", "max_position_embeddings"):
        if vals[key] <= 0:
            raise _err(source, key, f"must be positive, got {vals[key]}")
    h = vals["num_attention_heads"]
    if vals["num_key_value_heads"] is None:
        vals["num_key_value_heads"] = h
    kvh = vals["num_key_value_heads"]
    if kvh <= 0 or h % kvh:
        raise _err(source, "num_key_value_heads", f"{kvh} does not divide num_attention_heads={h}")
    if vals["head_dim"] is None:
        if vals["hidden_size"] % h:
            raise _err(source, "num_attention_heads", f"{h} does not divide hidden_size={vals['hidden_size']}")
        vals["head_dim"] = vals["hidden_size"] // h
    if vals["head_dim"] <= 0 or vals["head_dim"] % 2:
        raise _err(source, "head_dim", f"must be positive and even, got {vals['head_dim']}")
    if vals["rms_norm_eps"] <= 0 or vals["rope_theta"] <= 0:
        raise _err(source, "rms_norm_eps" if vals["rms_norm_eps"] <= 0 else "rope_theta", "must be positive")
    vals["rope_scaling"] = _parse_rope_scaling(vals["rope_scaling"], source)
    vals["eos_token_id"] = vals["eos_token_id"] or []
    return LlamaConfig(**vals, source=source)


def _parse_rope_scaling(rs, source):
    if rs is None:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind != "llama3":
        raise _err(source, "rope_scaling.rope_type",
                   f"{kind!r} is not supported (supported: 'llama3', 'default')")
    out = {"rope_type": "llama3"}
    for key in LLAMA3_ROPE_KEYS:
        v = rs.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise _err(source, f"rope_scaling.{key}", f"expected a positive number, got {v!r}")
        out[key] = float(v)
    if out["high_freq_factor"] <= out["low_freq_factor"]:
        raise _err(source, "rope_scaling.high_freq_factor", "must exceed low_freq_factor")
    return out

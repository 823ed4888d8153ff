"""The CLI's error paths (issue #20): every option of generate / eval / bench / models given a bad
value, missing or corrupt model files, unreadable prompt files and Ctrl-C at each phase.

Each case asserts the exit code (2: a bad command line, 1: a failure, 130: interrupted) and one
message line without a traceback. They run through cli.main, as the santa-cupy script does, on the
tiny random Llama of test_model.py (no download, no GPU).
"""

import builtins
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from santa_cupy.cli import main as cli
from test_cli_generate import _write_tokenizer
from test_model import make_tiny

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path, _, _ = make_tiny(tmp_path_factory.mktemp("tiny"), H=4, KVH=2, max_pos=32)
    _write_tokenizer(path)
    return path


@pytest.fixture()
def model(tiny_model, tmp_path):
    """A copy of the tiny checkpoint that a test may damage."""
    return Path(shutil.copytree(tiny_model, tmp_path / "model"))


def invoke(args):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def with_model(command, model):
    """command (generate ... or eval <sub> ...) with --model after the (sub)command's name."""
    n = 2 if command[0] == "eval" else 1
    return [*command[:n], "--model", model, *command[n:]]


def no_traceback(res):
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)


def error_line(res, exit_code) -> str:
    """The one 'Error: ...' line of a failed command (click prints usage lines above it for exit 2)."""
    assert res.exit_code == exit_code, res.output
    no_traceback(res)
    errors = [ln for ln in res.output.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1, res.output
    return errors[0]


# ------------------------------------------------------------------------- bad option values

GENERATE_BAD = [
    (["--max-new-tokens", "-1"], "--max-new-tokens"), (["--max-new-tokens", "many"], "--max-new-tokens"),
    (["--temperature", "-0.5"], "--temperature"), (["--temperature", "hot"], "--temperature"),
    (["--top-k", "-1"], "--top-k"), (["--top-k", "1.5"], "--top-k"),
    (["--top-p", "0"], "--top-p"), (["--top-p", "1.01"], "--top-p"), (["--top-p", "x"], "--top-p"),
    (["--repetition-penalty", "0"], "--repetition-penalty"), (["--repetition-penalty", "-2"], "--repetition-penalty"),
    (["--seed", "-1"], "--seed"), (["--seed", str(2**64)], "--seed"), (["--seed", "1.5"], "--seed"),
    (["--device", "tpu"], "--device"), (["--dtype", "int8"], "--dtype"),
    (["--attention", "sparse"], "--attention"), (["--samples", "0"], "--samples"),
    (["--samples", str(2**20 + 1)], "--samples"), (["--samples", "lots"], "--samples"),
    (["--sampler", "uniform"], "--sampler"), (["--budget", "half"], "--budget"),
    (["--format", "xml"], "--format"), (["--encoding", "klingon"], "--encoding"),
    (["--cuda-graph", "--device", "cpu"], "--cuda-graph"),
    (["--greedy", "--top-k", "3"], "--greedy"),
    (["--prompt-file", "/no/such/file"], "--prompt-file"),
]


@pytest.mark.parametrize("args,option", GENERATE_BAD, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_generate_bad_option_fails_before_loading(args, option):
    """Exit 2 naming the option; the model (which does not exist) is never looked up."""
    prompt = [] if "--prompt-file" in args else ["--prompt", "w1"]
    res = invoke(["generate", "--model", "/no/such/model", *prompt, *args])
    assert option in error_line(res, 2)
    assert "loading" not in res.output and "unknown model" not in res.output


@pytest.mark.parametrize("args,code,words", [
    ([], 2, ["--prompt", "--prompt-file"]), (["--prompt", "w1", "--prompt-file", __file__], 2, ["exactly one"]),
    (["--prompt", ""], 1, ["prompt is empty"]), (["--prompt", "w1 " * 40], 1, ["40 tokens", "context window"]),
    (["--prompt", "w1", "--chat"], 1, ["chat template"]),
])
def test_generate_bad_prompt_is_one_line(args, code, words, tiny_model):
    line = error_line(invoke(["generate", "--model", tiny_model, *args]), code)
    assert all(w in line for w in words), line


EVAL_BAD = [
    (["--device", "tpu"], "--device"), (["--dtype", "float64"], "--dtype"),
    (["--seeds", str(2**64)], "--seeds"), (["--seeds", "1,-1"], "--seeds"),
    (["--samples", str(2**20 + 1)], "--samples"), (["--samples", ","], "--samples"),
    (["--samplers", ""], "--samplers"), (["--block-n", "0"], "--block-n"),
    (["--json", "/no/such/dir/out.json"], "--json"), (["--markdown", "/no/such/dir/out.md"], "--markdown"),
    (["--plot", "/no/such/dir/out.png"], "--plot"), (["--json", "/"], "--json"),
]
EVAL_ONLY = {   # the options of one subcommand
    "kernel": [(["--context", "3"], "--context"), (["--layers", "first"], "--layers")],
    "model": [(["--context", "x"], "--context"), (["--steps", "-3"], "--steps"),
              (["--greedy-tokens", "0"], "--greedy-tokens")],
    "retrieval": [(["--lengths", "1"], "--lengths"), (["--depths", "-0.1"], "--depths"),
                  (["--needles", "x"], "--needles"), (["--answer-tokens", "-1"], "--answer-tokens")],
}
EVAL_CASES = [(sub, args, opt) for sub in EVAL_ONLY for args, opt in EVAL_BAD + EVAL_ONLY[sub]]


@pytest.mark.parametrize("sub,args,option", EVAL_CASES, ids=lambda a: " ".join(a) if isinstance(a, list) else a)
def test_eval_bad_option_fails_before_loading(sub, args, option, monkeypatch):
    monkeypatch.setattr("llama_min.models.resolve_model", lambda *a, **k: pytest.fail("model resolved"))
    assert option in error_line(invoke(["eval", sub, "--small", *args]), 2)


@pytest.mark.parametrize("args,option", [
    (["model", "--greedy-tokens", "28"], "--greedy-tokens"),           # 32 positions: no room for a text
    (["retrieval", "--answer-tokens", "29"], "--answer-tokens"),       # no room for a prompt
    (["retrieval", "--answer-tokens", "17"], "--answer-tokens"),       # room, but less than the question
    (["kernel", "--context", "33"], "--context"), (["kernel", "--layers", "-9"], "layers"),
    (["retrieval", "--lengths", "40"], "--lengths"),
])
def test_eval_options_beyond_the_model_fail_with_one_line(args, option, tiny_model):
    """Checked against the model's config (or tokenizer): still exit 2, one line."""
    assert option in error_line(invoke(["eval", args[0], "--small", "--model", tiny_model, *args[1:]]), 2)


def test_eval_merge_of_bad_files_is_one_line(tmp_path):
    for name, content in [("broken.json", b"{oops"), ("list.json", b"[1, 2]"), ("latin1.json", b"\xff{}"),
                          ("other.json", b'{"rows": []}')]:
        (tmp_path / name).write_bytes(content)
        assert name in error_line(invoke(["eval", "merge", tmp_path / name]), 1)
    assert "FILES" in error_line(invoke(["eval", "merge", tmp_path / "missing.json"]), 2)


BENCH_BAD = [
    (["kernels", "--batch", "0"], "--batch"), (["kernels", "--batch", ""], "--batch"),
    (["kernels", "--context", "32x"], "--context"), (["kernels", "--shape", "gpt2"], "--shape"),
    (["kernels", "--methods", "santa-global"], "--methods"), (["kernels", "--repeats", "2"], "--repeats"),
    (["kernels", "--inner", "0"], "--inner"), (["kernels", "--mem-gb", "0.5"], "--mem-gb"),
    (["kernels", "--json", "/no/such/dir/k.json"], "--json"), (["kernels", "--markdown", "/"], "--markdown"),
    (["kernels", "--plot", "/no/such/dir/k.png"], "--plot"), (["kernels", "--full", "--quick"], "--quick"),
    (["e2e", "--context", "0"], "--context"), (["e2e", "--batch", "-1"], "--batch"),
    (["e2e", "--steps", "0"], "--steps"),
    (["e2e", "--warmup", "-1"], "--warmup"), (["e2e", "--methods", "torch-flash"], "--methods"),
    (["e2e", "--layers", "0"], "--layers"), (["e2e", "--model", "/no/such/model"], "--model"),
    (["e2e", "--products", "magic"], "--products"), (["e2e", "--mem-gb", "0"], "--mem-gb"),
    (["e2e", "--json", "/no/such/dir/e.json"], "--json"),
    (["e2e", "--no-graph", "--products", "gemv"], "--products"),
    (["stages", "--batch", "0"], "--batch"), (["stages", "--context", "k"], "--context"),
    (["stages", "--shape", "gpt2"], "--shape"), (["stages", "--methods", "torch-flash"], "--methods"),
    (["stages", "--repeats", "1"], "--repeats"), (["stages", "--inner", "0"], "--inner"),
    (["stages", "--mem-gb", "0"], "--mem-gb"),
    (["products", "--tokens", "x"], "--tokens"), (["products", "--tokens", "5"], "--tokens"),
    (["products", "--methods", "cublas,magic"], "--methods"), (["products", "--repeats", "0"], "--repeats"),
    (["products", "--markdown", "/no/such/dir/p.md"], "--markdown"),
]


@pytest.mark.parametrize("args,option", BENCH_BAD, ids=lambda a: " ".join(a) if isinstance(a, list) else None)
def test_bench_bad_option_is_one_line(args, option):
    """Exit 2 naming the option, checked before the GPU is needed (none here)."""
    assert option in error_line(invoke(["bench", *args]), 2)


@pytest.mark.parametrize("command", ["kernels", "e2e", "stages", "products"])
def test_bench_without_a_gpu_is_one_line(command, monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)      # `import cupy` fails, installed or not
    assert "CuPy" in error_line(invoke(["bench", command]), 1)


def test_models_bad_arguments_are_one_line(tmp_path):
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x05" * 20)
    for args, code, word in [
        (["pull", "--forse"], 2, "--forse"), (["list", "--all"], 2, "--all"),
        (["convert-gguf"], 2, "FILE"), (["convert-gguf", tmp_path / "none.gguf", tmp_path / "o"], 2, "FILE"),
        (["convert-gguf", tmp_path, tmp_path / "o"], 2, "FILE"), (["convert-gguf", garbage, garbage], 2, "DIR"),
        (["convert-gguf", garbage, tmp_path / "o1"], 1, "garbage.gguf"),
        (["convert-gguf", empty, tmp_path / "o2"], 1, "empty.gguf"),
        (["convert-gguf", truncated, tmp_path / "o3"], 1, "truncated.gguf"),
    ]:
        assert word in error_line(invoke(["models", *args]), code), args


# ------------------------------------------------------------------- missing or corrupt models


def _edit_config(**changes):
    def damage(path):
        cfg = json.loads((path / "config.json").read_text())
        for key, value in changes.items():
            if value is None:
                del cfg[key]
            else:
                cfg[key] = value
        (path / "config.json").write_text(json.dumps(cfg))
    return damage


def _truncate(fraction):
    def damage(path):
        f = path / "model.safetensors"
        data = f.read_bytes()
        f.write_bytes(data[:int(len(data) * fraction)])
    return damage


def _write(name, content):
    return lambda path: (path / name).write_bytes(content)


def _remove(name):
    return lambda path: (path / name).unlink()


def _nan_weight(path):
    f = path / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-4:] = b"\x00\x00\xc0\x7f"                        # float32 NaN as the last value
    f.write_bytes(bytes(data))


DAMAGE = {   # name: (what is done to the checkpoint, words of the one-line error)
    "config.json not JSON": (_write("config.json", b"{oops"), ["config.json", "JSON"]),
    "config.json a list": (_write("config.json", b"[]"), ["config.json", "object"]),
    "config.json not UTF-8": (_write("config.json", b"\xff\xfe{}"), ["config.json"]),
    "config.json without config": (_remove("config.json"), ["config.json"]),
    "hidden_size a string": (_edit_config(hidden_size="big"), ["config.json", "hidden_size"]),
    "vocab_size missing": (_edit_config(vocab_size=None), ["config.json", "vocab_size"]),
    "KV heads not dividing heads": (_edit_config(num_key_value_heads=3), ["num_key_value_heads"]),
    "vocab not the weights'": (_edit_config(vocab_size=10), ["model.safetensors", "shape"]),
    "safetensors truncated": (_truncate(0.5), ["model.safetensors", "truncated"]),
    "safetensors empty": (_write("model.safetensors", b""), ["model.safetensors", "truncated"]),
    "safetensors header length huge": (_write("model.safetensors", (2**62).to_bytes(8, "little") + b"{}"),
                                       ["model.safetensors", "header"]),
    "safetensors header not JSON": (_write("model.safetensors", (4).to_bytes(8, "little") + b"{oop"),
                                    ["model.safetensors", "header"]),
    "safetensors missing": (_remove("model.safetensors"), ["model.safetensors"]),
    "NaN weight": (_nan_weight, ["model.safetensors", "non-finite"]),
    "tokenizer.json not JSON": (_write("tokenizer.json", b"{oops"), ["tokenizer.json"]),
    "tokenizer.json missing": (_remove("tokenizer.json"), ["tokenizer.json"]),
    "tokenizer_config.json not JSON": (_write("tokenizer_config.json", b"{oops"), ["tokenizer_config.json"]),
    "generation_config.json not JSON": (_write("generation_config.json", b"{oops"), ["generation_config.json"]),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_generate_on_a_damaged_model_is_one_line(damage, model):
    do, words = DAMAGE[damage]
    do(model)
    line = error_line(invoke(["generate", "--model", model, "--prompt", "w1", "--max-new-tokens", 1]), 1)
    assert all(w in line for w in words), line


@pytest.mark.parametrize("damage", ["config.json not JSON", "safetensors truncated", "tokenizer.json not JSON",
                                    "NaN weight"])
@pytest.mark.parametrize("sub", ["kernel", "model", "retrieval"])
def test_eval_on_a_damaged_model_is_one_line(sub, damage, model):
    do, words = DAMAGE[damage]
    do(model)
    line = error_line(invoke(["eval", sub, "--small", "--model", model]), 1)
    assert all(w in line for w in words), line


@pytest.mark.parametrize("command", [["generate", "--prompt", "w1"], ["eval", "kernel", "--small"],
                                     ["eval", "model", "--small"], ["eval", "retrieval", "--small"]])
def test_missing_model_is_one_line(command, tmp_path):
    missing = tmp_path / "gone"
    line = error_line(invoke(with_model(command, missing)), 1)
    assert str(missing) in line and "unknown model" in line
    empty = tmp_path / "empty"
    empty.mkdir()
    line = error_line(invoke(with_model(command, empty)), 1)
    assert str(empty) in line and "config.json" in line


# --------------------------------------------------------------------------------- prompt files


def _generate_from(model, prompt_file, *extra):
    return invoke(["generate", "--model", model, "--prompt-file", prompt_file, "--max-new-tokens", 1, *extra])


def test_prompt_file_without_read_permission(tiny_model, tmp_path):
    pf = tmp_path / "secret.txt"
    pf.write_text("w1 w2")
    pf.chmod(0)
    try:
        if os.access(pf, os.R_OK):
            pytest.skip("this user reads files without read permission (root)")
        line = error_line(_generate_from(tiny_model, pf), 2)
        assert "--prompt-file" in line and str(pf) in line and "ermission" in line
    finally:
        pf.chmod(0o600)


def test_prompt_file_open_refused(tiny_model, tmp_path, monkeypatch):
    """The same refusal as a missing read permission, for users (root) the kernel never refuses."""
    pf = tmp_path / "secret.txt"
    pf.write_text("w1 w2")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(pf):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    line = error_line(_generate_from(tiny_model, pf), 2)
    assert "--prompt-file" in line and str(pf) in line and "Permission denied" in line


def test_prompt_file_a_directory_or_missing(tiny_model, tmp_path):
    assert "--prompt-file" in error_line(_generate_from(tiny_model, tmp_path), 2)
    assert "--prompt-file" in error_line(_generate_from(tiny_model, tmp_path / "none.txt"), 2)


@pytest.mark.parametrize("content,encoding,offset", [
    (b"w1 \xff w2", "utf-8", 3),                          # not UTF-8 at all
    (b"w1 w2 \xe2\x82", "utf-8", 6),                      # UTF-8 cut inside a character
    (b"\xff\xfew\x00\x00\xd8", "utf-16", 4),              # a lone surrogate in UTF-16
])
def test_prompt_file_not_in_its_encoding(tiny_model, tmp_path, content, encoding, offset):
    pf = tmp_path / "prompt.txt"
    pf.write_bytes(content)
    line = error_line(_generate_from(tiny_model, pf, "--encoding", encoding), 2)
    assert str(pf) in line and f"offset {offset}" in line and "--encoding" in line


# ------------------------------------------------------------------------------------- Ctrl-C


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


PHASES = {   # phase: the function that gets Ctrl-C
    "resolve": "llama_min.models.resolve_model",
    "load": "llama_min.model.LlamaModel.from_pretrained",
    "prefill": "llama_min.model.LlamaModel.prefill",
    "decode": "llama_min.model.LlamaModel.decode",
}
COMMANDS = {
    "generate text": ["generate", "--prompt", "w1 w2 w3", "--max-new-tokens", 4],
    "generate json": ["generate", "--prompt", "w1 w2 w3", "--max-new-tokens", 4, "--format", "json"],
    "generate santa": ["generate", "--prompt", "w1 w2 w3", "--max-new-tokens", 4, "--attention", "santa"],
    "eval kernel": ["eval", "kernel", "--small", "--context", 8],
    "eval model": ["eval", "model", "--small", "--context", 8],
    "eval retrieval": ["eval", "retrieval", "--small"],
}


def assert_interrupted(res):
    assert res.exit_code == 130, res.output
    no_traceback(res)
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines[-1] == "interrupted" and res.output.count("interrupted") == 1, res.output
    assert "Error" not in res.output and "Aborted" not in res.output


@pytest.mark.parametrize("phase", sorted(PHASES))
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_ctrl_c_at_each_phase_exits_130_with_one_line(command, phase, tiny_model, monkeypatch):
    target = PHASES[phase]
    called = []

    def interrupt(*args, **kwargs):
        called.append(target)
        raise KeyboardInterrupt

    monkeypatch.setattr(target, staticmethod(interrupt) if phase == "load" else interrupt)
    res = invoke(with_model(COMMANDS[command], tiny_model))
    assert called, f"{target} was never called: the test does not interrupt {phase}"
    assert_interrupted(res)


@pytest.mark.parametrize("args,target", [
    (["bench", "kernels", "--quick"], "santa_cupy.cli.bench.kernels._cupy"),
    (["bench", "e2e"], "santa_cupy.cli.bench.e2e._cupy"),
    (["bench", "stages"], "santa_cupy.cli.bench.kernels._cupy"),
    (["bench", "products"], "santa_cupy.cli.bench.products._cupy"),
    (["models", "pull"], "llama_min.models.pull_default"), (["models", "list"], "llama_min.models.list_models"),
    (["models", "convert-gguf", __file__, "out"], "llama_min.gguf_convert.convert_gguf"),
    (["eval", "merge", "run.json"], "santa_cupy.cli.evaluation.commands.merge_results"),
])
def test_ctrl_c_in_bench_and_models(args, target, monkeypatch, tmp_path):
    monkeypatch.setattr(target, _interrupt)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.json").write_text('{"config": {}}')
    assert_interrupted(invoke(args))


def test_a_real_sigint_while_decoding_exits_130(tiny_model):
    """The process itself (not CliRunner): SIGINT delivered during the decode loop."""
    script = (
        "import os, signal, sys\n"
        # as from an interactive shell, even where this test's runner ignores SIGINT (nohup ... &),
        # which the child would inherit
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "from llama_min.model import LlamaModel\n"
        "real = LlamaModel.decode\n"
        "def decode(self, *a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return real(self, *a, **k)\n"
        "LlamaModel.decode = decode\n"
        "from santa_cupy.cli import main as cli\n"
        "sys.argv = ['santa-cupy'] + sys.argv[1:]\n"
        "cli.main()\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", script, "generate", "--model", str(tiny_model), "--prompt", "w1 w2",
                           "--max-new-tokens", "50", "--device", "cpu"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == "interrupted", proc.stderr

"""llama_min.threads: the BLAS thread count per phase, its override, and that the decoder uses it."""

import numpy as np
import pytest

from llama_min import threads

threadpoolctl = pytest.importorskip("threadpoolctl")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (threads.ENV,) + threads.LIBRARY_ENVS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def _blas_threads_now():
    counts = {lib["num_threads"] for lib in threadpoolctl.threadpool_info() if lib["user_api"] == "blas"}
    if not counts:
        pytest.skip("no BLAS library that threadpoolctl controls")
    assert len(counts) == 1, counts
    return counts.pop()


def test_choose_per_phase(clean_env, monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 6)
    assert threads.choose("decode") == 1
    assert threads.choose("prefill", 512) == 6
    assert threads.choose("prefill", threads.PREFILL_MIN_TOKENS) == 6
    assert threads.choose("prefill", 15) == 1            # a short prompt is matrix-vector-like
    with pytest.raises(ValueError, match="phase"):
        threads.choose("train")


def test_override_and_user_settings(clean_env):
    clean_env.setenv(threads.ENV, "3")
    assert threads.choose("decode") == threads.choose("prefill", 512) == 3
    clean_env.delenv(threads.ENV)
    clean_env.setenv("OPENBLAS_NUM_THREADS", "2")        # the user configured the library: hands off
    assert threads.choose("decode") is None and threads.choose("prefill", 512) is None
    clean_env.setenv(threads.ENV, "1")                   # ours wins over the library's
    assert threads.choose("prefill", 512) == 1


@pytest.mark.parametrize("bad", ["0", "-2", "two", "1.5"])
def test_bad_override_names_the_variable(clean_env, bad):
    clean_env.setenv(threads.ENV, bad)
    with pytest.raises(ValueError, match=threads.ENV):
        threads.choose("decode")


def test_blas_threads_sets_and_restores(clean_env):
    before = _blas_threads_now()
    with threads.blas_threads("decode") as n:
        assert n == 1 and _blas_threads_now() == 1
    assert _blas_threads_now() == before


def test_decoder_decodes_with_one_blas_thread_and_prefills_with_all(clean_env, tmp_path):
    from llama_min.model import LlamaModel
    from tests.test_model import make_tiny

    clean_env.setattr(threads, "available_cores", lambda: 2)
    model = LlamaModel.from_pretrained(make_tiny(tmp_path, max_pos=128)[0], device="cpu")
    seen = []
    real_chunk, real_core = model._forward_chunk, model._decode_core
    clean_env.setattr(model, "_forward_chunk", lambda *a: seen.append(("prefill", _blas_threads_now())) or real_chunk(*a))
    clean_env.setattr(model, "_decode_core", lambda *a: seen.append(("decode", _blas_threads_now())) or real_core(*a))
    cache = model.new_cache(1, threads.PREFILL_MIN_TOKENS + 1)
    model.prefill(np.arange(1, 1 + threads.PREFILL_MIN_TOKENS).reshape(1, -1) % 30, cache)
    model.decode(np.array([3]), cache)
    assert seen == [("prefill", 2), ("decode", 1)]

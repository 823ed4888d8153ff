"""eval ruler on the GPU (marker gpu): the captured decode step with the greedy device sampler
(GraphDecoders / GraphGreedy, reused across samples) gives the eager path's answers; its in-place
reset between samples; the one-pass budget as a per-layer hook, in the graph as eagerly."""

import numpy as np
import pytest

from santa_cupy.cli.evaluation import decoding
from santa_cupy.cli.evaluation import ruler as er
from santa_cupy.cli.evaluation.settings import DENSE, run_setting
from tests.gpu_util import requires_gpu
from tests.test_ruler import CharTok

pytestmark = [pytest.mark.gpu, requires_gpu]


def _model(tmp_path, dtype):
    from llama_min.model import LlamaModel
    from tests.test_model import make_tiny
    path = make_tiny(tmp_path, H=4, KVH=2, layers=2, max_pos=64)[0]
    return LlamaModel.from_pretrained(path, device="gpu", dtype=dtype)


SAMPLES = [{"task": "niah_single_1", "max_seq_length": 64, "index": i, "input": text, "outputs": ["zzqq"]}
           for i, text in enumerate(["the magic number is", "what is the code of the third door"])]


def _runs(labels, seeds=(0, 1)):
    sts = [er.runs.parse_setting(x) for x in labels]
    return [(DENSE, 0)] + [(s, sd) for s in sts for sd in seeds]


def _answers(records):
    return {er.runs.record_key(r): (r["pred"], r["new_tokens"]) for r in records}


@pytest.mark.parametrize("full", [True, False])
def test_graph_and_eager_give_the_same_answers(tmp_path, full):
    """Two samples x dense and two SANTA settings x two seeds: the graph path's greedy tokens (device
    sampler, one graph per setting reused for both samples) are the eager path's (host argmax of
    model.decode's logits), on a float32 model (the same logits to the products' rounding)."""
    model = _model(tmp_path, "float32")
    runs = _runs(["systematic/global/S=4", "iid/fixed/S=8"])
    outs = ["zzqq"] if full else ["b"]                 # never found / found early (early stop)
    samples = [dict(s, outputs=outs) for s in SAMPLES]
    g = er.runs.run_samples(model, CharTok(), samples, runs, max_new=12, full=full, graph=True)
    e = er.runs.run_samples(model, CharTok(), samples, runs, max_new=12, full=full, graph=False)
    assert len(g) == len(e) == 2 * len(runs)
    assert _answers(g) == _answers(e)
    assert all(r["new_tokens"] <= 12 for r in g) and any(r["new_tokens"] > 1 for r in g)


def test_graphs_are_reused_and_reset_in_place(tmp_path):
    """One GraphGreedy per (capacity, setting): sample A, then B, then A again on the same graphs
    gives A's first answers (prefill rows, lengths, host mirror, SANTA and sampler steps, one-pass
    hints put back in place); the one-pass hook's step counters advance once a token; decoding the
    settings side by side (greedy_together) equals decoding each alone."""
    model = _model(tmp_path, "float16")
    tok = CharTok()
    atts = [run_setting(DENSE, 0)] + [run_setting(er.runs.parse_setting(x), 1) for x in
                                      ("systematic/global/S=4", "systematic/one_pass/S=8")]
    dec = er.runs.GraphDecoders(model)
    try:
        got = []
        for text in (SAMPLES[0]["input"], SAMPLES[1]["input"], SAMPLES[0]["input"]):
            ids = tok.encode(text)
            dec.prefill(ids[:-1], 64)
            got.append([t for t, _ in dec.answers(atts, ids[-1], 10, (), None)])
        assert dec.graphs == len(atts)
        assert got[2] == got[0]
        g1 = dec.by_key[(64, atts[2])]
        assert isinstance(g1.hook, decoding.OnePassLayers)
        assert all(int(p.step.get()[0]) == len(got[2][2]) for p in g1.hook.plans)
        assert int(g1.graph.plan.step.get()[0]) == len(got[2][2]) and g1.cache.length == len(ids) - 1 + 10
        # each setting alone (GraphGreedy.answer on its cache) gives what it gave side by side
        for a, want in zip(atts, got[2]):
            g = dec.by_key[(64, a)]
            decoding.load_prefill(g.cache, dec.cache, len(ids) - 1)
            assert g.answer(len(ids) - 1, ids[-1], 10) == want
    finally:
        dec.close()


def test_one_pass_hook_in_the_graph_as_eagerly(tmp_path):
    """The one-pass budget through OnePassLayers: teacher-forced logits of the captured step equal
    the eager step's with the same hook (S large: nearly every row taken, so the products' rounding
    cannot move a row's inclusion much), each layer's hint its own previous lse (finite after a step)."""
    from santa_cupy import AttentionSetting
    model = _model(tmp_path, "float16")
    att = AttentionSetting(method="santa", samples=4096, sampler="systematic", budget="one_pass", seed=3,
                           santa_min_length=0)
    ids = CharTok().encode("the magic number is here")
    cache0 = decoding.prefilled_cache(model, ids[:10], 64)
    cache = decoding.clone_cache(model, cache0)
    feed = ids[10:]
    with decoding.GraphGreedy(model, cache, att) as g:
        g.reset(10)
        lg = [g.graph.replay([t]).get()[0].astype(np.float64) for t in feed]
        assert all(np.isfinite(p.lse.get()).all() for p in g.hook.plans)
    ce = decoding.clone_cache(model, cache0)
    a, hook = decoding.gpu_attention(model, ce, att)
    assert a.method == "dense" and isinstance(hook, decoding.OnePassLayers)
    le = [decoding.to_host(model.decode(np.asarray([t]), ce, a, attention_hook=hook)[0]).astype(np.float64)
          for t in feed]
    for i, (x, y) in enumerate(zip(lg, le)):
        np.testing.assert_allclose(x, y, atol=0.05 * np.abs(y).max(), err_msg=f"step {i}")

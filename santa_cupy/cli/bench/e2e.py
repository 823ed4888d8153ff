"""``bench e2e``: one whole decode step of a Llama-shaped model (random fp16 weights and KV cache, or
a checkpoint), captured as a CUDA graph, dense vs SANTA attention; its byte floor and memory.

``--tp N``: the step tensor-parallel over N GPUs (e2e_tp.py; a random model of ``--shape``, 70b by
default).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass

import click

from llama_min.commands import KV_CACHE_LAYOUTS, check_output_path, kv_cache_page_size, kv_cache_report
from santa_cupy.cli.bench.gpu import _cupy, gpu_metadata, random_array
from santa_cupy.cli.bench.methods import parse_list, parse_method, parse_size
from santa_cupy.cli.bench.report import _log, e2e_table, fmt_bytes, run_metadata, write_outputs
from santa_cupy.cli.bench.timing import measure_ceiling, time_steps


@dataclass(frozen=True)
class ModelShape:
    layers: int = 32
    hidden: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    intermediate: int = 14336
    vocab: int = 128256
    rope_theta: float = 500000.0
    eps: float = 1e-5


LLAMA8B_MODEL = ModelShape()
LLAMA70B_MODEL = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, head_dim=128, intermediate=28672,
                            vocab=128256)
SHAPES = {"8b": LLAMA8B_MODEL, "70b": LLAMA70B_MODEL}
SHAPE_NAMES = {"8b": "Llama-3.1-8B", "70b": "Llama-3.1-70B"}
E2E_ITEMSIZE = 2  # fp16 weights and KV cache (cuBLAS fp16 GEMMs; CuPy has no bf16 matmul)


def weight_shapes(m: ModelShape) -> dict[str, tuple[int, int]]:
    """The decode step's weight matrices [N, K] (llama_min's fused QKV and gate/up layout)."""
    d, HD, KD, I = m.hidden, m.heads * m.head_dim, m.kv_heads * m.head_dim, m.intermediate
    return {"qkv": (HD + 2 * KD, d), "o": (d, HD), "gate_up": (2 * I, d), "down": (d, I), "lm_head": (m.vocab, d)}


def e2e_bytes(m: ModelShape, B: int, L: int) -> dict:
    """Byte floor of one decode step: every weight read once (layers + final norm + lm_head; one
    embedding row per sequence), and K + V of every layer at length L."""
    d, KD = m.hidden, m.kv_heads * m.head_dim
    shapes = weight_shapes(m)
    per_layer = sum(N * K for name, (N, K) in shapes.items() if name != "lm_head") * E2E_ITEMSIZE + 2 * d * 4
    weights = m.layers * per_layer + math.prod(shapes["lm_head"]) * E2E_ITEMSIZE + d * 4 + B * d * E2E_ITEMSIZE
    kv = m.layers * 2 * B * L * KD * E2E_ITEMSIZE
    return {"weights": weights, "kv": kv, "total": weights + kv}


def e2e_memory(m: ModelShape, B: int, L_max: int) -> int:
    """Device memory of the random model: weights incl. embedding, KV cache, rotary tables."""
    return (e2e_bytes(m, B, L_max)["total"] + m.vocab * m.hidden * E2E_ITEMSIZE
            + L_max * m.head_dim * 4)


def e2e_derived(rows: list[dict], ceiling_tbps: float | None, floor_bytes: int) -> list[dict]:
    dense = next((r["ms"] for r in rows if r["method"] == "dense" and r.get("ms")), None)
    for r in rows:
        ms = r.get("ms")
        r["tok_s"] = r["B"] * 1000.0 / ms if ms else None
        r["floor_ms"] = floor_bytes / (ceiling_tbps * 1e12) * 1e3 if ceiling_tbps else None
        r["pct_floor"] = 100.0 * r["floor_ms"] / ms if ms and r["floor_ms"] else None
        r["x_dense"] = dense / ms if ms and dense else None
    return rows


def random_model_config(m: ModelShape, L_max: int, source: str):
    """The llama_min LlamaConfig of a shape (no checkpoint behind it)."""
    from llama_min.config import LlamaConfig

    return LlamaConfig(hidden_size=m.hidden, intermediate_size=m.intermediate, num_hidden_layers=m.layers,
                       num_attention_heads=m.heads, num_key_value_heads=m.kv_heads, head_dim=m.head_dim,
                       rms_norm_eps=m.eps, rope_theta=m.rope_theta, rope_scaling=None, max_position_embeddings=L_max,
                       vocab_size=m.vocab, tie_word_embeddings=False, bos_token_id=None, source=source)


def random_weights(cp, layers: int, d: int, shapes: dict) -> dict:
    """llama_min's weight dict on the current GPU: random fp16 products of ``shapes`` ({name: (rows,
    cols)}: qkv, o, gate_up, down, lm_head; scaled 1/sqrt(cols)), unit norms; the embedding [vocab
    rows, d] drawn like lm_head."""
    def w(name):
        rows, cols = shapes[name]
        return random_array(cp, (rows, cols), "float16", scale=1.0 / math.sqrt(cols))

    blocks = [{"attn_norm": cp.ones((d,), cp.float32), "wqkv": w("qkv"), "wo": w("o"),
               "mlp_norm": cp.ones((d,), cp.float32), "w_gu": w("gate_up"), "w_down": w("down")}
              for _ in range(layers)]
    return {"embed": w("lm_head"), "lm_head": w("lm_head"), "norm": cp.ones((d,), cp.float32), "layers": blocks}


def random_llama(cp, m: ModelShape, B: int, L: int, L_max: int, page_size: int | None = None):
    """-> (llama_min LlamaModel, KVCache): the e2e model when no --model is given. Random fp16
    weights generated on the GPU (no download), unit norms, and a cache of random fp16 K/V
    holding L tokens of every sequence (no prefill; paged with page_size: see _fill_random_kv).
    The decode step is llama_min's own."""
    from llama_min.model import LlamaModel

    cfg = random_model_config(m, L_max, "bench e2e (random weights)")
    model = LlamaModel(cfg, random_weights(cp, m.layers, m.hidden, weight_shapes(m)), cp, "gpu", "float16", "float16")
    cache = e2e_cache(model, B, L_max, page_size)
    _fill_random_kv(cp, model, cache, L)
    return model, cache


E2E_PAGE_SEED = 0      # the paged cache's page order: a shuffled pool, as a serving stack's after churn


def e2e_cache(model, B: int, L_max: int, page_size: int | None):
    """The e2e cache: contiguous, or paged (pages of page_size rows from a pool in shuffled order,
    so every sequence's block table is a random, non-contiguous list of pages)."""
    if page_size is None:
        return model.new_cache(B, L_max)
    return model.new_cache(B, L_max, page_size=page_size, page_seed=E2E_PAGE_SEED)


def _fill_random_kv(cp, model, cache, L):
    """Random K/V in every layer of the cache (never zeros: a paged cache's whole page pool), which
    then holds L tokens (paged: their pages reserved, in the pool's shuffled order)."""
    cache.reserve(L)
    for layer in range(len(cache.k)):
        for kv in (cache.k[layer], cache.v[layer]):
            kv[...] = random_array(cp, kv.shape, model.kv_dtype).view(kv.dtype)
    cache.lengths[...] = L
    cache.length = L



def _e2e_rows(cp, model, cache, L, steps, warmup, methods, gemv=None, graph=True, programmatic=True):
    """Time llama_min's decode step for each method over the same weights and cache, reset to
    L tokens before each method: a CUDA graph (GraphDecoder) replayed, or eager model.decode()."""
    from llama_min.graph import GraphDecoder

    B = cache.batch
    rows = []
    for m in methods:
        cache.lengths[...] = L
        cache.length, cache.step = L, 0
        att = m.setting if m.kind == "dense" else m.setting.replace(santa_min_length=0)   # santa at every length
        tokens = cp.ones((B,), cp.int32)
        if graph:
            gd = GraphDecoder(model, cache, att, gemv=gemv, programmatic_launch=programmatic)
            run, stream, plan = (lambda: gd.replay(tokens)), gd.stream, gd.plan
        else:
            gd, stream = None, cp.cuda.get_current_stream()
            model.decode(tokens, cache, att)                       # builds the cached plan
            run, plan = (lambda: model.decode(tokens, cache, att)), cache.plans.get(att)
        ms, ms_min = time_steps(cp, run, stream, steps, warmup)
        row = {"method": m.name, "B": B, "L": L, "ms": ms, "ms_min": ms_min, "timing": "graph" if graph else "eager",
               "programmatic": gd is not None and gd.programmatic_launch}
        if m.kind == "santa" and plan is not None:
            last_len = int(cache.lengths[0])       # the last step attended over this many rows
            row["rows_frac"] = float(plan.info().rows_read.sum()) / (B * model.KVH * last_len)
        rows.append(row)
        if gd is not None:
            gd.close()
        cp.cuda.Device().synchronize()
    return rows


@click.command("e2e")
@click.option("--context", default="32k", show_default=True, help="Tokens already in the KV cache (k = 1024).")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=20, show_default=True, help="Timed decode steps (median).")
@click.option("--warmup", type=click.IntRange(min=0), default=3, show_default=True, help="Untimed graph replays first.")
@click.option("--methods", default="dense,santa-global-systematic-256", show_default=True,
              help="Comma-separated: dense, santa-<budget>-<sampler>-<S>.")
@click.option("--layers", type=click.IntRange(min=1), default=None,
              help="Layers of the random model (fewer for a smaller GPU)  [default: the shape's, 32 for 8b, 80 for 70b]")
@click.option("--shape", "shape_name", type=click.Choice(sorted(SHAPES)), default=None,
              help="The random model's shape: Llama-3.1-8B or -70B  [default: 8b, 70b with --tp > 1]")
@click.option("--tp", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tensor-parallel degree: the step over this many GPUs (NCCL, one CUDA graph per GPU; a "
                   "random model only).")
@click.option("--model", "model_path", type=click.Path(exists=True), default=None,
              help="A checkpoint directory (llama_min); default: Llama-3.1-8B-shaped random weights.")
@click.option("--no-graph", is_flag=True, help="Time eager steps instead of a captured CUDA graph.")
@click.option("--products", "products", type=click.Choice(["auto", "gemv", "cublas"]), default="auto",
              show_default=True, help="Weight products: GraphDecoder's default (gemv.cu at batch 1, cuBLAS "
                                      "beyond), gemv.cu up to batch 4, or cuBLAS only. Needs the graph.")
@click.option("--pdl/--no-pdl", default=True, show_default=True,
              help="Capture santa-cupy's kernels with programmatic dependent launch (GraphDecoder's default on "
                   "sm_90+), or plainly.")
@click.option("--kv-cache", "kv_cache", type=click.Choice(KV_CACHE_LAYOUTS), default="contiguous", show_default=True,
              help="KV cache storage: contiguous, or paged (a shuffled page pool and block table, NHD).")
@click.option("--page-size", type=click.IntRange(1, 256), default=None,
              help="Rows per page of --kv-cache paged (1..256; default 16).")
@click.option("--mem-gb", type=click.FloatRange(min=1), default=60.0, show_default=True, help="Refuse above this.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
def e2e_command(context, batch, steps, warmup, methods, layers, shape_name, tp, model_path, no_graph, products, pdl,
                kv_cache, page_size, mem_gb, json_path, markdown_path):
    """Whole-model decode latency (ms/token, tokens/s), dense vs SANTA attention; --tp N over N GPUs."""
    L = parse_size(context, "context")
    page_size = kv_cache_page_size(kv_cache, page_size)
    method_objs = [parse_method(n) for n in parse_list(methods, "methods", str)]
    bad = [m.name for m in method_objs if m.external]
    if bad:
        raise click.BadParameter(f"e2e runs our kernels only, not {', '.join(bad)}", param_hint="--methods")
    shape_name = shape_name or ("70b" if tp > 1 else "8b")
    shape = SHAPES[shape_name]
    if layers is not None:
        shape = dataclasses.replace(shape, layers=layers)
    L_max = L + steps + warmup + 8
    if products != "auto" and no_graph:
        raise click.UsageError("--products needs the captured graph (drop --no-graph)")
    gemv = {"auto": None, "gemv": True, "cublas": False}[products]
    if tp > 1:
        from santa_cupy.cli.bench.e2e_tp import _e2e_tp, tp_memory, tp_plan   # e2e_tp imports this module

        if model_path is not None:
            raise click.UsageError("--tp runs a random model (drop --model)")
        if no_graph:
            raise click.UsageError("--tp captures one CUDA graph per GPU (drop --no-graph)")
        try:
            tp_plan(shape, tp)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--tp") from None
        if tp_memory(shape, batch, L_max, tp) > mem_gb * 1e9:
            raise click.UsageError(f"the random {shape_name} model at TP={tp}, batch {batch}, context {L} needs "
                                   f"{fmt_bytes(tp_memory(shape, batch, L_max, tp))} a GPU > --mem-gb {mem_gb}; "
                                   "use fewer --layers, a smaller --batch/--context, a larger --tp or --mem-gb")
        from llama_min.tensor_parallel import _nccl_environment
        _nccl_environment()                      # NCCL_NVLS_ENABLE=0 before anything initialises NCCL
        cp = _cupy()
        meta = dict(run_metadata("e2e"), **gpu_metadata(cp))
        meta["model"] = f"random {SHAPE_NAMES[shape_name]}-shaped, fp16 weights and KV, {asdict(shape)}, sharded"
        meta["kv_cache"] = kv_cache_report(page_size)
        meta["decode_step"] = "llama_min tensor-parallel (ShardedBackend: all-reduce after o_proj and down_proj)"
        meta["weight_products"] = {"auto": "santa-cupy gemv at batch 1, else cuBLAS", "gemv": "santa-cupy gemv",
                                   "cublas": "cuBLAS"}[products]
        return _e2e_tp(cp, shape, tp, batch, L, L_max, steps, warmup, method_objs, gemv, page_size, meta,
                       json_path, markdown_path, programmatic=pdl)
    if model_path is None and e2e_memory(shape, batch, L_max) > mem_gb * 1e9:
        raise click.UsageError(f"the random model at batch {batch}, context {L} needs "
                               f"{fmt_bytes(e2e_memory(shape, batch, L_max))} > --mem-gb {mem_gb}; "
                               "use fewer --layers, a smaller --batch/--context or a larger --mem-gb")
    cp = _cupy()
    meta = dict(run_metadata("e2e"), **gpu_metadata(cp))
    _log("measuring the streaming-read ceiling ...")
    ceiling = measure_ceiling(cp)
    if model_path is not None:
        from llama_min.model import LlamaModel

        _log(f"loading {model_path} ...")
        model = LlamaModel.from_pretrained(model_path, device="gpu")
        cfg = model.cfg
        cache = e2e_cache(model, batch, L_max, page_size)
        _fill_random_kv(cp, model, cache, L)
        shape = ModelShape(layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=cfg.num_attention_heads,
                           kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                           intermediate=cfg.intermediate_size, vocab=cfg.vocab_size)
        meta["model"] = str(model_path)
        note = "random KV, no prefill"
    else:
        meta["model"] = f"random {SHAPE_NAMES[shape_name]}-shaped, fp16 weights and KV, {asdict(shape)}"
        _log(f"generating random weights and KV cache ({fmt_bytes(e2e_memory(shape, batch, L_max))}) ...")
        model, cache = random_llama(cp, shape, batch, L, L_max, page_size)
        note = "random weights, random KV, no prefill"
    meta["kv_cache"] = kv_cache_report(page_size)
    meta["decode_step"] = "llama_min (fused RMSNorm / rotary + K/V append / SiLU kernels, residual adds in the products)"
    meta["weight_products"] = {"auto": "santa-cupy gemv at batch 1, else cuBLAS", "gemv": "santa-cupy gemv",
                               "cublas": "cuBLAS"}[products] if not no_graph else "CuPy matmul (eager)"
    rows = _e2e_rows(cp, model, cache, L, steps, warmup, method_objs, gemv=gemv, graph=not no_graph,
                     programmatic=pdl)
    meta["programmatic_launch"] = bool(pdl and not no_graph and rows and rows[0].get("programmatic"))
    if page_size is not None:
        note += f", paged KV (pages of {page_size} rows, shuffled block table)"
    for r in rows:
        r["note"] = note
    floor = e2e_bytes(shape, batch, L)
    meta["byte_floor"] = floor
    meta["byte_floor_text"] = (f"weights {fmt_bytes(floor['weights'])} + KV {fmt_bytes(floor['kv'])} at context "
                               f"{L} = {fmt_bytes(floor['total'])} per step")
    meta["timing"] = f"median of {steps} single-step replays after {warmup} warm-up replays"
    e2e_derived(rows, ceiling["read_tbps"], floor["total"])
    write_outputs(meta, ceiling, rows, e2e_table(rows), json_path=json_path, markdown_path=markdown_path)


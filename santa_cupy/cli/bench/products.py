"""``bench products``: the decoder's weight products x @ w.T at a few token counts, cuBLAS vs the
gemv kernels, on the Llama-3.1-8B weight shapes.
"""

from __future__ import annotations

import math
import sys

import click

from llama_min.commands import check_output_path
from santa_cupy.cli.bench.e2e import LLAMA8B_MODEL, weight_shapes
from santa_cupy.cli.bench.gpu import _cupy, gpu_metadata, random_array
from santa_cupy.cli.bench.methods import parse_list
from santa_cupy.cli.bench.report import _log, run_metadata, write_outputs
from santa_cupy.cli.bench.timing import measure_ceiling, time_cupy_graph


PRODUCT_METHODS = ("cublas", "gemv", "gemv-rows")      # gemv = decoder_ops v2 "split", gemv-rows = v1


def _product_fn(method, x, w, y, cublas):
    """One weight product y (float32) += x @ w.T by method (the residual update's form), for
    time_cupy_graph; cublas: a llama_min.cublas.CublasGemm."""
    if method == "cublas":
        return lambda: cublas(x, w, accumulate_into=y)
    from llama_min import ops as decoder_ops
    kernel = "split" if method == "gemv" else "rows"
    return lambda: decoder_ops.gemv(x, w, out=y, accumulate=True, kernel=kernel)



def _token_count(text: str) -> int:
    if not text.isdigit():
        raise click.BadParameter(f"token counts must be integers, got {text!r}", param_hint="--tokens")
    return int(text)


@click.command("products")
@click.option("--tokens", default="1,2,4", show_default=True, help="Comma-separated token counts (rows of x).")
@click.option("--methods", default=",".join(PRODUCT_METHODS), show_default=True,
              help=f"Comma-separated, of: {', '.join(PRODUCT_METHODS)}.")
@click.option("--repeats", type=click.IntRange(min=3), default=30, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
@click.option("--markdown", "markdown_path", type=click.Path(dir_okay=False), default=None,
              callback=check_output_path)
def products_command(tokens, methods, repeats, json_path, markdown_path):
    """The decode step's weight products (Llama-3.1-8B shapes, fp16, float32 out), cuBLAS vs gemv.cu:
    µs, TB/s and % of the streaming-read ceiling, every method on the same rotating weights."""
    token_list = parse_list(tokens, "tokens", _token_count)
    method_list = parse_list(methods, "methods", str)
    bad = [m for m in method_list if m not in PRODUCT_METHODS]
    if bad:
        raise click.BadParameter(f"unknown method(s) {bad}; choose from {PRODUCT_METHODS}", param_hint="--methods")
    from llama_min import ops as decoder_ops
    if not token_list or min(token_list) < 1 or max(token_list) > decoder_ops.GEMV_TOKENS[-1]:
        raise click.BadParameter(f"token counts must be in 1..{decoder_ops.GEMV_TOKENS[-1]}", param_hint="--tokens")
    cp = _cupy()
    meta = dict(run_metadata("products"), **gpu_metadata(cp))
    _log("measuring the streaming-read ceiling ...")
    ceiling = measure_ceiling(cp)
    l2 = cp.cuda.Device().attributes["L2CacheSize"]
    from llama_min.cublas import CublasGemm
    cublas = CublasGemm()
    rows = []
    shapes = weight_shapes(LLAMA8B_MODEL)
    with click.progressbar(list(shapes.items()), label="products", file=sys.stderr) as bar:
        for name, (N, K) in bar:
            copies = max(2, -(-3 * l2 // (N * K * 2)))              # rotate over > 3x L2
            ws = [random_array(cp, (N, K), "float16", scale=1.0 / math.sqrt(K)) for _ in range(copies)]
            for n in token_list:
                x = random_array(cp, (n, K), "float16")
                y = cp.zeros((n, N), cp.float32)
                for method in method_list:
                    fns = [_product_fn(method, x, w, y, cublas) for w in ws]
                    us, mode = time_cupy_graph(cp, fns, n_inner=max(len(fns), 8), repeats=repeats)
                    nbytes = N * K * 2 + n * K * 2 + n * N * 4
                    rows.append({"product": name, "N": N, "K": K, "tokens": n, "method": method, "us": us,
                                 "bytes": nbytes, "tbps": nbytes / us / 1e6, "timing": mode})
            del ws
    base = {(r["product"], r["tokens"]): r["us"] for r in rows if r["method"] == "cublas"}
    lines = ["| product | N x K | tokens | method | µs | TB/s | % ceiling | x cuBLAS |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        r["pct_ceiling"] = 100.0 * r["tbps"] / ceiling["read_tbps"] if ceiling.get("read_tbps") else None
        b = base.get((r["product"], r["tokens"]))
        r["x_cublas"] = b / r["us"] if b else None
        lines.append(f"| {r['product']} | {r['N']} x {r['K']} | {r['tokens']} | {r['method']} | {r['us']:.1f} | "
                     f"{r['tbps']:.2f} | {r['pct_ceiling']:.0f}% | "
                     + (f"{r['x_cublas']:.2f}x |" if r["x_cublas"] else "- |"))
    meta["timing"] = f"CUDA graph over rotating weight copies (> 3x L2), median of {repeats} replays"
    write_outputs(meta, ceiling, rows, "\n".join(lines) + "\n", json_path=json_path, markdown_path=markdown_path)


"""santa-cupy benchmark harness: ``bench kernels`` and ``bench e2e``.

    santa-cupy bench kernels --quick --json bench.json --markdown bench.md
    santa-cupy bench e2e --context 32k --batch 1 --steps 20
    (or, in a checkout, ``python3 bench.py kernels ...`` / ``python3 bench.py e2e ...``)

kernels: decode attention alone, one DecodePlan per (shape, batch, context, method), timed as a
captured CUDA graph of many launches over rotating random input buffers (together >= 3x L2), median
of many replays; the streaming-read and device-copy ceilings are measured in the same run; torch SDPA
(flash / cudnn / efficient backends) and FlashInfer (our cache seen as pages of 16 rows, tensor cores)
are the external dense baselines when importable; "x best peer" divides our rows against the fastest
of cuDNN, FA2 (torch flash) and FlashInfer at the same point.
e2e: one whole decode step of a Llama-3.1-8B-shaped model with random fp16 weights and a random KV
cache, captured as a CUDA graph, dense vs SANTA attention. What is counted is in docs/BENCHMARKS.md.

Modules, one job each: methods (shapes, method names, parsers), accounting (bytes and derived
numbers), paged (the cache as pages), report (tables, files, plot), gpu (CuPy / torch / FlashInfer),
timing (timers and ceilings), peers (torch SDPA, FlashInfer), and one module per command (kernels
with stages, e2e, products). methods, accounting, paged and report are pure Python and tested on
CPU (tests/test_bench.py).
"""

import click

from santa_cupy.cli.bench.e2e import e2e_command
from santa_cupy.cli.bench.kernels import kernels_command, stages_command
from santa_cupy.cli.bench.products import products_command


@click.group("bench", context_settings={"help_option_names": ["-h", "--help"]})
def bench():
    """Benchmarks: decode-attention kernels and end-to-end decode (GPU, CuPy)."""


for _command in (kernels_command, stages_command, products_command, e2e_command):
    bench.add_command(_command)

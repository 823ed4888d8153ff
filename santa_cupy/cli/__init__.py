"""santa-cupy's command-line applications: the ``santa-cupy`` click group (main), the benchmarks (bench)
and the accuracy evaluations (evaluation). The libraries they drive are santa_cupy and llama_min.

Not imported by ``import santa_cupy``: the library stays free of click and llama_min; only the
``santa-cupy`` command (and ``cli.py`` / ``bench.py`` in a checkout) imports this package."""

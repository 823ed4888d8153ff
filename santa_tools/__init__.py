"""santa-cupy's command-line tools: the ``santa-cupy`` click group (cli), the benchmarks (bench) and
the accuracy evaluations (evaluation). The libraries they drive are santa_cupy and llama_min."""

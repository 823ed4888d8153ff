"""``python3 bench.py kernels ...`` in a checkout: ``santa-cupy bench`` (santa_cupy/cli/bench). Not installed."""

from santa_cupy.cli.bench import bench

if __name__ == "__main__":
    bench()

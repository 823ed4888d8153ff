"""``python3 bench.py kernels ...`` in a checkout: ``santa-cupy bench`` (santa_tools/bench). Not installed."""

from santa_tools.bench import bench

if __name__ == "__main__":
    bench()

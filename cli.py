"""``python3 cli.py ...`` in a checkout: the ``santa-cupy`` command (santa_cupy/cli/main.py). Not installed."""

from santa_cupy.cli.main import main

if __name__ == "__main__":
    main()

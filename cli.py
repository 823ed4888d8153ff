"""``python3 cli.py ...`` in a checkout: the ``santa-cupy`` command (santa_tools/cli.py). Not installed."""

from santa_tools.cli import main

if __name__ == "__main__":
    main()

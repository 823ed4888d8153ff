"""matplotlib for the reports' optional plots (``--plot``): imported on demand, headless."""

from __future__ import annotations

import sys


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with one line on stderr) when matplotlib is not
    installed: a report without its plot is still a report."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping the plot (pip install matplotlib)", file=sys.stderr)
        return None
    return plt

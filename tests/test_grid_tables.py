"""tools/grid_tables.py on a stored grid call (docs/results/h100_e4acc55): the tables BENCHMARKS.md
carried from it."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_grid_tables_reproduce_the_stored_h100_grid():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "grid_tables.py"),
                          str(ROOT / "docs" / "results" / "h100_e4acc55")],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert "| 1 | 8k | 19.8 | 18.7 | 26.0 | - | 19.8 (exact) | 25.5 | 31.8 | 0.95x | 0.74x | 0.59x |" in lines
    assert "| 16 | 128k | 2720.9 | 2664.8 | 2690.6 | - | 1676.5 | 1676.9 | 1871.8 | 1.59x | 1.59x | 1.42x |" in lines
    assert "| B=1, 32k | >= 1.5x | 1.24x |" in lines
    assert "| e2e 8B, B=1, 32k | >= 1.07x | 1.03x dense |" in lines
    assert "| e2e 8B, B=16, 32k | >= 1.45x | - |" in lines      # that call ran e2e at B=8 only


def test_grid_tables_refuses_a_folder_without_rows(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "tools" / "grid_tables.py"), str(tmp_path)],
                         capture_output=True, text=True, check=False)
    assert run.returncode != 0 and "no kernels_*.json rows" in run.stderr

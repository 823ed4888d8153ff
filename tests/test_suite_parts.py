"""SANTA_TEST_PART (tests/conftest.py): the n shares of a selection are disjoint, cover it, and
differ in size by at most one; a bad value stops the run."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _collect(part, *args):
    env = dict(os.environ, SANTA_TEST_PART=part)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *args],
                       cwd=ROOT, env=env, capture_output=True, text=True)
    return r.returncode, [line for line in r.stdout.splitlines() if "::" in line], r.stdout + r.stderr


def test_parts_cover_the_selection_once():
    _, every, _ = _collect("", "tests/test_setting.py", "-k", "not parse")
    assert len(every) > 10
    shares = [_collect(f"{i}/3", "tests/test_setting.py", "-k", "not parse")[1] for i in (1, 2, 3)]
    assert sorted(sum(shares, [])) == sorted(every)
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_bad_part_is_refused():
    for bad in ("3/2", "x"):
        rc, _, out = _collect(bad, "tests/test_setting.py")
        assert rc != 0 and "SANTA_TEST_PART must be i/n" in out, bad

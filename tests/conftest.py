"""The suite's pytest hooks.

SANTA_TEST_PART=i/n keeps the i-th of n interleaved shares of the selected tests (1-based: tests
k with k % n == i - 1, after the -m / -k selection), so that the GPU suite, longer than one device
call, spans n calls on a warm machine (tools/gpu_check.sh PART=i/n).
"""

import os

import pytest


def parse_part(value):
    """(i, n) from "i/n" with 1 <= i <= n; pytest.UsageError otherwise."""
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"SANTA_TEST_PART must be i/n with 1 <= i <= n, got {value!r}")
    return i, n


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    value = os.environ.get("SANTA_TEST_PART")
    if not value:
        return
    i, n = parse_part(value)
    config.hook.pytest_deselected(items=[t for k, t in enumerate(items) if k % n != i - 1])
    items[:] = [t for k, t in enumerate(items) if k % n == i - 1]

"""Every plan of tests/plan_launches.GRID launches exactly what the recorded baseline
(tests/data/plan_launches.json) says: kernels, grids, blocks, argument kinds and values, shared
memory. The plan's structure may change; its launches may not (without regenerating the baseline)."""

import json
from pathlib import Path

from tests import plan_launches, test_plan_host

launches = test_plan_host.launches            # the fixture

BASELINE = json.loads((Path(__file__).parent / "data" / "plan_launches.json").read_text())


def test_grid_matches_the_recorded_launches(launches):
    got = plan_launches.record(plan_launches.make_plan, launches)
    assert list(got) == list(BASELINE)
    for name, want in BASELINE.items():
        assert got[name]["attrs"] == want["attrs"], name
        assert len(got[name]["launches"]) == len(want["launches"]), name
        for i, (g, w) in enumerate(zip(got[name]["launches"], want["launches"])):
            assert g == w, f"{name}: launch {i} ({w[0]}) moved"


def test_grid_names_are_unique():
    names = [g[0] for g in plan_launches.GRID]
    assert len(set(names)) == len(names)

"""The side-by-side benchmark keeps working and prints what the tests prove (no timing is asserted)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

#: runs the platform's benchmark: the long part
pytestmark = pytest.mark.long

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_unified_gb10.py"


def test_bench_unified_gb10_reports_the_second_runs_and_the_two_workflow_pool(capsys):
    spec = importlib.util.spec_from_file_location("bench_unified_gb10", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--json", "--compute-seconds", "9"]) == 0
    data = json.loads(capsys.readouterr().out)
    for title, (runs, at) in bench.SCENARIOS.items():
        stock, plugin = data[title]["stock"]["runs"][at], data[title]["plugin"]["runs"][at]
        first = data[title]["stock"]["runs"][runs.index(stock["workflow"])]  # the cold load of that workflow
        assert plugin["loaded"] == 0 and plugin["seconds"] == 9.0
        assert stock["loaded"] == first["loaded"] > 0 and stock["seconds"] > 9.0
    two = data["two-workflow pool"]
    assert [sum(r["oom"] for r in two[s]["runs"]) for s in ("stock", "plugin")] == [0, 0]
    assert two["plugin"]["refusals"] == 0 and two["plugin"]["lowest_available"] >= two["plugin"]["headroom"]
    assert [r["evicted"] for r in two["plugin"]["runs"]][2:] == [["image_unet"], ["video_unet"], ["audio_model"]]
    assert sum(r["loaded"] for r in two["plugin"]["runs"]) < sum(r["loaded"] for r in two["stock"]["runs"])

"""benchmarks/bench_rocm_windows.py keeps printing its side-by-side figures (a short run; no timings)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

#: runs the platform's benchmark: the long part
pytestmark = pytest.mark.long

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_rocm_windows.py"


def test_bench_prints_seed_cycles_and_quota_side_by_side(capsys):
    spec = importlib.util.spec_from_file_location("bench_rocm_windows", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--json", "--cycles", "20"]) == 0
    data = json.loads(capsys.readouterr().out)
    stock, aimdo_sized, plugin = data["seed"]
    assert stock["commit_over_baseline"] == stock["reserved"] > 0 and stock["reservations_alive"] == 3
    assert aimdo_sized["reserved"] > stock["reserved"]
    assert plugin["backend"] == "rocm_windows" and plugin["commit_over_baseline"] == 0
    assert plugin["reservations_alive"] == plugin["driver_reservations"] == 0
    by = {(r["backend"], r["policy"], r["unload"]): r for r in data["cycles"]}
    ours = by[("rocm_windows", "membackend", "full_unload")]
    # one window kept per device: each cycle's release past it frees the smaller window while the frees last
    assert ours["done"] == 20 and ours["error"] is None and ours["large_frees"] <= 12 and ours["commit_flat_after_2"]
    assert ours["peak_quota_used"] <= ours["quota_limit"] and ours["crashes"] == 0
    assert by[("vmm", "membackend", "full_unload")]["error"] is not None  # the churn defect, without the pool
    vmm_quota, our_quota = data["quota"]
    assert vmm_quota["crashes"] == 1 and our_quota["crashes"] == 0 and our_quota["outcome"] == "AddressSpaceExhausted"

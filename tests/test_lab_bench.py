"""``membackend.lab.bench``: every entry comes out with sane types, as JSON and as a table; the public names the
benchmark scripts import.

No timing thresholds: the machines are shared and noisy, so only shapes and signs are checked.
The start-up measurement is replaced by a fake module (it would spawn interpreters importing torch).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from membackend.lab import bench
from membackend.lab._replay import compare, scenarios
from membackend.lab._replay.scenarios import SCENARIOS

#: runs the benchmark suite: the long part
pytestmark = pytest.mark.long

STARTUP = "membackend.lab.startup_cost"
BENCH_CORE = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_core.py"
ENTRIES = ("dispatch", "dispatch_free", "host_fault", "pages_alive", "startup")


def _startup_module(measure) -> types.ModuleType:
    mod = types.ModuleType(STARTUP)
    mod.measure_startup = measure
    return mod


def _fake_measure(calls: list[int]):
    def measure_startup(rounds: int = 3) -> dict:
        calls.append(rounds)
        return {"torch_seconds": 2.0, "adapter_seconds": 0.1, "ratio": 0.05}
    return measure_startup


def _isolated(mp: pytest.MonkeyPatch, where: Path) -> None:
    for key in list(os.environ):
        if key.startswith("MEMBACKEND_"):
            mp.delenv(key)
    mp.chdir(where)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    """One quick run with a fake start-up measurement: (result, progress lines, rounds asked)."""
    calls: list[int] = []
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as mp:
        _isolated(mp, tmp_path_factory.mktemp("bench"))
        mp.setitem(sys.modules, STARTUP, _startup_module(_fake_measure(calls)))
        result = bench.run_bench(quick=True, startup_rounds=1, progress=lines.append)
    return result, lines, calls


def _positive(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x > 0


def test_every_key_with_sane_types(quick):
    r, _, calls = quick
    assert set(r) == {"dispatch", "dispatch_free", "hot_path", "host_fault", "pages_alive", "free_sync", "startup",
                      "scenarios", "targets_met", "guarantees_held", "machine"}
    assert _positive(r["dispatch"]) and _positive(r["dispatch_free"])
    assert [row["ratio"] for row in r["hot_path"]] == [r["dispatch"], r["dispatch_free"]]
    for row in r["hot_path"]:
        assert all(_positive(row[k]) for k in ("session_ns", "direct_ns", "pluggy_generic_ratio"))
    hf = r["host_fault"]
    assert all(_positive(hf[k]) for k in ("gbps", "memset_gbps", "ratio")) and hf["target"] == ">= 0.35"
    assert "64 MiB" in hf["bench"]  # quick shrinks the size
    pa = r["pages_alive"]
    assert all(_positive(pa[k]) for k in ("ns_1k", "ns_100k", "ratio")) and pa["target"] == "<= 1.5"
    assert calls == [1]
    assert r["startup"] == {"torch_seconds": 2.0, "adapter_seconds": 0.1, "ratio": 0.05, "target": "<= 0.15"}
    assert set(r["targets_met"]) == set(ENTRIES)
    assert all(isinstance(v, bool) for v in r["targets_met"].values())
    assert r["targets_met"]["startup"] is True  # 0.05 <= 0.15
    assert isinstance(r["machine"], str) and f"{os.cpu_count()} CPUs" in r["machine"]


def test_targets_met_follow_the_ratios(quick):
    r, _, _ = quick
    assert r["targets_met"]["dispatch"] == (r["dispatch"] <= 1.2)
    assert r["targets_met"]["dispatch_free"] == (r["dispatch_free"] <= 1.25)
    assert r["targets_met"]["host_fault"] == (r["host_fault"]["ratio"] >= 0.35)
    assert r["targets_met"]["pages_alive"] == (r["pages_alive"]["ratio"] <= 1.5)


def test_every_scenario_replayed_with_its_figures(quick):
    r, lines, _ = quick
    assert list(r["scenarios"]) == list(SCENARIOS)
    for name, sc in r["scenarios"].items():
        assert {"report", "profile", "backends", "figures", "violations", "stock_reproduces"} <= set(sc)
        assert sc["violations"] == [], name
        assert set(sc["backends"]) == {"stock", "plugin"}
        assert sc["seeds"] == 1  # quick: one seed each
        for key in ("peak_committed", "alive_after_unload", "loaded"):
            fig = sc["figures"][key]
            assert fig["stock"] is not None and fig["plugin"] is not None, (name, key)
        assert sc["figures"]["alive_after_unload"]["plugin"] == 0
        assert sc["stock_reproduces"] is True, name
    assert r["guarantees_held"] is True
    assert lines == ["hot path", "host fault", "pages alive", "free sync", "startup"] + \
        [f"scenario {n}" for n in SCENARIOS]


def test_free_sync_rows_show_what_the_device_sync_costs_and_why_wddm_keeps_it(quick):
    """Shapes and the simulated driver's behaviour only (no wall-time threshold): with the sync every free
    waits for the other range's kernel; without it the kernel is still running afterwards, except on WDDM,
    where the free races the page-in of the fresh mapping (ComfyUI #16246)."""
    r, _, _ = quick
    rows = {row["profile"]: row for row in r["free_sync"]}
    assert set(rows) == set(bench.FREE_SYNC_PROFILES)
    for name, row in rows.items():
        assert _positive(row["sync_us"]) and row["sync_stall_ms"] > 0 and row["sync_kernel_running"] == 0.0, name
        assert row["sync_failure"] is None and row["sync_hazards"] == 0, name
        if name == "wddm-6gb":
            assert row["platform_syncs"] and "Bugcheck" in row["nosync_failure"] and row["nosync_us"] is None
            assert row["ratio"] is None and row["nosync_hazards"] > 0
        else:
            assert row["nosync_failure"] is None and row["nosync_hazards"] == 0, name
            assert _positive(row["nosync_us"]) and _positive(row["ratio"]), name
            assert row["nosync_stall_ms"] == 0 and row["nosync_kernel_running"] == 1.0, name
    assert [rows[n]["platform_syncs"] for n in ("h200", "gb10-128gb", "rocm-win-2gpu")] == [False, False, True]


def test_json_serialisable(quick):
    r, _, _ = quick
    back = json.loads(json.dumps(r))
    assert back["dispatch"] == r["dispatch"] and set(back["scenarios"]) == set(SCENARIOS)


def test_table_mentions_every_entry(quick):
    r, _, _ = quick
    text = bench.format_bench(r)
    for needle in ("Session.fault", "Session.free", "host fault", "pages alive", "start-up", "<= 0.15",
                   "free with a token unfinished on another range", "SimulatedBugcheck",
                   "guarantees held in every scenario: yes"):
        assert needle in text, needle
    for name, sc in SCENARIOS.items():
        assert name in text and f"plugin holds {sc.guarantee}: yes" in text
    # each scenario's reported figures are among its headline rows
    assert "~120 s stock, ~9 s warm" in text and "(the report's 20.96 GiB) still allocated" in text
    assert f"{r['dispatch']:.2f}" in text


@pytest.mark.parametrize("module", [
    None,  # not installed: the import fails
    _startup_module(lambda rounds=3: (_ for _ in ()).throw(RuntimeError("no torch here"))),
    _startup_module(lambda rounds=3: {"torch_seconds": 1.0}),  # incomplete answer
    _startup_module(lambda rounds=3: {"torch_seconds": 0.0, "adapter_seconds": 0.1, "ratio": float("inf")}),
])
def test_startup_failure_is_recorded_as_skipped(monkeypatch, module):
    monkeypatch.setitem(sys.modules, STARTUP, module)
    got = bench.bench_startup(1)
    assert set(got) == {"skipped"} and isinstance(got["skipped"], str) and got["skipped"]


def test_skipped_startup_leaves_targets_and_shows_in_table(monkeypatch):
    def broken(rounds=3):
        raise RuntimeError("no torch here")
    monkeypatch.setitem(sys.modules, STARTUP, _startup_module(broken))
    monkeypatch.setattr(scenarios, "SCENARIOS", {})  # the replays are covered above
    r = bench.run_bench(quick=True, startup_rounds=1)
    assert r["startup"] == {"skipped": "RuntimeError: no torch here"}
    assert set(r["targets_met"]) == set(ENTRIES) - {"startup"}
    assert "skipped: RuntimeError: no torch here" in bench.format_bench(r)
    json.dumps(r)


def test_plugin_that_did_not_run_does_not_hold(monkeypatch):
    real = compare.replay

    def without_plugin(name, **kw):
        c = real(name, policy="stock", **kw)
        c.missing["plugin"] = "membackend-rocm-windows is not installed"
        return c
    monkeypatch.setitem(sys.modules, STARTUP, _startup_module(_fake_measure([])))
    monkeypatch.setattr(scenarios, "SCENARIOS", {"full-unload-rocm": SCENARIOS["full-unload-rocm"]})
    monkeypatch.setattr(compare, "replay", without_plugin)
    r = bench.run_bench(quick=True, startup_rounds=1)
    sc = r["scenarios"]["full-unload-rocm"]
    assert sc["violations"] == [] and r["guarantees_held"] is False
    text = bench.format_bench(r)
    assert "plugin holds G1: no" in text and "not run" in text


def test_bench_free_sync_script_runs(tmp_path):
    script = BENCH_CORE.with_name("bench_free_sync.py")
    out = subprocess.run([sys.executable, str(script), "--quick", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [row["profile"] for row in rows] == list(bench.FREE_SYNC_PROFILES)


def test_bench_core_script_still_runs(tmp_path):
    out = subprocess.run([sys.executable, str(BENCH_CORE), "--quick", "--json"], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    ratios = [row["ratio"] for row in data["hot_path"]] + [data["throughput"]["ratio"], data["pages_alive"]["ratio"]]
    assert len(ratios) == 4 and all(x > 0 for x in ratios)


def test_the_public_face_benchmark_scripts_import():
    """Everything in ``__all__`` is there; the re-exports are the replay's and the start-up measurement's own
    functions, under names that do not clash with the suite's ``bench_startup``."""
    from membackend.lab import startup_cost

    assert all(hasattr(bench, name) for name in bench.__all__)
    assert bench.replay is compare.replay
    assert bench.measure_startup_cost is startup_cost.measure_startup
    assert bench.format_startup is startup_cost.format_startup
    assert not hasattr(bench, "measure_startup")
    for name in ("bench_hot_path", "bench_fault_parts", "bench_fault_throughput", "bench_pages_alive", "bench_free_sync", "bench_startup",
                 "run_bench", "replay", "measure_startup_cost"):
        assert name in bench.__all__ and f"{name}`" in bench.__doc__, name  # each is said in the docstring


def test_benchmark_scripts_import_the_public_bench_module_only():
    """The scripts built on the suite import nothing internal (no module with a part starting with ``_``)."""
    import ast

    for script in ("bench_core.py", "bench_free_sync.py", "bench_comfyui_startup.py", "bench_trace_stream.py",
                   "bench_fault_parts.py"):
        source = BENCH_CORE.with_name(script).read_text()
        modules = [node.module for node in ast.walk(ast.parse(source)) if isinstance(node, ast.ImportFrom)]
        modules += [a.name for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Import) for a in node.names]
        assert "from membackend.lab.bench import" in source, script  # bench_trace_stream's is in its replaying child
        internal = [m for m in modules if m and m.startswith("membackend")
                    and any(part.startswith("_") for part in m.split("."))]
        assert internal == [] and "membackend._" not in source, (script, internal)


def test_the_fault_parts_build_up_to_the_session_fault_itself():
    rows = bench.bench_fault_parts(rounds=2, n=50)
    assert [row["row"] for row in rows] == ["one more Python call", "+ the argument checks",
                                           "+ the permit and its token, the waiters",
                                           "+ Fault.mapped, the error wrappers", "Session.fault itself"]
    assert all(_positive(row["ns"]) and _positive(row["ratio"]) for row in rows)
    assert len({row["direct_ns"] for row in rows}) == 1  # one baseline, measured beside every row
    lines = bench.format_fault_parts(rows)
    assert len(lines) == 6 and "Session.fault itself" in lines[-1] and lines[-1].rstrip().endswith("ns)")

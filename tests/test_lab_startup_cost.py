"""The start-up measurement (``membackend.lab.startup_cost``): what the ComfyUI adapter adds to ComfyUI's start-up,
as a ratio to ``import torch``; every side reported, a side that did not start is an error and not a figure, the
rounds alternate the sides and keep each side's best. Only the first test starts interpreters; the others replace
the runs."""

from __future__ import annotations

import importlib.util

import pytest

from membackend.lab import startup_cost

#: starts Python processes to time ComfyUI's start-up: the long part
pytestmark = pytest.mark.long

ROWS = {"torch", "adapter, auto", "adapter, started", "torch, after prestartup"}


@pytest.mark.skipif(importlib.util.find_spec("torch") is None or importlib.util.find_spec("comfy_aimdo") is None,
                    reason="needs torch and comfy-aimdo")
def test_measure_startup_runs_and_reports_every_side():
    """A real run (one round, no warm-up); shapes only, no timing threshold."""
    r = startup_cost.measure_startup(1, bytecode_cache=False)
    assert set(r["rows"]) == ROWS and r["rounds"] == 1 and r["bytecode_cache"] is False
    assert r["torch_seconds"] > 0 and r["adapter_seconds"] > 0
    assert r["adapter_seconds"] == max(r["rows"]["adapter, auto"]["seconds"], r["rows"]["adapter, started"]["seconds"])
    assert r["ratio"] == pytest.approx(r["adapter_seconds"] / r["torch_seconds"])
    assert "adapter, started" in startup_cost.format_startup(r)


def test_without_torch_it_raises_torch_missing(monkeypatch):
    real = startup_cost.importlib.util.find_spec
    monkeypatch.setattr(startup_cost.importlib.util, "find_spec", lambda n, *a: None if n == "torch" else real(n, *a))
    with pytest.raises(startup_cost.TorchMissing, match="torch is not installed"):
        startup_cost.measure_startup(1)
    # one class per meaning: the same TorchMissing a tensor view raises, importable from membackend.types
    from membackend import _tensors, types
    assert startup_cost.TorchMissing is types.TorchMissing is _tensors.TorchMissing


def test_a_side_that_did_not_start_or_failed_is_an_error_not_a_figure(monkeypatch):
    def not_started(code, extra, cwd, pycache):
        if code == startup_cost.TORCH:
            return {"seconds": 2.0}
        return {"seconds": 0.01, "torch_seconds": 2.0, "armed": False, "started": False, "aborted": None}
    monkeypatch.setattr(startup_cost, "_run", not_started)
    with pytest.raises(startup_cost.StartupCostError, match="did not start on the host backend"):
        startup_cost.measure_startup(1, bytecode_cache=False)
    monkeypatch.undo()
    monkeypatch.setattr(startup_cost, "ADAPTER", "raise SystemExit('broken adapter')")
    with pytest.raises(startup_cost.StartupCostError, match="broken adapter"):
        startup_cost.measure_startup(1, bytecode_cache=False)


def test_rounds_alternate_the_sides_and_keep_each_sides_best(monkeypatch):
    seen = []
    figures = iter([2.0, 0.3, 0.2, 1.5, 0.4, 0.1, 1.8, 0.1, 0.5])  # torch, auto, started per round

    def fake(code, extra, cwd, pycache):
        side = "torch" if code == startup_cost.TORCH else ("started" if extra else "auto")
        seen.append((side, pycache is not None))
        step = next(figures)
        return {"seconds": step, "torch_seconds": 3 * step, "armed": True, "started": True, "aborted": None}
    monkeypatch.setattr(startup_cost, "_run", fake)
    r = startup_cost.measure_startup(3, bytecode_cache=False)
    assert [s for s, _ in seen] == ["torch", "auto", "started"] * 3 and not any(c for _, c in seen)
    assert r["torch_seconds"] == 1.5 and r["rows"]["adapter, auto"]["seconds"] == 0.1
    assert r["rows"]["adapter, started"]["seconds"] == 0.1 and r["adapter_seconds"] == 0.1
    assert r["rows"]["torch, after prestartup"]["seconds"] == pytest.approx(0.3)
    assert r["ratio"] == pytest.approx(0.1 / 1.5)
    seen.clear()
    figures = iter([0.5] * 6)
    startup_cost.measure_startup(1)  # the cached-bytecode run: one warm-up of each kind first
    assert seen == [("torch", True), ("auto", True), ("started", True)] * 2

"""The adapter's per-call paths under the lab's timers (``membackend.lab.adapter``): figures of both ways and
their ratio, nothing left running or changed afterwards, and a warm path that stopped being warm is an error,
not a figure. Shapes only: no timing threshold on this shared machine."""

from __future__ import annotations

import pytest

from membackend._comfyui import buffers, runtime, vbar
from membackend.lab import adapter
from membackend.types import NotResident


def test_the_warm_path_reports_both_ways_and_stops_its_runtime():
    figures = adapter.warm_path(weights=8, steps=2, profile="h200", rounds=1)
    assert set(figures) == {"warm", "checked", "ratio"} and figures["warm"] > 0 and figures["checked"] > 0
    assert figures["ratio"] == pytest.approx(figures["warm"] / figures["checked"])
    assert runtime.current() is None and runtime.outcome().state == "stock"


def test_a_warm_layer_whose_signature_changed_is_not_resident_and_the_runtime_still_stops(monkeypatch):
    monkeypatch.setattr(vbar, "vbar_signature_compare", lambda a, b: False)
    with pytest.raises(NotResident, match="signature changed"):
        adapter.warm_path(weights=2, steps=1, rounds=1)
    assert runtime.current() is None


def test_a_profile_that_is_not_simulated_is_a_config_error():
    from membackend.types import ConfigError

    with pytest.raises(ConfigError):
        adapter.warm_path(weights=1, steps=1, profile="no-such-gpu", rounds=1)
    assert runtime.current() is None


def test_the_file_read_reports_both_ways_and_puts_the_reader_gate_back():
    gate = buffers.READ_THREADS_FROM
    figures = adapter.file_read(mib=24, rounds=1)
    assert set(figures) == {"one thread", "reader threads", "ratio"} and figures["one thread"] > 0
    assert figures["ratio"] == pytest.approx(figures["reader threads"] / figures["one thread"])
    assert buffers.READ_THREADS_FROM == gate

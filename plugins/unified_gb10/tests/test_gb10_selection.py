"""Selection through the entry point: auto on the GB10 profile, never on the other three; forced by name;
the doctor explains both."""

from __future__ import annotations

import importlib.metadata

import pytest

from membackend._cli import main
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.types import ConfigError
from membackend_unified_gb10 import HEADROOM_ENV, PLATFORM, SCORE


def test_the_distribution_publishes_one_entry_point_naming_the_record():
    eps = [ep for ep in importlib.metadata.entry_points(group="membackend.backends")
           if ep.dist is not None and ep.dist.name == "membackend-unified-gb10"]
    assert [(ep.name, ep.value) for ep in eps] == [("unified_gb10", "membackend_unified_gb10:PLATFORM")]
    assert eps[0].load() is PLATFORM


def test_auto_selected_on_the_gb10_profile():
    sel = BackendManager(load_settings(sim_profile="gb10-128gb")).select()
    assert sel.record.name == "unified_gb10" and sel.how == "auto"
    assert sel.candidates["unified_gb10"].score == SCORE > sel.candidates["vmm"].score
    assert "NVIDIA GB10" in sel.reason and "119.2 GiB pool" in sel.reason


@pytest.mark.parametrize("profile, why", [("wddm-6gb", "NVIDIA GeForce RTX 3050 is not integrated"),
                                          ("h200", "NVIDIA H200 is not integrated"),
                                          ("rocm-win-2gpu", "no CUDA device")])
def test_not_selected_on_the_other_profiles(profile, why):
    sel = BackendManager(load_settings(sim_profile=profile)).select()
    assert sel.record.name != "unified_gb10" and sel.how == "auto"  # vmm, or another platform plugin
    c = sel.candidates["unified_gb10"]
    assert c.score == 0 and why in c.reason


def test_forced_by_the_backend_variable(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "gb10-128gb")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "unified_gb10")
    s = BackendManager(load_settings()).session()
    try:
        assert s.name == "unified_gb10" and s.how == "forced"
    finally:
        s.close()


def test_the_doctor_explains_the_automatic_choice(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "gb10-128gb")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "unified_gb10" in line and "score" in line)
    assert row.lstrip().startswith("* unified_gb10") and f"score {SCORE}" in row and "NVIDIA GB10" in row
    assert "selected: unified_gb10 (auto): highest probe score (70)" in out
    assert main(["budget"]) == 0
    assert "unified pool: MemAvailable" in capsys.readouterr().out


def test_forcing_it_where_it_does_not_fit_is_refused_unless_the_probe_is_overridden(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "h200")
    monkeypatch.setenv("MEMBACKEND_BACKEND", "unified_gb10")
    assert main(["backends"]) == 2  # not a self-test failing later on raw byte counts (issue 42)
    err = capsys.readouterr().err
    assert "its probe says it does not fit this machine: cuda:0 NVIDIA H200 is not integrated" in err
    monkeypatch.setenv("MEMBACKEND_OVERRIDE_PROBE", "1")
    assert main(["backends"]) == 0
    out = capsys.readouterr().out
    assert "selected: unified_gb10 (forced): forced by backend='unified_gb10'" in out
    assert "its probe says it does not fit (overridden by override_probe): its probe's reason, above" in out
    assert "score 0    cuda:0 NVIDIA H200 is not integrated" in out


def test_the_doctor_shows_a_bad_headroom_variable_and_forcing_then_names_it(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "gb10-128gb")
    monkeypatch.setenv(HEADROOM_ENV, "plenty")
    # a settings error (issue 42): exit 2 naming the variable, never another backend selected in its place
    assert main(["backends"]) == 2
    captured = capsys.readouterr()
    assert f"unified_gb10.headroom (from env {HEADROOM_ENV}): 'plenty' is not a size" in captured.err
    assert "selected:" not in captured.out
    with pytest.raises(ConfigError, match=HEADROOM_ENV):
        BackendManager(load_settings(backend="unified_gb10")).select()

"""Selection: cuda_wddm is found through its entry point, auto-selected on wddm-6gb only, forced by name
wherever a CUDA device is (elsewhere a configuration error with its probe's reason), and the doctor explains
both; the conformance kit passes on it over the profile."""

from __future__ import annotations

import subprocess
import sys

import pytest

from membackend import _cli as cli
from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.types import BackendNotFound

OTHERS = ("rocm-win-2gpu", "gb10-128gb", "h200")


def test_auto_selected_on_wddm_6gb_through_its_entry_point():
    manager = BackendManager(load_settings(sim_profile="wddm-6gb"))
    sel = manager.select()
    assert sel.how == "auto" and sel.record.name == "cuda_wddm"
    assert sel.record.origin.startswith("entry point cuda_wddm")
    assert sel.candidates["cuda_wddm"].score > sel.candidates["vmm"].score
    s = manager.session()
    try:
        assert s.backend.name == "cuda_wddm" and s.backend.platform.budget_source == "wddm"
    finally:
        s.close()


@pytest.mark.parametrize("profile", OTHERS)
def test_not_selected_on_the_other_profiles(profile):
    sel = BackendManager(load_settings(sim_profile=profile)).select()
    assert sel.record.name != "cuda_wddm"
    assert sel.candidates["cuda_wddm"].score == 0 and sel.candidates["cuda_wddm"].reason


def test_forced_by_name_where_it_does_not_fit_only_with_the_probe_overridden():
    with pytest.raises(BackendNotFound, match="its probe says it does not fit this machine: the OS is linux, not "
                                              "Windows.*MEMBACKEND_OVERRIDE_PROBE=1"):
        BackendManager(load_settings(sim_profile="h200", backend="cuda_wddm")).select()
    sel = BackendManager(load_settings(sim_profile="h200", backend="cuda_wddm", override_probe=True)).select()
    assert sel.how == "forced" and sel.record.name == "cuda_wddm"
    assert "does not fit (overridden by override_probe)" in sel.reason and "not Windows" in sel.reason
    wddm = BackendManager(load_settings(sim_profile="wddm-6gb", backend="cuda_wddm")).select()
    assert wddm.how == "forced" and wddm.record.name == "cuda_wddm"


def _backends(monkeypatch, capsys, **env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["backends"]) == 0
    return capsys.readouterr().out


def test_the_doctor_explains_the_auto_selection(monkeypatch, capsys):
    out = _backends(monkeypatch, capsys, MEMBACKEND_SIM_PROFILE="wddm-6gb")
    assert "selected: cuda_wddm (auto)" in out
    assert "under WDDM" in out and "96 - 2 per GiB" in out and "512 MiB headroom" in out


def test_forced_where_it_serves_no_device_the_doctor_refuses_with_its_probes_reason(monkeypatch, capsys):
    monkeypatch.setenv("MEMBACKEND_SIM_PROFILE", "rocm-win-2gpu")  # AMD GPUs only: no CUDA device to serve
    monkeypatch.setenv("MEMBACKEND_BACKEND", "cuda_wddm")
    assert cli.main(["backends"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "backend 'cuda_wddm' cannot be used here: it serves cuda devices" in err[0], err
    assert "no NVIDIA (CUDA) device found" in err[0], err


def test_the_doctor_on_h200_says_why_not(monkeypatch, capsys):
    out = _backends(monkeypatch, capsys, MEMBACKEND_SIM_PROFILE="h200")
    line = next(l for l in out.splitlines() if "cuda_wddm" in l and "score" in l)
    assert "score 0" in line and "not Windows" in line


@pytest.mark.kit_long  # the whole kit in a subprocess
def test_the_conformance_kit_passes_over_wddm_6gb(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--pyargs", "membackend.testing.conformance",
         "--membackend-backend", "cuda_wddm:wddm-6gb", "--membackend-examples", "8"],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    checked = next(x for x in proc.stdout.splitlines() if x.startswith("membackend kit: cuda_wddm:wddm-6gb: checked: "))
    for check in ("ledger vs driver (membackend_inspect)", "budget vs the machine", "partial frees",
                  "leaks after close"):
        assert check in checked, checked

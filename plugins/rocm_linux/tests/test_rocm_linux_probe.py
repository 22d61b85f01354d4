"""When rocm_linux is selected: on the three AMD-on-Linux machines with VMM, never on a gfx1150 APU (no VMM),
never on another platform's machine; and rocm_windows never on Linux. Selection runs as membackend runs it
(the settings' simulated profile, machine discovery through the simulated HIP runtime, every probe)."""

from __future__ import annotations

import dataclasses

import pytest
from rocm_linux_sessions import SELECTED

from membackend._manager import BackendManager
from membackend._settings import load_settings
from membackend.lab.simulated import simulated_machine, simulated_profiles
from membackend.types import Score
from membackend_rocm_linux import PLATFORM, SCORE_LISTED, SCORE_TORCH, probe


def _selected(profile: str) -> str:
    sel = BackendManager(load_settings(sim_profile=profile)).select()
    assert sel.record is not None
    return sel.record.name


@pytest.mark.parametrize("profile", SELECTED)
def test_selected_on_the_amd_linux_machines_with_vmm(profile):
    assert _selected(profile) == "rocm_linux"


def test_not_selected_on_a_gfx1150_apu_and_the_reason_says_why():
    assert _selected("gfx1150-apu") == "host"
    c = probe(simulated_machine("gfx1150-apu"))
    assert c.score == Score.NONE
    assert "APU without virtual memory management" in c.reason and "gfx1150" in c.reason
    assert "hipMemCreate is not supported" in c.reason and "does not claim it" in c.reason


@pytest.mark.parametrize("profile", [p for p in simulated_profiles() if p not in SELECTED])
def test_never_selected_on_other_machines(profile):
    assert probe(simulated_machine(profile)).score == Score.NONE
    assert _selected(profile) != "rocm_linux"


@pytest.mark.parametrize("profile", SELECTED + ("gfx1150-apu", "mi100-novmm"))
def test_rocm_windows_is_never_selected_on_linux(profile):
    assert _selected(profile) != "rocm_windows"


def test_scores_follow_the_torch_build():
    m = simulated_machine("rx7900xtx-linux")
    assert probe(m).score == SCORE_TORCH
    assert probe(dataclasses.replace(m, torch_vendor=None)).score == SCORE_LISTED
    for vendor in ("cpu", "cuda"):
        c = probe(dataclasses.replace(m, torch_vendor=vendor))
        assert c.score == Score.NONE and f"torch is a {vendor} build" in c.reason


def test_not_linux_is_refused_naming_the_windows_plugin():
    c = probe(dataclasses.replace(simulated_machine("rx7900xtx-linux"), os="windows"))
    assert c.score == Score.NONE and "rocm_windows" in c.reason


def test_the_reason_names_each_device_and_the_apu_budget():
    c = probe(simulated_machine("strix-halo-128gb"))
    assert "AMD Radeon 8060S Graphics (gfx1151, APU, one pool with the host)" in c.reason
    assert "sysfs carve-out + GTT" in c.reason and "MemAvailable" in c.reason
    d = probe(simulated_machine("rx9070xt-linux"))
    assert "(gfx1201, discrete)" in d.reason and "never below 2 MiB" in d.reason


def test_the_record():
    assert PLATFORM.vendor == "hip" and PLATFORM.budget_source == "auto" and PLATFORM.page_size == 32 << 20
    caps = PLATFORM.capabilities_for()
    assert caps.map_granularity == 2 << 20 and caps.vmm_self_test and not caps.memory_returns_on_unmap
    assert caps.release_on_full_unload and not caps.recycle_handles and caps.page_in_sync == "never"

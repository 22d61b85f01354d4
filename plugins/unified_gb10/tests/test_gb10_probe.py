"""The probe: an integrated CUDA device (never unified addressing alone); the reason names the device and
the pool; the headroom rule."""

from __future__ import annotations

import pytest

from membackend.types import ConfigError, Device, DeviceInfo, Machine, Score
from membackend_unified_gb10 import HEADROOM_ENV, HEADROOM_MAX, HEADROOM_MIN, PLATFORM, SCORE, headroom, probe

GB, GIB = 10**9, 1 << 30


def machine(*devices: DeviceInfo, ram: int = 128 * GB, cgroup: int | None = None) -> Machine:
    return Machine(os="linux", cpus=20, ram_total=ram, ram_available=ram, cgroup_limit=cgroup,
                   torch_version="2.13.0", torch_vendor="cuda", devices=devices)


def gpu(index: int = 0, name: str = "NVIDIA GB10", total: int = 128 * GB, integrated: bool = True,
        unified: bool = True, kind: str = "cuda", vmm: bool | None = True) -> DeviceInfo:
    return DeviceInfo(Device(kind, index), name, total, integrated=integrated, unified=unified, vmm_supported=vmm)


def test_the_record_is_a_cuda_platform_on_the_unified_budget_that_refuses_past_the_pool():
    assert PLATFORM.name == "unified_gb10" and PLATFORM.vendor == "cuda" and PLATFORM.budget_source == "unified"
    assert PLATFORM.capabilities.unified_pool and PLATFORM.capabilities.release_on_full_unload
    assert not PLATFORM.capabilities.recycle_handles
    assert SCORE in Score.PLATFORM and SCORE > max(Score.GENERIC)


def test_an_integrated_cuda_device_fits_and_the_reason_names_it_and_the_pool():
    c = probe(machine(gpu()))
    assert c.score == SCORE and not c.opt_in
    assert "cuda:0 NVIDIA GB10" in c.reason and "119.2 GiB pool" in c.reason


def test_a_jetson_fits_too_with_its_own_pool_size():
    c = probe(machine(gpu(name="Orin", total=30 * GB), ram=32 * GB))
    assert c.score == SCORE and "cuda:0 Orin" in c.reason and "29.8 GiB pool" in c.reason


def test_the_pool_is_the_cgroup_limit_when_it_is_smaller():
    c = probe(machine(gpu(), cgroup=64 * GB))
    assert c.score == SCORE and "59.6 GiB pool" in c.reason and "cgroup" in c.reason


def test_unified_addressing_alone_does_not_fit():
    c = probe(machine(gpu(name="NVIDIA H200", total=141 * GB, integrated=False, unified=True)))
    assert c.score == Score.NONE
    assert "cuda:0 NVIDIA H200 is not integrated" in c.reason and "unified addressing alone" in c.reason


def test_a_discrete_gpu_does_not_fit_and_the_reason_says_why():
    c = probe(machine(gpu(name="NVIDIA GeForce RTX 3050", total=6 * GB, integrated=False, unified=False)))
    assert c.score == Score.NONE and "not integrated" in c.reason and "5.6 GiB of its own memory" in c.reason


def test_integrated_next_to_discrete_is_left_to_the_generic_backend():
    c = probe(machine(gpu(0), gpu(1, "NVIDIA RTX 6000", 48 * GB, integrated=False, unified=False)))
    assert c.score == Score.NONE and "cuda:1 NVIDIA RTX 6000 is discrete" in c.reason


@pytest.mark.parametrize("devices, seen", [((), "no CUDA device;"),
                                           ((gpu(kind="hip", name="AMD Radeon 8060S"),), "hip:0 AMD Radeon 8060S")])
def test_no_cuda_device_does_not_fit(devices, seen):
    c = probe(machine(*devices))
    assert c.score == Score.NONE and "no CUDA device" in c.reason and seen in c.reason


def test_default_headroom_is_an_eighth_of_the_pool_clamped():
    assert headroom(128 * GB) == 16 * GB
    assert headroom(32 * GB) == 4 * GB
    assert headroom(8 * GIB) == HEADROOM_MIN  # an eighth is 1 GiB: the floor
    assert headroom(4 * GIB) == HEADROOM_MIN
    assert headroom(512 * GIB) == HEADROOM_MAX
    assert headroom(1 * GIB) == 512 << 20  # never more than half of a tiny pool


def test_the_headroom_variable_is_parsed_as_a_size_and_replaces_the_rule(monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, "12GiB")
    assert headroom(128 * GB, PLATFORM.setting_values()) == 12 * GIB
    monkeypatch.setenv(HEADROOM_ENV, "0")
    assert headroom(128 * GB, PLATFORM.setting_values()) == 0
    monkeypatch.setenv(HEADROOM_ENV, "  ")
    values = PLATFORM.setting_values()  # empty: not set, the rule
    assert values["headroom"] is None and headroom(128 * GB, values) == 16 * GB
    assert PLATFORM.headroom_source(values) == "platform unified_gb10's own rule"


def test_a_bad_headroom_variable_is_refused_when_the_settings_are_read_not_by_the_probe(monkeypatch):
    monkeypatch.setenv(HEADROOM_ENV, "sixteen")
    with pytest.raises(ConfigError) as info:
        PLATFORM.setting_values()
    assert info.value.key == "unified_gb10.headroom" and "'sixteen' is not a size" in str(info.value)
    assert info.value.source == f"env {HEADROOM_ENV}" and "GiB" in info.value.accepted
    assert probe(machine(gpu())).score == SCORE  # the probe reads no environment


def test_an_integrated_device_without_virtual_memory_management_does_not_fit():
    c = probe(machine(gpu(vmm=False)))
    assert c.score == 0 and "does not support virtual memory management" in c.reason

"""rocm_windows: the Platform record alone (probe, address quota, entry point), no session."""

from __future__ import annotations

import importlib.metadata
import logging

import pytest

import membackend_rocm_windows as rw
from membackend._settings import load_settings
from membackend.platform import Platform
from membackend.types import ConfigError, Device, DeviceInfo, Machine, Score

MiB, GiB, TiB = 1 << 20, 1 << 30, 1 << 40


def machine(os="windows", torch="rocm", devices=(("AMD Radeon RX 9070 XT", "gfx1201"),) * 2, kind="hip", vmm=True):
    return Machine(os=os, cpus=16, ram_total=64 * GiB, ram_available=64 * GiB, cgroup_limit=None,
                   torch_version="2.13.0+rocm10.0.0" if torch == "rocm" else None, torch_vendor=torch,
                   devices=tuple(DeviceInfo(Device(kind, i), name=n, total_memory=16 * GiB, arch=a, vmm_supported=vmm)
                                 for i, (n, a) in enumerate(devices)))


# --------------------------------------------------------------------------- probe


def test_fits_windows_rocm_and_names_every_device_and_architecture():
    c = rw.probe(machine(devices=(("AMD Radeon RX 9070 XT", "gfx1201"), ("AMD Radeon RX 7900 XTX", "gfx1100"))))
    assert c.score in Score.PLATFORM and c.score == rw.SCORE_TORCH
    assert "hip:0 AMD Radeon RX 9070 XT (gfx1201)" in c.reason and "hip:1 AMD Radeon RX 7900 XTX (gfx1100)" in c.reason
    assert "2 device(s)" in c.reason and "ROCm build of torch" in c.reason


def test_devices_listed_without_torch_fit_lower_than_with_a_rocm_torch():
    c = rw.probe(machine(torch=None))
    assert c.score in Score.PLATFORM and c.score < rw.SCORE_TORCH and "no torch" in c.reason


@pytest.mark.parametrize("m, why", [
    (machine(os="linux"), "not Windows (this machine runs linux)"),
    (machine(torch="cuda"), "torch is a cuda build"),
    (machine(torch="cpu"), "torch is a cpu build"),
    (machine(devices=()), "no HIP device listed"),
    (machine(devices=(("NVIDIA GeForce RTX 3050", "sm_86"),)), "not AMD GPUs: hip:0 NVIDIA GeForce RTX 3050 (sm_86)"),
    (machine(devices=(("NVIDIA GeForce RTX 3050", "sm_86"),), kind="cuda"), "no HIP device listed"),
])
def test_does_not_fit_elsewhere_and_says_why(m, why):
    c = rw.probe(m)
    assert c.score == Score.NONE and why in c.reason


def test_an_unknown_architecture_still_fits_and_says_so():
    assert "hip:0 unnamed (architecture unknown)" in rw.probe(machine(devices=(("", None),))).reason


# --------------------------------------------------------------------------- address quota


def values(**quota):
    """The platform's settings as membackend reads them (kwargs: ``address_quota=...``)."""
    return rw.PLATFORM.setting_values(load_settings(rocm_windows=quota) if quota else None)


def test_default_quota_is_the_rocm_default_with_a_margin_below_the_crash_point():
    caps = rw.PLATFORM.capabilities_for(values())
    assert rw.address_quota(values(), {}) == (256 * GiB, "the ROCm default")
    assert caps.address_quota == 240 * GiB  # 256 GiB minus 1/16: #9823 crashed on reaching 256
    assert caps.address_quota < 256 * GiB


@pytest.mark.parametrize("value, quota", [("4194304", 4 * TiB), ("262144", 256 * GiB), (" 65536 ", 64 * GiB),
                                          ("0" * 5000 + "1024", GiB)])
def test_ocl_set_svm_size_counts_mib(monkeypatch, value, quota):
    """ComfyUI sets 4194304 for "4TB" (PR #16199) and earlier 262144 for 256 GB: the unit is MiB."""
    assert rw.address_quota(None, {"OCL_SET_SVM_SIZE": value})[0] == quota
    monkeypatch.setenv("OCL_SET_SVM_SIZE", value)  # the runtime's own variable, read as the runtime reads it
    assert rw.PLATFORM.capabilities_for(values()).address_quota == quota - quota // 16


@pytest.mark.parametrize("value", ["4TB", "-1", "0", "", "1.5", "0x400000", str(2**32), "lots", "9" * 5000,
                                   "0" * 5000, "٣"])
def test_an_ocl_set_svm_size_the_runtime_cannot_use_is_logged_and_the_default_kept(value, caplog):
    with caplog.at_level(logging.WARNING, logger="membackend_rocm_windows"):
        assert rw.address_quota(None, {"OCL_SET_SVM_SIZE": value}) == (256 * GiB, "the ROCm default")
    assert "OCL_SET_SVM_SIZE" in caplog.text and "whole number of MiB" in caplog.text


def test_the_membackend_setting_wins_over_ocl_set_svm_size(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA", "512GiB")
    monkeypatch.setenv("OCL_SET_SVM_SIZE", "4194304")
    assert rw.address_quota(values()) == (
        512 * GiB, "rocm_windows.address_quota from env MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA")
    assert rw.PLATFORM.capabilities_for(values()).address_quota == 480 * GiB
    assert "512 GiB from rocm_windows.address_quota from env" in rw.policy(values())


def test_the_quota_setting_is_read_from_a_file_table_and_from_kwargs(tmp_path):
    (tmp_path / "membackend.toml").write_text('[rocm_windows]\naddress_quota = "128GiB"\n')
    got = values()
    assert (got["address_quota"], got.source("address_quota")) == (128 * GiB, "membackend.toml [rocm_windows]")
    got = values(address_quota="64GiB")
    assert (got["address_quota"], got.source("address_quota")) == (64 * GiB, "kwargs")


@pytest.mark.parametrize("value, says", [("lots", "is not a size"), ("-5GiB", "not a size"),
                                         ("256", "below 1 GiB"), ("true", "not a size")])
def test_a_bad_quota_setting_is_a_config_error_naming_the_key_and_what_is_accepted(monkeypatch, value, says):
    monkeypatch.setenv("MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA", value)
    with pytest.raises(ConfigError) as info:
        values()
    err = info.value
    assert (err.key, err.source) == ("rocm_windows.address_quota", "env MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA")
    assert says in str(err) and "at least 1 GiB" in err.accepted and "GiB" in err.accepted


def test_importing_never_fails_and_the_record_reads_no_environment(monkeypatch):
    monkeypatch.setenv("MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA", "nonsense")
    importlib.reload(rw)  # the module imports with a bad value in the environment, and so does its record
    assert isinstance(rw.PLATFORM, Platform) and rw.PLATFORM is rw.PLATFORM
    with pytest.raises(ConfigError):
        rw.PLATFORM.setting_values()  # reading the settings (what membackend does when it builds it) says why
    monkeypatch.setenv("MEMBACKEND_ROCM_WINDOWS_ADDRESS_QUOTA", "64GiB")
    assert rw.PLATFORM.capabilities_for(values()).address_quota == 60 * GiB


# --------------------------------------------------------------------------- the record


def test_the_record_tunes_the_mechanism_for_the_documented_defects():
    p = rw.PLATFORM
    caps = p.capabilities_for(p.default_values())
    assert isinstance(p, Platform) and (p.name, p.vendor, p.budget_source) == ("rocm_windows", "hip", "device")
    assert caps.release_on_full_unload and caps.reserve_churn_limit == 14 and caps.reserve_churn_window == GiB
    assert p.page_size == 32 * MiB and p.headroom_for(16 * GiB) == 256 * MiB


def test_one_entry_point_in_the_backends_group():
    eps = importlib.metadata.distribution("membackend-rocm-windows").entry_points
    assert [(e.group, e.name, e.value) for e in eps] == [
        ("membackend.backends", "rocm_windows", "membackend_rocm_windows:PLATFORM")]
    assert isinstance(tuple(eps)[0].load(), Platform)


def test_a_device_without_virtual_memory_management_does_not_fit():
    c = rw.probe(machine(vmm=False))
    assert c.score == 0 and "does not support virtual memory management" in c.reason
    unknown = rw.probe(machine(vmm=None))
    assert unknown.score == 0 and "unknown" in unknown.reason

"""The Platform seam: a record, a driver opener, budget sources behind the driver with simulated twins."""

from __future__ import annotations

import sys

import pytest

from membackend._backends.vmm import VmmBackend
from membackend._drivers import dxgi
from membackend._drivers.open import LazyDriver, check_sim_profile, machine_for, open_gpu_driver, resolve_vendor
from membackend._settings import load_settings
from membackend.platform import GENERIC, Platform, amd_unfit
from membackend.types import Candidate, ConfigError, Device, DriverError, Score

MiB, GiB = 1 << 20, 1 << 30


def _fits(machine):
    return Candidate("x", 60, "fits")


def backend_on(profile: str, **platform) -> VmmBackend:
    vendor = "hip" if profile.startswith("rocm") else "cuda"
    return VmmBackend(Platform(name=platform.pop("name", "p"), vendor=vendor, probe=_fits, **platform),
                      driver_factory=LazyDriver(vendor, profile))


def test_a_backend_is_named_after_its_platform_and_takes_its_defaults():
    b = backend_on("wddm-6gb", name="smallcard", headroom=64 * MiB, page_size=4 * MiB)
    assert b.name == "smallcard" and b.headroom == 64 * MiB and b.device_kinds == ("cuda",)
    r = b.membackend_reserve(Device("cuda", 0), 1)
    assert r.page_size == 4 * MiB and r.backend == "smallcard"
    b.membackend_release_reservation(r)


@pytest.mark.parametrize("bad, match", [
    ({"name": "Bad Name"}, "must match"),
    ({"vendor": "metal"}, "accepted: cuda, hip"),
    ({"budget_source": "nvml"}, "accepted: device, wddm, unified"),
    ({"probe": 42}, "probe must be callable"),
    ({"headroom": -1}, "headroom >= 0"),
])
def test_a_platform_record_refuses_bad_fields_saying_what_is_accepted(bad, match):
    fields = {"name": "ok", "probe": _fits, **bad}
    with pytest.raises(ValueError, match=match):
        Platform(**fields)


def test_the_wddm_budget_source_is_the_dxgi_budget_minus_usage_on_the_twin():
    b = backend_on("wddm-6gb", budget_source="wddm")
    sim = b.driver.sim
    budget = b.membackend_budget_query(Device("cuda", 0))
    assert budget.total == 6 * GiB - 512 * MiB == sim.wddm_budget(0) and budget.free == budget.total
    assert budget.source.startswith("DXGI QueryVideoMemoryInfo budget")
    r = b.membackend_reserve(Device("cuda", 0), 64 * MiB)
    b.membackend_fault(r, 0, 64 * MiB)
    assert b.membackend_budget_query(Device("cuda", 0)).free == budget.total - 64 * MiB


def test_the_unified_budget_source_is_memavailable_not_memfree_on_the_twin():
    b = backend_on("gb10-128gb", budget_source="unified")
    info = b.driver.sim.meminfo()
    budget = b.membackend_budget_query(Device("cuda", 0))
    assert budget.free == info["MemAvailable"] > info["MemFree"] and budget.unified
    assert "MemAvailable" in budget.source


def test_the_device_budget_source_is_mem_get_info():
    b = backend_on("h200")
    budget = b.membackend_budget_query(Device("cuda", 0))
    assert budget.source == "cuMemGetInfo (sim:h200)" and budget.total == 143_771 * MiB


def test_the_real_unified_source_reads_the_host_pool():
    from membackend._hostmem import host_memory

    d = open_gpu_driver("cuda")  # the real wrapper: the unified source needs no GPU
    total, free, source = d.budget("unified", 0)
    pool = host_memory()
    assert total == pool.total and 0 < free <= total and "unified pool" in source


def test_an_unknown_budget_source_is_a_typed_error():
    with pytest.raises(DriverError, match="accepted: device, wddm, unified"):
        open_gpu_driver("cuda").budget("nvml", 0)


@pytest.mark.skipif(sys.platform == "win32", reason="checks the behaviour off Windows")
def test_dxgi_off_windows_is_a_driver_error_not_a_crash():
    with pytest.raises(DriverError, match="only on Windows"):
        dxgi.query_video_memory((1, 0))


def test_a_luid_is_read_as_low_and_high_parts():
    assert dxgi.luid_from_bytes(bytes([1, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF])) == (1, -1)
    with pytest.raises(DriverError):
        dxgi.luid_from_bytes(b"\x00")


def test_the_opener_validates_profiles_and_vendors():
    with pytest.raises(ConfigError, match="accepted: wddm-6gb, rocm-win-2gpu, gb10-128gb, jetson-orin-16gb, h200"):
        check_sim_profile("pdp-11")
    with pytest.raises(ConfigError, match="simulates hip, not cuda"):
        open_gpu_driver("cuda", "rocm-win-2gpu")
    assert resolve_vendor(None, load_settings(sim_profile="rocm-win-2gpu")) == "hip"
    assert resolve_vendor(None, load_settings(machine={"torch_vendor": "rocm"})) == "hip"
    assert resolve_vendor("cuda", load_settings(sim_profile="rocm-win-2gpu")) == "cuda"


def test_machine_facts_follow_the_profile_and_overrides_win():
    m = machine_for(load_settings(sim_profile="rocm-win-2gpu", machine={"os": "linux"}))
    assert [d.name for d in m.gpus("hip")] == ["AMD Radeon RX 9070 XT"] * 2 and m.os == "linux"


def test_real_drivers_carry_no_simulation():
    assert not hasattr(open_gpu_driver("cuda"), "sim")
    assert hasattr(open_gpu_driver("cuda", "h200"), "sim")


def test_the_generic_platform_scores_in_the_generic_band():
    c = GENERIC.probe(machine_for(load_settings(sim_profile="h200")))
    assert c.score in Score.GENERIC and c.name == "vmm"
    assert GENERIC.probe(machine_for(load_settings(machine={"devices": []}))).score == Score.NONE


def test_every_capability_is_read_by_someone():
    """Issue: capabilities nobody read were silently ignored. Each field must appear in code that uses it."""
    import dataclasses
    from pathlib import Path

    import membackend
    from membackend.types import Capabilities

    root = Path(membackend.__file__).parent
    users = "".join(p.read_text() for folder in ("_backends/vmm", "_residency") for p in (root / folder).glob("*.py"))
    for f in dataclasses.fields(Capabilities):
        assert f"capabilities.{f.name}" in users or f"caps.{f.name}" in users, f"nobody reads {f.name}"


def test_a_headroom_rule_is_a_function_of_the_device_total():
    b = backend_on("gb10-128gb", budget_source="unified",
                   headroom=lambda total: min(8 * GiB, max(2 * GiB, total // 20)))
    budget = b.membackend_budget_query(Device("cuda", 0))
    assert budget.headroom == min(8 * GiB, max(2 * GiB, budget.total // 20)) == 6_400_000_000
    with pytest.raises(ValueError, match="accepted: an int >= 0"):
        backend_on("h200", headroom=lambda total: -1).membackend_budget_query(Device("cuda", 0))


def test_vmm_support_is_required_and_unknown_support_is_not_taken_for_support():
    from membackend.platform import vmm_unsupported
    from membackend.types import DeviceInfo, Machine

    def machine(*flags):
        return Machine(os="linux", cpus=2, ram_total=GiB, ram_available=GiB, cgroup_limit=None, torch_version=None,
                       torch_vendor="cuda", devices=tuple(DeviceInfo(Device("cuda", i), "GPU", GiB, vmm_supported=f,
                                                                     source="test")
                                                          for i, f in enumerate(flags)))
    assert vmm_unsupported(machine(True, True).devices) is None
    assert "cuda:1 (GPU) does not support virtual memory management" in vmm_unsupported(machine(True, False).devices)
    assert "unknown" in vmm_unsupported(machine(None).devices)
    assert GENERIC.probe(machine(True, False)).score == Score.NONE
    assert GENERIC.probe(machine(True)).score in Score.GENERIC


def test_the_sim_hip_driver_needs_no_hip_package():
    """hip-python has no Windows wheel: the simulated HIP driver takes its types from the ctypes binding."""
    from membackend._drivers.open import bindings_missing

    assert bindings_missing("hip", simulated=True) is None
    assert LazyDriver("hip", "rocm-win-2gpu").missing() is None


#: each interface's own methods in declaration order (dxgi.h, dxgi1_2.h, dxgi1_3.h, dxgi1_4.h; the C vtables
#: list the inherited ones first), from IUnknown down
_FACTORY4 = [
    ("IUnknown", ["QueryInterface", "AddRef", "Release"]),
    ("IDXGIObject", ["SetPrivateData", "SetPrivateDataInterface", "GetPrivateData", "GetParent"]),
    ("IDXGIFactory", ["EnumAdapters", "MakeWindowAssociation", "GetWindowAssociation", "CreateSwapChain",
                      "CreateSoftwareAdapter"]),
    ("IDXGIFactory1", ["EnumAdapters1", "IsCurrent"]),
    ("IDXGIFactory2", ["IsWindowedStereoEnabled", "CreateSwapChainForHwnd", "CreateSwapChainForCoreWindow",
                       "GetSharedResourceAdapterLuid", "RegisterStereoStatusWindow", "RegisterStereoStatusEvent",
                       "UnregisterStereoStatus", "RegisterOcclusionStatusWindow", "RegisterOcclusionStatusEvent",
                       "UnregisterOcclusionStatus", "CreateSwapChainForComposition"]),
    ("IDXGIFactory3", ["GetCreationFlags"]),
    ("IDXGIFactory4", ["EnumAdapterByLuid", "EnumWarpAdapter"]),
]
_ADAPTER3 = _FACTORY4[:2] + [
    ("IDXGIAdapter", ["EnumOutputs", "GetDesc", "CheckInterfaceSupport"]),
    ("IDXGIAdapter1", ["GetDesc1"]),
    ("IDXGIAdapter2", ["GetDesc2"]),
    ("IDXGIAdapter3", ["RegisterHardwareContentProtectionTeardownStatusEvent",
                       "UnregisterHardwareContentProtectionTeardownStatus", "QueryVideoMemoryInfo",
                       "SetVideoMemoryReservation", "RegisterVideoMemoryBudgetChangeNotificationEvent",
                       "UnregisterVideoMemoryBudgetChangeNotification"]),
]


def _slot(chain, method):
    return [m for _, methods in chain for m in methods].index(method)


def test_the_dxgi_vtable_slots_follow_the_interfaces_method_lists():
    """A wrong slot would call another method and crash the process rather than raise."""
    assert dxgi._RELEASE == _slot(_FACTORY4, "Release")
    assert dxgi._FACTORY4_ENUM_ADAPTER_BY_LUID == _slot(_FACTORY4, "EnumAdapterByLuid")
    assert dxgi._ADAPTER3_QUERY_VIDEO_MEMORY_INFO == _slot(_ADAPTER3, "QueryVideoMemoryInfo")


def test_amd_unfit_answers_for_every_amd_platform_why_the_machine_is_not_theirs():
    import dataclasses

    from membackend.lab.simulated import simulated_machine

    m = simulated_machine("rx7900xtx-linux")
    assert amd_unfit(m, "mine", "the driver") is None
    c = amd_unfit(dataclasses.replace(m, torch_vendor="cuda"), "mine", "the driver")
    assert c.name == "mine" and c.score == Score.NONE and "torch is a cuda build" in c.reason
    c = amd_unfit(simulated_machine("h200"), "mine", "the amdgpu driver")
    assert "torch is a cuda build" in c.reason
    c = amd_unfit(dataclasses.replace(simulated_machine("h200"), torch_vendor=None), "mine", "the amdgpu driver")
    assert "no HIP device listed" in c.reason and c.reason.endswith("check the amdgpu driver)")
    nvidia = dataclasses.replace(m.devices[0], arch="sm_90")
    c = amd_unfit(dataclasses.replace(m, devices=(nvidia,)), "mine", "the driver")
    assert "not AMD GPUs" in c.reason and "sm_90" in c.reason

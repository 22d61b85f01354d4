"""Each simulated profile's documented behaviour, against hand-written expectations."""

from __future__ import annotations

import pytest

from membackend._drivers.sim import FaultPlan, SimulatedBugcheck, SimulatedCrash, sim_driver
from membackend.types import DriverError

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
SOURCE = bytearray(PAGE)  # host bytes the tests copy from (a real driver refuses a NULL source)


def started(profile, faults=None, device=0):
    """A simulated driver, initialised, with ``device`` current."""
    d = sim_driver(profile, faults)
    d.init()
    d.set_device(device)
    return d


def mapped_page(d, device=0, size=PAGE):
    d.set_device(device)
    va = d.address_reserve(size, 0)
    h = d.create(size, device)
    d.map(va, size, h)
    d.set_access(va, size, device)
    return va, h


def code_name(exc: DriverError) -> str:
    return exc.code.name


# --------------------------------------------------------------------------- wddm-6gb


def test_wddm_release_with_a_pending_copy_is_a_bugcheck():
    d = sim_driver("wddm-6gb")
    d.init()
    va, h = mapped_page(d)
    stream = d.stream_create()
    d.memcpy_htod_async(va, SOURCE, PAGE, stream)
    with pytest.raises(SimulatedBugcheck, match="copy"):
        d.unmap(va, PAGE)
    assert d.sim.bugchecks == 1


def test_wddm_release_after_a_fence_is_safe():
    d = sim_driver("wddm-6gb")
    d.init()
    va, h = mapped_page(d)
    stream = d.stream_create()
    d.memcpy_htod_async(va, SOURCE, PAGE, stream)
    event = d.event_create()
    d.event_record(event, stream)
    assert not d.event_query(event)
    d.event_synchronize(event)
    d.unmap(va, PAGE)
    d.release(h)
    assert d.sim.bugchecks == 0 and d.sim.state()["handles"] == 0


def test_wddm_unmapping_during_the_deferred_page_in_is_a_bugcheck():
    d = sim_driver("wddm-6gb")
    d.init()
    va, h = mapped_page(d)  # no work at all: the page-in alone is pending
    with pytest.raises(SimulatedBugcheck, match="page-in"):
        d.unmap(va, PAGE)


def test_wddm_page_in_completes_with_time_or_a_device_sync():
    d = sim_driver("wddm-6gb")
    d.init()
    va, _ = mapped_page(d)
    d.sim.advance(d.sim.profile.pagein_seconds)
    d.unmap(va, PAGE)
    va2, _ = mapped_page(d)
    d.device_synchronize()
    d.unmap(va2, PAGE)
    assert d.sim.bugchecks == 0


def test_wddm_copies_wait_for_the_page_in_of_their_memory():
    d = sim_driver("wddm-6gb")
    d.init()
    va, _ = mapped_page(d)
    stream = d.stream_create()
    d.memcpy_htod_async(va, SOURCE, PAGE, stream)
    d.stream_synchronize(stream)
    assert d.sim.clock >= d.sim.profile.pagein_seconds
    d.unmap(va, PAGE)  # the copy's fence covered the page-in too


def test_wddm_mapping_past_vram_spills_to_system_memory():
    d = started("wddm-6gb")
    va = d.address_reserve(8 * GiB, 0)
    for i in range(4):  # 8 GiB on a 6 GiB card
        h = d.create(2 * GiB, 0)
        d.map(va + i * 2 * GiB, 2 * GiB, h)
    assert d.sim.spilled_bytes == 2 * GiB
    assert d.mem_get_info() == (0, 6 * GiB)
    assert d.sim.wddm_budget(0) == 6 * GiB - 512 * MiB


# --------------------------------------------------------------------------- rocm-win-2gpu


def test_rocm_reserved_address_space_is_charged_to_private_commit():
    d = started("rocm-win-2gpu")
    va = d.address_reserve(16 * GiB, 0)
    assert d.sim.private_commit == 16 * GiB
    d.address_free(va, 16 * GiB)
    assert d.sim.private_commit == 0


def test_rocm_quota_overrun_is_an_access_violation():
    d = started("rocm-win-2gpu")
    for _ in range(15):  # 240 GiB
        d.address_reserve(16 * GiB, 0)
    with pytest.raises(SimulatedCrash, match="access violation"):
        d.address_reserve(32 * GiB, 0)
    assert d.sim.crashes == 1


def test_rocm_large_window_churn_fails_after_14_cycles():
    d = started("rocm-win-2gpu")
    for _ in range(14):
        d.address_free(d.address_reserve(4 * GiB, 0), 4 * GiB)
    with pytest.raises(DriverError) as info:
        d.address_reserve(4 * GiB, 0)
    assert code_name(info.value) == "hipErrorOutOfMemory"
    d.address_free(d.address_reserve(64 * MiB, 0), 64 * MiB)  # small windows are unaffected


def test_rocm_operation_with_another_device_current_fails():
    d = sim_driver("rocm-win-2gpu")
    d.init()
    va, h = mapped_page(d, device=1)
    d.set_device(0)
    with pytest.raises(DriverError) as info:
        d.unmap(va, PAGE)
    assert code_name(info.value) == "hipErrorInvalidDevice"
    d.set_device(1)
    d.unmap(va, PAGE)
    d.release(h)


# --------------------------------------------------------------------------- gb10-128gb


def test_gb10_mem_get_info_reports_memfree_while_memavailable_is_higher():
    d = started("gb10-128gb")
    free, total = d.mem_get_info()
    info = d.sim.meminfo()
    assert total == info["MemTotal"] == 128 * 10**9
    assert free == info["MemFree"] < info["MemAvailable"]
    assert info["MemAvailable"] - info["MemFree"] == d.sim.page_cache


def test_gb10_device_pages_and_host_copies_draw_from_one_pool():
    d = sim_driver("gb10-128gb")
    d.init()
    before = d.sim.meminfo()["MemAvailable"]
    mapped_page(d, size=GiB)
    d.host_alloc_pinned(GiB)  # a pinned host copy
    assert before - d.sim.meminfo()["MemAvailable"] == 2 * GiB


def test_gb10_past_the_pool_is_out_of_memory():
    d = started("gb10-128gb")
    d.host_alloc_pinned(100 * 10**9)
    with pytest.raises(DriverError) as info:
        d.create(30 * GiB, 0)
    assert code_name(info.value) == "CUDA_ERROR_OUT_OF_MEMORY"


# --------------------------------------------------------------------------- AMD on Linux (issue 27)


def test_strix_halo_answers_free_above_its_total_and_sysfs_follows_the_device():
    d = started("strix-halo-128gb")
    free, total = d.mem_get_info()
    assert total == 96 * GiB and free == d.sim.meminfo()["MemFree"] > total
    assert d.sim.amdgpu_sysfs(0) == {"vram_total": 512 * MiB, "vram_used": 0, "gtt_total": 96 * GiB, "gtt_used": 0}
    va, h = mapped_page(d, size=GiB)
    assert d.sim.amdgpu_sysfs(0)["gtt_used"] == GiB and d.mem_get_info()[0] == free - GiB
    assert d.amdgpu_memory(0).left == 96 * GiB + 512 * MiB - GiB


def test_strix_halo_device_memory_is_gtt_and_past_it_is_out_of_memory():
    d = started("strix-halo-128gb")
    d.create(90 * GiB, 0)
    with pytest.raises(DriverError) as info:
        d.create(8 * GiB, 0)
    assert code_name(info.value) == "hipErrorOutOfMemory"


def test_rocm_72_keeps_a_released_handles_memory_until_its_range_is_freed():
    d = started("rx7900xtx-linux")
    va, h = mapped_page(d)
    never_mapped = d.create(PAGE, 0)
    d.unmap(va, PAGE)
    d.release(h)
    d.release(never_mapped)  # never mapped: returned at once
    assert d.sim.devices[0].used == PAGE and d.mem_get_info()[0] == 24 * GiB - PAGE
    d.address_free(va, PAGE)
    assert d.sim.devices[0].used == 0 and not d.sim.held_released


def test_without_rocm_72_a_release_after_the_unmap_returns_the_memory():
    d = started("h200")
    va, h = mapped_page(d)
    d.unmap(va, PAGE)
    d.release(h)
    assert d.sim.devices[0].used == 0


def test_rdna4_work_on_a_mapping_aligned_below_2_mib_is_a_memory_access_fault():
    d = started("rx9070xt-linux")
    assert d.granularity(0) == 4096  # what the runtime reports
    va = d.address_reserve(2 * MiB, 2 * MiB)
    d.map(va, 2 * MiB, d.create(2 * MiB, 0))
    d.set_access(va, 2 * MiB, 0)
    d.memcpy_htod(va, SOURCE, 4096)  # 2 MiB-aligned, 2 MiB: fine
    small = d.address_reserve(64 * 1024, 0)
    h = d.create(4096, 0)
    d.map(small + 4096, 4096, h)
    d.set_access(small + 4096, 4096, 0)
    with pytest.raises(DriverError) as info:
        d.memcpy_htod(small + 4096, SOURCE, 4096)
    assert code_name(info.value) == "hipErrorIllegalAddress" and d.sim.illegal_addresses == 1


def test_strix_point_has_no_vmm():
    d = started("gfx1150-apu")
    assert not d.vmm_supported(0) and d.integrated(0) and d.total_mem(0) == 2 * GiB
    with pytest.raises(DriverError) as info:
        d.create(PAGE, 0)
    assert code_name(info.value) == "hipErrorNotSupported"


# --------------------------------------------------------------------------- h200


def test_h200_is_discrete_and_runs_out_at_its_vram():
    d = started("h200")
    assert not d.integrated(0) and d.name(0) == "NVIDIA H200"
    d.create(140 * GiB, 0)
    with pytest.raises(DriverError) as info:
        d.create(2 * GiB, 0)
    assert code_name(info.value) == "CUDA_ERROR_OUT_OF_MEMORY"


def test_h200_unmap_waits_for_pending_work_instead_of_racing():
    d = sim_driver("h200")
    d.init()
    va, h = mapped_page(d)
    stream = d.stream_create()
    d.memcpy_htod_async(va, SOURCE, PAGE, stream)
    d.unmap(va, PAGE)  # "exhibits synchronous behavior" (CUDA docs)
    assert d.sim.use_after_free == 0 and d.sim.clock > 0


# --------------------------------------------------------------------------- API shape and fault injection


def test_sim_calls_return_the_bindings_tuples_and_enums():
    from cuda.bindings import driver as real

    d = sim_driver("h200")
    m = d.m
    assert m.cuInit(0) == (real.CUresult.CUDA_SUCCESS,)
    err, ptr = m.cuMemAddressReserve(2 * MiB, 0, 0, 0)
    assert err == real.CUresult.CUDA_SUCCESS and isinstance(ptr, real.CUdeviceptr)
    err, value = m.cuMemAddressReserve(3, 0, 0, 0)
    assert err == real.CUresult.CUDA_ERROR_INVALID_VALUE and value is None
    assert m.CUmemAllocationProp is real.CUmemAllocationProp
    with pytest.raises(AttributeError, match="simulated driver has no cuLaunchKernel"):
        m.cuLaunchKernel


def test_hip_sim_uses_hip_python_enums():
    from hip import hip

    d = sim_driver("rocm-win-2gpu")
    assert d.m.hipInit(0) == (hip.hipError_t.hipSuccess,)
    assert d.m.hipGetDeviceCount() == (hip.hipError_t.hipSuccess, 2)


def test_fault_injection_on_the_kth_call():
    plan = FaultPlan()
    plan.add("cuMemSetAccess", 600, nth=2)
    d = sim_driver("h200", plan)
    d.init()
    mapped_page(d)
    with pytest.raises(DriverError) as info:
        mapped_page(d)
    assert code_name(info.value) == "CUDA_ERROR_NOT_READY" and plan.injected == 1
    mapped_page(d)  # the third call succeeds


def test_fault_injection_by_probability_is_reproducible_with_a_seed():
    def run(seed):
        plan = FaultPlan(seed=seed)
        plan.add("cuMemMap", 719, probability=0.3)
        d = started("h200", plan)
        outcomes = []
        for _ in range(40):
            va, h = d.address_reserve(PAGE, 0), d.create(PAGE, 0)
            try:
                d.map(va, PAGE, h)
                outcomes.append(True)
            except DriverError as exc:
                assert code_name(exc) == "CUDA_ERROR_LAUNCH_FAILED"
                outcomes.append(False)
        return outcomes

    assert run(7) == run(7) and run(7) != run(8) and False in run(7)


def test_injected_reserve_failure_on_hip():
    plan = FaultPlan()
    plan.add("hipMemAddressReserve", 2, nth=1)
    d = started("rocm-win-2gpu", plan)
    with pytest.raises(DriverError, match="hipMemAddressReserve"):
        d.address_reserve(PAGE, 0)


@pytest.mark.parametrize("profile,arch,model", [
    ("wddm-6gb", "sm_86", "wddm"), ("h200", "sm_90", None), ("gb10-128gb", "sm_121", None),
    ("rocm-win-2gpu", "gfx1201", None),
])
def test_device_attributes_through_the_wrappers(profile, arch, model):
    d = sim_driver(profile)
    d.init()
    os_name = d.sim.profile.os
    assert d.arch(0) == arch and d.driver_model(0, os_name) == model
    assert d.total_mem(0) == d.sim.profile.devices[0].vram
    assert d.integrated(0) == (profile == "gb10-128gb")


# --------------------------------------------------------------------------- contexts and devices (per thread)


def test_cuda_a_thread_starts_with_no_context_and_context_bound_calls_need_one():
    d = sim_driver("h200")
    d.init()
    m = d.m
    assert int(m.cuCtxGetCurrent()[1]) == 0  # NULL and CUDA_SUCCESS (cuCtxGetCurrent docs)
    assert m.cuMemGetInfo()[0].name == "CUDA_ERROR_INVALID_CONTEXT"
    assert m.cuCtxGetDevice()[0].name == "CUDA_ERROR_INVALID_CONTEXT"
    assert d.mem_get_info() == (d.sim.devices[0].vram, d.sim.devices[0].vram)  # the wrapper binds one for the call
    assert int(m.cuCtxGetCurrent()[1]) == 0  # and unbinds it again


def test_cuda_primary_contexts_are_reference_counted():
    d = sim_driver("h200")
    d.init()
    dev = d.m.types.CUdevice(0)
    assert d.m.cuDevicePrimaryCtxRelease(dev)[0].name == "CUDA_ERROR_INVALID_CONTEXT"  # not retained
    d.set_device(0)
    d.stream_create()
    assert d.sim.devices[0].primary_refs == 1
    d.stream_create()
    assert d.sim.devices[0].primary_refs == 1  # retained once per wrapper
    d.close()
    assert d.sim.devices[0].primary_refs == 0


def test_a_device_without_vmm_support_fails_create_with_not_supported():
    d = started("mi100-novmm")
    assert d.vmm_supported(0) is False
    va = d.address_reserve(PAGE, 0)
    with pytest.raises(DriverError) as info:
        d.create(PAGE, 0)
    assert code_name(info.value) == "hipErrorNotSupported"
    d.address_free(va, PAGE)


def test_the_luid_exists_on_windows_only():
    assert started("wddm-6gb").luid(0) == (0xC0DE, 0)
    with pytest.raises(DriverError) as info:
        started("h200").luid(0)
    assert code_name(info.value) == "CUDA_ERROR_NOT_SUPPORTED"


def test_every_profile_answers_discovery():
    from membackend._drivers.open import profile_names

    for name in profile_names():
        d = sim_driver(name)
        d.init()
        for i in range(d.device_count()):
            assert d.name(i) and d.total_mem(i) > 0 and isinstance(d.vmm_supported(i), bool)
            assert isinstance(d.integrated(i), bool) and d.arch(i)

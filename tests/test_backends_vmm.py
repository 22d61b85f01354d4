"""The generic VMM backend over the simulated drivers."""

from __future__ import annotations

import dataclasses

import pytest

from membackend._backends.vmm import AddressSpaceExhausted, VmmBackend
from membackend._drivers.open import machine_for
from membackend._drivers.sim import FaultPlan, SimulatedBugcheck, get_profile, sim_driver
from membackend._ledger import Ledger
from membackend._machine import gather_machine
from membackend._session import Session
from membackend._settings import load_settings
from membackend.platform import GENERIC
from membackend.types import Capabilities, Device, DriverError

MiB, GiB = 1 << 20, 1 << 30
PAGE = 2 * MiB
#: the generic platform with the pages these tests count in (its own default is 32 MiB, comfy-aimdo's)
GENERIC_2MIB = dataclasses.replace(GENERIC, page_size=PAGE)
SOURCE = bytearray(PAGE)  # host bytes the tests copy from (a real driver refuses a NULL source)


def session_on(profile: str, faults: FaultPlan | None = None, **caps) -> Session:
    p = get_profile(profile)
    # knobs not given are the profile's (page_in_sync follows the profile's OS, not this process's)
    caps = {"page_in_sync": p.capabilities().page_in_sync, **caps} if caps else None
    backend = VmmBackend(GENERIC_2MIB, sim_driver(p, faults), capabilities=Capabilities(**caps) if caps else p.capabilities())
    machine = gather_machine(load_settings(sim_profile=profile).machine.model_copy(
        update={"devices": None}))  # devices come from the session's backend kind only
    return Session(backend, machine=machine, ledger=Ledger(sanitize=True))


def sim(session):
    return session.backend.driver.sim


def test_fault_then_free_at_once_does_not_race_the_wddm_page_in():
    s = session_on("wddm-6gb")
    r = s.reserve("cuda:0", 8 * PAGE)
    for _ in range(50):  # the churn of #16246
        assert s.fault(r, 0, 8 * PAGE).ok
        assert s.free(r) == 8 * PAGE
    s.release_reservation(r)
    assert sim(s).bugchecks == 0 and sim(s).state()["handles"] == 0


def test_a_recorded_copy_is_fenced_before_release():
    s = session_on("wddm-6gb")
    r = s.reserve("cuda:0", PAGE)
    s.fault(r, 0, PAGE)
    d = s.backend.driver
    s.fence("cuda:0")  # page-in done: only the copy below is pending
    stream = d.stream_create()
    d.memcpy_htod_async(r.base, SOURCE, PAGE, stream)
    s.record(r, s.backend.fence_token(r, stream))
    s.release_reservation(r)
    assert sim(s).bugchecks == 0


def test_an_unrecorded_copy_is_a_broken_promise_the_sim_catches():
    s = session_on("wddm-6gb", fence_granularity="reservation")
    r = s.reserve("cuda:0", PAGE)
    s.fault(r, 0, PAGE)
    s.fence("cuda:0")
    d = s.backend.driver
    d.memcpy_htod_async(r.base, SOURCE, PAGE, d.stream_create())
    with pytest.raises(SimulatedBugcheck):
        s.free(r)


def test_device_fence_granularity_syncs_before_every_unmap():
    """WDDM's platform asks for device-wide fences: even a copy nobody recorded is finished first."""
    s = session_on("wddm-6gb", fence_granularity="device")
    r = s.reserve("cuda:0", PAGE)
    s.fault(r, 0, PAGE)
    s.fence("cuda:0")
    d = s.backend.driver
    d.memcpy_htod_async(r.base, SOURCE, PAGE, d.stream_create())
    assert s.free(r) == PAGE and sim(s).bugchecks == 0


def free_waited_for_another_ranges_kernel(s: Session, kernel_seconds: float = 0.05) -> bool:
    """Fault a fresh range and free it while a kernel reading another range runs (its token recorded):
    whether the free waited for that kernel (it finished, the simulated clock moved)."""
    d, device = s.backend.driver, Device(s.backend.device_kinds[0], 0)
    busy, fresh = s.reserve(device, 4 * PAGE), s.reserve(device, 4 * PAGE)
    s.fault(busy, 0, 4 * PAGE)
    s.fence(device)
    stream = d.stream_create()
    d.sim.launch(int(stream), busy.base, 4 * PAGE, kernel_seconds)
    token = s.backend.fence_token(busy, stream)
    s.record(busy, token)
    assert s.fault(fresh, 0, 4 * PAGE).ok
    clock = d.sim.clock
    assert s.free(fresh) == 4 * PAGE
    waited = token.done()
    assert waited == (d.sim.clock >= clock + kernel_seconds)
    assert d.sim.use_after_free == d.sim.bugchecks == 0
    s.release_reservation(fresh)
    s.release_reservation(busy)  # fences its token first
    return waited


@pytest.mark.parametrize("profile", ["h200", "gb10-128gb", "rocm-win-2gpu"])
@pytest.mark.parametrize("mode", ["never", "always"])
def test_a_free_after_a_fault_synchronizes_the_device_only_where_the_platform_asks(profile, mode):
    """page_in_sync="never": the recorded tokens cover the range, so freeing it leaves another stream's kernel
    running; "always": the free synchronizes the device and waits for that kernel too (every stream stalls)."""
    assert free_waited_for_another_ranges_kernel(session_on(profile, page_in_sync=mode)) is (mode == "always")


@pytest.mark.parametrize("os_name, driver_model, syncs", [
    ("windows", "wddm", True), ("windows", "mcdm", True), ("windows", "tcc", False), ("linux", None, False),
])
def test_page_in_sync_wddm_synchronizes_only_devices_under_wddm(os_name, driver_model, syncs):
    """The generic platform's choice: on Windows every driver model but TCC is served by the video memory
    manager that pages fresh mappings in (ComfyUI #16246); Linux has none. Read from the machine facts."""
    import dataclasses

    facts = machine_for(load_settings(sim_profile="h200"))
    machine = dataclasses.replace(facts, os=os_name,
                                  devices=(dataclasses.replace(facts.devices[0], driver_model=driver_model),))
    backend = VmmBackend(GENERIC_2MIB, sim_driver("h200"), machine=lambda: machine)
    assert backend.capabilities.page_in_sync == "wddm"
    s = Session(backend, machine=machine, ledger=Ledger(sanitize=True))
    assert free_waited_for_another_ranges_kernel(s) is syncs


def test_the_platforms_page_in_sync_choices():
    import membackend_cuda_wddm
    import membackend_rocm_windows
    import membackend_unified_gb10

    assert GENERIC.capabilities.page_in_sync == "wddm"
    assert membackend_cuda_wddm.PLATFORM.capabilities.page_in_sync == "always"
    assert membackend_rocm_windows.PLATFORM.capabilities.page_in_sync == "always"
    assert membackend_unified_gb10.PLATFORM.capabilities.page_in_sync == "never"
    with pytest.raises(ValueError, match="accepted: always, wddm, never"):
        Capabilities(page_in_sync="sometimes")


def test_each_device_is_made_current_for_its_own_pages():
    s = session_on("rocm-win-2gpu")
    a = s.reserve("hip:1", 4 * PAGE)
    b = s.reserve("hip:0", 4 * PAGE)
    s.fault(a, 0, 4 * PAGE)
    s.fault(b, 0, 4 * PAGE)  # leaves device 0 current
    assert s.free(a) == 4 * PAGE and s.release_reservation(a) == 0
    assert s.ledger.account(Device("hip", 1)).reserved == 0
    assert sim(s).state(1) == {"reserved": 0, "reservations": 0, "mapped": 0, "handles": 0, "physical": 0,
                               "pending_ops": 0}


def test_the_address_quota_is_refused_before_the_driver_crashes():
    s = session_on("rocm-win-2gpu")
    kept = []
    with pytest.raises(AddressSpaceExhausted, match="GPU address quota"):
        for _ in range(20):
            kept.append(s.reserve("hip:0", 16 * GiB))
    assert isinstance(AddressSpaceExhausted("x"), MemoryError)
    assert sim(s).crashes == 0 and len(kept) < 15
    for r in kept:
        s.release_reservation(r)
    # every window is kept until a trim (releasing spends none of the platform's large frees): no more
    # than the device had alive at once
    assert sim(s).private_commit == len(kept) * 16 * GiB and sim(s).churn_frees == 0
    freed = s.backend.membackend_trim(Device("hip", 0))
    # trim spends the 12 large frees the platform allows (14 minus the margin) and keeps the rest
    assert freed == 12 * 16 * GiB and sim(s).churn_frees == 12
    left = (len(kept) - 12) * 16 * GiB
    assert sim(s).private_commit == left == s.inspect(Device("hip", 0)).held
    report = s.backend.kept_windows(Device("hip", 0))
    assert (report.windows, report.bytes, report.bound) == (len(kept) - 12, left, len(kept))
    assert (report.large_frees_spent, report.large_frees_allowed, report.can_give_back) == (12, 12, False)
    assert s.reserve("hip:0", 16 * GiB).size == 16 * GiB, "a large reserve still works: a kept window"


def test_reserve_churn_limit_is_honoured_by_reusing_released_windows():
    """rocm-win-2gpu fails large reserves after 14 large frees (rocm-systems #6191): without the
    capability the 15th reuse of a >= 1 GiB model fails; with it, windows are reused."""
    plain = session_on("rocm-win-2gpu", reserve_churn_limit=None)
    with pytest.raises(AddressSpaceExhausted):  # the driver's out of memory, typed (issue 42)
        for _ in range(20):
            plain.release_reservation(plain.reserve("hip:0", 2 * GiB))
    s = session_on("rocm-win-2gpu")
    for i in range(100):
        r = s.reserve(f"hip:{i % 2}", 2 * GiB)
        assert s.fault(r, 0, 4 * PAGE).ok
        s.release_reservation(r)
    assert sim(s).churn_frees == 0
    state = s.backend.membackend_inspect(Device("hip", 0))
    assert (state.reserved, state.resident, state.held) == (0, 0, 2 * GiB)
    assert s.backend.membackend_trim(Device("hip", 0)) == 2 * GiB
    assert s.backend.membackend_trim(Device("hip", 1)) == 2 * GiB
    assert sim(s).private_commit == 0 and sim(s).state()["reservations"] == 0


def test_a_smaller_model_reuses_a_larger_kept_window_and_releases_it_whole():
    s = session_on("rocm-win-2gpu")
    s.release_reservation(s.reserve("hip:0", 4 * GiB))
    small = s.reserve("hip:0", 2 * GiB)
    assert small.size == 2 * GiB and sim(s).state(0)["reserved"] == 4 * GiB
    s.release_reservation(small)
    s.backend.membackend_trim(Device("hip", 0))
    assert sim(s).state(0)["reserved"] == 0


def test_a_failed_set_access_rolls_back_the_pages_the_fault_mapped():
    plan = FaultPlan()
    s = session_on("h200", plan)
    r = s.reserve("cuda:0", 4 * PAGE)
    s.fault(r, 0, PAGE)
    plan.add("cuMemSetAccess", 1, nth=plan.calls.get("cuMemSetAccess", 0) + 3)  # INVALID_VALUE: no retry
    before = s.ledger.account(Device("cuda", 0)), sim(s).state(0)
    with pytest.raises(DriverError, match="cuMemSetAccess"):
        s.fault(r, 0, 4 * PAGE)  # pages 1 and 2 map, page 3 fails: all three roll back
    assert (s.ledger.account(Device("cuda", 0)), sim(s).state(0)) == before
    assert s.fault(r, 0, 4 * PAGE).ok


def test_out_of_memory_is_a_fault_result_with_nothing_left_mapped():
    s = session_on("h200")
    d = s.backend.driver
    d.set_device(0)
    hog = d.create(140 * GiB, 0)  # another user of the card holds most of it
    r = s.reserve("cuda:0", 4 * GiB)
    f = s.fault(r, 0, 4 * GiB)
    assert not f.ok and sim(s).state(0)["mapped"] == 0 and s.ledger.resident(r) == 0
    d.release(hog)
    assert s.fault(r, 0, 4 * GiB).ok


def test_recycled_handles_are_reused_and_trimmed():
    s = session_on("h200", recycle_handles=True)
    r = s.reserve("cuda:0", 4 * PAGE)
    s.fault(r, 0, 4 * PAGE)
    s.free(r)
    assert sim(s).state(0)["handles"] == 4 and sim(s).state(0)["mapped"] == 0
    creates = sim(s).faults.calls["cuMemCreate"]
    s.fault(r, 0, 4 * PAGE)
    assert sim(s).faults.calls["cuMemCreate"] == creates
    s.release_reservation(r)
    assert s.backend.trim(Device("cuda", 0)) == 4 * PAGE and sim(s).state(0)["handles"] == 0


def test_budget_is_mem_get_info_minus_headroom():
    s = session_on("h200")
    b = s.budget_query("cuda:0")
    assert (b.total, b.free, b.headroom) == (143_771 * MiB, 143_771 * MiB, 256 * MiB)
    assert b.source == "cuMemGetInfo (sim:h200)" and not b.unified


def test_on_gb10_the_generic_budget_is_the_pool_s_memavailable_not_the_device_view():
    """The generic platform's ``auto`` source (G3): an integrated device's mem-get-info reports MemFree."""
    s = session_on("gb10-128gb")
    b = s.budget_query("cuda:0")
    info = sim(s).meminfo()
    assert b.unified and b.free == info["MemAvailable"] > info["MemFree"], (b, info)
    assert b.source.startswith("unified pool: MemAvailable")
    h = session_on("h200").budget_query("cuda:0")
    assert h.source.startswith("cuMemGetInfo") and not h.unified  # a discrete device: its own figures


def test_a_unified_pool_is_capped_by_the_machine_s_ram_and_cgroup_facts():
    """A Jetson-sized machine on the GB10 profile: the RAM override reaches the budget and the headroom rule."""
    from membackend.lab import simulated_session

    s = simulated_session("gb10-128gb", machine={"ram_total": "16GiB"})
    try:
        b = s.budget_query(s.devices()[0])
        assert (b.total, b.free) == (16 * GiB, 16 * GiB) and "capped by machine.ram_total" in b.source, b
    finally:
        s.close()
    s = simulated_session("gb10-128gb", machine={"cgroup_limit": "8GiB"})
    try:
        b = s.budget_query(s.devices()[0])
        assert b.total == 8 * GiB and "capped by the memory cgroup's limit" in b.source, b
    finally:
        s.close()


def test_a_device_that_does_not_exist_is_a_wrong_device():
    from membackend.types import WrongDevice

    s = session_on("h200")
    with pytest.raises(WrongDevice, match="cuda:3 does not exist"):
        s.reserve("cuda:3", PAGE)


def test_probe_without_a_gpu_says_so():
    backend = VmmBackend.from_settings(load_settings())
    c = backend.membackend_probe(machine=gather_machine())
    assert c.score == 0 and "no CUDA or HIP device found" in c.reason


def test_probe_on_a_simulated_profile():
    settings = load_settings(sim_profile="gb10-128gb")
    backend = VmmBackend.from_settings(settings)
    c = backend.membackend_probe(machine=machine_for(settings))
    assert c.score == 20 and "NVIDIA GB10" in c.reason and "simulated" in c.reason
    assert backend.device_kinds == ("cuda",)


def test_an_event_token_shared_by_threads_destroys_its_event_once():
    import threading

    s = session_on("h200")
    r = s.reserve("cuda:0", PAGE)
    s.fault(r, 0, PAGE)
    d = s.backend.driver
    stream = d.stream_create()
    d.memcpy_htod_async(r.base, SOURCE, PAGE, stream)
    token = s.backend.fence_token(r, stream)
    errors = []

    def wait():
        try:
            for _ in range(50):
                token.done()
                token.wait()
        except Exception as exc:  # a second destroy would be a DriverError here
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and token.done()


def test_not_ready_on_map_or_set_access_is_retried_after_a_fence_then_typed():
    from cuda.bindings import driver as cu

    NOT_READY = cu.CUresult.CUDA_ERROR_NOT_READY
    plan = FaultPlan()
    plan.add("cuMemMap", NOT_READY, nth=1)
    plan.add("cuMemSetAccess", NOT_READY, nth=2)
    s = session_on("wddm-6gb", plan)
    r = s.reserve("cuda:0", 2 * PAGE)
    assert s.fault(r, 0, 2 * PAGE).ok, "each retried after a fence"
    plan.add("cuMemSetAccess", NOT_READY, probability=1.0)
    r2 = s.reserve("cuda:0", PAGE)
    with pytest.raises(DriverError, match="CUDA_ERROR_NOT_READY"):
        s.fault(r2, 0, PAGE)
    state = s.inspect(Device("cuda", 0))
    assert (state.reserved, state.resident) == (s.ledger.account(Device("cuda", 0)).reserved,
                                                s.ledger.account(Device("cuda", 0)).resident)


def test_a_unified_pool_refuses_a_fault_that_would_cross_it_before_the_driver_is_asked():
    s = session_on("gb10-128gb", unified_pool=True)
    d = s.backend.driver
    avail = sim(s).meminfo()["MemAvailable"]
    r = s.reserve("cuda:0", avail)  # the whole pool: more than is left after the headroom
    creates = sim(s).faults.calls.get("cuMemCreate", 0)
    f = s.fault(r, 0, r.size)
    assert not f.ok and sim(s).faults.calls.get("cuMemCreate", 0) == creates, "the driver was never asked"
    assert s.fault(r, 0, 64 * PAGE).ok
    assert d is s.backend.driver


def test_inspect_reports_the_hazards_the_driver_saw():
    """On ROCm the simulated driver lets an unmap race a copy (no bugcheck, no wait): inspect counts it,
    so the conformance kit sees it too."""
    s = session_on("rocm-win-2gpu")
    r = s.reserve("hip:0", PAGE)
    s.fault(r, 0, PAGE)
    s.fence("hip:0")
    d = s.backend.driver
    d.memcpy_htod_async(r.base, SOURCE, PAGE, d.stream_create())  # nobody records it: a broken promise
    s.free(r)
    assert s.inspect(Device("hip", 0)).hazards == 2, "the unmap and the release of its handle"


def test_a_budget_bounded_recycle_pool_counts_kept_handles_free_and_shrinks_when_the_budget_needs_them():
    s = session_on("wddm-6gb", recycle_handles=True, recycle_limit=None)
    s.backend._headroom = 512 * MiB
    r = s.reserve("cuda:0", 1 * GiB)
    assert s.fault(r, 0, 1 * GiB).ok
    before = s.budget_query("cuda:0").free
    s.free(r)
    assert sim(s).state(0)["handles"] == 512, "all 512 pages kept: no handle count bound"
    assert s.budget_query("cuda:0").free == before + 1 * GiB, "kept handles are free to the policy"
    d = s.backend.driver
    d.set_device(0)
    hog = d.create(6 * GiB - 1 * GiB - 448 * MiB, 0)  # someone else leaves only 448 MiB of VRAM free
    s.budget_query("cuda:0")
    assert sim(s).state(0)["handles"] == 1 + 512 - 32, "32 kept pages (64 MiB) went back to restore the headroom"
    assert d.mem_get_info()[0] == 512 * MiB
    d.release(hog)

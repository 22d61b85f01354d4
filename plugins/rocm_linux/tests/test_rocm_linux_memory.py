"""The mechanism on AMD GPUs under Linux: a release that really releases (ROCm 7.2 returns memory only when the
address range is freed), pages of at least 2 MiB on RDNA4 (4 KiB reported, kernels fault below 2 MiB), no page
aliased, and virtual memory proven by a self-test at each device's first use. Each on the simulated machine whose
runtime behaves as the reports say, against the generic mechanism, which does not know (the same simulation)."""

from __future__ import annotations

from collections import Counter

import pytest
from rocm_linux_sessions import GiB, MiB, session, sim, used

from membackend import ResidencyManager
from membackend._backends.vmm import VmmBackend
from membackend.lab.simulated import simulated_driver, simulated_session
from membackend.types import Capabilities, Device, DriverError
from membackend_rocm_linux import PLATFORM

DEV = "hip:0"
NOT_SUPPORTED = 801  # hipErrorNotSupported


def _creates(s) -> int:
    return sim(s).faults.calls.get("hipMemCreate", 0)


def test_a_freed_page_stays_with_its_range_and_the_release_returns_the_memory():
    s = session("rx7900xtx-linux")
    r = s.reserve(DEV, 256 * MiB)
    assert s.fault(r, 0, 256 * MiB).mapped == 256 * MiB and used(s) == 256 * MiB
    assert s.free(r, 0, 128 * MiB) == 128 * MiB
    assert used(s) == 256 * MiB  # ROCm 7.2: unmapped, not returned; the handles wait with their range
    creates = _creates(s)
    assert s.fault(r, 0, 128 * MiB).mapped == 128 * MiB
    assert _creates(s) == creates  # the range's own handles, mapped again: nothing new asked of the runtime
    s.free(r, 0, 256 * MiB)
    s.release_reservation(r)
    assert used(s) == 0 and not sim(s).held_released  # the range freed: every byte back
    s.close()


def test_the_generic_mechanism_frees_pages_that_rocm_72_never_returns():
    s = simulated_session("rx7900xtx-linux", capabilities=Capabilities())  # memory returns on unmap, it thinks
    r = s.reserve(DEV, 256 * MiB)
    s.fault(r, 0, 256 * MiB)
    s.free(r, 0, 256 * MiB)
    assert used(s) == 256 * MiB  # every page released, and every byte still held
    assert sum(h.size for h in sim(s).held_released.values()) == 256 * MiB
    s.release_reservation(r)
    assert used(s) == 0
    s.close()


def _two_models(s, size):
    rm = ResidencyManager(s)
    a, b = rm.register("a", size, [DEV]), rm.register("b", size, [DEV])
    rm.use([a])
    assert rm.fault(a, 0, size).ok
    rm.unpin(a, 0, size)
    rm.use([b])
    return rm, a, b


def test_a_whole_model_evicted_by_the_policy_is_evicted_by_releasing_its_range():
    s = session("rx7900xtx-linux")
    rm, a, b = _two_models(s, 14 * GiB)  # two of them do not fit 24 GiB
    assert rm.fault(b, 0, 14 * GiB).ok
    assert a.reservation(DEV) is None  # released, so the runtime gave its memory back
    assert used(s) == 14 * GiB
    rm.unload_all()
    assert used(s) == 0
    s.close()


def test_evicting_page_by_page_on_rocm_72_leaves_the_next_model_out_of_memory():
    s = simulated_session("rx7900xtx-linux", PLATFORM, capabilities=Capabilities(
        release_on_full_unload=True, page_in_sync="never", map_granularity=2 * MiB))
    rm, a, b = _two_models(s, 14 * GiB)
    assert not rm.fault(b, 0, 14 * GiB).ok  # a's pages were freed, and the runtime still holds them
    # the whole card is held by the runtime for pages nobody has mapped: a's, and b's rolled back
    assert sum(h.size for h in sim(s).held_released.values()) == used(s) == 24 * GiB
    s.close()


def test_pages_are_at_least_2_mib_on_rdna4_and_copies_land():
    s = session("rx9070xt-linux", page_size="4KiB")
    r = s.reserve(DEV, 8 * MiB)
    assert r.page_size == 2 * MiB and r.base % (2 * MiB) == 0
    assert s.fault(r, 0, 8 * MiB).ok
    data = bytes(range(256)) * 16
    s.backend.driver.memcpy_htod(r.base + 2 * MiB, data, len(data))
    assert sim(s).illegal_addresses == 0
    s.close()


def test_4_kib_pages_on_rdna4_fault_in_kernels():
    s = simulated_session("rx9070xt-linux", capabilities=Capabilities(), page_size="4KiB")
    r = s.reserve(DEV, 64 * 1024)
    assert r.page_size == 4096
    assert s.fault(r, 0, 64 * 1024).ok  # the runtime maps them: the granularity it reports
    with pytest.raises(DriverError, match="failed with 700"):  # hipErrorIllegalAddress
        s.backend.driver.memcpy_htod(r.base, b"x" * 4096, 4096)
    assert sim(s).illegal_addresses == 1
    s.close()


def test_no_page_is_ever_mapped_at_two_addresses():
    s = session("strix-halo-128gb")
    rm = ResidencyManager(s)
    models = [rm.register(f"m{i}", 3 * GiB, [DEV]) for i in range(4)]
    for round_ in range(3):
        for m in models:
            rm.use([m])
            assert rm.fault(m, 0, 3 * GiB).ok
            rm.unpin(m, 0, 3 * GiB)
            rm.free_memory(2 * GiB, DEV)
            handles = Counter(mp.handle for mp in sim(s).mappings.values())
            assert not [h for h, n in handles.items() if n > 1], round_
    rm.unload_all()
    assert used(s) == 0
    s.close()


def test_the_self_test_runs_at_a_devices_first_use():
    driver = simulated_driver("rx7900xtx-linux")
    backend = VmmBackend(PLATFORM, driver)
    backend.membackend_budget_query(Device("hip", 0))
    calls = driver.sim.faults.calls
    for call in ("hipMemAddressReserve", "hipMemCreate", "hipMemMap", "hipMemSetAccess", "hipMemUnmap",
                 "hipMemRelease", "hipMemAddressFree"):
        assert calls.get(call) == 1, (call, calls)
    assert driver.sim.devices[0].used == 0 and not driver.sim.reservations  # nothing left behind
    backend.membackend_budget_query(Device("hip", 0))
    assert calls["hipMemCreate"] == 1  # once per device


@pytest.mark.parametrize("step", ["hipMemCreate", "hipMemMap", "hipMemSetAccess"])
def test_a_failed_self_test_refuses_the_device_and_undoes_what_it_made(step):
    driver = simulated_driver("rx7900xtx-linux")
    driver.sim.faults.add(step, NOT_SUPPORTED, nth=1)
    backend = VmmBackend(PLATFORM, driver)
    with pytest.raises(DriverError, match="start-up self-test of virtual memory management on hip:0 failed"):
        backend.membackend_budget_query(Device("hip", 0))
    assert driver.sim.devices[0].used == 0 and not driver.sim.reservations and not driver.sim.mappings


def test_a_failed_fault_keeps_what_it_rolled_back_with_its_range():
    s = session("rx7900xtx-linux")
    r = s.reserve(DEV, 30 * GiB)
    assert not s.fault(r, 0, 30 * GiB).ok  # past the card: rolled back
    creates = _creates(s)
    assert s.fault(r, 0, 20 * GiB).ok  # the rolled-back handles, mapped again: nothing held for nothing
    assert _creates(s) == creates and used(s) <= 24 * GiB
    s.release_reservation(r)
    assert used(s) == 0
    s.close()


def test_memory_asked_for_others_is_never_counted_freed_while_the_model_holds_it():
    s = session("rx7900xtx-linux")
    rm = ResidencyManager(s)
    a = rm.register("a", 20 * GiB, [DEV])
    rm.use([a])
    assert rm.fault(a, 0, 20 * GiB).ok
    rm.unpin(a, GiB, 19 * GiB)  # its first GiB stays pinned: a layer in use
    assert rm.free_memory(8 * GiB, DEV) == 0  # freeing its pages would give nothing back on ROCm 7.2
    assert used(s) == 20 * GiB and a.reservation(DEV) is not None
    rm.unpin(a, 0, GiB)
    assert rm.free_memory(8 * GiB, DEV) == 20 * GiB  # unpinned: its range released, every byte back
    assert used(s) == 0
    s.close()


def test_a_model_faults_its_own_freed_pages_back_without_evicting_another():
    s = session("rx7900xtx-linux")
    rm = ResidencyManager(s)
    a, c = rm.register("a", 20 * GiB, [DEV]), rm.register("c", 2 * GiB, [DEV])
    for m in (c, a):
        rm.use([m])
        assert rm.fault(m, 0, m.size).ok
        rm.unpin(m, 0, m.size)
    assert rm.shed(a, 8 * GiB) == 8 * GiB  # a partial unload: the range keeps the memory
    creates = _creates(s)
    rm.use([a])
    assert rm.fault(a, 12 * GiB, 8 * GiB).ok
    assert _creates(s) == creates  # its own kept handles
    assert c.reservation(DEV) is not None and c.slots[Device.parse(DEV)].resident_bytes() == 2 * GiB
    rm.unload_all()
    assert used(s) == 0
    s.close()

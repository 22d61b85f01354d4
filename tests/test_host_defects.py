"""Host driver and backend under stress: populate's EINVAL, populate threads, threads, failure injection."""

from __future__ import annotations

import ctypes
import errno
import random
import sys
import threading

import pluggy
import pytest

from membackend import hookspec
from membackend._backends.host import HostBackend
from membackend._drivers.host import MADV_POPULATE_WRITE, PosixHostDriver, resident_bytes
from membackend.types import ConfigError, Device, DriverError, WrongDevice

MiB = 1 << 20
PS = 2 * MiB
CPU = Device("cpu", 0)
MADVISE_POPULATE = "madvise(MADV_POPULATE_WRITE)"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux only")
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX host driver")


def einval_for_populate(real):
    """libc's madvise, except MADV_POPULATE_WRITE fails with EINVAL (an old kernel, or an inaccessible range)."""
    calls = []

    def madvise(addr, size, advice):
        calls.append((addr, size, advice))
        if advice == MADV_POPULATE_WRITE:
            ctypes.set_errno(errno.EINVAL)
            return -1
        return real(addr, size, advice)

    madvise.calls = calls
    return madvise


def kernel_resident(reservations) -> int:
    return sum(resident_bytes(r.base, r.size) for r in reservations)


def populate_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("membackend-populate")]


# --------------------------------------------------------------------------- 4.1: EINVAL from populate


@linux_only
@pytest.mark.parametrize("size", [4 * MiB, 16 * MiB], ids=["one-call", "split-over-threads"])
def test_einval_from_populate_is_a_driver_error_and_never_a_switch_to_touching(monkeypatch, size):
    """On a kernel with MADV_POPULATE_WRITE, EINVAL means the range is not accessible: touching it would crash."""
    backend = HostBackend(page_size=PS)
    driver = backend.driver
    if driver.populate_method != MADVISE_POPULATE:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    driver.workers = 2
    r = backend.membackend_reserve(CPU, size)
    try:
        monkeypatch.setattr(driver, "_madvise", einval_for_populate(driver._madvise))
        with pytest.raises(DriverError) as info:
            backend.membackend_fault(r, 0, size)
        assert info.value.code == errno.EINVAL and MADVISE_POPULATE in str(info.value)
        assert driver.populate_method == MADVISE_POPULATE, "the populate method is decided once, at start-up"
        assert resident_bytes(r.base, r.size) == 0, "nothing may be written into the range"
        assert backend.resident == 0 and r.handle.resident.count(1) == 0
    finally:
        backend.membackend_release_reservation(r)
        driver.shutdown_pool()


@linux_only
def test_the_populate_method_is_probed_once_on_a_scratch_page():
    real = PosixHostDriver()._madvise
    old_kernel = einval_for_populate(real)
    driver = PosixHostDriver(madvise=old_kernel)
    assert driver.populate_method == "touch"
    assert [(size, advice) for _, size, advice in old_kernel.calls] == [(driver.page, MADV_POPULATE_WRITE)]

    # a driver that populates by touching still makes the pages resident, and asks madvise nothing more
    backend = HostBackend(page_size=PS, driver=driver)
    r = backend.membackend_reserve(CPU, 4 * MiB)
    old_kernel.calls.clear()
    assert backend.membackend_fault(r, 0, 4 * MiB).ok
    assert resident_bytes(r.base, r.size) == 4 * MiB
    assert not [c for c in old_kernel.calls if c[2] == MADV_POPULATE_WRITE]
    backend.membackend_release_reservation(r)

    assert PosixHostDriver(madvise=lambda addr, size, advice: 0).populate_method == MADVISE_POPULATE


# --------------------------------------------------------------------------- 4.14: populate threads


@posix_only
def test_trim_stops_the_populate_threads_and_they_come_back_when_needed():
    backend = HostBackend(page_size=PS)
    backend.driver.workers = 2  # a one-core machine would not use the pool at all
    r = backend.membackend_reserve(CPU, 32 * MiB)
    assert backend.membackend_fault(r, 0, 32 * MiB).ok
    assert populate_threads(), "a 32 MiB fault is split over the populate threads"
    assert backend.membackend_trim(CPU) == 0, "the host keeps no memory for reuse"
    assert populate_threads() == []
    backend.membackend_free(r, 0, 32 * MiB)
    assert backend.membackend_fault(r, 0, 32 * MiB).ok and populate_threads()
    backend.membackend_release_reservation(r)
    backend.membackend_trim(CPU)
    assert populate_threads() == []


def test_trim_is_a_hook_and_names_the_device_it_serves():
    backend = HostBackend(page_size=PS)
    pm = pluggy.PluginManager(hookspec.PROJECT)
    pm.add_hookspecs(hookspec)
    pm.register(backend)
    assert pm.hook.membackend_trim(device=CPU) == 0
    with pytest.raises(WrongDevice, match="serves only cpu:0, not cuda:0"):
        backend.membackend_trim(Device("cuda", 0))


@posix_only
def test_closing_a_host_session_leaves_no_populate_thread():
    from membackend import create_session

    session = create_session(backend="host")
    session.backend.driver.workers = 2
    r = session.reserve(CPU, 32 * MiB)
    assert session.fault(r, 0, 32 * MiB).ok and populate_threads()
    session.close()
    assert populate_threads() == []


# --------------------------------------------------------------------------- threads on distinct reservations


@posix_only
def test_concurrent_faults_never_take_more_than_the_capacity():
    """Eight threads fault at once into a capacity that fits two: the check and the charge are one step."""
    for _ in range(5):
        backend = HostBackend(page_size=PS, capacity=4 * PS)
        rs = [backend.membackend_reserve(CPU, 2 * PS) for _ in range(8)]
        barrier = threading.Barrier(len(rs))
        faults = [None] * len(rs)

        def fault(k):
            barrier.wait()
            faults[k] = backend.membackend_fault(rs[k], 0, 2 * PS)

        threads = [threading.Thread(target=fault, args=(k,)) for k in range(len(rs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        granted = sum(f.mapped for f in faults if f.ok)
        assert granted == 4 * PS, f"capacity {4 * PS}, granted {granted} ({[f.ok for f in faults]})"
        assert backend.resident == granted == sum(r.handle.resident.count(1) * PS for r in rs)
        assert kernel_resident(rs) == granted
        for r in rs:
            backend.membackend_release_reservation(r)
        assert backend.resident == 0
        backend.driver.shutdown_pool()


@posix_only
def test_random_verbs_from_threads_keep_the_resident_count_exact():
    backend = HostBackend(page_size=PS, capacity=24 * PS)
    rs = [backend.membackend_reserve(CPU, 6 * PS) for _ in range(8)]

    def work(k):
        rng = random.Random(k)
        r = rs[k]
        for _ in range(200):
            first = rng.randrange(6)
            pages = rng.randint(1, 6 - first)
            if rng.random() < 0.6:
                backend.membackend_fault(r, first * PS, pages * PS)
            else:
                backend.membackend_free(r, first * PS, pages * PS)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(rs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    counted = sum(r.handle.resident.count(1) * PS for r in rs)
    assert backend.resident == counted == kernel_resident(rs)
    assert counted <= 24 * PS
    generations = [g for r in rs for p, g in enumerate(r.handle.generations) if r.handle.resident[p]]
    assert len(set(generations)) == len(generations), "every backed page has its own generation"
    for r in rs:
        backend.membackend_release_reservation(r)
    assert backend.resident == 0
    backend.driver.shutdown_pool()


# --------------------------------------------------------------------------- failure injection


def run_faults(backend, count=40, seed=3):
    rng = random.Random(seed)
    r = backend.membackend_reserve(CPU, 8 * PS)
    outcomes = []
    try:
        for _ in range(count):
            first = rng.randrange(8)
            f = backend.membackend_fault(r, first * PS, rng.randint(1, 8 - first) * PS)
            outcomes.append(f.ok)
            assert backend.resident == r.handle.resident.count(1) * PS
            if sys.platform != "win32":
                assert resident_bytes(r.base, r.size) == backend.resident, "a failed fault must roll back"
            if rng.random() < 0.5:
                backend.membackend_free(r, 0, r.size)
    finally:
        backend.membackend_release_reservation(r)
    return outcomes


@posix_only
def test_injected_failures_are_out_of_memory_and_stop_restores_the_driver():
    backend = HostBackend(page_size=PS)
    real = backend.driver
    injection = backend.membackend_inject_failures(0.3, 11)
    outcomes = run_faults(backend)
    assert injection.injected == outcomes.count(False) > 0 and any(outcomes)
    injection.stop()
    injection.stop()
    assert backend.driver is real
    assert all(run_faults(backend))
    assert injection.injected == outcomes.count(False)


@posix_only
def test_a_seed_gives_the_same_failures():
    a, b = HostBackend(page_size=PS), HostBackend(page_size=PS)
    a.membackend_inject_failures(0.3, 5)
    b.membackend_inject_failures(0.3, 5)
    assert run_faults(a) == run_faults(b)


@posix_only
def test_injected_failures_from_threads_are_counted_and_rolled_back():
    backend = HostBackend(page_size=PS)
    injection = backend.membackend_inject_failures(0.2, 1)
    rs = [backend.membackend_reserve(CPU, 4 * PS) for _ in range(8)]
    failed = [0] * len(rs)

    def work(k):
        for _ in range(50):
            if not backend.membackend_fault(rs[k], 0, 4 * PS).ok:
                failed[k] += 1
            backend.membackend_free(rs[k], 0, 4 * PS)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(rs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    injection.stop()
    assert injection.injected == sum(failed) > 0
    assert backend.resident == 0 == kernel_resident(rs)
    for r in rs:
        backend.membackend_release_reservation(r)


@posix_only
def test_injections_nest_and_stop_in_any_order():
    backend = HostBackend(page_size=PS)
    real = backend.driver
    outer = backend.membackend_inject_failures(1.0, 0)
    inner = backend.membackend_inject_failures(0.0, 0)
    outer.stop()  # the outer one stops injecting at once, though the inner one still wraps it
    assert all(run_faults(backend, count=5))
    inner.stop()
    assert backend.driver is real

    outer = backend.membackend_inject_failures(0.0, 0)
    inner = backend.membackend_inject_failures(1.0, 0)
    inner.stop()
    assert backend.driver is outer._driver
    outer.stop()
    assert backend.driver is real


@pytest.mark.parametrize("probability,seed,key", [(1.5, 0, "probability"), (True, 0, "probability"),
                                                  ("0.1", 0, "probability"), (0.1, 1.5, "seed")])
def test_bad_injection_arguments_are_typed(probability, seed, key):
    backend = HostBackend(page_size=PS)
    real = backend.driver
    with pytest.raises(ConfigError) as info:
        backend.membackend_inject_failures(probability, seed)
    assert info.value.key == key and info.value.accepted
    assert backend.driver is real

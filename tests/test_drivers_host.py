"""The host driver (``membackend._drivers.host``): its real effect on the process (RSS and
/proc/self/maps), populating pages (MADV_POPULATE_WRITE, its EINVAL, its threads) and the Windows calls."""

from __future__ import annotations

import ctypes
import errno
import sys
import threading

import psutil
import pytest

from membackend._backends.host import HostBackend
from membackend._drivers.host import (
    MADV_POPULATE_WRITE,
    MEM_COMMIT,
    MEM_DECOMMIT,
    MEM_RELEASE,
    MEM_RESERVE,
    PAGE_NOACCESS,
    PAGE_READWRITE,
    PosixHostDriver,
    WindowsHostDriver,
    resident_bytes,
    win32_args,
)
from membackend.types import Device, DriverError

MiB = 1 << 20
PS = 2 * MiB
CPU = Device("cpu", 0)
MADVISE_POPULATE = "madvise(MADV_POPULATE_WRITE)"

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
populate_linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                         reason="MADV_POPULATE_WRITE is Linux only")
posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX host driver")


def rss() -> int:
    return psutil.Process().memory_info().rss


def mapped(addr: int) -> bool:
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@linux_only
@pytest.mark.slow
def test_reserve_fault_free_release_move_real_memory(host_session):
    baseline = rss()
    r = host_session.reserve(CPU, 1 << 30)
    assert rss() - baseline < 32 * MiB, "reserving must not commit memory"
    assert mapped(r.base)
    assert host_session.fault(r, 0, 512 * MiB).ok
    assert rss() - baseline >= 400 * MiB
    assert host_session.free(r) == 512 * MiB
    assert abs(rss() - baseline) <= 32 * MiB
    assert mapped(r.base), "free keeps the address range"
    host_session.release_reservation(r)
    assert not mapped(r.base) and not mapped(r.base + r.size - 1)


@linux_only
def test_freed_range_is_inaccessible_again(host_session):
    """free re-protects the range (PROT_NONE): /proc/self/maps shows ---p for it."""
    r = host_session.reserve(CPU, 4 * MiB)
    host_session.fault(r, 0, 4 * MiB)

    def perms(addr):
        with open("/proc/self/maps") as f:
            for line in f:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= addr < hi:
                    return line.split()[1]

    assert perms(r.base) == "rw-p"
    host_session.free(r)
    assert perms(r.base) == "---p"


@linux_only
def test_a_failing_populate_rolls_back_what_the_fault_mapped(host_session, monkeypatch):
    import errno

    r = host_session.reserve(CPU, 8 * MiB)
    host_session.fault(r, 0, 2 * MiB)
    driver = host_session.backend.driver
    real = driver.populate
    calls = []

    def flaky(addr, size):
        calls.append(addr)
        if len(calls) == 2:
            raise DriverError(errno.ENOMEM, "madvise(MADV_POPULATE_WRITE)")
        real(addr, size)

    monkeypatch.setattr(driver, "populate", flaky)
    # pages 1 and 3 are missing, page 2 is resident: two runs, the second fails
    host_session.fault(r, 4 * MiB, 2 * MiB)
    before = host_session.ledger.account(CPU), host_session.backend.resident
    calls.clear()
    f = host_session.fault(r, 0, 8 * MiB)
    assert not f.ok
    assert (host_session.ledger.account(CPU), host_session.backend.resident) == before
    assert bytes(r.handle.resident) == b"\x01\x00\x01\x00"


def test_a_driver_error_other_than_oom_is_raised_after_rollback(host_session, monkeypatch):
    import errno

    r = host_session.reserve(CPU, 4 * MiB)
    monkeypatch.setattr(host_session.backend.driver, "populate",
                        lambda a, s: (_ for _ in ()).throw(DriverError(errno.EFAULT, "madvise")))
    with pytest.raises(DriverError, match="madvise failed"):
        host_session.fault(r, 0, 4 * MiB)
    assert host_session.ledger.resident(r) == 0 and bytes(r.handle.resident) == b"\x00\x00"


# --------------------------------------------------------------------------- Windows argument building


def test_win32_arguments():
    assert win32_args("reserve", None, 4096) == ("VirtualAlloc", (None, 4096, MEM_RESERVE, PAGE_NOACCESS))
    assert win32_args("commit", 0x10000, 8192) == ("VirtualAlloc", (0x10000, 8192, MEM_COMMIT, PAGE_READWRITE))
    assert win32_args("decommit", 0x10000, 8192) == ("VirtualFree", (0x10000, 8192, MEM_DECOMMIT))
    assert win32_args("release", 0x10000, 8192) == ("VirtualFree", (0x10000, 0, MEM_RELEASE))
    with pytest.raises(ValueError, match="accepted: reserve, commit, decommit, release"):
        win32_args("protect", 0, 1)


class FakeKernel32:
    """Records calls the way kernel32 would receive them; returns 0 (failure) when told to."""

    def __init__(self, fail=None):
        self.calls, self.fail = [], fail

    def VirtualAlloc(self, *args):
        self.calls.append(("VirtualAlloc", args))
        return 0 if self.fail == "VirtualAlloc" else (args[0] or 0x7FF000000000)

    def VirtualFree(self, *args):
        self.calls.append(("VirtualFree", args))
        return 0 if self.fail == "VirtualFree" else 1


def test_windows_driver_issues_the_documented_calls():
    k = FakeKernel32()
    d = WindowsHostDriver(kernel32=k)
    addr = d.reserve(1 << 30, 2 * MiB)
    d.commit(addr, 2 * MiB)
    d.decommit(addr, 2 * MiB)
    d.release(addr, 1 << 30)
    assert k.calls == [
        ("VirtualAlloc", (None, 1 << 30, MEM_RESERVE, PAGE_NOACCESS)),
        ("VirtualAlloc", (addr, 2 * MiB, MEM_COMMIT, PAGE_READWRITE)),
        ("VirtualFree", (addr, 2 * MiB, MEM_DECOMMIT)),
        ("VirtualFree", (addr, 0, MEM_RELEASE)),
    ]


def test_windows_driver_failure_is_a_driver_error():
    d = WindowsHostDriver(kernel32=FakeKernel32(fail="VirtualAlloc"))
    with pytest.raises(DriverError, match="VirtualAlloc failed"):
        d.reserve(1 << 20, 4096)


# --------------------------------------------------------------------------- populating pages


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


def populate_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("membackend-populate")]


# --------------------------------------------------------------------------- 4.1: EINVAL from populate


@populate_linux_only
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


@populate_linux_only
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


@posix_only
def test_closing_a_host_session_leaves_no_populate_thread():
    from membackend import create_session

    session = create_session(backend="host")
    session.backend.driver.workers = 2
    r = session.reserve(CPU, 32 * MiB)
    assert session.fault(r, 0, 32 * MiB).ok and populate_threads()
    session.close()
    assert populate_threads() == []

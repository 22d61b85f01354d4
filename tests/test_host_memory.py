"""The host backend's real effect on the process: RSS and /proc/self/maps."""

from __future__ import annotations

import sys

import psutil
import pytest

from membackend._drivers.host import (
    MEM_COMMIT,
    MEM_DECOMMIT,
    MEM_RELEASE,
    MEM_RESERVE,
    PAGE_NOACCESS,
    PAGE_READWRITE,
    WindowsHostDriver,
    win32_args,
)
from membackend.types import Device, DriverError

MiB = 1 << 20
CPU = Device("cpu", 0)

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")


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

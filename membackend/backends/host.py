"""The built-in ``host`` backend: reservations in host RAM on real OS virtual memory.

Always available and never blockable: it is the fallback when no GPU backend
fits. Reserve maps address space with no memory behind it; fault commits and
populates whole pages; free drops them (the addresses stay); release unmaps.
``capacity`` caps what may be resident, so a small device can be modelled
on a big host: a fault past it is out of memory (``Fault(ok=False)``).
"""

from __future__ import annotations

import errno
import itertools
from array import array

import psutil

from .. import __version__
from ..drivers.host import HostDriver, host_driver, os_page_size
from ..hookspec import hookimpl
from ..machine import cgroup_memory
from ..types import Budget, Candidate, Capabilities, Device, DriverError, Fault, Machine, Reservation, WrongDevice

__all__ = ["HostBackend"]

CPU = Device("cpu", 0)
DEFAULT_PAGE_SIZE = 2 << 20
DEFAULT_HEADROOM = 512 << 20


class _Pages:
    """Per-reservation page table: a resident flag and a generation per page."""

    __slots__ = ("resident", "generations")

    def __init__(self, pages: int):
        self.resident = bytearray(pages)
        self.generations = array("Q", bytes(8 * pages))


def _runs(flags: bytearray, first: int, last: int, want: int) -> list[tuple[int, int]]:
    """Maximal runs ``[start, end)`` of pages in ``[first, last)`` whose flag is ``want``."""
    runs = []
    needle, other = bytes([want]), bytes([1 - want])
    i = flags.find(needle, first, last)
    while i != -1:
        j = flags.find(other, i, last)
        j = last if j == -1 else j
        runs.append((i, j))
        i = flags.find(needle, j, last)
    return runs


class HostBackend:
    """Host RAM backend (see module docstring). One device: ``cpu:0``."""

    name = "host"
    version = __version__
    capabilities = Capabilities(unified_pool=True)
    device_kinds = ("cpu",)

    def __init__(self, page_size: int = DEFAULT_PAGE_SIZE, capacity: int | None = None,
                 headroom: int = DEFAULT_HEADROOM, driver: HostDriver | None = None):
        os_page = os_page_size()
        if page_size < os_page or page_size % os_page or page_size & (page_size - 1):
            raise ValueError(f"page_size {page_size} must be a power of two multiple of the OS page ({os_page})")
        self.page_size = page_size
        self.capacity = capacity
        self.headroom = headroom
        self.driver = driver or host_driver()
        self.resident = 0
        self._generation = itertools.count(1)

    @classmethod
    def from_settings(cls, settings) -> "HostBackend":
        return cls(page_size=settings.page_size or DEFAULT_PAGE_SIZE, capacity=settings.host_capacity)

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        return Candidate(self.name, 1, "host RAM through OS virtual memory; always available, the fallback")

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        if device != CPU:
            raise WrongDevice(f"the host backend serves only {CPU}, not {device}")
        ps = self.page_size
        rounded = -(-size // ps) * ps
        base = self.driver.reserve(rounded, ps)
        return Reservation(device, base, rounded, ps, self.name, handle=_Pages(rounded // ps), requested=size)

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        pages: _Pages = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if pages.resident.find(0, first, last) == -1:  # hot path: all resident
            return Fault(True, tuple(pages.generations[first:last]), first, 0)
        missing = _runs(pages.resident, first, last, 0)
        need = sum(j - i for i, j in missing) * ps
        if self.capacity is not None and self.resident + need > self.capacity:
            return Fault(False, (), first, 0)
        done: list[tuple[int, int]] = []
        try:
            for i, j in missing:
                addr, length = reservation.base + i * ps, (j - i) * ps
                try:
                    self.driver.commit(addr, length)
                    self.driver.populate(addr, length)
                except DriverError:
                    self.driver.decommit(addr, length)
                    raise
                done.append((i, j))
        except DriverError as exc:
            for i, j in done:
                self.driver.decommit(reservation.base + i * ps, (j - i) * ps)
            if exc.code in (errno.ENOMEM, errno.EAGAIN, 8, 1455):  # 8/1455: Windows not enough memory / commit limit
                return Fault(False, (), first, 0)
            raise
        gens = pages.generations
        for i, j in done:
            pages.resident[i:j] = b"\x01" * (j - i)
            for p in range(i, j):
                gens[p] = next(self._generation)
        self.resident += need
        return Fault(True, tuple(gens[first:last]), first, need)

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        pages: _Pages = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if pages.resident.find(1, first, last) == -1:
            return 0
        dropped = 0
        for i, j in _runs(pages.resident, first, last, 1):
            self.driver.decommit(reservation.base + i * ps, (j - i) * ps)
            pages.resident[i:j] = bytes(j - i)
            dropped += (j - i) * ps
            self.resident -= (j - i) * ps
        return dropped

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        pages: _Pages = reservation.handle
        dropped = pages.resident.count(1) * reservation.page_size
        self.driver.release(reservation.base, reservation.size)
        self.resident -= dropped
        return dropped

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        """The host has no queues of its own: the session's fence tokens are all there is."""

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        if device != CPU:
            raise WrongDevice(f"the host backend serves only {CPU}, not {device}")
        vm = psutil.virtual_memory()
        total, free, source = int(vm.total), int(vm.available), "psutil MemAvailable"
        limit, usage = cgroup_memory()
        if limit is not None and limit < total:
            total, source = limit, "cgroup memory limit"
            free = min(free, limit - (usage or 0))
        if self.capacity is not None:
            total, source = self.capacity, f"host_capacity ({source})"
            free = min(free, self.capacity - self.resident)
        return Budget.of(total, free, self.headroom, source, unified=True)

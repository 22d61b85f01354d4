"""The built-in ``host`` backend: reservations in host RAM on real OS virtual memory.

Always available and never blockable: it is the fallback when no GPU backend
fits. Reserve maps address space with no memory behind it; fault commits and
populates whole pages; free drops them (the addresses stay); release unmaps.
``capacity`` caps what may be resident, so a small device can be modelled
on a big host: a fault past it is out of memory (``Fault(ok=False)``).

Threads: the session serialises the verbs on one reservation, but verbs on
different reservations reach the backend at the same time. The backend's own
shared state (the ``resident`` count, the capacity check, the generation
counter) is kept under one lock; the driver calls run outside it, so faults
on different reservations populate in parallel. A fault charges its pages to
``resident`` before it commits them and uncharges them if it fails, so
concurrent faults never take more than ``capacity`` together.
"""

from __future__ import annotations

import errno
import sys
import threading
from array import array

from .._version import __version__
from .._drivers.host import FailingHostDriver, HostDriver, host_driver, resident_bytes
from .._hostmem import host_memory, os_page_size
from .._settings.rules import HOST_PAGE_SIZE
from ..hookspec import hookimpl
from ..types import (
    Budget,
    Candidate,
    Capabilities,
    ConfigError,
    Device,
    DriverError,
    DriverState,
    Fault,
    Machine,
    Reservation,
    Score,
    WrongDevice,
    format_size,
)

__all__ = ["HostBackend", "HostFailures"]

CPU = Device("cpu", 0)
DEFAULT_PAGE_SIZE = HOST_PAGE_SIZE  # the page_size setting's default: one number for both
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
        self._next_generation = 1
        self._live: dict[int, Reservation] = {}  # base -> every reservation not released yet (for inspect)
        self._lock = threading.Lock()  # resident, the capacity check and the generation counter
        #: the live reservations; held across inspect's mincore and release's munmap, so that inspect never asks
        #: the kernel about a range a release is giving back (faults never take it)
        self._live_lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings) -> "HostBackend":
        """``page_size`` (always a size: 2 MiB unless set) and ``host_capacity`` from the settings; the
        ``headroom`` setting is the session's to apply, not this backend's (see ``Session``)."""
        return cls(page_size=settings.page_size, capacity=settings.host_capacity)

    def own_headroom(self, device: Device, total: int) -> tuple[int, str]:
        """The headroom this backend keeps of its own (the lowest level of ``Session.headroom_in_force``)."""
        return self.headroom, f"backend {self.name}'s own rule ({format_size(self.headroom)})"

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        return Candidate(self.name, Score.FALLBACK,
                         "host RAM through OS virtual memory; always available, the fallback")

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        self._serves(device)
        ps = self.page_size
        rounded = -(-size // ps) * ps
        base = self.driver.reserve(rounded, ps)
        r = Reservation(device, base, rounded, ps, self.name, handle=_Pages(rounded // ps), requested=size)
        with self._live_lock:
            self._live[base] = r
        return r

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        pages: _Pages = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if pages.resident.find(0, first, last) == -1:  # hot path: all resident
            return Fault(True, tuple(pages.generations[first:last]), first, 0)
        missing = _runs(pages.resident, first, last, 0)
        need = sum(j - i for i, j in missing) * ps
        with self._lock:  # check and charge as one step: concurrent faults cannot overshoot the capacity
            if self.capacity is not None and self.resident + need > self.capacity:
                return Fault(False, (), first, 0)
            self.resident += need
        done: list[tuple[int, int]] = []
        try:
            for i, j in missing:
                done.append((i, j))  # from the commit on, the run may be (partly) backed
                self.driver.commit(reservation.base + i * ps, (j - i) * ps)
                self.driver.populate(reservation.base + i * ps, (j - i) * ps)
        except BaseException as exc:
            kept = self._roll_back(reservation, done)
            with self._lock:
                self.resident -= need - kept
            if not kept and isinstance(exc, DriverError) and exc.code in (errno.ENOMEM, errno.EAGAIN, 8, 1455):
                return Fault(False, (), first, 0)  # 8/1455: Windows not enough memory / commit limit
            if kept and isinstance(exc, DriverError):
                exc.mapped = kept  # pages the rollback could not drop stay resident and accounted
            raise
        self._mark_resident(pages, done)
        return Fault(True, tuple(pages.generations[first:last]), first, need)

    def _roll_back(self, reservation: Reservation, runs: list[tuple[int, int]]) -> int:
        """Decommit the runs a failed fault touched; returns the bytes that had to stay backed.

        A run whose decommit fails stays committed: it is marked resident with
        new generations (it holds no data the caller knows of), so nothing leaks.
        """
        ps, stuck = reservation.page_size, []
        for i, j in runs:
            try:
                self.driver.decommit(reservation.base + i * ps, (j - i) * ps)
            except DriverError:
                stuck.append((i, j))
        self._mark_resident(reservation.handle, stuck)
        return sum(j - i for i, j in stuck) * ps

    def _mark_resident(self, pages: _Pages, runs: list[tuple[int, int]]) -> None:
        count = sum(j - i for i, j in runs)
        with self._lock:
            generation = self._next_generation
            self._next_generation += count
        gens = pages.generations
        for i, j in runs:
            pages.resident[i:j] = b"\x01" * (j - i)
            for p in range(i, j):
                gens[p] = generation
                generation += 1

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        pages: _Pages = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if pages.resident.find(1, first, last) == -1:
            return 0
        dropped = 0
        for i, j in _runs(pages.resident, first, last, 1):
            try:
                self.driver.decommit(reservation.base + i * ps, (j - i) * ps)
            except DriverError as exc:
                exc.dropped = dropped  # the session accounts what did go
                raise
            pages.resident[i:j] = bytes(j - i)
            dropped += (j - i) * ps
            with self._lock:
                self.resident -= (j - i) * ps
        return dropped

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        pages: _Pages = reservation.handle
        dropped = pages.resident.count(1) * reservation.page_size
        with self._live_lock:
            self.driver.release(reservation.base, reservation.size)
            self._live.pop(reservation.base, None)
        with self._lock:
            self.resident -= dropped
        return dropped

    @hookimpl
    def membackend_inspect(self, device: Device) -> DriverState | None:
        """The kernel's own view of the live reservations: their bytes, and the bytes of them it holds in RAM
        (``mincore(2)``); None where the OS has no ``mincore`` (Windows)."""
        self._serves(device)
        if sys.platform == "win32":
            return None
        with self._live_lock:  # no release unmaps a range while the kernel is asked about it
            live = list(self._live.values())
            resident = sum(resident_bytes(r.base, r.size) for r in live)
        return DriverState(reserved=sum(r.size for r in live), resident=resident,
                           source="the kernel (mincore over the live reservations)")

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        """The host has no queues of its own: the session's fence tokens are all there is."""

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        self._serves(device)
        mem = host_memory()
        total, free, source = mem.total, mem.available, mem.source
        if self.capacity is not None:
            total, source = self.capacity, f"host_capacity ({source})"
            free = min(free, self.capacity - self.resident)
        return Budget.of(total, free, self.headroom, source, unified=True)

    # ------------------------------------------------------------------ optional hooks

    @hookimpl
    def membackend_trim(self, device: Device) -> int:
        """Stop the driver's populate threads (they start again on the next big fault).

        The host keeps no memory for reuse, so this always gives back 0 bytes.
        """
        self._serves(device)
        self.driver.shutdown_pool()
        return 0

    @hookimpl
    def membackend_inject_failures(self, probability: float, seed: int) -> "HostFailures":
        """Fail commits and populates at random with the OS's out-of-memory codes.

        See :class:`~membackend._drivers.host.FailingHostDriver` for which calls
        fail and why those. ``stop()`` puts the real driver back.
        """
        where = "membackend_inject_failures argument"
        if isinstance(probability, bool) or not isinstance(probability, (int, float)) \
                or not 0.0 <= probability <= 1.0:
            raise ConfigError("probability", where, f"not a probability (got {probability!r})", "a number from 0 to 1")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ConfigError("seed", where, f"not a seed (got {seed!r})", "an int")
        return HostFailures(self, FailingHostDriver(self.driver, float(probability), seed))

    def _serves(self, device: Device) -> None:
        if device != CPU:
            raise WrongDevice(f"the host backend serves only {CPU}, not {device}")


class HostFailures:
    """A running failure injection on one :class:`HostBackend` (a ``FailureInjection``)."""

    def __init__(self, backend: HostBackend, driver: FailingHostDriver):
        self._backend, self._driver = backend, driver
        backend.driver = driver

    @property
    def injected(self) -> int:
        """Failures injected so far."""
        return self._driver.injected

    def stop(self) -> None:
        """End the injection; calling it again does nothing.

        Injections nest: stopping an inner one restores the outer one; an
        outer one stopped first stops injecting at once and leaves the chain
        until the inner one is stopped too.
        """
        self._driver.active = False
        if self._backend.driver is self._driver:
            real = self._driver.real
            # skip wrappers stopped out of order, so nothing stale stays in the chain
            while isinstance(real, FailingHostDriver) and not real.active:
                real = real.real
            self._backend.driver = real

"""A third-party backend written from membackend's documentation and hookspec alone: host
memory in a memfd (an anonymous shared-memory file), one per reservation. Linux only.

* reserve: ``memfd_create`` + ``ftruncate`` (a sparse file: no memory yet), mapped
  shared and read-write: the reservation's address range;
* fault: ``posix_fallocate`` over each missing page allocates it in the file
  (ENOSPC/ENOMEM from the kernel is out of memory: ``Fault(ok=False)``), then
  a write to each OS page maps it;
* free: ``madvise(MADV_REMOVE)`` punches the pages out of the file (for a shared
  mapping ``MADV_DONTNEED`` would only drop this process's page-table entries
  and keep the memory: man 2 madvise);
* release: unmap, close the descriptor;
* optional hooks: ``membackend_inject_failures`` (allocations and page drops fail
  at random); ``from_settings`` honours ``host_capacity``, so the kit can also
  drive it out of memory by capacity.

Installed (``pip install docs/examples/memfd_backend``), membackend finds it through its entry
point ``memfd`` in the group ``membackend.backends``; it is opt-in, so it is selected only when
forced (``MEMBACKEND_BACKEND=memfd``). The conformance kit checks it installed,
``pytest --pyargs membackend.testing.conformance --membackend-backend memfd``, or by import path
without installing, ``--membackend-plugin membackend_memfd:MemfdBackend``.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import mmap
import os
import random
import threading

import psutil

from membackend import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    Fault,
    Reservation,
    Score,
    WrongDevice,
    hookimpl,
)

CPU = Device("cpu", 0)
PAGE = 16 * mmap.PAGESIZE


class _Handle:
    """What the backend keeps per reservation: the file, its mapping, and a page table."""

    def __init__(self, fd: int, mapping: mmap.mmap, pages: int):
        self.fd, self.mapping = fd, mapping
        self.resident = bytearray(pages)
        self.generations = [0] * pages


class MemfdBackend:
    name = "memfd"
    version = "0.1.0"
    capabilities = Capabilities(unified_pool=True)
    device_kinds = ("cpu",)

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity  # bytes that may be resident at once (None: no cap)
        self.resident = 0  # bytes resident in every reservation, under _lock
        self._lock = threading.Lock()  # the session runs verbs on different reservations at once
        self._generation = itertools.count(1)
        self._failures: _Failures | None = None

    @classmethod
    def from_settings(cls, settings):
        """How membackend builds it from its entry point: honour the ``host_capacity`` setting."""
        return cls(capacity=settings.host_capacity)

    @hookimpl
    def membackend_probe(self, machine):
        # fits any Linux host, but only when asked for by name: host (score 1) stays the default
        return Candidate(self.name, Score.FALLBACK, "host memory in memfd files", opt_in=True)

    @hookimpl
    def membackend_reserve(self, device, size):
        if device != CPU:
            raise WrongDevice(f"the memfd backend serves only {CPU}, not {device}")
        rounded = -(-size // PAGE) * PAGE
        fd = os.memfd_create("membackend-memfd", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, rounded)
            mapping = mmap.mmap(fd, rounded, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise DriverError(exc.errno, "memfd reserve", exc.strerror or "") from exc
        view = ctypes.c_char.from_buffer(mapping)
        base = ctypes.addressof(view)
        del view  # no buffer export may outlive this call, or the mapping could not be closed
        return Reservation(device, base, rounded, PAGE, self.name, handle=_Handle(fd, mapping, rounded // PAGE),
                           requested=size)

    @hookimpl
    def membackend_fault(self, reservation, offset, size):
        h: _Handle = reservation.handle
        first, last = offset // PAGE, (offset + size - 1) // PAGE + 1
        missing = [p for p in range(first, last) if not h.resident[p]]
        with self._lock:  # claimed before backing, so two faults at once cannot both pass the capacity
            if self.capacity is not None and self.resident + len(missing) * PAGE > self.capacity:
                return Fault(False, (), first, 0)
            self.resident += len(missing) * PAGE
        done = []
        for p in missing:
            try:
                self._back(h, p)
            except OSError as exc:
                kept = self._roll_back(h, done)
                with self._lock:
                    self.resident -= (len(missing) - len(kept)) * PAGE
                if exc.errno in (errno.ENOSPC, errno.ENOMEM) and not kept:
                    return Fault(False, (), first, 0)
                error = DriverError(exc.errno, "posix_fallocate", exc.strerror or "")
                error.mapped = len(kept) * PAGE  # pages the rollback could not drop stay resident, counted
                raise error from exc
            done.append(p)
        for p in done:
            h.resident[p] = 1
            h.generations[p] = next(self._generation)
        return Fault(True, tuple(h.generations[first:last]), first, len(done) * PAGE)

    def _roll_back(self, h: _Handle, pages: list[int]) -> list[int]:
        """Drop the pages a failed fault backed; returns those that could not be dropped (still resident)."""
        kept = []
        for p in pages:
            try:
                self._drop(h, p)
            except OSError:
                kept.append(p)
        for p in kept:
            h.resident[p] = 1
            h.generations[p] = next(self._generation)
        return kept

    def _back(self, h: _Handle, page: int) -> None:
        # allocate first, so a lack of memory is an error here rather than SIGBUS on first touch;
        # then write each OS page: fallocated shmem pages are not yet in memory for mincore(2)
        if self._failures is not None:
            self._failures.maybe_fail()
        os.posix_fallocate(h.fd, page * PAGE, PAGE)
        for o in range(page * PAGE, (page + 1) * PAGE, mmap.PAGESIZE):
            h.mapping[o] = 0

    def _drop(self, h: _Handle, page: int) -> None:
        if self._failures is not None:  # a punch can fail too (EBUSY, ENOMEM): the kit checks partial frees
            self._failures.maybe_fail(errno.EAGAIN)
        h.mapping.madvise(mmap.MADV_REMOVE, page * PAGE, PAGE)

    @hookimpl
    def membackend_free(self, reservation, offset, size):
        h: _Handle = reservation.handle
        dropped = 0
        for p in range(offset // PAGE, (offset + size - 1) // PAGE + 1):
            if h.resident[p]:
                try:
                    self._drop(h, p)
                except OSError as exc:
                    # the hookspec's partial-failure rule: what was dropped stays dropped and is reported
                    # on the error, so the session's ledger keeps matching the kernel; the rest stays resident
                    with self._lock:
                        self.resident -= dropped
                    error = DriverError(exc.errno, "madvise(MADV_REMOVE)", exc.strerror or "")
                    error.dropped = dropped
                    raise error from exc
                h.resident[p] = 0
                dropped += PAGE
        with self._lock:
            self.resident -= dropped
        return dropped

    @hookimpl
    def membackend_release_reservation(self, reservation):
        h: _Handle = reservation.handle
        dropped = h.resident.count(1) * PAGE
        try:
            self._unmap(h)
        except OSError as exc:  # nothing was given back: the reservation stays alive, a retry may succeed
            raise DriverError(exc.errno, "memfd release", exc.strerror or "") from exc
        with self._lock:
            self.resident -= dropped
        return dropped

    def _unmap(self, h: _Handle) -> None:
        h.mapping.close()
        os.close(h.fd)

    @hookimpl
    def membackend_fence(self, device, reservation):
        """No queues of its own: the session's fence tokens are all there is."""

    @hookimpl
    def membackend_budget_query(self, device):
        if device != CPU:
            raise WrongDevice(f"the memfd backend serves only {CPU}, not {device}")
        vm = psutil.virtual_memory()
        total, free, source = vm.total, vm.available, "psutil MemAvailable"
        if self.capacity is not None:
            total, free, source = self.capacity, min(free, self.capacity - self.resident), "host_capacity"
        return Budget.of(total, free, 256 << 20, f"{source} (memfd backend)", unified=True)

    @hookimpl
    def membackend_inject_failures(self, probability, seed):
        """Make allocations and page drops fail at random, as a full tmpfs or memory cgroup does."""
        if self._failures is not None:
            self._failures.stop()
        self._failures = _Failures(self, probability, seed)
        return self._failures


class _Failures:
    """A running failure injection (membackend.types.FailureInjection): ``injected`` and ``stop()``."""

    def __init__(self, backend: MemfdBackend, probability: float, seed: int):
        self.backend, self.probability, self.rng = backend, probability, random.Random(seed)
        self.injected = 0

    def maybe_fail(self, code: int = errno.ENOSPC) -> None:
        if self.rng.random() < self.probability:
            self.injected += 1
            raise OSError(code, f"injected: {os.strerror(code)}")

    def stop(self) -> None:
        if self.backend._failures is self:
            self.backend._failures = None

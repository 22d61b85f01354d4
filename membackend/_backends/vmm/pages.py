"""Pages in and out of a reservation: the fault, its rollback, and the free.

* fault: for each missing page, a kept handle or a new one (:mod:`.handles`), mapped and given access; a "not
  ready" answer (the driver still evicting, as WDDM can after an eviction) is retried after a device fence a
  bounded number of times; if a step fails, the pages this call mapped are rolled back (a create refused for
  want of a file descriptor raises ``DescriptorLimit``, :mod:`.descriptors`); each page gets a new
  generation whenever it gets new physical memory; on one pool shared with the host the one-pool guard
  (:mod:`.pool`) answers out of memory before the driver is asked;
* free: the session has already waited for the fence tokens recorded on the range; the device is
  synchronized only where the platform's ``page_in_sync`` says the driver pages fresh mappings in behind the
  process's back (WDDM: ComfyUI #16246), and then only if pages were mapped since the last synchronize, or
  before every unmap when the platform's ``fence_granularity`` is ``device``; then each page is unmapped and
  its handle goes to the handle keeper.

Called under the backend's lock.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

from ..._drivers.gpu import GpuDriver
from ...types import Capabilities, DriverError, Fault, Reservation
from .descriptors import HandleDescriptors
from .handles import HandleKeeper
from .pool import OnePoolGuard
from .state import DeviceState, PageTable

log = logging.getLogger(__package__)  # the backend's one logger

NOT_READY_RETRIES = 3  # a map or set-access answering "not ready" is retried after a fence this often


class PageMapper:
    """Maps and unmaps the pages of reservations. ``use(index)`` makes a device current and returns its
    state; ``generations`` numbers every page that gets new memory, for the backend's whole life; the
    parts are the handle keeper and the one-pool guard (None: no device shares one pool)."""

    def __init__(self, capabilities: Capabilities, driver: Callable[[], GpuDriver],
                 use: Callable[[int], DeviceState], generations: Iterator[int], handles: HandleKeeper,
                 one_pool: OnePoolGuard | None, descriptors: HandleDescriptors | None = None):
        self.fence_every_unmap = capabilities.fence_granularity == "device"
        self._driver = driver
        self._use = use
        self._generation = generations
        self.handles = handles
        self.one_pool = one_pool
        self.descriptors = descriptors

    def fault(self, reservation: Reservation, rng: PageTable, first: int, last: int) -> Fault:
        """Back pages ``[first, last)`` of ``reservation`` (see the module docstring)."""
        ps = reservation.page_size
        state = self._use(rng.index)
        d = self._driver()
        handles, ready, gens = rng.handles, rng.ready, rng.generations
        guard = self.one_pool
        if guard is not None and guard.applies(state) and not guard.has_room(rng, first, last, state):
            return Fault(False, (), first, 0)
        mapped: list[tuple[int, Any]] = []
        finished: list[int] = []  # pages left mapped by an earlier failure, now given access
        for p in range(first, last):
            if ready[p]:
                continue
            va, h, is_mapped = reservation.base + p * ps, handles[p], handles[p] is not None
            try:
                if not is_mapped:
                    h = self.handles.take(state, rng)
                    if h is None:
                        h = d.create(ps, rng.index)
                    self._not_ready_retried(state, d.map, va, ps, h)
                    is_mapped = True
                    mapped.append((p, h))
                self._not_ready_retried(state, d.set_access, va, ps, rng.index)
            except DriverError as exc:
                state.dirty = True
                # a create refused for want of a descriptor (counted before the rollback releases any)
                creating = not is_mapped and h is None and d.is_oom(exc)
                refused = (self.descriptors.refusal(exc, ps, len(mapped))
                           if self.descriptors is not None and creating else None)
                if not is_mapped and h is not None:
                    self.handles.not_mapped(state, rng, h)  # not mapped now: reuse it later
                kept = self._unwind(state, reservation, mapped)
                if refused is not None:
                    refused.mapped = kept
                    raise refused from exc
                if d.is_oom(exc) and not kept:
                    return Fault(False, (), first, 0)
                exc.mapped = kept  # pages the rollback could not unmap stay resident and accounted
                raise
            if handles[p] is not None:
                finished.append(p)
        state.dirty = True
        for p, h in mapped:
            handles[p] = h
        for p in [p for p, _ in mapped] + finished:
            ready[p] = 1
            gens[p] = next(self._generation)
        state.resident += len(mapped) * ps
        return Fault(True, tuple(gens[first:last]), first, len(mapped) * ps)

    def _not_ready_retried(self, state: DeviceState, call: Any, *args: Any) -> None:
        """Run a map or set-access; a "not ready" answer is retried after a device fence a bounded number of
        times, then raised typed."""
        driver = self._driver()
        for attempt in range(NOT_READY_RETRIES + 1):
            try:
                call(*args)
                return
            except DriverError as exc:
                if exc.code != driver.NOT_READY or attempt == NOT_READY_RETRIES:
                    raise
                log.info("membackend: %s answered not ready; fencing the device and retrying", exc.call)
                driver.device_synchronize()
                state.dirty = False

    def _unwind(self, state: DeviceState, r: Reservation, mapped: list[tuple[int, Any]]) -> int:
        """Roll back a failed fault; returns the bytes that had to stay mapped.

        Where the platform pages fresh mappings in asynchronously
        (``page_in_sync``), the device is synchronized first (aimdo's
        ``three_stooges`` unwinds without one); elsewhere nothing touched the
        fresh pages yet. A page whose unmap fails stays resident with a new
        generation, so nothing leaks.
        """
        d = self._driver()
        if state.page_in_sync:
            try:
                d.device_synchronize()
                state.dirty = False
            except DriverError:
                log.warning("membackend: cannot synchronize to roll back a fault; %d page(s) stay mapped",
                            len(mapped))
                return self._keep(state, r, mapped)
        for i, (p, h) in enumerate(mapped):
            try:
                d.unmap(r.base + p * r.page_size, r.page_size)
            except DriverError:
                return self._keep(state, r, mapped[i:])
            self.handles.unmapped(state, r.handle, h)
        return 0

    @staticmethod
    def _keep(state: DeviceState, r: Reservation, pages: list[tuple[int, Any]]) -> int:
        rng: PageTable = r.handle
        for p, h in pages:
            rng.handles[p] = h  # mapped, not ready: counted as resident, finished by the next fault
            rng.ready[p] = 0
        state.resident += len(pages) * r.page_size
        return len(pages) * r.page_size

    def _fence_before_drop(self, state: DeviceState) -> None:
        """The session already waited for the range's fence tokens. Synchronize the device only where fresh
        mappings may still be paging in (``page_in_sync``, WDDM) and pages were mapped since the last
        synchronize, or where a device-granular platform fences every unmap; elsewhere a free never stalls
        the device's other streams."""
        if (state.dirty and state.page_in_sync) or self.fence_every_unmap:
            self._driver().device_synchronize()
            state.dirty = False

    def _unmap(self, ptr: int, size: int) -> None:
        self._driver().unmap(ptr, size)

    def drop(self, r: Reservation, first: int, last: int, releasing: bool = False) -> int:
        """Unmap every resident page in ``[first, last)`` and hand its handle to the handle keeper
        (``releasing``: the reservation is being released); returns the bytes dropped. A failed unmap
        raises its ``DriverError`` with ``dropped``, the bytes that did go."""
        rng: PageTable = r.handle
        pages = [p for p in range(first, last) if rng.handles[p] is not None]
        if not pages:
            return 0
        state = self._use(rng.index)
        self._fence_before_drop(state)
        ps, dropped = r.page_size, 0
        for p in pages:
            try:
                self._unmap(r.base + p * ps, ps)
            except DriverError as exc:
                exc.dropped = dropped  # the session accounts what did go
                raise
            self.handles.unmapped(state, rng, rng.handles[p], releasing)
            rng.handles[p] = None
            rng.ready[p] = 0
            dropped += ps
            state.resident -= ps
        return dropped

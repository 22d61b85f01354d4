"""The virtual-memory backend, built from a :class:`~membackend.platform.Platform` and a driver.

``VmmBackend(platform, driver)`` serves every platform with one mechanism and
names itself after the platform: the built-in generic platform gives the
``vmm`` backend; a platform plugin contributes only its ``Platform`` record.
Mechanism only, per device:

* reserve: an address range rounded up to whole pages (a page is a multiple of
  the allocation granularity); refused with ``AddressSpaceExhausted`` before
  a known per-process address quota is reached, instead of letting the driver
  crash (rocm-systems #9823);
* fault: for each missing page, create physical memory, map it, set access;
  if a step fails, the pages this call mapped are rolled back; each page gets
  a new generation whenever it gets new physical memory;
* free: synchronize the device if pages were mapped since it was last
  synchronized (a fresh mapping may still be paging in: the WDDM bugcheck of
  ComfyUI #16246), or before every unmap when the platform's fence
  granularity is ``device``; then unmap and release each page, or keep the
  physical handle (bounded) for the next fault when ``recycle_handles``;
* release: free every page, then return the address range — or, under a
  reserve-churn limit, keep a large window (bounded) for the next reserve
  that fits, since the platform fails large reserves after enough frees;
* trim: give back kept handles and windows (the session calls it on close
  and after a full unload of everything);
* fence: recorded work arrives as :class:`~membackend.drivers.gpu.EventToken`
  from :meth:`VmmBackend.fence_token` (the session waits for those); a
  device-wide fence synchronizes the device;
* budget: the platform's budget source (``device``, ``wddm``, ``unified``)
  minus headroom;
* inspect / inject_failures: the driver's own tables and random driver
  failures, where the driver offers them (the simulated drivers do).

The right device is made current before every call that touches one. Calls
on different reservations may arrive from several threads (the session
serialises calls on one reservation): one lock guards the per-device state.
"""

from __future__ import annotations

import itertools
import logging
import threading
from array import array
from typing import Any

from .._version import __version__
from ..drivers.gpu import EventToken, GpuDriver
from ..drivers.open import LazyDriver, resolve_vendor
from ..hookspec import hookimpl
from ..platform import GENERIC, Platform
from ..types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    DriverState,
    Fault,
    Machine,
    MembackendError,
    Reservation,
    Score,
    WrongDevice,
)

log = logging.getLogger(__name__)

__all__ = ["VmmBackend", "AddressSpaceExhausted"]

MiB = 1 << 20
NOT_READY_RETRIES = 3  # a map or set-access answering "not ready" is retried after a fence this often
WINDOW_POOL_LIMIT = 4  # released address windows kept per device under a reserve-churn limit, at most
CHURN_MARGIN = 2  # large frees left unspent under a reserve-churn limit (the limit is one reproducer's count)


class AddressSpaceExhausted(MembackendError, MemoryError):
    """A reservation would pass the platform's per-process GPU address quota."""


class _Range:
    """Per-reservation page table.

    ``handles[p]`` is the physical handle mapped at page p (None: nothing
    mapped, the page is not resident); ``ready[p]`` is 1 once access is set
    too. A page can be mapped but not ready when a failed fault could not be
    rolled back: it counts as resident, and the next fault finishes it.
    """

    __slots__ = ("index", "window", "handles", "ready", "generations")

    def __init__(self, index: int, pages: int, window: int):
        self.index = index
        self.window = window  # bytes of address space behind it (a reused window may be larger)
        self.handles: list[Any] = [None] * pages
        self.ready = bytearray(pages)
        self.generations = array("Q", bytes(8 * pages))


class _DeviceState:
    __slots__ = ("granularity", "page_size", "dirty", "reserved", "resident", "spare", "windows")

    def __init__(self, granularity: int, page_size: int):
        self.granularity = granularity
        self.page_size = page_size
        self.dirty = False  # pages mapped since the last device synchronize
        self.reserved = 0  # address space of live reservations (whole windows)
        self.resident = 0
        self.spare: list[Any] = []  # unmapped physical handles kept for reuse
        self.windows: list[tuple[int, int]] = []  # (base, size) of released windows kept for reuse

    @property
    def pooled(self) -> int:
        return sum(size for _, size in self.windows)


class VmmBackend:
    """See the module docstring. ``driver`` is a :class:`GpuDriver` (initialised on first use), or
    None with ``driver_factory`` to open one lazily; ``capabilities``, ``headroom`` and ``page_size``
    replace the platform's own (for tests and comparisons)."""

    def __init__(self, platform: Platform = GENERIC, driver: GpuDriver | None = None, *,
                 capabilities: Capabilities | None = None, headroom: int | None = None,
                 page_size: int | None = None, driver_factory: LazyDriver | None = None):
        self.platform = platform
        self.name = platform.name
        self.version = platform.version or __version__
        self.capabilities = capabilities or platform.capabilities
        self._headroom = headroom  # None: the platform's own, per device
        self.requested_page_size = page_size or platform.page_size
        self._driver = driver
        self._driver_factory = driver_factory
        self._devices: dict[int, _DeviceState] = {}
        self._generation = itertools.count(1)
        self._initialised = False
        self._lock = threading.RLock()
        self._large_frees = 0  # frees of windows >= reserve_churn_window, process-wide (what #6191 counts)
        self._churn_warned = False
        vendor = driver.vendor if driver is not None else getattr(driver_factory, "vendor", None)
        if vendor is None:
            raise ValueError("VmmBackend needs a driver or a driver_factory")
        self.device_kinds = (vendor,)

    def headroom_for(self, total: int) -> int:
        """Bytes kept free on a device of ``total`` bytes: the override, else the platform's."""
        return self._headroom if self._headroom is not None else self.platform.headroom_for(total)

    @property
    def headroom(self) -> int | Any:
        """The fixed headroom, or the platform's rule (a function of the device total)."""
        return self._headroom if self._headroom is not None else self.platform.headroom

    @classmethod
    def from_settings(cls, settings: Any, platform: Platform = GENERIC) -> "VmmBackend":
        """Over the driver the settings pick (a simulated profile's twin, or the real bindings), opened
        on first use; the generic platform takes the vendor of the torch build or the profile."""
        vendor = resolve_vendor(platform.vendor, settings)
        # the headroom setting replaces the platform's here too, so the up-front refusal of a unified
        # pool keeps the same headroom as the budget the session reports
        return cls(platform, driver_factory=LazyDriver(vendor, settings.sim_profile), headroom=settings.headroom)

    # ------------------------------------------------------------------ driver access

    @property
    def driver(self) -> GpuDriver:
        if self._driver is None or not self._initialised:
            with self._lock:
                if self._driver is None:
                    self._driver = self._driver_factory()
                if not self._initialised:
                    self._driver.init()
                    self._initialised = True
        return self._driver

    def _use(self, index: int) -> _DeviceState:
        """Make device ``index`` current and return its state (created on first use)."""
        d = self.driver
        state = self._devices.get(index)
        if state is None:
            if not 0 <= index < d.device_count():
                raise WrongDevice(f"{self.device_kinds[0]}:{index} does not exist; "
                                  f"this machine has {d.device_count()} device(s)")
            d.set_device(index)
            g = d.granularity(index)
            page = max(g, -(-self.requested_page_size // g) * g)
            state = self._devices[index] = _DeviceState(g, page)
        else:
            d.set_device(index)
        return state

    def _device_index(self, device: Device) -> int:
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"backend {self.name!r} serves {self.device_kinds[0]} devices, not {device}")
        return device.index

    def fence_token(self, reservation: Reservation, stream: Any) -> EventToken:
        """An event recorded on ``stream`` after work that touches ``reservation``; give it to
        ``Session.record`` so frees and releases wait for that work (G2)."""
        index = reservation.handle.index
        with self._lock:
            self._use(index)
            event = self.driver.event_create()
            self.driver.event_record(event, stream)
        return EventToken(self.driver, event, index)

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        c = self.platform.probe(machine)
        if not isinstance(c, Candidate):
            raise TypeError(f"platform {self.name!r} probe returned {c!r}, not a Candidate")
        if c.score > Score.NONE and self._driver is None:
            missing = self._driver_factory.missing()
            if missing:
                return Candidate(self.name, Score.NONE, missing)
        if getattr(self._driver_factory, "simulated", False) or hasattr(self._driver, "sim"):
            c = Candidate(c.name, c.score, f"{c.reason} [simulated driver]", c.opt_in)
        return Candidate(self.name, c.score, c.reason, c.opt_in)

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._device_index(device)
        with self._lock:
            state = self._use(index)
            ps = state.page_size
            rounded = -(-size // ps) * ps
            window = self._pooled_window(state, rounded)
            if window is None:
                self._check_quota(device, rounded)
                base = self.driver.address_reserve(rounded, ps)
                window = (base, rounded)
            base, span = window
            state.reserved += span
        return Reservation(device, base, rounded, ps, self.name, handle=_Range(index, rounded // ps, span),
                           requested=size)

    def _check_quota(self, device: Device, rounded: int) -> None:
        quota = self.capabilities.address_quota
        if quota is None:
            return
        in_use = sum(s.reserved + s.resident + s.pooled for s in self._devices.values())
        if in_use + 2 * rounded > quota:  # the range and, at worst, its mappings
            raise AddressSpaceExhausted(
                f"reserving {rounded} bytes on {device} would pass the {quota} byte GPU address quota "
                f"({in_use} in use); unload a model first")

    def _pooled_window(self, state: _DeviceState, size: int) -> tuple[int, int] | None:
        """The smallest kept window that holds ``size`` bytes, taken out of the pool."""
        fits = [w for w in state.windows if w[1] >= size]
        if not fits:
            return None
        best = min(fits, key=lambda w: w[1])
        state.windows.remove(best)
        return best

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        rng: _Range = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if rng.ready.find(0, first, last) == -1:  # hot path: all resident, no driver call
            return Fault(True, tuple(rng.generations[first:last]), first, 0)
        with self._lock:
            return self._fault(reservation, rng, first, last)

    def _fault(self, reservation: Reservation, rng: _Range, first: int, last: int) -> Fault:
        ps = reservation.page_size
        state = self._use(rng.index)
        d = self.driver
        handles, ready, gens = rng.handles, rng.ready, rng.generations
        if self._unified and not self._pool_has_room(rng, first, last, state):
            return Fault(False, (), first, 0)
        mapped: list[tuple[int, Any]] = []
        finished: list[int] = []  # pages left mapped by an earlier failure, now given access
        for p in range(first, last):
            if ready[p]:
                continue
            va, h, is_mapped = reservation.base + p * ps, handles[p], handles[p] is not None
            try:
                if not is_mapped:
                    h = state.spare.pop() if state.spare else d.create(ps, rng.index)
                    self._not_ready_retried(state, d.map, va, ps, h)
                    is_mapped = True
                    mapped.append((p, h))
                self._not_ready_retried(state, d.set_access, va, ps, rng.index)
            except DriverError as exc:
                state.dirty = True
                if not is_mapped and h is not None:
                    state.spare.append(h)  # created but never mapped: reuse it later
                kept = self._unwind(state, reservation, mapped)
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

    @property
    def _unified(self) -> bool:
        return self.capabilities.unified_pool or self.platform.budget_source == "unified"

    def _pool_has_room(self, rng: _Range, first: int, last: int, state: _DeviceState) -> bool:
        """One pool shared with the host: a fault that would cross it is out of memory before the
        driver is asked (a GB10 driver refusing late ends in NV_ERR_NO_MEMORY and aborts, ComfyUI #15285)."""
        need = sum(1 for p in range(first, last) if rng.handles[p] is None) - len(state.spare)
        if need <= 0:
            return True
        _total, free, _source = self.driver.budget(self.platform.budget_source if self.platform.budget_source
                                                   == "unified" else "device", rng.index)
        return need * state.page_size <= free - self.headroom_for(_total)

    def _not_ready_retried(self, state: _DeviceState, call: Any, *args: Any) -> None:
        """Run a map or set-access; a "not ready" answer (the driver still evicting, as WDDM can after
        an eviction) is retried after a device fence a bounded number of times, then raised typed."""
        for attempt in range(NOT_READY_RETRIES + 1):
            try:
                call(*args)
                return
            except DriverError as exc:
                if exc.code != self.driver.NOT_READY or attempt == NOT_READY_RETRIES:
                    raise
                log.info("membackend: %s answered not ready; fencing the device and retrying", exc.call)
                self.driver.device_synchronize()
                state.dirty = False

    def _unwind(self, state: _DeviceState, r: Reservation, mapped: list[tuple[int, Any]]) -> int:
        """Roll back a failed fault; returns the bytes that had to stay mapped.

        Fresh mappings may still be paging in, so the device is synchronized
        first (aimdo's ``three_stooges`` unwinds without one). A page whose
        unmap fails stays resident with a new generation, so nothing leaks.
        """
        d = self.driver
        try:
            d.device_synchronize()
            state.dirty = False
        except DriverError:
            log.warning("membackend: cannot synchronize to roll back a fault; %d page(s) stay mapped", len(mapped))
            return self._keep(state, r, mapped)
        for i, (p, h) in enumerate(mapped):
            try:
                d.unmap(r.base + p * r.page_size, r.page_size)
            except DriverError:
                return self._keep(state, r, mapped[i:])
            self._release_or_keep(state, h)
        return 0

    def _keep(self, state: _DeviceState, r: Reservation, pages: list[tuple[int, Any]]) -> int:
        rng: _Range = r.handle
        for p, h in pages:
            rng.handles[p] = h  # mapped, not ready: counted as resident, finished by the next fault
            rng.ready[p] = 0
        state.resident += len(pages) * r.page_size
        return len(pages) * r.page_size

    def _release_or_keep(self, state: _DeviceState, handle: Any) -> None:
        """Release an unmapped handle, or keep it for reuse (recycling, or when release fails)."""
        limit = self.capabilities.recycle_limit
        if self.capabilities.recycle_handles and (limit is None or len(state.spare) < limit):
            state.spare.append(handle)
            return
        try:
            self.driver.release(handle)
        except DriverError:
            state.spare.append(handle)  # still ours: trim() or the next fault takes it

    def _fence_before_drop(self, state: _DeviceState) -> None:
        """Fresh mappings may still be paging in (WDDM) and a device-granular platform fences every
        unmap: synchronize first in either case."""
        if state.dirty or self.capabilities.fence_granularity == "device":
            self.driver.device_synchronize()
            state.dirty = False

    def _unmap(self, ptr: int, size: int) -> None:
        self.driver.unmap(ptr, size)

    def _drop(self, r: Reservation, first: int, last: int) -> int:
        """Unmap every resident page in ``[first, last)`` and release (or keep) its memory; returns bytes dropped."""
        rng: _Range = r.handle
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
            self._release_or_keep(state, rng.handles[p])
            rng.handles[p] = None
            rng.ready[p] = 0
            dropped += ps
            state.resident -= ps
        return dropped

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        ps = reservation.page_size
        with self._lock:
            return self._drop(reservation, offset // ps, (offset + size - 1) // ps + 1)

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        rng: _Range = reservation.handle
        with self._lock:
            dropped = self._drop(reservation, 0, reservation.pages)
            state = self._use(rng.index)
            window = (reservation.base, rng.window)
            if self._keeps_window(state, rng.window):
                state.windows.append(window)
            else:
                try:
                    self._free_window(*window)
                except DriverError as exc:
                    exc.dropped = dropped
                    raise
            state.reserved -= rng.window
        return dropped

    def _keeps_window(self, state: _DeviceState, size: int) -> bool:
        """Under a reserve-churn limit a large window is kept for reuse instead of freed: the
        platform fails large reserves once enough have been freed (rocm-systems #6191)."""
        caps = self.capabilities
        if caps.reserve_churn_limit is None or size < caps.reserve_churn_window:
            return False
        if len(state.windows) >= WINDOW_POOL_LIMIT:  # bounded: the smallest kept one goes back
            smallest = min(state.windows, key=lambda w: w[1])
            if smallest[1] >= size:
                return False
            self._free_window(*smallest)
            state.windows.remove(smallest)
        return True

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        with self._lock:
            state = self._use(self._device_index(device))
            if reservation is None or state.dirty:
                self.driver.device_synchronize()
                state.dirty = False

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._device_index(device)
        with self._lock:
            state = self._use(index)
            total, free, source = self.driver.budget(self.platform.budget_source, index)
            room = self.headroom_for(total)
            if self.capabilities.recycle_handles:
                # kept handles are usage to the driver, but the next fault maps them without asking it: free
                # to the policy. When the driver's own free falls below the headroom they go back first
                # (quiet: every free fenced them before they were unmapped), so the pool shrinks as the
                # budget needs the memory and can never push a WDDM device into sysmem fallback
                while state.spare and free < room:
                    self.driver.release(state.spare[-1])
                    state.spare.pop()
                    free += state.page_size
                free += len(state.spare) * state.page_size
            unified = self.capabilities.unified_pool or self.platform.budget_source == "unified" \
                or self.driver.integrated(index)
        return Budget.of(total, free, room, source, unified=unified)

    @hookimpl
    def membackend_trim(self, device: Device) -> int:
        """Release the physical handles kept for reuse and free the kept windows on ``device``."""
        index = self._device_index(device)
        with self._lock:
            state = self._devices.get(index)
            if state is None or not (state.spare or state.windows):
                return 0
            self._use(index)
            released = 0
            while state.spare:
                self.driver.release(state.spare[-1])
                state.spare.pop()
                released += state.page_size
            while state.windows:
                base, size = state.windows[-1]
                if not self._may_free_window(size):
                    report = log.debug if self._churn_warned else log.warning
                    self._churn_warned = True  # once per backend: unload-everything cycles would repeat it
                    report("membackend: keeping %d address window(s) on %s (%d bytes): the platform fails "
                                "large reserves after %d large frees and %d are spent (rocm-systems #6191)",
                                len(state.windows), device, state.pooled, self.capabilities.reserve_churn_limit,
                                self._large_frees)
                    break
                self._free_window(base, size)
                state.windows.pop()
                released += size
        return released

    def _is_large(self, size: int) -> bool:
        caps = self.capabilities
        return caps.reserve_churn_limit is not None and size >= caps.reserve_churn_window

    def _may_free_window(self, size: int) -> bool:
        """Under a reserve-churn limit a large window is freed only while the process's large frees stay
        below the limit minus a margin: past it every later large reserve fails (rocm-systems #6191)."""
        return not self._is_large(size) or \
            self._large_frees < self.capabilities.reserve_churn_limit - CHURN_MARGIN

    def _free_window(self, base: int, size: int) -> None:
        self.driver.address_free(base, size)
        if self._is_large(size):
            self._large_frees += 1

    def trim(self, device: Device) -> int:
        """Same as :meth:`membackend_trim` (kept for callers that hold the backend)."""
        return self.membackend_trim(device)

    @hookimpl
    def membackend_inspect(self, device: Device) -> DriverState | None:
        """The driver's tables for ``device`` (the simulated drivers have them; real drivers: None).

        Kept windows are reserved in the driver but belong to no reservation:
        they and the unmapped physical handles are reported as ``held``.
        """
        index = self._device_index(device)
        with self._lock:
            raw = self.driver.inspect(index)
            if raw is None:
                return None
            state = self._devices.get(index)
            pooled = state.pooled if state is not None else 0
        return DriverState(reserved=raw["reserved"] - pooled, resident=raw["mapped"],
                           held=pooled + raw["physical"] - raw["mapped"], source=f"driver tables ({self.driver.label})",
                           committed=raw.get("committed"), hazards=raw.get("hazards", 0))

    @hookimpl
    def membackend_inject_failures(self, probability: float, seed: int) -> Any:
        """Random failures of the driver's VMM calls, where the driver can inject them (simulations)."""
        return self.driver.inject_failures(probability, seed)


def capabilities_for(profile: Any) -> Capabilities:
    """What a simulated profile's platform would tell the policy, for tests and benchmarks that run
    the generic backend with a platform's knobs (the platform plugins carry their own)."""
    quota = profile.address_quota
    return Capabilities(
        unified_pool=profile.unified,
        address_quota=quota - quota // 16 if quota else None,  # keep a margin below the crash point
        reserve_churn_limit=profile.churn_limit,
        reserve_churn_window=profile.churn_window,
        fence_granularity="device" if profile.wddm else "reservation",
    )

"""The generic virtual-memory backend over any GPU driver wrapper (CUDA, HIP or a simulation).

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
  ComfyUI #16246), then unmap and release each page, or keep the physical
  handle for the next fault when the capabilities say ``recycle_handles``;
* release: free every page, then return the address range;
* fence: recorded work arrives as :class:`~membackend.drivers.gpu.EventToken`
  from :meth:`VmmBackend.fence_token` (the session waits for those); a
  device-wide fence synchronizes the device;
* budget: the driver's mem get info minus headroom.

The right device is made current before every call that touches one.
"""

from __future__ import annotations

import itertools
import logging
from array import array
from typing import Any

from .. import __version__
from ..drivers.gpu import EventToken, GpuDriver
from ..hookspec import hookimpl
from ..types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    Fault,
    Machine,
    MembackendError,
    Reservation,
    WrongDevice,
)

log = logging.getLogger(__name__)

__all__ = ["VmmBackend", "AddressSpaceExhausted"]

MiB = 1 << 20
DEFAULT_HEADROOM = 256 * MiB  # aimdo's VRAM_HEADROOM (reference/aimdo-internals.md 1.3)
RECYCLE_LIMIT = 16  # physical handles kept per device for reuse, at most


class AddressSpaceExhausted(MembackendError, MemoryError):
    """A reservation would pass the platform's per-process GPU address quota."""


class _Range:
    """Per-reservation page table.

    ``handles[p]`` is the physical handle mapped at page p (None: nothing
    mapped, the page is not resident); ``ready[p]`` is 1 once access is set
    too. A page can be mapped but not ready when a failed fault could not be
    rolled back: it counts as resident, and the next fault finishes it.
    """

    __slots__ = ("index", "handles", "ready", "generations")

    def __init__(self, index: int, pages: int):
        self.index = index
        self.handles: list[Any] = [None] * pages
        self.ready = bytearray(pages)
        self.generations = array("Q", bytes(8 * pages))


class _DeviceState:
    __slots__ = ("granularity", "page_size", "dirty", "reserved", "resident", "spare")

    def __init__(self, granularity: int, page_size: int):
        self.granularity = granularity
        self.page_size = page_size
        self.dirty = False  # pages mapped since the last device synchronize
        self.reserved = 0
        self.resident = 0
        self.spare: list[Any] = []  # unmapped physical handles kept for reuse


class VmmBackend:
    """See the module docstring. ``driver`` is any :class:`GpuDriver`; it is initialised on first use."""

    version = __version__
    honours_sim_profile = True  # from_settings builds it over MEMBACKEND_SIM_PROFILE's simulation

    def __init__(self, driver: GpuDriver | None = None, *, name: str = "vmm",
                 capabilities: Capabilities | None = None, headroom: int = DEFAULT_HEADROOM,
                 page_size: int = 2 * MiB, driver_factory: Any = None):
        self.name = name
        self.capabilities = capabilities or Capabilities()
        self.headroom = headroom
        self.requested_page_size = page_size
        self._driver = driver
        self._driver_factory = driver_factory
        self._devices: dict[int, _DeviceState] = {}
        self._generation = itertools.count(1)
        self._initialised = False
        vendor = driver.vendor if driver is not None else getattr(driver_factory, "vendor", "cuda")
        self.device_kinds = (vendor,)

    @classmethod
    def from_settings(cls, settings: Any) -> "VmmBackend":
        """Over the simulated profile ``settings.sim_profile`` if set, else the real driver of the torch build."""
        if settings.sim_profile:
            from ..drivers.sim import get_profile, sim_driver

            profile = get_profile(settings.sim_profile)
            return cls(sim_driver(profile), capabilities=capabilities_for(profile))
        vendor = "hip" if settings.machine.torch_vendor == "rocm" else None
        return cls(driver_factory=_RealDriverFactory(vendor))

    # ------------------------------------------------------------------ driver access

    @property
    def driver(self) -> GpuDriver:
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
        self._use(index)
        event = self.driver.event_create()
        self.driver.event_record(event, stream)
        return EventToken(self.driver, event, index)

    def driver_state(self, device: Device) -> dict[str, int] | None:
        """What the (simulated) driver holds on ``device``: reserved and mapped bytes. None on real drivers."""
        sim = self._driver.sim if self._driver is not None else None
        if sim is None:
            return None
        st = sim.state(device.index)
        return {"reserved": st["reserved"], "resident": st["mapped"]}

    # ------------------------------------------------------------------ contract

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        if self._driver is not None and self._driver.sim is not None:
            p = self._driver.sim.profile
            return Candidate(self.name, 10, f"generic VMM over the simulated {p.name} ({p.description})")
        vendor = self.device_kinds[0]
        gpus = machine.gpus(vendor)
        if not gpus:
            return Candidate(self.name, 0, f"no {vendor.upper()} device found")
        try:
            self._driver_factory.check()
        except ImportError as exc:
            extra = "cuda" if vendor == "cuda" else "hip"
            return Candidate(self.name, 0, f"{exc}; install membackend[{extra}]")
        return Candidate(self.name, 10, f"generic VMM over {vendor} on {len(gpus)} device(s)")

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._device_index(device)
        state = self._use(index)
        ps = state.page_size
        rounded = -(-size // ps) * ps
        quota = self.capabilities.address_quota
        if quota is not None:
            in_use = sum(s.reserved + s.resident for s in self._devices.values())
            if in_use + 2 * rounded > quota:  # the range and, at worst, its mappings
                raise AddressSpaceExhausted(
                    f"reserving {rounded} bytes on {device} would pass the {quota} byte GPU address quota "
                    f"({in_use} in use); unload a model first")
        base = self.driver.address_reserve(rounded, ps)
        state.reserved += rounded
        return Reservation(device, base, rounded, ps, self.name, handle=_Range(index, rounded // ps), requested=size)

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        rng: _Range = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if rng.ready.find(0, first, last) == -1:  # hot path: all resident, no driver call
            return Fault(True, tuple(rng.generations[first:last]), first, 0)
        state = self._use(rng.index)
        d = self.driver
        handles, ready, gens = rng.handles, rng.ready, rng.generations
        mapped: list[tuple[int, Any]] = []
        finished: list[int] = []  # pages left mapped by an earlier failure, now given access
        for p in range(first, last):
            if ready[p]:
                continue
            va, h, is_mapped = reservation.base + p * ps, handles[p], handles[p] is not None
            try:
                if not is_mapped:
                    h = state.spare.pop() if state.spare else d.create(ps, rng.index)
                    d.map(va, ps, h)
                    is_mapped = True
                    mapped.append((p, h))
                d.set_access(va, ps, rng.index)
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
        if self.capabilities.recycle_handles and len(state.spare) < RECYCLE_LIMIT:
            state.spare.append(handle)
            return
        try:
            self.driver.release(handle)
        except DriverError:
            state.spare.append(handle)  # still ours: trim() or the next fault takes it

    def _drop(self, r: Reservation, first: int, last: int) -> int:
        """Unmap every resident page in ``[first, last)`` and release (or keep) its memory; returns bytes dropped."""
        rng: _Range = r.handle
        pages = [p for p in range(first, last) if rng.handles[p] is not None]
        if not pages:
            return 0
        state = self._use(rng.index)
        d = self.driver
        if state.dirty:
            d.device_synchronize()
            state.dirty = False
        ps, dropped = r.page_size, 0
        for p in pages:
            try:
                d.unmap(r.base + p * ps, ps)
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
        return self._drop(reservation, offset // ps, (offset + size - 1) // ps + 1)

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        dropped = self._drop(reservation, 0, reservation.pages)
        state = self._use(reservation.handle.index)
        try:
            self.driver.address_free(reservation.base, reservation.size)
        except DriverError as exc:
            exc.dropped = dropped
            raise
        state.reserved -= reservation.size
        return dropped

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        state = self._use(self._device_index(device))
        if reservation is None or state.dirty:
            self.driver.device_synchronize()
            state.dirty = False

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._device_index(device)
        self._use(index)
        free, total = self.driver.mem_get_info()
        call = "cuMemGetInfo" if self.driver.vendor == "cuda" else "hipMemGetInfo"
        return Budget.of(total, free, self.headroom, f"{call} ({self.driver.label})",
                         unified=self.driver.integrated(index))

    def trim(self, device: Device) -> int:
        """Release the physical handles kept for reuse on ``device``; returns bytes released."""
        state = self._devices.get(device.index)
        if state is None or not state.spare:
            return 0
        self._use(device.index)
        released = 0
        while state.spare:
            self.driver.release(state.spare[-1])
            state.spare.pop()
            released += state.page_size
        return released


def capabilities_for(profile: Any) -> Capabilities:
    """What a profile's platform tells the policy (the platform plugins refine this)."""
    quota = profile.address_quota
    return Capabilities(
        unified_pool=profile.unified,
        address_quota=quota - quota // 16 if quota else None,  # keep a margin below the crash point
        reserve_churn_limit=profile.churn_limit,
        fence_granularity="device" if profile.wddm else "reservation",
    )


class _RealDriverFactory:
    """Builds the real driver wrapper on first use; ``check`` only imports the bindings."""

    def __init__(self, vendor: str | None):
        self.vendor = vendor or "cuda"

    def check(self) -> None:
        if self.vendor == "hip":
            from hip import hip  # noqa: F401
        else:
            import cuda.bindings.driver  # noqa: F401

    def __call__(self) -> GpuDriver:
        if self.vendor == "hip":
            from ..drivers.hip import HipDriver

            return HipDriver()
        from ..drivers.cuda import CudaDriver

        return CudaDriver()

"""``VmmBackend``: the contract's verbs over a driver, composed of the parts its platform's capabilities choose
(:mod:`.parts`). The package docstring is the whole story."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Mapping

from ..._version import __version__
from ..._drivers.gpu import EventToken, GpuDriver
from ..._drivers.open import LazyDriver, machine_for, resolve_vendor
from ...hookspec import hookimpl
from ...platform import GENERIC, Headroom, Platform
from ...types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    DriverState,
    Fault,
    Machine,
    Reservation,
    format_size,
)
from .devices import DescriptorRoom, Devices
from .ledger import HandleLedger
from .parts import Parts, choose_parts
from .pool import PoolBudget, RoomSplit
from .state import DeviceState, PageTable
from .windows import KeptWindows, WindowBooks


class VmmBackend:
    """See the package docstring. ``driver`` is a :class:`GpuDriver` (initialised on first use), or None with
    ``driver_factory`` to open one lazily; ``capabilities``, ``headroom`` and ``page_size`` replace the platform's
    own (for tests and comparisons). ``machine`` (a function returning the :class:`~membackend.types.Machine`,
    asked once, on first use of a device) says which devices run under WDDM where ``page_in_sync`` is ``wddm``;
    without it this process's OS and the driver's answer decide. ``platform_values`` (a
    :class:`~membackend.platform.PlatformValues`) are the values of the settings the platform declares, handed to
    its probe, headroom and capabilities functions (None: their defaults; :meth:`from_settings` reads them).
    Assigning ``capabilities`` chooses the parts again (kept windows and the large frees spent stay); do it
    before the backend serves a device. The headroom has one owner, the session (the package docstring)."""

    def __init__(self, platform: Platform = GENERIC, driver: GpuDriver | None = None, *,
                 capabilities: Capabilities | None = None, headroom: int | None = None,
                 page_size: int | None = None, driver_factory: LazyDriver | None = None,
                 machine: Callable[[], Machine] | None = None, platform_values: Any = None):
        self.platform = platform
        self.name = platform.name
        self.version = platform.version or __version__
        self.platform_values = platform_values if platform_values is not None else platform.default_values()
        capabilities = capabilities or platform.capabilities_for(self.platform_values)
        self._headroom = headroom  # None: the platform's own, per device
        self._headrooms: Mapping[Device, Headroom] | None = None  # the session's (use_headroom); None: own
        self.requested_page_size = page_size or platform.page_size
        vendor = driver.vendor if driver is not None else getattr(driver_factory, "vendor", None)
        if vendor is None:
            raise ValueError("VmmBackend needs a driver or a driver_factory")
        self.device_kinds = (vendor,)
        self._lock = threading.RLock()  # guards the devices' state, the parts' books and the churn accounting
        self._devs = Devices(self.name, vendor, self.requested_page_size, driver, driver_factory, machine, self._lock)
        self._devices = self._devs.states
        self._budget = PoolBudget(platform.budget_source, lambda: self.driver, self._devs.facts.machine)
        self._window_books = WindowBooks()
        self._generation = itertools.count(1)
        self.capabilities = capabilities

    @property
    def capabilities(self) -> Capabilities:
        """What the platform tells the mechanism (and the policy); the parts are chosen from it."""
        return self._capabilities

    @capabilities.setter
    def capabilities(self, capabilities: Capabilities) -> None:
        self._capabilities = capabilities
        self._parts = self._choose_parts(capabilities)
        self._devs.configure(capabilities, self._parts.self_test, self._parts.descriptors)

    def _choose_parts(self, capabilities: Capabilities) -> Parts:
        """The parts for ``capabilities`` (:func:`.parts.choose_parts`); a model of another mechanism (the
        replays' stock comfy-aimdo) replaces some."""
        return choose_parts(capabilities, self._devs, self._budget, self._window_books, self._room, self._generation)

    def own_headroom(self, device: Device, total: int) -> tuple[int, str]:
        """This backend's own headroom on ``device`` of ``total`` bytes, and its source in words: the
        ``headroom`` override given to the constructor, else the platform's rule with its declared
        settings. The lowest level of ``Session.headroom_in_force``."""
        if self._headroom is not None:
            return self._headroom, f"backend {self.name}'s own rule (an override of {format_size(self._headroom)})"
        integrated = self._devs.integrated(device.index)
        return (self.platform.headroom_for(total, self.platform_values, integrated=integrated),
                self.platform.headroom_source(self.platform_values))

    def use_headroom(self, headrooms: Mapping[Device, Headroom] | None,
                     instead_of: Mapping[Device, Headroom] | None = None) -> None:
        """Read the headroom in force from ``headrooms[device]`` (the session's ``Headroom``s; None: back to
        :meth:`own_headroom`) for every budget and the unified pool's up-front refusal; with ``instead_of``,
        only while that is the one used (``hookspec.OptionalMembers.use_headroom``: the latest session's)."""
        with self._lock:
            if instead_of is None or self._headrooms is instead_of:
                self._headrooms = headrooms

    def _room(self, index: int, total: int) -> int:
        """The headroom in force on device ``index`` of ``total`` bytes (see :meth:`use_headroom`)."""
        device = Device(self.device_kinds[0], index)
        headrooms = self._headrooms  # the Headroom computes the precedence: nothing calls back up
        return headrooms[device].in_force(total)[0] if headrooms is not None else self.own_headroom(device, total)[0]

    @property
    def headroom(self) -> int | Any:
        """The fixed headroom, or the platform's rule (a function of the device total)."""
        return self._headroom if self._headroom is not None else self.platform.headroom

    @classmethod
    def from_settings(cls, settings: Any, platform: Platform = GENERIC) -> "VmmBackend":
        """Over the driver the settings pick (a simulated profile's twin, or the real bindings), opened on first
        use; the generic platform takes the vendor of the torch build or the profile. The platform's declared
        settings are read here, from the sources ``settings`` were read from (``Platform.setting_values``: a bad
        value raises ``ConfigError``). The ``headroom`` setting is not the backend's: the session applies it."""
        vendor = resolve_vendor(platform.vendor, settings)
        values = platform.setting_values(settings)
        return cls(platform, driver_factory=LazyDriver(vendor, settings.sim_profile),
                   machine=lambda: machine_for(settings), platform_values=values)

    @property
    def driver(self) -> GpuDriver:
        """The driver, opened and initialised on first use."""
        return self._devs.driver

    @property
    def _driver(self) -> GpuDriver | None:
        """The driver once opened (initialised or not); None before a factory's is opened."""
        return self._devs.opened

    def _use(self, index: int) -> DeviceState:
        """Make device ``index`` current and return its state (:meth:`.devices.Devices.use`)."""
        return self._devs.use(index)

    def fence_token(self, reservation: Reservation, stream: Any) -> EventToken:
        """An event recorded on ``stream`` after work that touches ``reservation``; give it to
        ``Session.record`` so frees and releases wait for that work (G2)."""
        return self._devs.fence_token(reservation.handle.index, stream)

    def page_size_on(self, device: Device) -> int:
        """The page this backend maps on ``device``: its page size (the platform's, or the one it was given)
        rounded up to the device's mapping granularity; every reservation there has it as ``page_size``."""
        index = self._devs.index_of(device)
        with self._lock:
            return self._use(index).page_size

    def tensor_device(self, device: Device) -> str:
        """The torch device that reads this backend's pages: ``cuda:N``, or ``cpu`` where the driver's
        device memory is memory of this process the CPU addresses directly (``GpuDriver.cpu_addressable``)."""
        return "cpu" if self.driver.cpu_addressable else f"cuda:{self._devs.index_of(device)}"

    def host_unregister(self, address: int) -> bool:
        """Ends the page-locking of the host range registered at ``address`` with the vendor's driver (as torch's
        ``cudaHostRegister`` makes one): True when one started there (``hookspec.OptionalMembers.host_unregister``:
        called before that memory is unmapped, so no later mapping there is copied from the old, locked pages)."""
        return self.driver.host_unregister(address)

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        c = self.platform.probe_for(machine, self.platform_values)
        if not isinstance(c, Candidate):
            raise TypeError(f"platform {self.name!r} probe returned {c!r}, not a Candidate")
        return self._devs.with_driver(c)

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._devs.index_of(device)
        with self._lock:
            state = self._use(index)
            ps = state.page_size
            rounded = -(-size // ps) * ps
            base, span = self._parts.windows.window_for(device, rounded, ps)
            state.reserved += span
            rng = PageTable(index, rounded // ps, span)
            state.ranges[rng] = ps
        return Reservation(device, base, rounded, ps, self.name, handle=rng, requested=size)

    @hookimpl
    def membackend_fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        rng: PageTable = reservation.handle
        ps = reservation.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if rng.ready.find(0, first, last) == -1:  # hot path: all resident, no driver call
            return Fault(True, tuple(rng.generations[first:last]), first, 0)
        with self._lock:
            return self._parts.pages.fault(reservation, rng, first, last)

    @hookimpl
    def membackend_free(self, reservation: Reservation, offset: int, size: int) -> int:
        ps = reservation.page_size
        with self._lock:
            return self._parts.pages.drop(reservation, offset // ps, (offset + size - 1) // ps + 1)

    @hookimpl
    def membackend_release_reservation(self, reservation: Reservation) -> int:
        rng: PageTable = reservation.handle
        with self._lock:
            dropped = self._parts.pages.drop(reservation, 0, reservation.pages, releasing=True)
            state = self._use(rng.index)
            self._parts.handles.release_with_range(state, rng)
            try:
                self._parts.windows.give_back(reservation.device, reservation.base, rng.window)
            except DriverError as exc:
                exc.dropped = dropped
                raise
            state.reserved -= rng.window
            state.ranges.pop(rng, None)
        return dropped

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        """The device fence synchronizes the device; a reservation's fence (its tokens already waited for by
        the session) does only where fresh mappings may still be paging in (``page_in_sync``)."""
        self._devs.fence(self._devs.index_of(device), whole_device=reservation is None)

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._devs.index_of(device)
        with self._lock:
            state = self._use(index)
            total, free, source = self._budget.read(index, state)
            room = self._room(index, total)
            free = self._parts.handles.counted_free(state, free, room)
            guard = self._parts.one_pool
            unified = (guard is not None and guard.applies(state)) or state.integrated
        return Budget.of(total, free, room, source, unified=unified)

    def room_split(self, device: Device) -> RoomSplit:
        """The device's memory split (:class:`RoomSplit`): one read of the platform's budget source, the headroom
        in force and this backend's own handles, under its lock. Drops no kept handle (unlike the budget query)."""
        index = self._devs.index_of(device)
        with self._lock:
            state = self._use(index)
            total, free, source = self._budget.read(index, state)
            return RoomSplit.measured(total, free, self._room(index, total), state, source)

    @hookimpl
    def membackend_close(self) -> None:
        """Release the primary contexts the driver wrapper retained (two GPUs: each one's)."""
        close = getattr(self._driver, "close", None)
        if close is not None:
            close()

    @hookimpl
    def membackend_trim(self, device: Device) -> int:
        """The idle give-back: release the handles kept for reuse and free the kept windows on ``device`` (under
        a reserve-churn limit only what the churn allowance permits: :mod:`.churn`; what stays is reported by
        :meth:`kept_windows`); returns the bytes. The session calls it on close, the residency manager after a
        full unload of everything and at idle (``ResidencyManager.on_idle``: "prompt queue empty")."""
        index = self._devs.index_of(device)
        with self._lock:
            state = self._devices.get(index)
            if state is None or not (state.spare or self._parts.windows.pooled(index)):
                return 0
            self._use(index)
            return self._parts.handles.trim(state) + self._parts.windows.trim(device)

    def trim(self, device: Device) -> int:
        """Same as :meth:`membackend_trim` (kept for callers that hold the backend)."""
        return self.membackend_trim(device)

    def descriptor_room(self, device: Device) -> DescriptorRoom | None:
        """What ``device`` can map under the descriptor limit (:meth:`.devices.Devices.descriptor_room`)."""
        return self._devs.descriptor_room(device)

    def kept_windows(self, device: Device) -> KeptWindows | None:
        """What stays reserved on ``device`` after its reservations were released (None: the platform has
        no reserve-churn limit, so nothing is kept). Thread-safe; asks no driver."""
        windows = self._parts.windows
        if not windows.keeps:
            return None
        self._devs.index_of(device)
        with self._lock:
            return windows.kept_windows(device)

    @hookimpl
    def membackend_inspect(self, device: Device) -> DriverState | None:
        """What ``device`` holds for this backend, as a :class:`~membackend.types.DriverState`; never None: the
        driver's own tables where it keeps them (the simulated drivers), else this backend's handle ledger
        checked against the driver (:meth:`handle_ledger`; :mod:`.ledger` says what each figure is). Raises
        only what the driver raises for a simulated table."""
        return self._devs.inspect(device, self._parts.windows.pooled)

    def handle_ledger(self, device: Device) -> HandleLedger:
        """This backend's own account of ``device`` (:class:`~.ledger.HandleLedger`), checked against the
        driver's mem-get-info where the device holds anything: the ledger's figures are taken under the
        backend's lock, the driver is asked after (one call, outside the lock). A failed query leaves the check
        unmade, with the driver's error as the reason: the ledger's own figures stand."""
        return self._devs.ledger(device, self._parts.windows.pooled)

    @hookimpl
    def membackend_inject_failures(self, probability: float, seed: int) -> Any:
        """Random failures of the driver's VMM calls, where the driver can inject them (simulations)."""
        return self.driver.inject_failures(probability, seed)

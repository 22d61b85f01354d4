"""The driver of one backend and the devices it serves.

The driver is opened (a factory's, where the backend was built without one) and initialised on first use.
Each device is set up on its first use: its page size (a multiple of the driver's allocation granularity,
never below the platform's ``map_granularity``: RDNA4 reports 4 KiB, its kernels need 2 MiB), the descriptor
limit raised where handles hold descriptors (:mod:`.descriptors`), the VMM self-test where the platform asks
for one (:mod:`.selftest`), and its facts (:mod:`.facts`). Every later use
makes the device current. Besides, what a device answers without the parts: its fences and what it holds.
"""

from __future__ import annotations

import threading
from typing import Callable

from ..._drivers.gpu import EventToken, GpuDriver
from ..._drivers.open import LazyDriver
from ...types import Candidate, Capabilities, Device, DriverState, Machine, Score, WrongDevice
from .descriptors import DescriptorRoom, HandleDescriptors
from .facts import DeviceFacts
from .ledger import HandleLedger, driver_tables
from .selftest import VmmSelfTest
from .state import DeviceState


class Devices:
    """The devices of one backend (``name``, serving ``kind`` devices) with pages of at least ``page_size``
    bytes: ``driver``, or ``driver_factory`` to open one lazily (under ``lock``, the backend's); ``machine``
    as :class:`~.facts.DeviceFacts` takes it. :meth:`configure` hands it the capabilities and the self-test
    in force."""

    def __init__(self, name: str, kind: str, page_size: int, driver: GpuDriver | None,
                 driver_factory: LazyDriver | None, machine: Callable[[], Machine] | None, lock: threading.RLock):
        self.name = name
        self.kind = kind
        self.page_size = page_size
        self.opened = driver  # None until a factory's driver is opened
        self._driver_factory = driver_factory
        self._initialised = False
        self._lock = lock
        self.states: dict[int, DeviceState] = {}
        self.facts = DeviceFacts(name, kind, lambda: self.driver, machine)
        self._capabilities = Capabilities()
        self._self_test: VmmSelfTest | None = None
        self._descriptors: HandleDescriptors | None = None

    def configure(self, capabilities: Capabilities, self_test: VmmSelfTest | None,
                  descriptors: HandleDescriptors | None = None) -> None:
        """What a device's first use follows from now on (devices already set up keep theirs): the self-test,
        and the descriptor budget's start, which runs first (the self-test's handle needs a descriptor)."""
        self._capabilities = capabilities
        self._self_test = self_test
        self._descriptors = descriptors

    @property
    def driver(self) -> GpuDriver:
        """The driver, opened and initialised on first use."""
        driver = self.opened
        if driver is None or not self._initialised:
            with self._lock:
                if self.opened is None:
                    self.opened = self.factory()()
                driver = self.opened
                if not self._initialised:
                    driver.init()
                    self._initialised = True
        return driver

    def factory(self) -> LazyDriver:
        """The driver factory of a backend built without a driver (the backend refuses one with neither)."""
        factory = self._driver_factory
        assert factory is not None, "a VmmBackend has a driver or a driver factory"
        return factory

    def with_driver(self, candidate: Candidate) -> Candidate:
        """The platform's ``candidate`` as this backend's, with what the driver adds: a fit is no fit where the
        driver's bindings are missing (the reason says which), and a simulated driver is said."""
        driver = self.opened
        if candidate.score > Score.NONE and driver is None:
            missing = self.factory().missing()
            if missing:
                return Candidate(self.name, Score.NONE, missing)
        reason = candidate.reason
        if driver.simulated if driver is not None else self.factory().simulated:
            reason = f"{reason} [simulated driver]"
        return Candidate(self.name, candidate.score, reason, candidate.opt_in)

    def index_of(self, device: Device) -> int:
        """``device``'s index; ``WrongDevice`` for a kind the backend does not serve."""
        if device.kind != self.kind:
            raise WrongDevice(f"backend {self.name!r} serves {self.kind} devices, not {device}")
        return device.index

    def use(self, index: int) -> DeviceState:
        """Make device ``index`` current and return its state (set up on first use: ``WrongDevice`` for an
        index the machine does not have, the self-test's ``DriverError`` for a device it refuses)."""
        d = self.driver
        state = self.states.get(index)
        if state is None:
            if not 0 <= index < d.device_count():
                raise WrongDevice(f"{self.kind}:{index} does not exist; this machine has {d.device_count()} device(s)")
            d.set_device(index)
            g = max(d.granularity(index), self._capabilities.map_granularity or 1)  # RDNA4: 4 KiB told, 2 MiB
            page = max(g, -(-self.page_size // g) * g)
            if self._descriptors is not None:
                self._descriptors.start(page)
            if self._self_test is not None:
                self._self_test.check(index, page)
            state = self.states[index] = DeviceState(
                g, page, self.facts.syncs_page_ins(index, self._capabilities.page_in_sync), self.facts.integrated(index))
        else:
            d.set_device(index)
        return state

    def descriptor_room(self, device: Device) -> DescriptorRoom | None:
        """What ``device`` can map under the process's descriptor limit now (:mod:`.descriptors`); None where
        handles hold no descriptor or the device was not used yet. Counts the process's descriptors, makes no
        driver call."""
        index = self.index_of(device)
        with self._lock:
            state, part = self.states.get(index), self._descriptors
            return None if part is None or state is None else part.room(str(device), state)

    def integrated(self, index: int) -> bool:
        """Whether device ``index`` shares one pool with the host: as found on its first use, else asked now."""
        state = self.states.get(index)
        return state.integrated if state is not None else self.facts.integrated(index)

    def address_held(self) -> int:
        """Address space the devices hold besides kept windows: live reservations and resident pages."""
        return sum(s.reserved + s.resident for s in self.states.values())

    def fence(self, index: int, whole_device: bool) -> None:
        """Synchronize device ``index`` when ``whole_device`` or where fresh mappings may still be paging in
        (``page_in_sync``) since its last synchronize."""
        with self._lock:
            state = self.use(index)
            if whole_device or (state.dirty and state.page_in_sync):
                self.driver.device_synchronize()
                state.dirty = False

    def fence_token(self, index: int, stream: object) -> EventToken:
        """An event recorded on ``stream`` of device ``index``."""
        with self._lock:
            self.use(index)
            event = self.driver.event_create()
            self.driver.event_record(event, stream)
        return EventToken(self.driver, event, index)

    def inspect(self, device: Device, windows: Callable[[int], int]) -> DriverState:
        """What ``device`` holds, with ``windows(index)`` the bytes of released windows it keeps: the driver's
        tables where it keeps them, else the handle ledger (:mod:`.ledger`)."""
        index = self.index_of(device)
        with self._lock:
            raw = self.driver.inspect(index)  # "calls": a mapping of the simulation's
            kept = windows(index)
        if raw is None:
            return self.ledger(device, windows).state()
        return driver_tables(raw, kept, self.driver.label)

    def ledger(self, device: Device, windows: Callable[[int], int]) -> HandleLedger:
        """The handle ledger of ``device``: its figures under the lock, the driver asked after (one call)."""
        index = self.index_of(device)
        with self._lock:
            state = self.states.get(index)
            if state is None:  # never used: nothing created, and no reason to wake the device
                return HandleLedger(device, 0, 0, 0, 0, 0, None, None, "", 0, "nothing created on the device yet")
            figures = (state.reserved, state.resident, state.kept_bytes(), windows(index), state.granularity)
        return HandleLedger.asking(self.driver, device, *figures)

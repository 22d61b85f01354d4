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
* free: the session has already waited for the fence tokens recorded on the
  range; the device is synchronized only where the platform's
  ``page_in_sync`` says the driver pages fresh mappings in behind the
  process's back (WDDM: ComfyUI #16246), and then only if pages were mapped
  since the last synchronize, or before every unmap when the platform's
  fence granularity is ``device``; then unmap and release each page, or keep
  the physical handle (bounded) for the next fault when ``recycle_handles``;
* release: free every page, then return the address range; under a
  reserve-churn limit a large window is kept for the next reserve that fits
  instead (see below);
* trim: give back kept handles and windows (the session calls it on close,
  the residency manager after a full unload of everything and at idle:
  ``ResidencyManager.on_idle``, which the ComfyUI adapter calls when the
  prompt queue empties);
* fence: recorded work arrives as :class:`~membackend._drivers.gpu.EventToken`
  from :meth:`VmmBackend.fence_token` (the session waits for those); a
  device-wide fence synchronizes the device;
* budget: the platform's budget source (``device``, ``wddm``, ``unified``)
  minus the headroom in force: the session's decision once a session follows
  this backend (:meth:`VmmBackend.follow_headroom`), else the platform's own
  rule (:meth:`VmmBackend.own_headroom`); the up-front refusal on a unified
  pool uses the same value;
* inspect: the driver's own tables where it has them (the simulated drivers);
  on a real driver, this backend's own handle ledger checked against the
  driver's free figure (:class:`HandleLedger`);
* inject_failures: random driver failures, where the driver offers them
  (the simulated drivers do).

**Under a reserve-churn limit** (Windows ROCm: large reserves fail once the
process has freed enough large windows, rocm-systems #6191) a released window
of at least ``reserve_churn_window`` bytes is kept on its device and reused by
the next large reserve it holds. Frees of large windows are counted; the
backend spends at most the limit minus :data:`CHURN_MARGIN` of them (the
*allowance*), on keeping each device's kept windows within its bound (at
release: the smallest go, the larger hold more models) and on trim (idle,
unload of everything, close: every kept window goes back while the
allowance permits; when only some may go, the smallest go and the largest
stay). The bound is the platform's ``reserve_churn_keep`` windows per device
(strict: large reservations alive count against the frees they will need),
or, where the platform sets none, :data:`KEPT_WINDOWS_PER_DEVICE` or more
where the device had more large reservations alive at once. The allowance
*permits* a free when one is left and, after it, the frees left still cover
every device's large windows (alive and kept) past its bound; so the bound
is kept by construction: a fresh large reserve that could never be brought
back within it is refused with :class:`AddressWindowsExhausted` (a
``MemoryError``, so an out-of-memory, never a ``DriverError``), as is one the
driver itself refuses for want of memory (frees this backend did not see,
e.g. another library in the process, may have spent the limit). A fresh
window after which no free would be left to spare is reserved as large as
the largest the device has served, so the windows that stay once the frees
are spent hold every model the device ran before (one at a time, under a
bound of one). :meth:`VmmBackend.kept_windows` reports the windows, their
bytes, the bound, the frees spent and why they stay (``membackend doctor``
prints it).

The right device is made current before every call that touches one. Calls
on different reservations may arrive from several threads (the session
serialises calls on one reservation): one lock guards the per-device state
and the churn accounting.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
from array import array
from dataclasses import dataclass
from typing import Any, Callable

from .._version import __version__
from .._drivers.gpu import EventToken, GpuDriver
from .._drivers.open import LazyDriver, machine_for, resolve_vendor
from ..hookspec import hookimpl
from ..platform import CHURN_MARGIN, GENERIC, KEPT_WINDOWS_PER_DEVICE, Platform
from ..types import (
    AddressSpaceExhausted,
    AddressWindowsExhausted,
    Budget,
    Candidate,
    Capabilities,
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

log = logging.getLogger(__name__)

__all__ = ["VmmBackend", "AddressSpaceExhausted", "AddressWindowsExhausted", "KeptWindows", "RoomSplit",
           "KEPT_WINDOWS_PER_DEVICE", "CHURN_MARGIN"]

MiB, GiB = 1 << 20, 1 << 30
NOT_READY_RETRIES = 3  # a map or set-access answering "not ready" is retried after a fence this often


@dataclass(frozen=True)
class RoomSplit:
    """Where one device's memory goes under the headroom in force (:meth:`VmmBackend.room_split`), in bytes.

    * ``total``, ``free``: the platform's budget source (``source``), as every budget reads it;
    * ``headroom``: the headroom in force (``--reserve-vram``, ``--vram-headroom``, a live cap, the setting or
      the platform's rule); ``room = max(0, total - headroom)``: what the process may hold on the device;
    * ``held``: what membackend's own handles hold (resident pages and kept handles);
    * ``other = max(0, total - free - held)``: everything else the driver counts as used: the process's other
      use (its context, its runtime allocator: activations, cast buffers) and, where the source cannot tell
      processes apart (a device's mem-get-info), other processes' too;
    * ``weights_room = max(0, room - other)``: what the weights may hold, never counting the process's own
      use twice; ``resident``: the weights' pages resident now (``held`` less kept handles).

    The budget's ``usable`` is ``weights_room - held`` clamped at 0 (kept handles count as free to it)."""

    total: int
    free: int
    headroom: int
    room: int
    held: int
    other: int
    weights_room: int
    resident: int
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {"total": self.total, "free": self.free, "headroom": self.headroom, "room": self.room,
                "held": self.held, "other": self.other, "weights_room": self.weights_room,
                "resident": self.resident, "source": self.source}


@dataclass(frozen=True)
class KeptWindows:
    """What a backend under a reserve-churn limit keeps reserved on one device after release.

    ``windows``/``bytes``: released address windows kept for reuse (charged to
    the process's commit on Windows ROCm), ``largest`` the largest of them;
    ``bound``: the most that stay kept on the device once no large free is
    left (the platform's ``reserve_churn_keep``; where it sets none,
    :data:`KEPT_WINDOWS_PER_DEVICE` or the most large reservations the device
    had alive at once), ``bound_rule`` how it is set, in words;
    ``large_frees_spent`` of ``large_frees_allowed`` (the platform's
    ``churn_limit`` minus :data:`CHURN_MARGIN`), process-wide for this backend
    (frees made by other code in the process are not seen);
    ``give_back``: how many of the windows a trim now would free (the churn
    allowance permitting), ``can_give_back`` whether it is any;
    ``reason``: why the windows are kept, in words (for the doctor, the
    status and logs). Figures of one moment, taken under the backend's lock.
    """

    device: Device
    windows: int
    bytes: int
    largest: int
    bound: int
    large_frees_spent: int
    large_frees_allowed: int
    churn_limit: int
    can_give_back: bool
    give_back: int = 0
    bound_rule: str = ""
    reason: str = ""

    def describe(self) -> str:
        """One line for the doctor and logs."""
        if not self.windows:
            kept = "no address window kept"
        else:
            kept = f"{self.windows} address window(s) kept, {format_size(self.bytes)} ({self.reason})"
        return (f"{self.device}: {kept}; at most {self.bound} stay once no large free is left ({self.bound_rule}); "
                f"large frees {self.large_frees_spent} of {self.large_frees_allowed} spent (large reserves fail "
                f"after {self.churn_limit}, rocm-systems #6191)")


@dataclass(frozen=True)
class HandleLedger:
    """What one device holds for a :class:`VmmBackend`, from its own handle ledger, checked against the driver.

    A real CUDA or HIP driver keeps no table a process can read (the simulated drivers do), so the backend
    counts what it made: ``reserved``, the address space of its live reservations (whole windows);
    ``resident``, the bytes of physical handles mapped into them; ``kept``, the bytes of handles it created,
    unmapped and still holds for reuse (recycled with the device, or kept with a live range where memory
    returns only when the range is freed); ``windows``, released address windows kept for reuse (address
    space, no memory). ``committed`` (``resident + kept``) is device memory the driver must count as used;
    ``held`` (``kept + windows``) is what a trim gives back.

    **The check is one-sided.** ``total`` and ``free`` are the driver's own figures for the whole device
    (``source`` names the call): every process's use, this one's context and its runtime allocator (torch's
    cache) included. So the driver's ``total - free`` is at least ``committed`` when the ledger is true;
    more is normal and says nothing. Less, by more than ``granularity`` (the driver's rounding), is
    what the driver cannot account for: ``unaccounted`` bytes, and :meth:`state` says so instead of
    vouching for the ledger. Causes: handles the driver never charged to the device (an APU whose free
    figure is its host's, above its own total; WDDM demoting video memory to system memory), or a
    ledger that counts handles already gone. Nothing is checked when the ledger holds no memory, or the
    query failed (``note`` says why)."""

    device: Device
    reserved: int
    resident: int
    kept: int
    windows: int
    granularity: int
    total: int | None
    free: int | None
    source: str
    unaccounted: int
    note: str = ""

    @classmethod
    def checked(cls, device: Device, reserved: int, resident: int, kept: int, windows: int, granularity: int,
                total: int, free: int, source: str) -> "HandleLedger":
        """The ledger's figures checked against the driver's ``total`` and ``free`` (see the class)."""
        committed = resident + kept
        in_use = max(0, total - free)  # an APU may report free above its own total: nothing in use then
        short = committed - in_use
        unaccounted = short if short > granularity else 0
        if unaccounted:
            note = (f"{source} cannot account for {_gib(unaccounted)} of the {_gib(committed)} committed: the "
                    f"device has {_gib(in_use)} in use, every process included")
        else:
            note = f"{source}: {_gib(in_use)} in use on the device, every process included, holds it"
        return cls(device, reserved, resident, kept, windows, granularity, total, free, source, unaccounted, note)

    @property
    def committed(self) -> int:
        return self.resident + self.kept

    @property
    def held(self) -> int:
        return self.kept + self.windows

    def state(self) -> DriverState:
        """The :class:`DriverState` ``membackend_inspect`` returns: the ledger's figures, the check in ``source``
        (``committed`` None on Windows, where the platform charges the process's private commit)."""
        return DriverState(reserved=self.reserved, resident=self.resident, held=self.held,
                           source=f"membackend's handle ledger ({self.note})",
                           committed=None if sys.platform == "win32" else self.committed)


def _gib(n: int) -> str:
    return format_size(n)  # as membackend writes every size


class _Range:
    """Per-reservation page table.

    ``handles[p]`` is the physical handle mapped at page p (None: nothing
    mapped, the page is not resident); ``ready[p]`` is 1 once access is set
    too. A page can be mapped but not ready when a failed fault could not be
    rolled back: it counts as resident, and the next fault finishes it.
    """

    __slots__ = ("index", "window", "handles", "ready", "generations", "spare")

    def __init__(self, index: int, pages: int, window: int):
        self.index = index
        self.window = window  # bytes of address space behind it (a reused window may be larger)
        self.handles: list[Any] = [None] * pages
        self.ready = bytearray(pages)
        self.generations = array("Q", bytes(8 * pages))
        # handles unmapped from this range and kept with it where memory returns only when the range is freed
        # (``memory_returns_on_unmap`` false): its own next faults map them, its release gives them back
        self.spare: list[Any] = []


class _DeviceState:
    __slots__ = ("granularity", "page_size", "page_in_sync", "dirty", "reserved", "resident", "spare", "windows",
                 "large_alive", "large_peak", "largest", "keep", "integrated", "ranges")

    def __init__(self, granularity: int, page_size: int, page_in_sync: bool, integrated: bool = False,
                 keep: int | None = None):
        self.granularity = granularity
        self.integrated = integrated  # one pool with the host (a device fact: asked once, not per budget)
        self.page_size = page_size
        self.page_in_sync = page_in_sync  # fresh mappings may still be paging in: synchronize before unmapping
        self.dirty = False  # pages mapped since the last device synchronize
        self.reserved = 0  # address space of live reservations (whole windows)
        self.resident = 0
        self.spare: list[Any] = []  # unmapped physical handles kept for reuse
        self.windows: list[tuple[int, int]] = []  # (base, size) of released large windows kept for reuse
        self.large_alive = 0  # live reservations on large windows (under a reserve-churn limit)
        self.large_peak = 0  # the most of those alive at once
        self.largest = 0  # the largest large window this device has served
        self.keep = keep  # the platform's strict bound (reserve_churn_keep); None: the peak rule
        # the live reservations' page tables with their page size: the handles kept with a range (``_Range.spare``)
        # belong to the handle ledger that ``membackend_inspect`` reports on a real driver
        self.ranges: dict[_Range, int] = {}

    @property
    def pooled(self) -> int:
        return sum(size for _, size in self.windows)

    @property
    def window_bound(self) -> int:
        """The most kept windows this device holds once no large free is left."""
        if self.keep is not None:
            return self.keep
        return max(KEPT_WINDOWS_PER_DEVICE, self.large_peak)

    def over_bound(self, more_alive: int = 0, fewer_kept: int = 0) -> int:
        """Large windows (alive and kept) past the bound, with ``more_alive`` more reservations alive and
        ``fewer_kept`` fewer windows kept: the frees it takes to bring the device back within its bound once
        every reservation is released. Under the platform's strict bound every large window counts; under
        the peak rule the ones alive never do (the bound grows to them)."""
        alive = self.large_alive + more_alive
        ceiling = self.keep if self.keep is not None else max(KEPT_WINDOWS_PER_DEVICE, self.large_peak, alive)
        return max(0, alive + len(self.windows) - fewer_kept - ceiling)


class VmmBackend:
    """See the module docstring. ``driver`` is a :class:`GpuDriver` (initialised on first use), or
    None with ``driver_factory`` to open one lazily; ``capabilities``, ``headroom`` and ``page_size``
    replace the platform's own (for tests and comparisons). ``machine`` (a function returning the
    :class:`~membackend.types.Machine`, asked once, on first use of a device) says which devices run under
    WDDM where ``page_in_sync`` is ``wddm``; without it this process's OS and the driver's answer decide.
    ``platform_values`` (a :class:`~membackend.platform.PlatformValues`) are the values of the settings
    the platform declares, handed to its probe, headroom and capabilities functions (None: their defaults;
    :meth:`from_settings` reads them).

    **The headroom has one owner, the session.** The backend never reads the ``headroom`` setting: its own
    rule (:meth:`own_headroom`: the ``headroom`` override, else the platform's) is the lowest level of the
    session's precedence, and the session that owns the backend hands it its decision
    (:meth:`follow_headroom`), which every budget and the up-front refusal of a unified pool then use."""

    def __init__(self, platform: Platform = GENERIC, driver: GpuDriver | None = None, *,
                 capabilities: Capabilities | None = None, headroom: int | None = None,
                 page_size: int | None = None, driver_factory: LazyDriver | None = None,
                 machine: Callable[[], Machine] | None = None, platform_values: Any = None):
        self.platform = platform
        self.name = platform.name
        self.version = platform.version or __version__
        self.platform_values = platform_values if platform_values is not None else platform.default_values()
        self.capabilities = capabilities or platform.capabilities_for(self.platform_values)
        self._headroom = headroom  # None: the platform's own, per device
        self._decide_headroom: Callable[[Device, int], int] | None = None  # the owning session's decision
        self.requested_page_size = page_size or platform.page_size
        self._driver = driver
        self._driver_factory = driver_factory
        self._devices: dict[int, _DeviceState] = {}
        self._self_test_failed: dict[int, DriverError] = {}  # per device whose VMM self-test failed
        self._generation = itertools.count(1)
        self._initialised = False
        self._lock = threading.RLock()
        self._machine = machine
        self._machine_facts: Machine | None = None
        self._large_frees = 0  # frees of windows >= reserve_churn_window, process-wide (what #6191 counts)
        self._churn_warned = False
        vendor = driver.vendor if driver is not None else getattr(driver_factory, "vendor", None)
        if vendor is None:
            raise ValueError("VmmBackend needs a driver or a driver_factory")
        self.device_kinds = (vendor,)

    def own_headroom(self, device: Device, total: int) -> tuple[int, str]:
        """This backend's own headroom on ``device`` of ``total`` bytes, and its source in words: the
        ``headroom`` override given to the constructor, else the platform's rule with its declared
        settings. The lowest level of ``Session.headroom_in_force``."""
        if self._headroom is not None:
            return self._headroom, f"backend {self.name}'s own rule (an override of {format_size(self._headroom)})"
        state = self._devices.get(device.index)
        integrated = state.integrated if state is not None else self._integrated(device.index)
        return (self.platform.headroom_for(total, self.platform_values, integrated=integrated),
                self.platform.headroom_source(self.platform_values))

    def follow_headroom(self, decide: Callable[[Device, int], int] | None,
                        instead_of: Callable[[Device, int], int] | None = None) -> None:
        """Take the headroom in force from ``decide(device, total)`` from now on: the session that owns
        this backend calls it when it is built, so the budget it reports and the up-front refusal of a
        unified pool keep the headroom the session decided (None: back to :meth:`own_headroom`). A backend
        follows one session: the latest one built on it. With ``instead_of``, only while that is the one
        followed now (a closing session lets go of the backend without undoing a newer session's hold)."""
        with self._lock:
            if instead_of is None or self._decide_headroom == instead_of:
                self._decide_headroom = decide

    def _room(self, index: int, total: int) -> int:
        """The headroom in force on device ``index`` of ``total`` bytes (see :meth:`follow_headroom`)."""
        device = Device(self.device_kinds[0], index)
        decide = self._decide_headroom
        return decide(device, total) if decide is not None else self.own_headroom(device, total)[0]

    @property
    def headroom(self) -> int | Any:
        """The fixed headroom, or the platform's rule (a function of the device total)."""
        return self._headroom if self._headroom is not None else self.platform.headroom

    @classmethod
    def from_settings(cls, settings: Any, platform: Platform = GENERIC) -> "VmmBackend":
        """Over the driver the settings pick (a simulated profile's twin, or the real bindings), opened
        on first use; the generic platform takes the vendor of the torch build or the profile. The
        platform's declared settings are read here, from the sources ``settings`` were read from
        (``Platform.setting_values``: a bad value raises ``ConfigError``). The ``headroom`` setting is not
        the backend's: the session applies it (``Session.headroom_in_force``)."""
        vendor = resolve_vendor(platform.vendor, settings)
        values = platform.setting_values(settings)
        return cls(platform, driver_factory=LazyDriver(vendor, settings.sim_profile),
                   machine=lambda: machine_for(settings), platform_values=values)

    # ------------------------------------------------------------------ driver access

    @property
    def driver(self) -> GpuDriver:
        driver = self._driver
        if driver is None or not self._initialised:
            with self._lock:
                if self._driver is None:
                    self._driver = self._factory()()
                driver = self._driver
                if not self._initialised:
                    driver.init()
                    self._initialised = True
        return driver

    def _use(self, index: int) -> _DeviceState:
        """Make device ``index`` current and return its state (created on first use)."""
        d = self.driver
        state = self._devices.get(index)
        if state is None:
            if not 0 <= index < d.device_count():
                raise WrongDevice(f"{self.device_kinds[0]}:{index} does not exist; "
                                  f"this machine has {d.device_count()} device(s)")
            d.set_device(index)
            g = max(d.granularity(index), self.capabilities.map_granularity or 1)  # RDNA4: 4 KiB told, 2 MiB
            page = max(g, -(-self.requested_page_size // g) * g)
            if self.capabilities.vmm_self_test:
                failed = self._self_test_failed.get(index)
                if failed is not None:  # tested once per device: the answer stands
                    raise failed
                try:
                    self._self_test(index, page)
                except DriverError as exc:
                    self._self_test_failed[index] = exc
                    raise
            state = self._devices[index] = _DeviceState(g, page, self._syncs_page_ins(index), self._integrated(index),
                                                        keep=self.capabilities.reserve_churn_keep)
        else:
            d.set_device(index)
        return state

    def _self_test(self, index: int, page: int) -> None:
        """Reserve, create, map, set access, unmap, release and free one page of device ``index``; a failed
        step raises ``DriverError`` saying the device is not served (whatever was made is undone)."""
        d = self.driver
        base = handle = None
        mapped = False
        try:
            base = d.address_reserve(page, page)
            handle = d.create(page, index)
            d.map(base, page, handle)
            mapped = True
            d.set_access(base, page, index)
            d.unmap(base, page)
            mapped = False
            d.release(handle)
            handle = None
            d.address_free(base, page)
            base = None
        except DriverError as exc:
            raise DriverError(exc.code, exc.call, f"the start-up self-test of virtual memory management on "
                                                  f"{self.device_kinds[0]}:{index} failed, so {self.name} does "
                                                  "not serve the device") from exc
        finally:  # what a failed step left: undone, newest first
            if mapped:
                self._undo_quietly(d.unmap, base, page)
            if handle is not None:
                self._undo_quietly(d.release, handle)
            if base is not None:
                self._undo_quietly(d.address_free, base, page)

    def _undo_quietly(self, call: Callable[..., None], *args: Any) -> None:
        try:
            call(*args)
        except DriverError:
            log.warning("membackend: %s: undoing the self-test's %s failed", self.name, call.__name__)

    def _integrated(self, index: int) -> bool:
        """Whether device ``index`` shares one pool with the host; a driver that cannot say: not known to."""
        try:
            return bool(self.driver.integrated(index))
        except DriverError:
            return False

    def _syncs_page_ins(self, index: int) -> bool:
        """Whether frees on device ``index`` synchronize it after fresh mappings (``page_in_sync``).

        ``wddm``: yes where the device runs under WDDM, whose video memory
        manager pages memory in asynchronously: on Windows, unless the driver
        model is TCC (every other Windows driver model, WDDM and MCDM, is served
        by VidMm). The facts come from the machine where one was given (a
        simulated profile's too), else from this process's OS and the driver.
        """
        mode = self.capabilities.page_in_sync
        if mode != "wddm":
            return mode == "always"
        os_name, model = self._os_and_driver_model(index)
        return os_name == "windows" and model != "tcc"

    def _facts(self) -> Machine | None:
        """The machine facts (read once), or None where none were given or they could not be read."""
        if self._machine is not None and self._machine_facts is None:
            try:
                self._machine_facts = self._machine()
            except Exception as exc:  # the facts are advice: the process's own OS and driver decide instead
                log.warning("membackend: %s: machine facts unavailable (%s: %s); deciding from this process's OS "
                            "and driver", self.name, type(exc).__name__, exc)
                self._machine = None
        return self._machine_facts

    def _factory(self) -> LazyDriver:
        """The driver factory of a backend built without a driver (``__init__`` refuses one with neither)."""
        factory = self._driver_factory
        assert factory is not None, "a VmmBackend has a driver or a driver factory"
        return factory

    def _os_and_driver_model(self, index: int) -> tuple[str, str | None]:
        m = self._facts()
        if m is not None:
            info = next((i for i in m.devices if i.device == Device(self.device_kinds[0], index)), None)
            if info is not None and info.driver_model is not None:
                return m.os, info.driver_model
            os_name = m.os
        else:
            os_name = "windows" if sys.platform == "win32" else sys.platform
        if os_name != "windows":
            return os_name, None
        try:
            return os_name, self.driver.driver_model(index, os_name)
        except (DriverError, NotImplementedError, TypeError):  # unknown: WDDM is what Windows runs
            return os_name, None

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

    def page_size_on(self, device: Device) -> int:
        """The page this backend maps on ``device``: its page size (the platform's, or the one it was given)
        rounded up to the device's mapping granularity; every reservation there has it as ``page_size``."""
        index = self._device_index(device)
        with self._lock:
            return self._use(index).page_size

    def tensor_device(self, device: Device) -> str:
        """The torch device that reads this backend's pages: ``cuda:N``, or ``cpu`` where the driver's
        device memory is memory of this process the CPU addresses directly (``GpuDriver.cpu_addressable``)."""
        return "cpu" if self.driver.cpu_addressable else f"cuda:{self._device_index(device)}"

    def host_unregister(self, address: int) -> bool:
        """Ends the page-locking of the host range registered at ``address`` with the vendor's driver (as
        torch's ``cudaHostRegister`` makes one): True when one started there, False when none did. Called
        before that memory is unmapped: a registration outliving its mapping stays in the driver's tables, and
        a later mapping placed at those addresses is then copied from the old, locked pages."""
        return self.driver.host_unregister(address)

    @hookimpl
    def membackend_probe(self, machine: Machine) -> Candidate:
        c = self.platform.probe_for(machine, self.platform_values)
        if not isinstance(c, Candidate):
            raise TypeError(f"platform {self.name!r} probe returned {c!r}, not a Candidate")
        if c.score > Score.NONE and self._driver is None:
            missing = self._factory().missing()
            if missing:
                return Candidate(self.name, Score.NONE, missing)
        if self._driver.simulated if self._driver is not None else self._factory().simulated:
            c = Candidate(c.name, c.score, f"{c.reason} [simulated driver]", c.opt_in)
        return Candidate(self.name, c.score, c.reason, c.opt_in)

    @hookimpl
    def membackend_reserve(self, device: Device, size: int) -> Reservation:
        index = self._device_index(device)
        with self._lock:
            state = self._use(index)
            ps = state.page_size
            rounded = -(-size // ps) * ps
            large = self._is_large(rounded)
            window = self._pooled_window(state, rounded) if large else None
            if window is None:
                self._check_quota(device, rounded)
                span = rounded
                if large:
                    self._check_window_bound(device, state, rounded)
                    span = self._lasting_span(state, rounded)
                window = (self._reserve_window(device, span, ps, large), span)
            base, span = window
            state.reserved += span
            rng = _Range(index, rounded // ps, span)
            state.ranges[rng] = ps
            if self._is_large(span):
                state.large_alive += 1
                state.large_peak = max(state.large_peak, state.large_alive)
                state.largest = max(state.largest, span)
        return Reservation(device, base, rounded, ps, self.name, handle=rng, requested=size)

    def _reserve_window(self, device: Device, size: int, alignment: int, large: bool) -> int:
        """A fresh address window. Under a reserve-churn limit a large one the driver refuses for want of
        memory (the platform's limit reached by frees this backend did not see, or the system's commit
        limit: reservations are charged to commit) is out of memory, typed, with the driver's error as its
        cause; nothing is changed, so trim still gives kept windows back (G1)."""
        try:
            return self.driver.address_reserve(size, alignment)
        except DriverError as exc:
            if not (large and self.driver.is_oom(exc)):
                raise
            log.warning("membackend: %s: the driver refused a %d byte address window on %s (%s); answered as "
                        "out of memory", self.name, size, device, exc)
            raise self._refused(device, self._devices[device.index], size,
                                f"the driver refused a large address window ({exc}), as the platform does once "
                                f"the process has spent its large frees") from exc

    def _lasting_span(self, state: _DeviceState, size: int) -> int:
        """The bytes of a fresh large window of ``size``: ``size``, or the largest window the device has served
        when, with this window, no free is left to spare (the frees left only just cover every device's windows
        past its bound). Such a window may be one that stays once the frees are spent: sized so, it holds every
        model the device ran before, where one sized to a small model would leave the larger ones out of memory
        for the rest of the process. Never past the address quota (then ``size``)."""
        if state.largest <= size:
            return size
        over = sum(s.over_bound(1 if s is state else 0) for s in self._devices.values())
        if over < self._large_frees_left():
            return size
        quota = self.capabilities.address_quota
        if quota is not None:
            in_use = sum(s.reserved + s.resident + s.pooled for s in self._devices.values())
            if in_use + 2 * state.largest > quota:
                return size
        return state.largest

    def _check_window_bound(self, device: Device, state: _DeviceState, size: int) -> None:
        """Refuse a fresh large window that could never be given back within the devices' bounds: the
        frees left must cover every device's large windows past its bound (this one with the new window)."""
        over = sum(s.over_bound(1 if s is state else 0) for s in self._devices.values())
        if over > self._large_frees_left():
            raise self._refused(device, state, size, "a new large address window could never be given back: "
                                                     "the platform allows no more large frees")

    def _refused(self, device: Device, state: _DeviceState, size: int, why: str) -> AddressWindowsExhausted:
        largest = max((w for _, w in state.windows), default=0)
        if state.large_alive:
            hint = f"unload a model on {device} and its window can be reused"
        else:
            hint = "every kept window is smaller; a larger one needs a new process"
        return AddressWindowsExhausted(
            f"reserving {size} bytes on {device}: {why} (large reserves fail after "
            f"{self.capabilities.reserve_churn_limit} large frees, rocm-systems #6191; {self._large_frees} of "
            f"{self._large_frees_allowed()} allowed are spent) and no kept window holds it ({len(state.windows)} "
            f"kept, largest {largest} bytes; {state.large_alive} large reservation(s) alive; at most "
            f"{state.window_bound} stay kept); out of memory: {hint}")

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
        """The smallest kept window that holds ``size`` bytes, taken out of the pool (large reserves only:
        a small one is reserved and freed at no cost to the churn limit)."""
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
        if self._one_pool(state) and not self._pool_has_room(rng, first, last, state):
            return Fault(False, (), first, 0)
        mapped: list[tuple[int, Any]] = []
        finished: list[int] = []  # pages left mapped by an earlier failure, now given access
        for p in range(first, last):
            if ready[p]:
                continue
            va, h, is_mapped = reservation.base + p * ps, handles[p], handles[p] is not None
            try:
                if not is_mapped:
                    h = self._spare_for(state, rng)
                    if h is None:
                        h = d.create(ps, rng.index)
                    self._not_ready_retried(state, d.map, va, ps, h)
                    is_mapped = True
                    mapped.append((p, h))
                self._not_ready_retried(state, d.set_access, va, ps, rng.index)
            except DriverError as exc:
                state.dirty = True
                if not is_mapped and h is not None:
                    # not mapped now: reuse it later (with its range where it was mapped there before)
                    (rng.spare if not self.capabilities.memory_returns_on_unmap else state.spare).append(h)
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

    def _one_pool(self, state: _DeviceState) -> bool:
        """Whether the device shares one pool with the host: the capability says so, the platform measures
        it as the pool, or the ``auto`` source finds it integrated."""
        source = self.platform.budget_source
        return (self.capabilities.unified_pool or source in ("unified", "apu")
                or (source == "auto" and state.integrated))

    def _pool_budget(self, index: int, state: _DeviceState) -> tuple[int, int, str]:
        """``(total, free, source)`` of device ``index`` from the platform's budget source (``auto``: the pool
        on a device that shares one with the host, whose mem-get-info reports ``MemFree`` without the
        reclaimable page cache, G3 and ComfyUI #15285 -- on an AMD APU the smallest of three figures, ``apu``;
        the device's own figures elsewhere). A ``unified`` pool is capped by the machine facts a user set
        (``machine.ram_total``) and by the memory cgroup's limit the facts carry; an APU's is not by the cgroup:
        its GTT allocations are not charged to it (hipMalloc on Strix Halo is not limited by a cgroup)."""
        source = self.platform.budget_source
        if source == "auto":  # an AMD APU's pool has three figures, none to trust alone (``apu``)
            source = ("apu" if self.driver.vendor == "hip" else "unified") if state.integrated else "device"
        total, free, label = self.driver.budget(source, index)
        if source != "unified":
            return total, free, label
        facts = self._facts()
        caps: list[tuple[int, str]] = []
        if facts is not None and "ram_total" in facts.overridden and facts.ram_total is not None:
            caps.append((facts.ram_total, "machine.ram_total"))
        if facts is not None and facts.cgroup_limit is not None:
            caps.append((facts.cgroup_limit, "the memory cgroup's limit"))
        for cap, why in caps:
            if cap < total:  # the same use, of a smaller pool
                used = total - free
                total, free, label = cap, max(0, min(free, cap - used)), f"{label}, capped by {why}"
        return total, free, label

    def _pool_has_room(self, rng: _Range, first: int, last: int, state: _DeviceState) -> bool:
        """One pool shared with the host: a fault that would cross it is out of memory before the
        driver is asked (a GB10 driver refusing late ends in NV_ERR_NO_MEMORY and aborts, ComfyUI #15285)."""
        need = sum(1 for p in range(first, last) if rng.handles[p] is None) - len(state.spare) - len(rng.spare)
        if need <= 0:
            return True
        total, free, _source = self._pool_budget(rng.index, state)
        return need * state.page_size <= free - self._room(rng.index, total)

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

        Where the platform pages fresh mappings in asynchronously
        (``page_in_sync``), the device is synchronized first (aimdo's
        ``three_stooges`` unwinds without one); elsewhere nothing touched the
        fresh pages yet. A page whose unmap fails stays resident with a new
        generation, so nothing leaks.
        """
        d = self.driver
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
            if self.capabilities.memory_returns_on_unmap:
                self._release_or_keep(state, h)
            else:  # a release would return nothing while the range lives: its next fault maps it again
                r.handle.spare.append(h)
        return 0

    def _keep(self, state: _DeviceState, r: Reservation, pages: list[tuple[int, Any]]) -> int:
        rng: _Range = r.handle
        for p, h in pages:
            rng.handles[p] = h  # mapped, not ready: counted as resident, finished by the next fault
            rng.ready[p] = 0
        state.resident += len(pages) * r.page_size
        return len(pages) * r.page_size

    @staticmethod
    def _spare_for(state: _DeviceState, rng: _Range) -> Any:
        """A kept handle for a page of ``rng``: its own first (mapped there before), then the device's."""
        if rng.spare:
            return rng.spare.pop()
        return state.spare.pop() if state.spare else None

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
        """The session already waited for the range's fence tokens. Synchronize the device only where fresh
        mappings may still be paging in (``page_in_sync``, WDDM) and pages were mapped since the last
        synchronize, or where a device-granular platform fences every unmap; elsewhere a free never stalls
        the device's other streams."""
        if (state.dirty and state.page_in_sync) or self.capabilities.fence_granularity == "device":
            self.driver.device_synchronize()
            state.dirty = False

    def _unmap(self, ptr: int, size: int) -> None:
        self.driver.unmap(ptr, size)

    def _drop(self, r: Reservation, first: int, last: int, releasing: bool = False) -> int:
        """Unmap every resident page in ``[first, last)`` and release (or keep) its memory; returns bytes dropped.

        Where memory returns only when the range is freed (``memory_returns_on_unmap`` false) a page's handle
        stays with its range for the range's next fault, unless the range is being released (``releasing``):
        then it is released before the range is freed, which returns it."""
        rng: _Range = r.handle
        keep_with_range = not (releasing or self.capabilities.memory_returns_on_unmap)
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
            if keep_with_range:
                rng.spare.append(rng.handles[p])
            else:
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
            dropped = self._drop(reservation, 0, reservation.pages, releasing=True)
            state = self._use(rng.index)
            self._release_range_spares(state, rng)
            window = (reservation.base, rng.window)
            if self._is_large(rng.window):
                # kept for the next large reserve it holds: a free would spend one of the platform's large
                # frees (rocm-systems #6191); trim gives it back while frees are left
                state.windows.append(window)
                state.large_alive -= 1
                self._keep_within_bound(reservation.device, state)
            else:
                try:
                    self._free_window(*window)
                except DriverError as exc:
                    exc.dropped = dropped
                    raise
            state.reserved -= rng.window
            state.ranges.pop(rng, None)
        return dropped

    def _release_range_spares(self, state: _DeviceState, rng: _Range) -> None:
        """Release the handles kept with a range that is being released: freeing the range then returns their
        memory (ROCm 7.2). One whose release fails is kept by the device, as any other."""
        while rng.spare:
            handle = rng.spare.pop()
            try:
                self.driver.release(handle)
            except DriverError:
                state.spare.append(handle)

    def _keep_within_bound(self, device: Device, state: _DeviceState) -> None:
        """More windows kept than the device's bound: free the smallest (the larger hold more models) while
        the frees last; the bound check at reserve leaves enough of them (under a strict bound this is where a
        run of several large models on one device spends its frees). Never fails the release: a window whose
        free fails stays kept (trim tries it again)."""
        while len(state.windows) > state.window_bound and self._large_frees_left() > 0:
            smallest = min(state.windows, key=lambda w: w[1])
            try:
                self._free_window(*smallest)
            except DriverError as exc:
                log.warning("membackend: %s: freeing a kept address window on %s failed (%s); it stays kept",
                            self.name, device, exc)
                return
            state.windows.remove(smallest)

    @hookimpl
    def membackend_fence(self, device: Device, reservation: Reservation | None) -> None:
        """The device fence synchronizes the device; a reservation's fence (its tokens already waited for by
        the session) does only where fresh mappings may still be paging in (``page_in_sync``)."""
        with self._lock:
            state = self._use(self._device_index(device))
            if reservation is None or (state.dirty and state.page_in_sync):
                self.driver.device_synchronize()
                state.dirty = False

    @hookimpl
    def membackend_budget_query(self, device: Device) -> Budget:
        index = self._device_index(device)
        with self._lock:
            state = self._use(index)
            total, free, source = self._pool_budget(index, state)
            room = self._room(index, total)
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
            unified = self._one_pool(state) or state.integrated
        return Budget.of(total, free, room, source, unified=unified)

    def room_split(self, device: Device) -> RoomSplit:
        """The device's memory split (:class:`RoomSplit`): one read of the platform's budget source, the
        headroom in force and this backend's own handles, under the backend's lock. Drops no kept handle
        (unlike the budget query): it only reports."""
        index = self._device_index(device)
        with self._lock:
            state = self._use(index)
            total, free, source = self._pool_budget(index, state)
            headroom = self._room(index, total)
            kept = len(state.spare) * state.page_size
            resident = state.resident
        held = resident + kept
        room = max(0, total - headroom)
        other = max(0, total - free - held)
        return RoomSplit(total, free, headroom, room, held, other, max(0, room - other), resident, source)

    @hookimpl
    def membackend_close(self) -> None:
        """Release the primary contexts the driver wrapper retained (two GPUs: each one's)."""
        close = getattr(self._driver, "close", None)
        if close is not None:
            close()

    @hookimpl
    def membackend_trim(self, device: Device) -> int:
        """Release the physical handles kept for reuse and free the kept windows on ``device``.

        The session calls it on close, the residency manager after a full
        unload of everything and at idle (``ResidencyManager.on_idle``: the
        ComfyUI adapter's "prompt queue empty"): that is the idle give-back.
        Under a reserve-churn limit a kept window is freed only while the churn
        allowance permits: a large free is left, and after it the frees left
        still cover every device's large windows past its bound (never a free
        the allowance does not permit: that is what keeps large reserves
        working, rocm-systems #6191). Every kept window goes when the allowance
        permits as many frees; when it permits fewer, the smallest go and the
        largest stay (they hold every model the smaller ones could). What stays
        is reported by :meth:`kept_windows` (and ``held`` in
        :meth:`membackend_inspect`).
        """
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
            for window in self._trim_plan(state):
                self._free_window(*window)
                state.windows.remove(window)
                released += window[1]
            if state.windows:  # what the churn allowance does not permit freeing stays, and is said
                self._report_kept(device, state)
        return released

    def _report_kept(self, device: Device, state: _DeviceState) -> None:
        report = log.debug if self._churn_warned else log.warning
        self._churn_warned = True  # once per backend: unload-everything cycles would repeat it
        report("membackend: %s", self._kept(device, state).describe())

    def _is_large(self, size: int) -> bool:
        caps = self.capabilities
        return caps.reserve_churn_limit is not None and size >= caps.reserve_churn_window

    def _large_frees_allowed(self) -> int:
        """Large frees this backend may spend: the platform's limit minus :data:`CHURN_MARGIN`."""
        limit = self.capabilities.reserve_churn_limit
        return 0 if limit is None else max(0, limit - CHURN_MARGIN)

    def _large_frees_left(self) -> int:
        return max(0, self._large_frees_allowed() - self._large_frees)

    def _trim_plan(self, state: _DeviceState) -> list[tuple[int, int]]:
        """The kept windows of ``state`` (all large: only those are kept) a trim now frees, in the order it
        frees them: smallest first, each while the churn allowance permits it -- a large free is left and,
        after it, the frees left still cover the large windows past their bounds on every device (see
        :meth:`_check_window_bound`). Asks no driver and changes nothing: :meth:`membackend_trim` frees this
        plan, :meth:`kept_windows` counts it."""
        left = self._large_frees_left()
        others = sum(s.over_bound() for s in self._devices.values() if s is not state)
        plan: list[tuple[int, int]] = []
        for window in sorted(state.windows, key=lambda w: w[1]):
            if left < 1 or others + state.over_bound(fewer_kept=len(plan) + 1) > left - 1:
                break
            left -= 1
            plan.append(window)
        return plan

    def _free_window(self, base: int, size: int) -> None:
        self.driver.address_free(base, size)
        if self._is_large(size):
            self._large_frees += 1

    def kept_windows(self, device: Device) -> KeptWindows | None:
        """What stays reserved on ``device`` after its reservations were released (None: the platform has
        no reserve-churn limit, so nothing is kept). Thread-safe; asks no driver."""
        if self.capabilities.reserve_churn_limit is None:
            return None
        index = self._device_index(device)
        with self._lock:
            state = self._devices.get(index)
            return self._kept(device, state)

    def _kept(self, device: Device, state: _DeviceState | None) -> KeptWindows:
        windows = state.windows if state is not None else []
        give_back = len(self._trim_plan(state)) if state is not None else 0
        keep = self.capabilities.reserve_churn_keep
        if keep is not None:
            rule = f"the platform's bound: {keep} per device"
        else:
            peak = state.large_peak if state is not None else 0
            rule = (f"{KEPT_WINDOWS_PER_DEVICE} per device, or as many large reservations as the device had alive "
                    f"at once ({peak})")
        left = self._large_frees_left()
        trim = "the next trim (idle, unload of everything, close)"
        if not windows:
            reason = "none kept"
        elif give_back == len(windows):
            reason = f"kept for reuse by the next large reserve, which then spends no large free; {trim} gives " \
                     f"them back: the churn allowance permits it"
        elif left < 1:
            reason = (f"they stay: the platform allows no more large frees ({self._large_frees} of "
                      f"{self._large_frees_allowed()} spent); reusing them spends none")
        elif give_back:
            reason = (f"{trim} gives {give_back} back, the smallest; the rest stay: the churn allowance permits "
                      f"no more ({left} large free(s) left, held to bring every device within its bound)")
        else:
            reason = (f"they stay: the {left} large free(s) left are held to bring the large windows past the "
                      f"devices' bounds back within them")
        return KeptWindows(
            device=device, windows=len(windows), bytes=sum(size for _, size in windows),
            largest=max((size for _, size in windows), default=0),
            bound=state.window_bound if state is not None else (keep or KEPT_WINDOWS_PER_DEVICE),
            large_frees_spent=self._large_frees, large_frees_allowed=self._large_frees_allowed(),
            churn_limit=self.capabilities.reserve_churn_limit or 0, can_give_back=give_back > 0,
            give_back=give_back, bound_rule=rule, reason=reason)

    def trim(self, device: Device) -> int:
        """Same as :meth:`membackend_trim` (kept for callers that hold the backend)."""
        return self.membackend_trim(device)

    @hookimpl
    def membackend_inspect(self, device: Device) -> DriverState | None:
        """What ``device`` holds for this backend, as a :class:`~membackend.types.DriverState`; never None.

        A simulated driver keeps its own tables: ``reserved``/``resident`` are its
        figures, and kept windows (reserved in the driver, no reservation's) and
        unmapped physical handles are ``held``. A real CUDA or HIP driver keeps
        no table a process can read, so the figures come from this backend's
        own handle ledger (:meth:`handle_ledger`), checked against the driver's
        free figure: ``committed`` is the device memory of the handles it
        created and has not released (mapped, and kept for reuse), ``held``
        the kept handles and kept windows. ``source`` says which, and where
        the driver's free figure cannot account for the committed bytes it
        says so (how many) instead of vouching for them. On Windows
        ``committed`` is None: there the platform charges the process's private
        commit, which the ledger cannot split out (callers measure it
        themselves). Raises only what the driver raises for a simulated table.
        """
        index = self._device_index(device)
        with self._lock:
            raw: dict[str, Any] | None = self.driver.inspect(index)  # "calls": a mapping of the simulation's
            if raw is not None:
                state = self._devices.get(index)
                pooled = state.pooled if state is not None else 0
        if raw is None:
            return self.handle_ledger(device).state()
        return DriverState(reserved=raw["reserved"] - pooled, resident=raw["mapped"],
                           held=pooled + raw["physical"] - raw["mapped"], source=f"driver tables ({self.driver.label})",
                           committed=raw.get("committed"), hazards=raw.get("hazards", 0), calls=raw.get("calls"))

    def handle_ledger(self, device: Device) -> HandleLedger:
        """This backend's own account of ``device`` (:class:`HandleLedger`), checked against the driver's
        mem-get-info where the device holds anything: the ledger's figures are taken under the backend's lock,
        the driver is asked after (one call, outside the lock). A failed query leaves the check unmade, with
        the driver's error as the reason: the ledger's own figures stand."""
        index = self._device_index(device)
        with self._lock:
            state = self._devices.get(index)
            if state is None:  # never used: nothing created, and no reason to wake the device
                return HandleLedger(device, 0, 0, 0, 0, 0, None, None, "", 0, "nothing created on the device yet")
            ps = state.page_size
            kept = len(state.spare) * ps + sum(len(r.spare) * p for r, p in state.ranges.items())
            ledger = (state.reserved, state.resident, kept, state.pooled, state.granularity)
        reserved, resident, kept, windows, granularity = ledger
        if resident + kept == 0:
            return HandleLedger(device, reserved, resident, kept, windows, granularity, None, None, "", 0,
                                "no physical memory held: nothing to check")
        call = "cuMemGetInfo" if self.driver.vendor == "cuda" else "hipMemGetInfo"
        try:
            total, free, label = self.driver.budget("device", index)
        except DriverError as exc:
            return HandleLedger(device, reserved, resident, kept, windows, granularity, None, None, call, 0,
                                f"not checked: {exc}")
        return HandleLedger.checked(device, reserved, resident, kept, windows, granularity, total, free, label)

    @hookimpl
    def membackend_inject_failures(self, probability: float, seed: int) -> Any:
        """Random failures of the driver's VMM calls, where the driver can inject them (simulations)."""
        return self.driver.inject_failures(probability, seed)


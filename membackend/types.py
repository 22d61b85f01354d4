"""Value types shared by every layer of membackend.

Nothing here imports anything else from membackend: these records are the
vocabulary of the contract (see ``hookspec.py``) and of the error hierarchy.
All sizes and offsets are in bytes; offsets are relative to a reservation's
base address.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, runtime_checkable

__all__ = [
    "Device",
    "DeviceInfo",
    "Machine",
    "Reservation",
    "Fault",
    "Budget",
    "Candidate",
    "Score",
    "Capabilities",
    "FenceToken",
    "DriverState",
    "FailureInjection",
    "MembackendError",
    "ReservationError",
    "ReservationReleased",
    "ForeignReservation",
    "InvalidToken",
    "PartialFailure",
    "OutOfRange",
    "InvalidSize",
    "Misaligned",
    "WrongDevice",
    "BackendNotFound",
    "BackendDisabled",
    "PluginError",
    "ConfigError",
    "DriverError",
    "SanitizerError",
]

DEVICE_KINDS = ("cpu", "cuda", "hip")


# --------------------------------------------------------------------------- errors


class MembackendError(Exception):
    """Root of every error membackend raises on purpose."""


class ReservationError(MembackendError, ValueError):
    """A verb was called with arguments that do not fit the reservation."""


class ReservationReleased(ReservationError):
    """The reservation was released; it cannot be used or released again."""


class ForeignReservation(ReservationError):
    """A reservation that another session (or another backend) handed out; nothing was changed."""


class InvalidToken(MembackendError, TypeError):
    """A fence token without callable ``done()`` and ``wait()``."""


class OutOfRange(ReservationError):
    """An offset or byte range falls outside the reservation."""


class InvalidSize(ReservationError):
    """A size is not a positive integer."""


class Misaligned(ReservationError):
    """A range that must cover whole pages does not start or end on a page boundary."""


class WrongDevice(ReservationError):
    """A device the backend does not serve, or one that does not match the reservation."""


class BackendNotFound(MembackendError, LookupError):
    """A backend was asked for by name and is not available.

    ``available`` lists the names that could have been chosen; ``unavailable``
    maps every other known name to the reason it cannot be used.
    """

    def __init__(self, name: str, available: list[str], unavailable: dict[str, str]):
        self.name = name
        self.available = list(available)
        self.unavailable = dict(unavailable)
        lines = [f"backend {name!r} is not available; available: {', '.join(self.available) or 'none'}"]
        for other, why in sorted(self.unavailable.items()):
            lines.append(f"  {other}: unavailable ({why})")
        super().__init__("\n".join(lines))


class BackendDisabled(MembackendError):
    """membackend was switched off (``MEMBACKEND_DISABLE``); callers use their legacy path."""


class PluginError(MembackendError):
    """A plugin is broken: it failed to load, to validate or to probe."""


class ConfigError(MembackendError, ValueError):
    """A setting has a value that cannot be used.

    ``key`` is the setting's name, ``source`` where the value came from
    (kwargs, env, a file path), ``accepted`` what would have been accepted.
    """

    def __init__(self, key: str, source: str, message: str, accepted: str = ""):
        self.key = key
        self.source = source
        self.accepted = accepted
        text = f"{key} (from {source}): {message}"
        if accepted:
            text += f"; accepted: {accepted}"
        super().__init__(text)


class DriverError(MembackendError, OSError):
    """A driver call returned a failure code.

    ``code`` is the driver's own code (an errno, a ``CUresult``, a ``hipError_t``),
    ``call`` the name of the failing function.
    """

    def __init__(self, code: Any, call: str, detail: str = ""):
        self.code = code
        self.call = call
        text = f"{call} failed with {code!s}"
        if detail:
            text += f": {detail}"
        MembackendError.__init__(self, text)
        self.args = (text,)

    def __str__(self) -> str:  # OSError's __str__ would print errno/strerror
        return self.args[0]


class PartialFailure(MembackendError):
    """An operation over many items (unload everything, close) carried on past failures.

    Everything that could be done was done; ``failures`` lists ``(what, error)``
    for each item that failed, and the message names them all.
    """

    def __init__(self, operation: str, failures: list[tuple[str, BaseException]]):
        self.operation = operation
        self.failures = list(failures)
        lines = [f"{operation}: {len(self.failures)} failure(s)"]
        lines += [f"  {what}: {type(err).__name__}: {err}" for what, err in self.failures]
        super().__init__("\n".join(lines))


class SanitizerError(MembackendError):
    """Sanitize mode caught a use of memory that would be unsafe (G1/G2)."""


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, order=True)
class Device:
    """One memory pool: ``cpu:0`` for host RAM, ``cuda:N`` / ``hip:N`` for a GPU."""

    kind: str
    index: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise WrongDevice(f"device kind {self.kind!r} is unknown; accepted: {', '.join(DEVICE_KINDS)}")
        if not isinstance(self.index, int) or isinstance(self.index, bool) or self.index < 0:
            raise WrongDevice(f"device index {self.index!r} must be an int >= 0")

    @classmethod
    def parse(cls, text: "str | Device") -> "Device":
        """``"cuda:1"`` → ``Device("cuda", 1)``; ``"cpu"`` → ``Device("cpu", 0)``."""
        if isinstance(text, Device):
            return text
        kind, _, index = str(text).partition(":")
        try:
            return cls(kind.strip().lower(), int(index) if index else 0)
        except ValueError:
            raise WrongDevice(f"device {text!r} is not of the form KIND[:INDEX]; kinds: {', '.join(DEVICE_KINDS)}") from None

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


@dataclass(frozen=True)
class DeviceInfo:
    """What is known about one device without creating a context on it."""

    device: Device
    name: str = ""
    total_memory: int = 0
    integrated: bool = False
    unified: bool = False
    driver_model: str | None = None  # "wddm" / "tcc" / "mcdm" on Windows, None elsewhere
    arch: str | None = None  # "sm_90", "gfx1201", ...
    source: str = ""


@dataclass(frozen=True)
class Machine:
    """Hardware facts, gathered once; every field can be overridden from settings."""

    os: str
    cpus: int
    ram_total: int
    ram_available: int
    cgroup_limit: int | None
    torch_version: str | None
    torch_vendor: str | None  # "cuda" / "rocm" / "cpu" / None when torch is absent
    devices: tuple[DeviceInfo, ...] = ()
    overridden: tuple[str, ...] = ()

    def gpus(self, kind: str | None = None) -> tuple[DeviceInfo, ...]:
        return tuple(d for d in self.devices if d.device.kind != "cpu" and (kind is None or d.device.kind == kind))


_reservation_ids = itertools.count(1)


@dataclass(eq=False)
class Reservation:
    """A range of address space handed out by ``membackend_reserve``.

    ``size`` is the usable size (a whole number of pages, at least what was
    asked for). ``handle`` is private to the backend that made it. A
    reservation is compared by identity; ``released`` turns true once it has
    been given back, after which every verb on it raises ``ReservationReleased``.
    """

    device: Device
    base: int
    size: int
    page_size: int
    backend: str
    handle: Any = field(default=None, repr=False)
    requested: int = 0
    id: int = field(default_factory=lambda: next(_reservation_ids))
    released: bool = False

    @property
    def pages(self) -> int:
        return self.size // self.page_size

    def page_range(self, offset: int, size: int) -> range:
        """Indices of every page the byte range touches (validated by the session)."""
        ps = self.page_size
        return range(offset // ps, (offset + size - 1) // ps + 1)


class Fault(NamedTuple):
    """Result of ``membackend_fault``.

    ``ok`` is false when the pages could not be backed (out of memory); the
    range is then left exactly as it was. ``generations`` has one entry per
    page of the range, starting at ``first_page``; an entry changes whenever
    that page gets new physical memory, so the caller knows to copy again.
    ``mapped`` is the number of bytes newly backed by this call.

    A named tuple, not a dataclass: it is built once per weight per step, and
    a frozen dataclass cost more than twice as much to construct.
    """

    ok: bool
    generations: tuple[int, ...] = ()
    first_page: int = 0
    mapped: int = 0


@dataclass(frozen=True)
class Budget:
    """How much memory a device has, from the platform's real source.

    ``usable`` is ``free - headroom`` clamped at zero; ``unified`` is true when
    the device shares one pool with the host (so host copies count too).
    """

    total: int
    free: int
    headroom: int
    usable: int
    source: str
    unified: bool = False

    @classmethod
    def of(cls, total: int, free: int, headroom: int, source: str, unified: bool = False) -> "Budget":
        free = max(0, min(free, total))
        return cls(total, free, headroom, max(0, free - headroom), source, unified)


class Score:
    """The one scale every probe scores on (higher wins; see ``docs/architecture.md``).

    * ``NONE`` (0): does not fit this machine; the reason says why.
    * ``FALLBACK`` (1): the built-in ``host`` backend, always available.
    * ``GENERIC`` band (10-49): backends that work on any device of a vendor
      (the generic ``vmm``, ``aimdo``).
    * ``PLATFORM`` band (50-99): platform plugins; a more specific fit scores
      higher inside the band.

    A candidate with ``opt_in=True`` fits but is selected only when forced by
    name. Ties at the top are broken by name (alphabetical), with one warning.
    """

    NONE = 0
    FALLBACK = 1
    GENERIC = range(10, 50)
    PLATFORM = range(50, 100)


@dataclass(frozen=True)
class Candidate:
    """A plugin's answer to ``membackend_probe``: score 0 means "does not fit", reason says why.

    ``opt_in`` true: the backend fits but wants to be chosen only when forced
    (``MEMBACKEND_BACKEND=name``); automatic selection passes it over.
    """

    name: str
    score: int
    reason: str
    opt_in: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a platform tells the mechanism and the policy; the defaults suit a discrete GPU.

    * ``release_on_full_unload``: a full unload returns the reservation (G1);
      false keeps it, as stock comfy-aimdo does (read by the residency manager).
    * ``recycle_handles``: freed physical memory is kept and mapped again by
      the next fault instead of released and created again; at most
      ``recycle_limit`` handles per device (None: bounded by the budget alone —
      kept handles are released first whenever the device's free memory falls
      below the headroom).
    * ``fence_granularity``: ``reservation`` fences recorded work per
      reservation; ``device`` also synchronizes the whole device before every
      unmap (for drivers that page memory in behind the process's back).
    * ``unified_pool``: the device shares one pool with the host (budgets say so).
    * ``address_quota``: bytes of GPU address space (reservations and mappings)
      the process may hold; a reserve past it is refused up front.
    * ``reserve_churn_limit``: the platform fails large reserves after this many
      large address frees; released windows of at least ``reserve_churn_window``
      bytes are then kept (bounded) and reused instead of freed.
    """

    release_on_full_unload: bool = True
    recycle_handles: bool = False
    recycle_limit: int | None = 16
    fence_granularity: str = "reservation"
    unified_pool: bool = False
    address_quota: int | None = None
    reserve_churn_limit: int | None = None
    reserve_churn_window: int = 1 << 30

    def __post_init__(self) -> None:
        if self.fence_granularity not in ("reservation", "device"):
            raise ValueError(f"fence_granularity {self.fence_granularity!r}; accepted: reservation, device")


@dataclass(frozen=True)
class DriverState:
    """The driver's (or kernel's) own view of one device, from ``membackend_inspect``.

    ``reserved`` and ``resident`` are the bytes of the reservations handed out
    and still alive, and of their resident pages, as the platform itself counts
    them (not the backend's bookkeeping): the conformance kit compares them
    with the session's ledger. ``held`` is memory the backend keeps for reuse
    (recycled physical handles, pooled address windows) that no live
    reservation uses; ``membackend_trim`` must bring it to zero. ``source``
    names where the figures came from.
    """

    reserved: int
    resident: int
    held: int = 0
    source: str = ""
    committed: int | None = None  # process memory the platform charges for it (Windows private commit), if known
    hazards: int = 0  # unsafe operations the driver saw: unmaps or releases while async work used the memory


@runtime_checkable
class FailureInjection(Protocol):
    """Random driver failures started by ``membackend_inject_failures``.

    ``injected`` counts the failures so far; ``stop()`` ends the injection and
    leaves the driver working normally.
    """

    injected: int

    def stop(self) -> None: ...


@runtime_checkable
class FenceToken(Protocol):
    """Asynchronous work on a range: a CUDA/HIP event wrapper, a copy thread's future."""

    def done(self) -> bool: ...

    def wait(self) -> None: ...

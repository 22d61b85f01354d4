"""A :class:`Session`: one selected backend, its ledger and its observers.

The session is what callers use. It checks every argument before the backend
sees it (so every backend gets the same typed errors and the ledger never
changes on a bad call), keeps the fence tokens recorded on each reservation,
fences before every free and release (G2), and keeps the ledger.

The hot verbs (``fault``, ``free``) are bound once: with no observer wrapping
a verb, the session calls the backend's method directly instead of going
through pluggy's generic dispatch; with observers, it calls a hook caller that
holds only this backend and those observers.
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Iterable

import pluggy

from . import hookspec
from .ledger import Ledger
from .types import (
    Budget,
    Candidate,
    Capabilities,
    Device,
    DriverError,
    FenceToken,
    Fault,
    InvalidSize,
    Machine,
    MembackendError,
    Misaligned,
    OutOfRange,
    PluginError,
    Reservation,
    WrongDevice,
)

log = logging.getLogger(__name__)

__all__ = ["Session"]

_ARGS = {
    "membackend_reserve": ("device", "size"),
    "membackend_fault": ("reservation", "offset", "size"),
    "membackend_free": ("reservation", "offset", "size"),
    "membackend_release_reservation": ("reservation",),
    "membackend_fence": ("device", "reservation"),
    "membackend_budget_query": ("device",),
}


def _int(value: Any, what: str) -> int:
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidSize(f"{what} must be an integer number of bytes, got {value!r}") from None


class Session:
    """Bound to exactly one backend; see the module docstring for the guarantees."""

    def __init__(self, backend: Any, *, machine: Machine, ledger: Ledger | None = None,
                 observers: Iterable[Any] = (), headroom: int | None = None,
                 candidate: Candidate | None = None, how: str = "forced"):
        self.backend = backend
        self.name: str = backend.name
        self.capabilities: Capabilities = getattr(backend, "capabilities", None) or Capabilities()
        self.device_kinds: tuple[str, ...] = tuple(getattr(backend, "device_kinds", ("cpu", "cuda", "hip")))
        self.machine = machine
        self.ledger = ledger or Ledger()
        self._pending_ids = self.ledger.pending_ids  # membership tests on the hot path
        self._sanitize = self.ledger.sanitize
        self.headroom = headroom
        self.candidate = candidate
        self.how = how
        self.observers = list(observers)
        self._alive: dict[int, Reservation] = {}
        self._bind()

    # ------------------------------------------------------------------ binding

    def _bind(self) -> None:
        pm = pluggy.PluginManager(hookspec.PROJECT)
        pm.add_hookspecs(hookspec)
        pm.register(self.backend, name=f"backend:{self.name}")
        for i, obs in enumerate(self.observers):
            pm.register(obs, name=f"observer:{i}:{type(obs).__name__}")
        self._pm = pm
        for verb, argnames in _ARGS.items():
            caller = getattr(pm.hook, verb)
            wrapped = any(impl.plugin is not self.backend for impl in caller.get_hookimpls())
            setattr(self, "_" + verb.removeprefix("membackend_"),
                    self._through(caller, argnames) if wrapped else getattr(self.backend, verb))

    @staticmethod
    def _through(caller: Any, argnames: tuple[str, ...]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            return caller(**dict(zip(argnames, args)))
        return call

    def add_observer(self, observer: Any) -> None:
        """Wrap the verbs with ``observer``'s ``wrapper=True`` hookimpls from now on."""
        self.observers.append(observer)
        self._bind()

    # ------------------------------------------------------------------ checks

    def _device(self, device: Any) -> Device:
        device = Device.parse(device)
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"backend {self.name!r} serves {', '.join(self.device_kinds)} devices, not {device}")
        return device

    def _mine(self, r: Any, verb: str) -> None:
        if not isinstance(r, Reservation):
            raise WrongDevice(f"{verb} needs a Reservation from this session, got {type(r).__name__}")
        if r.released:
            self.ledger.check_alive(r, verb)
        if r.backend != self.name:
            raise WrongDevice(f"reservation #{r.id} belongs to backend {r.backend!r}, not {self.name!r}")

    @staticmethod
    def _range(r: Reservation, offset: Any, size: Any) -> tuple[int, int]:
        if offset.__class__ is not int or size.__class__ is not int:
            offset, size = _int(offset, "offset"), _int(size, "size")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}")
        if offset < 0 or offset + size > r.size:
            raise OutOfRange(f"range [{offset}, {offset + size}) is outside reservation #{r.id} of {r.size} bytes; "
                             f"accepted: 0 <= offset and offset + size <= {r.size}")
        return offset, size

    # ------------------------------------------------------------------ verbs

    def devices(self) -> list[Device]:
        """The devices of this machine that the backend serves."""
        found = [Device("cpu", 0)] if "cpu" in self.device_kinds else []
        found += [d.device for d in self.machine.devices if d.device.kind in self.device_kinds]
        return found

    def reserve(self, device: Any, size: Any) -> Reservation:
        device = self._device(device)
        size = _int(size, "size")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}")
        try:
            r = self._reserve(device, size)
        except Exception as exc:
            if (untyped := self._failed("reserve", exc)) is None:
                raise
            raise untyped from exc
        if not isinstance(r, Reservation) or r.size < size or r.device != device or r.page_size <= 0 \
                or r.size % r.page_size or r.backend != self.name:
            raise PluginError(f"backend {self.name!r} broke the contract: reserve({device}, {size}) returned {r!r}")
        self.ledger.on_reserve(r)
        self._alive[r.id] = r
        return r

    def fault(self, reservation: Reservation, offset: int, size: int) -> Fault:
        """Back every page of the range; ``Fault.ok`` false is out of memory (nothing changed)."""
        if reservation.__class__ is not Reservation or reservation.released or reservation.backend != self.name:
            self._mine(reservation, "fault")
        offset, size = self._range(reservation, offset, size)
        try:
            f = self._fault(reservation, offset, size)
        except Exception as exc:
            if (untyped := self._failed("fault", exc, reservation)) is None:
                raise
            raise untyped from exc
        if f.mapped:
            self.ledger.on_fault(reservation, f.mapped)
        return f

    def free(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
        """Fence, then drop the resident pages of a page-aligned range (default: all). Returns bytes dropped."""
        if reservation.__class__ is not Reservation or reservation.released or reservation.backend != self.name:
            self._mine(reservation, "free")
        if size is None:
            size = reservation.size - offset
        offset, size = self._range(reservation, offset, size)
        ps = reservation.page_size
        end = offset + size
        if offset % ps or end % ps:
            if offset % ps or end < reservation.requested:
                raise Misaligned(f"free range [{offset}, {end}) must start on a page boundary and end on one "
                                 f"(or at the end of the reservation); page size {ps}")
            size = reservation.size - offset  # the tail page holds only this caller's bytes
        if reservation.id in self._pending_ids:
            self._wait_tokens(reservation.device, reservation)
        if self._sanitize:
            self.ledger.check_quiet(reservation, "free")
        try:
            dropped = self._free(reservation, offset, size)
        except Exception as exc:
            if (untyped := self._failed("free", exc, reservation)) is None:
                raise
            raise untyped from exc
        if dropped:
            self.ledger.on_free(reservation, dropped)
        return dropped

    def release_reservation(self, reservation: Reservation) -> int:
        """Fence, drop every page and return the address range; the reservation is dead afterwards."""
        self._mine(reservation, "release_reservation")
        self._wait_tokens(reservation.device, reservation)
        self.ledger.check_quiet(reservation, "release_reservation")
        try:
            dropped = self._release_reservation(reservation)
        except Exception as exc:
            if (untyped := self._failed("release_reservation", exc, reservation)) is None:
                raise
            raise untyped from exc
        reservation.released = True
        self.ledger.on_release(reservation)
        self._alive.pop(reservation.id, None)
        return dropped

    def record(self, reservation: Reservation, token: FenceToken) -> None:
        """Note asynchronous work (a copy, a kernel) on the reservation; fences wait for it."""
        self._mine(reservation, "record")
        if not (callable(getattr(token, "done", None)) and callable(getattr(token, "wait", None))):
            raise TypeError(f"a fence token needs done() and wait(); got {type(token).__name__}")
        self.ledger.record(reservation, token)

    def fence(self, device: Any = None, reservation: Reservation | None = None) -> None:
        """Wait for recorded work on the reservation, or on the whole device when it is None."""
        if reservation is not None:
            self._mine(reservation, "fence")
            if device is not None and Device.parse(device) != reservation.device:
                raise WrongDevice(f"reservation #{reservation.id} is on {reservation.device}, not {device}")
            device = reservation.device
        elif device is None:
            raise WrongDevice("fence needs a device or a reservation")
        device = self._device(device)
        self._wait_tokens(device, reservation)
        try:
            self._fence(device, reservation)
        except Exception as exc:
            if (untyped := self._failed("fence", exc)) is None:
                raise
            raise untyped from exc

    def budget_query(self, device: Any) -> Budget:
        """The backend's budget; a session-wide ``headroom`` setting replaces the backend's own."""
        device = self._device(device)
        try:
            b = self._budget_query(device)
        except Exception as exc:
            if (untyped := self._failed("budget_query", exc)) is None:
                raise
            raise untyped from exc
        if not isinstance(b, Budget):
            raise PluginError(f"backend {self.name!r} broke the contract: budget_query returned {b!r}")
        if self.headroom is not None and self.headroom != b.headroom:
            b = Budget.of(b.total, b.free, self.headroom, b.source, b.unified)
        return b

    def reservations(self) -> list[Reservation]:
        """Every reservation of this session that is still alive."""
        return list(self._alive.values())

    def close(self) -> int:
        """Release every reservation still alive; returns how many there were."""
        alive = list(self._alive.values())
        for r in alive:
            self.release_reservation(r)
        return len(alive)

    # ------------------------------------------------------------------ internals

    def _failed(self, verb: str, exc: Exception, reservation: Reservation | None = None) -> PluginError | None:
        """Account for a verb that raised; return the typed error to raise instead, or None to re-raise.

        A ``DriverError`` may carry the bytes the backend still changed before it
        failed (``mapped`` by a fault whose rollback could not unmap, ``dropped``
        by a free or release that stopped half-way): the ledger takes them, so it
        keeps matching the driver. Anything that is not a membackend error is a
        broken backend, and G6 wants it typed.
        """
        if isinstance(exc, DriverError) and reservation is not None:
            self.ledger.on_fault(reservation, getattr(exc, "mapped", 0))
            self.ledger.on_free(reservation, getattr(exc, "dropped", 0))
        if isinstance(exc, MembackendError):
            return None
        log.error("membackend: backend %r raised %s in %s: %s", self.name, type(exc).__name__, verb, exc)
        return PluginError(f"backend {self.name!r} raised {type(exc).__name__} in {verb}: {exc}")

    def _wait_tokens(self, device: Device, reservation: Reservation | None) -> None:
        taken = self.ledger.take_pending(device, reservation)
        try:
            for _dev, tokens in taken.values():
                for t in tokens:
                    t.wait()
        except MembackendError:
            self.ledger.restore_pending(taken)
            raise
        except Exception as exc:
            self.ledger.restore_pending(taken)
            raise DriverError(type(exc).__name__, "fence token wait", str(exc)) from exc

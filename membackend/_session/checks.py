"""The session's argument checks and its typed-error wrapper: every backend gets the same typed errors, and the
ledger never changes on a bad call.

* :func:`as_int`: a size or an offset as an int, ``InvalidSize`` otherwise (no bools);
* :class:`Checks`: a device the backend serves, a reservation alive in this session, a range inside it, and
  :meth:`Checks.failed` / :meth:`Checks.call`: what a backend raised, typed (G6).
"""

from __future__ import annotations

import logging
import operator
from typing import Any, Callable, Iterable, NoReturn

from ..types import (
    Budget,
    Device,
    DriverError,
    ForeignReservation,
    InvalidSize,
    MembackendError,
    OutOfRange,
    PluginError,
    Reservation,
    WrongDevice,
)

log = logging.getLogger("membackend._session")

#: The largest reservation a session passes to a backend: 2**48 bytes (256 TiB).
#: That is the whole user address space of x86-64 and AArch64 with 4-level page
#: tables, and more than any GPU driver's virtual address range for one
#: process, so no platform can hold a bigger range. A bigger size is a caller's
#: bug (a negative number cast to unsigned, a unit mix-up); refusing it up front
#: also keeps it from wrapping in a driver's ``size_t`` into a small, valid range.
MAX_RESERVATION = 1 << 48


def as_int(value: Any, what: str, accepted: str) -> int:
    """``value`` as an int, or ``InvalidSize`` naming what was given and what is accepted (no bools)."""
    if value.__class__ is not bool:
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise InvalidSize(f"{what} must be an integer number of bytes, got {value!r} ({type(value).__name__}); "
                      f"accepted: {accepted}")


def in_range(r: Reservation, offset: Any, size: Any) -> tuple[int, int]:
    """``(offset, size)`` as ints when the range lies inside ``r``; ``InvalidSize`` or ``OutOfRange`` otherwise."""
    if offset.__class__ is not int or size.__class__ is not int:
        offset = as_int(offset, "offset", f"an int from 0 to {r.size - 1}")
        size = as_int(size, "size", f"an int from 1 to {r.size}")
    if size <= 0:
        raise InvalidSize(f"size must be > 0, got {size}; accepted: 1 to {r.size} bytes")
    if offset < 0 or offset + size > r.size:
        raise OutOfRange(f"range [{offset}, {offset + size}) is outside reservation #{r.id} of {r.size} bytes; "
                         f"accepted: 0 <= offset and offset + size <= {r.size}")
    return offset, size


class Checks:
    """The checks of one session over backend ``name`` serving ``device_kinds`` on the ``known`` devices (the
    machine's), with the ledger's ``check_alive(r, verb)`` (raises for a released reservation) and its
    ``on_fault(r, bytes)`` / ``on_free(r, bytes)`` (what a failed verb still changed)."""

    def __init__(self, name: str, device_kinds: tuple[str, ...], known: Iterable[Device],
                 check_alive: Callable[[Reservation, str], None], on_fault: Callable[[Reservation, int], Any],
                 on_free: Callable[[Reservation, int], Any]):
        self.name = name
        self.device_kinds = device_kinds
        self.known = frozenset(known)
        self.known_kinds = frozenset(d.kind for d in self.known)
        self._check_alive = check_alive
        self._on_fault = on_fault
        self._on_free = on_free

    def device(self, device: Any) -> Device:
        """``device`` parsed, when the backend serves it and the machine has it (or does not list its kind)."""
        if device.__class__ is not Device:
            device = Device.parse(device)
        if device in self.known:
            return device
        if device.kind not in self.device_kinds:
            raise WrongDevice(f"backend {self.name!r} serves {', '.join(self.device_kinds)} devices, not {device}")
        if device.kind in self.known_kinds:  # the machine lists this kind: the index must be one of them
            have = ", ".join(str(d) for d in sorted(self.known) if d.kind == device.kind)
            raise WrongDevice(f"{device} is not a device of this machine; accepted: {have}")
        return device  # devices the machine facts do not list: the backend decides

    def refuse(self, r: Any, verb: str) -> NoReturn:
        """Raise the typed error for a reservation that is not alive in this session."""
        if not isinstance(r, Reservation):
            raise WrongDevice(f"{verb} needs a Reservation from this session, got {type(r).__name__}")
        self._check_alive(r, verb)  # raises when released
        if r.backend != self.name:
            raise WrongDevice(f"reservation #{r.id} belongs to backend {r.backend!r}, not {self.name!r}")
        raise ForeignReservation(
            f"{verb}: reservation #{r.id} ({r.device}) was handed out by another session of backend "
            f"{self.name!r}; nothing was changed. Accepted: reservations this session reserved and has not released")

    def failed(self, verb: str, exc: Exception, reservation: Reservation | None = None) -> PluginError | None:
        """Account for a verb that raised; return the typed error to raise instead, or None to re-raise.

        A ``DriverError`` may carry the bytes the backend still changed before it
        failed (``mapped`` by a fault whose rollback could not unmap, ``dropped``
        by a free or release that stopped half-way): the ledger takes them, so it
        keeps matching the driver. Anything that is not a membackend error is a
        broken backend, and G6 wants it typed.
        """
        if isinstance(exc, DriverError) and reservation is not None:
            self._on_fault(reservation, getattr(exc, "mapped", 0))
            self._on_free(reservation, getattr(exc, "dropped", 0))
        if isinstance(exc, MembackendError):
            return None
        log.error("membackend: backend %r raised %s in %s: %s", self.name, type(exc).__name__, verb, exc)
        return PluginError(f"backend {self.name!r} raised {type(exc).__name__} in {verb}: {exc}")

    def call(self, verb: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, with what it raises typed by :meth:`failed` (no reservation's bytes)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            if (untyped := self.failed(verb, exc)) is None:
                raise
            raise untyped from exc

    def budget(self, query: Callable[[Device], Any], device: Device) -> Budget:
        """A budget from ``query`` (the bound verb, or the backend itself), typed as every verb is."""
        b = self.call("budget_query", query, device)
        if not isinstance(b, Budget):
            raise PluginError(f"backend {self.name!r} broke the contract: budget_query returned {b!r}")
        return b

"""The hot verbs, ``fault`` and ``free``: one body each, closures over exactly what they use.

Why closures: the hot verbs are meant to cost little more than the backend's own method, and every attribute of
the session they read on each call was a measurable part of what they cost over it (``membackend bench``;
``docs/performance.md``). :func:`hot_verbs` makes both for the verbs as bound (:mod:`.binding`); the session
installs them as attributes of the instance, declared on the class as :class:`FaultVerb` and :class:`FreeVerb`
(their contracts), so no bound method is made per call and there is no second body. Each check is the one the
session makes anywhere: the reservation alive here, the arguments, the permit (:class:`~.permits.Permits`),
G2's fence before a free, the live views, the ledger.

Why the seat: a reservation alive in a session carries ``(that session's live table, its permit)`` in
``Reservation._seat`` (set by :mod:`.lifecycle`), and the hot verbs read it there, one attribute load, where the
lookup in the live table was the largest single cost of ``Session.fault`` over the backend's method (about 70 of
its 260 ns, ``docs/performance.md``). The table's identity says the reservation is alive *here*.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Protocol

from .._ledger import Ledger
from ..types import Fault, Misaligned, OutOfRange, Reservation
from .checks import as_int
from .permits import Permits


class FaultVerb(Protocol):
    def __call__(self, reservation: Reservation, offset: int, size: int) -> Fault:
        """Back every page of the range; ``Fault.ok`` false is out of memory (nothing changed).

        ``ReservationReleased``, ``ForeignReservation`` or ``WrongDevice`` for a reservation not alive in this
        session; ``InvalidSize`` / ``OutOfRange`` for a range not inside it; what the backend raises, typed
        (``PluginError`` for an untyped error; a ``DriverError``'s ``mapped`` bytes join the ledger)."""
        ...


class FreeVerb(Protocol):
    def __call__(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
        """Fence, then drop the resident pages of a page-aligned range (default: all). Returns bytes dropped.

        ``TensorAlive`` (nothing changed) while a tensor from ``membackend._tensors`` views the range;
        ``Misaligned`` for a range that neither starts nor ends on a page boundary (its end may be the
        reservation's); the errors of :class:`FaultVerb` otherwise. A reservation the ledger holds no resident
        byte of has nothing to drop: after the checks and the fence the free returns 0 without calling the
        backend. Every free that reaches the backend counts in ``Session.backing_changes``."""
        ...


def hot_verbs(live: dict[Reservation, list[bool]], permits: Permits, ledger: Ledger, frees: dict[int, int],
              views: dict[Reservation, Any], check_views: Callable[[Reservation, int, int, str], None],
              wait_tokens: Callable[[Reservation], None], refuse: Callable[[Any, str], NoReturn],
              in_range: Callable[[Reservation, Any, Any], tuple[int, int]],
              failed: Callable[..., Any], backend_fault: Callable[..., Fault],
              backend_free: Callable[..., int]) -> tuple[FaultVerb, FreeVerb]:
    """``(fault, free)`` over ``live`` (reservation -> its permit, of ``permits``; the identity a reservation's
    seat names), the ``ledger``, ``frees``
    (reservation id -> frees that reached the backend), the live ``views`` table and its ``check_views``,
    ``wait_tokens`` (G2), ``refuse`` and ``in_range`` (the checks), ``failed`` (the typed-error wrapper) and
    the bound ``backend_fault`` and ``backend_free``."""
    waiting = permits.waiting  # looked at by every release
    pending_ids, resident_by_id, sanitize = ledger.pending_ids, ledger.resident_by_id, ledger.sanitize
    check_alive, on_fault, on_free, check_quiet = ledger.check_alive, ledger.on_fault, ledger.on_free, \
        ledger.check_quiet
    wait, wake = permits.wait, permits.wake

    def fault(reservation: Reservation, offset: int, size: int) -> Fault:
        try:
            table, permit = reservation._seat
        except (AttributeError, TypeError):  # not a Reservation, or alive in no session
            refuse(reservation, "fault")
        if table is not live:
            refuse(reservation, "fault")
        if offset.__class__ is not int or size.__class__ is not int or offset < 0 or size <= 0 \
                or offset + size > reservation.size:
            offset, size = in_range(reservation, offset, size)
        try:  # take the permit, inlined (see Permits)
            permit.pop()
        except IndexError:
            wait(permit)
        try:
            if reservation.released:  # released by another thread while this one waited
                check_alive(reservation, "fault")
            try:
                f: Fault = backend_fault(reservation, offset, size)
            except Exception as exc:
                if (untyped := failed("fault", exc, reservation)) is None:
                    raise
                raise untyped from exc
            if f[3]:  # f.mapped: an index costs less than a name on a tuple subclass
                on_fault(reservation, f[3])
        finally:
            permit.append(True)  # give it back, inlined
            if waiting:
                wake()
        return f

    def free(reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
        try:
            table, permit = reservation._seat
        except (AttributeError, TypeError):
            refuse(reservation, "free")
        if table is not live:
            refuse(reservation, "free")
        if size is None:
            if offset.__class__ is not int:
                offset = as_int(offset, "offset", f"an int from 0 to {reservation.size - 1}")
            if not 0 <= offset < reservation.size:
                raise OutOfRange(f"offset {offset} is outside reservation #{reservation.id} of "
                                 f"{reservation.size} bytes; accepted: 0 <= offset < {reservation.size}")
            size = reservation.size - offset
        if offset.__class__ is not int or size.__class__ is not int or offset < 0 or size <= 0 \
                or offset + size > reservation.size:
            offset, size = in_range(reservation, offset, size)
        ps = reservation.page_size
        end = offset + size
        if offset % ps or end % ps:
            if offset % ps or end < reservation.requested:
                raise Misaligned(f"free range [{offset}, {end}) must start on a page boundary and end on one "
                                 f"(or at the end of the reservation); page size {ps}")
            size = reservation.size - offset  # the tail page holds only this caller's bytes
        try:  # take the permit, inlined (see Permits)
            permit.pop()
        except IndexError:
            wait(permit)
        try:
            if reservation.released:
                check_alive(reservation, "free")
            if reservation in views:
                check_views(reservation, offset, size, "free")
            if reservation.id in pending_ids:
                wait_tokens(reservation)
            if sanitize:
                check_quiet(reservation, "free")
            if not resident_by_id.get(reservation.id):
                return 0  # the ledger holds no byte of it resident: nothing for the backend to drop
            # counted before the call: one that raises may have dropped pages too (backing_changes)
            frees[reservation.id] = frees.get(reservation.id, 0) + 1
            try:
                dropped: int = backend_free(reservation, offset, size)
            except Exception as exc:
                if (untyped := failed("free", exc, reservation)) is None:
                    raise
                raise untyped from exc
            if dropped:
                on_free(reservation, dropped)
        finally:
            permit.append(True)  # give it back, inlined
            if waiting:
                wake()
        return dropped

    return fault, free

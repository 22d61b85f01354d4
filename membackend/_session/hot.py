"""The hot verbs, ``fault`` and ``free``: one body each, closures over exactly what they use.

Why closures: the hot verbs are meant to cost little more than the backend's own method, and every attribute of
the session they read on each call was a measurable part of what they cost over it (``membackend bench``;
``docs/performance.md``). :func:`hot_verbs` makes both for the verbs as bound (:mod:`.binding`); the session
installs them as attributes of the instance, declared on the class as :class:`FaultVerb` and :class:`FreeVerb`
(their contracts), so no bound method is made per call and there is no second body. Each check is the one the
session makes anywhere: the reservation alive here, the arguments, the permit (:class:`~.permits.Permits`),
G2's fence before a free, the live views, the ledger.

Why the seat and the token: a reservation alive in a session carries its permit in ``Reservation._seat`` (set
by :mod:`.lifecycle`), and the hot verbs take it there, one attribute load, where the lookup in the session's
table of live reservations was the largest single cost of ``Session.fault`` over the backend's method (about 70
of its 260 ns, ``docs/performance.md``). What the permit holds while free is the owning session's token (its
``owner``), and :data:`~.permits.RELEASED` after the release: the ``pop()`` that takes it says in the same step
whether the reservation is this session's and still alive.
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


class Rare:
    """What the hot verbs call only off their fast path, held behind one closure cell: every cell a closure
    holds is copied into each call's frame, and these are many."""

    __slots__ = ("refuse", "in_range", "wait", "wake", "give", "failed", "on_fault", "on_free", "check_quiet",
                 "check_views", "wait_tokens")

    def __init__(self, permits: Permits, ledger: Ledger, refuse: Callable[[Any, str], NoReturn],
                 in_range: Callable[[Reservation, Any, Any], tuple[int, int]], failed: Callable[..., Any],
                 check_views: Callable[[Reservation, int, int, str], None],
                 wait_tokens: Callable[[Reservation], None]):
        self.refuse, self.in_range, self.failed = refuse, in_range, failed
        self.wait, self.wake, self.give = permits.wait, permits.wake, permits.give
        self.on_fault, self.on_free, self.check_quiet = ledger.on_fault, ledger.on_free, ledger.check_quiet
        self.check_views, self.wait_tokens = check_views, wait_tokens

    def not_ours(self, reservation: Any, permit: list[Any], token: Any, verb: str) -> NoReturn:
        """A permit taken that did not hold this session's token: put ``token`` back and raise the typed error
        (:data:`~.permits.RELEASED`: released; another session's token: that session's reservation)."""
        self.give(permit, token)
        self.refuse(reservation, verb)


def hot_verbs(owner: object, permits: Permits, ledger: Ledger, frees: dict[int, int],
              views: dict[Reservation, Any], check_views: Callable[[Reservation, int, int, str], None],
              wait_tokens: Callable[[Reservation], None], refuse: Callable[[Any, str], NoReturn],
              in_range: Callable[[Reservation, Any, Any], tuple[int, int]],
              failed: Callable[..., Any], backend_fault: Callable[..., Fault],
              backend_free: Callable[..., int]) -> tuple[FaultVerb, FreeVerb]:
    """``(fault, free)`` for the session whose token in its reservations' permits is ``owner`` (of ``permits``),
    over the ``ledger``, ``frees`` (reservation id -> frees that reached the backend), the live ``views`` table
    and its ``check_views``, ``wait_tokens`` (G2), ``refuse`` and ``in_range`` (the checks), ``failed`` (the
    typed-error wrapper) and the bound ``backend_fault`` and ``backend_free``."""
    waiting = permits.waiting  # looked at by every release
    pending_ids, resident_by_id, sanitize = ledger.pending_ids, ledger.resident_by_id, ledger.sanitize
    rare = Rare(permits, ledger, refuse, in_range, failed, check_views, wait_tokens)
    exact = int  # one cell, not a builtins look-up per check

    def fault(reservation: Reservation, offset: int, size: int) -> Fault:
        try:  # take the permit, inlined (see Permits): its token says whose the reservation is
            permit = reservation._seat
            token = permit.pop()
        except IndexError:
            token = rare.wait(permit)
        except AttributeError:  # not a Reservation, or alive in no session (no seat)
            rare.refuse(reservation, "fault")
        if token is not owner:
            rare.not_ours(reservation, permit, token, "fault")
        try:
            if offset.__class__ is not exact or size.__class__ is not exact or offset < 0 or size <= 0 \
                    or offset + size > reservation.size:
                offset, size = rare.in_range(reservation, offset, size)
            try:
                f: Fault = backend_fault(reservation, offset, size)
            except Exception as exc:
                if (untyped := rare.failed("fault", exc, reservation)) is None:
                    raise
                raise untyped from exc
            if f[3]:  # f.mapped: an index costs less than a name on a tuple subclass
                rare.on_fault(reservation, f[3])
        finally:
            permit.append(owner)  # give it back, inlined
            if waiting:
                rare.wake()
        return f

    def free(reservation: Reservation, offset: int = 0, size: int | None = None) -> int:
        try:
            permit = reservation._seat
            token = permit.pop()
        except IndexError:
            token = rare.wait(permit)
        except AttributeError:
            rare.refuse(reservation, "free")
        if token is not owner:
            rare.not_ours(reservation, permit, token, "free")
        try:
            if size is None:
                if offset.__class__ is not exact:
                    offset = as_int(offset, "offset", f"an int from 0 to {reservation.size - 1}")
                if not 0 <= offset < reservation.size:
                    raise OutOfRange(f"offset {offset} is outside reservation #{reservation.id} of "
                                     f"{reservation.size} bytes; accepted: 0 <= offset < {reservation.size}")
                size = reservation.size - offset
            if offset.__class__ is not exact or size.__class__ is not exact or offset < 0 or size <= 0 \
                    or offset + size > reservation.size:
                offset, size = rare.in_range(reservation, offset, size)
            ps = reservation.page_size
            end = offset + size
            if offset % ps or end % ps:
                if offset % ps or end < reservation.requested:
                    raise Misaligned(f"free range [{offset}, {end}) must start on a page boundary and end on one "
                                     f"(or at the end of the reservation); page size {ps}")
                size = reservation.size - offset  # the tail page holds only this caller's bytes
            if reservation in views:
                rare.check_views(reservation, offset, size, "free")
            if reservation.id in pending_ids:
                rare.wait_tokens(reservation)
            if sanitize:
                rare.check_quiet(reservation, "free")
            if not resident_by_id.get(reservation.id):
                return 0  # the ledger holds no byte of it resident: nothing for the backend to drop
            # counted before the call: one that raises may have dropped pages too (backing_changes)
            frees[reservation.id] = frees.get(reservation.id, 0) + 1
            try:
                dropped: int = backend_free(reservation, offset, size)
            except Exception as exc:
                if (untyped := rare.failed("free", exc, reservation)) is None:
                    raise
                raise untyped from exc
            if dropped:
                rare.on_free(reservation, dropped)
        finally:
            permit.append(owner)  # give it back, inlined
            if waiting:
                rare.wake()
        return dropped

    return fault, free

"""Fencing (G2): the tokens recorded on each reservation, the waits for them, and the reservations' locks.

:class:`Fencing` keeps nothing of its own but the count of moves of each reservation's tokens: the tokens live
in the ledger, the permits in :class:`~.permits.Permits`, the live reservations in the session's table.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

from .._fences import FutureToken, work_died
from .._ledger import Ledger, still_running
from ..types import Device, DriverError, FenceToken, InvalidToken, MembackendError, Reservation, WrongDevice
from .permits import Permits

#: the ``call`` of the ``DriverError`` a fence raises when recorded asynchronous work failed
FENCE_WAIT = "fence token wait"


class Fencing:
    """The fences of one session: ``live`` (reservation -> its permit, of ``permits``), the ``ledger`` that keeps
    the tokens, ``moving`` (reservation id -> how often a fence began and ended taking its waited tokens off:
    odd while under way; written under the reservation's lock, read without it), ``lock_of(r, verb)`` (the
    reservation's lock, :func:`~.permits.locker`), ``device(d)`` (a served device), ``backend_fence(device,
    reservation)`` (the bound verb, its errors typed)."""

    def __init__(self, live: dict[Reservation, list[bool]], permits: Permits, ledger: Ledger,
                 moving: dict[int, int], lock_of: Callable[[Any, str], contextlib.AbstractContextManager[None]],
                 device: Callable[[Any], Device], backend_fence: Callable[[Device, Reservation | None], None]):
        self._live = live
        self._permits = permits
        self._ledger = ledger
        self._moving = moving
        self._pending_ids = ledger.pending_ids
        self.lock_of = lock_of
        self._device = device
        self._backend_fence = backend_fence

    def record(self, reservation: Reservation, token: FenceToken | Future) -> None:
        """``Session.record``: a fence token (or a future, wrapped) noted on the reservation, under its lock."""
        lock = self.lock_of(reservation, "record")
        if isinstance(token, Future):  # has done() but no wait(): result() is its wait
            token = FutureToken(token)
        try:
            ok = callable(getattr(token, "done", None)) and callable(getattr(token, "wait", None))
        except Exception:
            ok = False
        if not ok:
            raise InvalidToken(f"a fence token needs done() and wait(); got {type(token).__name__} {token!r}; "
                               f"accepted: an object with callable done() and wait() (an event token, a FutureToken) "
                               f"or a concurrent.futures.Future")
        with lock:
            if reservation.released:
                self._ledger.check_alive(reservation, "record")
            self._ledger.record(reservation, token)

    def fence(self, device: Any = None, reservation: Reservation | None = None) -> None:
        """``Session.fence``: the reservation's tokens under its lock, or every reservation of the device with
        work, one at a time, then the backend's fence (see the session's docstring)."""
        if reservation is not None:
            lock = self.lock_of(reservation, "fence")
            if device is not None and Device.parse(device) != reservation.device:
                raise WrongDevice(f"reservation #{reservation.id} is on {reservation.device}, not {device}")
            with lock:
                if reservation.released:
                    self._ledger.check_alive(reservation, "fence")
                self.wait_tokens(reservation)
                self._backend_fence(reservation.device, reservation)
            return
        if device is None:
            raise WrongDevice("fence needs a device or a reservation")
        device = self._device(device)
        errors: list[BaseException] = []
        for r, permit in list(self._live.items()):
            if r.device != device or not self.may_have_work(r):
                continue
            with self._permits.held(permit):
                if not r.released:
                    try:
                        self.wait_tokens(r)
                    except MembackendError as exc:  # the others are still waited for; their tokens are kept
                        errors.append(exc)
        if errors:
            raise errors[0]
        self._backend_fence(device, None)

    def wait_tokens(self, reservation: Reservation) -> None:
        """Wait for every token recorded on ``reservation`` (its lock held).

        The tokens stay recorded -- visible to a device-wide fence on another
        thread -- until their waits have completed, so that fence waits for them
        too instead of passing a copy still running (G2). Under the
        reservation's lock nobody else records or takes its tokens, so the
        snapshot waited for is what is then taken (:meth:`settle`).

        Every token is waited for even when one fails; then every token whose
        ``done()`` says it is still running is kept, so the next fence waits
        again (G2); a failed token (``wait()`` raised and ``done()`` is true or
        raises) is reported once and counts as finished (G1); the first failure
        is raised typed: a ``DriverError`` with call :data:`FENCE_WAIT` (a
        membackend error a token raised passes as it is). A copy whose own thread
        stopped with ``KeyboardInterrupt`` or ``SystemExit`` (a future holding it,
        :func:`~membackend._fences.work_died`) is such a failure too, never
        re-raised in this thread (G6). A ``BaseException`` that is not the
        work's own (the caller's thread interrupted while it waits) propagates
        and every token stays recorded.
        """
        tokens = self._ledger.pending(reservation)
        if not tokens:
            return
        errors: list[BaseException] = []
        for t in tokens:
            try:
                t.wait()
            except Exception as exc:
                errors.append(exc)
            except BaseException as exc:
                if not work_died(t, exc):
                    raise  # the caller's own thread was interrupted: nothing taken, every token stays recorded
                errors.append(exc)
        left = self.settle(reservation, tokens, failed=bool(errors))
        if not errors:
            return
        first = errors[0]
        if isinstance(first, MembackendError):
            raise first
        count = len(tokens)
        what = str(first)
        if not isinstance(first, Exception):  # KeyboardInterrupt, SystemExit: the work's thread stopped
            what = (f"{what + ': ' if what else ''}the recorded work's own thread stopped with "
                    f"{type(first).__name__} before it finished, so what it wrote to the range is undefined "
                    f"(copy it again); accepted: work that finishes, or fails with an Exception")
        raise DriverError(type(first).__name__, FENCE_WAIT,
                          f"{what} ({len(errors)} of {count} token(s) on reservation #{reservation.id} failed; "
                          f"{left} still running kept for the next fence, the failed ones count as finished)") \
            from first

    def settle(self, reservation: Reservation, waited: list[FenceToken], failed: bool) -> int:
        """Take the tokens just ``waited`` for off ``reservation`` (its lock held); returns how many of them
        are kept because they are still running.

        After waits that all returned every one has finished; after a wait that
        ``failed``, the ones still running are kept (G2) and the failed ones count
        as finished (reported once). Anything recorded past the reservation's
        lock meanwhile (straight into the ledger) is not this fence's to drop:
        it stays, for the sanitizer to see. The ledger takes and puts back in two
        steps; the odd count in ``moving`` tells a device fence that it must
        not trust what the ledger says in between (:meth:`may_have_work`).
        """
        rid = reservation.id
        self._moving[rid] = self._moving.get(rid, 0) + 1
        try:
            taken = self._ledger.take_pending(reservation.device, reservation)
            dev, now = taken.get(rid, (reservation.device, []))
            mine = Counter(map(id, waited))
            kept, running = [], 0
            for t in now:
                if not mine[id(t)]:
                    kept.append(t)  # recorded past the lock while this fence waited
                elif failed and still_running(t):
                    mine[id(t)] -= 1
                    kept.append(t)
                    running += 1
                else:
                    mine[id(t)] -= 1
            if kept:
                self._ledger.restore_pending({rid: (dev, kept)})
        finally:
            self._moving[rid] += 1
        return running

    def may_have_work(self, r: Reservation) -> bool:
        """Whether tokens recorded on ``r`` may still be unfinished, without taking its lock (a device fence).

        A token stays recorded until its wait completed, except while a fence
        takes the waited ones off and puts back those it keeps (:meth:`settle`,
        two steps in the ledger): the count of those moves, odd while one is
        under way and read on both sides of the check, says whether the answer
        could have missed one. False is then safe: nothing recorded before the
        check is unfinished.
        """
        moves = self._moving.get(r.id, 0)
        return r.id in self._pending_ids or moves % 2 == 1 or self._moving.get(r.id, 0) != moves

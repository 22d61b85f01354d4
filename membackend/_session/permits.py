"""The mutexes of reservations (:class:`Permits`): one *permit* each, as cheap as the hot verbs need."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, NoReturn

__all__ = ["Permits", "PERMITS", "RELEASED", "locker"]

#: what a released reservation's permit holds from then on: whoever takes it learns the reservation is gone,
#: and puts it back for the next
RELEASED: Any = object()


class Permits:
    """The mutexes of reservations: one *permit* each, a list holding one *token* while it is free.

    The token is the owning session's mark (its ``owner``) while the reservation is alive there, and
    :data:`RELEASED` once it was released: so taking the permit also says whose the reservation is and
    whether it is still alive, which the hot verbs would otherwise look up apart. A holder puts back what it
    took, except the release, which puts back :data:`RELEASED`.

    Why not a ``threading.Lock`` per reservation: ``acquire()`` plus ``release()`` cost about as much as every
    other check of ``Session.fault`` together (they parse their arguments on every call), and the hot verbs
    are meant to cost little more than the backend's own method. Taking a permit is ``permit.pop()``,
    giving it back ``permit.append(token)``: each is atomic (one operation on a built-in list, under the
    interpreter's lock or, on a free-threaded build, the list's own), and the hot verbs inline both.

    A thread that finds a permit taken calls :meth:`wait`: under the condition it counts itself in
    :attr:`waiting` *before* it tries again; a releaser looks at :attr:`waiting` *after* it put the permit
    back and, when anyone waits, calls :meth:`wake`. Either the waiter's retry finds the permit or the
    releaser sees the waiter and wakes it: no wake-up is lost. Not reentrant; only the holder releases.
    """

    __slots__ = ("waiting", "_cond")

    def __init__(self) -> None:
        #: id(permit) -> how many threads wait for it; empty (false) while nobody waits
        self.waiting: dict[int, int] = {}
        self._cond = threading.Condition(threading.Lock())

    def wait(self, permit: list[Any]) -> Any:
        """Block until this thread took ``permit`` (the slow part of an acquire); returns the token it took."""
        key = id(permit)
        with self._cond:
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                while True:
                    try:
                        return permit.pop()
                    except IndexError:
                        self._cond.wait()
            finally:
                if self.waiting[key] == 1:
                    del self.waiting[key]
                else:
                    self.waiting[key] -= 1

    def wake(self) -> None:
        """Wake the waiters (the slow part of a release; each retries its own permit)."""
        with self._cond:
            self._cond.notify_all()

    def take(self, permit: list[Any]) -> Any:
        """Take ``permit``, waiting while another thread holds it; returns the token taken."""
        try:
            return permit.pop()
        except IndexError:
            return self.wait(permit)

    def give(self, permit: list[Any], token: Any) -> None:
        """Put ``token`` back into ``permit`` and wake whoever waits."""
        permit.append(token)
        if self.waiting:
            self.wake()

    @contextlib.contextmanager
    def held(self, permit: list[Any]) -> Iterator[Any]:
        """``with permits.held(permit) as token:`` -- the permit taken for the block, as ``with lock:`` would;
        the token it held (:data:`RELEASED` for a reservation released meanwhile) is put back after."""
        token = self.take(permit)
        try:
            yield token
        finally:
            self.give(permit, token)


#: the permits of every session in the process: one condition and one count of waiters, so that a thread that
#: took another session's permit (a reservation of that session, then refused) and put it back wakes that
#: session's waiters too
PERMITS = Permits()


def locker(live: dict[Any, list[Any]], permits: Permits,
           refuse: Callable[[Any, str], NoReturn]) -> Callable[[Any, str], contextlib.AbstractContextManager[Any]]:
    """``lock_of(r, verb)``: what ``with`` takes to hold ``r``'s permit (``live[r]``, of ``permits``); the typed
    error ``refuse(r, verb)`` raises for a reservation not alive in the session. The block checks ``r.released``:
    a release may have come first (the block's token is then :data:`RELEASED`)."""

    def lock_of(r: Any, verb: str) -> contextlib.AbstractContextManager[Any]:
        try:
            return permits.held(live[r])
        except (KeyError, TypeError):
            refuse(r, verb)

    return lock_of

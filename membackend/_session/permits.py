"""The mutexes of a session's reservations (:class:`Permits`): one *permit* each, as cheap as the hot verbs need."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, NoReturn

__all__ = ["Permits", "locker"]


class Permits:
    """The mutexes of a session's reservations: one *permit* each, a list holding ``True`` while it is free.

    Why not a ``threading.Lock`` per reservation: ``acquire()`` plus ``release()`` cost about as much as every
    other check of ``Session.fault`` together (they parse their arguments on every call), and the hot verbs
    are meant to cost little more than the backend's own method. Taking a permit is ``permit.pop()``,
    giving it back ``permit.append(True)``: each is atomic (one operation on a built-in list, under the
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

    def wait(self, permit: list[bool]) -> None:
        """Block until this thread took ``permit`` (the slow part of an acquire)."""
        key = id(permit)
        with self._cond:
            self.waiting[key] = self.waiting.get(key, 0) + 1
            try:
                while True:
                    try:
                        permit.pop()
                        return
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

    @contextlib.contextmanager
    def held(self, permit: list[bool]) -> Iterator[None]:
        """``with permits.held(permit):`` -- the permit taken for the block, as ``with lock:`` would."""
        try:
            permit.pop()
        except IndexError:
            self.wait(permit)
        try:
            yield
        finally:
            permit.append(True)
            if self.waiting:
                self.wake()


def locker(live: dict[Any, list[bool]], permits: Permits,
           refuse: Callable[[Any, str], NoReturn]) -> Callable[[Any, str], contextlib.AbstractContextManager[None]]:
    """``lock_of(r, verb)``: what ``with`` takes to hold ``r``'s permit (``live[r]``, of ``permits``); the typed
    error ``refuse(r, verb)`` raises for a reservation not alive in the session."""

    def lock_of(r: Any, verb: str) -> contextlib.AbstractContextManager[None]:
        try:
            return permits.held(live[r])
        except (KeyError, TypeError):
            refuse(r, verb)

    return lock_of

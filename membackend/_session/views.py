"""Live tensor views: the byte ranges tensors made by ``membackend._tensors`` read, which no free may drop."""

from __future__ import annotations

import contextlib
import functools
import itertools
from typing import Any, Callable

from ..types import Reservation, TensorAlive


class Views:
    """The live views of one session's reservations: ``table`` (reservation -> {view key: (offset, end)}; an
    entry is added under the reservation's lock, removed without any lock by the finalizer of the tensor's
    storage), ``lock_of(r, verb)`` (the reservation's lock), ``in_range(r, offset, size)`` (the range checked)
    and ``check_alive(r, verb)`` (raises for a released reservation)."""

    def __init__(self, table: dict[Reservation, dict[int, tuple[int, int]]],
                 lock_of: Callable[[Any, str], contextlib.AbstractContextManager[None]],
                 in_range: Callable[[Reservation, Any, Any], tuple[int, int]],
                 check_alive: Callable[[Reservation, str], None]):
        self._table = table
        self._lock_of = lock_of
        self._in_range = in_range
        self._check_alive = check_alive
        self._keys = itertools.count(1)

    def add(self, reservation: Reservation, offset: int, size: int) -> Callable[[], None]:
        """``Session.add_view``: register ``[offset, offset+size)``; the returned callable ends the view (no
        lock, any thread, harmless twice)."""
        lock = self._lock_of(reservation, "add_view")
        offset, size = self._in_range(reservation, offset, size)
        key = next(self._keys)
        with lock:
            if reservation.released:
                self._check_alive(reservation, "add_view")
            views = self._table.get(reservation)
            if views is None:
                views = self._table[reservation] = {}
            views[key] = (offset, offset + size)
        end_view: Callable[[], None] = functools.partial(views.pop, key, None)  # type: ignore[assignment]
        return end_view  # (what pop returns is of no use to the caller: it only ends the view)

    def overlapping(self, reservation: Reservation, offset: int = 0, size: int | None = None) -> list[tuple[int, int]]:
        """``Session.views``: the live views' ranges overlapping ``[offset, offset+size)``; a snapshot."""
        views = self._table.get(reservation)
        if not views:
            return []
        end = reservation.size if size is None else offset + size
        return [(a, b) for a, b in views.copy().values() if a < end and offset < b]

    def check(self, reservation: Reservation, offset: int, size: int, verb: str) -> None:
        """Raise ``TensorAlive`` when a live view overlaps the range (the reservation's lock held, and the
        reservation in the table)."""
        views = self._table[reservation]
        if not views:  # every view ended: stop paying for the check (add re-creates it under this lock)
            del self._table[reservation]
            return
        end = offset + size
        held = [(a, b) for a, b in views.copy().values() if a < end and offset < b]
        if held:
            raise TensorAlive(verb, reservation, offset, size, held)

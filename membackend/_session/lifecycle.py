"""A reservation's life in the session: reserved, released, given back after a broken reserve; and the
session's close, which releases what is still alive."""

from __future__ import annotations

import logging
from typing import Any, Callable, NoReturn

from .._ledger import Ledger
from ..types import Device, InvalidSize, MembackendError, PartialFailure, PluginError, Reservation, ReservationReleased
from .checks import MAX_RESERVATION, as_int
from .permits import RELEASED, Permits

log = logging.getLogger("membackend._session")


class Lifecycle:
    """Reserve and release for backend ``name``: ``live`` (reservation -> its permit), ``owner`` (this session's
    token in those permits, of ``permits``), ``views`` (the live views table) and ``check_views``
    (:meth:`.views.Views.check`), ``moving`` and ``frees`` (the fences' and frees' counts per reservation id),
    the ``ledger``, ``wait_tokens`` (G2), ``device`` (a served device), ``refuse`` (the typed error for a
    reservation not alive here), ``failed`` (the typed-error wrapper) and the bound ``backend_reserve`` and
    ``backend_release``."""

    def __init__(self, name: str, live: dict[Reservation, list[Any]], owner: object, permits: Permits,
                 views: dict[Reservation, Any], check_views: Callable[[Reservation, int, int, str], None],
                 moving: dict[int, int], frees: dict[int, int], ledger: Ledger,
                 wait_tokens: Callable[[Reservation], None], device: Callable[[Any], Device],
                 refuse: Callable[[Any, str], NoReturn], failed: Callable[..., PluginError | None],
                 backend_reserve: Callable[..., Any], backend_release: Callable[..., int]):
        self._name = name
        self._live, self._owner, self._permits = live, owner, permits
        self._views, self._check_views = views, check_views
        self._moving, self._frees, self._ledger = moving, frees, ledger
        self._wait_tokens, self._device, self._refuse, self._failed = wait_tokens, device, refuse, failed
        self._backend_reserve, self._backend_release = backend_reserve, backend_release

    def reserve(self, device: Any, size: Any) -> Reservation:
        """``Session.reserve``: checked, reserved, its contract checked; given back if anything fails after."""
        device = self._device(device)
        size = as_int(size, "size", f"1 to {MAX_RESERVATION} bytes")
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}; accepted: 1 to {MAX_RESERVATION} bytes")
        if size > MAX_RESERVATION:
            raise InvalidSize(f"size {size} is more than any address space holds; accepted: 1 to "
                              f"{MAX_RESERVATION} bytes (2**48)")
        try:
            r = self._backend_reserve(device, size)
        except Exception as exc:
            if (untyped := self._failed("reserve", exc)) is None:
                raise
            raise untyped from exc
        if isinstance(r, Reservation) and r._seat is not None:  # not a new one: nothing to give back
            raise PluginError(f"backend {self._name!r} broke the contract: reserve({device}, {size}) returned "
                              f"reservation #{r.id}, which is alive already")
        try:
            if not isinstance(r, Reservation) or r.size < size or r.device != device or r.page_size <= 0 \
                    or r.size % r.page_size or r.backend != self._name or r.released:
                raise PluginError(f"backend {self._name!r} broke the contract: reserve({device}, {size}) returned "
                                  f"{r!r}")
            self._ledger.on_reserve(r)
            permit = [self._owner]  # free, and this session's (see Permits)
            self._live[r] = permit
            r._seat = permit  # where the hot verbs take it (Reservation._seat)
        except BaseException:
            self.give_back(r)
            raise
        return r

    def release(self, reservation: Reservation) -> int:
        """``Session.release_reservation``: under its permit, views checked, fenced, released, forgotten; the
        permit then holds :data:`~.permits.RELEASED` for whoever took the reservation's seat before."""
        try:
            permit = self._live[reservation]
        except (KeyError, TypeError):
            self._refuse(reservation, "release_reservation")
        token = self._permits.take(permit)
        try:
            if token is not self._owner:  # a concurrent release won
                self._ledger.check_alive(reservation, "release_reservation")
            if reservation in self._views:
                self._check_views(reservation, 0, reservation.size, "release_reservation")
            self._wait_tokens(reservation)
            self._ledger.check_quiet(reservation, "release_reservation")
            # counted as a free (backing_changes): one that raises may have dropped pages and left it alive
            self._frees[reservation.id] = self._frees.get(reservation.id, 0) + 1
            try:
                dropped = self._backend_release(reservation)
            except Exception as exc:
                if (untyped := self._failed("release_reservation", exc, reservation)) is None:
                    raise
                raise untyped from exc
            reservation.released = True
            reservation._seat = None
            token = RELEASED  # what the permit holds from now on
            self._ledger.on_release(reservation)
            self._live.pop(reservation, None)
            self._views.pop(reservation, None)
            self._moving.pop(reservation.id, None)
            self._frees.pop(reservation.id, None)
        finally:
            self._permits.give(permit, token)
        return dropped

    def give_back(self, r: Any) -> None:
        """Return a reservation that failed after the backend made it; never raises."""
        if not isinstance(r, Reservation):
            return  # nothing a backend could release
        self._live.pop(r, None)
        r._seat = None
        self._views.pop(r, None)
        self._ledger.forget(r)
        try:
            self._backend_release(r)
        except Exception as exc:
            log.error("membackend: backend %r could not give back reservation #%s after a failed reserve: %s",
                      self._name, r.id, exc)

    def release_all(self, fence: Callable[[Any, Reservation], None],
                    may_have_work: Callable[[Reservation], bool]) -> tuple[int, list[tuple[str, BaseException]]]:
        """Release every reservation still alive, fencing first where work may be recorded (``fence(None, r)``);
        a failure is noted and the rest go on. Returns how many were released and the failures."""
        released = 0
        failures: list[tuple[str, BaseException]] = []
        for r in list(self._live):
            if r.released or r not in self._live:
                continue  # released by another thread meanwhile
            if may_have_work(r):  # a copy that failed unreported is reported here, not a reason to keep r
                try:
                    fence(None, r)
                except ReservationReleased:
                    continue
                except MembackendError as exc:
                    failures.append((f"fence(#{r.id} on {r.device})", exc))
            try:
                self.release(r)
                released += 1
            except ReservationReleased:
                continue  # released by another thread between the check and the release
            except MembackendError as exc:
                failures.append((f"release_reservation(#{r.id} on {r.device})", exc))
        return released, failures


def close_session(name: str, released: tuple[int, list[tuple[str, BaseException]]], trim: Callable[[], int],
                  take_back_headroom: Callable[[], None], backend_close: Callable[[], None] | None,
                  tracer_close: Callable[[], None] | None) -> int:
    """The rest of ``Session.close`` once ``released`` (:meth:`Lifecycle.release_all`'s answer): ``trim()`` every
    device served, take the headroom back from the backend, ``backend_close()`` (what it holds of the driver:
    a primary context), ``tracer_close()`` (the trace file the session owns); then one ``PartialFailure``
    naming every failure, or the count released."""
    count, failures = released
    try:
        trim()
    except PartialFailure as exc:
        failures += exc.failures
    except MembackendError as exc:
        failures.append(("trim", exc))
    take_back_headroom()  # a closed session decides nothing for the backend any more
    if backend_close is not None:
        try:
            backend_close()
        except Exception as exc:
            failures.append(("close", exc if isinstance(exc, MembackendError) else
                             PluginError(f"backend {name!r} raised {type(exc).__name__} in close: {exc}")))
    if tracer_close is not None:
        tracer_close()
    if failures:
        raise PartialFailure("close", failures)
    return count

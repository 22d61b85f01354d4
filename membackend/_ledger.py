"""Authoritative accounting of what a session holds, per device.

The session updates the ledger after every successful verb, so the numbers
here are what membackend believes the driver holds: reserved bytes, resident
bytes, reservations alive, and fence tokens recorded but not yet waited for.
In sanitize mode it also checks the rules behind G1 and G2: nothing is freed
or released while recorded work is unfinished, a released reservation is
never used again, and nothing is released twice. It remembers where each
reservation was released so the error can say so.

Thread safety: every update and every multi-field read happens under one
lock, so updates for different reservations from different threads never
lose each other (a read-modify-write of a device total is one step). The
lock is never held while a fence token is waited for or a backend is called.
"""

from __future__ import annotations

import threading
import traceback
from dataclasses import dataclass
from typing import Mapping

from .types import Device, FenceToken, Reservation, ReservationReleased, SanitizerError

__all__ = ["Ledger", "DeviceAccount"]

RELEASE_HISTORY = 4096  # where the newest released reservations were released, for sanitizer messages


@dataclass
class DeviceAccount:
    """Totals for one device; a snapshot when returned by :meth:`Ledger.account`."""

    reserved: int = 0
    resident: int = 0
    reservations_alive: int = 0
    pending_fences: int = 0


def _finished(token: FenceToken) -> bool:
    """Whether ``token`` reports done; a token whose ``done()`` raises is not known to be done."""
    try:
        return bool(token.done())
    except Exception:
        return False


def still_running(token: FenceToken) -> bool:
    """Whether ``token`` says its work is still running (``done()`` answers false). After its ``wait()``
    raised, a token whose ``done()`` raises too has failed for good -- a copy that errored is not running --
    and counts as finished once the error is reported."""
    try:
        return not token.done()
    except Exception:
        return False


class Ledger:
    """Per-device and per-reservation accounting, plus the sanitizer's checks (thread-safe)."""

    def __init__(self, sanitize: bool = False):
        self.sanitize = sanitize
        self._devices: dict[Device, DeviceAccount] = {}
        self._resident: dict[int, int] = {}  # reservation id -> resident bytes; its keys are the live ids
        #: reservation id -> resident bytes; read-only, for the session's hot path (a value changes only under
        #: that reservation's gate, by the session's verbs on it)
        self.resident_by_id: Mapping[int, int] = self._resident
        self._pending: dict[int, tuple[Device, list[FenceToken]]] = {}  # reservation id -> (device, tokens)
        #: ids of reservations with recorded tokens; read-only, for cheap membership tests
        self.pending_ids = self._pending.keys()
        self._released_at: dict[int, str] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ reads

    def account(self, device: Device) -> DeviceAccount:
        with self._lock:
            a = self._devices.get(device)
            return DeviceAccount(**vars(a)) if a else DeviceAccount()

    def devices(self) -> list[Device]:
        with self._lock:
            return sorted(self._devices)

    def resident(self, reservation: Reservation) -> int:
        return self._resident.get(reservation.id, 0)

    def pending(self, reservation: Reservation) -> list[FenceToken]:
        with self._lock:
            entry = self._pending.get(reservation.id)
            return list(entry[1]) if entry else []

    def alive(self) -> int:
        return len(self._resident)

    # ------------------------------------------------------------------ checks

    def check_alive(self, reservation: Reservation, verb: str) -> None:
        """Raise when ``reservation`` was released (``SanitizerError`` in sanitize mode)."""
        if not reservation.released:
            return
        where = self._released_at.get(reservation.id)
        text = f"{verb} on reservation #{reservation.id} ({reservation.device}) after it was released"
        if self.sanitize:
            kind = "double release" if verb == "release_reservation" else "use after release"
            raise SanitizerError(f"{kind}: {text}" + (f"; released at:\n{where}" if where else ""))
        raise ReservationReleased(text + "; reserve again to get a new one")

    def check_quiet(self, reservation: Reservation, verb: str) -> None:
        """Sanitize mode: raise if recorded work on the reservation is still running.

        Called right before the backend unmaps, after the session's fence; an
        unfinished token here means a fence was skipped, a token lied about its
        wait, or work was recorded concurrently with the free (G2). A token
        whose ``done()`` raises counts as unfinished.
        """
        if not self.sanitize:
            return
        with self._lock:
            entry = self._pending.get(reservation.id)
            tokens = list(entry[1]) if entry else []
        busy = [t for t in tokens if not _finished(t)]
        if busy:
            raise SanitizerError(
                f"{verb} on reservation #{reservation.id} ({reservation.device}) while "
                f"{len(busy)} recorded asynchronous operation(s) are unfinished: {busy[0]!r}"
            )

    # ------------------------------------------------------------------ updates (each one atomic)

    def _dev(self, device: Device) -> DeviceAccount:
        a = self._devices.get(device)
        if a is None:
            a = self._devices[device] = DeviceAccount()
        return a

    def on_reserve(self, r: Reservation) -> None:
        with self._lock:
            a = self._dev(r.device)
            a.reserved += r.size
            a.reservations_alive += 1
            self._resident[r.id] = 0

    def on_fault(self, r: Reservation, mapped: int) -> None:
        if mapped:
            with self._lock:
                self._devices[r.device].resident += mapped
                self._resident[r.id] += mapped

    def on_free(self, r: Reservation, dropped: int) -> None:
        if dropped:
            with self._lock:
                self._devices[r.device].resident -= dropped
                self._resident[r.id] -= dropped

    def on_release(self, r: Reservation) -> None:
        where = "".join(traceback.format_stack(limit=8)[:-2]) if self.sanitize else ""
        with self._lock:
            a = self._devices[r.device]
            a.reserved -= r.size
            a.reservations_alive -= 1
            a.resident -= self._resident.pop(r.id, 0)
            entry = self._pending.pop(r.id, None)
            a.pending_fences -= len(entry[1]) if entry else 0
            if self.sanitize:
                self._released_at[r.id] = where
                if len(self._released_at) > RELEASE_HISTORY:  # a long run keeps the newest only
                    del self._released_at[next(iter(self._released_at))]

    def forget(self, r: Reservation) -> None:
        """Undo :meth:`on_reserve` for a reservation given back before anyone saw it (a failed reserve)."""
        with self._lock:
            if self._resident.pop(r.id, None) is None:
                return
            a = self._devices[r.device]
            a.reserved -= r.size
            a.reservations_alive -= 1

    def record(self, r: Reservation, token: FenceToken) -> None:
        """Keep ``token`` until a fence waits for it; refused once ``r`` is released (no stale tokens)."""
        with self._lock:
            if r.id not in self._resident:
                raise ReservationReleased(f"record on reservation #{r.id} ({r.device}): it is not alive in this "
                                          f"ledger (released, or never reserved here); nothing was recorded")
            entry = self._pending.get(r.id)
            if entry is None:
                entry = self._pending[r.id] = (r.device, [])
            entry[1].append(token)
            self._devices[r.device].pending_fences += 1

    def take_pending(self, device: Device, r: Reservation | None) -> dict[int, tuple[Device, list[FenceToken]]]:
        """Remove and return the tokens of ``r``, or of every reservation on ``device``."""
        with self._lock:
            ids = [r.id] if r is not None else [rid for rid, (dev, _) in self._pending.items() if dev == device]
            taken = {rid: self._pending.pop(rid) for rid in ids if rid in self._pending}
            for dev, tokens in taken.values():
                self._devices[dev].pending_fences -= len(tokens)
            return taken

    def restore_pending(self, taken: dict[int, tuple[Device, list[FenceToken]]]) -> None:
        """Put back every token of a fence that failed unless it reports done, so nothing is lost (G2).

        A token whose ``done()`` raises is kept. Tokens of a reservation
        released meanwhile are dropped with it.
        """
        kept = {rid: (dev, [t for t in tokens if not _finished(t)]) for rid, (dev, tokens) in taken.items()}
        with self._lock:
            for rid, (dev, left) in kept.items():
                if left and rid in self._resident:
                    self._pending.setdefault(rid, (dev, []))[1][:0] = left  # oldest first
                    self._devices[dev].pending_fences += len(left)

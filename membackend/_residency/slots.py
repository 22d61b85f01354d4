"""The policy's page map of one reservation (:class:`Slot`) and the byte checks every verb shares.

A slot follows every verb's outcome exactly as the session's ledger does, so its resident bytes always
equal the ledger's for the reservation, failed verbs included.
"""

from __future__ import annotations

import logging
import operator
import weakref
from array import array
from typing import Any

from ..types import Device, DriverError, InvalidSize, ModelError, OutOfRange, Reservation

log = logging.getLogger(__name__)

# what the policy's page map says about one page
GONE, RESIDENT, UNKNOWN = 0, 1, 2  # UNKNOWN: a driver call on it failed part-way; it may be resident

#: the pin counts: 16 bits per page (a model of 64 GiB in 2 MiB pages counts its pins in 64 KiB), widened to
#: 64 bits for a slot only when one of its pages reaches 65,535 pins (a leak of pins, or a page holding
#: tens of thousands of small weights): no count can overflow in practice then
PINS, WIDE_PINS = "H", "Q"


def no_pins(pages: int) -> array:
    """Pin counts of ``pages`` pages, all 0, in the narrow width."""
    return array(PINS, bytes(array(PINS).itemsize * pages))


def as_int(value: Any, what: str) -> int:
    """``value`` as an int number of bytes (``what`` names it in the error); a bool or a non-integer is
    refused with :class:`~membackend.types.InvalidSize`."""
    if value.__class__ is int:
        return value
    from .._settings import quoted

    if isinstance(value, bool):
        raise InvalidSize(f"{what} must be an integer number of bytes, got {value!r}; accepted: an int, not a bool")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidSize(f"{what} must be an integer number of bytes, got {quoted(value)}") from None


def _changed(exc: BaseException) -> tuple[int, int]:
    """Bytes a failed verb still mapped and dropped, exactly as the session's ledger takes them."""
    if isinstance(exc, DriverError):
        return getattr(exc, "mapped", 0) or 0, getattr(exc, "dropped", 0) or 0
    return 0, 0


class Slot:
    """A model's reservation on one device, with the policy's page map.

    ``resident[p]`` is GONE, RESIDENT or UNKNOWN. A page is UNKNOWN after a
    fault or free over it raised: the driver may have left it mapped (a
    rollback that could not unmap) or dropped it (a free that stopped half
    way). ``maybe`` is how many bytes of the UNKNOWN pages are resident, as the
    ledger counts them (``DriverError.mapped`` / ``.dropped``), so the slot's
    resident bytes always equal the ledger's for the reservation. UNKNOWN pages
    count as resident for eviction and unload (they are freed, and the free
    says how much went) and as missing for faults (they are backed again).

    ``pins[p]`` counts the pins of page ``p`` (:meth:`pin`, :meth:`unpin`); a pin of a range is all or
    nothing: one that cannot be counted raises a typed error with every count as it was.

    ``frees`` is how many frees of the reservation the session had counted (``Session.backing_changes``)
    when the map last followed them: a free made straight through the session, past the manager, moves the
    session's count and not this one, and the manager then stops trusting the map (:meth:`unseen_frees`).
    """

    __slots__ = ("model", "device", "reservation", "resident", "maybe", "pins", "watermark", "kept", "epoch", "hold",
                 "tags", "frees")

    def __init__(self, model: Any, device: Device):
        # ``model``: the :class:`~.model.Model` the slot belongs to (typed Any, as its weak proxy is: this module
        # never imports the models, which import it); a stock finalizer holds slots, they must not keep it alive
        self.model: Any = weakref.proxy(model)
        self.device = device
        self.reservation: Reservation | None = None
        self.resident = bytearray()
        self.maybe = 0
        self.pins = no_pins(0)
        self.watermark: int | None = None  # faults reaching above fail fast; None: no limit
        # bytes of pages freed whose memory stays with the reservation, for its own next faults (where memory
        # returns only when the range is freed: ``memory_returns_on_unmap`` false); 0 elsewhere
        self.kept = 0
        #: counts every change that may take a page's backing or generation (a free, a failure, a release,
        #: a new reservation): a :class:`~membackend._residency.WarmRange` made at one count holds until the next
        self.epoch = 0
        #: the :class:`~membackend._residency.holds.Hold` on its pages (None: none); no page of a held slot is
        #: freed until the hold ends
        self.hold: Any = None
        #: the :class:`~membackend._residency.content.Tags` of what its pages hold (None: nothing known); a
        #: change to a page's backing drops the tags over it
        self.tags: Any = None
        self.frees = 0

    def bind(self, r: Reservation) -> None:
        self.epoch += 1
        self.tags = None
        self.reservation = r
        self.resident = bytearray(r.pages)
        self.maybe = 0
        self.pins = no_pins(r.pages)
        self.watermark = None
        self.kept = 0
        self.frees = 0  # a new reservation: the session has seen no free of it

    def clear_pins(self) -> None:
        self.pins = no_pins(len(self.pins))

    @property
    def alive(self) -> bool:
        return self.reservation is not None and not self.reservation.released

    @property
    def bound(self) -> Reservation:
        """The reservation of a slot that was bound: every verb of the policy runs on a bound slot."""
        r = self.reservation
        assert r is not None, "a slot is bound to its reservation before the policy works on it"
        return r

    def pages(self, offset: Any, size: Any) -> tuple[int, int, int, int]:
        """Check a byte range of the slot's model; returns ``(offset, size, first page, end page)``."""
        offset, size = as_int(offset, "offset"), as_int(size, "size")
        model = self.model
        if size <= 0:
            raise InvalidSize(f"size must be > 0, got {size}")
        if offset < 0 or offset + size > model.size:
            raise OutOfRange(f"range [{offset}, {offset + size}) is outside model {model.id!r} of {model.size} "
                             f"bytes; accepted: 0 <= offset and offset + size <= {model.size}")
        ps = self.reservation.page_size if self.reservation is not None else 1
        return offset, size, offset // ps, (offset + size - 1) // ps + 1

    def resident_bytes(self) -> int:
        return self.resident.count(RESIDENT) * self.bound.page_size + self.maybe if self.alive else 0

    def all_resident(self, first: int, last: int) -> bool:
        return self.resident.count(RESIDENT, first, last) == last - first

    def missing(self, first: int, last: int) -> int:
        """Bytes of ``[first, last)`` not known to be resident (UNKNOWN pages included)."""
        return (last - first - self.resident.count(RESIDENT, first, last)) * self.bound.page_size

    def pin(self, first: int, last: int) -> None:
        """One more pin on each page of ``[first, last)``, all or none. A page at the most its counts hold
        widens them (16 to 64 bits, once per slot); past 64 bits (never in practice) :class:`ModelError`
        with every count as it was."""
        pins = self.pins
        p = first
        try:
            for p in range(first, last):
                pins[p] += 1
        except OverflowError:
            for q in range(first, p):  # the pages this call counted already: as they were
                pins[q] -= 1
            if pins.typecode == WIDE_PINS:
                raise ModelError(
                    f"page {p} of model {self.model.id!r} on {self.device} is pinned {pins[p]} times, the most a "
                    f"pin count holds; nothing was pinned. Accepted: unpin what was faulted (one unpin per "
                    f"fault) before pinning it again") from None
            self.pins = array(WIDE_PINS, pins)
            self.pin(first, last)

    def unpin(self, first: int, last: int) -> None:
        pins = self.pins
        for p in range(first, last):
            if pins[p]:
                pins[p] -= 1

    # the map follows every verb's outcome exactly as the ledger does

    def faulted(self, first: int, last: int, mapped: int) -> None:
        """A fault of pages ``[first, last)`` succeeded and newly backed ``mapped`` bytes."""
        unknown = self.resident.count(UNKNOWN, first, last)
        if unknown:  # what was not newly backed among the not-known pages was resident already
            self.maybe -= self.missing(first, last) - mapped
        self.resident[first:last] = b"\x01" * (last - first)
        self._settle()

    def freed(self, first: int, last: int, dropped: int) -> None:
        """A free of pages ``[first, last)`` succeeded and dropped ``dropped`` bytes."""
        self.epoch += 1
        self._untag(first, last)
        if self.resident.count(UNKNOWN, first, last):
            self.maybe -= dropped - self.resident.count(RESIDENT, first, last) * self.bound.page_size
        self.resident[first:last] = bytes(last - first)
        self._settle()

    def fault_failed(self, first: int, last: int, exc: BaseException) -> None:
        """A fault of ``[first, last)`` raised: its pages not known resident may be mapped now (unpinned)."""
        self.epoch += 1
        self._untag(first, last)
        mapped, dropped = _changed(exc)
        r = self.resident
        for p in range(first, last):
            if r[p] == GONE:
                r[p] = UNKNOWN
        self.maybe += mapped - dropped

    def free_failed(self, first: int, last: int, exc: BaseException) -> None:
        """A free (or release) of ``[first, last)`` raised: its resident pages may or may not be gone."""
        self.epoch += 1
        self._untag(first, last)
        mapped, dropped = _changed(exc)
        r = self.resident
        known = r.count(RESIDENT, first, last)
        for p in range(first, last):
            if r[p] == RESIDENT:
                r[p] = UNKNOWN
        self.maybe += known * self.bound.page_size + mapped - dropped

    def _settle(self) -> None:
        # only a backend whose results disagree with its own errors can trip these; keep the map sane
        if UNKNOWN not in self.resident and self.maybe:
            log.warning("membackend: model %s on %s: %d resident byte(s) unaccounted once every page was settled",
                        self.model.id, self.device, self.maybe)
            self.maybe = 0
        elif self.maybe < 0:
            self.maybe = 0

    def _untag(self, first: int, last: int) -> None:
        """Pages ``[first, last)`` changed backing (or may have): what was known of their bytes goes."""
        if self.tags and self.reservation is not None:
            ps = self.reservation.page_size
            self.tags.drop(first * ps, last * ps)

    def released(self) -> None:
        self.epoch += 1
        self.tags = None
        self.resident = bytearray(len(self.resident))
        self.maybe = 0
        self.kept = 0

    def unseen_frees(self, resident: int, frees: int) -> None:
        """The session counts ``frees`` frees of the reservation, more than the map followed: a caller freed
        pages of it straight through the session (``Session.free``), which the policy cannot name. Every page
        the map holds resident becomes UNKNOWN -- resident for eviction and unload, missing for faults, so
        the next fault backs what went again and answers a new generation for it -- with the ledger's
        ``resident`` bytes as theirs; what was known of their bytes (tags) and every warm range go."""
        self.epoch += 1
        self.tags = None
        r = self.resident
        r[:] = r.replace(b"\x01", b"\x02")  # RESIDENT -> UNKNOWN, in place: callers may hold the map
        self.maybe = resident
        self.frees = frees

"""The VMM backend's books: one page table per reservation, one record per device.

Data only: the parts (:mod:`.pages`, :mod:`.handles`, :mod:`.windows`, ...) change these records under the
backend's lock; nothing here asks a driver.
"""

from __future__ import annotations

from array import array
from typing import Any


class PageTable:
    """One reservation's pages (its ``Reservation.handle``).

    ``handles[p]`` is the physical handle mapped at page p (None: nothing
    mapped, the page is not resident); ``ready[p]`` is 1 once access is set
    too. A page can be mapped but not ready when a failed fault could not be
    rolled back: it counts as resident, and the next fault finishes it.
    """

    __slots__ = ("index", "window", "handles", "ready", "generations", "spare")

    def __init__(self, index: int, pages: int, window: int):
        self.index = index
        self.window = window  # bytes of address space behind it (a reused window may be larger)
        self.handles: list[Any] = [None] * pages
        self.ready = bytearray(pages)
        self.generations = array("Q", bytes(8 * pages))
        # handles unmapped from this range and kept with it where memory returns only when the range is freed
        # (``memory_returns_on_unmap`` false): its own next faults map them, its release gives them back
        self.spare: list[Any] = []


class DeviceState:
    """What the backend knows and holds on one device, made on the device's first use."""

    __slots__ = ("granularity", "page_size", "page_in_sync", "dirty", "reserved", "resident", "spare",
                 "integrated", "ranges")

    def __init__(self, granularity: int, page_size: int, page_in_sync: bool, integrated: bool = False):
        self.granularity = granularity
        self.integrated = integrated  # one pool with the host (a device fact: asked once, not per budget)
        self.page_size = page_size
        self.page_in_sync = page_in_sync  # fresh mappings may still be paging in: synchronize before unmapping
        self.dirty = False  # pages mapped since the last device synchronize
        self.reserved = 0  # address space of live reservations (whole windows)
        self.resident = 0
        self.spare: list[Any] = []  # unmapped physical handles kept for reuse
        # the live reservations' page tables with their page size: the handles kept with a range
        # (``PageTable.spare``) belong to the handle ledger that ``membackend_inspect`` reports on a real driver
        self.ranges: dict[PageTable, int] = {}

    def kept_bytes(self) -> int:
        """Bytes of the handles kept unmapped: the device's, and those kept with its live ranges."""
        return len(self.spare) * self.page_size + sum(len(r.spare) * p for r, p in self.ranges.items())

"""What the resident pages hold, and the models their owners dropped kept as cache (issue 41, item 2).

**Content tags.** A caller that wrote known bytes into a range -- the bytes of a file at an offset, say -- tags
the range with a key naming them (:meth:`Contents.tag`); one that is about to write anything else into a range
drops the tags over it first (:meth:`Contents.untag`). A tag lives exactly as long as the bytes under it: any
change to a page's backing (a free, a failed verb, a release, a new reservation) drops every tag over that page
(:class:`Tags`, kept by each :class:`~.slots.Slot`). A later reader of the same key can then copy the bytes from
the device (:meth:`Contents.borrow`) instead of reading them again.

**Cached models.** A model its owner dropped (ComfyUI collected it) may keep the pages whose bytes are tagged as
*cache*: reclaimable memory that no live model holds (:meth:`Contents.cache`). The cache goes first, always:

* eviction of any kind takes cached models before any page of a live model (``Eviction.by_priority`` puts them
  first, least recently dropped first), within the call that needs the room -- a fault, keeping the headroom,
  a lowered cap, freeing by amount;
* its size is bounded by the manager's ``cache_limit`` per device (None: only by the budget; 0: nothing is
  cached);
* a borrowed range of a cached model *moved* to its new owner: its tag goes, and each page no tag covers any
  more is freed at once, so a model loaded again from the same file holds its bytes once, not twice;
* ``unload_all`` takes it with everything else; :meth:`Contents.drop` takes just the cache.

A cached model stays registered until a later :meth:`Contents.sweep` (its slot released, nothing resident):
eviction loops hold only weak references to models, so none is unregistered inside one.
"""

from __future__ import annotations

import bisect
import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Hashable

from ..types import Device, Reservation
from .slots import RESIDENT, Slot

if TYPE_CHECKING:
    from .eviction import Eviction
    from .loads import LoadBook
    from .model import Model
    from .registry import Registry

log = logging.getLogger(__name__)

__all__ = ["Tags", "Contents", "Borrowed"]


class Tags:
    """The tagged byte ranges of one reservation: ``[start, end)`` with a key each, never overlapping."""

    __slots__ = ("starts", "entries", "by_key")

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.entries: list[tuple[int, int, Hashable]] = []  # sorted by start
        self.by_key: dict[Hashable, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def _overlapping(self, start: int, end: int) -> tuple[int, int]:
        """The index span of the entries overlapping ``[start, end)``."""
        lo = bisect.bisect_right(self.starts, start) - 1
        if lo < 0 or self.entries[lo][1] <= start:
            lo += 1
        hi = bisect.bisect_left(self.starts, end, lo)
        return lo, hi

    def drop(self, start: int, end: int) -> int:
        """Drop every tag overlapping ``[start, end)``; returns how many went."""
        lo, hi = self._overlapping(start, end)
        for _, _, key in self.entries[lo:hi]:
            self.by_key.pop(key, None)
        del self.entries[lo:hi], self.starts[lo:hi]
        return hi - lo

    def add(self, start: int, end: int, key: Hashable) -> None:
        """Tag ``[start, end)`` with ``key`` (a key names one range: its earlier range goes)."""
        old = self.by_key.get(key)
        if old is not None:
            self.drop(*old)
        self.drop(start, end)
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.entries.insert(i, (start, end, key))
        self.by_key[key] = (start, end)

    def covered(self, start: int, end: int) -> bool:
        """Whether any tag overlaps ``[start, end)``."""
        lo, hi = self._overlapping(start, end)
        return hi > lo

    def pages(self, page_size: int, pages: int) -> bytearray:
        """One byte per page: 1 where a tag covers part of it."""
        out = bytearray(pages)
        for start, end, _ in self.entries:
            out[start // page_size:(end - 1) // page_size + 1] = b"\x01" * ((end - 1) // page_size + 1 - start // page_size)
        return out


@dataclass
class Borrowed:
    """A tagged range lent for one copy (:meth:`Contents.borrow`): ``address`` is its first byte on the device;
    its pages are pinned and viewed (no free, no release) until :meth:`Contents.returned`."""

    slot: Slot
    reservation: Reservation
    offset: int
    size: int
    key: Hashable
    drop_view: Callable[[], None]

    @property
    def address(self) -> int:
        return self.reservation.base + self.offset


class Contents:
    """The manager's content tags and its cache of dropped models, on its registry; every method runs under the
    registry's lock (its callers hold it).

    ``eviction`` frees and orders the slots; ``loads`` is the manager's load book; ``unregister(model, via)``
    forgets a model (``Unloading.unregister``)."""

    def __init__(self, registry: Registry, loads: LoadBook, eviction: Eviction, *,
                 unregister: Callable[[Model, str | None], None]):
        self.registry = registry
        self.loads = loads
        self.eviction = eviction
        self.unregister = unregister

    # ------------------------------------------------------------------ tags

    def tag(self, slot: Slot, offset: int, size: int, key: Hashable) -> bool:
        """Tag ``[offset, offset+size)`` of ``slot`` with ``key``; False (nothing tagged) unless every page of it
        is resident now."""
        if not slot.alive:
            return False
        self.registry.sync(slot)  # pages freed past the manager hold nothing known
        ps = slot.bound.page_size
        first, last = offset // ps, (offset + size - 1) // ps + 1
        if not slot.all_resident(first, last):
            return False
        if slot.tags is None:
            slot.tags = Tags()
        slot.tags.add(offset, offset + size, key)
        return True

    def untag(self, slot: Slot, offset: int, size: int) -> None:
        if slot.tags is not None:
            slot.tags.drop(offset, offset + size)

    def borrow(self, device: Device, key: Hashable, avoid: tuple[Slot, int, int] | None = None) -> Borrowed | None:
        """A resident range tagged ``key`` on ``device`` (cached models first, then live ones), pinned and
        viewed for one copy; None when there is none. ``avoid``: a range the copy writes into (never its own
        source)."""
        reg = self.registry
        for slot in self.eviction.by_priority(device):
            reg.sync(slot)  # a free made past the manager drops the tags over what it took
            tags = slot.tags
            found = tags.by_key.get(key) if tags is not None else None
            if found is None:
                continue
            start, end = found
            if avoid is not None and avoid[0] is slot and start < avoid[2] and avoid[1] < end:
                continue
            r = slot.bound
            ps = r.page_size
            first, last = start // ps, (end - 1) // ps + 1
            if not slot.all_resident(first, last):
                continue
            try:
                drop = reg.session.add_view(r, start, end - start)
            except Exception as exc:  # noqa: BLE001 - released meanwhile: not a source
                log.debug("membackend: a cached range could not be viewed: %s", exc)
                continue
            slot.pin(first, last)
            return Borrowed(slot, r, start, end - start, key, drop)
        return None

    def returned(self, lent: Borrowed, moved: bool) -> int:
        """The copy from ``lent`` is done (queued work on it already fenced by a recorded token): unpin it; where
        its model is cached and the bytes ``moved`` to their new owner, its tag goes and every page of it no
        tag covers any more is freed. Returns the bytes freed."""
        slot = lent.slot
        lent.drop_view()
        if slot.reservation is not lent.reservation:
            return 0
        ps = lent.reservation.page_size
        first, last = lent.offset // ps, (lent.offset + lent.size - 1) // ps + 1
        slot.unpin(first, last)
        if not (moved and slot.model.cached and slot.tags is not None):
            return 0
        slot.tags.drop(lent.offset, lent.offset + lent.size)
        freed = 0
        for p in range(first, last):
            if not slot.pins[p] and slot.resident[p] == RESIDENT and not slot.tags.covered(p * ps, (p + 1) * ps):
                freed += self.eviction.free_pages(slot, p, p + 1)
        if not slot.tags and not slot.resident_bytes():  # every byte of it moved: the cached model goes
            model = self.registry.models.get(slot.model.id)
            if model is not None:
                self.unregister(model, "cache")
        return freed

    # ------------------------------------------------------------------ the cache

    def cache(self, model: "Model", limit: int | None) -> int:
        """Keep ``model`` (its owner dropped it: no pin or hold of it will end otherwise) as cache: every page
        of it no tag covers is freed now, the tagged ones stay, reclaimable; then the cache is fitted to
        ``limit`` bytes per device and to the budget. Returns the bytes kept; 0 (nothing kept, the model left
        as it was) where ``limit`` is 0 or nothing of it is tagged."""
        reg = self.registry
        if limit == 0 or not any(s.alive and s.tags for s in model.slots.values()):
            return 0
        model.cached = True
        reg.running.discard(model.id)  # no run uses what its owner dropped
        model.last_used = next(reg.clock)  # least recently dropped first, after every live model
        kept = 0
        for slot in model.slots.values():
            if not slot.alive:
                continue
            self.eviction.let_go(slot, "dropped by its owner", for_others=False)
            slot.clear_pins()
            tagged = slot.tags.pages(slot.bound.page_size, slot.bound.pages) if slot.tags else bytearray(
                slot.bound.pages)
            p, pages = 0, slot.bound.pages
            while p < pages:  # untagged runs: nothing reads them again
                if tagged[p] or not slot.resident[p]:
                    p += 1
                    continue
                q = p
                while q < pages and not tagged[q] and slot.resident[q]:
                    q += 1
                self.eviction.free_pages(slot, p, q)
                p = q
            kept += slot.resident_bytes()
        self.loads.forget(model.id)
        reg.trace("cache", model, bytes=kept)
        for device in model.devices:
            if limit is not None:
                over = self.cached(device) - limit
                if over > 0:
                    self.drop(device, over, "cache over its limit")
            if self.eviction.keep_warm(device, "the cache within the budget") is not None:  # as keep_warm does
                self.sweep()
        return sum(s.resident_bytes() for s in model.slots.values())

    def cached(self, device: Device | None = None) -> int:
        """Bytes of cached models resident on ``device`` (every device: None)."""
        return sum(s.resident_bytes() for mod in self.registry.models.values() if mod.cached
                   for d, s in mod.slots.items() if device is None or d == device)

    def drop(self, device: Device | None, amount: float = math.inf, reason: str = "cache dropped") -> int:
        """Release cached models on ``device`` (every device: None), least recently dropped first, until
        ``amount`` bytes went; returns the bytes freed."""
        reg = self.registry
        freed = 0
        devices = [device] if device is not None else sorted({d for x in reg.models.values() for d in x.devices},
                                                              key=str)
        for dev in devices:
            for slot in self.eviction.by_priority(dev):
                if freed >= amount:
                    break
                if slot.model.cached:
                    dropped = self.eviction.empty(slot, release=True)
                    freed += dropped
                    reg.trace("evict_model", slot.model, device=str(dev), bytes=dropped, reason=reason)
        self.sweep()
        return freed

    def sweep(self) -> int:
        """Unregister every cached model with nothing left reserved; returns how many went."""
        gone = [mod for mod in self.registry.models.values()
                if mod.cached and not any(s.alive for s in mod.slots.values())]
        if not gone:
            return 0
        for mod in gone:
            self.unregister(mod, "cache")
        return len(gone)

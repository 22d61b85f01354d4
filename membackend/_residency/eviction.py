"""How the manager frees memory: by priority, whole models or pages from the top down, for a fault, for
another model, or by amount (:class:`Eviction`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ..types import Device, TensorAlive
from .slots import GONE, Slot

if TYPE_CHECKING:
    from .loads import LoadBook
    from .registry import Registry

#: a fault's own slot and its page range ``[first, last)``, which eviction for that fault never frees
Protect = tuple[Slot, int, int]


class Eviction:
    """The manager's eviction, on its registry: what to free, in which order, and freeing it through the session.

    Every method runs under the registry's lock (its callers hold it) and keeps the slots' page maps agreeing
    with the session's ledger. Losses are noted in ``loads`` (the manager's load book) and decisions go to the
    registry's trace.
    """

    def __init__(self, registry: Registry, loads: LoadBook):
        self.registry = registry
        self.loads = loads

    def by_priority(self, device: Device) -> list[Slot]:
        """Live slots on ``device``, lowest priority first: the cache (dropped models, least recently dropped
        first), then the live models, least recently used first."""
        slots = [s for m in self.registry.models.values() for d, s in m.slots.items() if d == device and s.alive]
        return sorted(slots, key=lambda s: (not s.model.cached, s.model.last_used))

    def whole_models(self, device: Device, amount: int, protect: Slot | None, reason: str) -> int:
        """Where the policy evicts whole models: free models outside the current run (never ``protect``'s),
        least recently used first, until ``amount`` bytes went; each gets a watermark at 0."""
        reg = self.registry
        freed = 0
        if not reg.policy.evicts_whole_models:
            return 0
        for slot in self.by_priority(device):
            if freed >= amount:
                break
            if slot.model.id in reg.running or slot is protect:
                continue
            dropped = self.for_others(slot, reason=reason)
            if dropped:
                freed += dropped
                slot.watermark = 0
                reg.trace("evict_model", slot.model, device=str(device), bytes=dropped, reason=reason)
                self.loads.lost(slot.model, dropped, reason, [protect.model] if protect is not None else reg.running)
        return freed

    def keep_warm(self, device: Device, reason: str) -> int | None:
        """The eviction of :meth:`~membackend.ResidencyManager.keep_warm`: whole models, least recently used
        first (never one the current run uses), until the budget's headroom on ``device`` is free again; returns
        bytes freed, None where the headroom was free (nothing was tried)."""
        b = self.registry.session.budget_query(device)
        deficit = b.headroom - b.free
        if deficit <= 0:
            return None
        return self.whole_models(device, deficit, None, reason)

    def for_fault(self, device: Device, amount: int, protect: Protect, reason: str) -> int:
        """Free at least ``amount`` bytes for a fault of ``protect``: whole models outside the current run
        first (least recently used first), then unpinned pages of the run's own models, lowest priority first,
        top down; the faulting model's own pages only where the policy sheds them for its faults."""
        reg = self.registry
        freed = self.whole_models(device, amount, protect[0], reason)
        for slot in self.by_priority(device):
            if freed >= amount:
                break
            own = slot is protect[0]
            if own and not reg.policy.sheds_own_pages_for_a_fault:
                continue
            dropped = self.shed(slot, amount - freed, protect) if own else \
                self.for_others(slot, amount - freed, protect, reason)
            if dropped:
                freed += dropped
                reg.trace("evict", slot.model, device=str(device), bytes=dropped, reason=reason,
                          watermark=slot.watermark)
                if not own:
                    self.loads.lost(slot.model, dropped, reason, [protect[0].model])
        return freed

    def by_amount(self, amount: int, device: Device, reason: str) -> int:
        """Free at least ``amount`` bytes on ``device`` by priority (pinned pages stay); returns bytes freed."""
        freed = 0
        for slot in self.by_priority(device):
            if freed >= amount:
                break
            dropped = self.for_others(slot, amount - freed, reason=reason)
            freed += dropped
            self.loads.lost(slot.model, dropped, reason)
        return freed

    def drop_pages(self, slot: Slot, *, unpin: bool) -> int | None:
        """The body of :meth:`~membackend.ResidencyManager.drop_pages` for a checked ``slot``: its hold ends,
        (``unpin``) its pins go, and every unpinned resident page is freed; the reservation stays. None when it is
        not alive or nothing of it is resident."""
        if not slot.alive:
            return None
        self.let_go(slot, "its pages dropped", for_others=False)
        if unpin:
            slot.clear_pins()
        if not any(slot.resident):
            return None
        return self.shed(slot, math.inf, None)

    def frees_by_release(self) -> bool:
        """The policy's :meth:`~membackend.ResidencyPolicy.frees_by_release` for the registry's session."""
        return self.registry.policy.frees_by_release(self.registry.session)

    def let_go(self, slot: Slot, reason: str, *, for_others: bool) -> bool:
        """Whether ``slot``'s pages may be freed now: True when nothing holds them, or once their
        :class:`~.holds.Hold` ended. A hold ends at once for its own model's request (``for_others`` false);
        for another model's room only while its model is outside the current run (see :mod:`.holds`)."""
        hold = slot.hold
        if hold is None:
            return True
        if for_others and slot.model.id in self.registry.running:
            return False
        hold.ended_by_manager(reason)
        return True

    def for_others(self, slot: Slot, amount: float = math.inf, protect: Protect | None = None,
                   reason: str = "room for another model") -> int:
        """Free ``slot``'s model for another: where only a release returns memory (:meth:`frees_by_release`)
        and nothing of it is pinned or viewed, by releasing its reservation (the model reserves again on its
        next fault), and not at all while a page of it is pinned or viewed; elsewhere up to ``amount`` bytes of
        its unpinned pages. A held slot is let go first, and kept while its model is in the current run."""
        if not self.let_go(slot, reason, for_others=True):
            return 0
        if slot.model.cached:  # the cache goes whole, pins or not (its owner dropped it: none will end)
            return self.empty(slot, release=True)
        if not self.frees_by_release():
            return self.shed(slot, amount, protect)
        if any(slot.pins) or self.viewed(slot):
            return 0  # its pages would stay the driver's: nothing for anyone else
        kept = slot.kept  # freed pages whose memory the range still holds: the release returns it too
        try:
            return self.empty(slot, release=True) + kept
        except TensorAlive:  # a tensor appeared meanwhile: nothing changed, nothing freed
            return 0

    def empty(self, slot: Slot, release: bool) -> int:
        """Fence ``slot``'s reservation, drop its pins, and free every page (``release``: by releasing the
        reservation); returns bytes dropped. A hold on it ends first. A release refused under a live tensor
        changes nothing."""
        self.let_go(slot, "full unload", for_others=False)
        r = slot.bound
        session = self.registry.session
        session.fence(reservation=r)
        pins = slot.pins
        slot.clear_pins()  # its pins go with it
        if not release:
            return self.shed(slot, math.inf, None)
        before = slot.frees
        try:
            dropped = session.release_reservation(r)
        except TensorAlive:  # refused, nothing changed: the model keeps its pages and pins
            slot.pins = pins
            raise
        except Exception as exc:
            slot.free_failed(0, r.pages, exc)
            self.registry.own_free(slot, r, before)  # it stays alive: the session counted the failed release
            raise
        slot.released()
        return dropped

    def shed(self, slot: Slot, amount: float, protect: Protect | None) -> int:
        """Free unpinned resident (or UNKNOWN) pages of ``slot`` from the top down, up to ``amount``
        bytes (rounded up to pages). Another model's reservation gets a watermark at the lowest page
        freed; the protected reservation (``protect``: a fault's own, or a shed's) keeps the
        protected range and gets none."""
        if slot.hold is not None:  # never under a hold: its callers end it first, or leave the slot alone
            return 0
        r = slot.bound
        ps = r.page_size
        own = protect is not None and protect[0] is slot
        lo, hi = (protect[1], protect[2]) if protect is not None and own else (0, 0)
        resident, pins = slot.resident, slot.pins
        held = self.viewed(slot)  # pages a live tensor views are skipped, as pinned ones are

        def evictable(p: int) -> bool:
            return bool(resident[p]) and not pins[p] and not lo <= p < hi and p not in held

        freed, lowest, p = 0, None, r.pages - 1
        while p >= 0 and freed < amount:
            if not evictable(p):
                p -= 1
                continue
            end = p + 1
            limit = math.ceil((amount - freed) / ps) if amount != math.inf else math.inf  # pages still wanted
            while p >= 0 and evictable(p) and end - p <= limit:
                p -= 1
            start = p + 1
            dropped = self.free_pages(slot, start, end)
            freed += dropped
            if dropped:  # a free refused under a live tensor drops nothing: no watermark over resident pages
                lowest = start * ps
        if lowest is not None and not own:
            slot.watermark = lowest if slot.watermark is None else min(slot.watermark, lowest)
        return freed

    def viewed(self, slot: Slot) -> frozenset[int] | set[int]:
        """Pages of ``slot`` that a live tensor from ``membackend._tensors`` views (never evicted)."""
        spans = self.registry.session.views(slot.bound)
        if not spans:
            return frozenset()
        ps = slot.bound.page_size
        return {p for a, b in spans for p in range(a // ps, (b - 1) // ps + 1)}

    def free_pages(self, slot: Slot, start: int, end: int) -> int:
        """Free pages ``[start, end)`` of ``slot``, after the policy's fence before a free; returns bytes
        dropped (0 where a tensor made over them since they were chosen refused it)."""
        reg = self.registry
        r = slot.bound
        reg.policy.fence_before_free(reg.session, slot.device, reg.in_fault)
        reg.sync(slot)  # the session's count of frees, as the map has followed it: this free adds one
        before = slot.frees
        try:
            dropped = reg.session.free(r, start * r.page_size, (end - start) * r.page_size)
        except TensorAlive:  # skipped, nothing changed
            return 0
        except Exception as exc:
            slot.free_failed(start, end, exc)
            reg.own_free(slot, r, before)
            raise
        slot.freed(start, end, dropped)
        reg.own_free(slot, r, before)
        if self.frees_by_release():
            slot.kept += dropped  # the range keeps their memory for its own next faults
        return dropped

    def evictable(self, device: Device) -> int:
        """Bytes of unpinned resident pages on ``device`` (what eviction could give back now)."""
        total = 0
        for slot in self.by_priority(device):
            ps = slot.bound.page_size
            held = self.viewed(slot)
            resident, pins = slot.resident, slot.pins
            if not held and pins.count(0) == len(pins):  # ComfyUI asks per load: counted in C when nothing is pinned
                total += (len(resident) - resident.count(GONE)) * ps
                continue
            total += sum(1 for i, (r, p) in enumerate(zip(resident, pins)) if r and not p and i not in held) * ps
        return total

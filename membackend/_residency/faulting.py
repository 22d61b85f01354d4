"""A fault past its warm path: reserving again after a full unload, the watermark, keeping the budget's
headroom, evicting until the driver backs it (:class:`Faulting`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..types import Device, Fault, Reservation
from .model import Model
from .slots import Slot

if TYPE_CHECKING:
    from .eviction import Protect
    from .loads import LoadBook
    from .registry import Registry


class Faulting:
    """The manager's faults, on its registry. Every method runs under the registry's lock (its callers hold it);
    a fault that raises leaves the pages it may have mapped UNKNOWN (unpinned) in the page map, as the ledger
    counts them.

    ``evict(device, amount, protect, reason)`` frees room for a fault (``Eviction.for_fault``);
    ``reserve(slot)`` reserves a slot again, unloading idle models for address space
    (``Unloading.reserve_making_room``); ``loads`` is the manager's load book."""

    def __init__(self, registry: Registry, loads: LoadBook, *,
                 evict: Callable[[Device, int, Protect, str], int], reserve: Callable[[Slot], None]):
        self.registry = registry
        self.loads = loads
        self.evict = evict
        self.reserve = reserve

    def making_room(self, model: Model, offset: Any, size: Any, device: Any) -> Fault:
        """:meth:`~membackend.ResidencyManager.fault` past its warm path: reserve again if fully unloaded,
        fail fast above a watermark, keep the headroom, evict until the driver backs the range."""
        reg = self.registry
        was, reg.in_fault = reg.in_fault, True  # what it frees, it frees to make room for a fault
        try:
            return self._making_room(model, offset, size, device)
        finally:
            reg.in_fault = was

    def _making_room(self, model: Model, offset: Any, size: Any, device: Any) -> Fault:
        reg = self.registry
        slot = reg.slot(model, device)
        offset, size, first, last = slot.pages(offset, size)
        refused = {"device": str(slot.device), "offset": offset, "bytes": size, "mapped": 0}
        if not slot.alive:  # used again after a full unload: reserve again, transparently
            try:
                self.reserve(slot)
            except MemoryError:  # refused for want of memory or address space, nothing left to unload
                reg.trace("fault", model, **refused, result="oom", reason="address space")
                return Fault(False, (), first, 0)
            offset, size, first, last = slot.pages(offset, size)
        r = slot.bound
        reg.sync(slot)  # pages freed past the manager are missing, not resident
        model.last_used = next(reg.clock)
        if slot.watermark is not None and offset + size > slot.watermark:
            reg.trace("fault", model, **refused, result="fail_fast", watermark=slot.watermark)
            return Fault(False, (), first, 0)
        evict = self.evict
        missing = slot.missing(first, last)
        need = missing - slot.kept if missing and slot.kept else missing  # its own kept memory covers the rest
        if need > 0:
            short = need - reg.session.budget_query(slot.device).usable
            if short > 0 and evict(slot.device, short, (slot, first, last), "headroom") < short:
                # past the budget a WDDM driver would spill to shared memory and a unified pool
                # would squeeze the host: out of memory is the caller's answer instead
                reg.trace("fault", model, **refused, result="oom", reason="budget")
                return Fault(False, (), first, 0)
        f = self.session_fault(slot, r, offset, size, first, last)
        while not f.ok:
            if not evict(slot.device, missing or r.page_size, (slot, first, last), "out of memory"):
                reg.trace("fault", model, **refused, result="oom", reason="driver")
                return f
            f = self.session_fault(slot, r, offset, size, first, last)
        return self.faulted(slot, offset, size, first, last, f)

    def faulted(self, slot: Slot, offset: int, size: int, first: int, last: int, f: Fault) -> Fault:
        """A fault of pages ``[first, last)`` succeeded (``f.ok``): the page map follows it, the pages are pinned."""
        reg = self.registry
        if f.mapped:
            slot.faulted(first, last, f.mapped)
            if slot.kept:  # ROCm 7.2: the range's kept memory, mapped again
                slot.kept = max(0, slot.kept - f.mapped)
            self.loads.loaded(slot.model.id, f.mapped)
        elif not slot.all_resident(first, last):
            slot.faulted(first, last, 0)  # UNKNOWN pages that turned out resident
        slot.pin(first, last)
        if reg.tracer is not None:
            reg.trace("fault", slot.model, device=str(slot.device), offset=offset, bytes=size, mapped=f.mapped,
                      result="mapped" if f.mapped else "resident")
        return f

    def session_fault(self, slot: Slot, r: Reservation, offset: int, size: int, first: int, last: int) -> Fault:
        """The session's fault of the range; one that raises leaves its pages UNKNOWN in ``slot``'s map."""
        try:
            return self.registry.session.fault(r, offset, size)
        except Exception as exc:
            slot.fault_failed(first, last, exc)
            raise

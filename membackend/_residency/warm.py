"""The warm path of a caller that faults the same ranges step after step: :class:`WarmRange`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..types import Fault, Reservation

if TYPE_CHECKING:
    from .model import Model
    from .registry import Registry
    from .slots import Slot


class WarmRange:
    """A range of one model's reservation that a fault backed and pinned: while nothing of that reservation
    was freed, failed or released since (its slot's ``epoch``; a free made straight through the session, past
    the manager, counts: ``Session.backing_changes``), :meth:`pin` pins it again and answers the
    same :class:`Fault` (the same generations: nothing to copy again) with no session call, and
    :meth:`unpin` unpins it. Made by :meth:`ResidencyManager.warm_range`; the per-weight, per-step path of a
    caller that faults the same ranges over and over (ComfyUI's sampler)."""

    __slots__ = ("_registry", "_model", "_slot", "_reservation", "_first", "_last", "_end", "_epoch", "fault")

    def __init__(self, registry: "Registry", model: "Model", slot: "Slot", r: Reservation, offset: int,
                 size: int, fault: Fault):
        ps = r.page_size
        self._registry, self._model, self._slot, self._reservation = registry, model, slot, r
        self._first, self._last, self._end = offset // ps, (offset + size - 1) // ps + 1, offset + size
        self._epoch = slot.epoch
        self.fault = fault

    def pin(self) -> Fault | None:
        """Pin the range again and answer its fault; None when it may have changed (the caller faults it)."""
        reg = self._registry
        with reg.lock:
            slot, r = self._slot, self._reservation
            if reg.frees.get(r.id, 0) != slot.frees and not r.released:  # freed past the manager: the map goes
                reg.unseen(slot, r)  # (and the epoch with it)
            if slot.epoch != self._epoch or slot.reservation is not r or r.released or reg.tracer is not None \
                    or (slot.watermark is not None and self._end > slot.watermark) \
                    or reg.models.get(self._model.id) is not self._model:
                return None
            slot.pin(self._first, self._last)
            self._model.last_used = next(reg.clock)
            return self.fault

    def unpin(self) -> bool:
        """Unpin the range; False when its reservation is not the one it was made on (the caller unpins)."""
        reg = self._registry
        with reg.lock:
            slot = self._slot
            if slot.reservation is not self._reservation or reg.tracer is not None:
                return False
            slot.unpin(self._first, self._last)
            return True

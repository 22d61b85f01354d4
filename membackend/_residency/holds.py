"""Pages a caller reads without faulting them, kept until it lets go: :class:`Hold`.

A caller that found every page of a model's range resident may run over those pages for as long as it likes
with no fault or unpin per use (ComfyUI's classic path over a resident model's weights, issue 41). The
manager then must never free a held page behind its back, and must not keep them forever either: when the
room is wanted, the hold ends first, and the holder's ``on_end`` runs (under the manager's lock) so that it
stops using the pages before any of them goes.

When a hold ends:

* **for the model itself** -- its full unload, a shed or page drop its owner asks for, its unregistration --
  at once: the owner asked, on its own thread, at a point where it is not using the pages;
* **for another model's room** -- a fault out of room, keeping the budget's headroom, a lowered cap, freeing
  by amount -- only while the model is outside the current run (``ResidencyManager.use``): a model the run
  uses keeps its pages, and the one that wanted the room streams, as it would beside pinned pages.

A hold pins nothing (the pin counts stay the layers'): eviction skips a held slot, and every path that frees
or releases one ends its hold first. What ends a hold must not wait for another thread that may want the
manager's lock (``on_end`` runs under it).
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .registry import Registry
    from .slots import Slot

log = logging.getLogger(__name__)

__all__ = ["Hold"]


class Hold:
    """Every page of ``[offset, offset+size)`` of one model's reservation on one device, resident and kept so
    until :meth:`end`. Made by :meth:`ResidencyManager.hold <membackend._residency.manager.ResidencyManager.hold>`.

    ``on_end(reason)`` is held weakly when it is a bound method (a hold never keeps its holder alive: the
    holder going is itself the end of its use); it runs once, under the manager's lock, before the hold is
    gone, and must not raise (what it raises is logged and the hold ends anyway)."""

    __slots__ = ("_registry", "_slot", "offset", "size", "_on_end", "ended", "reason")

    def __init__(self, registry: "Registry", slot: "Slot", offset: int, size: int, on_end: Callable[[str], Any]):
        self._registry, self._slot = registry, slot
        self.offset, self.size = offset, size
        self._on_end: Callable[[], Callable[[str], Any] | None]
        if hasattr(on_end, "__self__") and hasattr(on_end, "__func__"):
            self._on_end = weakref.WeakMethod(on_end)
        else:
            self._on_end = lambda: on_end
        self.ended = False
        #: why it ended (None while held)
        self.reason: str | None = None

    @property
    def model_id(self) -> str:
        return self._slot.model.id

    def end(self, reason: str) -> bool:
        """Let go of the pages: ``on_end(reason)`` runs, then the slot's pages may be freed again. False when
        it had ended already. Safe from any thread."""
        with self._registry.lock:
            return self.ended_by_manager(reason)

    def ended_by_manager(self, reason: str) -> bool:
        """:meth:`end` for a caller holding the manager's lock (the manager's own parts)."""
        if self.ended:
            return False
        callback = self._on_end()
        try:
            if callback is not None:
                callback(reason)
        except Exception as exc:  # noqa: BLE001 - the pages must not stay held for a holder that failed
            log.warning("membackend: letting go of the pages held for %s failed (%s: %s); they are let go anyway",
                        self.model_id, type(exc).__name__, exc)
        self.ended, self.reason = True, reason
        if self._slot.hold is self:
            self._slot.hold = None
        self._registry.trace("hold_end", self._slot.model, device=str(self._slot.device), reason=reason)
        return True

    def __repr__(self) -> str:
        return f"Hold({self.model_id}, [{self.offset}, {self.offset + self.size}), ended={self.ended})"

"""Keep warm (G4) by budget, never by reference: which dynamic patchers ComfyUI still holds, watched weakly.

membackend keeps no model alive. A model's life is ComfyUI's to decide: while its node cache (or anything of
ComfyUI's) references a dynamic patcher, the model stays resident across workflow switches as long as the
budget allows -- the wiring's ``free_memory`` keeps such models out of ComfyUI's unload while the budget has
room, and the residency policy evicts by budget, least recently used first. When ComfyUI drops a model (its
default cache drops an earlier workflow's models after the next workflow's first node), the patcher, its
``nn.Module`` and the module's ``ModelVBAR`` are collected, and the VBAR's close returns its pages and its
reservation at once (:meth:`membackend._comfyui.runtime.Runtime.close_vbar`, fenced, G1/G2). Holding the
patchers here instead (as this module did until issue 34) kept every dropped model's pages committed until
``POST /free``, above stock's VRAM, and the reload copied the same weights in again anyway.

:class:`KeepWarm` records each run's dynamic patchers (``load_models_gpu``, most recent last) as weak
references: the status's ``held`` (a model ComfyUI still holds, kept warm by budget) and ``dropped`` (patchers
ComfyUI let go of since start-up) come from it, and ``enabled`` is the switch ComfyUI's
``--disable-smart-memory`` turns off (then the wiring keeps nothing loaded on its own either).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

__all__ = ["KeepWarm"]


class KeepWarm:
    """The run's dynamic patchers and the earlier ones ComfyUI still holds, by weak reference; safe to share
    between ComfyUI's threads. Nothing here keeps a patcher alive."""

    def __init__(self, lock: "threading.RLock | None" = None):
        self._refs: dict[int, weakref.ReferenceType[Any]] = {}  # id -> weak reference, least recently used first
        self.run_ids: set[int] = set()
        #: patchers ComfyUI let go of (collected) while watched, since start-up
        self.dropped = 0
        self.enabled = True
        self._lock = lock or threading.RLock()

    def hold(self, patchers: list[Any]) -> None:
        """These patchers are the current run's (until the next call): watch them, weakly. A patcher that
        cannot be weakly referenced is not watched (it is never kept alive either). The ones ComfyUI dropped
        since the last call are forgotten and counted in ``dropped``. No callback runs when a patcher goes:
        a weak reference's callback would run inside whatever code the garbage collector interrupted."""
        if not self.enabled:
            return
        with self._lock:
            self._prune()
            self.run_ids = {id(p) for p in patchers}
            for p in patchers:
                key = id(p)
                self._refs.pop(key, None)  # most recent last
                try:
                    self._refs[key] = weakref.ref(p)
                except TypeError:
                    continue

    def _prune(self) -> None:
        # under self._lock
        gone = [key for key, ref in self._refs.items() if ref() is None]
        for key in gone:
            del self._refs[key]
            self.run_ids.discard(key)
        self.dropped += len(gone)

    @property
    def held(self) -> dict[int, Any]:
        """The watched patchers ComfyUI still holds (id -> patcher, least recently used first): a snapshot of
        strong references for the caller's use; keep it no longer than that use."""
        with self._lock:
            refs = list(self._refs.items())
        out = {}
        for key, ref in refs:
            p = ref()
            if p is not None:
                out[key] = p
        return out

    def release(self, patchers: list[Any]) -> None:
        """ComfyUI unloaded these models (an unload it chose, ``/free``): stop watching them."""
        with self._lock:
            for p in patchers:
                self._refs.pop(id(p), None)
                self.run_ids.discard(id(p))

    def clear(self) -> None:
        """Watch nothing (the adapter stopped or switched off)."""
        with self._lock:
            self._refs.clear()
            self.run_ids = set()

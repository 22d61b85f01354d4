"""Keep warm (G4): strong references to the run's dynamic patchers, given back under RAM pressure.

ComfyUI drops its own references to a model when a workflow switches, and the
garbage collector then destroys a model the budget could have kept resident.
:meth:`KeepWarm.hold` keeps the patchers of each run (most recent last);
:meth:`KeepWarm.relieve` gives back the others, least recently used first, never
the current run's, while the host's available RAM is under ``ram_floor``. The
wiring calls ``hold`` from ``load_models_gpu``; the runtime calls ``relieve``
between nodes. ComfyUI's ``--disable-smart-memory`` switches holding off.
"""

from __future__ import annotations

import gc
import logging
import threading
from typing import Any

from .._version import __version__

log = logging.getLogger("membackend")

__all__ = ["KeepWarm"]


class KeepWarm:
    """The held patchers; safe to share between ComfyUI's threads."""

    def __init__(self, lock: "threading.RLock | None" = None):
        self.held: dict[int, Any] = {}  # id -> dynamic patcher, least recently used first
        self.run_ids: set[int] = set()
        self.ram_floor: int | None = None  # bytes; None: a tenth of the host's RAM
        self.given_back = 0
        self.enabled = True
        self._lock = lock or threading.RLock()

    def hold(self, patchers: list[Any]) -> None:
        """These patchers are the current run's (until the next call); keep them referenced."""
        if not self.enabled:
            return
        with self._lock:
            self.run_ids = {id(p) for p in patchers}
            for p in patchers:
                self.held.pop(id(p), None)
                self.held[id(p)] = p
        self.relieve()

    def ram_pressure(self) -> bool:
        """True while the host's available RAM (psutil ``MemAvailable``, capped by a cgroup) is below
        ``ram_floor`` bytes (default: a tenth of the host's RAM)."""
        from .._hostmem import host_memory

        hm = host_memory()
        floor = self.ram_floor if self.ram_floor is not None else hm.total // 10
        return hm.available < floor

    def relieve(self) -> int:
        """Under RAM pressure, drop held references -- least recently used first, never the current run's --
        until the pressure is gone or only the run's are left. Returns how many were given back."""
        given = 0
        with self._lock:
            while self.held and self.ram_pressure():
                victim = next((k for k in self.held if k not in self.run_ids), None)
                if victim is None:
                    break
                self.held.pop(victim)
                given += 1
                gc.collect()  # the model goes now if nothing else holds it: its reservation is returned
            self.given_back += given
        if given:
            log.info("membackend %s: RAM pressure: gave back %d held model(s), least recently used first",
                     __version__, given)
        return given

    def release(self, patchers: list[Any]) -> None:
        """ComfyUI dropped these models (an unload it chose, ``/free``): stop holding them."""
        with self._lock:
            for p in patchers:
                self.held.pop(id(p), None)
                self.run_ids.discard(id(p))

    def clear(self) -> None:
        with self._lock:
            self.held.clear()
            self.run_ids = set()

"""What each model's loads did, for the load records of :meth:`~membackend.ResidencyManager.loads_done`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable

if TYPE_CHECKING:
    from .._trace import TraceObserver
    from .model import Model

log = logging.getLogger(__name__)


class LoadBook:
    """The loads a run opened (one record per model, by id) and what each model lost since its last load.

    Not thread-safe on its own: the manager calls it under its lock.
    """

    def __init__(self) -> None:
        #: per model id, what it lost since its last load: {"time", "bytes", "reason", "for"}
        self.losses: dict[str, dict[str, Any]] = {}
        self.open: dict[str, dict[str, Any]] = {}  # the loads of the current run, by model id
        #: called with each finished load record
        self.listeners: list[Callable[[dict[str, Any]], None]] = []

    def begin(self, model: "Model", workflow: str | None, resident_before: int) -> None:
        """``model``'s load in a run named ``workflow`` begins, with ``resident_before`` bytes resident."""
        self.open[model.id] = {"model": model.id, "size": model.size, "began": time.time(), "workflow": workflow,
                               "resident_before": resident_before, "loaded": 0,
                               "lost": self.losses.pop(model.id, None)}

    def loaded(self, model_id: str, nbytes: int) -> None:
        """A fault of the model newly backed ``nbytes`` (each copied in)."""
        rec = self.open.get(model_id)
        if rec is not None:
            rec["loaded"] += nbytes

    def lost(self, model: Any, nbytes: int, reason: str, for_models: Iterable[Any] = ()) -> None:
        """``model`` lost ``nbytes`` resident bytes (eviction, shed, unload) for ``reason``, to make room for
        ``for_models`` (models or ids); kept for its next load record. Bytes add up until that load; the time,
        reason and models are the latest."""
        if nbytes <= 0:
            return
        mid = model.id
        if mid in self.open:  # lost during its own load (its pages shed to fit another of the run's): said too
            self.open[mid]["shed_during"] = self.open[mid].get("shed_during", 0) + nbytes
        before = self.losses.get(mid)
        self.losses[mid] = {"time": time.time(), "bytes": nbytes + (before["bytes"] if before else 0),
                            "reason": reason, "for": sorted(getattr(m, "id", m) for m in for_models)}

    def close(self, tracer: "TraceObserver | None", policy: str) -> list[dict[str, Any]]:
        """Close the open loads: each record gets its ``kind``, goes to the tracer (as a ``load`` event of
        ``policy``) and to every listener; returns them."""
        done, self.open = list(self.open.values()), {}
        for rec in done:
            rec["kind"] = "kept" if not rec["loaded"] else "reloaded" if rec["lost"] else "cold"
            if tracer is not None:
                tracer.event("load", policy=policy, **rec)
            for listener in list(self.listeners):
                try:
                    listener(rec)
                except Exception as exc:  # a listener (a log line) must never fail the policy
                    log.warning("membackend: a load listener failed: %s: %s", type(exc).__name__, exc)
        return done

    def forget(self, model_id: str) -> None:
        """The model is gone: nothing loads it again, so its losses would only pile up."""
        self.losses.pop(model_id, None)
        self.open.pop(model_id, None)

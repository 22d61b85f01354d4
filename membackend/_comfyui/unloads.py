"""Models leave the device: full unloads ComfyUI asks for, and the models ComfyUI dropped (G1, G2).

:class:`Unloader` runs a VBAR's full unload now when no page of it is pinned, else puts it off to the next
quiescent point (between nodes). A VBAR that is closed -- ComfyUI dropped its model and the garbage collector
collected the VBAR with the model's ``nn.Module``, or someone closed it -- has its model fully unloaded and
unregistered: fenced first, its reservation returned. From a finalizer, which the garbage collector may run
inside any code with any lock held, that only queues the model; the reaper thread retires it at once on a
thread of its own.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
import time
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from ..types import Device, PartialFailure
from .lines import gb, log, say

if TYPE_CHECKING:
    from .._residency import ResidencyManager
    from .journal import Journal
    from .links import RuntimeLinks

__all__ = ["Unloader"]

#: the reason a put-off full unload runs with (the per-load line words it too)
PUT_OFF = "put off until no page was pinned"
#: what a dropped model kept as cache is called after its name, until the cache goes
DROPPED = " (dropped)"


def _in_finalizer(obj: Any, depth: int = 8) -> bool:
    """Whether this call comes from ``obj``'s own ``__del__`` (within ``depth`` frames): the garbage collector
    runs it inside whatever code it interrupted, so nothing that takes a lock may run there."""
    finalizer = getattr(getattr(type(obj), "__del__", None), "__code__", None)
    if finalizer is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code is finalizer:
            return True
        frame = frame.f_back
    return False


class Unloader:
    """The full unloads of a runtime's VBARs, put off or now, and the retirement of the closed ones.

    What it reads of the runtime, handed to it when the runtime builds it (it never holds the runtime):
    ``links`` (the residency manager and the copy fences as they are now, the live VBARs), ``journal`` (the
    model names and the unload records), ``manager()`` (the residency manager, or a ``RuntimeError`` before
    the start made one: ``Runtime.residency_manager``) and ``session()`` (the session now, None before the start)."""

    def __init__(self, links: "RuntimeLinks", journal: "Journal", *, manager: "Callable[[], ResidencyManager]",
                 session: Callable[[], Any]):
        self._links = links
        self._journal = journal
        self._manager = manager
        self._session = session
        #: VBARs whose full unload is put off until no page is pinned; changed through put_off/cancel_put_off
        #: (a WeakSet must not change while another thread copies it)
        self.pending: weakref.WeakSet[Any] = weakref.WeakSet()
        self.pending_lock = threading.Lock()
        #: closed VBARs whose model is still registered: (model, device), put by a finalizer's close
        #: (:meth:`close`) and retired by the reaper thread (or the next quiescent point). A SimpleQueue:
        #: its ``put`` is safe inside a finalizer, which may run inside any code, locks held
        self._closing: queue.SimpleQueue[tuple[Any, Device] | None] = queue.SimpleQueue()
        self._reaper: threading.Thread | None = None
        self._reaper_lock = threading.Lock()
        #: closed models whose retirement failed (a driver error, a fence that failed): retried between nodes
        self._retry: list[tuple[Any, Device]] = []
        self._retry_lock = threading.Lock()

    # ------------------------------------------------------------------ full unloads ComfyUI asks for

    def unload(self, vbar: Any, reason: str, earlier: int = 0) -> None:
        """Full unload of a VBAR's model (G1), now when nothing is pinned, else at the next quiescent point.

        The pin check and the unload are one decision under the policy's lock
        (``ResidencyManager.full_unload_unless_pinned``), so a layer another thread pins meanwhile is never
        released under its pin. A unload that fails (a copy's fence failed, a driver error) is reported in
        one line and retried at the next quiescent point. ``earlier``: bytes ComfyUI's own detach already
        freed from it (for the log line)."""
        model = vbar._model
        policy = self._manager()
        try:
            dropped = policy.full_unload_unless_pinned(model)
        except PartialFailure as exc:
            self.put_off(vbar)
            say(f"full unload of {model.id} failed, retried at the next node ({exc})", logging.WARNING)
            return
        if dropped is None:
            with self.pending_lock:
                first = vbar not in self.pending
            self.put_off(vbar)  # destroying pinned pages is what aborts aimdo (#14396): wait
            if first:  # said once, not at every node it keeps waiting
                say(f"full unload of {model.id} on {vbar._dev} put off: a page is still pinned; it runs after the "
                    f"node that uses it ({reason})")
            return
        self.cancel_put_off(vbar)
        if not dropped.alive:
            return  # unloaded already
        entry = {"model": model.id, "device": str(vbar._dev), "bytes": dropped.bytes + earlier,
                 "reservations": dropped.released, "reserved_bytes": dropped.reserved_bytes, "reason": reason}
        entry["time"] = time.time()
        entry["name"] = self._journal.display_name(model.id)
        lost = policy.losses.get(model.id)
        if lost is not None:  # the policy says "full unload"; the adapter knows who asked
            lost["reason"] = reason
        self._journal.unloaded(entry)
        say(f"full unload of {model.id} on {vbar._dev}: {entry['bytes']} bytes freed, {entry['reservations']} "
            f"reservation(s) of {entry['reserved_bytes']} bytes returned ({reason})")

    def put_off(self, vbar: Any) -> None:
        """Run this VBAR's full unload at the next quiescent point."""
        with self.pending_lock:
            self.pending.add(vbar)

    def cancel_put_off(self, vbar: Any) -> None:
        """The VBAR is used again (or gone): its put-off unload is cancelled. Cheap when nothing waits
        (every fault calls it): a racing ``put_off`` is decided by the pin check under the policy's lock."""
        if not self.pending:
            return
        with self.pending_lock:
            self.pending.discard(vbar)

    def run_put_off(self) -> None:
        """Between nodes: the full unloads that waited for pins to go (of VBARs not closed since)."""
        with self.pending_lock:
            waiting = [v for v in self.pending if not getattr(v, "_closed", False)]
        for vbar in waiting:
            self.unload(vbar, PUT_OFF)

    # ------------------------------------------------------------------ closed VBARs: dropped models

    def close(self, vbar: Any) -> None:
        """``vbar`` was closed: ComfyUI dropped its model (the VBAR was collected with the model's nn.Module) or
        closed it. Its model is fully unloaded and unregistered -- fenced first (G2), its reservation returned
        (G1) -- and every record of it goes.

        From an explicit ``close()`` this runs now, on the caller's thread. From the VBAR's finalizer (the
        garbage collector may run it inside any code, on any thread, with any of membackend's or the driver's
        locks held by that thread) it only puts the model on a queue, and the reaper thread retires it at once
        on a thread of its own (:meth:`reap`; where no reaper runs, the next quiescent point does)."""
        model = vbar._model
        if _in_finalizer(vbar):
            self._closing.put((model, vbar._dev))
            return
        self.cancel_put_off(vbar)
        self._links.vbars.discard(vbar)
        self._retire(model, vbar._dev)

    def forget_cached(self) -> None:
        """The names of dropped models kept as cache that have gone since (the cache was taken or freed)."""
        residency = self._links.residency()
        if residency is None:
            return
        names = self._journal.names
        dropped = [mid for mid, name in list(names.items()) if name.endswith(DROPPED)]
        if dropped:
            registered = {m.id for m in residency.models()}
            for mid in dropped:
                if mid not in registered:
                    names.pop(mid, None)

    def reap(self) -> int:
        """Retire every closed VBAR's model waiting on the queue, and the ones whose retirement failed before;
        returns how many were retired. Safe from any thread outside a finalizer."""
        with self._retry_lock:
            retry, self._retry = self._retry, []
        done = 0
        for model, dev in retry:
            done += self._retire(model, dev)
        while True:
            try:
                item = self._closing.get_nowait()
            except queue.Empty:
                return done
            if item is not None:
                done += self._retire(*item)

    def start_reaper(self) -> None:
        """Start the daemon thread that retires closed VBARs' models as their finalizers queue them."""
        with self._reaper_lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._reaper = threading.Thread(target=self._reap_forever, name="membackend-reaper", daemon=True)
            self._reaper.start()

    def stop_reaper(self) -> None:
        """Stop the reaper thread (waiting up to 5 s for the model it retires now); what stays queued is
        retired by the next :meth:`reap`."""
        with self._reaper_lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None and reaper.is_alive():
            self._closing.put(None)
            if reaper is not threading.current_thread():
                reaper.join(timeout=5.0)

    def _reap_forever(self) -> None:
        while True:
            item = self._closing.get()
            if item is None:
                return
            try:
                self._retire(*item)
            except Exception as exc:  # noqa: BLE001 - never let the reaper die: the next item is retired too
                log.warning("membackend: retiring a dropped model failed: %s: %s", type(exc).__name__, exc)

    def _retire(self, model: Any, dev: Device) -> int:
        """Full unload and unregister a closed VBAR's model (1), or nothing to do (0). A failure (a fence whose
        copy failed, a driver error) is told and retried at the next quiescent point; a model the adapter no
        longer serves (stopped, or another retirement came first) is only forgotten."""
        journal = self._journal
        # the name goes with the model, not before: a status taken meanwhile names it, and a retry too
        name = journal.display_name(model.id)
        residency = self._links.residency()
        if residency is None or self._session() is None:
            journal.forget(model.id)
            return 0
        fences = self._links.fences()
        if fences is not None:
            fences.forget(model)
        try:
            if model not in residency.models():
                journal.forget(model.id)
                return 0
            kept = residency.cache(model)  # its weights' pages kept as reclaimable cache (issue 41, item 2)
            if kept:
                journal.forget(model.id)
                journal.names[model.id] = f"{name}{DROPPED}"  # still listed, as cache, until it goes
                journal.unloaded({"model": model.id, "device": str(dev), "bytes": 0, "reservations": 0,
                                     "reserved_bytes": 0, "reason": "dropped by ComfyUI; its weights kept as cache",
                                     "time": time.time(), "name": name}, dropped=True)
                say(f"{name} dropped by ComfyUI: {gb(kept)} of its weights kept on {dev} as cache (reclaimable: "
                    "it goes first when memory is wanted, and a load of the same file copies from it)")
                return 1
            unloaded = residency.full_unload_unless_pinned(model)
            residency.unregister(model)  # what was pinned goes too: the VBAR is closed, no unpin will come
            journal.forget(model.id)
        except Exception as exc:  # noqa: BLE001 - told, retried between nodes; ComfyUI is never stopped by it
            with self._retry_lock:
                self._retry.append((model, dev))
            say(f"retiring the dropped model {model.id} failed, retried at the next node ({type(exc).__name__}: "
                f"{exc})", logging.WARNING)
            return 0
        if unloaded is None or not unloaded.alive:
            return 1
        entry = {"model": model.id, "device": str(dev), "bytes": unloaded.bytes, "reservations": unloaded.released,
                 "reserved_bytes": unloaded.reserved_bytes, "reason": "dropped by ComfyUI", "time": time.time(),
                 "name": name}
        journal.unloaded(entry, dropped=True)
        say(f"{name} dropped by ComfyUI: {gb(unloaded.bytes)} freed, {unloaded.released} reservation(s) of "
            f"{gb(unloaded.reserved_bytes)} returned on {dev}")
        return 1

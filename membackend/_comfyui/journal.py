"""What the adapter knows of each model and what happened to them: the per-load lines and the status's lists.

:class:`Journal` keeps the names people know the models by (ComfyUI's model classes), their weights' bytes and
when ComfyUI last loaded them; the most recent loads (each with the words of its line, :func:`describe_load`),
full unloads and idle give-backs, with the count of all. The wiring and the facade fill it; the status reads it.
"""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .lines import gb, log, say

if TYPE_CHECKING:
    from .._residency import ResidencyManager

__all__ = ["Journal", "describe_load", "UNLOADS_KEPT", "LOADS_KEPT"]

UNLOADS_KEPT = 100  # the status shows the most recent full unloads; the count of all is kept too
LOADS_KEPT = 100  # likewise the most recent loads (one per model each time ComfyUI loads it)

#: the residency policy's reasons for a loss, as (what happened, why) for the per-load line
_LOSS_WORDS = {
    "headroom": ("evicted", "to keep the headroom free"),
    "out of memory": ("evicted", "the device was out of memory"),
    "budget": ("evicted", "over the budget at a workflow switch"),
    "address space": ("unloaded", "to make address space"),
    "full unload": ("fully unloaded", None),
    "unload_all": ("fully unloaded", "unload all models"),
    "unregister": ("fully unloaded", "its model was deleted"),
    "unloaded by ComfyUI": ("fully unloaded by ComfyUI", None),
    "dropped by ComfyUI": ("fully unloaded", "ComfyUI dropped the model"),
    "put off until no page was pinned": ("fully unloaded by ComfyUI", None),
    "shed by its owner": ("partly unloaded by ComfyUI", None),
    "free_memory": ("freed", None),
}


def describe_load(rec: dict[str, Any], name: Callable[[str], str] = str, pages: int | None = None) -> str:
    """The words of one load record (``ResidencyManager.loads_done``): why the model loaded what it did.

    ``kept: 0 bytes loaded`` / ``reloaded 3.2 GB: evicted at 14:02 for VAE`` / ``loaded 3.2 GB (cold)`` /
    ``nothing loaded: none of its layers ran``, with ``streamed: `` in front when the load shed its own pages
    to fit its later layers or loaded more than the ``pages`` its weights span (it faulted pages again);
    ``name`` turns a model id into the name a person knows it by."""
    loaded = rec.get("loaded", 0)
    if not loaded and not rec.get("resident_before", 0):
        out = "nothing loaded: none of its layers ran"
    elif rec.get("kind") == "kept" or not loaded:
        out = f"kept: 0 bytes loaded ({gb(rec.get('resident_before', 0))} resident)"
    elif rec.get("kind") == "reloaded" and rec.get("lost"):
        lost = rec["lost"]
        when = time.strftime("%H:%M:%S", time.localtime(lost["time"]))
        what, why = _LOSS_WORDS.get(lost.get("reason") or "", ("evicted", lost.get("reason")))
        for_ = ", ".join(name(m) for m in lost.get("for") or ())
        out = f"reloaded {gb(loaded)}: {what} at {when}" + (f" for {for_}" if for_ else "") + \
            (f" ({why})" if why else "")
    else:
        out = f"loaded {gb(loaded)} (cold)"
    if rec.get("shed_during"):  # its own pages made room for its later layers: it streamed
        out = f"streamed: {out}; {gb(rec['shed_during'])} of it shed again to fit the budget"
    elif pages and loaded > pages:  # more than its weights: layers were loaded again within the load
        out = f"streamed: {out}; more than its {gb(pages)} of weights, the budget holds only part of it"
    return out


class Journal:
    """The adapter's record of models and their loads and unloads; safe to share between ComfyUI's threads.

    ``vbars`` are the facade's live VBARs (the runtime's set): a load's line compares what it loaded with the
    whole pages its weights span, in its VBAR's page size."""

    def __init__(self, vbars: weakref.WeakSet[Any]):
        self._vbars = vbars
        self.names: dict[str, str] = {}  # model id -> the name ComfyUI's model class gives it
        #: model id -> its weights' bytes: what ComfyUI staged in its VBAR (ModelVBAR.alloc), not the address range
        self.weights: dict[str, int] = {}
        self.last_used: dict[str, float] = {}  # model id -> when ComfyUI last loaded it (epoch seconds)
        self.loads: collections.deque[dict[str, Any]] = collections.deque(maxlen=LOADS_KEPT)
        self.load_count = 0
        self.loaded_bytes = 0  # bytes every load copied in, in all
        self.unloads: collections.deque[dict[str, Any]] = collections.deque(maxlen=UNLOADS_KEPT)
        self.unload_count = 0
        self.dropped_count = 0  # models retired because their VBAR was closed (ComfyUI dropped them)
        self.dropped_bytes = 0  # the bytes those models had resident when they went
        self.idles = 0  # times the prompt queue emptied
        self.idle_bytes = 0  # what on_idle gave back, in all
        # leaf locks: on_load runs under the policy's lock, which abort() may wait for, so nothing runs inside
        self._loads_lock = threading.Lock()
        self._unloads_lock = threading.Lock()

    def display_name(self, model_id: str) -> str:
        """The name a person knows the model by (ComfyUI's model class), else its id."""
        return self.names.get(model_id, model_id)

    def forget(self, model_id: str) -> str:
        """Drop everything known of a model that is gone (each ModelVBAR has an id of its own: nothing here
        outlives it); returns the name it was known by, for the last line about it."""
        name = self.display_name(model_id)
        self.names.pop(model_id, None)
        self.weights.pop(model_id, None)
        self.last_used.pop(model_id, None)
        return name

    # ------------------------------------------------------------------ loads

    def on_load(self, rec: dict[str, Any]) -> None:
        """A load finished (``ResidencyManager.loads_done``, a load listener): one line that says why, kept for
        the status."""
        name = self.display_name(rec["model"])
        weights = self.weights.get(rec["model"], 0)
        vbar = next((v for v in list(self._vbars) if v._model.id == rec["model"]), None)
        r = vbar._model.reservation(vbar._dev) if vbar is not None else None
        page = r.page_size if r is not None else 0
        words = describe_load(rec, self.display_name, -(-weights // page) * page if weights and page else None)
        entry = {**rec, "name": name, "text": words}
        with self._loads_lock:
            self.loads.append(entry)
            self.load_count += 1
            self.loaded_bytes += int(rec.get("loaded", 0))
        say(f"load of {name} ({gb(self.weights.get(rec['model'], rec['size']))}): {words}")

    @staticmethod
    def close_loads(residency: "ResidencyManager | None") -> None:
        """Close the loads the last run opened (one line per load, through :meth:`on_load`); a failure there
        (the trace file) is logged, never raised into ComfyUI's node loop."""
        if residency is None:
            return
        try:
            residency.loads_done()
        except Exception as exc:  # noqa: BLE001
            log.warning("membackend: closing the run's load records failed: %s: %s", type(exc).__name__, exc)

    def loads_so_far(self) -> tuple[list[dict[str, Any]], int, int]:
        """``(the most recent loads, the count of all, the bytes all of them loaded)``, copied together."""
        with self._loads_lock:
            return list(self.loads), self.load_count, self.loaded_bytes

    # ------------------------------------------------------------------ unloads, idle

    def unloaded(self, entry: dict[str, Any], dropped: bool = False) -> None:
        """Record one full unload (``entry``: model, device, bytes, reservations, reserved_bytes, reason, time,
        name); ``dropped``: ComfyUI dropped the model (its VBAR was closed), counted apart too."""
        with self._unloads_lock:
            self.unloads.append(entry)
            self.unload_count += 1
            if dropped:
                self.dropped_count += 1
                self.dropped_bytes += entry["bytes"]

    def unloads_so_far(self) -> tuple[list[dict[str, Any]], int]:
        """``(the most recent full unloads, the count of all)``, copied together."""
        with self._unloads_lock:
            return list(self.unloads), self.unload_count

    def idled(self, given: int) -> None:
        """The prompt queue emptied and the backend gave back ``given`` bytes it kept for reuse."""
        self.idles += 1
        self.idle_bytes += given

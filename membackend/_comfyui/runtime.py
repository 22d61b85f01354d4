"""The running adapter: the one :class:`Runtime` of this process, its G6 guard and the ``init_devices`` seam.

:func:`current` is the only place the adapter is held. :mod:`.startup` creates the
runtime before torch and arms it (:meth:`Runtime.arm`: ComfyUI's
``comfy_aimdo.control.init_devices`` becomes :meth:`Runtime.init_devices`); when
ComfyUI calls it, the runtime opens the session and the residency manager and
calls the ``wire`` function it was given (:func:`membackend._comfyui.wiring.wire`:
the facade, the buffers, the ``comfy.model_management`` patches). The facade and
the wiring find the runtime through :func:`current`; nothing here imports them.

**Never in the way (G6).** Any exception in any step -- or later, inside any
guarded replacement (:meth:`Runtime.guard`) -- restores every original
(:meth:`Runtime.abort`), logs one line with the cause, and ComfyUI carries on
stock. After ``init_devices`` said yes, ComfyUI has swapped in its dynamic
patcher and comfy-aimdo has no device, so aimdo's own VBAR functions could not
serve the patchers already made: an abort then keeps the facade names (patches
made with ``surface=True``) for those, restores everything else, and puts
ComfyUI's legacy patcher back for new models.

**What the status says.** :func:`outcome` is the start-up decision of this
process (the state and the words of the start-up line) even when no runtime was
made, so the status route can tell "off", "stock because ..." and "switched
itself off" apart.
"""

from __future__ import annotations

import collections
import importlib
import itertools
import logging
import queue
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable

from .._version import __version__
from ..types import Device, InvalidSize, PartialFailure, WrongDevice, format_size
from .keepwarm import KeepWarm
from .patches import Patches

if TYPE_CHECKING:
    from .._manager import BackendManager, PluginRecord, Selection
    from .._residency import ResidencyManager
    from .streams import CopyFences

log = logging.getLogger("membackend")

__all__ = ["Runtime", "Outcome", "current", "outcome", "say", "HOW_TO", "UNLOADS_KEPT", "LOADS_KEPT",
           "HISTORY_SECONDS", "HISTORY_KEPT", "describe_load", "gb"]

HOW_TO = "MEMBACKEND_BACKEND=<name> forces another, MEMBACKEND_DISABLE=1 turns membackend off"
UNLOADS_KEPT = 100  # the status shows the most recent full unloads; the count of all is kept too
LOADS_KEPT = 100  # likewise the most recent loads (one per model each time ComfyUI loads it)
HISTORY_SECONDS = 600.0  # the status keeps this much of each device's reserved/resident/committed history
HISTORY_EVERY = 1.0  # seconds: at most one history sample per device this often
#: samples kept per device, whatever their age (forced samples come on top of the one a second); a live headroom
#: change's sample replaces one taken less than HISTORY_EVERY before it, so 20,000 changes keep the status small
HISTORY_KEPT = 1000
LIVE_SOURCE = "live change (lasts until ComfyUI stops)"
#: comfy-aimdo's log-level functions; ComfyUI calls one after init_devices said yes (they need aimdo's library)
AIMDO_LOG_LEVELS = ("none", "critical", "error", "warning", "info", "debug", "verbose", "vverbose")


@dataclass(frozen=True)
class Outcome:
    """The start-up decision: ``state`` is one of ``disabled``, ``stock``, ``armed``, ``not-started``;
    ``reason`` says why in a few words; ``line`` is the start-up line as logged."""

    state: str
    reason: str
    line: str


_current: "Runtime | None" = None
_outcome: Outcome | None = None
_state_lock = threading.Lock()


def current() -> "Runtime | None":
    """The adapter made in this process (armed, running or switched off); None: ComfyUI runs stock."""
    return _current


def outcome() -> Outcome | None:
    """The start-up decision of this process; None when the prestartup script never ran."""
    return _outcome


def decided(state: str, reason: str, line: str, runtime: "Runtime | None" = None) -> None:
    """Record the start-up decision (and the runtime, when one was armed)."""
    global _current, _outcome
    with _state_lock:
        _outcome = Outcome(state, reason, line)
        _current = runtime


def _forget(runtime: "Runtime") -> None:
    global _current
    with _state_lock:
        if _current is runtime:
            _current = None


def gb(n: int | float) -> str:
    """Bytes for a person, as membackend writes them everywhere (``types.format_size``): ``3.0 GiB``,
    ``512.0 MiB``, ``0 bytes``."""
    return format_size(n)


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


def committed_bytes(state: Any) -> int:
    """The memory a device's driver holds for this process: the platform's own commit figure where it has one
    (Windows private commit), else the resident pages and what the backend keeps for reuse."""
    return state.committed if state.committed is not None else state.resident + state.held


def say(text: str, level: int = logging.INFO) -> str:
    """Log one membackend line (``membackend <version>: text``); returns it."""
    line = f"membackend {__version__}: {text}"
    log.log(level, "%s", line)
    return line


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


class _ComfyRaised(Exception):
    """Carries an exception ComfyUI's own function raised through a guarded replacement."""

    def __init__(self, exc: Exception):
        super().__init__(str(exc))
        self.exc = exc


def aimdo_log_noop(*_args: Any, **_kwargs: Any) -> None:
    """Stands in for comfy-aimdo's ``set_log_<level>()`` while membackend serves: aimdo's native library,
    which those functions configure, is not in use (and may never have been loaded). ComfyUI's console
    level already governs membackend's own logger."""


class Runtime:
    """The adapter in one process: selection, session, policy, the patches and what the status shows.

    ``wire(runtime)`` installs the facade and the ComfyUI patches once the session is open; it is
    given by the caller so that this module imports neither (arrows point down).
    """

    def __init__(self, manager: "BackendManager", machine: Any, selection: "Selection",
                 wire: Callable[["Runtime"], None], comfy_args: Any = None):
        self.manager = manager
        self.machine = machine
        self.selection = selection
        record = selection.record
        if record is None:  # the start-up decision arms a runtime for a selected backend only
            raise ValueError(f"a runtime needs a selected backend; the selection has none ({selection.reason})")
        #: the selected backend's record (``selection.record``)
        self.record: PluginRecord = record
        self.name = record.name
        self.comfy_args = comfy_args
        self.patches = Patches()
        self.keep = KeepWarm()
        self.session: Any = None
        self.residency: "ResidencyManager | None" = None
        self.fences: "CopyFences | None" = None  # tokens for the cast path's queued copies (G2)
        self.devices: list[Device] = []
        self.vbars: weakref.WeakSet[Any] = weakref.WeakSet()
        #: VBARs whose full unload is put off until no page is pinned; changed through put_off/cancel_put_off
        #: (a WeakSet must not change while another thread copies it)
        self.pending: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pending_lock = threading.Lock()
        #: closed VBARs whose model is still registered: (model, device), put by a finalizer's close
        #: (:meth:`close_vbar`) and retired by the reaper thread (or the next quiescent point). A SimpleQueue:
        #: its ``put`` is safe inside a finalizer, which may run inside any code, locks held
        self._closing: queue.SimpleQueue[tuple[Any, Device] | None] = queue.SimpleQueue()
        self._reaper: threading.Thread | None = None
        self._reaper_lock = threading.Lock()
        #: closed models whose retirement failed (a driver error, a fence that failed): retried between nodes
        self._close_retry: list[tuple[Any, Device]] = []
        self.dropped_count = 0  # models retired because their VBAR was closed (ComfyUI dropped them)
        self.dropped_bytes = 0  # the bytes those models had resident when they went
        self.started: bool | None = None  # None: init_devices not called yet
        self.aborted: str | None = None
        self.unloads: collections.deque[dict[str, Any]] = collections.deque(maxlen=UNLOADS_KEPT)
        self.unload_count = 0
        self.idles = 0  # times the prompt queue emptied
        self.idle_bytes = 0  # what on_idle gave back, in all
        self.loads: collections.deque[dict[str, Any]] = collections.deque(maxlen=LOADS_KEPT)
        self.load_count = 0
        self.loaded_bytes = 0  # bytes every load copied in, in all
        self.names: dict[str, str] = {}  # model id -> the name ComfyUI's model class gives it
        #: model id -> its weights' bytes: what ComfyUI staged in its VBAR (ModelVBAR.alloc), not the address range
        self.weights: dict[str, int] = {}
        self.last_used: dict[str, float] = {}  # model id -> when ComfyUI last loaded it (epoch seconds)
        #: per device: (time, reserved, resident, committed or None) samples, the last HISTORY_SECONDS (at most
        #: HISTORY_KEPT of them)
        self.history: dict[str, collections.deque[tuple[float, int, int, int | None]]] = {}
        self._sampled = 0.0
        self._headroom_lock = threading.Lock()  # one live change at a time
        self._stop_lock = threading.Lock()  # stop() and the unpin that ends the last hold close once
        self.stopping = False  # stop() ran and the session is not closed yet (a tensor held a range)
        self._stop_told = False
        self._loads_lock = threading.Lock()  # the load records (taken under the policy's lock: nothing inside)
        self._wire = wire
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._original_init: Callable[..., Any] | None = None
        self._reported: set[tuple[str, str]] = set()  # (where, error type) told once (report_once)
        #: id of a Hook delegate's nn.Module -> (weak reference to its dynamic owner, the delegate's bytes)
        self.delegates: dict[int, tuple[Any, int]] = {}
        #: every Hook delegate's nn.Module while anything keeps it alive (the status counts them)
        self.delegate_modules: weakref.WeakSet[Any] = weakref.WeakSet()
        kinds = tuple(getattr(record.plugin, "device_kinds", ("cpu",)))
        self.kind = next((k for k in ("cuda", "hip") if k in kinds), "cpu")

    # ------------------------------------------------------------------ arming (prestartup, before torch)

    def arm(self) -> None:
        """Make ComfyUI's ``init_devices`` ours; nothing else changes until ComfyUI calls it."""
        control = importlib.import_module("comfy_aimdo.control")
        self._original_init = control.init_devices
        self.patches.replace(control, "init_devices", self.init_devices)

    # ------------------------------------------------------------------ start (init_devices)

    def init_devices(self, device_ids: Any) -> bool:
        """Replaces ``comfy_aimdo.control.init_devices``: start membackend; on any failure, stock.

        ``device_ids`` is what ComfyUI passes: ``(torch device index, extra VRAM headroom bytes)`` pairs
        (``--vram-headroom``), or plain indices (its retry for comfy-aimdo 0.4.9's protocol). A second
        call answers the first answer."""
        ids = list(device_ids)
        with self._lock:
            if self.started is not None:
                return self.started
            try:
                self.start(ids)
                self.started = True
                return True
            except Exception as exc:
                self.started = False
                original = self._original_init
                self.abort(exc, "starting")
                self._close_quietly()  # nothing reached ComfyUI yet: give back what start opened
                return original(ids) if original is not None else False

    def start(self, ids: list[Any]) -> None:
        from .._residency import ResidencyManager
        from .streams import CopyFences

        args = self.comfy_args
        if args is not None:
            # aimdo's CUDA-graph capture and its compiler path record aimdo's own allocations; ComfyUI reads
            # these flags when it runs a model, after init_devices
            # surface patches: they stay after a switch-off, as the facade does, since comfy-aimdo has no device
            # to record graphs or compile on (its record would fail with "not initialized")
            for attr in ("disable_cuda_graphs", "disable_comfy_compiler"):
                self.patches.replace(args, attr, True, required=False, label="--" + attr.replace("_", "-"),
                                     surface=True)
        pairs = [i if isinstance(i, tuple) else (i, 0) for i in ids] or [(0, 0)]
        self.session = self.manager.session(self.machine, selection=self.selection)
        self.devices = list(dict.fromkeys(self.device_for(index) for index, _ in pairs))
        self._apply_headroom({self.device_for(index): int(extra) for index, extra in pairs})
        self.residency = ResidencyManager(self.session)
        self.residency.load_listeners.append(self.on_load)
        self.fences = CopyFences(self.residency)
        control = importlib.import_module("comfy_aimdo.control")
        for level in AIMDO_LOG_LEVELS:  # main.py calls one right after we answer True
            self.patches.replace(control, f"set_log_{level}", aimdo_log_noop, required=False)
        self._wire(self)
        self._start_reaper()
        skipped = f"; not in this ComfyUI: {', '.join(self.patches.skipped)}" if self.patches.skipped else ""
        say(f"started {self.name} on {', '.join(map(str, self.devices))}; {len(self.patches.applied)} patch "
            f"point(s){skipped}")

    def _apply_headroom(self, extra: dict[Device, int]) -> None:
        """ComfyUI's memory flags reach the budget: ``--reserve-vram`` GB is kept free at least (the larger
        of it and the backend's own headroom, as comfy-aimdo's simple headroom), ``--vram-headroom`` GB
        (passed to ``init_devices``) is kept free on top."""
        reserve_gb = getattr(self.comfy_args, "reserve_vram", None)
        reserve = int(float(reserve_gb) * 1024 ** 3) if reserve_gb else 0
        for dev in self.devices:
            more = max(0, extra.get(dev, 0))
            if not (reserve or more):
                continue
            own = self.session.budget_query(dev).headroom
            self.session.set_headroom(dev, max(own, reserve) + more, source="comfyui --reserve-vram/--vram-headroom")

    # ------------------------------------------------------------------ the live headroom (VRAM cap)

    def device_named(self, name: Any) -> Device:
        """One of the devices membackend serves, from ``"cuda:0"``, ``0`` or None (the first);
        :class:`~membackend.types.WrongDevice` for any other."""
        from .._settings import quoted

        served = ", ".join(map(str, self.devices)) or "none"
        if name is None:
            if not self.devices:
                raise WrongDevice("membackend serves no device yet; accepted: a device once it runs")
            return self.devices[0]
        try:
            dev = self.device_for(name) if isinstance(name, int) and not isinstance(name, bool) else Device.parse(name)
        except Exception:
            raise WrongDevice(f"device {quoted(name)} is not a device name; accepted: one of {served}") from None
        if dev not in self.devices:
            raise WrongDevice(f"membackend does not serve {dev}; accepted: one of {served}")
        return dev

    def headroom_in_force(self, device: Device) -> tuple[int, str]:
        """``(bytes kept free on device, where that value came from, in words)``: the session's answer."""
        return self.session.headroom_in_force(device)

    def headroom_range(self, device: Device) -> tuple[int, int]:
        """The live headroom accepted on ``device``: 0 to the device's total, in bytes."""
        return 0, int(self.session.budget_query(device).total)

    def parse_headroom(self, device: Device, value: Any) -> int | None:
        """A headroom as the settings read one (``"2GiB"``, ``1.5e9``, bytes; None: back to the start-up
        value); :class:`~membackend.types.InvalidSize` naming the accepted form and range otherwise."""
        from .._settings import SIZE_ACCEPTED, parse_bytes, quoted

        lo, hi = self.headroom_range(device)
        accepted = f"accepted: {SIZE_ACCEPTED}, from {lo} to {hi} bytes (the total of {device}), or null"
        if value is None:
            return None
        if isinstance(value, float) and value != value:  # NaN: parse_bytes would name it oddly
            raise InvalidSize(f"headroom {quoted(value)} is not a number of bytes; {accepted}")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise InvalidSize(f"headroom {quoted(value)} is negative; {accepted}")
        try:
            n = parse_bytes(value)
        except ValueError as exc:
            raise InvalidSize(f"headroom: {exc}; {accepted}") from None
        if n > hi:
            raise InvalidSize(f"headroom {quoted(value)} ({n} bytes) is above the total of {device} ({hi} bytes); "
                              f"{accepted}")
        return n

    def set_headroom_live(self, device: Any, value: Any,
                          then: Callable[[int], dict[str, Any]] | None = None) -> dict[str, Any]:
        """Change the headroom (the VRAM kept free) of a served device for the rest of this session.

        ``value`` as :meth:`parse_headroom` reads it. The next fault sees the new budget. When the free room
        is now below the headroom, the residency policy gives back what no longer fits: whole idle models
        first (least recently used), then unpinned pages by priority -- never a pinned page. Returns the
        value in force, its source, the bytes freed and the new budget. A bad device or value raises
        (:class:`~membackend.types.WrongDevice`, :class:`~membackend.types.InvalidSize`) and changes nothing;
        a failure while freeing puts the previous headroom back and raises it. ``then(bytes in force)`` runs
        under the same lock once the change holds (the route's save); what it returns joins the answer, and
        if it raises, the previous headroom is put back the same way."""
        if self.session is None or self.residency is None:
            raise WrongDevice("membackend is not running in this ComfyUI; accepted: a live change once it runs")
        dev = self.device_named(device)
        n = self.parse_headroom(dev, value)
        with self._headroom_lock:
            before, before_source = self.headroom_in_force(dev)
            was_live = before_source == LIVE_SOURCE
            self.session.set_headroom(dev, n, source=LIVE_SOURCE)  # None: back to the start-up value
            try:
                freed = self._fit(dev, n)
                now, source = self.headroom_in_force(dev)
                extra = then(now) if then is not None else {}
            except Exception:
                self.session.set_headroom(dev, before if was_live else None, source=LIVE_SOURCE)
                raise
        b = self.session.budget_query(dev)
        say(f"headroom on {dev} is now {gb(now)} ({source}; was {gb(before)}, {before_source})"
            + (f"; gave back {gb(freed)} that no longer fit" if freed else ""))
        self.sample(force=True, coalesce=True)
        return {**extra, "device": str(dev), "headroom": now, "source": source, "previous": before,
                "previous_source": before_source, "freed": freed,
                "budget": {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                           "source": b.source}}

    def _fit(self, dev: Device, headroom: int | None) -> int:
        """Free what no longer fits under the budget of ``dev``: idle models whole, then unpinned pages."""
        b = self.session.budget_query(dev)
        if b.free >= b.headroom:
            return 0
        reason = f"headroom raised to {gb(b.headroom)} (live)"
        residency = self.policy()
        freed = residency.keep_warm(dev, reason=reason)
        b = self.session.budget_query(dev)
        if b.free < b.headroom:
            freed += residency.free_memory(b.headroom - b.free, dev, reason=reason)
        return freed

    # ------------------------------------------------------------------ loads, history

    def display_name(self, model_id: str) -> str:
        return self.names.get(model_id, model_id)

    def on_load(self, rec: dict[str, Any]) -> None:
        """A load finished (``ResidencyManager.loads_done``): one line that says why, kept for the status."""
        name = self.display_name(rec["model"])
        weights = self.weights.get(rec["model"], 0)
        vbar = next((v for v in list(self.vbars) if v._model.id == rec["model"]), None)
        r = vbar._model.reservation(vbar._dev) if vbar is not None else None
        page = r.page_size if r is not None else 0
        words = describe_load(rec, self.display_name, -(-weights // page) * page if weights and page else None)
        entry = {**rec, "name": name, "text": words}
        with self._loads_lock:  # a leaf lock: this runs under the policy's lock, which abort() may wait for
            self.loads.append(entry)
            self.load_count += 1
            self.loaded_bytes += int(rec.get("loaded", 0))
        say(f"load of {name} ({gb(self.weights.get(rec['model'], rec['size']))}): {words}")

    def sample(self, force: bool = False, coalesce: bool = False) -> None:
        """Add one history sample per device (at most one a second unless ``force``; with ``coalesce`` it
        replaces a sample less than a second old). At most :data:`HISTORY_KEPT` samples per device stay, none
        older than :data:`HISTORY_SECONDS`. Never raises: the chart is for people, and a sample that fails (a
        driver that cannot be inspected now) is skipped."""
        if self.session is None:
            return
        now = time.time()
        if not force and now - self._sampled < HISTORY_EVERY:
            return
        self._sampled = now
        try:
            rows = []
            for d in self.devices:
                acct = self.session.ledger.account(d)
                state = self.session.inspect(d)
                committed = committed_bytes(state) if state is not None else None
                rows.append((str(d), (round(now, 3), acct.reserved, acct.resident, committed)))
        except Exception as exc:  # noqa: BLE001
            log.debug("membackend: history sample skipped: %s: %s", type(exc).__name__, exc)
            return
        with self._lock:  # status() copies the history under the same lock
            for key, row in rows:
                hist = self.history.setdefault(key, collections.deque(maxlen=HISTORY_KEPT))
                if coalesce and hist and now - hist[-1][0] < HISTORY_EVERY:  # a burst of changes: the newest stands
                    hist[-1] = row
                else:
                    hist.append(row)
                while hist and now - hist[0][0] > HISTORY_SECONDS:
                    hist.popleft()

    def _close_loads(self) -> None:
        """Close the loads the last run opened (one line per load); a failure there (the trace file) is
        logged, never raised into ComfyUI's node loop."""
        if self.residency is None:
            return
        try:
            self.residency.loads_done()
        except Exception as exc:  # noqa: BLE001
            log.warning("membackend: closing the run's load records failed: %s: %s", type(exc).__name__, exc)

    # ------------------------------------------------------------------ G6

    def guard(self, what: str, original: Callable[..., Any], replacement: Callable[..., Any]) -> Callable[..., Any]:
        """``replacement`` with the same call; any exception in it aborts the adapter and calls ``original``.

        An exception raised by ComfyUI's own function called through :meth:`comfy` is ComfyUI's, not the
        adapter's: it propagates unchanged and nothing is switched off or called twice."""
        def call(*args: Any, **kwargs: Any) -> Any:
            if self.aborted is not None:
                return original(*args, **kwargs)
            try:
                return replacement(*args, **kwargs)
            except _ComfyRaised as raised:
                raise raised.exc.with_traceback(raised.exc.__traceback__) from None
            except Exception as exc:
                self.abort(exc, what)
                return original(*args, **kwargs)
        call.__wrapped__ = original  # type: ignore[attr-defined]
        call.__name__ = getattr(original, "__name__", what)
        call.__doc__ = getattr(original, "__doc__", None)
        call._membackend = what  # type: ignore[attr-defined]
        return call

    @staticmethod
    def comfy(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ComfyUI's own ``fn`` from inside a guarded replacement (see :meth:`guard`)."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise _ComfyRaised(exc) from None

    def report_once(self, where: str, exc: BaseException, then: str) -> None:
        """One warning line per kind of error at ``where`` that the adapter survives (the rest are logged
        at debug level), saying what ComfyUI does instead (``then``)."""
        key = (where, type(exc).__name__)
        with self._lock:
            first = key not in self._reported
            self._reported.add(key)
        if first:
            say(f"{where} failed ({type(exc).__name__}: {exc}); {then} (reported once)", logging.WARNING)
        else:
            log.debug("membackend: %s failed again: %s: %s", where, type(exc).__name__, exc)

    def abort(self, exc: BaseException, where: str) -> None:
        """Restore every original and say so in one line; ComfyUI carries on stock."""
        with self._lock:
            if self.aborted is not None:
                return
            self.aborted = f"{where}: {type(exc).__name__}: {exc}"
            # the facade stays for the patchers ComfyUI made on our word (its fault answers "out of memory"
            # once it fails, so ComfyUI casts from its own copy); everything else goes back
            failed = self.patches.restore(keep_surface=bool(self.started))
            self.keep.clear()  # stock ComfyUI holds nothing warm
            if self.started:
                failed += self._legacy_patcher()
            note = f"; could not restore {', '.join(failed)}" if failed else ""
            what = "new models load with ComfyUI's legacy patcher" if self.started else "every original restored"
            say(f"switched off while {where} ({type(exc).__name__}: {exc}); {what}{note}; ComfyUI carries on "
                "stock", logging.WARNING)

    @staticmethod
    def _legacy_patcher() -> list[str]:
        """ComfyUI swapped in its dynamic patcher because init_devices said yes: new models go legacy again
        (what ComfyUI itself does when init_devices fails). Models already loaded keep their facade VBARs."""
        mp = sys.modules.get("comfy.model_patcher")
        try:
            if mp is not None and getattr(mp, "CoreModelPatcher", None) is getattr(mp, "ModelPatcherDynamic", ()):
                setattr(mp, "CoreModelPatcher", mp.ModelPatcher)
        except Exception as exc:
            return [f"comfy.model_patcher.CoreModelPatcher: {exc}"]
        return []

    @property
    def running(self) -> bool:
        return bool(self.started) and self.aborted is None

    def policy(self) -> ResidencyManager:
        """The residency manager :meth:`start` made; what runs before it (or after a start that failed
        before making it) gets a ``RuntimeError``."""
        residency = self.residency
        if residency is None:
            raise RuntimeError("membackend's residency manager is not made yet (init_devices did not start it)")
        return residency

    # ------------------------------------------------------------------ used by the facade and the wiring

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}"

    def device_for(self, index: Any) -> Device:
        """The membackend device for a torch device index (or a torch.device); cpu-only backends: cpu:0."""
        idx = getattr(index, "index", index)
        idx = 0 if idx is None else int(idx)
        return Device("cpu", 0) if self.kind == "cpu" else Device(self.kind, idx)

    def serves(self, torch_device: Any) -> bool:
        """Whether budgets for this torch device (or index; None: ComfyUI's own device) come from us."""
        if torch_device is None or isinstance(torch_device, int):
            return True
        kind = getattr(torch_device, "type", None) or str(torch_device).split(":")[0]
        return kind == ("cpu" if self.kind == "cpu" else "cuda")  # torch calls HIP devices cuda

    def page_size(self, device: Device) -> int:
        """The page size the backend maps on ``device`` (``Session.page_size``): the facade sizes a model whose
        reservation is not alive by it."""
        return int(self.session.page_size(device))

    def unload_vbar(self, vbar: Any, reason: str, earlier: int = 0) -> None:
        """Full unload of a VBAR's model (G1), now when nothing is pinned, else at the next quiescent point.

        The pin check and the unload are one decision under the policy's lock
        (``ResidencyManager.full_unload_unless_pinned``), so a layer another thread pins meanwhile is never
        released under its pin. A unload that fails (a copy's fence failed, a driver error) is reported in
        one line and retried at the next quiescent point. ``earlier``: bytes ComfyUI's own detach already
        freed from it (for the log line)."""
        model = vbar._model
        try:
            dropped = self.policy().full_unload_unless_pinned(model)
        except PartialFailure as exc:
            self.put_off(vbar)
            say(f"full unload of {model.id} failed, retried at the next node ({exc})", logging.WARNING)
            return
        if dropped is None:
            with self._pending_lock:
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
        entry["name"] = self.display_name(model.id)
        lost = self.policy().losses.get(model.id)
        if lost is not None:  # the policy says "full unload"; the adapter knows who asked
            lost["reason"] = reason
        with self._lock:
            self.unloads.append(entry)
            self.unload_count += 1
        say(f"full unload of {model.id} on {vbar._dev}: {entry['bytes']} bytes freed, {entry['reservations']} "
            f"reservation(s) of {entry['reserved_bytes']} bytes returned ({reason})")

    def quiescent(self) -> None:
        """Between nodes: retire the closed VBARs' models still waiting (:meth:`reap`), run the full unloads
        that waited for pins to go, and close the run's load records."""
        self.reap()  # what the reaper has not retired yet (none runs in a runtime made without start())
        with self._pending_lock:
            waiting = [v for v in self.pending if not getattr(v, "_closed", False)]
        for vbar in waiting:
            self.unload_vbar(vbar, "put off until no page was pinned")
        self._close_loads()  # the node that loaded its models is done: one line per load
        self.sample()

    def idle(self) -> int:
        """ComfyUI's prompt queue emptied: the backend gives back what it keeps for reuse
        (``ResidencyManager.on_idle``); resident models stay resident (G4). Returns the bytes given back."""
        if self.residency is None or self.aborted is not None:
            return 0
        given = self._give_back("prompt queue empty")
        self.idles += 1
        self.idle_bytes += given
        return given

    def track_delegate(self, owner: Any, delegate: Any) -> None:
        """ComfyUI made (or reused) ``owner``'s non-dynamic Hook delegate: remember it by the delegate's
        nn.Module, with its weights' bytes, so that its unload drops the owner's cached copy (G5)."""
        module = getattr(delegate, "model", None)
        if module is None:
            return
        try:
            size = int(delegate.model_size())
        except Exception:  # noqa: BLE001 - the size is for the status only
            size = 0
        with self._lock:
            self.delegates[id(module)] = (weakref.ref(owner), size)
            self.delegate_modules.add(module)

    def drop_delegate(self, patcher: Any) -> bool:
        """``patcher`` (a delegate or its owner) was unloaded: the owner lets go of its cached delegate."""
        module = getattr(patcher, "model", None)
        with self._lock:
            found = [k for k, (ref, _) in self.delegates.items() if k == id(module) or ref() is patcher]
            entries = [self.delegates.pop(k) for k in found]
        dropped = False
        for ref, size in entries:
            owner = ref()
            if owner is not None and getattr(owner, "non_dynamic_delegate_model", None) is not None:
                owner.non_dynamic_delegate_model = None
                dropped = True
                say(f"the Hook delegate of {type(getattr(owner, 'model', owner)).__name__} ({gb(size)}) goes "
                    "with its unload")
        return dropped

    def delegates_held(self) -> list[dict[str, Any]]:
        """The Hook delegates still cached by their owner: the owner's model class and the delegate's bytes."""
        with self._lock:
            entries = list(self.delegates.values())
        out = []
        for ref, size in entries:
            owner = ref()
            if owner is not None and getattr(owner, "non_dynamic_delegate_model", None) is not None:
                out.append({"owner": type(getattr(owner, "model", owner)).__name__, "bytes": size})
        return out

    def give_back(self) -> int:
        """Everything was unloaded: the backend gives back what it keeps for reuse (``ResidencyManager.on_idle``:
        recycled handles, kept address windows), so the memory the driver holds is back at its start-up
        value. Returns the bytes given back."""
        return self._give_back("every model unloaded") if self.residency is not None else 0

    def _give_back(self, why: str) -> int:
        given = self.policy().on_idle()
        self.sample(force=True)
        if given:
            say(f"{why}: gave back {gb(given)} the backend kept for reuse")
        return given

    def put_off(self, vbar: Any) -> None:
        """Run this VBAR's full unload at the next quiescent point."""
        with self._pending_lock:
            self.pending.add(vbar)

    def cancel_put_off(self, vbar: Any) -> None:
        """The VBAR is used again (or gone): its put-off unload is cancelled. Cheap when nothing waits
        (every fault calls it): a racing ``put_off`` is decided by the pin check under the policy's lock."""
        if not self.pending:
            return
        with self._pending_lock:
            self.pending.discard(vbar)

    def close_vbar(self, vbar: Any) -> None:
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
        self.vbars.discard(vbar)
        self._retire_closed(model, vbar._dev)

    def reap(self) -> int:
        """Retire every closed VBAR's model waiting on the queue, and the ones whose retirement failed before;
        returns how many were retired. Safe from any thread outside a finalizer."""
        retry, self._close_retry = self._close_retry, []
        done = 0
        for model, dev in retry:
            done += self._retire_closed(model, dev)
        while True:
            try:
                item = self._closing.get_nowait()
            except queue.Empty:
                return done
            if item is not None:
                done += self._retire_closed(*item)

    def _start_reaper(self) -> None:
        """Start the daemon thread that retires closed VBARs' models as their finalizers queue them."""
        with self._reaper_lock:
            if self._reaper is not None and self._reaper.is_alive():
                return
            self._reaper = threading.Thread(target=self._reap_forever, name="membackend-reaper", daemon=True)
            self._reaper.start()

    def _stop_reaper(self) -> None:
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
                self._retire_closed(*item)
            except Exception as exc:  # noqa: BLE001 - never let the reaper die: the next item is retired too
                log.warning("membackend: retiring a dropped model failed: %s: %s", type(exc).__name__, exc)

    def _retire_closed(self, model: Any, dev: Device) -> int:
        """Full unload and unregister a closed VBAR's model (1), or nothing to do (0). A failure (a fence whose
        copy failed, a driver error) is told and retried at the next quiescent point; a model the adapter no
        longer serves (stopped, or another retirement came first) is only forgotten."""
        name = self.display_name(model.id)
        self.names.pop(model.id, None)  # each ModelVBAR has an id of its own: nothing here outlives it
        self.weights.pop(model.id, None)
        self.last_used.pop(model.id, None)
        residency = self.residency
        if residency is None or self.session is None:
            return 0
        if self.fences is not None:
            self.fences.forget(model)
        try:
            if model not in residency.models():
                return 0
            unloaded = residency.full_unload_unless_pinned(model)
            residency.unregister(model)  # what was pinned goes too: the VBAR is closed, no unpin will come
        except Exception as exc:  # noqa: BLE001 - told, retried between nodes; ComfyUI is never stopped by it
            with self._lock:
                self._close_retry.append((model, dev))
            say(f"retiring the dropped model {model.id} failed, retried at the next node ({type(exc).__name__}: "
                f"{exc})", logging.WARNING)
            return 0
        if unloaded is None or not unloaded.alive:
            return 1
        entry = {"model": model.id, "device": str(dev), "bytes": unloaded.bytes, "reservations": unloaded.released,
                 "reserved_bytes": unloaded.reserved_bytes, "reason": "dropped by ComfyUI", "time": time.time(),
                 "name": name}
        with self._lock:
            self.unloads.append(entry)
            self.unload_count += 1
            self.dropped_count += 1
            self.dropped_bytes += unloaded.bytes
        say(f"{name} dropped by ComfyUI: {gb(unloaded.bytes)} freed, {unloaded.released} reservation(s) of "
            f"{gb(unloaded.reserved_bytes)} returned on {dev}")
        return 1

    # ------------------------------------------------------------------ status, stop

    def state(self) -> tuple[str, str]:
        """``(state, reason)`` for the status route."""
        if self.aborted is not None:
            return "switched-off", self.aborted
        if self.started:
            return "running", self.selection.reason
        if self.started is False:
            return "switched-off", "could not start"
        return "armed", "waiting for ComfyUI to initialise dynamic VRAM; if ComfyUI's start-up is over, it did " \
                        "not (torch or the device lacks dynamic VRAM support), and ComfyUI runs stock"

    def status(self) -> dict[str, Any]:
        """What ``GET /membackend/status`` answers while a runtime exists."""
        state, reason = self.state()
        with self._lock:  # appended from other threads: copied whole
            unloads = list(self.unloads)
        with self._loads_lock:
            loads, load_count, loaded_bytes = list(self.loads), self.load_count, self.loaded_bytes
        out: dict[str, Any] = {"version": __version__, "running": self.running, "state": state, "reason": reason,
                               "backend": self.name, "how": self.selection.how,
                               "selection_reason": self.selection.reason, "started": bool(self.started),
                               "aborted": self.aborted, "patched": self.patches.applied,
                               "not_present": list(self.patches.skipped),
                               "unloads": unloads, "unload_count": self.unload_count,
                               "idle": {"times": self.idles, "bytes": self.idle_bytes},
                               "how_to": HOW_TO, "line": _outcome.line if _outcome is not None else None,
                               "loads": loads, "load_count": load_count,
                               "loaded_bytes": loaded_bytes, "keep_warm": self.keep.enabled,
                               "delegates": self.delegates_held(),
                               "delegates_alive": len(list(self.delegate_modules))}
        if self.session is None or self.residency is None or self.started is False:
            return out  # not started, part-way through start, or a start that failed (its session closed)
        self.sample()
        budgets, held, headroom, windows = {}, {}, {}, {}
        for d in self.devices:
            b = self.session.budget_query(d)
            budgets[str(d)] = {"total": b.total, "free": b.free, "headroom": b.headroom, "usable": b.usable,
                               "source": b.source}
            try:  # the split under the headroom in force: the process's other use, the weights' room and resident
                split = self.session.room_split(d)
            except Exception as exc:  # noqa: BLE001 - the status never fails on it
                log.debug("membackend: the room split of %s for the status: %s: %s", d, type(exc).__name__, exc)
                split = None
            if split is not None:
                budgets[str(d)]["split"] = {"room": split.room, "other": split.other,
                                            "weights_room": split.weights_room, "weights_resident": split.resident,
                                            "kept": split.held - split.resident}
            value, source = self.headroom_in_force(d)
            lo, hi = self.headroom_range(d)
            headroom[str(d)] = {"bytes": value, "source": source, "live": source == LIVE_SOURCE,
                                "min": lo, "max": hi}
            try:  # what the backend keeps for reuse (kept address windows included); the status never fails on it
                inspected = self.session.inspect(d)
            except Exception as exc:  # noqa: BLE001
                log.debug("membackend: inspecting %s for the status failed: %s: %s", d, type(exc).__name__, exc)
                inspected = None
            if inspected is not None:
                held[str(d)] = {"held": inspected.held, "committed": committed_bytes(inspected),
                                "source": inspected.source, "hazards": inspected.hazards,
                                "calls": dict(inspected.calls or {})}
            kept = self._kept_windows(d)
            if kept is not None:
                windows[str(d)] = kept
        out["budgets"] = budgets
        out["kept"] = held
        #: per device, the released address windows a backend under a reserve-churn limit keeps (rocm_windows)
        out["kept_windows"] = windows
        out["reservations"] = [{"id": r.id, "device": str(r.device), "size": r.size, "page_size": r.page_size}
                               for r in self.session.reservations()]
        out["headroom"] = headroom
        out["models"] = self.model_details()
        #: per model id, what it lost since its last load (``ResidencyManager.losses``): recent evictions
        out["evictions"] = {k: dict(v) for k, v in list(self.policy().losses.items())}
        with self._lock:  # sample() appends from other threads
            out["history"] = {d: [list(x) for x in h] for d, h in self.history.items()}
        return out

    def _kept_windows(self, device: Device) -> dict[str, Any] | None:
        """What the backend says it keeps of released address windows on ``device`` (``kept_windows``: the vmm
        backend under a reserve-churn limit), with its line; None where it keeps none or cannot say."""
        report = getattr(self.session.backend, "kept_windows", None)
        if report is None:
            return None
        try:
            r = report(device)
        except Exception as exc:  # noqa: BLE001 - the status never fails on it
            log.debug("membackend: kept windows of %s for the status: %s: %s", device, type(exc).__name__, exc)
            return None
        if r is None:
            return None
        return {"windows": r.windows, "bytes": r.bytes, "largest": r.largest, "bound": r.bound,
                "bound_rule": r.bound_rule, "reason": r.reason, "give_back": r.give_back,
                "large_frees_spent": r.large_frees_spent, "large_frees_allowed": r.large_frees_allowed,
                "line": r.describe()}

    def model_details(self) -> dict[str, Any]:
        """Per model (by id): ``resident`` and ``reserved`` (``ResidencyManager.stats``), and ``name``,
        ``size`` (its weights' bytes, as ComfyUI staged them), ``address_range`` (the bytes of address space
        ComfyUI reserved for it, about ten times its size), ``device``, ``pinned`` and ``evictable`` bytes,
        ``state`` (``pinned``: a layer is in use now; ``warm``: every page of its weights resident; ``partly
        resident``; ``not resident``), ``held`` (kept warm by the adapter) and ``last_used`` (epoch seconds,
        None: not loaded by ComfyUI yet)."""
        held = {id(v._model) for p in list(self.keep.held.values())
                for v in (getattr(getattr(p, "model", None), "dynamic_vbars", None) or {}).values()
                if hasattr(v, "_model")}
        residency = self.policy()
        stats = residency.stats()
        out: dict[str, Any] = {}
        for m in residency.models():
            row = dict(stats.get(m.id, {"resident": 0, "reserved": False}))
            pinned = evictable = page = 0
            for dev in m.devices:
                slot = m.slots.get(dev)
                r = slot.reservation if slot is not None and slot.alive else None
                if r is None:
                    continue
                bits = residency.residency(m, dev)
                page = r.page_size
                pinned += sum(1 for x in bits if x & 2) * r.page_size
                evictable += sum(1 for x in bits if x == 1) * r.page_size
            resident = row["resident"]
            weights = self.weights.get(m.id, 0)
            whole = -(-weights // page) * page if weights and page else m.size  # the pages the weights span
            state = ("pinned" if pinned else "warm" if resident >= whole else "partly resident" if resident
                     else "not resident")
            row.update(name=self.display_name(m.id), size=self.weights.get(m.id, 0), address_range=m.size,
                       device=", ".join(map(str, m.devices)),
                       kind=m.kind.value, pinned=pinned, evictable=evictable, state=state, held=id(m) in held,
                       last_used=self.last_used.get(m.id))
            out[m.id] = row
        return out

    def _close_quietly(self) -> None:
        if self.session is not None:
            try:
                self.session.close()
            except Exception as exc:
                log.debug("membackend: closing the session after a failed start: %s", exc)

    def stop(self) -> None:
        """Undo everything (tests, or a host application shutting the adapter down).

        Every model is fully unloaded and the session closed, never under a tensor ComfyUI still reads: while
        a layer's tensor holds its range (from ``aimdo_to_tensor`` to the range's unpin, on another thread),
        that model keeps its range, and the unloads and the close run at that unpin."""
        self.patches.restore()
        self.keep.clear()
        _forget(self)
        self._stop_reaper()
        self.reap()  # the models dropped before the stop go now, through the residency, before it closes
        if self.session is not None:
            self.stopping = True
            self.finish_stop()

    def finish_stop(self) -> bool:
        """The unloads and the close of :meth:`stop`, unless a tensor still holds a range (then False: the
        facade's unpin that ends the hold calls this again, and logs what the close raises). Raises what the
        session's close raises (``PartialFailure``), as :meth:`stop` always has."""
        from ..types import TensorAlive

        with self._stop_lock:
            if not self.stopping:
                return True
            if self.residency is not None:
                try:
                    self.residency.unload_all()
                except PartialFailure as exc:
                    if any(isinstance(e, TensorAlive) for _, e in exc.failures):
                        if not self._stop_told:
                            self._stop_told = True
                            say("stopping: a model range is in use on another thread (a layer's tensor); it is "
                                "released, and the session closed, when that layer is done")
                        return False
                    log.warning("membackend: stopping: %s", exc)  # the close below tries those again
            self.stopping = False
            self.session.close()
            return True

"""The running adapter: the one :class:`Runtime` of this process, its G6 guard and the ``init_devices`` seam.

:func:`current` is the only place the adapter is held. :mod:`.startup` creates the
runtime before torch and arms it (:meth:`Runtime.arm`: ComfyUI's
``comfy_aimdo.control.init_devices`` becomes :meth:`Runtime.init_devices`); when
ComfyUI calls it, the runtime opens the session and the residency manager and
calls the ``wire`` function it was given (:func:`membackend._comfyui.wiring.wire`:
the facade, the buffers, the ``comfy.model_management`` patches). The facade and
the wiring find the runtime through :func:`current`; nothing here imports them.

**Its parts.** The runtime holds the session, the residency manager and the patches, and hands each other
responsibility to a part of its own: :class:`~.headroom.Headroom` (ComfyUI's memory flags and the live
cap), :class:`~.unloads.Unloader` (full unloads, put off while a page is pinned, and the models ComfyUI
dropped), :class:`~.delegates.HookDelegates` (G5), :class:`~.journal.Journal` (model names, the per-load
lines, the unloads) and :class:`~.history.History` (the panel's chart). The status answer is built where it
is served, in :mod:`.status`.

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

import importlib
import itertools
import logging
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..types import Device, PartialFailure, WrongDevice
from .classic import ClassicPath
from .delegates import HookDelegates
from .headroom import Headroom
from .history import History
from .journal import Journal, describe_load
from .keepwarm import KeepWarm
from .lines import gb, log, say
from .links import RuntimeLinks
from .patches import Patches
from .reuse import Reuse
from .unloads import Unloader

if TYPE_CHECKING:
    from .._manager import BackendManager, PluginRecord, Selection
    from .._residency import ResidencyManager
    from .streams import CopyFences

#: ``say``, ``gb`` and ``describe_load`` are the adapter's line writers (:mod:`.lines`, :mod:`.journal`), named
#: here too for the modules that log through the runtime
__all__ = ["Runtime", "Outcome", "current", "outcome", "say", "HOW_TO", "describe_load", "gb"]

HOW_TO = "MEMBACKEND_BACKEND=<name> forces another, MEMBACKEND_DISABLE=1 turns membackend off"
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
    """The adapter in one process: selection, session, policy, the patches, and the parts that keep the rest
    (see the module's docstring).

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
        self.vbars: weakref.WeakSet[Any] = weakref.WeakSet()  # the facade's live VBARs
        self.journal = Journal(self.vbars)
        self.history = History()
        self.delegates = HookDelegates()
        #: what the parts read of this runtime as it is now (they never hold the runtime)
        self.links = RuntimeLinks(residency=lambda: self.residency, fences=lambda: self.fences,
                                  aborted=lambda: self.aborted, vbars=self.vbars)
        self.headroom = Headroom(comfy_args, lambda: self.session, lambda: self.devices, self.links,
                                 self.device_named, self.residency_manager, self.sample)
        self.unloader = Unloader(self.links, self.journal, manager=self.residency_manager, session=lambda: self.session)
        self.classic = ClassicPath(self.links)  # wholly resident models on ComfyUI's classic path (issue 41)
        self.reuse = Reuse(self.links)  # weights already in VRAM copied on the device, not read again (issue 41)
        # the journal's records and the put-off unloads, under the names the wiring and the facade read and fill
        self.names, self.weights, self.last_used = self.journal.names, self.journal.weights, self.journal.last_used
        self.pending = self.unloader.pending
        self.started: bool | None = None  # None: init_devices not called yet
        self.aborted: str | None = None
        self._stop_lock = threading.Lock()  # stop() and the unpin that ends the last hold close once
        self.stopping = False  # stop() ran and the session is not closed yet (a tensor held a range)
        self._stop_told = False
        self._wire = wire
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._original_init: Callable[..., Any] | None = None
        self._reported: set[tuple[str, str]] = set()  # (where, error type) told once (report_once)
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
        self.headroom.apply_comfy_flags({self.device_for(index): int(extra) for index, extra in pairs})
        self.residency = ResidencyManager(self.session)
        self.residency.load_listeners.append(self.journal.on_load)
        keep = getattr(self.manager.settings, "keep_dropped", "auto")  # dropped models' weights kept as cache
        self.residency.cache_limit = None if keep == "auto" else 0 if keep == "off" else int(keep)
        self.reuse.enabled = self.residency.cache_limit != 0
        self.fences = CopyFences(self.residency)
        control = importlib.import_module("comfy_aimdo.control")
        for level in AIMDO_LOG_LEVELS:  # main.py calls one right after we answer True
            self.patches.replace(control, f"set_log_{level}", aimdo_log_noop, required=False)
        self._wire(self)
        self.unloader.start_reaper()
        skipped = f"; not in this ComfyUI: {', '.join(self.patches.skipped)}" if self.patches.skipped else ""
        say(f"started {self.name} on {', '.join(map(str, self.devices))}; {len(self.patches.applied)} patch "
            f"point(s){skipped}")

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

    def sample(self, force: bool = False, coalesce: bool = False) -> None:
        """Add one history sample per served device (:meth:`History.sample <.history.History.sample>`)."""
        self.history.sample(self.session, self.devices, force, coalesce)

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
        # outside the runtime's lock: letting go of held pages takes the residency manager's
        try:
            self.classic.demote_all("membackend switched off")  # their layers cast from ComfyUI's own copy again
        except Exception as undo:  # noqa: BLE001 - already off; say what stayed
            log.warning("membackend: putting the classic-path models back after switching off: %s", undo)

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

    def residency_manager(self) -> ResidencyManager:
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
        """Full unload of a VBAR's model (G1), now when nothing is pinned, else at the next quiescent point
        (:meth:`Unloader.unload <.unloads.Unloader.unload>`)."""
        self.unloader.unload(vbar, reason, earlier)

    def cancel_put_off(self, vbar: Any) -> None:
        """The VBAR is used again (or gone): its put-off unload is cancelled (cheap when nothing waits)."""
        self.unloader.cancel_put_off(vbar)

    def close_vbar(self, vbar: Any) -> None:
        """``vbar`` was closed: its model is fully unloaded and unregistered, now or by the reaper thread
        (:meth:`Unloader.close <.unloads.Unloader.close>`)."""
        self.unloader.close(vbar)

    def quiescent(self) -> None:
        """Between nodes: retire the closed VBARs' models still waiting, run the full unloads that waited for
        pins to go, and close the run's load records."""
        self.unloader.reap()  # what the reaper has not retired yet (none runs in a runtime made without start())
        self.unloader.run_put_off()
        self.unloader.forget_cached()  # the names of cached models that went
        self.headroom.refit()  # a cap or budget drop that had to wait for a model's run to end
        self.journal.close_loads(self.residency)  # the node that loaded its models is done: one line per load
        self.sample()

    def idle(self) -> int:
        """ComfyUI's prompt queue emptied: the backend gives back what it keeps for reuse
        (``ResidencyManager.on_idle``); resident models stay resident (G4). Returns the bytes given back."""
        if self.residency is None or self.aborted is not None:
            return 0
        given = self._give_back("prompt queue empty")
        self.headroom.refit(every=True)  # no run now: what a run kept over a cap, or a budget drop, goes
        self.journal.idled(given)
        return given

    def give_back(self) -> int:
        """Everything was unloaded: the backend gives back what it keeps for reuse (``ResidencyManager.on_idle``:
        recycled handles, kept address windows), so the memory the driver holds is back at its start-up
        value. Returns the bytes given back."""
        return self._give_back("every model unloaded") if self.residency is not None else 0

    def _give_back(self, why: str) -> int:
        given = self.residency_manager().on_idle()
        self.sample(force=True)
        if given:
            say(f"{why}: gave back {gb(given)} the backend kept for reuse")
        return given

    # ------------------------------------------------------------------ stop

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
        self.unloader.stop_reaper()
        self.unloader.reap()  # the models dropped before the stop go now, through the residency, before it closes
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
